"""`fused_replay`: the fused Warp recorder, then the padded JAX replay of its mesh."""

from typing import ClassVar

import jax.numpy as jnp

from ..mesh import Mesh
from ..replay import replay_function
from ..warp._fused import run_fused
from ._base import Differentiates, Records, Solves
from .fused import FusedEngine


class FusedReplay(FusedEngine, Solves, Records, Differentiates):
    """The fused Warp recorder, then the padded JAX replay of its mesh."""

    name: ClassVar[str] = "fused_replay"
    routes: ClassVar[tuple[str, ...]] = ("gradient",)
    recorder: ClassVar[str] = "fused"
    # Its gradient replays in JAX (every method's continuous extension); its forward
    # solve is the fused kernel (Tsit5's: FusedEngine.interpolates_with).
    interpolates: ClassVar[tuple[str, ...]] = ("solve", "gradient")

    def record(self, prob, cfg, params=None, y0=None):
        out = run_fused(prob, cfg, record=True, params=params, y0=y0)
        dtype = out.h.dtype
        return Mesh(h=jnp.asarray(out.h), n_steps=jnp.asarray(out.n_accepted),
                    n_rejected=jnp.asarray(out.n_rejected), status=jnp.asarray(out.status),
                    t0=jnp.asarray(prob.t_span[0], dtype), t1=jnp.asarray(prob.t_span[1], dtype),
                    method=cfg.method, rtol=cfg.rtol, atol=cfg.atol, recorder=self.recorder)

    checks_mesh: ClassVar[bool] = True

    def ys_function(self, prob, cfg, mode):
        return replay_function(prob, cfg, check=mode == "checked", forward=mode == "forward")
