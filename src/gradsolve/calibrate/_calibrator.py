"""The Calibrator: B independent fits at once, one batched gradient per update.

Fit b owns trajectories `b*K:(b+1)*K` of the ensemble. Every update replays the
recorded mesh for the whole ensemble, differentiates the SUM of the per-fit losses
(fits share no parameters, so each fit's gradient is its own), and applies the
Optax transformation per fit under `vmap` (so norms, clipping and schedules never
couple fits). Fits that converge are frozen -- parameters and optimizer state -- and
fits whose loss or gradient goes non-finite, or whose trajectories fail to record,
are frozen with a status; the others go on untouched.
"""

import enum
import functools
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

from ..config import DEFAULT_MAX_STEPS
from ..problem import Shared, as_problem
from ..record import RECORDERS
from ..router import plan
from ..status import Status
from . import _transforms
from ._checkpoint import Checkpoints
from ._result import FitResult


class FitStatus(enum.IntEnum):
    """Outcome of one fit."""

    RUNNING = 0
    CONVERGED = 1
    STEP_CAP = 2
    NONFINITE = 3
    RECORD_FAILED = 4


class FitState(NamedTuple):
    """Everything a fit needs to continue: arrays only (it is what is checkpointed)."""

    u: Any               # unconstrained parameters, leaves lead with B
    opt_state: Any       # per-fit optimizer state, leaves lead with B
    active: jax.Array    # (B,) still updating
    status: jax.Array    # (B,) FitStatus
    steps: jax.Array     # (B,) updates applied
    loss: jax.Array      # (B,) loss at the current parameters
    grad_norm: jax.Array  # (B,)
    history: jax.Array   # (steps, B) loss at each update
    drift: jax.Array     # (steps,) drift figure where a drift check ran, else NaN
    update: jax.Array    # () updates done
    refreshes: jax.Array  # () mesh refreshes so far
    key: jax.Array
    mesh: Any            # the mesh's arrays (None for an engine without a mesh)


def _where(mask, new, old):
    """Per-fit select over trees whose leaves lead with B."""
    def pick(a, b):
        return jnp.where(mask.reshape(mask.shape + (1,) * (a.ndim - 1)), a, b)
    return jax.tree.map(pick, new, old)


def _mesh_arrays(mesh):
    if mesh is None:
        return None
    return {"h": mesh.h, "n_steps": mesh.n_steps, "n_rejected": mesh.n_rejected,
            "status": mesh.status, "t0": mesh.t0, "t1": mesh.t1}


