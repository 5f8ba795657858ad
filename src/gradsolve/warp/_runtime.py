"""Warp at run time: one import, the device, generated modules, split launches.

Everything that touches `warp` directly lives here and in `_fused.py`; the rest of
gradsolve never imports it, so Warp loads (and its ~4 s first compile happens) only
when a fused engine runs.
"""

import concurrent.futures
import contextlib
import functools
import hashlib
import importlib.util
import os
import pathlib
import sys
import tempfile


# Trajectories differ in cost (a slice of stiffer ones takes longer): several slices
# per core keep both cores busy to the end (Lorenz, n = 2^16: 5% faster than one).
SLICES_PER_CORE = 4
MIN_SLICE = 512
_NO_DRIVER = "Could not find or load the NVIDIA CUDA driver"


@functools.cache
def warp():
    """The `warp` module, initialised quietly (no banner, no per-module timings, no
    warning about a missing CUDA driver on a CPU-only machine)."""
    import warp as wp  # Warp loads (and starts its compiler) only when a fused engine runs

    wp.config.log_level = wp.LOG_ERROR
    with _native_stderr() as printed:
        wp.init()
    # Warp's native library prints the missing-driver notice itself: drop that line,
    # pass on anything else.
    sys.stderr.write("".join(line for line in printed().splitlines(keepends=True)
                             if _NO_DRIVER not in line))
    return wp


@contextlib.contextmanager
def _native_stderr():
    """Capture what native code writes to file descriptor 2 inside the block; yields
    a function that returns it as text once the block has ended."""
    sys.stderr.flush()
    saved = os.dup(2)
    text = []
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield lambda: "".join(text)
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            text.append(sink.read().decode(errors="replace"))


DEVICE_SETTING = "GRADSOLVE_WARP_DEVICE"


@functools.cache
def device() -> str:
    """The Warp device the fused engines run on: `GRADSOLVE_WARP_DEVICE` when set
    (`cpu` or `cuda`), else `"cuda"` when Warp sees a GPU and `"cpu"` otherwise.

    Read once per process, at the first routing of a registered field. The test suite
    sets it to `cpu`, as it sets `JAX_PLATFORMS`: the router's table and the JAX-Warp
    bridge depend on the device, and tests/gpu runs the GPU side on its own.
    """
    value = os.environ.get(DEVICE_SETTING, "")
    if value not in ("", "cpu", "cuda"):
        raise ValueError(f"{DEVICE_SETTING} must be 'cpu' or 'cuda' (unset: a GPU when Warp "
                         f"sees one), got {value!r}")
    if value == "cpu":
        return "cpu"  # no need to start Warp to know
    gpus = warp().get_cuda_device_count()
    if value == "cuda" and gpus == 0:
        raise ValueError(f"{DEVICE_SETTING}=cuda, but Warp sees no CUDA device (driver "
                         f"missing or no GPU visible)")
    return "cuda" if gpus > 0 else "cpu"


def cache_dir() -> pathlib.Path:
    root = os.environ.get("GRADSOLVE_KERNEL_CACHE")
    path = pathlib.Path(root) if root else pathlib.Path.home() / ".cache" / "gradsolve" / "kernels"
    path.mkdir(parents=True, exist_ok=True)
    return path


@functools.cache
def load(source: str):
    """Import generated kernel source as a module named by its hash.

    Warp refuses kernels defined by a bare `exec`; a real file works, and naming the
    module by the source's hash keys Warp's own cache on the text.
    """
    name = "gradsolve_kernel_" + hashlib.sha256(source.encode()).hexdigest()[:20]
    path = cache_dir() / f"{name}.py"
    if not path.exists() or path.read_text() != source:
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(source)
        tmp.replace(path)  # atomic: a concurrent reader sees the old or the new file
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    warp().load_module(module, device=device())
    return module


def slices(n: int, parts: int, align: int = 1):
    """`parts` contiguous, nearly equal `(start, stop)` ranges covering `range(n)`,
    every inner boundary a multiple of `align`."""
    parts = max(1, min(parts, -(-n // align)))
    bounds = [min(n, align * round(k * n / parts / align)) for k in range(parts)] + [n]
    return [(a, b) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]


def cpu_threads() -> int:
    """Threads the CPU device splits a launch over: `GRADSOLVE_CPU_THREADS` if set
    (read at every launch, so a benchmark can compare 1 and 2), else one per core."""
    value = os.environ.get("GRADSOLVE_CPU_THREADS", "")
    if not value:
        return os.cpu_count() or 1
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"GRADSOLVE_CPU_THREADS must be a positive integer, got {value!r}")
    return int(value)


def run_split(fn, n: int, align: int = 1):
    """Call `fn(start, stop)` over slices of the ensemble: on the CPU
    `SLICES_PER_CORE` slices per thread on a pool of `cpu_threads()` threads (a Warp
    CPU launch is single-threaded and releases the GIL; one thread: one launch), on
    a GPU one launch over everything."""
    threads = cpu_threads() if device() == "cpu" else 1
    if threads == 1:
        fn(0, n)
        return
    parts = slices(n, min(threads * SLICES_PER_CORE, -(-n // MIN_SLICE)), align)
    if len(parts) == 1:
        fn(*parts[0])
        return
    for future in [_pool(threads).submit(fn, a, b) for a, b in parts]:
        future.result()


@functools.cache
def _pool(threads: int):
    """One pool per thread count for the process: creating threads per launch cost
    ~ms on small n."""
    return concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="gradsolve-warp")
