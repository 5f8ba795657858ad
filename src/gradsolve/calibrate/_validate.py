"""The Calibrator's checks of its inputs, run before anything is compiled: each
refusal names the argument, the leaf or index, and what was expected."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

from ..problem import _is_shared as is_shared, unwrap_shared
from . import _fingerprint, _least_squares, _transforms


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
    the update calls them: with optax's extra arguments (`value`, `grad`, `value_fn`:
    `optax.lbfgs`'s line search), which transformations that take none ignore
    (`optax.with_extra_args_support`). A failure is raised naming the parameters."""
    if _least_squares.is_optimistix(optimizer):
        try:
            _least_squares.fingerprint_jaxpr(optimizer, u_b)
        except Exception as e:  # noqa: BLE001 - re-raised with the inputs named
            raise TypeError(f"optimizer {type(optimizer).__name__} failed on fit 0's "
                            f"parameters {_fingerprint.array_shapes(u_b)}: "
                            f"{type(e).__name__}: {e}") from e
        return
    extra_args = optax.with_extra_args_support(optimizer)

    def value(u):
        return sum(jnp.sum(x) for x in jax.tree.leaves(u))

    def one(u):
        return extra_args.update(u, optimizer.init(u), u, value=value(u), grad=u,
                                 value_fn=value)
    try:
        jax.eval_shape(one, u_b)
    except Exception as e:  # noqa: BLE001 - re-raised with the inputs named
        raise TypeError(f"optimizer.init/update failed on fit 0's parameters "
                        f"{_fingerprint.array_shapes(u_b)}: {type(e).__name__}: {e}") from e


def check_grid(transform, name, path, grid):
    """A profile's grid: not empty, finite, inside the transform's domain of its leaf."""
    if grid.size == 0:
        raise ValueError(f"grid is empty: give at least one value to fix {name!r} at")
    if not np.isfinite(grid).all():
        raise ValueError(f"grid must hold finite values, got {grid}")
    t = _transforms.for_path(transform, path)
    bad = np.flatnonzero(~np.isfinite(np.asarray(
        _transforms.apply_compiled(t, np.asarray(grid), "inverse"))))
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


# -- a fit's theta0 against the Calibrator's settings (`cal`), before `fit` compiles --


def with_fit_axis(cal, theta0):
    """`theta0` as `fit` works on it: leaves leading with B. A one-fit Calibrator's
    (the class's "One fit") gets B = 1, from the problem's shared values when None."""
    if not cal.one_fit:
        if theta0 is None:
            raise ValueError(
                "theta0 is required: a pytree whose array leaves lead with the number "
                "of fits B (it defaults to the problem's own values only for one fit "
                "over a problem whose params are all gs.Shared, without to_params)")
        return theta0
    values = unwrap_shared(cal.problem.params)
    if theta0 is None:
        theta0 = values

    def shapes(tree):
        return {jax.tree_util.keystr(p): list(np.shape(x))
                for p, x in jax.tree_util.tree_leaves_with_path(tree)
                if eqx.is_array(x) or isinstance(x, np.ndarray)}
    if shapes(theta0) != shapes(values):
        raise ValueError(
            "theta0 of one fit over the problem's gs.Shared parameters must be shaped "
            "as their values, without a fit axis (or None: start from them); expected "
            f"{shapes(values)}, got {shapes(theta0)}")
    return _lead_with_one(theta0)


@eqx.filter_jit
def _lead_with_one(tree):
    """`tree`'s arrays (JAX's or NumPy's) with a leading axis of 1, in one compiled
    program: one eager slice per leaf compiled a program each (8 for an MLP, 0.18 s of
    the neural ODE example's first update)."""
    return jax.tree.map(lambda x: x[None] if eqx.is_array(x) else x, tree)


