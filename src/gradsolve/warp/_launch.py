"""One launch driver for the fused kernels: a kernel's signature as data, and `run`.

A kernel that runs whole trajectories per thread takes, in its parameter order:

- `per_trajectory` inputs: host arrays with one row per trajectory;
- `shared` inputs: one host array every trajectory reads;
- `scalar`s: one number for the launch (the float type `T`, or `int`);
- `count`: the number of trajectories in this launch (the kernel guards its lanes);
- `output`s: one row per trajectory, zero-initialised, copied back to the host;
- `block_sum`s: one row per trajectory for the kernel to write (a shared parameter's
  gradient, row i from trajectory i alone), returned summed over the trajectories:
  rows are summed in fixed blocks of `BLOCK` trajectories and the block sums in
  order, and launches start on block boundaries, so the sum is the same bit for bit
  whatever the slicing, chunking or thread count, and only one chunk's rows exist at
  a time (no n x k buffer beyond the memory budget).

A `Signature` lists these; it writes the kernel's Warp header (`header`) so the text
and the launch cannot disagree, and `run` packs the inputs (host -> Warp arrays of the
launch's float type on the runtime's device), chunks the trajectories by a memory
budget computed from the signature's per-trajectory bytes, splits each chunk over the
thread pool (`_runtime.run_split`: slices on the CPU, one launch on a GPU), and
returns the outputs as NumPy arrays in a NamedTuple. A trajectory's result does not
depend on its chunk, slice or lane: each thread reads only its own rows.
"""

import dataclasses
import functools
import math
from typing import NamedTuple

import numpy as np

from . import _runtime


FLOAT, INT32, INT = "float", "int32", "int"  # element types; FLOAT is the launch's T


class Param(NamedTuple):
    """One kernel parameter. `shape` is per trajectory for inputs and outputs (the row
    shape); its entries are ints or names of sizes given
    to `run`."""

    name: str
    role: str
    shape: tuple = ()
    dtype: str = FLOAT


def per_trajectory(name, *shape, dtype=FLOAT) -> Param:
    return Param(name, "per_trajectory", shape, dtype)


def shared(name, dtype=FLOAT) -> Param:
    return Param(name, "shared", (None,), dtype)


def scalar(name, dtype=FLOAT) -> Param:
    return Param(name, "scalar", (), dtype)


def count(name) -> Param:
    return Param(name, "count", (), INT)


def output(name, *shape, dtype=FLOAT) -> Param:
    return Param(name, "output", shape, dtype)


def block_sum(name, *shape, dtype=FLOAT) -> Param:
    return Param(name, "block_sum", shape, dtype)


BLOCK = 64  # trajectories per fixed summation block of a block_sum
_ARRAY_ROLES = ("per_trajectory", "output", "block_sum")  # a leading axis over trajectories
_RESULTS = ("output", "block_sum")


def _warp_type(param: Param) -> str:
    """The parameter's type annotation in the generated source."""
    element = {FLOAT: "T", INT32: "wp.int32", INT: "int"}[param.dtype]
    if param.role in ("scalar", "count"):
        return element
    ndim = len(param.shape) + (param.role in _ARRAY_ROLES)
    return f"wp.array{'' if ndim == 1 else f'{ndim}d'}(dtype={element})"


@dataclasses.dataclass(frozen=True)
class Signature:
    """A kernel's parameters, in order; `Outputs` is the NamedTuple `run` returns
    (one field per output and block_sum)."""

    params: tuple[Param, ...]

    def __post_init__(self):
        names = [p.name for p in self.params]
        if len(set(names)) != len(names):
            raise ValueError(f"repeated parameter names in {names}")
        if sum(p.role == "count" for p in self.params) != 1:
            raise ValueError("a signature needs exactly one count parameter")

    @functools.cached_property
    def Outputs(self):  # noqa: N802 - a class
        names = [p.name for p in self.params if p.role in _RESULTS]
        return NamedTuple("Outputs", [(name, np.ndarray) for name in names])

    def header(self, name: str, width: int = 88) -> str:
        """`@wp.kernel(enable_backward=False)` and `def name(...):`, wrapped at `width`.

        Forward kernels are marked forward-only one by one (Warp then compiles no
        adjoint for them or for the functions only they call): a module may also hold
        kernels that need their backward.
        """
        head = f"def {name}("
        lines, line = [], head
        for k, p in enumerate(self.params):
            text = f"{p.name}: {_warp_type(p)}" + ("):" if k == len(self.params) - 1 else ",")
            if len(line) + 1 + len(text) > width and line.strip() != head.strip():
                lines.append(line)
                line = " " * len(head) + text
            else:
                line += ("" if line == head else " ") + text
        return "@wp.kernel(enable_backward=False)\n" + "\n".join(lines + [line]) + "\n"


def _host(param: Param, dtype) -> np.dtype:
    return {FLOAT: dtype, INT32: np.dtype(np.int32), INT: np.dtype(np.int64)}[param.dtype]


def _shape(param: Param, sizes) -> tuple:
    return tuple(sizes[k] if isinstance(k, str) else k for k in param.shape)


