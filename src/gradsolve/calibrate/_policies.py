"""A fit's periodic behaviours, between calls of the compiled update loop.

Each has one shape: built when the fit starts, `due(window, done)` -- how many
updates the next call may run before the policy wants the host back (None: no
bound) -- and `apply(...)` between calls. The driver (`_driver.run`) runs a call of
as many updates as every policy allows (`updates_due`), then applies them:

- `Refresh` (before a call): re-record a running fit's mesh when its own update count
  reaches a multiple of `refresh_every` (`auto_refresh_every`: what "auto" means for a
  network's field, a least-squares fit and the others), when the drift check every
  `drift_every` finds its outputs moved more than `drift_tol`, or when the compiled
  loop stopped because a step of its mesh failed the error check (`refresh_tol`);
- `Saves` (after a call): checkpoint cadence, every so many updates or a wall-time
  interval (`_checkpoint.Schedule`), and the save at the fit's end or interruption.

Two others have no host-side due: slot refill (`_slots.fill`, before every call) and
minibatch draws (inside the compiled update, keyed by each fit's own update count).
"""

import equinox as eqx
import jax
import numpy as np

from . import _least_squares, _slots
from ._checkpoint import Schedule
from ._objective import _where
from ._state import FitStatus
from ..replay import checks_mesh

# The wall time a call of the compiled loop aims at: the host returns between calls to
# refresh, save, report progress and take Ctrl-C, so a call runs as many updates as fit
# in CALL_SECONDS by the last call's pace (at most MAX_UPDATES_PER_CALL), cut at the
# next update where a refresh, drift check or counted save is due. Results do not
# depend on it: every update, one per call or many, runs the same compiled body.
CALL_SECONDS = 0.1


# refresh_every="auto" for a fit over a network (`gs.Shared` parameters of
# config.NETWORK_SIZE numbers or more) whose replay does not check its mesh
# (`refresh_tol`: kernel_adjoint, Rosenbrock methods, no `ts`, integrated outputs):
# re-record as often as keeps the records to ~10 % of the fit's time. A record solves
# the fit's K trajectories forward once; an update replays `rows` of them (its
# minibatch, else all K) forward and backward; on Diffrax's neural ODE example a record
# of 256 trajectories took ~4.6 updates of 32 rows (26 ms against 5.6 ms), ~0.6 update
# per K / rows. So every ceil(AUTO_REFRESH_PER_RATIO * K / rows) updates, within
# AUTO_REFRESH_RANGE. Measured (benchmarks/neural_ode.py): the Diffrax example (K / rows
# = 8: every 50) reached a full-data loss of 0.2197 where never refreshing reached
# 0.2379 ("refresh": 300 updates); DiffEqFlux's spiral (K = rows = 1: every 7) went from
# a loss of 192 to 1.03 in 500 updates (the default before refresh_tol) and to 0.289
# every 5, but to 196 never refreshing and 4.5e4 every 25 ("spiral", 9f7ee5d; an
# earlier run, its outputs different in the last bits: 0.893, 0.577, 1.2e4, 0.507 --
# Adam at 0.05 there turns roundoff into another path; Diffrax's own gradient: 0.075).
AUTO_REFRESH_PER_RATIO = 6.25
AUTO_REFRESH_RANGE = (5, 50)


# refresh_every="auto" for a least-squares fit: it converges in tens of updates, often
# far from the parameters its mesh was recorded at, and should end on a mesh recorded
# near its optimum. Measured on recipes/multistart.py (rtol 1e-8, 32 starts, 8 slots):
# refreshing every 50 updates (the converged fits then never refreshed) left the best
# fit 1.6e-6 from SciPy's loss and 1e-6 from its parameters; every 10, 1.3e-8 and
# 3e-8, in 320 updates and 13.6 s with compiles (22 s every 50: fewer updates, same
# compiles; each refresh evaluates the fit anew, its first update after one a
# re-evaluation).
LEAST_SQUARES_REFRESH = 10


