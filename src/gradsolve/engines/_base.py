"""The engine contract: what the router reads (`Request`) and what an engine serves.

An engine is a small final `eqx.Module` that says what it runs (`methods`), which
tasks the router may give it unasked (`routes`), and implements one or more of three
capabilities, each a mixin with one abstract method:

- `Solves.solve(prob, cfg)`: a forward solve;
- `Records.record(prob, cfg, params, y0)`: a `gs.Mesh` (its `recorder` names it);
- `Differentiates.ys_function(prob, cfg, mode)`: a pure function to differentiate.

A forward-only engine implements `Solves` alone; the router never asks it for a
gradient. Hooks say what else stops an engine, each returning a reason or None:

- `admits(request)`: a family's rules, asked before the method is known (the Warp
  engines': a fused form, the dtype, the d cutoff);
- `refuses_method(method, request)`: the method it does not run, or not for this
  request (a Warp Rosenbrock23 needs the field's Jacobian);
- `supports(request)`: what else it cannot serve, read from the request (Diffrax not
  installed, forward mode, ...);
- `check(prob, method)`: what it cannot serve that only the problem itself shows (a
  field whose derivative does not translate), asked of the engine the router chose;
- `declines(request)`: where it could serve but is not the router's choice unasked (a
  measured speed policy); named with `engine=`, it runs all the same.

The rules common to all engines (task, devices, method, continuous extension) are
the router's, in router.py; an engine family's own rules sit with the family (the Warp
engines': engines/fused.py), and what the request needs to know of a problem for them
comes from the family too (`describe`).
"""

import abc
import dataclasses
from typing import ClassVar

import equinox as eqx

from ..methods import default_for, names


TASKS = ("solve", "record", "gradient")


@dataclasses.dataclass(frozen=True)
class Request:
    """What the router reads about a call, so that an engine can refuse it before
    anything is traced.

    Attributes:
        gradient: a gradient (or a mesh for one) is wanted, not only a solve.
        stiff, d: the problem's stiffness flag and state dimension.
        n: the number of trajectories (0: not given).
        method: the method asked for, or None (each engine's default: `methods.default_for`).
        facts: what the engine families read off the problem (`Engine.describe`; the
            Warp engines': `fused`, the field has a fused form, `fused_why` why not,
            `jacobian`, that form carries a Jacobian), as `(name, value)` pairs
            sorted by name (a dict is taken too); `fact(name)` reads one.
        rtol: the relative tolerance asked for.
        mode: `"reverse"` or `"forward"` (gradients).
        interpolate: `ts` served from a continuous extension (True), by an integrated
            step (False), or as the engine and method decide (None).
        ts: output times were asked for.
        dtype: the problem's floating dtype, by name.
        shared_module: the `gs.Shared` parameters hold an Equinox module (an MLP).
        warp: the caller's `fused=` choice: True asks for a Warp engine, False keeps
            the request off every Warp engine, None lets the router choose.
        devices: the number of devices named (`devices=`), 0 for the default.
    """

    gradient: bool
    stiff: bool
    d: int
    n: int = 0
    method: str | None = None
    facts: tuple = ()
    rtol: float | None = None
    mode: str = "reverse"
    interpolate: bool | None = None
    ts: bool = False
    dtype: str = "float64"
    shared_module: bool = False
    warp: bool | None = None
    devices: int = 0

    def __post_init__(self):
        if isinstance(self.facts, dict):  # hashable, in one order
            object.__setattr__(self, "facts", tuple(sorted(self.facts.items())))

    def fact(self, name: str, default=None):
        """The engine families' fact `name` (`facts`), or `default` if none gave it."""
        return dict(self.facts).get(name, default)

    @property
    def task(self) -> str:
        return "gradient" if self.gradient else "solve"


