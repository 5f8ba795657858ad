"""Ensemble problems: the six-member protocol, `Shared` parameters and validation.

Every public entry point passes its problem through `as_problem`, which checks the
input and names the offending field before anything is traced or compiled.
"""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import jaxprs_in_params


class Shared(eqx.Module):
    """Marks a parameter subtree common to every trajectory (an Equinox MLP, say).

    Leaves inside `Shared` carry no ensemble axis. The right-hand side receives the
    wrapped value itself (not the wrapper), and its gradient sums over trajectories.

    Examples:
        >>> import jax.numpy as jnp, gradsolve as gs
        >>> p = {"rate": jnp.ones(4), "scale": gs.Shared(jnp.array(2.0))}
        >>> f = lambda t, y, p: -p["rate"] * p["scale"] * y
        >>> prob = gs.EnsembleProblem(f_jax=f, y0=jnp.ones((4, 1)), params=p,
        ...                           t_span=(0.0, 1.0))
        >>> prob.n, prob.d
        (4, 1)
    """

    value: Any


def _is_shared(x) -> bool:
    return isinstance(x, Shared)


def unwrap_shared(params):
    """`params` with each `Shared(x)` replaced by `x` (what `f_jax` receives)."""
    return jax.tree.map(lambda x: x.value if _is_shared(x) else x, params,
                        is_leaf=_is_shared)


def network_size(params) -> int:
    """How many numbers one trajectory's networks hold: every array in a `Shared`
    subtree (a network common to the ensemble: its weights), and per trajectory the
    arrays of any other Equinox module among `params` (a network per trajectory, made
    with `eqx.filter_vmap`: its leaves lead with n). Plain per-trajectory arrays (rate
    constants, a PEtab model's parameters) are not counted."""
    def arrays(tree):
        return [x for x in jax.tree.leaves(tree) if eqx.is_array(x)]
    total = 0
    for node in jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, eqx.Module)):
        if _is_shared(node):
            total += sum(int(np.size(x)) for x in arrays(node.value))
        elif isinstance(node, eqx.Module):
            total += sum(int(np.size(x)) // max(int(np.shape(x)[0]), 1)
                         for x in arrays(node) if np.ndim(x))
    return total


def evaluation_size(prob) -> int:
    """How many numbers one evaluation of the field computes for one trajectory: every
    intermediate of its jaxpr (nested calls included). A replay without remat keeps
    what the backward sweep needs of each stage -- at most this -- for every step;
    a network's hidden activations make it far more than the state's d numbers."""
    def size(jaxpr) -> int:
        total = 0
        for eqn in jaxpr.eqns:
            total += sum(int(np.prod(v.aval.shape)) for v in eqn.outvars
                         if hasattr(v.aval, "shape"))
            for sub in jaxprs_in_params(eqn.params):
                total += size(sub)
        return total
    closed = eqx.filter_make_jaxpr(prob.f_one)(*_one_trajectory(prob))[0]
    return max(size(closed.jaxpr), prob.d)


def field(f_jax):
    """`f_jax` with `Shared` wrappers removed from its parameters: the right-hand side
    the steps call (`EnsembleProblem.f_one` is this for the problem's own `f_jax`)."""
    return lambda t, y, p: f_jax(t, y, unwrap_shared(p))


def param_axes(params):
    """`vmap` axes for `params`: 0 for per-trajectory leaves, None inside `Shared`."""
    def axis(x):
        if _is_shared(x):
            return None
        return 0 if eqx.is_array(x) else None
    return jax.tree.map(axis, params, is_leaf=_is_shared)


def trajectory_params(params, i):
    """The parameters of trajectory `i` (shared subtrees as they are)."""
    def take(x):
        if _is_shared(x) or not eqx.is_array(x):
            return x
        return x[i]
    return jax.tree.map(take, params, is_leaf=_is_shared)


@eqx.filter_jit
def rows_of(y0, params, rows):
    """Trajectories `rows` (an integer array): their initial states and parameters
    (`gs.Shared` subtrees as they are), as one compiled program; run eagerly, the take
    of each leaf compiled a small program of its own."""
    return y0[rows], trajectory_params(params, rows)


