"""The memory model: the budget, and what a row of a replay or a record holds."""

import math
import os
import re

import jax
import numpy as np


# The default memory budget: this fraction of the memory available when it is read.
BUDGET_FRACTION = 0.5


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def budget_bytes(memory_budget) -> int:
    """`memory_budget`, the bytes each device may use, validated: a positive number of
    bytes, a string such as `"2GB"` or `"512 MiB"`, or None for `BUDGET_FRACTION` of
    the memory available now (of the default device's memory on a GPU; on the CPU of
    the host's, shared by the host's devices)."""
    if memory_budget is None:
        return available_bytes()
    if isinstance(memory_budget, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", memory_budget)
        if m is None or m.group(2).lower() not in _UNITS:
            raise ValueError(f"memory_budget must be a number of bytes or a size such as "
                             f"'2GB' or '512MiB', got {memory_budget!r}")
        memory_budget = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if isinstance(memory_budget, bool) or not isinstance(memory_budget, (int, float, np.number)) \
            or not memory_budget > 0 or not math.isfinite(memory_budget):
        raise ValueError(f"memory_budget must be a positive number of bytes or a size such "
                         f"as '2GB', got {memory_budget!r}")
    return int(memory_budget)


def available_bytes() -> int:
    device = jax.devices()[0]
    stats = device.memory_stats() if device.platform != "cpu" else None
    if stats and "bytes_limit" in stats:
        free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
    else:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        free //= jax.local_device_count()
    return int(BUDGET_FRACTION * free)


def _stages(method) -> int:
    return getattr(method.tableau, "stages", 8)


def replay_bytes(method, d: int, width: int, itemsize: int, *, remat: bool, n_ts: int = 0,
                 gradient: bool = True, evaluation_size: int = 0) -> int:
    """Bytes one trajectory's replay keeps live at `width` columns: the state and time
    at every column (the scan's saved carry), and without `remat` every step's stages
    -- each what one evaluation of the field computes (`evaluation_size`, at least d:
    a network's activations) -- and d x d Jacobians for implicit methods; twice that
    for a gradient (the cotangents of the same shapes), plus the outputs. The estimate
    the chunks are sized by; against measured peaks in docs/benchmarks.md ("Scaling":
    1.79 GB estimated, 1.85 GB measured above the process's start, for 2^20 Lorenz rows
    under 2 GB)."""
    per_column = d + 1
    if not remat:
        per_column += (_stages(method) * max(d, evaluation_size)
                       + (d * d if method.implicit else 0))
    live = width * per_column + (n_ts + 1) * (d + 1) * (width > 0) + 4 * d
    return int(itemsize * live * (2 if gradient else 1))


def record_bytes(method, d: int, itemsize: int, chunk: int) -> int:
    """Bytes one trajectory holds in the general recorder: its state, slopes and stages
    (d x d for implicit methods), twice (the loop's carry in and out), and its chunk
    of step sizes five times over (the carry in and out, the host's copy, the joined
    mesh and its device copy). Measured: 2.5 kB a row for Lorenz (d = 3, Tsit5,
    chunk 64) at 2^20 rows, against 3.2 kB from this (docs/benchmarks.md, Scale)."""
    per_state = d * (_stages(method) + 6) + (d * d * 2 if method.implicit else 0)
    return int(itemsize * (2 * per_state + 5 * chunk + 8))


def held_bytes(rows: int, columns: int, d: int, itemsize: int) -> int:
    """What a device holds whole while a chunked replay runs: its rows of the mesh
    (`columns` step sizes each) and of the states, parameters and outputs with their
    gradients (~4 (d + 1) numbers each)."""
    return rows * itemsize * (columns + 4 * (d + 1))


def rows_within(budget: int, per_row: int, what: str, held: int = 0) -> int:
    """How many rows of `per_row` bytes fit in `budget` beside `held` bytes; a clear
    error if not even one does."""
    if held + per_row > budget:
        beside = f" beside {held:,} bytes for the whole ensemble's mesh and states" \
            if held else ""
        raise MemoryError(
            f"one trajectory needs about {per_row:,} bytes for the {what}{beside}, more "
            f"than the memory budget of {budget:,} bytes (memory_budget=): raise the "
            f"budget, split the ensemble over more devices, or shorten the mesh (a "
            f"looser rtol, a shorter t_span)")
    return max(1, (budget - held) // per_row)
