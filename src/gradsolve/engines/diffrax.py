"""`diffrax`: Diffrax under `vmap`; forward solves, and gradients as the baseline
(`RecursiveCheckpointAdjoint`, or `ForwardMode` for `mode="forward"`)."""

import importlib.util
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ..methods import get, names
from ..problem import field, param_axes
from ..recorder import first_step
from ..status import Status
from ._base import Differentiates, Engine, Solves


_SOLVERS = {"tsit5": "Tsit5"}
_SOLVES: dict = {}


def _diffrax():
    import diffrax  # optional: imported when the engine runs, not with gradsolve
    return diffrax


class Diffrax(Engine, Solves, Differentiates):
    """Diffrax under `vmap` with `PIDController(rtol, atol)`.

    The first step is the general recorder's (`recorder.first_step`, Hairer & Wanner's
    rule, which Diffrax 0.7.2 skips for wrapped terms), so both solve the same problem.

    Args:
        checkpoints: `RecursiveCheckpointAdjoint(checkpoints=...)` for reverse-mode
            gradients (None: Diffrax's default, about log(max_steps) checkpoints).
        solver: a Diffrax solver to use instead of the one matching `method` (for
            baselines such as `diffrax.Kvaerno5()` or `diffrax.Dopri8()`).
    """

    name: ClassVar[str] = "diffrax"
    routes: ClassVar[tuple[str, ...]] = ("solve",)
    # Equinox's closure conversion inside Diffrax refuses shard_map's device-local
    # arguments (jax 0.10 / diffrax 0.7.2); automatic sharding of its vmapped loop
    # would make every loop condition a collective -- the trap layout/ avoids.
    one_device: ClassVar[str] = "Diffrax's solve does not run under shard_map"
    checkpoints: int | None = None
    solver: Any = None

    @property
    def methods(self):
        return names() if self.solver is not None else tuple(_SOLVERS)

    def method_refusal(self, method):
        return f"Diffrax has no {method!r} solver"

    def supports(self, request):
        if importlib.util.find_spec("diffrax") is None:
            return "diffrax is not installed"
        if request.ts and request.interpolate is False:
            return ("Diffrax serves ts from its own interpolant; interpolate=False (an "
                    "integrated step per output) runs on the general engine")
        return None

    def _solve_fn(self, prob, cfg, adjoint, ts, throw):
        diffrax = _diffrax()
        solver = self.solver or getattr(diffrax, _SOLVERS[cfg.method])()
        f = field(prob.f_jax)
        t0, t1 = prob.t_span
        controller = diffrax.PIDController(rtol=cfg.rtol, atol=cfg.atol)
        saveat = diffrax.SaveAt(ts=ts) if ts is not None else diffrax.SaveAt(t1=True)
        term = diffrax.ODETerm(f)

        def one(y0, p, dt0):
            sol = diffrax.diffeqsolve(
                term, solver, t0, t1, dt0, y0, args=p, saveat=saveat,
                stepsize_controller=controller, max_steps=cfg.max_steps,
                adjoint=adjoint, throw=throw)
            ys = sol.ys if ts is not None else sol.ys[0]
            return ys, sol.result, sol.stats

        def run(params, y0):
            if cfg.dt0 is None:
                dt0 = jax.lax.stop_gradient(first_step(
                    prob.f_jax, get(cfg.method), y0, params, t0, cfg.rtol, cfg.atol)[0])
            else:
                dt0 = jnp.broadcast_to(jnp.asarray(cfg.dt0, y0.dtype), y0.shape[:1])
            return jax.vmap(one, in_axes=(0, param_axes(params), 0))(y0, params, dt0)
        return run

    def solve(self, prob, cfg):
        diffrax = _diffrax()
        key = (prob.f_jax, prob.t_span, id(self.solver), cfg.method, cfg.rtol, cfg.atol,
               cfg.max_steps, None if cfg.ts is None else cfg.ts.tobytes(),
               None if cfg.dt0 is None else np.asarray(cfg.dt0).tobytes())
        run = _SOLVES.pop(key, None)
        if run is None:  # compile once per problem and settings, not once per call
            run = eqx.filter_jit(self._solve_fn(
                prob, cfg, diffrax.RecursiveCheckpointAdjoint(), cfg.ts, throw=False))
        _SOLVES[key] = run  # most recent last; keep the newest few
        while len(_SOLVES) > 16:
            _SOLVES.pop(next(iter(_SOLVES)))
        ys, result, stats = run(prob.params, prob.y0)
        status = jnp.where(result == diffrax.RESULTS.successful, Status.SUCCESS,
                           jnp.where(result == diffrax.RESULTS.max_steps_reached,
                                     Status.MAX_STEPS, Status.NONFINITE))
        return ys, status, stats["num_accepted_steps"], stats["num_rejected_steps"]

    def ys_function(self, prob, cfg, mode):
        diffrax = _diffrax()
        if mode == "forward":
            adjoint = diffrax.ForwardMode()
        else:
            adjoint = diffrax.RecursiveCheckpointAdjoint(checkpoints=self.checkpoints)
        # No mesh to inspect beforehand: a failed solve raises inside the gradient
        # (Diffrax's own runtime check) instead of returning a wrong value.
        run = self._solve_fn(prob, cfg, adjoint, cfg.ts, throw=True)
        return lambda mesh, params, y0: run(params, y0)[0]
