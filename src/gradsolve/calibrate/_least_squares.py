"""Optimistix's steps: its Gauss-Newton family (`optx.LevenbergMarquardt`,
`optx.GaussNewton`, `optx.Dogleg`) on the Calibrator's residuals (`Calibrator(...,
residuals=...)`), and its quasi-Newton minimisers (`optx.BFGS`) on the scalar loss,
driven one step per update, per fit.

Each fit runs the solver's own `init` / `step` / `terminate` under `vmap`, its trial
points evaluated on the fit's own rows of the same recorded mesh (so the objective is
smooth and deterministic between refreshes, and nothing couples two fits). The
solver's state is the fit's optimizer state: checkpointed, gathered into slots and
restarted when the fit's mesh is re-recorded (`restart`: a trust region keeps its
radius).

The Jacobian. A fit's residual function is wrapped so that its linearisation is a
materialised `(M, P)` matrix (M residuals, P parameters): one forward-mode replay with
P tangents (`jax.jacfwd`: the seed's forward mode) when P <= M and the engine serves
forward mode, else M reverse-mode rows (`jax.jacrev`). The solver then sees a matrix
times a vector -- the same small linear map whatever the mesh's width, which is what
lets its state cross refreshes, slots and checkpoints.

    res = gs.Calibrator(prob, residuals=lambda ys, th, d: (ys - d).ravel(),
                        data=obs).fit(theta0)  # Levenberg-Marquardt by default
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import optimistix as optx
from jax.flatten_util import ravel_pytree

from . import _transforms

# The default least-squares solver's termination (optimistix's Cauchy test: a step's
# change in the parameters and in the residuals both below atol + rtol * size).
RTOL, ATOL = 1e-8, 1e-10
# A fit whose trust region rejected this many trial points in a row, and whose next
# trial is predicted to gain nothing beyond the solver's tolerance, has converged
# (`_stalled`): at an optimum, optimistix's own test needs an accepted step, which a
# rounding-level loss surface may never give (measured on recipes/multistart.py's
# profile: 2 of 12 points stayed at their optimum to 14 digits for 90 updates). It
# must be below the refresh interval, which restarts the count.
STALLED = 5
_TAGS = frozenset()
_OPTIONS = {"jac": "fwd"}  # the linearisation of our materialised map: a matmul


def is_least_squares(optimizer) -> bool:
    return isinstance(optimizer, optx.AbstractLeastSquaresSolver)


def is_optimistix(optimizer) -> bool:
    """An optimistix solver (driven here), not an optax transformation."""
    return isinstance(optimizer, (optx.AbstractLeastSquaresSolver, optx.AbstractMinimiser))


def check_solver(optimizer, residuals, transform=None):
    """Refuse, by name, an optimistix solver the Calibrator does not drive, a
    least-squares solver without residuals, and a quasi-Newton minimiser on clipped
    edges (its line search and memory would see steps the box cuts short)."""
    if is_optimistix(optimizer) and not isinstance(
            optimizer, (optx.AbstractGaussNewton, optx.AbstractQuasiNewton)):
        raise TypeError(
            f"optimizer={type(optimizer).__name__}: of optimistix's solvers the Calibrator "
            f"drives the Gauss-Newton family (optx.LevenbergMarquardt, optx.GaussNewton, "
            f"optx.Dogleg) on residuals= and the quasi-Newton minimisers (optx.BFGS); "
            f"or use an optax transformation (optax.lbfgs() is L-BFGS with a line search)")
    if (isinstance(optimizer, optx.AbstractQuasiNewton)
            and _transforms.has_box(transform)):
        raise TypeError(
            f"optimizer={type(optimizer).__name__} does not keep a box: with "
            f"edges=\"clip\" transforms use Levenberg-Marquardt on residuals= or an "
            f"optax transformation, or keep the default squashed edges")
    if is_least_squares(optimizer) and residuals is None:
        raise TypeError(
            f"optimizer={type(optimizer).__name__} is a least-squares method: give the "
            f"fit's residuals (Calibrator(prob, residuals=r, ...), r(ys_b, theta_b, "
            f"data_b) -> array) instead of a scalar loss")


def default_solver(dtype=jnp.float64):
    """The least-squares default: `optx.LevenbergMarquardt(RTOL, ATOL)`, the
    tolerances raised to what `dtype` resolves (rtol at least 10 roundoffs, atol kept
    at rtol / 100): float32 gets rtol 1.2e-6, atol 1.2e-8. Below its resolution a
    fit at its optimum changes by rounding at every step and never meets the test:
    float32's y' = -k y fits (tests/float32) took 36 updates where 13 sufficed, the
    parameters the same to the last bit."""
    rtol = max(RTOL, 10 * float(jnp.finfo(dtype).eps))
    return optx.LevenbergMarquardt(rtol=rtol, atol=ATOL * rtol / RTOL)


def half_squares(residuals):
    """The scalar loss of a least-squares fit: half the squared norm of its residuals."""
    def loss(ys_b, theta_b, data_b):
        return 0.5 * jnp.sum(jnp.square(residuals(ys_b, theta_b, data_b)))
    return loss


def _jacobian_by(forward, P, M):
    """`jax.jacfwd` (P tangents) when the engine serves forward mode and P <= M, else
    `jax.jacrev` (M cotangents)."""
    return "fwd" if forward and P <= M else "rev"


def objective_fn(objective, solver, static, K, held, forward):
    """optimistix's `fn(u_b, args) -> (out, None)` for one fit, `args = (b, mesh, data,
    y0, rows)`: its residuals for a least-squares solver (`residual_fn`), else its
    scalar loss, the leaves `held` (None, or a pytree of bools shaped as `u_b`'s
    structure) without a gradient."""
    if is_least_squares(solver):
        return residual_fn(objective, static, K, held, forward)

    def fn(u_b, args):
        if held is not None:
            u_b = jax.tree.map(lambda x, h: jax.lax.stop_gradient(x) if h else x, u_b, held)
        return objective.fit_output(u_b, *args, static=static, K=K), None
    return fn


def residual_fn(objective, static, K, held, forward):
    """optimistix's `fn(u_b, args) -> (r, None)` for one fit, `args = (b, mesh, data,
    y0, rows)`: fit b's residuals (flattened) at its unconstrained parameters `u_b`,
    with the Jacobian materialised (see the module). `held`: None or a pytree of bools
    shaped as `u_b`'s structure, True at the leaves a profile holds (their Jacobian
    columns are zero, so no step moves them). Leaves kept in a box (`edges="clip"`) on
    a bound their gradient pushes against lose their columns the same way (the active
    set of a projected Gauss-Newton step); `make_step` projects the trial points."""

    def fn(u_b, args):
        v, unravel = ravel_pytree(u_b)
        mask = None if held is None else ravel_pytree(jax.tree.map(
            lambda x, h: jnp.full(jnp.shape(x), h), u_b, held))[0]
        box = objective.box(u_b, static)
        if box is not None:
            box = tuple(ravel_pytree(x)[0] for x in box)

        def plain(v, args, ys_forward=False):
            if mask is not None:
                v = jnp.where(mask, jax.lax.stop_gradient(v), v)
            return objective.fit_output(unravel(v), *args, static=static, K=K,
                                        residuals=True, forward=ys_forward).ravel()

        @jax.custom_jvp
        def r(v, args):
            return plain(v, args)

        @r.defjvp
        def r_jvp(primals, tangents):
            v, args = primals
            M = jax.eval_shape(plain, v, args).shape[0]
            by = _jacobian_by(forward, v.shape[0], M)

            def both(v):
                out = plain(v, args, ys_forward=by == "fwd")
                return out, out
            jac, out = (jax.jacfwd if by == "fwd" else jax.jacrev)(both, has_aux=True)(v)
            if box is not None:  # the active bounds' columns dropped: the step holds them
                out_of = _transforms.pushing_out(jac.T @ out, v, box)
                jac = jnp.where(out_of[None, :], 0.0, jac)
            return out, jac @ tangents[0]
        return r(v, args), None
    return fn


@eqx.filter_jit  # traced once per shape: every refresh starts solver states here
def init(objective, solver, u, static, mesh, data, y0, held, forward):
    """The solver's state of every fit (leaves lead with B) at `u`: nothing is replayed
    (the solver reads the shapes only); its first step evaluates the fit at `u`."""
    B = jax.tree.leaves(u)[0].shape[0]
    K = y0.shape[0] // B
    fn = objective_fn(objective, solver, static, K, held, forward)

    def one(u_b, b):
        args = (b, mesh, data, y0, None)
        return eqx.filter(_init(solver, fn, u_b, args), eqx.is_array)
    return jax.vmap(one)(u, jnp.arange(B))


def restart(old, new):
    """The solver states `new` (just initialised at the fits' parameters on a fresh
    mesh) keeping `old`'s search state: a trust region's radius (Levenberg-Marquardt's
    damping) or a line search's step. The point, residuals and Jacobian are evaluated
    anew on the fresh mesh, and the region goes on at the size the fit had found.
    Restarting it at optimistix's initial radius too wasted updates growing the
    damping back at every refresh: on Boehm_JProteomeRes2014 (8 starts, 100 updates,
    a refresh every 10) 0 of 8 fits converged with it and 5 of 8 without."""
    if getattr(new, "search_state", None) is None:
        return new
    return eqx.tree_at(lambda s: s.search_state, new, old.search_state)


def _init(solver, fn, u_b, args):
    return solver.init(fn, u_b, args, _OPTIONS, jax.eval_shape(lambda: fn(u_b, args)[0]),
                       None, _TAGS)


def _with_static(solver, fn, u_b, args, arrays):
    """A fit's solver state from its arrays (what the FitState carries: a traced
    loop's carry, a checkpoint) and the rest -- the linearisation's jaxpr, the same at
    every step -- traced anew from the solver's `init`."""
    struct = eqx.filter_eval_shape(_init, solver, fn, u_b, args)
    return eqx.combine(arrays, eqx.filter(struct, lambda x: not isinstance(
        x, jax.ShapeDtypeStruct)))


def make_step(objective, solver, held, forward):
    """`step(state, static, mesh, data, y0, rows) -> (u, opt_state, losses, grad_norm,
    done)`: one solver step of every fit (its `step` then `terminate`); `losses` and
    `grad_norm` are at the returned (accepted) parameters."""

    def step(state, static, mesh, data, y0, rows):
        B = state.active.shape[0]
        fn = objective_fn(objective, solver, static, y0.shape[0] // B, held, forward)

        def one(u_b, s, b):
            args = (b, mesh, data, y0, None if rows is None else rows[b][None])
            s = _with_static(solver, fn, u_b, args, s)
            u_b, s, _ = solver.step(fn, u_b, args, _OPTIONS, s, _TAGS)
            box = objective.box(u_b, static)
            if box is not None:  # the next trial point, projected into the box
                s = eqx.tree_at(lambda s: s.y_eval, s, _transforms.project(s.y_eval, box))
            done, _ = solver.terminate(fn, u_b, args, _OPTIONS, s, _TAGS)
            if hasattr(s, "num_steps_since_acceptance"):  # a trust region's
                done = done | _stalled(solver, u_b, s)
            grad = (s.f_info.compute_grad() if is_least_squares(solver) else s.f_info.grad)
            return (u_b, eqx.filter(s, eqx.is_array), s.f_info.as_min(),
                    optax.tree.norm(grad), done)
        return jax.vmap(one)(state.u, state.opt_state, jnp.arange(B))
    return step


def _stalled(solver, u_b, s):
    """Whether a fit's trust region has stalled at an optimum: its last STALLED trial
    points were rejected and, for a least-squares solver, the next one is predicted
    (by the Gauss-Newton model at the accepted point) to change the residuals by no
    more than the solver's own tolerance, `atol + rtol * |r|` (its Cauchy test's, on
    the model's change): nothing is left to gain but rounding.

    Rejections alone are not enough: Levenberg-Marquardt's damping is added to J^T J
    unscaled, so on a badly scaled problem five 4x shrinks of a wide region can leave
    the step as undamped as before. On Boehm_JProteomeRes2014 (8 starts, 150 updates)
    five of eight fits stopped as converged that way with gradient norms of 87-104,
    at log-likelihoods 95-98 below the best."""
    stalled = s.num_steps_since_acceptance >= STALLED
    if not is_least_squares(solver):
        return stalled
    change = s.f_info.jac.mv(jax.tree.map(jnp.subtract, s.y_eval, u_b))
    return stalled & (optax.tree.norm(change) <= solver.atol + solver.rtol * optax.tree.norm(
        s.f_info.residual))


def fingerprint_jaxpr(solver, u_b):
    """The jaxpr of one step of `solver` on a stand-in objective (residuals `u`
    doubled, or their squared norm) at parameters shaped as `u_b`: its kind and
    constants (rtol, atol, its linear solver), for the checkpoint fingerprint."""
    def fn(u, args):
        r = jax.tree.map(lambda x: 2.0 * x, u)
        return (r if is_least_squares(solver) else optax.tree.norm(r, squared=True)), None

    def one(u):
        return solver.step(fn, u, None, _OPTIONS, _init(solver, fn, u, None), _TAGS)[0]
    return jax.make_jaxpr(one)(u_b)
