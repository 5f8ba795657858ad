"""`kernel_adjoint`: the fused Warp recorder, then the in-kernel adjoint of its mesh.

The replay runs in Warp instead of JAX: a forward kernel over the recorded mesh that
stores one state per mesh point, and a backward kernel that recomputes each step's
stages from it and applies the step's vector-Jacobian product (`warp/_adjoint.py`).
The pair enters JAX as one `jax.custom_vjp` around two host calls (`warp/_jax.py`:
XLA's FFI on the CPU, `jax.pure_callback` elsewhere; `_adjoint.replay_function`, also
`gs.replay(..., engine="kernel_adjoint")`, which this module registers), so it
works inside `jit` and under `jax.grad` like the JAX replay -- the same convention
(the exact derivative of the replay on the recorded mesh, step sizes held fixed) and
the same masking rule (a failed trajectory gives zero outputs and zero gradients).

Reverse mode only; Tsit5 (outputs at `ts` from its continuous extension by default,
or integrated), Vern7 (the same, its extension's extra stages in the kernels) and
Rosenbrock23 (its adjoint goes through W's inverse transposed and the Jacobian's own
VJP; integrated outputs). The field and its VJP are translated from the JAX
right-hand side (`warp/_translate.py`), so any field with a fused form that the
translator accepts runs here, Equinox MLPs in `gs.Shared` included.
"""

from typing import ClassVar

from .. import methods
from ..config import resolve_interpolate
from ..replay import ENGINE_REPLAYS
from ..warp import _adjoint, _runtime, _steps
from .fused import FUSED_METHODS
from .fused_replay import FusedReplay


# The ensemble size from which the router prefers the in-kernel adjoint to the JAX
# replay of the same mesh, per Warp device and method (None: by name only). Measured
# on the 2-core CPU (benchmarks/results/kernel_adjoint.json): Tsit5 on Lorenz is
# slower than fused_replay at n = 8 (0.56x: the fixed costs of two launches and two
# host calls), 1.47x faster at n = 128, 3.0-3.5x at 1024 and 8192; Rosenbrock23 is
# faster at every size measured (Robertson and HIRES, n = 8 to 1024: 1.2-9.3x), the
# JAX replay's batched LU solves being the slow part there. Vern7 on Lorenz at rtol
# 1e-8 (by hand, 2026-12-07, warm medians of the gradient against fused_replay's):
# 2.1 against 0.9 ms at n = 8, 2.8 against 3.5 at 64, 5.5 against 12.8 at 256, 9.9
# against 50 at 1024. A method not listed is chosen by name only. Not measured on a GPU.
MIN_N = {"cpu": {"tsit5": 256, "vern7": 64, "rosenbrock23": 0}, "cuda": None}


class KernelAdjoint(FusedReplay):
    """The fused Warp recorder, then the Warp forward over its mesh and the Warp
    backward; reverse mode, the fused kernels' methods."""

    name: ClassVar[str] = "kernel_adjoint"
    routes: ClassVar[tuple[str, ...]] = ("gradient",)
    methods: ClassVar[tuple[str, ...]] = FUSED_METHODS
    named_by_recorder: ClassVar[bool] = False  # recorder="fused" means fused_replay
    interpolates: ClassVar[tuple[str, ...]] = ("solve", "gradient")  # not Rosenbrock23
    one_device: ClassVar[str] = ("its Warp kernels run in host calls, not split over "
                                 "devices; fused_replay splits its replay")

    def interpolates_with(self, task, method):
        """Its kernels (solve and gradient) serve `ts` from Tsit5's continuous
        extension; Rosenbrock23's outputs are integrated
        (`_steps.has_kernel_extension`)."""
        return (task in self.interpolates
                and _steps.has_kernel_extension(methods.get(method)))

    def method_refusal(self, method):
        return f"the in-kernel adjoint runs {self.methods}, not {method!r}"

    def supports(self, request):
        if request.gradient and request.mode != "reverse":
            return "reverse mode only (mode='forward': fused_replay or general_replay)"
        return None

    def check(self, prob, method):
        return _adjoint.why_not(prob, method)

    def declines(self, request):
        device = _runtime.device()
        limit = MIN_N[device]
        if limit is None:
            return f"chosen by name only on the {device} device (not yet measured faster)"
        if request.shared_module and device == "cpu":
            return ("an Equinox module in the field: on the CPU the JAX replay's batched "
                    "matrix products are faster (benchmarks/kernel_adjoint.py)")
        method = request.method or self.default_method(request)
        if method not in limit:
            return f"chosen by name only for {method} on the {device} device (not measured)"
        if request.n < limit[method]:
            return (f"n = {request.n} < {limit[method]}: the JAX replay is faster below that "
                    f"here ({method})")
        return None

    def ys_function(self, prob, cfg, mode):
        return _adjoint.replay_function(prob, cfg.method, cfg.ts, cfg.interpolate)


def _replay_on(prob, mesh, params, y0, ts, interpolate):
    """`gs.replay(..., engine="kernel_adjoint")`: the Warp forward and backward over
    `mesh`, `interpolate` resolved as for the engine."""
    method = methods.get(mesh.method)
    dense = resolve_interpolate(method, interpolate, ts, _steps.has_kernel_extension(method))
    return _adjoint.replay_function(prob, mesh.method, ts, dense)(mesh, params, y0)


ENGINE_REPLAYS[KernelAdjoint.name] = _replay_on
