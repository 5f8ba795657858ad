"""Where each trajectory runs: devices, buckets by recorded step count, memory chunks.

The ensemble axis is the parallel axis, and every replay is per trajectory, so an
ensemble can be cut anywhere along it without changing a result. This module is the
one place that cuts it:

- **devices**: the rows are split over a 1-D `jax.sharding.Mesh` with `shard_map`,
  each device running its own loops (no collective per step); `gs.Shared` leaves and
  the mesh's span are replicated, and `shard_map`'s transpose sums their gradients
  over devices;
- **buckets**: the replay sorts the trajectories by recorded step count into a few
  equal-sized groups, each replayed at its own width (the zero-padded columns past a
  group's longest trajectory are dropped: they are the identity), and deals the
  sorted trajectories to the devices in turn, back and forth, so every device gets
  the same mix of short and long ones: the same padded work, about the same steps;
- **chunks**: under a memory budget, each bucket is replayed in chunks of rows, one
  after the other (`lax.map` over a checkpointed chunk: the backward sweep keeps one
  chunk's intermediates at a time), and the recorders run row chunks in turn.

`Arrangement` is the plan (an order of the rows, filler rows to make the pieces
equal, and the static widths); `arrange` makes it on the host from a mesh's step
counts, `run` evaluates a replay function through it, and the outputs come back in
the user's order. Across processes (`gs.distributed`), the device mesh spans every
process's devices and each process records its own rows (`record_rows`).
"""

import dataclasses
import math
import os
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils as mu
from jax.sharding import NamedSharding, PartitionSpec

from . import methods
from .mesh import Mesh, padded_width
from .problem import param_axes
from .status import Status


AXIS = "ensemble"
# The default device split starts at this many trajectories per device. Measured on
# 2 forced host devices of the 2-core CPU (benchmarks/scale.py, docs/benchmarks.md):
# the Lorenz gradient is 0.6-0.8x on two devices at 32-128 rows per device and
# 1.3-2.6x from 256 on; the general record alone is 0.5-1.5x with no size from which
# it pays throughout. The gradient is what is called repeatedly. Named `devices=`
# always split.
MIN_ROWS_PER_DEVICE = 256
# Bucketing: the default number of buckets is the smallest of `BUCKETS` whose padded
# work is within `BUCKET_SLACK` of the largest's, with at least `MIN_BUCKET_ROWS` rows
# per bucket and device (a bucket is one more scan to compile and launch).
BUCKETS = (1, 2, 4, 8)
BUCKET_SLACK = 1.15
MIN_BUCKET_ROWS = 256
# The most buckets `buckets=` may ask for: each is one more replay scan to compile,
# and a replay's compile time grows with them (issue 27: 64 buckets of Lorenz took
# 42.9 s to the first gradient on 4 rows, 2 buckets 5.3 s: ~0.6 s a bucket), while
# the padded work saved flattens out well before, the widths snapping to a few values
# (docs/benchmarks.md, Scaling: a heavy-tailed ensemble's work is 2.02x less in 4
# buckets, 2.08x in 8). Twice the largest default.
MAX_BUCKETS = 16
# XLA's CPU vector width in float64 lanes, at most (8: AVX-512). Every piece of rows
# is a multiple of it, so that no row falls in a vector loop's scalar remainder: the
# remainder rounds differently (libm `pow` in the recorder's controller, a multiply
# and add not fused in the replay), in the last bit, and the recorder's error estimate
# (a difference of near-equal states) turns that bit into 1e-12 in the step sizes.
# With it, a row's results do not depend on how many rows or devices there are -- up
# to a size: from ~1400 rows a piece XLA compiles the recorder's loop body another way
# (measured: a row's mesh is the same at 16 and 1344 rows, 1e-11 apart at 1408), so
# larger split records agree to ~1e-11 in the step sizes, not bit for bit.
LANES = 8
# The default memory budget: this fraction of the memory available when it is read.
BUDGET_FRACTION = 0.5


# -- devices --------------------------------------------------------------------------

