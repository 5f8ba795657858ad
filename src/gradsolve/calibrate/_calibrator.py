"""The Calibrator: B independent fits at once, one batched gradient per update.

Fit b owns trajectories `b*K:(b+1)*K` of the ensemble. Every update replays the
recorded mesh for the whole ensemble, differentiates the SUM of the per-fit losses
(fits share no parameters, so each fit's gradient is its own), and applies the
Optax transformation per fit under `vmap` (so norms, clipping and schedules never
couple fits). Fits that converge are frozen -- parameters and optimizer state -- and
fits whose loss or gradient goes non-finite, or whose trajectories fail to record,
are frozen with a status; the others go on untouched.

With `fit(..., slots=m)` the compiled update runs on m fits at a time and a fit that
stops hands its slot to the next start; nothing in the update couples two fits, and
each fit counts its own updates (history, cap, refreshes, minibatches), so a start's
result does not depend on the slots.

Nothing compiled depends on the number of steps: the step cap is traced, and the
loss history lives on the host. A refreshed mesh keeps the compiled width while its
steps fit, and one that outgrows it is widened (a network's field's to five times its
steps from the first record on, replayed guarded: `mesh.grown_width`), so a fit
compiles its update once per width it meets, and meets few.

This module holds the Calibrator's settings and its records; the rest is in small
parts: the pure objective and update (`_objective`), the fit loop (`_driver`), its
periodic behaviours (`_policies`), the slot scheduler (`_slots`), input checks
(`_validate`), the checkpoint fingerprint (`_fingerprint`) and profiles (`_profile`).
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

from .. import layout
from ..config import DEFAULT_MAX_STEPS, NETWORK_SIZE
from ..record import record_rows
from ..engines import recorder_of, with_recorder
from ..mesh import GROWTH, Mesh, grown_width
from ..problem import as_problem, network_size
from ..router import plan, refusal, request_for
from ..status import Status
from . import _driver, _least_squares, _policies, _profile, _validate
from ._checkpoint import check_directory, check_every
from ._objective import (MAX_UPDATES_PER_CALL, Objective, all_shared,
                         make_optimistix_update, make_update, make_updates, resharing)
from ._state import FitState, FitStatus


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
            None)`. A loss returning anything but one real number per fit is refused
            when `fit` starts (traced abstractly), with the shape it returned.
        to_params: `theta_b -> per-trajectory params of fit b's K trajectories` (leaves
            leading with K). Default: `theta_b` broadcast to K -- or, when every
            parameter of the problem is in a `gs.Shared` (a neural ODE's network), one
            fit of those: see "One fit" below.
        to_y0: `theta_b -> (K, d)` initial states of fit b's trajectories, when they
            are estimated too (the gradient flows through y0 as through the
            parameters). Default: the problem's y0.
        residuals: in place of `loss`, the least-squares form: `residuals(ys_b,
            theta_b, data_b) -> array` (any shape, its size fixed), the loss being half
            its squared norm. Fitted by `optx.LevenbergMarquardt` by default (see
            `optimizer`); docs/calibrator.md, "Least squares".
        data: a pytree whose leaves lead with B (observations per fit; for one fit
            over shared parameters, that fit's, without B), or None. Its
            values must be finite: a NaN or inf is refused here, naming the leaf and
            its first index. Missing measurements: fill them with any finite value and
            weight them out in the loss with a mask leaf of `data`.
        optimizer: an `optax.GradientTransformation`, run per fit under `vmap`, or,
            with `residuals`, a solver of optimistix's Gauss-Newton family
            (`optx.LevenbergMarquardt`, `optx.GaussNewton`, `optx.Dogleg`), or a
            quasi-Newton minimiser of optimistix's (`optx.BFGS`), one step per update
            per fit. Default: `optx.LevenbergMarquardt(rtol=1e-8,
            atol=1e-10)` with `residuals` (but for a network's field), else
            `optax.adam(1e-2)`. An optax transformation whose `update` takes optax's
            extra arguments gets them per fit: `value` and `grad` (the fit's loss and
            gradient) and `value_fn`, the fit's loss as a function of its parameters
            on its own rows of the same mesh (`optax.lbfgs`'s line search).
        transform: parameter transforms (`gs.transforms.Positive()`, `Bounded(lo,
            hi)`), one for all leaves or a pytree matching `theta0`; None: identity.
        rtol, atol, method, ts, max_steps, dt0: the record's and replay's settings.
        interpolate: how `ts` is served, as `gs.value_and_grad` (None: the
            continuous extension of Tsit5 and Rodas5P on the JAX replay, else an
            integrated step per output). The extension costs no evaluation of the field
            beyond the mesh's steps, which matters when there are many more outputs than
            steps (a neural ODE's data).
        remat: recompute each replay step in the backward sweep (`eqx.filter_checkpoint`;
            default as `gs.value_and_grad`: on for non-stiff methods but for a field
            carrying a network, see `config.default_remat`).
        engine: None (router), or an engine name; `"diffrax"` runs the same loop on
            Diffrax gradients (no mesh) -- the fitting benchmark's baseline.
        recorder: None (router), `"general"` or `"fused"`: which recorder refreshes the
            mesh (the engine then follows: `general_replay` or `fused_replay`).
        refresh_every: re-record the mesh at the current parameters every this many
            updates (None: never). The default, `"auto"`: fits over a network (64
            numbers or more per trajectory, `problem.network_size`: a `gs.Shared` one
            or one per trajectory; or one fit over shared parameters) are re-recorded
            by `refresh_tol` where their replay checks its mesh, else every
            `_policies.auto_refresh_every` updates: 5 to 50, as often as keeps the
            records to ~10 % of the fit's time (50 for 256 trajectories in minibatches
            of 32, 7 without minibatches; B fits with minibatches get one fit's
            interval over all n, which is longer); least-squares fits every
            `_policies.LEAST_SQUARES_REFRESH` (10) updates, so that they end on a mesh
            recorded near their optimum; other fits never.
            A network trained on the mesh recorded for its initial weights stops
            improving or diverges (docs/calibrator.md, "The mesh during a fit").
        refresh_tol: re-record a fit's mesh as soon as one of its steps, replayed at
            the fit's current parameters, has an embedded error estimate above
            `refresh_tol` times the tolerance the mesh was recorded at (the
            controller accepted it below 1): the update that found it is run again on
            the new mesh, so results do not depend on when the host looks. The check
            costs no evaluation of the field; it is served where outputs come from
            the continuous extension of Tsit5 or Vern7 on the JAX replay
            (`general_replay`, `fused_replay`), and a number given elsewhere is
            refused saying so. None: off. The default, `"auto"`, is on for fits over a
            network with an optax optimizer, at `2 * n / batch_size` (2 without
            minibatches; a refresh records all n trajectories, so the costlier it is
            the more error it waits for): `_policies.REFRESH_TOL`, with what it was
            chosen by.
        drift_every, drift_tol: every `drift_every` updates, record afresh and compare
            the replayed final states with the fresh record's; if the relative change
            exceeds `drift_tol` adopt the fresh mesh. Figures land in `result.drift`.
        batch_size: each update uses this many of a fit's K trajectories (and their
            data: every data leaf then leads with `(B, K)`), drawn without replacement
            from the fit's key; the key is checkpointed, so a resumed fit draws the
            same batches. The loss history is then the minibatch loss. None: all K.
        checkpoint_dir, checkpoint_every: save the fit state with Orbax in
            `checkpoint_dir`, at the end of a fit, when it is interrupted (Ctrl-C) and
            every `checkpoint_every` updates (an int) or once that much wall time has
            passed since the last save (a `datetime.timedelta`; the default, None, is
            one minute). Each save costs ~20 ms of CPU in a writer process beside the
            fit's, so on fits of a few ms per update a time interval costs least. `fit()` on a
            directory with a checkpoint of the same setup resumes from it (see `fit`).
            A relative path is taken from the current directory; the directory is
            created and checked for writing here.
        devices, buckets, memory_budget: where the B * K trajectories are recorded and
            replayed (as `gs.value_and_grad`; docs/scale.md): split over devices (the
            fits' own state is replicated), grouped by recorded step count, in chunks
            under the budget. Results do not depend on them.

    One fit: when the problem's params are all `gs.Shared` and there is no
    `to_params`, the Calibrator fits those shared values, once, over all n
    trajectories -- a neural ODE's network, a model's global constants. Nothing then
    carries a fit axis: `theta0` is shaped as the shared values and defaults to them
    (the network the problem was built with), `data` is the one fit's (with
    `batch_size`, leaves leading with n), and `result.best().theta` is the fitted
    value (`result.theta` keeps B = 1 as every result).

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
        >>> one_at_a_time = cal.fit(jnp.ones(B), steps=300, tol=1e-12, progress=False, slots=1)
        >>> bool(jnp.allclose(one_at_a_time.theta, res.theta, rtol=1e-12, atol=0))
        True

        One fit of a rate shared by three trajectories, from the problem's own value:

        >>> ts = jnp.array([0.5, 1.0])
        >>> shared = gs.EnsembleProblem(f_jax=lambda t, y, k: -k * y,
        ...                             y0=jnp.array([[1.0], [2.0], [3.0]]),
        ...                             params=gs.Shared(jnp.array(1.0)), t_span=(0.0, 1.0))
        >>> obs = shared.y0[:, None, :] * jnp.exp(-0.7 * ts)[None, :, None]  # (n, len(ts), d)
        >>> cal = gs.Calibrator(shared, lambda ys, k, d: jnp.sum((ys - d) ** 2), data=obs,
        ...                     ts=ts, optimizer=optax.adam(0.05))
        >>> round(float(cal.fit(steps=300, progress=False).best().theta), 3)
        0.7
    """

    def __init__(self, prob, loss=None, to_params=None, data=None, optimizer=None, *,
                 residuals=None, to_y0=None, transform=None, rtol=1e-6, atol=1e-9, method=None, ts=None,
                 interpolate=None, max_steps=DEFAULT_MAX_STEPS, dt0=None, remat=None,
                 engine=None, recorder=None, refresh_every="auto", refresh_tol="auto",
                 drift_every=None,
                 drift_tol=None, batch_size=None, checkpoint_dir=None, checkpoint_every=None,
                 devices=None, buckets=None, memory_budget=None):
        # The keyword settings as given: a profile builds its Calibrator from them.
        self._settings = {k: v for k, v in locals().items()
                          if k not in ("self", "prob", "loss", "to_params", "data", "optimizer")}
        self.problem = as_problem(prob)
        if (loss is None) == (residuals is None):
            raise TypeError("give one of loss (loss(ys_b, theta_b, data_b) -> scalar) and "
                            "residuals (residuals(ys_b, theta_b, data_b) -> array)"
                            + ("" if loss is None else ", not both"))
        if not callable(loss if residuals is None else residuals):
            raise TypeError("loss must be callable as loss(ys_b, theta_b, data_b)"
                            if residuals is None else
                            "residuals must be callable as residuals(ys_b, theta_b, data_b)")
        if to_params is not None and not callable(to_params):
            raise TypeError("to_params must be callable as to_params(theta_b)")
        if to_y0 is not None and not callable(to_y0):
            raise TypeError("to_y0 must be callable as to_y0(theta_b) -> (K, d)")
        _validate.check_data(data)
        # One fit over the problem's shared parameters (a neural ODE's network): its
        # theta is the problem's params without the gs.Shared wrappers, and neither
        # theta0 nor data carries a fit axis (B = 1 inside).
        self.one_fit = to_params is None and all_shared(self.problem.params)
        if self.one_fit:
            to_params = resharing(self.problem.params)
            data = None if data is None else _validate._lead_with_one(data)
        # A network's field (shared: one fit's; or each trajectory's) gets stiffer as
        # it trains: "auto" refreshes its mesh, and a mesh that outgrew its width is
        # padded with headroom (`mesh.grown_width`) and replayed guarded.
        self.grows = self.one_fit or network_size(self.problem.params) >= NETWORK_SIZE
        if optimizer is None:  # least squares for residuals, but for a network's field
            optimizer = (_least_squares.default_solver(self.problem.y0.dtype)
                         if residuals is not None and not self.grows else optax.adam(1e-2))
        _least_squares.check_solver(optimizer, residuals, transform)
        self.least_squares = _least_squares.is_least_squares(optimizer)
        self.optimistix = _least_squares.is_optimistix(optimizer)
        if not self.optimistix and not (callable(getattr(optimizer, "init", None))
                                        and callable(getattr(optimizer, "update", None))):
            raise TypeError("optimizer must be an optax.GradientTransformation or an "
                            "optimistix solver (optx.LevenbergMarquardt, optx.BFGS)")
        if self.optimistix and batch_size is not None:
            raise ValueError(
                f"batch_size={batch_size} with optimizer={type(optimizer).__name__}: its "
                f"step compares a trial point with the last on one objective, which "
                f"minibatches change at every update; use an optax optimizer with "
                f"minibatches")
        self._growth = GROWTH if self.grows else 1.0
        auto_every = isinstance(refresh_every, str) and refresh_every == "auto"
        for name, v in (("refresh_every", refresh_every), ("drift_every", drift_every),
                        ("batch_size", batch_size)):
            if v is not None and not (name == "refresh_every" and auto_every) and (
                    not isinstance(v, int) or v < 1):
                also = ' or "auto"' if name == "refresh_every" else ""
                raise ValueError(f"{name} must be None{also} or a positive integer, "
                                 f"got {v!r}")
        if (drift_every is None) != (drift_tol is None):
            raise ValueError("drift_every and drift_tol go together")
        if recorder is not None and engine is None:
            engine = with_recorder(recorder)
        checkpoint_every = check_every(checkpoint_every)
        if checkpoint_every is not None and checkpoint_dir is None:
            raise ValueError("checkpoint_every needs checkpoint_dir")
        if drift_tol is not None and not (isinstance(drift_tol, (int, float, np.number))
                                          and drift_tol >= 0):
            raise ValueError(f"drift_tol must be a number >= 0, got {drift_tol!r}")
        if checkpoint_dir is not None:
            checkpoint_dir = check_directory(checkpoint_dir)
        self.residuals = residuals
        if residuals is not None:
            loss = _least_squares.half_squares(residuals)
        self.loss, self.to_params, self.to_y0, self.data = loss, to_params, to_y0, data
        self.optimizer, self.transform = optimizer, transform
        self._engine, self.passed_over, self.config = plan(
            self.problem, gradient=True, engine=engine, method=method, rtol=rtol, atol=atol,
            dt0=dt0, max_steps=max_steps, ts=ts, interpolate=interpolate, remat=remat,
            devices=devices, buckets=buckets, memory_budget=memory_budget)
        self.engine = self._engine.name
        self._arrangements = layout.Arrangements(
            self.config, self.problem.d, self.problem.y0.dtype.itemsize, self._growth)
        self.refresh_tol = _policies.check_refresh_tol(
            refresh_tol, self._engine, self.config, self.problem.n, batch_size,
            network=self.grows, optimistix=self.optimistix)
        if auto_every:
            refresh_every = _policies.auto_refresh_every(
                self.problem.n, batch_size, self.grows, self.least_squares,
                checked=self.refresh_tol is not None)
        self.refresh_every, self.drift_every = refresh_every, drift_every
        self.batch_size = batch_size
        self.drift_tol = None if drift_tol is None else float(drift_tol)
        self.checkpoint_dir, self.checkpoint_every = checkpoint_dir, checkpoint_every
        # Forward-mode replays for a least-squares Jacobian of few parameters, where
        # the engine serves them (`_least_squares`).
        self._forward = self.least_squares and refusal(self._engine, request_for(
            self.problem, gradient=True, method=self.config.method, rtol=rtol,
            mode="forward", interpolate=interpolate, ts=ts is not None)) is None
        self.objective = Objective(
            loss=loss, to_params=to_params, to_y0=to_y0, transform=transform,
            batch_size=batch_size, residuals=residuals,
            ys=self._engine.ys_function(self.problem, self.config,
                                        "reverse" if self.refresh_tol is None else "checked"),
            checked=self.refresh_tol is not None,
            ys_forward=self._engine.ys_function(self.problem, self.config, "forward")
            if self._forward else None)
        self._hold(None)
        self._replayed = eqx.filter_jit(lambda mesh, params, y0, arr: layout.run(
            self._unchecked, arr, mesh, params, y0))
        # What a record (at a refresh, a drift check) solves from, in one compiled call
        # (eager, the theta -> params map of the neural ODE benchmark's network took
        # ~7 ms a refresh; measured here).
        self._inputs = eqx.filter_jit(self.objective.inputs)
        self._max_updates = MAX_UPDATES_PER_CALL  # 1: one update per call (tests)

    def _unchecked(self, mesh, params, y0):
        """The objective's replay, its outputs only (a drift check's)."""
        ys = self.objective.ys(mesh, params, y0)
        return ys[0] if self.objective.checked else ys

    def _hold(self, held):
        """Hold the leaves `held` (None, or a pytree of bools shaped as the optimised
        parameters) at their starting values: a profile's fixed leaf
        (`_objective.make_update`)."""
        self._held = held
        self._update = eqx.filter_jit(make_updates(
            make_optimistix_update(self.objective, self.optimizer, held, self._forward,
                                   self.refresh_every if self.least_squares else None)
            if self.optimistix else make_update(self.objective, self.optimizer, held),
            self.refresh_tol))

    def _opt_init(self, u, static, mesh, y0, data):
        """The optimizer state of the fits at `u` (leaves lead with B); a
        least-squares solver's reads the fits' mesh rows, data and y0 (their shapes)."""
        if not self.optimistix:
            return _vmapped_init(self.optimizer, u)
        return _least_squares.init(self.objective, self.optimizer, u, static, mesh, data,
                                   y0, self._held, self._forward)

    # -- records --------------------------------------------------------------------

    def _record(self, u, static, K, y0, width=0):
        """Record at the current parameters; per-fit record success. The mesh is padded
        to one of `Mesh.widened`'s few widths, at least `width`."""
        if not self._engine.serves("record"):
            return None, None
        params, y0 = self._inputs(u, static, K, y0)
        mesh = record_rows(self._engine, self.problem, self.config, params=params, y0=y0)
        ok = np.asarray(mesh.status).reshape(-1, K) == Status.SUCCESS
        return mesh.widened(width), ok.all(axis=1)

    def _mesh(self, arrays):
        if arrays is None:
            return None
        return Mesh(**arrays, method=self.config.method, rtol=self.config.rtol,
                    atol=self.config.atol, recorder=recorder_of(self._engine),
                    guarded=self.grows)

    # -- the loop -------------------------------------------------------------------

    def fit(self, theta0=None, steps=400, tol=None, grad_tol=None, progress=True, key=None,
            resume=True, slots=None):
        """Run the fits for up to `steps` updates each.

        With `checkpoint_dir`, a directory holding a checkpoint of the same fit is
        resumed from its newest good step (which is printed), and the fit's end -- and
        an interruption -- are saved too. The same fit means the same fingerprint:
        problem, data, theta0, tolerances, engine, refresh settings, `tol`/`grad_tol`,
        and the traced loss and optimizer (a changed learning rate or loss counts); a
        checkpoint of another fit is refused naming what changed. Saves run in the
        background while the fit goes on; a save that fails (a full disk) warns, naming
        the last step saved, and the fit goes on. `steps` is a cap, not
        part of the fit: a larger one extends a finished fit (fits stopped by the cap go
        on; converged and failed ones stay so; `history` grows), bit for bit as one
        uninterrupted run.

        Args:
            theta0: initial parameters (constrained space), leaves leading with B. One
                fit over shared parameters (see the class): shaped as their values,
                without B; None starts from the problem's own.
            steps: the step cap per fit (and the length of `result.history`).
            tol: a fit converges when its loss is <= tol.
            grad_tol: ... or when its gradient norm (unconstrained space) is <= this.
            progress: show a progress bar with the loss range and converged count.
            key: a `jax.random` key kept (and checkpointed) with the fit state.
            resume: False deletes the directory's checkpoints and starts over.
            slots: run at most this many fits at once (None: all of them): when a
                slot's fit stops (converged, step cap, failed) the slot takes the next
                start, lowest index first. Each start's result is the one it gets in
                any number of slots (its own steps, history, refreshes and minibatch
                draws); checkpoints hold every start, so a fit resumes with any slots.

        Returns:
            A `FitResult`.

        Raises:
            KeyboardInterrupt: re-raised after saving a checkpoint of the work so far
                (with `checkpoint_dir`) and printing how to resume.
            gs.calibrate.CheckpointMismatch: `checkpoint_dir` holds another fit.
            gs.calibrate.CheckpointLocked: another live fit writes to `checkpoint_dir`.

        Examples:
            >>> import tempfile, jax.numpy as jnp, optax, gradsolve as gs
            >>> prob = gs.EnsembleProblem(f_jax=lambda t, y, k: -k * y, y0=jnp.ones((2, 1)),
            ...                           params=jnp.ones(2), t_span=(0.0, 1.0))
            >>> run = tempfile.mkdtemp() + "/fit"
            >>> def calibrator():
            ...     return gs.Calibrator(prob, lambda ys, k, d: jnp.sum((ys - d) ** 2),
            ...                          data=jnp.full((2, 1, 1), 0.5), optimizer=optax.adam(0.1),
            ...                          checkpoint_dir=run, checkpoint_every=10)
            >>> first = calibrator().fit(jnp.ones(2), steps=20, progress=False)
            >>> more = calibrator().fit(jnp.ones(2), steps=30, progress=False)  # extends it
            >>> more.resumed_from, more.updates, more.history.shape
            (20, 30, (30, 2))
        """
        return _driver.run(self, theta0, steps, tol, grad_tol, progress, key, resume, slots)

    def profile(self, res, name, grid, steps=400, tol=None, grad_tol=None, progress=True,
                slots=None):
        """The profile likelihood of one parameter, all grid points as one batched job.

        At each value of `grid` the parameter `name` (a leaf of theta holding one
        number per fit, e.g. `"k"` for `theta["k"]`) is held fixed and the others are
        re-optimised, every grid point a concurrent fit warm-started from `res`'s best
        fit (`res.best()`), on that fit's data. The optimizer, transforms, tolerances
        and engine are this Calibrator's; no checkpoints are written.

        Args:
            res: a `FitResult` of this Calibrator (a multistart, say).
            name: the profiled leaf, by name as in `res.table()` (`"k"`, `"rates.k1"`).
            grid: the values to fix it at (constrained space).
            steps, tol, grad_tol, progress, slots: as `fit`, for the re-optimisations
                (`slots` bounds how many grid points run at once).

        Returns:
            A `FitResult` with one fit per grid point (`theta[name]` is the grid),
            `.plot(kind="profile", name=name)` to draw it.
        """
        return _profile.profile(self, res, name, grid, steps=steps, tol=tol,
                                grad_tol=grad_tol, progress=progress, slots=slots)

    def _step(self, window, static, tol, grad_tol, cap, n, refill, fresh):
        """Up to `n` compiled updates of the slots' fits (`_objective.make_updates`);
        `fresh`: the slots whose meshes were just recorded."""
        mesh = self._mesh(window.state.mesh)
        B = window.state.active.shape[0]
        batch = None if self.batch_size is None else B * self.batch_size
        return self._update(window.state, static, mesh, window.data, window.y0,
                            jax.device_put(window.start), tol, grad_tol, cap,
                            np.asarray(n, np.int32), np.asarray(refill),
                            jax.device_put(np.asarray(fresh, bool)),
                            self._arrangement(mesh, window.y0.shape[0], batch))

    def _arrangement(self, mesh, n, batch=None, cache=True):
        """Where `n` trajectories are replayed on `mesh` (`layout.Arrangements`)."""
        return self._arrangements(mesh, n, batch, cache) if self._engine.splits else None

    def _initial_state(self, u, static, S, K, steps, key):
        """The state of S starts, every one recorded at its theta0 (so the mesh width,
        and with it the compiled update, is fixed before the first update) and queued
        for a slot, or failed."""
        mesh, ok = self._record(u, static, K, self.problem.y0)
        if mesh is not None and self.grows:  # headroom from the start (`grown_width`)
            mesh = mesh.padded(grown_width(int(np.max(mesh.n_steps)), 0, self._growth))
        ok = np.ones(S, bool) if ok is None else ok
        dtype = self.problem.y0.dtype
        return jax.device_put(FitState(
            u=u, opt_state=self._opt_init(u, static, mesh, self.problem.y0, self.data),
            active=ok,
            status=np.where(ok, FitStatus.QUEUED, FitStatus.RECORD_FAILED).astype(np.int32),
            steps=np.zeros(S, np.int32), loss=np.full(S, np.nan, dtype),
            grad_norm=np.full(S, np.nan, dtype), history=None, drift=None,
            update=np.asarray(0, np.int32), refreshes=np.asarray(0, np.int32),
            key=jax.random.key_data(jax.random.key(0)) if key is None else jax.random.key_data(key),
            mesh=_mesh_arrays(mesh)))._replace(history=np.full((steps, S), np.nan, dtype),
                                               drift=np.full((steps, S), np.nan, dtype))


@eqx.filter_jit
def _vmapped_init(optimizer, u):
    """Every fit's optax state at `u`, as one compiled program (cached per optimizer
    and shapes): run eagerly, Adam's init on a network compiled one small program per
    leaf shape (11 on the neural ODE example, 0.25 s of its first update)."""
    return jax.vmap(optimizer.init)(u)
