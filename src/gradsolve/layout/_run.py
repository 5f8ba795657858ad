"""Running a replay function through an arrangement (`run`), outputs in the user's
order."""

import equinox as eqx
import jax
import jax.numpy as jnp

from ..mesh import Mesh
from ..problem import param_axes
from ._arrangement import Arrangement
from ._devices import shard_rows, size


def _mesh_axes(mesh):
    """`vmap`-style axes of a `gs.Mesh`: its rows split, its span replicated."""
    return None if mesh is None else Mesh(
        h=0, n_steps=0, n_rejected=0, status=0, t0=None, t1=None, method=mesh.method,
        rtol=mesh.rtol, atol=mesh.atol, recorder=mesh.recorder, guarded=mesh.guarded)


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
