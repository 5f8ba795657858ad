"""Devices and processes: the 1-D device mesh the rows are split over, this
process's rows, row chunks under the memory budget, and rows gathered across
processes."""

import dataclasses

import equinox as eqx
import jax
import numpy as np
from jax.experimental import multihost_utils as mu
from jax.sharding import PartitionSpec

from ._memory import rows_within


AXIS = "ensemble"
# The default device split starts at this many trajectories per device. Measured on
# 2 forced host devices of the 2-core CPU (benchmarks/scale.py, docs/benchmarks.md):
# the Lorenz gradient is 0.6-0.8x on two devices at 32-128 rows per device and
# 1.3-2.6x from 256 on; the general record alone is 0.5-1.5x with no size from which
# it pays throughout. The gradient is what is called repeatedly. Named `devices=`
# always split.
MIN_ROWS_PER_DEVICE = 256


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
    process's equal share, in process order (`gather_rows` joins them)."""
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


def by_rows(n: int, cfg, per_row: int | None, what: str, run):
    """`run(rows, cfg)` (a tuple of arrays, rows first) over this process's rows in
    the chunks of `row_pieces`, joined into all n rows: `rows` is None for the whole
    ensemble in one piece (one process, one chunk: `run`'s arrays are returned as they
    are), else a chunk's row indices with its `cfg`. The chunks are joined on the host
    as they come -- one host copy of the result, a 2-D array (a mesh's `h`) widened
    with zeros when a chunk is wider -- then joined over processes (`gather_rows`)."""
    pieces = row_pieces(n, cfg, per_row, what)
    if len(pieces) == 1 and pieces[0][0].size == n:
        return run(None, cfg)
    lo, out = pieces[0][0][0], None
    for rows, sub in pieces:
        part = [np.asarray(x) for x in run(rows, sub)]
        if out is None:
            out = [np.zeros((pieces[-1][0][-1] + 1 - lo,) + x.shape[1:], x.dtype)
                   for x in part]
        for i, x in enumerate(part):
            if x.ndim != 2:
                out[i][rows - lo] = x
                continue
            if x.shape[1] > out[i].shape[1]:
                out[i] = np.pad(out[i], ((0, 0), (0, x.shape[1] - out[i].shape[1])))
            out[i][rows - lo, :x.shape[1]] = x
        del part
    return gather_rows(out, n) if jax.process_count() > 1 else out


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
