"""`general`: the batched JAX adaptive solve (any field, any d); forward only."""

from typing import ClassVar

from .. import layout, methods
from ..recorder import DEFAULT_CHUNK, run_record
from ..replay import arranged_replay
from ._base import Engine, Solves


def general_solve(prob, cfg):
    """The general recorder's solve, its rows split over this process's devices; `ts`
    outputs by one extra step each (or the continuous extension), as the replay
    serves them."""
    devices = layout.local_mesh(cfg.devices)
    mesh, y_end = run_record(prob, cfg, devices=devices)
    ys = y_end
    if cfg.ts is not None:
        arr = layout.for_mesh(mesh, prob.n, dmesh=devices, buckets=cfg.buckets)
        ys = arranged_replay(prob.f_jax, methods.get(cfg.method), mesh, prob.params, prob.y0,
                             cfg.ts, False, cfg.interpolate, arr)
    return ys, mesh.status, mesh.n_steps, mesh.n_rejected


def general_row_bytes(prob, cfg) -> int:
    """What one trajectory holds in the general recorder (`layout.record_bytes`)."""
    return layout.record_bytes(methods.get(cfg.method), prob.d, prob.y0.dtype.itemsize,
                               DEFAULT_CHUNK)


class General(Engine, Solves):
    """The batched JAX adaptive solve; forward only."""

    name: ClassVar[str] = "general"
    routes: ClassVar[tuple[str, ...]] = ("solve",)
    gradients_by: ClassVar[str] = "general_replay"

    def solve(self, prob, cfg):
        return general_solve(prob, cfg)

    def row_bytes(self, prob, cfg):
        return general_row_bytes(prob, cfg)
