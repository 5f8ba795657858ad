"""Engines: each way of solving an ensemble or differentiating it is a small final
module with `supports(request) -> reason | None`. The router (router.py) picks one.

Engines in this version:
- `fused`: a Warp kernel, one thread per trajectory, forward only (registered fields).
- `fused_replay`: the fused (Warp) recorder, then the padded JAX replay.
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
from .problem import field
from .recorder import run_record
from .replay import _replay
from .problem import param_axes
from .status import Status


@dataclasses.dataclass(frozen=True)
class Request:
    """What the router reads: is a gradient wanted, for what kind of problem."""

    gradient: bool
    stiff: bool
    d: int
    method: str | None = None
    fused: bool = False
    jacobian: bool = False
    rtol: float | None = None
    fused_why: str | None = None  # why the field has no fused form, when it has none


# The router's state-dimension cutoff for the fused kernels, per Warp device. On a GPU
# the limit is the per-thread register file (the design's 64 keeps far inside it); on
# this project's 2-core CPU the fused kernel stops beating the batched JAX engine
# between d = 8 and d = 16 (benchmarks/fused_forward.py, docs/benchmarks.md).
FUSED_MAX_D = {"cuda": 64, "cpu": 8}
FUSED_METHODS = ("tsit5", "rosenbrock23")
# Below this rtol a stiff request without a named method leaves the fused path: at
# rtol 1e-10 Rosenbrock23 ran past 4096 steps on Robertson where Rodas5P took ~100.
ROSENBROCK23_MIN_RTOL = 1e-6


class Engine(eqx.Module):
    """An implementation of solve and/or gradient. Subclasses are final."""

    name: ClassVar[str]
    records: ClassVar[bool]

    def default_method(self, request: Request) -> str:
        """The method this engine runs when none is asked for."""
        return "rodas5p" if request.stiff else "tsit5"

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


def _replay_ys_function(prob, cfg):
    method = methods.get(cfg.method)

    def ys_fn(mesh, params, y0):
        # Failed trajectories (allowed by on_failure="mask") are masked by the one
        # rule in `replay._replay`: zero outputs, zero gradients.
        return _replay(prob.f_jax, method, mesh, params, y0, cfg.ts, cfg.remat,
                       cfg.interpolate, mask=True)
    return ys_fn


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
        return _replay_ys_function(prob, cfg)


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
_DIFFRAX_SOLVES: dict = {}


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
        method = request.method or self.default_method(request)
        if self.solver is None and method not in _DIFFRAX_SOLVERS:
            return f"Diffrax has no {method!r} solver"
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

        key = (prob.f_jax, prob.t_span, id(self.solver), cfg.method, cfg.rtol, cfg.atol,
               cfg.max_steps, None if cfg.ts is None else cfg.ts.tobytes(),
               None if cfg.dt0 is None else np.asarray(cfg.dt0).tobytes())
        run = _DIFFRAX_SOLVES.pop(key, None)
        if run is None:  # compile once per problem and settings, not once per call
            run = eqx.filter_jit(self._solve_fn(
                prob, cfg, diffrax.RecursiveCheckpointAdjoint(), cfg.ts, throw=False))
        _DIFFRAX_SOLVES[key] = run  # most recent last; keep the newest few
        while len(_DIFFRAX_SOLVES) > 16:
            _DIFFRAX_SOLVES.pop(next(iter(_DIFFRAX_SOLVES)))
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


def _fused_refusal(request: Request) -> str | None:
    """Why the fused kernels cannot run this request, or None."""
    if not request.fused:
        return request.fused_why or "f_jax has no fused form (gs.register_field translates one)"
    from .warp._runtime import device
    limit = FUSED_MAX_D[device()]
    if request.d > limit:
        return (f"d = {request.d} > {limit}: past the fused kernels' cutoff on the "
                f"{device()} device")
    if request.method is None and request.stiff and request.rtol is not None \
            and request.rtol < ROSENBROCK23_MIN_RTOL:
        return (f"the fused stiff method, second-order Rosenbrock23, needs too many steps "
                f"at rtol < {ROSENBROCK23_MIN_RTOL:g}: the general path's Rodas5P serves it")
    method = request.method or ("rosenbrock23" if request.stiff else "tsit5")
    if method not in FUSED_METHODS:
        return f"the fused kernels run {FUSED_METHODS}, not {method!r}"
    if method == "rosenbrock23" and not request.jacobian:
        return "the field has no hand-written Jacobian for the stiff fused kernel"
    return None


def _fused_solve(prob, cfg):
    from .warp._fused import run_fused
    out = run_fused(prob, cfg)
    ys = out.y if out.ys is None else out.ys
    return (jnp.asarray(ys), jnp.asarray(out.status), jnp.asarray(out.n_accepted),
            jnp.asarray(out.n_rejected))


class Fused(Engine):
    """The fused Warp kernel: one thread per trajectory, the whole adaptive loop
    (Tsit5, or Rosenbrock23 for stiff fields) in one launch; forward only."""

    name: ClassVar[str] = "fused"
    records: ClassVar[bool] = False

    def default_method(self, request):
        return "rosenbrock23" if request.stiff else "tsit5"

    def supports(self, request):
        if request.gradient:
            return "forward only (gradients: 'fused_replay')"
        return _fused_refusal(request)

    def solve(self, prob, cfg):
        return _fused_solve(prob, cfg)

    def ys_function(self, prob, cfg, mode):
        raise ValueError("engine 'fused' is forward only")


class FusedReplay(Engine):
    """The fused Warp recorder, then the padded JAX replay of its mesh."""

    name: ClassVar[str] = "fused_replay"
    records: ClassVar[bool] = True

    def default_method(self, request):
        return "rosenbrock23" if request.stiff else "tsit5"

    def supports(self, request):
        return _fused_refusal(request)

    def solve(self, prob, cfg):
        return _fused_solve(prob, cfg)

    def record(self, prob, cfg, params=None, y0=None):
        from .mesh import Mesh
        from .warp._fused import run_fused
        out = run_fused(prob, cfg, record=True, params=params, y0=y0)
        dtype = out.h.dtype
        return Mesh(h=jnp.asarray(out.h), n_steps=jnp.asarray(out.n_accepted),
                    n_rejected=jnp.asarray(out.n_rejected), status=jnp.asarray(out.status),
                    t0=jnp.asarray(prob.t_span[0], dtype), t1=jnp.asarray(prob.t_span[1], dtype),
                    method=cfg.method, rtol=cfg.rtol, atol=cfg.atol, recorder="fused")

    def ys_function(self, prob, cfg, mode):
        return _replay_ys_function(prob, cfg)


ENGINES: dict[str, Engine] = {e.name: e for e in (
    Fused(), FusedReplay(), GeneralReplay(), General(), Diffrax())}


def engine_names() -> tuple[str, ...]:
    """Names of the engines built into this version."""
    return tuple(ENGINES)
