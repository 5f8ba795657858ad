"""`fused`: the fused Warp kernel, one thread per trajectory, the whole adaptive loop
(Tsit5 or Vern7, or Rosenbrock23 for stiff fields with a Jacobian) in one launch;
forward only.

`FusedEngine`, the family every Warp engine belongs to, holds the rules for running
on Warp at all -- a fused form, `fused=` not False, the dtype, the d cutoff, the
tolerance below which Rosenbrock23 is not chosen, the Jacobian Rosenbrock23 needs --
and reads what they need off the problem (`describe`); the router asks them through
the engine hooks (`engines/_base.py`) and knows nothing of Warp.
"""

from typing import ClassVar

import jax.numpy as jnp

from .. import methods
from ..warp import _runtime, _steps
from ..warp._fused import run_fused
from ..warp._registry import NOT_FUSED, fused_form
from ._base import Engine, Request, Solves


# The methods the kernel generator writes (`warp/_steps.py`'s `EMITTERS`: every explicit
# Runge--Kutta tableau, Tsit5's and Vern7's, and Rosenbrock23).
FUSED_METHODS = _steps.kernel_methods()
# The state-dimension cutoff of the Warp engines, per Warp device. On a GPU the limit
# is the per-thread register file (the design's 64 keeps far inside it); on this
# project's 2-core CPU the fused kernel stops beating the batched JAX engine between
# d = 8 and d = 16 (benchmarks/fused_forward.py, docs/benchmarks.md).
FUSED_MAX_D = {"cuda": 64, "cpu": 8}
# Below this rtol a stiff request without a named method leaves the Warp engines: at
# rtol 1e-10 Rosenbrock23 ran past 4096 steps on Robertson where Rodas5P took ~100.
ROSENBROCK23_MIN_RTOL = 1e-6
WARP_DTYPES = ("float32", "float64")


def warp_refusal(request: Request) -> str | None:
    """Why no Warp engine may run `request` (before its method is known), or None."""
    if request.warp is False:
        return "fused=False keeps the request off the Warp engines"
    if not request.fact("fused", False):
        return request.fact("fused_why") or NOT_FUSED
    if request.dtype not in WARP_DTYPES:
        return f"the fused kernels run {WARP_DTYPES}, not {request.dtype}"
    device = _runtime.device()
    limit = FUSED_MAX_D[device]
    if request.d > limit:
        return f"d = {request.d} > {limit}: past the fused kernels' cutoff on the {device} device"
    if request.method is None and request.stiff and request.rtol is not None \
            and request.rtol < ROSENBROCK23_MIN_RTOL:
        return (f"the fused stiff method, second-order Rosenbrock23, needs too many steps "
                f"at rtol < {ROSENBROCK23_MIN_RTOL:g}: the general path's Rodas5P serves it")
    return None


def fused_solve(prob, cfg):
    out = run_fused(prob, cfg)
    ys = out.y if out.ys is None else out.ys
    return (jnp.asarray(ys), jnp.asarray(out.status), jnp.asarray(out.n_accepted),
            jnp.asarray(out.n_rejected))


class FusedEngine(Engine):
    """What every engine built on the fused kernels shares (abstract)."""

    methods: ClassVar[tuple[str, ...]] = FUSED_METHODS
    warp: ClassVar[bool] = True
    interpolates: ClassVar[tuple[str, ...]] = ("solve",)

    @staticmethod
    def describe(prob, fused):
        """Whether the field has a fused form (and a Jacobian), and why not."""
        form, why = fused_form(prob) if fused is not False else (None, None)
        return dict(fused=form is not None, jacobian=bool(form is not None and form.stiff),
                    fused_why=why)

    def admits(self, request):
        return warp_refusal(request)

    def refuses_method(self, method, request):
        why = super().refuses_method(method, request)
        if why is None and method == "rosenbrock23" and not request.fact("jacobian", False):
            return "the field has no hand-written Jacobian for the stiff fused kernel"
        return why

    def interpolates_with(self, task, method):
        """The solve kernel serves `ts` from Tsit5's and Vern7's continuous extensions
        and integrates Rosenbrock23's outputs (`_steps.has_kernel_extension`); a
        gradient follows `interpolates` (the JAX replay serves every method's
        extension)."""
        if task == "solve":
            return _steps.has_kernel_extension(methods.get(method))
        return task in self.interpolates

    def method_refusal(self, method):
        return f"the fused kernels run {FUSED_METHODS}, not {method!r}"

    def solve(self, prob, cfg):
        return fused_solve(prob, cfg)


class Fused(FusedEngine, Solves):
    """The fused Warp kernel; forward only."""

    name: ClassVar[str] = "fused"
    routes: ClassVar[tuple[str, ...]] = ("solve",)
    gradients_by: ClassVar[str] = "fused_replay"