# refresh_tol="auto": a fit over a network re-records its mesh as soon as a step of it,
# replayed at the fit's parameters, has an error ratio above REFRESH_TOL * n / rows
# (the recorder accepted it below 1; a refresh records all n trajectories, ~0.6 update
# of `rows` per n / rows, so the costlier it is the more error it waits for). Measured
# (2026-12-07, 500 updates from 4 seeds; 220 updates of the Diffrax example):
# - DiffEqFlux's spiral (n = rows = 1, Adam at 0.05): at REFRESH_TOL 2, 31-45
#   re-records and final losses 0.023, 0.148, 0.023, 0.031 where Diffrax's own
#   gradient ended at 0.075, 0.107, 0.047, 0.194 and refreshing every 7 updates (the
#   default before) at 1.03, 0.39, 21.9, 0.50; at 8: 0.039, 19.0, 0.17, 0.029; at 16:
#   0.024, 0.23, 0.096, 0.37.
# - Diffrax's neural ODE example (n / rows = 8, Adam at 3e-3): 38, 17, 12 and 3
#   re-records at 2, 4, 8 and 16 (16 = 2 * 8), 10.6, 7.4, 7.0 and 5.3 ms per update,
#   the full-data loss 0.2253 at every one (refreshing every 50 updates with no
#   check: 5.6 ms, 0.2256).
REFRESH_TOL = 2.0


# `_where` over a least-squares state at a refresh, as one compiled program (eager, a
# small program per leaf shape).
_where_compiled = eqx.filter_jit(_where)


def check_refresh_tol(refresh_tol, engine, cfg, n: int, batch_size, network: bool,
                      optimistix: bool):
    """The Calibrator's `refresh_tol`, resolved: "auto" is `REFRESH_TOL * n / rows`
    for a fit over a network with an optax optimizer where the engine's replay checks
    its mesh (`replay.checks_mesh`), else None; a number needs that check (a clear
    error otherwise) and must be >= 1 (a fresh mesh's steps are below 1)."""
    served = engine.checks_mesh and checks_mesh(cfg)
    if isinstance(refresh_tol, str) and refresh_tol == "auto":
        if not (served and network and not optimistix):
            return None
        return REFRESH_TOL * n / (n if batch_size is None else min(batch_size, n))
    if refresh_tol is None:
        return None
    if isinstance(refresh_tol, bool) or not isinstance(refresh_tol, (int, float, np.number)) \
            or not refresh_tol >= 1:
        raise ValueError(f'refresh_tol must be None, "auto" or a number >= 1, got '
                         f"{refresh_tol!r}")
    if optimistix:
        raise ValueError("refresh_tol is for optax optimizers; an optimistix solver's "
                         "fit refreshes every refresh_every updates")
    if not served:
        raise ValueError(
            f"refresh_tol={refresh_tol!r} needs the replay's error check: engine "
            f"general_replay or fused_replay (this is {engine.name}), output times ts "
            f"served from the continuous extension (interpolate) of tsit5 or vern7 "
            f"(this is method={cfg.method!r}, ts {'given' if cfg.ts is not None else 'None'}"
            f", interpolate={cfg.interpolate})")
    return float(refresh_tol)


def auto_refresh_every(n: int, batch_size, network: bool, least_squares: bool,
                       checked: bool = False):
    """`refresh_every="auto"`: for a fit over a network (`network`) with `n`
    trajectories and minibatches of `batch_size` (None: all n), None where its replay
    checks the mesh (`checked`: `refresh_tol` re-records it when due), else see
    `AUTO_REFRESH_PER_RATIO`; `LEAST_SQUARES_REFRESH` for a least-squares fit, and
    None (never) for the others."""
    if network and checked:
        return None
    if not network:
        return LEAST_SQUARES_REFRESH if least_squares else None
    rows = n if batch_size is None else batch_size
    return int(np.clip(np.ceil(AUTO_REFRESH_PER_RATIO * n / rows), *AUTO_REFRESH_RANGE))


def updates_due(policies, window, done, pace, max_updates, seconds_left=None):
    """How many updates the next call may run: as many as fit in CALL_SECONDS at
    `pace` (seconds per update, None before the first; 1 then, the call that compiles)
    or in `seconds_left` (before a save on a wall-time interval), at most
    `max_updates`, and no more than any policy's `due`."""
    if pace is None:
        n = 1
    else:
        seconds = CALL_SECONDS if seconds_left is None else min(CALL_SECONDS, seconds_left)
        n = int(np.clip(seconds / max(pace, 1e-9), 1, max_updates))
    for policy in policies:
        due = policy.due(window, done)
        if due is not None:
            n = min(n, due)
    return max(n, 1)


