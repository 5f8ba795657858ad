"""`general_replay`: the batched JAX recorder, then the padded JAX replay (any f, any d)."""

from typing import ClassVar

from .. import layout
from ..recorder import run_record
from ..replay import replay_function
from ._base import Differentiates, Engine, Records, Solves
from .general import general_row_bytes, general_solve


class GeneralReplay(Engine, Solves, Records, Differentiates):
    """Batched JAX recorder, then the padded JAX replay (any f, any d)."""

    name: ClassVar[str] = "general_replay"
    routes: ClassVar[tuple[str, ...]] = ("gradient",)
    recorder: ClassVar[str] = "general"

    def solve(self, prob, cfg):
        return general_solve(prob, cfg)

    def record(self, prob, cfg, params=None, y0=None):
        return run_record(prob, cfg, params=params, y0=y0, recorder=self.recorder,
                          devices=layout.local_mesh(cfg.devices))[0]

    def row_bytes(self, prob, cfg):
        return general_row_bytes(prob, cfg)

    checks_mesh: ClassVar[bool] = True

    def ys_function(self, prob, cfg, mode):
        return replay_function(prob, cfg, check=mode == "checked", forward=mode == "forward")