def device_mesh(devices, n: int | None = None):
    """The 1-D device mesh the ensemble is split over, or None for one device.

    `devices`: None (the default: every device of the default backend -- across
    processes after `gs.distributed.initialize` -- when `n` reaches
    `MIN_ROWS_PER_DEVICE` per device, else one device), an int (the first that many
    devices), a sequence of `jax.Device`, or a 1-D `jax.sharding.Mesh`.
    """
    if devices is None:
        found = jax.devices()
        if len(found) == 1:
            return None
        if jax.process_count() == 1 and (n is None or n < MIN_ROWS_PER_DEVICE * len(found)):
            return None
        devices = found
    if isinstance(devices, jax.sharding.Mesh):
        if devices.devices.ndim != 1:
            raise ValueError(f"devices must be a 1-D jax.sharding.Mesh (the ensemble axis), "
                             f"got axes {devices.axis_names} of shape {devices.devices.shape}")
        devices = list(devices.devices)
    elif isinstance(devices, (int, np.integer)) and not isinstance(devices, bool):
        found = jax.devices()
        if devices < 1:
            raise ValueError(f"devices must be a positive number of devices, got {devices} "
                             f"(or None, a sequence of jax devices, a 1-D "
                             f"jax.sharding.Mesh)")
        if devices > len(found):
            raise ValueError(f"devices={devices}: there are {len(found)} devices "
                             f"({found[0].platform})")
        devices = found[:devices]
    try:
        devices = list(devices)
    except TypeError:
        raise TypeError(f"devices must be None, a number, a sequence of jax devices or a "
                        f"jax.sharding.Mesh, got {type(devices).__name__}") from None
    if not devices or not all(isinstance(d, jax.Device) for d in devices):
        raise TypeError(f"devices must hold jax devices (jax.devices()), got {devices!r}")
    if len(set(devices)) != len(devices):
        raise ValueError(f"devices lists a device twice: {devices}")
    if len(devices) == 1 and jax.process_count() == 1:
        return None
    return jax.sharding.Mesh(np.array(devices), (AXIS,))


def local_mesh(dmesh):
    """The devices of `dmesh` that this process drives, as a mesh (or None for one)."""
    if dmesh is None:
        return None
    mine = [d for d in dmesh.devices.ravel() if d.process_index == jax.process_index()]
    return jax.sharding.Mesh(np.array(mine), (AXIS,)) if len(mine) > 1 else None


