"""Solver settings shared by `solve`, `record` and `value_and_grad`: one validation
for all of them, run before anything is traced or compiled."""

import dataclasses
from typing import Any

import numpy as np

from . import layout, methods
from .methods._rosenbrock import uses_time
from .problem import evaluation_size, network_size, trajectory_params


DEFAULT_MAX_STEPS = 4096


@dataclasses.dataclass(frozen=True, eq=False)
class Config:
    """Validated solver settings."""

    rtol: float
    atol: float
    method: str
    dt0: Any = None
    max_steps: int = DEFAULT_MAX_STEPS
    ts: Any = None
    remat: Any = None
    interpolate: bool = False
    devices: Any = None          # the 1-D device mesh of the ensemble axis (`layout/`)
    memory_budget: int | None = None  # bytes per device (None: not chunked)
    buckets: int | None = None   # replay buckets (None: layout.arrange's rule)
    # Numbers one field evaluation computes (problem.evaluation_size), what a replay
    # without remat keeps per stage at most: the memory model's (0: the state's d).
    evaluation_size: int = 0


def check_tolerances(rtol, atol):
    for name, v in (("rtol", rtol), ("atol", atol)):
        if not (isinstance(v, (int, float, np.floating)) and np.isfinite(v) and v > 0):
            raise ValueError(f"{name} must be a positive finite number, got {v!r}")
    return float(rtol), float(atol)


def check_dt0(dt0, n):
    if dt0 is None:
        return None
    a = np.asarray(dt0, dtype=np.float64)
    if a.shape not in ((), (n,)) or not np.all(np.isfinite(a)) or not np.all(a > 0):
        raise ValueError(f"dt0 must be None, a positive number or a positive array of "
                         f"shape ({n},), got {dt0!r}")
    return float(a) if a.shape == () else a


def check_ts(ts, t_span):
    """Validate requested output times: 1-D, non-decreasing, inside `t_span`."""
    if ts is None:
        return None
    a = np.asarray(ts, dtype=np.float64)
    t0, t1 = (float(t) for t in t_span)
    if a.ndim != 1 or a.size == 0:
        raise ValueError(f"ts must be a non-empty 1-D array of times, got shape {a.shape}")
    if not np.all(np.isfinite(a)):
        raise ValueError("ts must be finite")
    if np.any(np.diff(a) < 0):
        raise ValueError("ts must be non-decreasing")
    if a[0] < t0 or a[-1] > t1:
        raise ValueError(f"ts must lie inside t_span=({t0}, {t1}), got [{a[0]}, {a[-1]}]")
    return a


def check_method(prob, name):
    """The method called `name`, refused where it cannot serve `prob`."""
    method = methods.get(name)
    if method.autonomous_only:
        if uses_time(prob.f_one, prob.y0[0, 0], prob.y0[0], trajectory_params(prob.params, 0)):
            raise ValueError(
                f"method {name!r} is for autonomous systems, but f_jax reads t; use "
                f"'rodas5p' (it carries df/dt)")
    return method


# A field whose networks hold at least this many numbers per trajectory
# (`problem.network_size`: a `gs.Shared` network's weights, or each trajectory's own)
# is replayed without recomputing steps (`default_remat`).
NETWORK_SIZE = 64


def default_remat(method, prob) -> bool:
    """Recompute the step in the backward sweep (`jax.checkpoint`)? For stiff
    (implicit) methods only from 16 variables on, where the stored stage intermediates
    (Jacobians, factorizations) grow as d^2. For explicit ones, on -- unless the field
    carries a network (`problem.network_size` of `NETWORK_SIZE` numbers or more): each
    of its evaluations then costs a multiply-add per weight, far more than storing the
    step's stages. Measured on Diffrax's neural ODE example (benchmarks/neural_ode.py,
    a Calibrator, refresh every 50 updates): 7.76 -> 5.94 ms per update in float64,
    7.52 -> 5.77 in float32; on Lorenz (3 parameters) storing was slower at small n."""
    if method.implicit or prob.stiff:
        return prob.d >= 16
    return network_size(prob.params) < NETWORK_SIZE


# `interpolate=None` (the default everywhere) serves `ts` from the method's continuous
# extension when its order is at least this (Tsit5 and Rodas5P: 4) and the engine
# serves it; else each output is integrated by an extra step from the mesh point before
# it (Rosenbrock23's order-2 extension measured 1.3-3.3x the integrated outputs' error
# on Robertson; the Warp kernels have the explicit methods' only).
# benchmarks/outputs.py (docs/benchmarks.md, "Output times") measures both.
AUTO_INTERPOLATE_ORDER = 3


def check_interpolate(method, interpolate):
    if interpolate is not None and not isinstance(interpolate, (bool, np.bool_)):
        raise ValueError(f"interpolate must be None (automatic), True or False, got "
                         f"{interpolate!r}")
    if interpolate and method is not None and not method.has_dense_output:
        having = [m for m in methods.names() if methods.get(m).has_dense_output]
        raise ValueError(f"interpolate=True needs a method with a continuous extension "
                         f"({', '.join(having)}); {method.name!r} has none")


def resolve_interpolate(method, interpolate, ts, served=True) -> bool:
    """Whether `ts` is served from `method`'s continuous extension: `interpolate` when
    given, else (None) when there are output times, the engine serves the extension
    (`served`) and its order is at least `AUTO_INTERPOLATE_ORDER`."""
    if interpolate is not None:
        return bool(interpolate)
    return ts is not None and served and method.dense_order >= AUTO_INTERPOLATE_ORDER


def make_config(prob, *, rtol=None, atol=None, method=None, dt0=None,
                max_steps=DEFAULT_MAX_STEPS, ts=None, remat=None, interpolate=None,
                devices=None, memory_budget=None, buckets=None, splits=True,
                interpolates=True, n=None, mesh=None) -> Config:
    """Validate every setting against `prob` and return a `Config`. `splits`: the
    engine runs on several devices (else the default `devices=None` means one);
    `interpolates`: it serves `ts` from a continuous extension (`interpolate=None`
    resolves against it); `n`: the rows the devices share (default `prob.n`; a
    replay of a piece of the ensemble has fewer); `mesh`: a replay's recorded
    `Mesh`, whose method and tolerances replace `method`, `rtol` and `atol` (the
    tolerances carried as recorded, not validated: the replay reads none, and a
    fixed-step mesh built by hand holds 0)."""
    if mesh is None:
        rtol, atol = check_tolerances(rtol, atol)
    else:
        rtol, atol, method = float(mesh.rtol), float(mesh.atol), mesh.method
    method = methods.default_for(prob.stiff) if method is None else method
    m = check_method(prob, method)
    check_interpolate(m, interpolate)
    if remat is None:
        remat = default_remat(m, prob)
    if isinstance(max_steps, bool) or not isinstance(max_steps, (int, np.integer)) or max_steps < 1:
        raise ValueError(f"max_steps must be a positive integer, got {max_steps!r}")
    ts = check_ts(ts, prob.t_span)
    return Config(rtol=rtol, atol=atol, method=method, dt0=check_dt0(dt0, prob.n),
                  max_steps=int(max_steps), ts=ts, remat=bool(remat),
                  interpolate=resolve_interpolate(m, interpolate, ts, interpolates),
                  devices=layout.device_mesh(devices, prob.n if n is None else n)
                  if splits or devices is not None else None,
                  memory_budget=layout.budget_bytes(memory_budget),
                  buckets=layout.check_buckets(buckets),
                  evaluation_size=0 if remat else evaluation_size(prob))
