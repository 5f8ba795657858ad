"""The pure parts of a fit: what a fit minimises (`Objective`: theta -> per-fit
losses) and one optimizer step of every slot's fit (`make_update`), run several at a
time in one compiled loop (`make_updates`).

Nothing here has a side effect or holds state between calls: the Calibrator builds
these once from its settings and owns everything else -- slots, refreshes, drift
checks, checkpoints, progress. Another kind of step is another `make_update` over the
same `Objective`: `make_optimistix_update` runs optimistix's Gauss-Newton family on
its residuals and its quasi-Newton minimisers on its loss (`_least_squares`).

    update = make_update(objective, optax.adam(1e-2))
    updates = eqx.filter_jit(make_updates(update))
    state, count, (steps, active, losses), stale = updates(
        state, static, mesh, data, y0, start, tol, grad_tol, cap, n, refill, fresh)
"""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

from .. import layout
from ..problem import Shared, _is_shared, trajectory_params
from . import _least_squares, _transforms
from ._state import FitState, FitStatus


# The most updates one call of the compiled loop runs (its loss record is this long;
# the host returns between calls for refreshes, drift checks, checkpoints and progress:
# the Calibrator's CALL_SECONDS).
MAX_UPDATES_PER_CALL = 64


class Objective(eqx.Module):
    """Theta -> per-fit losses on a mesh: the fits' parameters and initial states
    (`to_params`, `to_y0`, the transform), the replay (`ys`, the engine's) and the
    user's `loss`, and the minibatch draws (`batch_size` of each fit's K trajectories).

    Every method is pure: the same arguments give the same numbers."""

    loss: Callable
    to_params: Callable | None
    to_y0: Callable | None
    transform: Any
    ys: Callable  # ys(mesh, params, y0): the engine's replay
    batch_size: int | None = eqx.field(static=True)
    residuals: Callable | None = None  # the least-squares form: loss = 0.5 |r|^2
    ys_forward: Callable | None = None  # the replay for forward mode, where served
    # `ys` returns `(ys, ratio)`: each row's largest error ratio on its mesh at these
    # parameters (`replay.replay_function(..., check=True)`), for `refresh_tol`.
    checked: bool = eqx.field(static=True, default=False)

    def theta(self, u, static):
        """The fits' theta (constrained) from the optimised, unconstrained `u`."""
        return _transforms.apply(self.transform, eqx.combine(u, static), "forward")

    def box(self, u, static):
        """`(lower, upper)`, trees shaped as `u`, that the optimizer keeps `u` within
        (`gs.transforms`' `edges="clip"`), or None where no transform keeps one."""
        b = _transforms.box(self.transform, eqx.combine(u, static))
        return None if b is None else tuple(eqx.filter(x, eqx.is_array) for x in b)

    def params(self, theta, K):
        """Per-trajectory parameters of the whole ensemble from the B fits' theta."""
        if self.to_params is None:
            def one(theta_b):
                return jax.tree.map(lambda x: jnp.broadcast_to(x, (K,) + jnp.shape(x))
                                    if eqx.is_array(x) else x, theta_b)
        else:
            one = self.to_params
        per_fit = eqx.filter_vmap(one)(theta)
        arrays = jax.tree.leaves(eqx.filter(theta, eqx.is_array))  # not a static leaf
        B = arrays[0].shape[0] if arrays else 1

        def merge(x):
            if isinstance(x, Shared):
                # Common to every trajectory of the ensemble: only one fit can own it.
                if B != 1:
                    raise ValueError("to_params may return gs.Shared parameters only when "
                                     f"B == 1 (one fit owns them), got B={B}")
                return Shared(jax.tree.map(lambda v: v[0] if eqx.is_array(v) else v,
                                           x.value))
            return x.reshape((-1,) + x.shape[2:]) if eqx.is_array(x) else x
        return jax.tree.map(merge, per_fit, is_leaf=lambda v: isinstance(v, Shared))

    def y0(self, theta, y0):
        """The initial states of the fits' trajectories: the problem's rows `y0`, or
        `to_y0` of each fit."""
        if self.to_y0 is None:
            return y0
        return eqx.filter_vmap(self.to_y0)(theta).reshape(y0.shape)

    def inputs(self, u, static, K, y0):
        """`(params, y0)` of the whole ensemble at `u`: what a record solves from."""
        theta = self.theta(u, static)
        return self.params(theta, K), self.y0(theta, y0)

    def rows(self, key, start, steps, K):
        """Each slot's minibatch at its fit's current update, `(B, batch_size)` rows
        of its K trajectories drawn without replacement from the fit's key (its start
        index and update count folded in: the same in any slot, and after a resume);
        None without minibatches."""
        if self.batch_size is None:
            return None
        return jax.vmap(lambda b, t: jax.random.choice(
            jax.random.fold_in(jax.random.fold_in(key, b), t), K,
            (self.batch_size,), replace=False))(start, steps)

    def losses(self, u, static, mesh, data, y0, K, rows=None, arr=None, residuals=False,
               forward=False):
        """Per-fit losses; with `rows` `(B, m)`, on those m of each fit's K
        trajectories (a minibatch) and their data. `arr`: where the rows are replayed
        (`layout/`), None for one piece. With `residuals`, each fit's residuals
        instead; with `forward`, replayed by the engine's forward-mode replay."""
        return self.checked_losses(u, static, mesh, data, y0, K, rows, arr, residuals,
                                   forward)[0]

    def checked_losses(self, u, static, mesh, data, y0, K, rows=None, arr=None,
                       residuals=False, forward=False):
        """`(losses, ratio)`: `losses` as `losses` gives them, and per fit the largest
        error ratio of its replayed rows' steps (`checked`; None otherwise)."""
        theta = self.theta(u, static)
        params, y0 = self.params(theta, K), self.y0(theta, y0)
        if rows is not None:
            B, K = rows.shape
            flat = (jnp.arange(B)[:, None] * (y0.shape[0] // B) + rows).reshape(-1)
            params = trajectory_params(params, flat)
            y0, mesh = y0[flat], None if mesh is None else mesh.take(flat)
            data = None if data is None else jax.tree.map(
                lambda d: jax.vmap(lambda d_b, r: d_b[r])(d, rows), data)
        run = self.ys_forward if forward else self.ys
        ys = run(mesh, params, y0) if arr is None else layout.run(run, arr, mesh, params, y0)
        ratio = None
        if self.checked and not forward:
            ys, ratio = ys
            ratio = ratio.reshape(-1, K).max(axis=1)
        ys_b = ys.reshape((-1, K) + ys.shape[1:])
        batched = eqx.if_array(0)
        axes = (batched, batched, None if data is None else batched)
        return eqx.filter_vmap(self.residuals if residuals else self.loss, in_axes=axes)(
            ys_b, theta, data), ratio

    def fit_output(self, u_b, b, mesh, data, y0, rows, *, static, K, residuals=False,
                   forward=False):
        """Fit b's loss (or residuals) as a function of its own parameters `u_b`
        (without the fit axis), on its K rows of `mesh`, `data` and `y0` (all fits'),
        `rows` its minibatch `(1, m)` or None: what a line search's or a least-squares
        step's trial points evaluate."""
        at = b * K + jnp.arange(K)
        return self.losses(
            jax.tree.map(lambda x: x[None], u_b), static,
            None if mesh is None else mesh.take(at),
            None if data is None else jax.tree.map(
                lambda x: x[b][None] if eqx.is_array(x) else x, data),
            y0[at], K, rows, residuals=residuals, forward=forward)[0]


def _where(mask, new, old):
    """Per fit (the leading axis), `new` where `mask` else `old`."""
    def pick(a, b):
        m = mask.reshape(mask.shape + (1,) * (a.ndim - 1))
        return jnp.where(m, a, b)
    return jax.tree.map(pick, new, old)


def make_update(objective: Objective, optimizer, held=None):
    """One optimizer step of every slot's fit: `update(state, static, mesh, data, y0,
    start, tol, grad_tol, cap, arr=None) -> (state, ratio)`, `ratio` per fit the
    largest error ratio of its mesh's steps at the parameters the step started from
    (`Objective.checked`; None unchecked).

    `held`: None, or a pytree of bools shaped as the optimised parameters, True at the
    leaves held at their values (a profile's fixed leaf): their gradient is zero, so
    no optimizer moves them (a quasi-Newton direction has no component along them, and
    a line search tries points where they are held), and `grad_tol` reads the others.
    Leaves kept in a box (`edges="clip"`) are projected back into it after every step,
    and on a bound their gradient pushes against, held as a profile's are.

    A fit moves when it is active, its loss and gradient are finite and it has not
    converged (`tol` on the loss, `grad_tol` on the gradient's norm); its status says
    why it stopped. `cap` is traced: the compiled update depends on the number of slots
    and the mesh width only, not on the number of steps. Nothing couples two fits: a
    fit's update depends on its own start index, steps, parameters, trajectories and
    data only -- which makes a start's result the same in whichever slot, beside
    whichever others.

    Transformations that take optax's extra arguments get them per fit (`value`,
    `grad`, `value_fn`: `optax.lbfgs`'s line search evaluates its trial points on the
    fit's own rows of the same mesh); the others ignore them
    (`optax.with_extra_args_support`)."""
    extra_args = optax.with_extra_args_support(optimizer)

    def update(state: FitState, static, mesh, data, y0, start, tol, grad_tol, cap,
               arr=None):
        B = state.active.shape[0]
        K = y0.shape[0] // B
        rows = objective.rows(state.key, start, state.steps, K)

        def total(u):
            losses, ratio = objective.checked_losses(u, static, mesh, data, y0, K, rows,
                                                     arr)
            # A non-finite fit adds nothing to the others' gradients.
            return jnp.sum(jnp.where(jnp.isfinite(losses), losses, 0.0)), (losses, ratio)

        (_, (losses, ratio)), grads = jax.value_and_grad(total, has_aux=True)(state.u)
        if held is not None:
            grads = jax.tree.map(lambda g, h: jnp.zeros_like(g) if h else g, grads, held)
        box = objective.box(state.u, static)
        if box is not None:  # a fit on a bound it pushes against is held there
            grads = jax.tree.map(lambda g, out: jnp.where(out, 0.0, g), grads,
                                 _transforms.pushing_out(grads, state.u, box))
        grad_norm = jax.vmap(optax.tree.norm)(grads)
        finite = jnp.isfinite(losses) & jnp.isfinite(grad_norm)
        converged = jnp.zeros_like(finite)
        if tol is not None:
            converged = converged | (losses <= tol)
        if grad_tol is not None:
            converged = converged | (grad_norm <= grad_tol)
        move = state.active & finite & ~converged

        def step(g, s, u_b, value, b):
            """Fit b's optimizer step, with optax's extra arguments: its loss, its
            gradient and `value_fn`, its loss as a function of its own parameters on
            its rows of the mesh (a line search's trial points: `optax.lbfgs`)."""
            def value_fn(u_trial):
                return objective.fit_output(u_trial, b, mesh, data, y0,
                                            None if rows is None else rows[b][None],
                                            static=static, K=K)
            return extra_args.update(g, s, u_b, value=value, grad=g, value_fn=value_fn)
        updates, opt_state = jax.vmap(step)(grads, state.opt_state, state.u, losses,
                                            jnp.arange(B))
        u = _transforms.project(optax.apply_updates(state.u, updates), box)
        return _advance(state, move, u, opt_state, losses, grad_norm, finite, converged,
                        cap, arr), ratio
    return update


def _advance(state, move, u, opt_state, losses, grad_norm, finite, converged, cap, arr):
    """The state after an update: the fits in `move` take `u` and `opt_state` and count
    a step; every active fit's loss and gradient norm are recorded; a fit stops --
    non-finite, converged or at the cap, in that order -- with its status."""
    u = _where(move, u, state.u)
    opt_state = _where(move, opt_state, state.opt_state)
    steps = state.steps + move
    status = jnp.select(
        [~state.active, ~finite, converged, steps >= cap],
        [state.status, FitStatus.NONFINITE, FitStatus.CONVERGED, FitStatus.STEP_CAP],
        state.status).astype(state.status.dtype)
    return layout.replicated(state._replace(
        u=u, opt_state=opt_state,
        active=state.active & finite & ~converged & (steps < cap),
        status=status, steps=steps, loss=jnp.where(state.active, losses, state.loss),
        grad_norm=jnp.where(state.active, grad_norm, state.grad_norm),
        update=state.update + 1), arr)


def make_optimistix_update(objective: Objective, solver, held=None, forward=False,
                           settle=None):
    """As `make_update`, for an optimistix solver (`_least_squares`): the Gauss-Newton
    family on the objective's residuals, a quasi-Newton minimiser on its loss. Every
    active fit takes one solver step (a rejected trial point counts as a step);
    its loss and gradient norm are those of its accepted point after the step, and it
    converges by the solver's own test (`terminate`), or by `tol` / `grad_tol`.

    `settle`: None, or the refresh interval: the solver's own test counts only after
    the fit's first refresh (more than `settle` updates), so that a fit quick to
    converge confirms its optimum on a mesh recorded there, not on the one recorded at
    its start."""
    step = _least_squares.make_step(objective, solver, held, forward)

    def update(state: FitState, static, mesh, data, y0, start, tol, grad_tol, cap,
               arr=None):
        u, opt_state, losses, grad_norm, converged = step(state, static, mesh, data, y0,
                                                          None)
        if settle is not None:
            converged = converged & (state.steps + 1 > settle)
        finite = jnp.isfinite(losses) & jnp.isfinite(grad_norm)
        if tol is not None:
            converged = converged | (losses <= tol)
        if grad_tol is not None:
            converged = converged | (grad_norm <= grad_tol)
        return _advance(state, state.active, u, opt_state, losses, grad_norm, finite,
                        converged, cap, arr), None
    return update


def make_updates(update, refresh_tol=None):
    """`update` run up to `n` times in one compiled loop: `updates(state, static, mesh,
    data, y0, start, tol, grad_tol, cap, n, refill, fresh, arr=None) -> (state, count,
    (steps, active, losses), stale)`. It stops early once no fit is active or, with
    `refill` (starts waiting for a slot), once a slot's fit has stopped, so that the
    host refills it before the next update as it would between single updates.
    Returns the state, the number of updates run and, per update, each slot's step
    count and activity before it and its loss (`MAX_UPDATES_PER_CALL` rows, `count` of
    them written).

    With `refresh_tol` (and a checked objective), an update in which an active fit's
    mesh has a step whose error ratio at the fit's parameters exceeds `refresh_tol` is
    not kept: the loop stops before it, and `stale` (per slot) names the fits whose
    meshes the host re-records before running it again. A fit in `fresh` (its mesh
    was just recorded at its parameters) is not checked at the call's first update:
    the record's own steps pass the controller's test there, and a check that could
    not pass would loop. Whether an update is kept depends on the fit's own
    parameters and mesh only, so that results do not depend on how the updates are
    split into calls."""

    def updates(state: FitState, static, mesh, data, y0, start, tol, grad_tol, cap, n,
                refill, fresh, arr=None):
        B = state.active.shape[0]
        record = (jnp.zeros((MAX_UPDATES_PER_CALL, B), state.steps.dtype),
                  jnp.zeros((MAX_UPDATES_PER_CALL, B), bool),
                  jnp.zeros((MAX_UPDATES_PER_CALL, B), state.loss.dtype))
        entered = state.active

        def go_on(carry):
            i, s, _, stale = carry
            return ((i < n) & s.active.any() & ~(refill & (entered & ~s.active).any())
                    & ~stale.any())

        def one(carry):
            i, s, (steps, active, loss), _ = carry
            new, ratio = update(s, static, mesh, data, y0, start, tol, grad_tol, cap, arr)
            stale, keep = jnp.zeros(B, bool), jnp.asarray(True)
            if refresh_tol is not None and ratio is not None:
                stale = s.active & (ratio > refresh_tol) & ~(fresh & (i == 0))
                keep = ~stale.any()  # else row i is past the count: not read
                new = jax.tree.map(lambda a, b: jnp.where(keep, a, b), new, s)
            return i + keep, new, (steps.at[i].set(s.steps), active.at[i].set(s.active),
                                   loss.at[i].set(new.loss)), stale
        count, state, record, stale = jax.lax.while_loop(
            go_on, one, (jnp.zeros((), jnp.int32), state, record, jnp.zeros(B, bool)))
        return state, count, record, stale
    return updates


def all_shared(params) -> bool:
    """Whether every parameter is in a `gs.Shared` (and there is one)."""
    nodes = jax.tree.leaves(params, is_leaf=_is_shared)
    return bool(nodes) and all(_is_shared(x) for x in nodes)


def resharing(params):
    """`to_params` of one fit over `params`' shared values: the values back in their
    `gs.Shared` wrappers (the structure only: no array of `params` is captured)."""
    treedef = jax.tree.structure(params, is_leaf=_is_shared)

    def to_params(theta_b):
        return jax.tree.unflatten(treedef, [Shared(v) for v in treedef.flatten_up_to(theta_b)])
    return to_params