class Refresh:
    """Re-records of the running fits' meshes (`Calibrator`'s `refresh_every`,
    `drift_every`, `drift_tol`), for fits of K trajectories with `static` the
    non-array part of their unconstrained parameters."""

    def __init__(self, cal, static, K):
        self.cal, self.static, self.K = cal, static, K
        self.periods = tuple(e for e in (cal.refresh_every, cal.drift_every) if e is not None)

    def due(self, window, done):
        """Updates until a running fit's refresh or drift check is due (`apply` tests
        them per fit, before its update)."""
        steps = np.asarray(window.state.steps)[np.asarray(window.state.active)]
        if window.state.mesh is None or not steps.size or not self.periods:
            return None
        return min(int((every - steps % every).min()) for every in self.periods)

    def apply(self, window, drift, stale=None):
        """`(window, refreshed)`: the window with the due fits' mesh rows re-recorded
        at their current parameters (the others keep theirs), and which slots were.
        Due: by `refresh_every`, by a drift check, or `stale` (the slots the compiled
        loop stopped for, `refresh_tol`). Fits whose record failed stop with
        RECORD_FAILED. Drift checks write into `drift` (the state's, on the host)."""
        cal, K = self.cal, self.K
        ws = window.state
        none = np.zeros(np.shape(ws.active), bool)
        stale = none if stale is None else np.asarray(stale) & np.asarray(ws.active)
        if ws.mesh is None or not (self.periods or stale.any()):
            return window, none
        steps = np.asarray(ws.steps)
        live = np.asarray(ws.active) & (steps > 0)

        def every(n):
            return live & (steps % n == 0) if n is not None else np.zeros_like(live)
        due, check = every(cal.refresh_every) | stale, every(cal.drift_every)
        if not (due | check).any():
            return window, none
        current = cal._mesh(ws.mesh)
        fresh, ok = cal._record(ws.u, self.static, K, window.y0, current.columns)
        if check.any():
            change = self._drift(current, fresh, ws.u, window.y0)
            drift[steps[check], window.start[check]] = change[check]
            due = due | (check & (change > cal.drift_tol))
        if not due.any():
            return window, none
        failed = due & ~ok
        opt_state = ws.opt_state
        if cal.optimistix:  # its point and Jacobian were evaluated on the old mesh
            started = _least_squares.restart(opt_state, cal._opt_init(
                ws.u, self.static, current, window.y0, window.data))
            opt_state = _where_compiled(np.asarray(due), started, opt_state)
        return window._replace(state=ws._replace(
            mesh=_slots.adopt(ws.mesh, fresh, due, K, cal._growth), opt_state=opt_state,
            refreshes=jax.device_put(np.asarray(ws.refreshes) + 1),
            active=jax.device_put(np.asarray(ws.active) & ~failed),
            status=jax.device_put(np.where(failed, FitStatus.RECORD_FAILED,
                                           np.asarray(ws.status)).astype(np.int32)))), due

    def _drift(self, mesh, fresh, u, y0):
        """Per fit, the largest relative change of its replayed outputs from `mesh` to
        `fresh`."""
        cal, K = self.cal, self.K
        params, y0 = cal._inputs(u, self.static, K, y0)
        old, new = (np.asarray(cal._replayed(
            m, params, y0, cal._arrangement(m, y0.shape[0], cache=False))
        ).reshape(y0.shape[0], -1) for m in (mesh, fresh))
        change = np.linalg.norm(old - new, axis=1) / np.linalg.norm(new, axis=1)
        return change.reshape(-1, K).max(axis=1)


class Saves:
    """Checkpoints of a fit to `store` (`_checkpoint.Checkpoints`) with `meta`, on
    `checkpoint_every`'s cadence. Written in the background while the fit goes on; a
    save that fails is warned about (by the store) and the next one writes again."""

    def __init__(self, store, every, meta):
        self.store, self.meta = store, meta
        self.schedule = Schedule(every)
        self.tried = None  # the last step this fit tried to save

    def seconds_left(self):
        return self.schedule.seconds_left()

    def due(self, window, done):
        every = self.schedule.every
        return every - done % every if isinstance(every, int) else None

    def apply(self, state, window, done):
        """After a call: the state with the window's fits written back (in NumPy: the
        window stays the fits' copy on the device) saved as step `done` if a save is
        due. A call that ran no update (its first found a stale mesh) leaves `done`
        where the last save left it: that step is not saved twice (orbax refuses a
        step that exists, and the fit warned)."""
        if done == self.tried or not self.schedule.due(done):
            return
        self.store.save(done, _slots.flush(state, window, to_device=False)._asdict(),
                        self.meta)
        self.tried = done
        self.schedule.saved()

    def finish(self, state, done):
        """At the end (or an interruption): step `done` saved unless its save was
        tried already, and every save waited for (a failure is a warning either way:
        the state in hand holds every update)."""
        self.store.wait()  # the save under way, if any
        if self.store.saved != done and self.tried != done:
            self.store.save(done, state._asdict(), self.meta)
            self.store.wait()
