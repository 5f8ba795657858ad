"""The fused solve and the fused recorder: each Warp thread runs whole trajectories.

The first step comes from the JAX side (`recorder.start`, Hairer & Wanner's rule in
`control.initial_step`), so both recorders start from the same step. A recording
launch keeps the first `RECORD_WIDTH` step sizes of every trajectory; the few that
take more steps run again, alone, with a buffer as wide as the longest of them --
the buffer never scales with `max_steps`, and a trajectory's result does not depend
on which launch ran it (the kernels are bit for bit lane- and slice-invariant).
Ensembles whose buffers would exceed `MEMORY_BUDGET` bytes run in consecutive chunks
(`_launch.run`).
"""

import functools
from typing import NamedTuple

import numpy as np

from .. import control, methods, recorder
from . import _kernels, _launch, _runtime
from ._registry import fused_form


MEMORY_BUDGET = 1 << 30
CPU_LANES = 2
RECORD_WIDTH = 64  # step sizes a recording launch keeps per trajectory; see run_fused


def lanes() -> int:
    """Trajectories per thread: `CPU_LANES` on the CPU, one on a GPU (whose threads
    already run side by side)."""
    return CPU_LANES if _runtime.device() == "cpu" else 1


class FusedRun(NamedTuple):
    """What a fused launch returns, as NumPy arrays."""

    y: np.ndarray            # (n, d) final states
    ys: np.ndarray | None    # (n, len(ts), d), or None without ts
    n_accepted: np.ndarray   # (n,) int32
    n_rejected: np.ndarray   # (n,) int32
    status: np.ndarray       # (n,) int32 gs.Status codes
    h: np.ndarray | None     # (n, S) recorded step sizes, or None without record


def kernel_for(prob, method, dtype):
    """The compiled `solve` kernel for this problem's field, method and dtype."""
    bits = 64 if np.dtype(dtype) == np.float64 else 32
    field, why = fused_form(prob)
    if field is None:
        raise ValueError(why)
    return _kernel(method, field, prob.d, bits, lanes())


@functools.cache
def _kernel(method, field, d, bits, n_lanes):
    source = _kernels.kernel_source(method, field.source(d), d, bits, n_lanes)
    return _runtime.load(source).solve


def run_fused(prob, cfg, *, record=False, params=None, y0=None):
    """Solve (and with `record=True` record) every trajectory in Warp.

    Returns:
        A `FusedRun`.
    """
    params = prob.params if params is None else params
    y0 = prob.y0 if y0 is None else y0
    method = methods.get(cfg.method)
    dtype = np.dtype(y0.dtype)
    n, d = y0.shape
    t0, t1 = (float(t) for t in prob.t_span)
    _, t_first, _ = recorder.start(y0, params, cfg.dt0, prob.f_jax, method, cfg.rtol, cfg.atol, t0, t1)
    P, S = fused_form(prob, params)[0].pack(params, n)
    n_ts = 0 if cfg.ts is None else len(cfg.ts)
    values = dict(y0=y0, p=P, s=S, t_first=t_first,
                  ts=np.zeros(1) if cfg.ts is None else cfg.ts, n_ts=n_ts,
                  interp=int(bool(cfg.interpolate) and n_ts > 0),
                  t0=t0, t1=t1, floor=float(control.t1_snap_floor(np.asarray(t1, dtype))),
                  rtol=cfg.rtol, atol=cfg.atol, max_steps=cfg.max_steps)
    kernel = kernel_for(prob, method, dtype)

    def solve(width, rows=None):
        """The trajectories `rows`, keeping `width` step sizes each (0: none)."""
        return _launch.run(kernel, _kernels.SOLVE, dict(values, width=width), n=n, dtype=dtype,
                           lanes=lanes(), budget=MEMORY_BUDGET, rows=rows,
                           sizes=dict(d=d, n_ts=max(n_ts, 1), width=max(width, 1)))

    if not record:
        out, h = solve(0), None
    else:
        # One launch records up to RECORD_WIDTH steps; the trajectories that took more
        # run again with a buffer as wide as the longest of them.
        width = min(RECORD_WIDTH, cfg.max_steps)
        out = solve(width)
        h = out.h_out
        longer = np.flatnonzero(out.n_acc > width)
        if longer.size:
            full = int(out.n_acc[longer].max())
            again = solve(full, longer)
            h = np.concatenate([h, np.zeros((n, full - width), dtype)], axis=1)
            h[longer] = again.h_out
            for name, value in again._asdict().items():
                if name != "h_out":
                    getattr(out, name)[longer] = value
        h = h[:, :max(int(out.n_acc.max()), 1)]
    return FusedRun(y=out.y_out, ys=out.ys_out if n_ts else None, n_accepted=out.n_acc,
                    n_rejected=out.n_rej, status=out.status, h=h)
