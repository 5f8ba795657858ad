"""Engines: each way of solving an ensemble or differentiating it is one file here
and one line in `ENGINES` below. The router (router.py) picks one per call.

- `fused`: a Warp kernel, one thread per trajectory, forward only (fused fields).
- `kernel_adjoint`: the fused recorder, then a Warp forward over its mesh and a Warp
  backward (the in-kernel adjoint); the router's choice from `MIN_N` trajectories.
- `fused_replay`: the fused (Warp) recorder, then the padded JAX replay.
- `diffrax`: Diffrax under `vmap`; forward solves, and gradients as the baseline.
- `general_replay`: the batched JAX recorder, then the padded JAX replay.
- `general`: the batched JAX adaptive solve, forward only.

The registry's order is the router's order of preference among the engines that
route a task (`Engine.routes`).
"""

from ._base import (
    Differentiates as Differentiates,
    Engine as Engine,
    Records as Records,
    Request as Request,
    Solves as Solves,
    TASKS as TASKS,
    recorder_of as recorder_of,
)
from .diffrax import Diffrax as Diffrax
from .fused import Fused as Fused
from .fused_replay import FusedReplay as FusedReplay
from .general import General as General
from .general_replay import GeneralReplay as GeneralReplay
from .kernel_adjoint import KernelAdjoint as KernelAdjoint


ENGINES: dict[str, Engine] = {e.name: e for e in (
    Fused(),
    KernelAdjoint(),
    FusedReplay(),
    Diffrax(),
    GeneralReplay(),
    General(),
)}


def engine_names() -> tuple[str, ...]:
    """Names of the registered engines, in the router's order of preference."""
    return tuple(ENGINES)


def register(engine: Engine, *, first: bool = False) -> Engine:
    """Add an engine to the registry (after the built-in ones, or `first=True`:
    before them, so the router prefers it where it serves). Returns it.

    Examples:
        >>> import gradsolve as gs
        >>> gs.engines.register(gs.engines.General())
        Traceback (most recent call last):
        ...
        ValueError: an engine named 'general' is already registered
    """
    if not isinstance(engine, Engine):
        raise TypeError(f"engine must be a gs.engines.Engine, got {type(engine).__name__}")
    if engine.name in ENGINES:
        raise ValueError(f"an engine named {engine.name!r} is already registered")
    for task in engine.routes:
        if task not in ("solve", "gradient") or not engine.serves(task):
            raise ValueError(f"engine {engine.name!r} routes {task!r} but does not serve it")
    items = list(ENGINES.items())
    items.insert(0 if first else len(items), (engine.name, engine))
    ENGINES.clear()
    ENGINES.update(items)
    return engine


def unregister(name: str) -> Engine:
    """Remove the engine called `name` from the registry; returns it."""
    if name not in ENGINES:
        raise ValueError(f"no engine named {name!r} is registered")
    return ENGINES.pop(name)


def with_recorder(recorder: str) -> Engine:
    """The first registered engine that differentiates meshes of `recorder`."""
    for engine in ENGINES.values():
        if recorder_of(engine) == recorder and engine.serves("gradient") \
                and engine.named_by_recorder:
            return engine
    known = ["None"] + [repr(r) for r in sorted(
        {r for r in map(recorder_of, ENGINES.values()) if r}, reverse=True)]
    raise ValueError(f"recorder must be {', '.join(known[:-1])} or {known[-1]}, "
                     f"got {recorder!r}")