class EnsembleProblem(eqx.Module):
    """n independent trajectories of one ODE, each with its own state and parameters.

    Args:
        f_jax: right-hand side of ONE trajectory, `f_jax(t, y, params) -> dy/dt` with
            `y` of shape `(d,)`.
        y0: initial states, shape `(n, d)`, floating point, finite.
        params: a pytree whose array leaves lead with `n`, except subtrees wrapped in
            `gs.Shared(...)`, common to all trajectories. `None` for no parameters.
            Callable leaves (an Equinox MLP's activation) are code, not data: they
            pass to every trajectory as they are. Floating leaves have `y0`'s dtype.
        t_span: `(t0, t1)` with `t1 > t0`, shared by all trajectories; stored as
            Python floats (it is static: part of what a compiled solve is keyed on).
        stiff: whether the problem is stiff (selects a stiff method).
        name: a name for results, checkpoints and the router's reports.
        fused: translate this right-hand side into the fused (Warp) form even though
            it is not registered (see `gs.register_field`).

    Examples:
        >>> import jax.numpy as jnp, gradsolve as gs
        >>> prob = gs.EnsembleProblem(
        ...     f_jax=lambda t, y, k: -k * y, y0=jnp.ones((3, 2)),
        ...     params=jnp.array([0.5, 1.0, 2.0]), t_span=(0.0, 1.0), name="decay")
        >>> prob.n, prob.d, prob.name
        (3, 2, 'decay')
    """

    f_jax: Callable = eqx.field(static=True)
    y0: jax.Array = eqx.field(converter=lambda x: _as_array(x, "y0"))
    params: Any
    t_span: tuple[float, float] = eqx.field(static=True, converter=lambda x: _as_span(x))
    stiff: bool = eqx.field(static=True, default=False)
    name: str = eqx.field(static=True, default="problem")
    fused: bool = eqx.field(static=True, default=False)

    def __check_init__(self):
        _validate(self)

    @property
    def n(self) -> int:
        return self.y0.shape[0]

    @property
    def d(self) -> int:
        return self.y0.shape[1]

    def f_one(self, t, y, params):
        """`f_jax` with `Shared` wrappers removed (see `field`)."""
        return field(self.f_jax)(t, y, params)

    def replace(self, **changes) -> "EnsembleProblem":
        """A copy with some members changed (validated again)."""
        fields = dict(f_jax=self.f_jax, y0=self.y0, params=self.params,
                      t_span=self.t_span, stiff=self.stiff, name=self.name,
                      fused=self.fused)
        fields.update(changes)
        return EnsembleProblem(**fields)


def _as_array(x, where):
    if eqx.is_array(x):
        return jnp.asarray(x)
    try:
        return jnp.asarray(x)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{where} must be an array, got {type(x).__name__}") from e


def _as_span(t_span):
    """`t_span` as a pair of Python floats (JAX or NumPy scalars are unhashable or
    compare elementwise, and the span is static); anything else is left for
    `_validate` to refuse by name."""
    try:
        t0, t1 = t_span
        return (float(t0), float(t1))
    except (TypeError, ValueError):
        return t_span


_MEMBERS = ("name", "f_jax", "y0", "params", "t_span", "stiff")


def as_problem(prob) -> EnsembleProblem:
    """Validate any object with the six problem members and return an
    `EnsembleProblem`; raises `TypeError`/`ValueError` naming the bad field."""
    if isinstance(prob, EnsembleProblem):
        return prob
    missing = [m for m in _MEMBERS if not hasattr(prob, m)]
    if missing:
        raise TypeError(
            f"a problem needs the members {_MEMBERS}; {type(prob).__name__} lacks "
            f"{missing}")
    return EnsembleProblem(
        f_jax=prob.f_jax, y0=prob.y0, params=prob.params, t_span=prob.t_span,
        stiff=prob.stiff, name=prob.name, fused=getattr(prob, "fused", False))


