"""Engines: each way of solving an ensemble or differentiating it is a small final
module with `supports(request) -> reason | None`. The router (router.py) picks one.

Engines in this version:
- `general_replay`: the batched JAX recorder, then the padded JAX replay.
- `general`: the batched JAX adaptive solve, forward only.
- `diffrax`: Diffrax under `vmap`; forward solves, and gradients as the baseline
  (`RecursiveCheckpointAdjoint`, or `ForwardMode` for `mode="forward"`).
"""

import abc
import dataclasses
import functools
import importlib.util
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from . import control, methods
from .config import Config
from .record import field, run_record
from .replay import _replay
from .problem import param_axes
from .status import Status


@dataclasses.dataclass(frozen=True)
class Request:
    """What the router reads: is a gradient wanted, for what kind of problem."""

    gradient: bool
    stiff: bool
    d: int
    method: str
    fused: bool = False


class Engine(eqx.Module):
    """An implementation of solve and/or gradient. Subclasses are final."""

    name: ClassVar[str]
    records: ClassVar[bool]

    @abc.abstractmethod
    def supports(self, request: Request) -> str | None:
        """`None` if this engine can serve `request`, else the reason it cannot."""

    @abc.abstractmethod
    def solve(self, prob, cfg: Config):
        """Forward solve: `(ys, status, n_accepted, n_rejected)`."""

    def record(self, prob, cfg: Config, params=None, y0=None):
        """The mesh a replay engine differentiates on (None for other engines)."""
        return None

    @abc.abstractmethod
    def ys_function(self, prob, cfg: Config, mode: str):
        """A pure function `(mesh, params, y0) -> ys` to differentiate."""


def _general_solve(prob, cfg: Config):
    mesh, y_end = run_record(prob, cfg)
    ys = y_end
    if cfg.ts is not None:
        ys = _replay(prob.f_jax, methods.get(cfg.method), mesh, prob.params, prob.y0,
                     cfg.ts, False, cfg.interpolate)
    return ys, mesh.status, mesh.n_steps, mesh.n_rejected


class GeneralReplay(Engine):
    """Batched JAX recorder, then the padded JAX replay (any f, any d)."""

    name: ClassVar[str] = "general_replay"
    records: ClassVar[bool] = True

    def supports(self, request):
        return None

    def solve(self, prob, cfg):
        return _general_solve(prob, cfg)

    def record(self, prob, cfg, params=None, y0=None):
        return run_record(prob, cfg, params=params, y0=y0)[0]

    def ys_function(self, prob, cfg, mode):
        method = methods.get(cfg.method)

        def ys_fn(mesh, params, y0):
            ys = _replay(prob.f_jax, method, mesh, params, y0, cfg.ts, cfg.remat,
                         cfg.interpolate)
            # Failed trajectories (allowed by on_failure="mask") carry no gradient.
            ok = (mesh.status == Status.SUCCESS).reshape((-1,) + (1,) * (ys.ndim - 1))
            return jnp.where(ok, ys, jax.lax.stop_gradient(ys))
        return ys_fn


class General(Engine):
    """The batched JAX adaptive solve; forward only."""

    name: ClassVar[str] = "general"
    records: ClassVar[bool] = False

    def supports(self, request):
        if request.gradient:
            return "forward only (gradients: 'general_replay')"
        return None

    def solve(self, prob, cfg):
        return _general_solve(prob, cfg)

    def ys_function(self, prob, cfg, mode):
        raise ValueError("engine 'general' is forward only")


_DIFFRAX_SOLVERS = {"tsit5": "Tsit5"}


class Diffrax(Engine):
    """Diffrax under `vmap` with `PIDController(rtol, atol)`.

    The first step is the same as the general recorder's (Hairer & Wanner's rule,
    which Diffrax 0.7.2 skips for wrapped terms), so both solve the same problem.

    Args:
        checkpoints: `RecursiveCheckpointAdjoint(checkpoints=...)` for reverse-mode
            gradients (None: Diffrax's default, about log(max_steps) checkpoints).
        solver: a Diffrax solver to use instead of the one matching `method` (for
            baselines such as `diffrax.Kvaerno5()` or `diffrax.Dopri8()`).
    """

    name: ClassVar[str] = "diffrax"
    records: ClassVar[bool] = False
    checkpoints: int | None = None
    solver: Any = None

    def supports(self, request):
        if importlib.util.find_spec("diffrax") is None:
            return "diffrax is not installed"
        if self.solver is None and request.method not in _DIFFRAX_SOLVERS:
            return f"Diffrax has no {request.method!r} solver"
        return None

    def _solve_fn(self, prob, cfg, adjoint, ts, throw):
        import diffrax

        solver = self.solver or getattr(diffrax, _DIFFRAX_SOLVERS[cfg.method])()
        method = methods.get(cfg.method)
        f = field(prob.f_jax)
        t0, t1 = (float(t) for t in prob.t_span)
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
            axes = param_axes(params)
            if cfg.dt0 is None:
                first = functools.partial(control.initial_step, f,
                                          error_order=method.error_order,
                                          rtol=cfg.rtol, atol=cfg.atol)
                t = jnp.full(y0.shape[:1], t0, y0.dtype)
                dt0 = jax.lax.stop_gradient(
                    jax.vmap(first, in_axes=(0, 0, axes))(t, y0, params))
            else:
                dt0 = jnp.broadcast_to(jnp.asarray(cfg.dt0, y0.dtype), y0.shape[:1])
            return jax.vmap(one, in_axes=(0, axes, 0))(y0, params, dt0)
        return run

    def solve(self, prob, cfg):
        import diffrax

        run = eqx.filter_jit(self._solve_fn(prob, cfg, diffrax.RecursiveCheckpointAdjoint(),
                                            cfg.ts, throw=False))
        ys, result, stats = run(prob.params, prob.y0)
        status = jnp.where(result == diffrax.RESULTS.successful, Status.SUCCESS,
                           jnp.where(result == diffrax.RESULTS.max_steps_reached,
                                     Status.MAX_STEPS, Status.NONFINITE))
        return ys, status, stats["num_accepted_steps"], stats["num_rejected_steps"]

    def ys_function(self, prob, cfg, mode):
        import diffrax

        if mode == "forward":
            adjoint = diffrax.ForwardMode()
        else:
            adjoint = diffrax.RecursiveCheckpointAdjoint(checkpoints=self.checkpoints)
        # No mesh to inspect beforehand: a failed solve raises inside the gradient
        # (Diffrax's own runtime check) instead of returning a wrong value.
        run = self._solve_fn(prob, cfg, adjoint, cfg.ts, throw=True)
        return lambda mesh, params, y0: run(params, y0)[0]


ENGINES: dict[str, Engine] = {e.name: e for e in (GeneralReplay(), General(), Diffrax())}


def engine_names() -> tuple[str, ...]:
    """Names of the engines built into this version."""
    return tuple(ENGINES)
