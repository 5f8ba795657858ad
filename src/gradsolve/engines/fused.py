"""`fused`: the fused Warp kernel, one thread per trajectory, the whole adaptive loop
(Tsit5, or Rosenbrock23 for stiff fields with a Jacobian) in one launch; forward only.

Whether a request may run on Warp at all (a fused form, the d cutoff) is the router's
rule for every Warp engine (router.py); this file only runs the kernel.
"""

from typing import ClassVar

import jax.numpy as jnp

from .. import methods
from ..warp import _steps
from ..warp._fused import run_fused
from ._base import Engine, Solves


# The methods the kernel generator writes (warp/_steps.py: explicit Runge--Kutta
# with Tsit5's tableau, and Rosenbrock23).
FUSED_METHODS = ("tsit5", "rosenbrock23")


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

    def interpolates_with(self, task, method):
        """The solve kernel serves `ts` from Tsit5's continuous extension and integrates
        Rosenbrock23's outputs (`_steps.has_kernel_extension`); a gradient follows
        `interpolates` (the JAX replay serves every method's extension)."""
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
