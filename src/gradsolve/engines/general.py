"""`general`: the batched JAX adaptive solve (any field, any d); forward only."""

from typing import ClassVar

from .. import methods
from ..recorder import run_record
from ..replay import _replay
from ._base import Engine, Solves


def general_solve(prob, cfg):
    """The general recorder's solve; `ts` outputs by one extra step each (or the
    continuous extension), as the replay serves them."""
    mesh, y_end = run_record(prob, cfg)
    ys = y_end
    if cfg.ts is not None:
        ys = _replay(prob.f_jax, methods.get(cfg.method), mesh, prob.params, prob.y0,
                     cfg.ts, False, cfg.interpolate)
    return ys, mesh.status, mesh.n_steps, mesh.n_rejected


class General(Engine, Solves):
    """The batched JAX adaptive solve; forward only."""

    name: ClassVar[str] = "general"
    routes: ClassVar[tuple[str, ...]] = ("solve",)
    gradients_by: ClassVar[str] = "general_replay"

    def solve(self, prob, cfg):
        return general_solve(prob, cfg)