def run(kernel, signature: Signature, values: dict, *, n: int, dtype, lanes: int,
        budget: int, sizes: dict | None = None, rows=None, into: dict | None = None):
    """Launch `kernel` over trajectories `rows` (default: all `n`).

    Args:
        kernel: the compiled Warp kernel whose header `signature.header` wrote.
        signature: its parameters.
        values: host values by parameter name for every input and scalar;
            per-trajectory arrays have `n` rows.
        n: the number of trajectories in `values`.
        dtype: the float type (`np.float32` or `np.float64`).
        lanes: trajectories per thread (a launch has `ceil(m / lanes)` threads).
        budget: bytes a chunk of trajectories may use on the device; consecutive chunks
            run one after another.
        sizes: the values of the named entries of outputs' and block sums' shapes.
        rows: indices of the trajectories to run.
        into: host arrays, by output name, that outputs are written into (zeroed
            first) instead of new ones: the buffers a caller keeps them in (XLA's
            output buffers, `_jax.call`), so they are written once.

    Returns:
        `signature.Outputs`: each output `(len(rows), *shape)`, each block_sum summed
        over the trajectories.
    """
    wp = _runtime.warp()
    dev = _runtime.device()
    dtype = np.dtype(dtype)
    T = wp.float64 if dtype == np.float64 else wp.float32
    sizes = sizes or {}
    rows = np.arange(n) if rows is None else np.asarray(rows)
    element = {FLOAT: T, INT32: wp.int32}
    host = {p.name: np.asarray(values[p.name], _host(p, dtype)) for p in signature.params
            if p.role in ("per_trajectory", "shared")}
    for p in signature.params:
        if p.role == "per_trajectory" and host[p.name].shape[0] != n:
            raise ValueError(f"{p.name}: {host[p.name].shape[0]} rows, expected {n}")
    outs = {}
    for p in signature.params:
        if p.role != "output":
            continue
        shape, kind = (len(rows), *_shape(p, sizes)), _host(p, dtype)
        given = (into or {}).get(p.name)
        if given is None:
            outs[p.name] = np.zeros(shape, kind)
            continue
        if given.shape != shape or given.dtype != kind or not given.flags.c_contiguous:
            raise ValueError(f"{p.name}: into a {given.dtype} array of shape {given.shape}, "
                             f"expected a contiguous {kind} array of shape {shape}")
        given[...] = 0
        outs[p.name] = given
    # Per block_sum, per block of BLOCK trajectories (by its first row): the block's sum.
    partial = {p.name: {} for p in signature.params if p.role == "block_sum"}

    # On the CPU, Warp arrays wrap the host memory (no copies in or out): inputs are
    # views of contiguous row ranges, outputs write straight into their NumPy rows.
    on_cpu = dev == "cpu"
    contiguous = len(rows) == 0 or bool(np.all(np.diff(rows) == 1))
    start_row = int(rows[0]) if len(rows) else 0

    def wrap(array, param, alive):
        if not on_cpu:
            return wp.array(array, dtype=element[param.dtype], device=dev)
        array = np.ascontiguousarray(array)
        if not array.size:
            return wp.array(array, dtype=element[param.dtype], device=dev, copy=False)
        # By pointer: a third of the cost of Warp's general constructor; `alive` holds
        # `array` until the launch has synchronised.
        alive.append(array)
        return wp.array(ptr=array.ctypes.data, shape=array.shape, dtype=element[param.dtype],
                        device=dev)

    on_device = {p.name: wrap(host[p.name], p, []) for p in signature.params
                 if p.role == "shared"}  # (`host` holds the arrays)

    def launch(a, b):
        """One launch over rows[a:b], written into `outs` (and `partial`)."""
        m = b - a
        rows_in = (slice(start_row + a, start_row + b) if contiguous else rows[a:b])
        args, results, alive = [], {}, []
        for p in signature.params:
            if p.role == "per_trajectory":
                args.append(wrap(host[p.name][rows_in], p, alive))
            elif p.role == "shared":
                args.append(on_device[p.name])
            elif p.role == "scalar":
                args.append(T(values[p.name]) if p.dtype == FLOAT else int(values[p.name]))
            elif p.role == "count":
                args.append(m)
            elif p.role == "output" and on_cpu:
                results[p.name] = None
                args.append(wrap(outs[p.name][a:b], p, alive))
            else:
                shape = _shape(p, sizes)
                results[p.name] = wp.zeros((m, *shape), dtype=element[p.dtype], device=dev)
                args.append(results[p.name])
        wp.launch(kernel, dim=-(-m // lanes), inputs=args, device=dev)
        wp.synchronize_device(dev)
        for name, array in results.items():
            if array is None:
                continue  # written in place
            if name in outs:
                outs[name][a:b] = array.numpy()
            else:
                rows_ = array.numpy()
                for k in range(0, m, BLOCK):  # a starts on a block boundary
                    partial[name][a + k] = rows_[k:k + BLOCK].sum(axis=0)

    per_row = sum(math.prod(host[p.name].shape[1:] if p.role == "per_trajectory"
                            else _shape(p, sizes)) * _host(p, dtype).itemsize
                  for p in signature.params if p.role in _ARRAY_ROLES)
    align = BLOCK if partial else 1
    chunk = max(align, budget // max(per_row, 1) // align * align)
    for start in range(0, len(rows), chunk):
        stop = min(len(rows), start + chunk)
        _runtime.run_split(lambda a, b, start=start: launch(start + a, start + b), stop - start,
                           align)

    sums = {}
    for name, parts in partial.items():
        p = next(q for q in signature.params if q.name == name)
        total = np.zeros(_shape(p, sizes), _host(p, dtype))
        for key in sorted(parts):
            total += parts[key]
        sums[name] = total
    return signature.Outputs(**{p.name: outs[p.name] if p.role == "output" else sums[p.name]
                                for p in signature.params if p.role in _RESULTS})
