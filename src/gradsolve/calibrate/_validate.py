"""The Calibrator's checks of its inputs, run before anything is compiled: each
refusal names the argument, the leaf or index, and what was expected."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from . import _fingerprint, _transforms


def check_tol(name, value):
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, np.number)) \
            or np.ndim(value) or not value >= 0:
        raise ValueError(f"{name} must be None or a number >= 0, got {value!r}")
    return float(value)


def check_data(data):
    """Every floating leaf of `data` finite: a NaN measurement would stop its fit at
    step 0 as non-finite, pointing nowhere near the data."""
    for path, x in jax.tree_util.tree_leaves_with_path(data):
        if not (eqx.is_array(x) or isinstance(x, np.ndarray)) \
                or not np.issubdtype(np.asarray(x).dtype, np.inexact):
            continue
        x = np.asarray(x)
        bad = ~np.isfinite(x)
        if bad.any():
            at = np.unravel_index(int(np.argmax(bad)), x.shape)
            raise ValueError(
                f"data{jax.tree_util.keystr(path)} holds a non-finite value ({x[at]}) at "
                f"index {tuple(int(i) for i in at)} ({int(bad.sum())} in all); missing "
                f"measurements are not taken as NaN: fill them with any finite value and "
                f"weight them out in the loss with a mask passed in data (e.g. "
                f"jnp.sum(d['mask'] * (ys - d['obs']) ** 2))")


def check_theta_dtype(theta0, dtype, how):
    """Every floating leaf of theta0 in the fit's dtype (`how`: what else would do)."""
    for p, x in jax.tree_util.tree_leaves_with_path(theta0):
        if eqx.is_inexact_array(x) and x.dtype != dtype:
            raise TypeError(f"theta0{jax.tree_util.keystr(p)} has dtype {x.dtype} but the "
                            f"problem is {np.dtype(dtype).name} (its y0){how}: give theta0 "
                            f"in {np.dtype(dtype).name}")


def check_optimizer(optimizer, u_b):
    """`optimizer.init(u)` and `optimizer.update(grads, state, u)` of one fit, traced
    abstractly (`u_b`: its unconstrained parameters, as `jax.ShapeDtypeStruct`s), as
    the update calls them. A transformation whose update needs optax's extra arguments
    (`value`, `grad`, `value_fn`: `optax.lbfgs`'s line search) is refused by name."""
    def trial(**extra):
        def one(u):
            kw = {k: v(u) for k, v in extra.items()}
            return optimizer.update(u, optimizer.init(u), u, **kw)
        return jax.eval_shape(one, u_b)

    def value(u):
        return sum(jnp.sum(x) for x in jax.tree.leaves(u))
    extra = {"value": value, "grad": lambda u: u, "value_fn": lambda u: value}
    try:
        trial()
        return
    except Exception as e:  # noqa: BLE001 - named below, or re-raised with the inputs
        error = e
    try:
        trial(**extra)
    except Exception:  # noqa: BLE001 - not for want of the extra arguments
        raise TypeError(f"optimizer.init/update failed on fit 0's parameters "
                        f"{_fingerprint.array_shapes(u_b)}: {type(error).__name__}: {error}") from error
    needed = []
    for name in sorted(extra):
        try:
            trial(**{k: v for k, v in extra.items() if k != name})
        except Exception:  # noqa: BLE001 - this one is needed
            needed.append(name)
    raise TypeError(
        f"optimizer.update needs the extra arguments {needed or sorted(extra)} (an "
        f"optax.GradientTransformationExtraArgs such as optax.lbfgs's line search): not "
        f"yet supported by the Calibrator, which calls update(grads, state, params); use a "
        f"first-order transformation (optax.adam, optax.sgd, or an optax.chain of them)")


def check_grid(transform, name, path, grid):
    """A profile's grid: not empty, finite, inside the transform's domain of its leaf."""
    if grid.size == 0:
        raise ValueError(f"grid is empty: give at least one value to fix {name!r} at")
    if not np.isfinite(grid).all():
        raise ValueError(f"grid must hold finite values, got {grid}")
    t = _transforms.for_path(transform, path)
    bad = np.flatnonzero(~np.isfinite(np.asarray(t.inverse(jnp.asarray(grid)))))
    if bad.size:
        raise ValueError(f"grid[{bad[0]}] = {grid[bad[0]]} is outside the domain of "
                         f"theta[{name!r}]'s transform {t} (grid points {bad[:10].tolist()})")


def check_domain(transform, theta0, u0):
    """Every theta0 value inside its transform's domain (a NaN in u names it)."""
    for (p, x), t in zip(jax.tree_util.tree_leaves_with_path(theta0), jax.tree.leaves(u0)):
        if not eqx.is_inexact_array(t):
            continue
        B = np.shape(t)[0]
        bad = ~np.isfinite(np.asarray(t)).reshape(B, -1).all(axis=1)
        if bad.any():
            b = int(np.flatnonzero(bad)[0])
            raise ValueError(
                f"theta0{jax.tree_util.keystr(p)} of fit {b} ({np.asarray(x)[b]}) is "
                f"outside the domain of its transform {_transforms.for_path(transform, p)} "
                f"(fits {np.flatnonzero(bad)[:10].tolist()})")