class Engine(eqx.Module):
    """An engine. Subclass it with one or more of `Solves`, `Records`,
    `Differentiates`, set the class attributes, and add one line to the registry in
    `gradsolve/engines/__init__.py` (or call `gs.engines.register`).

    Class attributes:
        name: the name results carry and `engine=` accepts.
        methods: the integration methods it runs.
        routes: the tasks (`"solve"`, `"gradient"`) the router may choose it for when
            no engine is named, in registry order; an engine with none runs only by name.
        warp: it runs Warp kernels (the router's fused-form rules apply to it).
        gradients_by: for a forward-only engine, the engine that differentiates
            what it solves (named in its refusal of a gradient request).
        one_device: None if its work may be split over devices (`devices=`,
            layout/), else why not: it then runs on one device by default, and the
            router refuses it several naming this.
        interpolates: the tasks on which it serves `ts` from the method's continuous
            extension (`interpolate=True`); `interpolates_with` refines it per method
            (the Warp kernels have Tsit5's only and integrate a step to each output
            time with Rosenbrock23).
    """

    name: ClassVar[str]
    methods: ClassVar[tuple[str, ...]] = names()
    routes: ClassVar[tuple[str, ...]] = ()
    warp: ClassVar[bool] = False
    gradients_by: ClassVar[str | None] = None
    one_device: ClassVar[str | None] = None
    interpolates: ClassVar[tuple[str, ...]] = ("solve", "gradient")

    @property
    def splits(self) -> bool:
        """Whether its work may be split over devices (`one_device` is None)."""
        return self.one_device is None

    def serves(self, task: str) -> bool:
        """Whether this engine implements `task` (one of `TASKS`)."""
        return isinstance(self, {"solve": Solves, "record": Records,
                                 "gradient": Differentiates}[task])

    def runs(self, method: str) -> bool:
        return method in self.methods

    @staticmethod
    def describe(prob, fused) -> dict:
        """The `Request.facts` this engine family reads off `prob` (`fused`: the
        caller's setting); the router merges every family's."""
        return {}

    def admits(self, request: Request) -> str | None:
        """`None`, or why no engine of this family may serve `request`, before its
        method is known."""
        return None

    def refuses_method(self, method: str, request: Request) -> str | None:
        """`None` if it runs `method` for `request`, else why not."""
        return None if self.runs(method) else self.method_refusal(method)

    def interpolates_with(self, task: str, method: str) -> bool:
        """Whether it serves `ts` from `method`'s continuous extension on `task`."""
        return task in self.interpolates

    def default_method(self, request: Request) -> str:
        """The method this engine runs when the request names none."""
        return default_for(request.stiff, self.methods)

    def method_refusal(self, method: str) -> str:
        """Why this engine does not run `method`."""
        return f"engine {self.name!r} runs {self.methods}, not {method!r}"

    def supports(self, request: Request) -> str | None:
        """`None` if nothing particular to this engine stops it serving `request`,
        else the reason (the router checks the task, the method and, for Warp engines,
        the fused form itself)."""
        return None

    def check(self, prob, method: str) -> str | None:
        """`None` if this engine can run `prob` with `method`, else the reason: the
        refusals only the problem shows (the router asks the engine it chose, and
        moves on to the next if it refuses)."""
        return None

    def row_bytes(self, prob, cfg) -> int | None:
        """The memory one trajectory's record or forward solve holds, by which
        `record_rows` and `solve_rows` cut an ensemble into chunks under
        `cfg.memory_budget`; None: the engine bounds its own memory (the fused
        kernels do)."""
        return None

    def declines(self, request: Request) -> str | None:
        """Why the router does not choose this engine for `request` when none is
        named, although it could serve it (a measured policy), or None."""
        return None


class Solves(eqx.Module):
    @abc.abstractmethod
    def solve(self, prob, cfg):
        """Forward solve: `(ys, status, n_accepted, n_rejected)`."""


class Records(eqx.Module):
    recorder: ClassVar[str]  # the name its meshes carry (`Mesh.recorder`)
    # `recorder="<name>"` (gs.record, gs.Calibrator) picks the first registered engine
    # of that recorder with this set: the one with the JAX replay and every method.
    named_by_recorder: ClassVar[bool] = True

    @abc.abstractmethod
    def record(self, prob, cfg, params=None, y0=None):
        """The `gs.Mesh` of every trajectory at `params`, `y0` (default the problem's)."""


class Differentiates(eqx.Module):
    # Whether `ys_function(prob, cfg, "checked")` is served where
    # `replay.checks_mesh(cfg)`: the replay with its mesh's error check.
    checks_mesh: ClassVar[bool] = False

    @abc.abstractmethod
    def ys_function(self, prob, cfg, mode: str):
        """A pure function `(mesh, params, y0) -> ys` to differentiate (`mesh` is None
        for an engine that does not record); with mode `"checked"` (`checks_mesh`),
        `-> (ys, ratio)` (`replay.replay_function`)."""


def recorder_of(engine) -> str | None:
    """The recorder whose meshes `engine` differentiates, or None."""
    return engine.recorder if isinstance(engine, Records) else None