def check_fit(cal, theta0, steps):
    """`steps` and `theta0` (leaves leading with B) against the Calibrator's problem,
    data, transform, minibatch size, `to_params`, `to_y0`, loss and optimizer, traced
    abstractly: `(B, K)`, the fits and each fit's trajectories."""
    if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < 1:
        raise ValueError(f"steps must be a positive integer, got {steps!r}")
    paths = [(p, x) for p, x in jax.tree_util.tree_leaves_with_path(theta0)
             if eqx.is_array(x)]
    if not paths:
        raise ValueError("theta0 must hold at least one array leaf leading with B")
    for p, x in paths:
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"theta0{jax.tree_util.keystr(p)} has dtype {x.dtype}; "
                            f"fitted parameters must be floating point (e.g. 1.0, not 1)")
    if cal.to_params is None:  # theta is broadcast to the parameters as it is
        check_theta_dtype(theta0, cal.problem.y0.dtype, "")
    sizes = {np.shape(x)[0] if np.ndim(x) else None for _, x in paths}
    if len(sizes) != 1 or None in sizes:
        raise ValueError(f"every array leaf of theta0 must lead with the number of "
                         f"fits B; got leading sizes {sorted(map(str, sizes))}")
    B = sizes.pop()
    n = cal.problem.n
    if n % B:
        raise ValueError(f"the problem's n={n} trajectories do not split into B={B} "
                         f"fits of equal size")
    for p, x in paths:
        bad = ~np.isfinite(np.asarray(x)).reshape(B, -1).all(axis=1)
        if bad.any():
            raise ValueError(f"theta0{jax.tree_util.keystr(p)} holds non-finite values "
                             f"(fits {np.flatnonzero(bad)[:10].tolist()})")
    if cal.data is not None:
        for path, x in jax.tree_util.tree_leaves_with_path(cal.data):
            if np.shape(x)[:1] != (B,):
                raise ValueError(f"data{jax.tree_util.keystr(path)} must lead with "
                                 f"the number of fits theta0's leaves lead with, B={B}, "
                                 f"got shape {np.shape(x)}")
    _transforms.check(cal.transform, theta0)
    if cal.batch_size is not None:
        if cal.batch_size > n // B:
            raise ValueError(f"batch_size={cal.batch_size} is more than a fit's "
                             f"K={n // B} trajectories")
        for path, x in jax.tree_util.tree_leaves_with_path(cal.data):
            if np.shape(x)[:2] != (B, n // B):  # one fit: data given without its B
                want, shape = ((f"the fit's n={n} trajectories", np.shape(x)[1:])
                               if cal.one_fit else
                               (f"(B, K) = ({B}, {n // B})", np.shape(x)))
                raise ValueError(
                    f"with batch_size, data{jax.tree_util.keystr(path)} must lead with "
                    f"{want} (a minibatch takes each fit's data of its drawn "
                    f"trajectories), got shape {shape}")
    check_to_params(cal, theta0, n // B)
    check_to_y0(cal, theta0, n // B)
    check_loss(cal, theta0, n // B)
    theta_b = _fit0(theta0)
    check_optimizer(cal.optimizer, eqx.filter(theta_b, lambda x: isinstance(
        x, jax.ShapeDtypeStruct) and jnp.issubdtype(x.dtype, jnp.inexact)))
    return B, n // B


def _fit0(theta0):
    """Fit 0's theta, abstractly (`jax.ShapeDtypeStruct` leaves), for the checks'
    traces: an eager `x[0]` per leaf compiled a small program per shape."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x)[1:], x.dtype)
                        if eqx.is_array(x) else x, theta0)


def check_loss(cal, theta0, K):
    """`loss` on fit 0's outputs, theta and data, traced abstractly: one real
    number. The outputs are `(K, d)`, or `(K, len(ts), d)` (`batch_size` rows for a
    minibatch) in the problem's dtype, as every engine's replay gives them."""
    theta_b = _fit0(theta0)
    rows = K if cal.batch_size is None else cal.batch_size
    ts = () if cal.config.ts is None else (len(cal.config.ts),)
    ys_b = jax.ShapeDtypeStruct((rows,) + ts + (cal.problem.d,), cal.problem.y0.dtype)
    # A fit's data: leaves without their B; a minibatch's, its rows of (B, K, ...).
    cut = (lambda s: s[1:]) if cal.batch_size is None else (lambda s: (rows,) + s[2:])
    data_b = None if cal.data is None else jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(cut(np.shape(x)), np.asarray(x).dtype)
        if eqx.is_array(x) or isinstance(x, np.ndarray) else x, cal.data)
    shown = f"ys_b {np.dtype(ys_b.dtype).name}{list(ys_b.shape)}"
    try:
        got = eqx.filter_eval_shape(cal.loss, ys_b, theta_b, data_b)
    except Exception as e:
        raise TypeError(f"loss(ys_b, theta_b, data_b) failed on fit 0's inputs ({shown}): "
                        f"{type(e).__name__}: {e}") from e
    if not (isinstance(got, jax.ShapeDtypeStruct) and got.shape == ()
            and jnp.issubdtype(got.dtype, jnp.floating)):
        what = (f"{np.dtype(got.dtype).name}{list(got.shape)}"
                if isinstance(got, jax.ShapeDtypeStruct) else type(got).__name__)
        raise ValueError(f"loss must return a scalar per fit (shape ()); loss(ys_b, "
                         f"theta_b, data_b) returned {what} for {shown}: sum or average "
                         f"over the fit's trajectories and times")


def check_to_y0(cal, theta0, K):
    """`to_y0` on fit 0's theta, traced abstractly: `(K, d)` in the problem's dtype."""
    if cal.to_y0 is None:
        return
    theta_b = _fit0(theta0)
    try:
        got = eqx.filter_eval_shape(cal.to_y0, theta_b)
    except Exception as e:
        raise TypeError(f"to_y0(theta_b) failed on fit 0's theta: {type(e).__name__}: "
                        f"{e}") from e
    want = (K, cal.problem.d)
    dtype = cal.problem.y0.dtype
    if not isinstance(got, jax.ShapeDtypeStruct) or got.shape != want or got.dtype != dtype:
        what = (f"{np.dtype(got.dtype).name}{list(got.shape)}"
                if isinstance(got, jax.ShapeDtypeStruct) else type(got).__name__)
        raise ValueError(f"to_y0(theta_b) must give the K={K} initial states of one fit, "
                         f"{np.dtype(dtype).name}{list(want)}; got {what}")


def check_to_params(cal, theta0, K):
    """`to_params` on fit 0's theta, traced abstractly: every parameter the problem
    has, each shaped for K trajectories (or as the problem's `Shared` value)."""
    theta_b = _fit0(theta0)
    what = "to_params(theta_b)" if cal.to_params is not None else \
        "theta_b broadcast to K (no to_params)"
    try:
        got = eqx.filter_eval_shape(
            lambda th: cal.objective.params(jax.tree.map(
                lambda x: x[None] if eqx.is_array(x) else x, th), K), theta_b)
    except Exception as e:
        raise TypeError(f"{what} failed on fit 0's theta: {type(e).__name__}: "
                        f"{e}") from e
    want = jax.tree.map(
        lambda x: x if is_shared(x) else jax.ShapeDtypeStruct((K,) + x.shape[1:], x.dtype)
        if eqx.is_array(x) else x, cal.problem.params, is_leaf=is_shared)
    got, want = _fingerprint.array_shapes(got), _fingerprint.array_shapes(want)
    if got != want:
        missing = sorted(set(want) - set(got))
        extra = sorted(set(got) - set(want))
        wrong = [f"{k}: {got[k]} (expected {want[k]})" for k in sorted(set(got) & set(want))
                 if got[k] != want[k]]
        parts = ([f"missing {missing}"] if missing else []) + \
            ([f"unexpected {extra}"] if extra else []) + \
            ([f"wrong shape or dtype {', '.join(wrong)}"] if wrong else [])
        if wrong:  # a theta0 of another dtype is the likely cause: name it
            check_theta_dtype(theta0, cal.problem.y0.dtype,
                               f"; {what} gives {', '.join(wrong)}")
        raise ValueError(
            f"{what} must give the K={K} trajectories of one fit the problem's "
            f"parameters (leaves leading with K, the problem's dtypes; gs.Shared ones "
            f"as in the problem): "
            + "; ".join(parts))
