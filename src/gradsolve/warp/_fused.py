"""The fused solve and the fused recorder: one Warp thread per trajectory.

The first step comes from the JAX side (`record._start`, Hairer & Wanner's rule in
`control.initial_step`), so both recorders start from the same step. Recording
takes two launches: the first counts each trajectory's accepted steps, the second
writes them into a buffer exactly as wide as the longest trajectory -- the buffer
never scales with `max_steps`. Ensembles whose buffers would exceed `MEMORY_BUDGET`
bytes run in consecutive chunks.
"""

import numpy as np

from .. import control, methods
from ..fields._warp import fused_field
from ..record import _start
from . import _codegen, _runtime


MEMORY_BUDGET = 1 << 30
CPU_LANES = 2


def lanes() -> int:
    """Trajectories per thread: `CPU_LANES` on the CPU, one on a GPU (whose threads
    already run side by side)."""
    return CPU_LANES if _runtime.device() == "cpu" else 1


def kernel_for(prob, method, dtype):
    """The compiled `solve` kernel for this problem's field, method and dtype."""
    field = fused_field(prob.f_jax)
    bits = 64 if np.dtype(dtype) == np.float64 else 32
    source = _codegen.kernel_source(method, field.source(prob.d), prob.d, bits, lanes())
    return _runtime.load(source).solve


def run_fused(prob, cfg, *, record=False, params=None, y0=None):
    """Solve (and with `record=True` record) every trajectory in Warp.

    Returns:
        dict of NumPy arrays: `y` (n, d), `ys` (n, J, d) or None, `n_acc`, `n_rej`,
        `status` (n,), and `h` (n, S) when recording.
    """
    wp = _runtime.warp()
    params = prob.params if params is None else params
    y0 = prob.y0 if y0 is None else y0
    method = methods.get(cfg.method)
    dtype = np.dtype(y0.dtype)
    n, d = y0.shape
    t0, t1 = (float(t) for t in prob.t_span)
    _, t_first, _ = _start(y0, params, cfg.dt0, prob.f_jax, method, cfg.rtol, cfg.atol, t0, t1)
    P, S = fused_field(prob.f_jax).pack(params, n)
    host = {"y0": np.asarray(y0, dtype), "p": np.asarray(P, dtype),
            "t_first": np.asarray(t_first, dtype)}
    shared = np.asarray(S, dtype)
    ts = np.zeros(1, dtype) if cfg.ts is None else np.asarray(cfg.ts, dtype)
    n_ts = 0 if cfg.ts is None else len(cfg.ts)
    scalars = dict(t0=t0, t1=t1, floor=float(control.t1_snap_floor(np.asarray(t1, dtype))),
                   rtol=cfg.rtol, atol=cfg.atol, max_steps=cfg.max_steps)
    kernel = kernel_for(prob, method, dtype)
    out = {"y": np.empty((n, d), dtype), "ys": np.empty((n, max(n_ts, 1), d), dtype),
           "n_acc": np.empty(n, np.int32), "n_rej": np.empty(n, np.int32),
           "status": np.empty(n, np.int32)}
    per_trajectory = dtype.itemsize * d * (4 + n_ts) + 64
    chunk = max(1, MEMORY_BUDGET // per_trajectory)
    T = wp.float64 if dtype == np.float64 else wp.float32
    dev = _runtime.device()

    def launch(a, b, width):
        arr = lambda x, dt=None: wp.array(x, dtype=dt or T, device=dev)
        m = b - a
        h_out = wp.zeros((m, max(width, 1)), dtype=T, device=dev)
        res = {"y": wp.zeros((m, d), dtype=T, device=dev),
               "ys": wp.zeros((m, max(n_ts, 1), d), dtype=T, device=dev),
               "n_acc": wp.zeros(m, dtype=wp.int32, device=dev),
               "n_rej": wp.zeros(m, dtype=wp.int32, device=dev),
               "status": wp.zeros(m, dtype=wp.int32, device=dev)}
        wp.launch(kernel, dim=-(-m // lanes()), device=dev, inputs=[
            arr(host["y0"][a:b]), arr(host["p"][a:b]), arr(shared), arr(host["t_first"][a:b]),
            arr(ts), n_ts, T(scalars["t0"]), T(scalars["t1"]), T(scalars["floor"]),
            T(scalars["rtol"]), T(scalars["atol"]), scalars["max_steps"], int(width > 0), m,
            h_out, res["y"], res["ys"], res["n_acc"], res["n_rej"], res["status"]])
        wp.synchronize_device(dev)
        return h_out, {k: v.numpy() for k, v in res.items()}

    def fill(a, b):
        _, res = launch(a, b, 0)
        for k, v in res.items():
            out[k][a:b] = v

    for start in range(0, n, chunk):
        stop = min(n, start + chunk)
        _runtime.run_split(lambda a, b: fill(start + a, start + b), stop - start)
    if record:
        width = max(int(out["n_acc"].max()), 1)
        out["h"] = np.zeros((n, width), dtype)
        chunk_h = max(1, MEMORY_BUDGET // (per_trajectory + dtype.itemsize * width))

        def fill_h(a, b):
            h, _ = launch(a, b, width)
            out["h"][a:b] = h.numpy()

        for start in range(0, n, chunk_h):
            stop = min(n, start + chunk_h)
            _runtime.run_split(lambda a, b: fill_h(start + a, start + b), stop - start)
    if n_ts == 0:
        out["ys"] = None
    return out