def _validate(prob: EnsembleProblem):
    if not isinstance(prob.name, str):
        raise TypeError(f"name must be a str, got {type(prob.name).__name__}")
    if not callable(prob.f_jax):
        raise TypeError(
            f"f_jax must be callable as f_jax(t, y, params), got "
            f"{type(prob.f_jax).__name__}")
    if not isinstance(prob.stiff, (bool, np.bool_)):
        raise TypeError(f"stiff must be a bool, got {prob.stiff!r}")
    y0 = prob.y0
    if not eqx.is_array(y0):
        raise TypeError(f"y0 must be an array of shape (n, d), got {type(y0).__name__}")
    if y0.ndim != 2 or 0 in y0.shape:
        raise ValueError(f"y0 must have shape (n, d) with n, d >= 1, got {y0.shape}")
    if not jnp.issubdtype(y0.dtype, jnp.floating):
        raise TypeError(f"y0 must be floating point, got dtype {y0.dtype}")
    traced = isinstance(y0, jax.core.Tracer)  # under jit or grad: no values to check
    bad = np.zeros(1, bool) if traced else ~np.isfinite(np.asarray(y0)).all(axis=1)
    if bad.any():
        raise ValueError(
            f"y0 holds non-finite values (NaN or inf) in trajectories "
            f"{np.flatnonzero(bad)[:10].tolist()}")
    t_span = prob.t_span
    try:
        t0, t1 = (float(t) for t in t_span)
    except (TypeError, ValueError):
        raise TypeError(f"t_span must be a pair of real numbers (t0, t1), got {t_span!r}")
    if not (np.isfinite(t0) and np.isfinite(t1)):
        raise ValueError(f"t_span must be finite, got {t_span!r}")
    if not t1 > t0:
        raise ValueError(f"t_span must have t1 > t0, got t0={t0}, t1={t1}")
    n = y0.shape[0]
    leaves = jax.tree_util.tree_leaves_with_path(prob.params, is_leaf=_is_shared)
    for path, leaf in leaves:
        where = "params" + jax.tree_util.keystr(path)
        if _is_shared(leaf):
            _check_finite(leaf.value, where)
            continue
        if _is_code(leaf):
            continue
        if not eqx.is_array(leaf):
            raise TypeError(
                f"{where} must be an array leading with n={n} (wrap values common to "
                f"all trajectories in gs.Shared), got {type(leaf).__name__}")
        if leaf.ndim == 0 or leaf.shape[0] != n:
            raise ValueError(
                f"{where} has shape {leaf.shape}; per-trajectory parameters lead with "
                f"n={n} (wrap values common to all trajectories in gs.Shared)")
        _check_finite(leaf, where)
    _check_dtypes(prob)
    _check_field_shape(prob)


def _is_code(leaf) -> bool:
    """A callable leaf that is not an array (an Equinox MLP's activation function):
    code carried inside the parameters, the same for every trajectory. `param_axes`
    and `trajectory_params` pass it on unbatched, and every transformation that
    parameters cross sees only their arrays (`eqx.filter_*`, `eqx.partition`)."""
    return callable(leaf) and not eqx.is_array(leaf)


def _check_dtypes(prob: EnsembleProblem):
    """The dtype rule, in one place: the ensemble is integrated in `y0`'s floating
    dtype, and every floating parameter must already have it. Mixed dtypes are
    refused, not promoted: promotion would silently move a float32 problem to
    float64 (or the fused kernels would silently run float32 parameters)."""
    dtype = prob.y0.dtype
    for path, leaf in jax.tree_util.tree_leaves_with_path(unwrap_shared(prob.params)):
        if eqx.is_inexact_array(leaf) and leaf.dtype != dtype:
            raise TypeError(
                f"params{jax.tree_util.keystr(path)} has dtype {leaf.dtype} but y0 has "
                f"{dtype}: floating parameters must have y0's dtype (cast one of them, "
                f"or pass dtype= to gs.solve)")


def _check_finite(tree, where):
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        if isinstance(leaf, jax.core.Tracer):
            continue  # traced (under jit or grad): no values to check; gs.solve says why
        if eqx.is_inexact_array(leaf) and not np.isfinite(np.asarray(leaf)).all():
            raise ValueError(f"{where}{jax.tree_util.keystr(path)} holds non-finite values")


def _one_trajectory(prob: EnsembleProblem):
    """`(t, y, params)` of one trajectory as `jax.ShapeDtypeStruct`s (`gs.Shared`
    values as they are), to trace the field with: taking trajectory 0's values
    eagerly compiled a small program per leaf shape."""
    def one(x):
        return jax.ShapeDtypeStruct(np.shape(x)[1:], x.dtype) if eqx.is_array(x) else x
    params = jax.tree.map(lambda x: x if _is_shared(x) else one(x), prob.params,
                          is_leaf=_is_shared)
    dtype = prob.y0.dtype
    return jax.ShapeDtypeStruct((), dtype), jax.ShapeDtypeStruct(prob.y0.shape[1:], dtype), \
        params


def _check_field_shape(prob: EnsembleProblem):
    """Trace `f_jax` once on trajectory 0 (abstractly: nothing runs or compiles)."""
    t, y, p = _one_trajectory(prob)
    try:
        out = eqx.filter_eval_shape(prob.f_one, t, y, p)
    except Exception as e:
        raise TypeError(
            f"f_jax(t, y, params) failed on one trajectory (t scalar, y of shape "
            f"{y.shape}): {type(e).__name__}: {e}") from e
    if not hasattr(out, "shape") or out.shape != y.shape:
        raise ValueError(
            f"f_jax must return dy/dt of shape {y.shape} for one trajectory, got "
            f"{getattr(out, 'shape', type(out).__name__)}")
    if out.dtype != y.dtype:
        raise TypeError(
            f"f_jax must return dy/dt of y0's dtype {y.dtype}, got {out.dtype}")