class Calibrator:
    """Fit B parameter sets at once, each to its own data, with Optax.

    Args:
        prob: the ensemble problem, n = B * K trajectories (fit b owns trajectories
            `b*K:(b+1)*K`). Its `params` give the structure `to_params` must return.
        loss: `loss(ys_b, theta_b, data_b) -> scalar`, `ys_b` shaped `(K, d)` or
            `(K, len(ts), d)`; with `data=None` it is called as `loss(ys_b, theta_b,
            None)`.
        to_params: `theta_b -> per-trajectory params of fit b's K trajectories` (leaves
            leading with K). Default: `theta_b` broadcast to K.
        data: a pytree whose leaves lead with B (observations per fit), or None.
        optimizer: an `optax.GradientTransformation` (default `optax.adam(1e-2)`), run
            per fit under `vmap`.
        transform: parameter transforms (`gs.transforms.Positive()`, `Bounded(lo,
            hi)`), one for all leaves or a pytree matching `theta0`; None: identity.
        rtol, atol, method, ts, max_steps, dt0: the record's and replay's settings.
        engine: None (router), or an engine name; `"diffrax"` runs the same loop on
            Diffrax gradients (no mesh) -- the fitting benchmark's baseline.
        recorder: None (router), `"general"` or `"fused"`: which recorder refreshes the
            mesh (the engine then follows: `general_replay` or `fused_replay`).
        refresh_every: re-record the mesh at the current parameters every this many
            updates (None: never).
        drift_every, drift_tol: every `drift_every` updates, record afresh and compare
            the replayed final states with the fresh record's; if the relative change
            exceeds `drift_tol` adopt the fresh mesh. Figures land in `result.drift`.
        checkpoint_dir, checkpoint_every: save the fit state with Orbax every this many
            updates; `fit()` on a directory with a checkpoint resumes from it.

    Examples:
        >>> import jax.numpy as jnp, optax, gradsolve as gs
        >>> B, K = 2, 2
        >>> prob = gs.EnsembleProblem(f_jax=lambda t, y, k: -k * y, y0=jnp.ones((B * K, 1)),
        ...                           params=jnp.ones(B * K), t_span=(0.0, 1.0))
        >>> obs = jnp.exp(-jnp.array([[0.5], [2.0]]))[:, None, :] * jnp.ones((1, K, 1))
        >>> cal = gs.Calibrator(prob, lambda ys, k, d: jnp.sum((ys - d) ** 2), data=obs,
        ...                     optimizer=optax.adam(0.1), transform=gs.transforms.Positive())
        >>> res = cal.fit(jnp.ones(B), steps=300, tol=1e-12, progress=False)
        >>> [round(float(k), 3) for k in res.theta], bool(res.converged.all())
        ([0.5, 2.0], True)
    """

    def __init__(self, prob, loss, to_params=None, data=None, optimizer=None, *,
                 transform=None, rtol=1e-6, atol=1e-9, method=None, ts=None,
                 max_steps=DEFAULT_MAX_STEPS, dt0=None, engine=None, recorder=None,
                 refresh_every=None, drift_every=None, drift_tol=None,
                 checkpoint_dir=None, checkpoint_every=None):
        self.problem = as_problem(prob)
        if not callable(loss):
            raise TypeError("loss must be callable as loss(ys_b, theta_b, data_b)")
        if to_params is not None and not callable(to_params):
            raise TypeError("to_params must be callable as to_params(theta_b)")
        optimizer = optax.adam(1e-2) if optimizer is None else optimizer
        if not (callable(getattr(optimizer, "init", None))
                and callable(getattr(optimizer, "update", None))):
            raise TypeError("optimizer must be an optax.GradientTransformation")
        for name, v in (("refresh_every", refresh_every), ("drift_every", drift_every),
                        ("checkpoint_every", checkpoint_every)):
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be None or a positive integer, got {v!r}")
        if (drift_every is None) != (drift_tol is None):
            raise ValueError("drift_every and drift_tol go together")
        if recorder not in (None, "general", "fused"):
            raise ValueError(f"recorder must be None, 'general' or 'fused', got {recorder!r}")
        if recorder is not None and engine is None:
            engine = RECORDERS[recorder]
        if checkpoint_every is not None and checkpoint_dir is None:
            raise ValueError("checkpoint_every needs checkpoint_dir")
        self.loss, self.to_params, self.data = loss, to_params, data
        self.optimizer, self.transform = optimizer, transform
        self._engine, self.passed_over, self.config = plan(
            self.problem, gradient=True, engine=engine, method=method, rtol=rtol, atol=atol,
            dt0=dt0, max_steps=max_steps, ts=ts)
        self.engine = self._engine.name
        self.refresh_every, self.drift_every, self.drift_tol = (
            refresh_every, drift_every, drift_tol)
        self.checkpoint_dir, self.checkpoint_every = checkpoint_dir, checkpoint_every
        self._ys = self._engine.ys_function(self.problem, self.config, "reverse")
        self._update = eqx.filter_jit(self._update_impl)

    # -- the per-update computation -------------------------------------------------

    def _full_params(self, theta, K):
        """Per-trajectory parameters of the whole ensemble from the B fits' theta."""
        if self.to_params is None:
            def one(theta_b):
                return jax.tree.map(lambda x: jnp.broadcast_to(x, (K,) + jnp.shape(x)),
                                    theta_b)
        else:
            one = self.to_params
        per_fit = eqx.filter_vmap(one)(theta)
        B = jax.tree.leaves(theta)[0].shape[0] if jax.tree.leaves(theta) else 1

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

    def _losses(self, u, static, mesh, data, K):
        theta = _transforms.apply(self.transform, eqx.combine(u, static), "forward")
        ys = self._ys(mesh, self._full_params(theta, K), self.problem.y0)
        ys_b = ys.reshape((-1, K) + ys.shape[1:])
        batched = eqx.if_array(0)
        axes = (batched, batched, None if data is None else batched)
        return eqx.filter_vmap(self.loss, in_axes=axes)(ys_b, theta, data)

    def _update_impl(self, state: FitState, static, mesh, data, tol, grad_tol, cap):
        # `cap` is traced and `history` is written outside: the compiled update
        # depends on B and the mesh width only, not on the number of steps.
        K = self.problem.n // state.active.shape[0]

        def total(u):
            losses = self._losses(u, static, mesh, data, K)
            # A non-finite fit adds nothing to the others' gradients.
            return jnp.sum(jnp.where(jnp.isfinite(losses), losses, 0.0)), losses

        (_, losses), grads = jax.value_and_grad(total, has_aux=True)(state.u)
        grad_norm = jax.vmap(optax.tree.norm)(grads)
        finite = jnp.isfinite(losses) & jnp.isfinite(grad_norm)
        converged = jnp.zeros_like(finite)
        if tol is not None:
            converged = converged | (losses <= tol)
        if grad_tol is not None:
            converged = converged | (grad_norm <= grad_tol)
        move = state.active & finite & ~converged
        updates, opt_state = jax.vmap(self.optimizer.update)(grads, state.opt_state, state.u)
        u = _where(move, optax.apply_updates(state.u, updates), state.u)
        opt_state = _where(move, opt_state, state.opt_state)
        steps = state.steps + move
        status = jnp.select(
            [~state.active, ~finite, converged, steps >= cap],
            [state.status, FitStatus.NONFINITE, FitStatus.CONVERGED, FitStatus.STEP_CAP],
            state.status).astype(state.status.dtype)
        return state._replace(
            u=u, opt_state=opt_state, active=state.active & move & (steps < cap),
            status=status, steps=steps, loss=losses, grad_norm=grad_norm,
            update=state.update + 1, key=jax.random.split(state.key)[0])

    # -- records --------------------------------------------------------------------

    def _record(self, u, static, K, width=0):
        """Record at the current parameters; per-fit record success."""
        if not self._engine.records:
            return None, None
        theta = _transforms.apply(self.transform, eqx.combine(u, static), "forward")
        mesh = self._engine.record(self.problem, self.config,
                                   params=self._full_params(theta, K))
        ok = np.asarray(mesh.status).reshape(-1, K) == Status.SUCCESS
        return mesh.widened(width), ok.all(axis=1)

    def _mesh(self, arrays):
        from ..mesh import Mesh
        if arrays is None:
            return None
        return Mesh(**arrays, method=self.config.method, rtol=self.config.rtol,
                    atol=self.config.atol, recorder=self._engine.name.replace("_replay", ""))

    def _drift(self, mesh, fresh, u, static, K):
        theta = _transforms.apply(self.transform, eqx.combine(u, static), "forward")
        params = self._full_params(theta, K)
        old = self._ys(mesh, params, self.problem.y0)
        new = self._ys(fresh, params, self.problem.y0)
        return float(jnp.max(jnp.linalg.norm((old - new).reshape(old.shape[0], -1), axis=1)
                             / jnp.linalg.norm(new.reshape(new.shape[0], -1), axis=1)))

    # -- the loop -------------------------------------------------------------------

    def _meta(self, B, K, steps, tol, grad_tol):
        from .. import __version__
        return {"gradsolve": __version__, "problem": self.problem.name,
                "method": self.config.method, "rtol": self.config.rtol,
                "atol": self.config.atol, "engine": self.engine, "B": B, "K": K,
                "steps": steps, "tol": tol, "grad_tol": grad_tol,
                "refresh_every": self.refresh_every, "drift_every": self.drift_every,
                "dtype": str(self.problem.y0.dtype)}

    def fit(self, theta0, steps=400, tol=None, grad_tol=None, progress=True, key=None):
        """Run the fits for up to `steps` updates each.

        Args:
            theta0: initial parameters (constrained space), leaves leading with B.
            steps: the step cap per fit (and the length of `result.history`).
            tol: a fit converges when its loss is <= tol.
            grad_tol: ... or when its gradient norm (unconstrained space) is <= this.
            progress: show a progress bar with the loss range and converged count.
            key: a `jax.random` key kept (and checkpointed) with the fit state.

        Returns:
            A `FitResult`.
        """
        B, K = self._check_theta(theta0, steps)
        u0 = _transforms.apply(self.transform, theta0, "inverse")
        u, static = eqx.partition(u0, eqx.is_inexact_array)
        meta = self._meta(B, K, int(steps), tol, grad_tol)
        state = self._initial_state(u, static, B, K, int(steps), key)
        store = None
        if self.checkpoint_dir is not None:
            store = Checkpoints(self.checkpoint_dir)
            found = store.restore_latest(state._asdict(), functools.partial(_check_meta, meta))
            if found is not None:
                state = FitState(**found[1])
        data = self.data
        tol_a = None if tol is None else float(tol)
        gtol = None if grad_tol is None else float(grad_tol)
        cap = jnp.asarray(int(steps), jnp.int32)
        done = int(state.update)  # counted on the host from here on
        bar = _progress(progress, int(steps), done)
        try:
            while done < steps and bool(jnp.any(state.active)):
                state = self._maybe_refresh(state, static, K, done)
                state = self._update(state, static, self._mesh(state.mesh), data, tol_a,
                                     gtol, cap)
                state = state._replace(history=state.history.at[done].set(state.loss))
                done += 1
                if bar is not None:
                    bar.update(1)
                    loss = np.asarray(state.loss)
                    finite = loss[np.isfinite(loss)]
                    bar.set_postfix_str(
                        f"loss {finite.min():.3g}..{finite.max():.3g}" if finite.size else
                        "loss n/a", refresh=False)
                    n_conv = int(np.sum(np.asarray(state.status) == FitStatus.CONVERGED))
                    bar.set_description(f"converged {n_conv}/{B}")
                if store is not None and self.checkpoint_every and done % self.checkpoint_every == 0:
                    store.save(done, state._asdict(), meta)
        finally:
            if bar is not None:
                bar.close()
            if store is not None:
                store.close()
        theta = _transforms.apply(self.transform, eqx.combine(state.u, static), "forward")
        return FitResult.from_state(state, theta, self.engine, FitStatus)

    def _check_theta(self, theta0, steps):
        if not isinstance(steps, (int, np.integer)) or steps < 1:
            raise ValueError(f"steps must be a positive integer, got {steps!r}")
        leaves = [x for x in jax.tree.leaves(theta0) if eqx.is_array(x)]
        if not leaves:
            raise ValueError("theta0 must hold at least one array leaf leading with B")
        sizes = {x.shape[0] if x.ndim else None for x in leaves}
        if len(sizes) != 1 or None in sizes:
            raise ValueError(f"every array leaf of theta0 must lead with the number of "
                             f"fits B; got leading sizes {sorted(map(str, sizes))}")
        B = sizes.pop()
        n = self.problem.n
        if n % B:
            raise ValueError(f"the problem's n={n} trajectories do not split into B={B} "
                             f"fits of equal size")
        for x in leaves:
            if not np.all(np.isfinite(np.asarray(x))):
                raise ValueError("theta0 holds non-finite values")
        if self.data is not None:
            for path, x in jax.tree_util.tree_leaves_with_path(self.data):
                if np.shape(x)[:1] != (B,):
                    raise ValueError(f"data{jax.tree_util.keystr(path)} must lead with "
                                     f"B={B}, got shape {np.shape(x)}")
        return B, n // B

    def _initial_state(self, u, static, B, K, steps, key):
        mesh, ok = self._record(u, static, K)
        active = jnp.ones(B, bool) if ok is None else jnp.asarray(ok)
        status = jnp.where(active, FitStatus.RUNNING, FitStatus.RECORD_FAILED).astype(jnp.int32)
        dtype = self.problem.y0.dtype
        return FitState(
            u=u, opt_state=jax.vmap(self.optimizer.init)(u), active=active, status=status,
            steps=jnp.zeros(B, jnp.int32), loss=jnp.full(B, jnp.nan, dtype),
            grad_norm=jnp.full(B, jnp.nan, dtype), history=jnp.full((steps, B), jnp.nan, dtype),
            drift=jnp.full(steps, jnp.nan, dtype), update=jnp.asarray(0, jnp.int32),
            refreshes=jnp.asarray(0, jnp.int32),
            key=jax.random.key_data(jax.random.key(0)) if key is None else jax.random.key_data(key),
            mesh=_mesh_arrays(mesh))

    def _maybe_refresh(self, state, static, K, done):
        if state.mesh is None or done == 0:
            return state
        due = self.refresh_every is not None and done % self.refresh_every == 0
        check = self.drift_every is not None and done % self.drift_every == 0
        if not (due or check):
            return state
        current = self._mesh(state.mesh)
        fresh, ok = self._record(state.u, static, K, current.columns)
        if check:
            drift = self._drift(current, fresh, state.u, static, K)
            state = state._replace(drift=state.drift.at[done].set(drift))
            due = due or drift > self.drift_tol
        if not due:
            return state
        failed = state.active & ~jnp.asarray(ok)
        return state._replace(
            mesh=_mesh_arrays(fresh), refreshes=state.refreshes + 1,
            active=state.active & ~failed,
            status=jnp.where(failed, FitStatus.RECORD_FAILED, state.status).astype(jnp.int32))


def _check_meta(expected, found):
    keys = [k for k in expected if found.get(k) != expected[k]]
    if keys:
        diffs = ", ".join(f"{k}: checkpoint {found.get(k)!r} vs now {expected[k]!r}"
                          for k in keys)
        raise ValueError(f"the checkpoint does not match this fit ({diffs})")


def _progress(enabled, total, initial):
    if not enabled:
        return None
    from tqdm.auto import tqdm
    return tqdm(total=total, initial=initial, unit="update", dynamic_ncols=True)
