"""`kernel_adjoint`: the fused Warp recorder, then the in-kernel adjoint of its mesh.

The replay runs in Warp instead of JAX: a forward kernel over the recorded mesh that
stores one state per mesh point, and a backward kernel that recomputes each step's
stages from it and applies the step's vector-Jacobian product (`warp/_adjoint.py`).
The pair enters JAX as one `jax.custom_vjp` around two `jax.pure_callback`s, so it
works inside `jit` and under `jax.grad` like the JAX replay -- the same convention
(the exact derivative of the replay on the recorded mesh, step sizes held fixed) and
the same masking rule (a failed trajectory gives zero outputs and zero gradients).

Reverse mode only; Tsit5 and Rosenbrock23 (its adjoint goes through W's inverse
transposed and the Jacobian's own VJP). The field and its VJP are translated from the
JAX right-hand side
(`warp/_translate.py`), so any field with a fused form that the translator accepts
runs here, Equinox MLPs in `gs.Shared` included.
"""

from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from ..status import Status
from ..warp import _adjoint, _runtime, _translate
from .fused_replay import FusedReplay


# The ensemble size from which the router prefers the in-kernel adjoint to the JAX
# replay of the same mesh, per Warp device and method (None: by name only). Measured
# on the 2-core CPU (benchmarks/kernel_adjoint.py): Tsit5 on Lorenz is slower than
# fused_replay at n = 128 (the fixed costs of two launches and two callbacks) and 2-3x
# faster from n = 1024; Rosenbrock23 is faster at every size measured (Robertson and
# HIRES, n = 8 to 1024: 1.6-9.5x), the JAX replay's batched LU solves being the slow
# part there. Not measured on a GPU yet.
MIN_N = {"cpu": {"tsit5": 1024, "rosenbrock23": 0}, "cuda": None}


def adjoint_function(prob, cfg):
    """The pure function `(mesh, params, y0) -> ys` that `kernel_adjoint`
    differentiates: final states `(n, d)`, or `(n, len(ts), d)` with `cfg.ts`.

    Raises:
        ValueError: the field or its VJP cannot be translated (naming the primitive).
    """
    try:
        prog = _adjoint.program(prob, cfg.method)
    except _translate.UntranslatableField as err:
        raise ValueError(f"engine 'kernel_adjoint' cannot serve this problem: {err}") from None
    ts = None if cfg.ts is None else np.asarray(cfg.ts, np.dtype(prob.y0.dtype))

    def host_forward(h, n_steps, ok, t0, y0, *leaves):
        run = _adjoint.forward(prog, np.asarray(h), np.asarray(n_steps), np.asarray(ok),
                               float(t0), np.asarray(y0), [np.asarray(x) for x in leaves], ts)
        return run.ys, run.states, run.tgrid, run.base

    def forward_call(h, n_steps, ok, t0, y0, leaves):
        n, d = y0.shape
        points = h.shape[1] + 1
        n_ts = 0 if ts is None else len(ts)
        shapes = (jax.ShapeDtypeStruct((n, d) if ts is None else (n, n_ts, d), y0.dtype),
                  jax.ShapeDtypeStruct((n, points, d), y0.dtype),
                  jax.ShapeDtypeStruct((n, points), y0.dtype),
                  jax.ShapeDtypeStruct((n, max(n_ts, 1)), jnp.int32))
        return jax.pure_callback(host_forward, shapes, h, n_steps, ok, t0, y0, *leaves)

    @jax.custom_vjp
    def run(h, n_steps, ok, t0, y0, *leaves):
        return forward_call(h, n_steps, ok, t0, y0, leaves)[0]

    def run_fwd(h, n_steps, ok, t0, y0, *leaves):
        ys, states, tgrid, base = forward_call(h, n_steps, ok, t0, y0, leaves)
        return ys, (h, n_steps, ok, t0, y0, leaves, states, tgrid, base)

    def run_bwd(res, ct):
        h, n_steps, ok, t0, y0, leaves, states, tgrid, base = res
        inexact = [jnp.issubdtype(x.dtype, jnp.inexact) for x in leaves]

        def host_backward(states, tgrid, base, h, ok, ct, *leaves):
            run = _adjoint.Forward(None, np.asarray(states), np.asarray(tgrid), np.asarray(base))
            g_y0, grads = _adjoint.backward(prog, run, np.asarray(h), np.asarray(ok),
                                            np.asarray(ct), [np.asarray(x) for x in leaves], ts)
            return (g_y0.astype(y0.dtype), *[g for g, keep in zip(grads, inexact) if keep])

        shapes = (jax.ShapeDtypeStruct(y0.shape, y0.dtype),
                  *[jax.ShapeDtypeStruct(x.shape, x.dtype) for x, keep in zip(leaves, inexact)
                    if keep])
        g_y0, *grads = jax.pure_callback(host_backward, shapes, states, tgrid, base, h, ok,
                                         ct, *leaves)
        grads = iter(grads)
        float0 = lambda x: np.zeros(x.shape, jax.dtypes.float0)
        g_leaves = [next(grads) if keep else float0(x) for x, keep in zip(leaves, inexact)]
        return (jnp.zeros_like(h), float0(n_steps), float0(ok), jnp.zeros_like(t0), g_y0,
                *g_leaves)

    run.defvjp(run_fwd, run_bwd)

    def ys_fn(mesh, params, y0):
        leaves = [x for x, _ in _translate._flat(params)]
        ok = mesh.status == Status.SUCCESS
        # The recorded-mesh convention: the step sizes are data.
        h = jnp.where(ok[:, None], jax.lax.stop_gradient(mesh.h).astype(y0.dtype), 0)
        n_steps = jnp.where(ok, mesh.n_steps, 0).astype(jnp.int32)
        t0 = jax.lax.stop_gradient(mesh.t0).astype(y0.dtype)
        return run(h, n_steps, ok, t0, y0, *leaves)
    return ys_fn


class KernelAdjoint(FusedReplay):
    """The fused Warp recorder, then the Warp forward over its mesh and the Warp
    backward; reverse mode, Tsit5 and Rosenbrock23."""

    name: ClassVar[str] = "kernel_adjoint"
    routes: ClassVar[tuple[str, ...]] = ("gradient",)
    methods: ClassVar[tuple[str, ...]] = ("tsit5", "rosenbrock23")
    named_by_recorder: ClassVar[bool] = False  # recorder="fused" means fused_replay

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
        if request.n < limit.get(method, 0):
            return (f"n = {request.n} < {limit[method]}: the JAX replay is faster below that "
                    f"here ({method})")
        return None

    def ys_function(self, prob, cfg, mode):
        return adjoint_function(prob, cfg)
