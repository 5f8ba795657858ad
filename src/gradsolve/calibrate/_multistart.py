"""Starting points for multistart fits: quasi-random designs over a box (SciPy's qmc)."""

import jax
import jax.numpy as jnp
import numpy as np
from scipy.stats import qmc


SCALES = ("lin", "log", "log10")
METHODS = ("sobol", "lhs")


def multistart(lo, hi, n_starts, key, scale="log", method="sobol"):
    """`n_starts` starting points spread over the box `[lo, hi]`, as a `theta0`.

    The points are a scrambled Sobol sequence (`method="sobol"`) or a Latin hypercube
    (`"lhs"`), from SciPy's `qmc`, over all entries of all leaves at once, seeded from
    `key`. On a `"log"` (or `"log10"`: the same points) scale they are uniform in
    log(theta), so a rate bounded by 1e-3 and 1e3 is as often near 0.01 as near 10.

    Args:
        lo, hi: pytrees of the same structure, leaves scalars or arrays: the bounds
            of each entry of one fit's theta.
        n_starts: number of starting points (a power of two keeps Sobol's balance).
        key: a `jax.random` key.
        scale: `"lin"`, `"log"` or `"log10"`, for every leaf or a pytree matching lo.
        method: `"sobol"` or `"lhs"`.

    Returns:
        `lo`'s structure with each leaf shaped `(n_starts, *leaf.shape)`.

    Examples:
        >>> import jax, gradsolve as gs
        >>> theta0 = gs.multistart({"k": 1e-3, "y0": 0.0}, {"k": 1e3, "y0": 2.0}, 32,
        ...                        jax.random.key(0), scale={"k": "log", "y0": "lin"})
        >>> theta0["k"].shape, bool((theta0["k"] > 1e-3).all() & (theta0["k"] < 1e3).all())
        ((32,), True)
    """
    if isinstance(n_starts, bool) or not isinstance(n_starts, (int, np.integer)) \
            or n_starts < 1:
        raise ValueError(f"n_starts must be a positive integer, got {n_starts!r}")
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    lo_leaves, treedef = jax.tree_util.tree_flatten_with_path(lo)
    hi_leaves = jax.tree.leaves(hi)
    if jax.tree.structure(hi) != jax.tree.structure(lo):
        raise ValueError(f"hi must have lo's structure {jax.tree.structure(lo)}, got "
                         f"{jax.tree.structure(hi)}")
    scales = [scale] * len(lo_leaves) if isinstance(scale, str) else _per_leaf(scale, lo)
    boxes = []
    for (path, a), b, s in zip(lo_leaves, hi_leaves, scales):
        leaf = jax.tree_util.keystr(path)
        name = f"lo/hi{leaf}"
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        if a.shape != b.shape:
            raise ValueError(f"{name}: lo has shape {a.shape}, hi {b.shape}")
        if s not in SCALES:
            raise ValueError(f"scale of {leaf or 'theta'} must be one of {SCALES}, "
                             f"got {s!r}")
        if not np.all(np.isfinite(a) & np.isfinite(b) & (b > a)):
            raise ValueError(f"{name}: every entry needs finite lo < hi, got lo={a}, hi={b}")
        if s != "lin" and not np.all(a > 0):
            raise ValueError(f"{name}: a {s} scale needs lo > 0, got lo={a}")
        boxes.append((a, b, s))
    dim = sum(a.size for a, _, _ in boxes)
    seed = int(jax.random.randint(key, (), 0, np.iinfo(np.int32).max))
    engine = (qmc.Sobol(dim, scramble=True, seed=seed) if method == "sobol"
              else qmc.LatinHypercube(dim, seed=seed))
    unit = engine.random(n_starts)  # (n_starts, dim) in [0, 1)
    out, column = [], 0
    for a, b, s in boxes:
        x = unit[:, column:column + a.size].reshape((n_starts,) + a.shape)
        column += a.size
        if s == "lin":
            v = a + (b - a) * x
        else:
            v = np.exp(np.log(a) + (np.log(b) - np.log(a)) * x)
        out.append(jnp.asarray(np.clip(v, a, b), jnp.result_type(float)))
    return jax.tree.unflatten(treedef, out)


def _per_leaf(scale, lo):
    try:
        return jax.tree.leaves(jax.tree.map(lambda s, _: s, scale, lo))
    except (ValueError, TypeError) as e:
        raise ValueError(f"scale must be one string or a pytree matching lo's structure "
                         f"{jax.tree.structure(lo)} ({e})") from None
