"""The fused solve and the fused recorder: each Warp thread runs whole trajectories.

The first step comes from the JAX side (`recorder.start`, Hairer & Wanner's rule in
`control.initial_step`), so both recorders start from the same step. A recording
launch keeps the first `RECORD_WIDTH` step sizes of every trajectory; the few that
take more steps run again, alone, with a buffer as wide as the longest of them --
the buffer never scales with `max_steps`, and a trajectory's result does not depend
on which launch ran it (the kernels are bit for bit lane- and slice-invariant).
Ensembles whose buffers would exceed `MEMORY_BUDGET` bytes run in consecutive chunks.
"""

import functools
from typing import NamedTuple

import numpy as np

from .. import control, methods
from ..fields._warp import fused_form
from .. import recorder
from . import _codegen, _runtime


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
    source = _codegen.kernel_source(method, field.source(d), d, bits, n_lanes)
    return _runtime.load(source).solve


def run_fused(prob, cfg, *, record=False, params=None, y0=None):
    """Solve (and with `record=True` record) every trajectory in Warp.

    Returns:
        A `FusedRun`.
    """
    wp = _runtime.warp()
    params = prob.params if params is None else params
    y0 = prob.y0 if y0 is None else y0
    method = methods.get(cfg.method)
    dtype = np.dtype(y0.dtype)
    n, d = y0.shape
    t0, t1 = (float(t) for t in prob.t_span)
    _, t_first, _ = recorder.start(y0, params, cfg.dt0, prob.f_jax, method, cfg.rtol, cfg.atol, t0, t1)
    P, S = fused_form(prob, params)[0].pack(params, n)
    host = {"y0": np.asarray(y0, dtype), "p": np.asarray(P, dtype),
            "t_first": np.asarray(t_first, dtype)}
    shared = np.asarray(S, dtype)
    ts = np.zeros(1, dtype) if cfg.ts is None else np.asarray(cfg.ts, dtype)
    n_ts = 0 if cfg.ts is None else len(cfg.ts)
    scalars = dict(t0=t0, t1=t1, floor=float(control.t1_snap_floor(np.asarray(t1, dtype))),
                   rtol=cfg.rtol, atol=cfg.atol, max_steps=cfg.max_steps)
    kernel = kernel_for(prob, method, dtype)
    T = wp.float64 if dtype == np.float64 else wp.float32
    dev = _runtime.device()

    def launch(inputs, width):
        """One launch over the trajectories in `inputs`; step sizes are written up to
        `width` columns (0: none)."""
        arr = lambda x: wp.array(x, dtype=T, device=dev)
        m = len(inputs["y0"])
        h_out = wp.zeros((m, max(width, 1)), dtype=T, device=dev)
        res = {"y": wp.zeros((m, d), dtype=T, device=dev),
               "ys": wp.zeros((m, max(n_ts, 1), d), dtype=T, device=dev),
               "n_acc": wp.zeros(m, dtype=wp.int32, device=dev),
               "n_rej": wp.zeros(m, dtype=wp.int32, device=dev),
               "status": wp.zeros(m, dtype=wp.int32, device=dev)}
        wp.launch(kernel, dim=-(-m // lanes()), device=dev, inputs=[
            arr(inputs["y0"]), arr(inputs["p"]), arr(shared), arr(inputs["t_first"]),
            arr(ts), n_ts, T(scalars["t0"]), T(scalars["t1"]), T(scalars["floor"]),
            T(scalars["rtol"]), T(scalars["atol"]), scalars["max_steps"], width, m,
            h_out, res["y"], res["ys"], res["n_acc"], res["n_rej"], res["status"]])
        wp.synchronize_device(dev)
        return h_out.numpy(), {k: v.numpy() for k, v in res.items()}

    def run(rows, width, out):
        """Run the trajectories `rows` (indices), in chunks within `MEMORY_BUDGET`,
        each chunk split over the thread pool; write their results into `out`."""
        per_trajectory = dtype.itemsize * (d * (4 + n_ts) + width) + 64
        chunk = max(1, MEMORY_BUDGET // per_trajectory)

        def fill(a, b):
            sel = rows[a:b]
            h, res = launch({k: v[sel] for k, v in host.items()}, width)
            for k, v in res.items():
                out[k][sel] = v
            if width:
                out["h"][sel, :width] = h[:, :width]

        for start in range(0, len(rows), chunk):
            stop = min(len(rows), start + chunk)
            _runtime.run_split(lambda a, b: fill(start + a, start + b), stop - start)

    out = {"y": np.empty((n, d), dtype), "ys": np.empty((n, max(n_ts, 1), d), dtype),
           "n_acc": np.empty(n, np.int32), "n_rej": np.empty(n, np.int32),
           "status": np.empty(n, np.int32)}
    every = np.arange(n)
    if not record:
        run(every, 0, out)
    else:
        # One launch records up to RECORD_WIDTH steps; the trajectories that took more
        # run again with a buffer as wide as the longest of them.
        width = min(RECORD_WIDTH, cfg.max_steps)
        out["h"] = np.zeros((n, width), dtype)
        run(every, width, out)
        longer = np.flatnonzero(out["n_acc"] > width)
        if longer.size:
            full = int(out["n_acc"][longer].max())
            out["h"] = np.concatenate([out["h"], np.zeros((n, full - width), dtype)], axis=1)
            run(longer, full, out)
        out["h"] = out["h"][:, :max(int(out["n_acc"].max()), 1)]
    return FusedRun(y=out["y"], ys=out["ys"] if n_ts else None, n_accepted=out["n_acc"],
                    n_rejected=out["n_rej"], status=out["status"], h=out.get("h"))