def own_rows(n: int) -> tuple[int, int]:
    """The rows `[lo, hi)` this process records: all of them in one process, else the
    process's equal share, in process order (`gather_processes` joins them)."""
    P, p = jax.process_count(), jax.process_index()
    m = -(-n // P)
    lo, hi = min(n, p * m), min(n, (p + 1) * m)
    if lo >= hi:
        raise ValueError(f"an ensemble of {n} trajectories leaves process {p} of {P} "
                         f"none (shares of {m}): use more trajectories or fewer processes")
    return lo, hi


def row_pieces(n: int, cfg, per_row: int | None, what: str):
    """This process's rows in consecutive chunks that fit `cfg.memory_budget` at
    `per_row` bytes a row (None: one chunk) over its devices, each with its `cfg`
    (a per-trajectory `dt0` cut to the chunk): `[(rows, cfg), ...]`."""
    lo, hi = own_rows(n)
    cap = hi - lo
    if per_row is not None:
        cap = rows_within(cfg.memory_budget, per_row, what) * size(local_mesh(cfg.devices))
    pieces = []
    for a in range(lo, hi, cap):
        rows = np.arange(a, min(a + cap, hi))
        pieces.append((rows, cfg if np.ndim(cfg.dt0) == 0 else dataclasses.replace(
            cfg, dt0=np.asarray(cfg.dt0)[rows])))
    return pieces


def gather_rows(arrays, n: int):
    """Every process's `own_rows` part of each array (rows first) joined into all n
    rows, on every process: a collective, every process calls it with its own parts.
    A 2-D array is padded with zeros to the widest process's columns (a mesh's `h`)."""
    m = -(-n // jax.process_count())
    out = []
    for x in arrays:
        x = np.asarray(x)
        pad = [(0, m - x.shape[0])] + [(0, 0)] * (x.ndim - 1)
        if x.ndim == 2:
            width = int(np.max(mu.process_allgather(np.asarray(x.shape[1]))))
            pad[1] = (0, width - x.shape[1])
        out.append(np.asarray(mu.process_allgather(np.pad(x, pad), tiled=True))[:n])
    return out


def gather_processes(mesh, n: int):
    """Every process's rows of a mesh joined into the mesh of all n rows, on every
    process (`gather_rows`)."""
    parts = gather_rows([mesh.h, mesh.n_steps, mesh.n_rejected, mesh.status], n)
    return eqx.tree_at(lambda t: (t.h, t.n_steps, t.n_rejected, t.status), mesh,
                       tuple(jnp.asarray(x) for x in parts))


def size(dmesh) -> int:
    return 1 if dmesh is None else dmesh.devices.size


def _axes_leaves(tree, axes):
    """`axes` (a pytree prefix of `tree`, of 0 and None) as one entry per leaf of
    `tree`."""
    full = jax.tree.map(lambda a, x: jax.tree.map(lambda _: a, x), axes, tree,
                        is_leaf=lambda v: v is None)
    return jax.tree.leaves(full, is_leaf=lambda v: v is None)


def shard_rows(fn, dmesh, axes):
    """`fn(*args)` with the rows of its arguments split across `dmesh` by `shard_map`:
    each device runs `fn` on its own rows, with no collective inside.

    `axes`: one pytree prefix per argument, of 0 (split along the leading axis) and
    None (replicated, e.g. `gs.Shared` leaves; their gradients are summed over the
    devices by `shard_map`'s transpose). Non-array leaves are closed over. Every
    output is split along its leading axis.
    """
    def call(*args):
        leaves, treedef = jax.tree.flatten(args)
        ax = _axes_leaves(args, tuple(axes))
        arrays = [i for i, x in enumerate(leaves) if eqx.is_array(x)]
        specs = tuple(PartitionSpec(AXIS) if ax[i] == 0 else PartitionSpec() for i in arrays)

        def body(*dynamic):
            full = list(leaves)
            for i, x in zip(arrays, dynamic):
                full[i] = x
            return fn(*jax.tree.unflatten(treedef, full))
        return jax.shard_map(body, mesh=dmesh, in_specs=specs,
                             out_specs=PartitionSpec(AXIS), check_vma=False)(
            *(leaves[i] for i in arrays))
    return call


# -- the memory budget ----------------------------------------------------------------

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
                 gradient: bool = True) -> int:
    """Bytes one trajectory's replay keeps live at `width` columns: the state and time
    at every column (the scan's saved carry), and without `remat` every step's stages
    (d x d Jacobians for implicit methods); twice that for a gradient (the cotangents
    of the same shapes), plus the outputs. The estimate the chunks are sized by; against
    measured peaks in docs/benchmarks.md ("Scaling": 1.79 GB estimated, 1.85 GB
    measured above the process's start, for 2^20 Lorenz rows under 2 GB)."""
    per_column = d + 1
    if not remat:
        per_column += _stages(method) * d + (d * d if method.implicit else 0)
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


def check_buckets(buckets):
    """`buckets` validated: None (the default rule) or a positive integer, at most
    `MAX_BUCKETS`."""
    if buckets is not None and (isinstance(buckets, bool) or not isinstance(
            buckets, (int, np.integer)) or buckets < 1):
        raise ValueError(f"buckets must be None or a positive integer, got {buckets!r}")
    if buckets is not None and buckets > MAX_BUCKETS:
        raise ValueError(f"buckets must be at most {MAX_BUCKETS} (each bucket is one more "
                         f"replay to compile), got {buckets}; None picks a number")
    return None if buckets is None else int(buckets)


def usable_buckets(n: int, D: int) -> int:
    """The most buckets n rows on D devices can fill: a bucket holds at least `LANES`
    rows a device, so past this the buckets would hold filler rows only."""
    return max(1, -(-n // (D * LANES)))


# -- the arrangement ------------------------------------------------------------------

class Arrangement(eqx.Module):
    """Where each row of an ensemble of n is replayed.

    Attributes:
        order: `(n_pad,)` the user's row at each position: device-major, each device's
            rows bucket-major (ascending step counts), each bucket `chunks` chunks.
        real: `(n_pad,)` False at filler positions (each replays a copy of the row
            with the fewest steps, which it names in `order`).
        where: `(n,)` the position of each user row in `order`.
        widths: per bucket, the mesh columns it replays (>= its longest trajectory).
        chunks: chunks per bucket (1: the bucket at once).
        devices: the device mesh (None: one device).
        identity: one device, one piece, the user's order, no filler: `run` calls the
            replay function as it is.
    """

    order: jax.Array
    real: jax.Array
    where: jax.Array
    widths: tuple = eqx.field(static=True)
    chunks: int = eqx.field(static=True)
    devices: object = eqx.field(static=True)
    identity: bool = eqx.field(static=True, default=False)

    @property
    def rows(self) -> int:
        """Rows per bucket on one device."""
        return self.order.shape[0] // (size(self.devices) * len(self.widths))

    def work(self) -> int:
        """Padded work: rows x columns replayed, over all devices."""
        return size(self.devices) * self.rows * sum(self.widths)


def _plan_sizes(n, D, k, rows_cap):
    """Chunks per bucket q and rows per bucket m (a multiple of LANES per chunk)."""
    m = -(-n // (D * k))
    q = 1 if rows_cap is None else max(1, -(-m // max(LANES, rows_cap)))
    c = -(-m // q)
    return q, -(-c // LANES) * LANES * q


def _layout(steps, D, k, rows_cap, S):
    """Order (-1 at filler positions), bucket widths and chunks per bucket for
    `steps` on D devices in k buckets. Fillers stand for copies of the row with the
    fewest steps: they sort first."""
    n = steps.size
    q, m = _plan_sizes(n, D, k, rows_cap)
    n_pad = D * k * m
    ranked = np.concatenate([np.full(n_pad - n, -1), np.argsort(steps, kind="stable")])
    ranked_steps = steps[np.where(ranked >= 0, ranked, np.argmin(steps))]
    # Dealt in turn, back and forth (device 0, 1, .., D-1, D-1, .., 0, ...): each
    # device gets the same number of rows of every bucket, and about the same steps.
    r = np.arange(n_pad)
    lap, seat = r // D, r % D
    device = np.where(lap % 2 == 0, seat, D - 1 - seat)
    position = device * (k * m) + lap                # device-major, ascending within
    order = np.empty(n_pad, np.int64)
    order[position] = ranked
    widths = []
    for b in range(k):
        longest = ranked_steps[b * m * D:(b + 1) * m * D].max(initial=0)
        widths.append(min(S, padded_width(int(longest))) if longest > 0 else 0)
    widths = [int(w) for w in widths]
    return order, tuple(widths), q


def arrange(n: int, *, dmesh=None, n_steps=None, status=None, columns=None, buckets=None,
            rows_cap=None, min_widths=None) -> Arrangement:
    """The arrangement of n rows on `dmesh` (host NumPy; `n_steps` and `status` are a
    mesh's, or None when the step counts are not known: one bucket of full width).

    `buckets`: None (the default rule: `BUCKETS`, `BUCKET_SLACK`, `MIN_BUCKET_ROWS`),
    or a number (1: no buckets; at most `usable_buckets(n, devices)` are made, the
    rest would hold only filler rows). `rows_cap`: the most rows one chunk may hold
    (None: no limit). `min_widths`: widths not to shrink below (a Calibrator keeps its
    compiled update while the step counts wander).

    Examples:
        >>> import numpy as np
        >>> from gradsolve import layout
        >>> steps = np.array([10] * 600 + [100] * 400)
        >>> flat = layout.arrange(1000, n_steps=steps, buckets=1)
        >>> auto = layout.arrange(1000, n_steps=steps)
        >>> flat.widths, auto.widths, round(flat.work() / auto.work(), 2)
        ((100,), (10, 100), 1.8)
    """
    D = size(dmesh)
    S = int(columns) if columns is not None else 0
    if n_steps is None:
        steps = np.full(n, S, np.int64)
        choices = (1,)
    else:
        steps = np.asarray(n_steps, np.int64)
        if status is not None:  # a masked trajectory replays no steps
            steps = np.where(np.asarray(status) == Status.SUCCESS, steps, 0)
        S = S or int(steps.max(initial=0))
        if buckets is None:
            per = -(-n // D)
            choices = tuple(k for k in BUCKETS if k == 1 or per // k >= MIN_BUCKET_ROWS)
        else:
            choices = (min(check_buckets(buckets), usable_buckets(n, D)),)
    plans = [_layout(steps, D, k, rows_cap, S) for k in choices]
    if min_widths is not None:
        plans = [(o, tuple(max(a, b) for a, b in zip(w, min_widths)) if len(w) == len(min_widths)
                  else w, q) for o, w, q in plans]
    work = [len(o) // len(w) * sum(w) for o, w, _ in plans]
    best = min(work)
    pick = next(i for i, w in enumerate(work) if w <= BUCKET_SLACK * best)
    order, widths, q = plans[pick]
    real = order >= 0
    # A filler replays a copy of a real row, its mesh and all: whatever it computes
    # is what that row computes (finite where the row is), and it never reaches an
    # output, so its zero cotangent adds exact zeros to the row's gradients.
    order = np.where(real, order, int(np.argmin(steps)))
    where = np.empty(n, np.int64)
    where[order[real]] = np.flatnonzero(real)
    put = _replicated(dmesh)
    identity = dmesh is None and len(widths) == 1 and q == 1 and order.size == n \
        and bool((order == np.arange(n)).all())
    return Arrangement(order=put(order.astype(np.int32)), real=put(real),
                       where=put(where.astype(np.int32)), widths=widths, chunks=q,
                       devices=dmesh, identity=identity)


def _replicated(dmesh):
    if dmesh is None:
        return jnp.asarray
    sharding = NamedSharding(dmesh, PartitionSpec())
    return lambda x: jax.device_put(x, sharding)


def for_mesh(mesh, n, *, dmesh, buckets=None, rows_cap=None, min_widths=None):
    """`arrange` from a concrete `gs.Mesh` (or None: no mesh, one bucket; a traced mesh:
    its step counts unknown, one bucket)."""
    if mesh is None or isinstance(mesh.n_steps, jax.core.Tracer):
        return arrange(n, dmesh=dmesh, buckets=1, rows_cap=rows_cap,
                       columns=None if mesh is None else mesh.columns)
    return arrange(n, dmesh=dmesh, n_steps=np.asarray(mesh.n_steps),
                   status=np.asarray(mesh.status), columns=mesh.columns, buckets=buckets,
                   rows_cap=rows_cap, min_widths=min_widths)


def for_replay(mesh, n, cfg, d, itemsize, *, gradient=True, min_widths=None):
    """The arrangement a replay of `mesh` runs by under `cfg`'s devices, buckets and
    memory budget (chunks only where a device's rows would not fit)."""
    rows_cap = None
    if mesh is not None:
        per_row = replay_bytes(methods.get(cfg.method), d, mesh.columns, itemsize,
                               remat=bool(cfg.remat), n_ts=0 if cfg.ts is None else len(cfg.ts),
                               gradient=gradient)
        rows = -(-n // size(cfg.devices))
        held = held_bytes(rows, mesh.columns, d, itemsize)
        if held + rows * per_row > cfg.memory_budget:
            rows_cap = rows_within(cfg.memory_budget, per_row,
                                   "replay gradient" if gradient else "replay", held=held)
    return for_mesh(mesh, n, dmesh=cfg.devices, buckets=cfg.buckets, rows_cap=rows_cap,
                    min_widths=min_widths)


def replicated(tree, arr):
    """`tree` (under `jit`) constrained to be whole on every device of `arr`'s mesh,
    where the mesh spans processes: every process can then read the results."""
    if arr is None or arr.devices is None or jax.process_count() == 1:
        return tree
    sharding = NamedSharding(arr.devices, PartitionSpec())
    return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, sharding)
                        if eqx.is_array(x) else x, tree)


# -- running a replay through an arrangement -------------------------------------------

def _mesh_axes(mesh):
    """`vmap`-style axes of a `gs.Mesh`: its rows split, its span replicated."""
    return None if mesh is None else Mesh(
        h=0, n_steps=0, n_rejected=0, status=0, t0=None, t1=None, method=mesh.method,
        rtol=mesh.rtol, atol=mesh.atol, recorder=mesh.recorder)


def _map_rows(f, tree, axes):
    """`f` on the leaves of `tree` whose axis (in the prefix `axes`) is 0."""
    return jax.tree.map(lambda a, x: jax.tree.map(lambda v: f(v) if eqx.is_array(v) else v, x)
                        if a == 0 else x, axes, tree, is_leaf=lambda v: v is None)


def run(ys_fn, arr: Arrangement | None, mesh, params, y0):
    """`ys_fn(mesh, params, y0)` of every row, evaluated piecewise as `arr` says, in the
    user's row order. `ys_fn` must treat rows independently (every replay does); its
    output is an array or a pytree of arrays, each leading with the rows.

    Each piece gathers its own rows (and the bucket's columns of the mesh) when it
    runs: on one device no permuted copy of the whole mesh is made, so a chunked
    replay holds the mesh once and one chunk's work. Split over devices, each device
    receives its rows in arrangement order.
    """
    if arr is None or arr.identity:
        return ys_fn(mesh, params, y0)
    axes = (_mesh_axes(mesh), param_axes(params), 0)
    args = (mesh, params, y0)
    widths, q = arr.widths, arr.chunks
    k = len(widths)

    def local(index, *args):
        m = index.shape[0] // k
        outs = []
        for b, w in enumerate(widths):
            rows = index[b * m:(b + 1) * m]
            if q == 1:
                outs.append(_piece(ys_fn, args, axes, rows, w))
            else:
                outs.append(_chunked(ys_fn, args, axes, rows.reshape(q, -1), w))
        return jax.tree.map(lambda *o: jnp.concatenate(o, axis=0), *outs) if k > 1 else outs[0]

    if arr.devices is None:
        ys_o = local(arr.order, *args)
    else:  # each device its own rows, in arrangement order; `local` indexes them
        ordered = _map_rows(lambda x: x[arr.order], args, axes)
        positions = jnp.arange(arr.order.shape[0] // size(arr.devices), dtype=jnp.int32)
        ys_o = shard_rows(lambda *a: local(positions, *a), arr.devices, axes)(*ordered)
    return jax.tree.map(lambda y: y[arr.where], ys_o)


def _piece(ys_fn, args, axes, rows, width):
    """`ys_fn` of the rows `rows` of `args`, on the mesh's first `width` columns (the
    columns past a bucket's longest trajectory are all zero: the identity)."""
    mesh, params, y0 = _map_rows(lambda x: x[rows], args, axes)
    if mesh is not None:
        mesh = eqx.tree_at(lambda t: t.h, mesh, mesh.h[:, :max(width, 1)])
    return ys_fn(mesh, params, y0)


def _chunked(ys_fn, args, axes, chunks, width):
    """`_piece` over the row chunks `chunks` `(q, c)` in turn, each recomputed in the
    backward sweep (`lax.map` of a checkpointed chunk): one chunk's intermediates are
    live at a time."""
    dynamic, static = eqx.partition(args, eqx.is_array)

    @eqx.filter_checkpoint
    def one(rows, dynamic):
        return _piece(ys_fn, eqx.combine(dynamic, static), axes, rows, width)

    ys = jax.lax.map(lambda rows: one(rows, dynamic), chunks)
    return jax.tree.map(lambda y: y.reshape((-1,) + y.shape[2:]), ys)
