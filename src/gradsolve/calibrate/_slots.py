"""The slot scheduler's moves: a window of starts that the compiled update runs on
(`fit(..., slots=m)`), and the host-side copies of fits and their mesh rows between
the window and the whole fit state. In NumPy: `jnp` indexing compiles once per shape."""

from typing import Any, NamedTuple

import jax
import numpy as np

from ..mesh import grown_width
from ._state import FitState


class Window(NamedTuple):
    """The starts the compiled update runs on: `state` holds slot j's copy of start
    `start[j]` (a `FitState` of the slots, without the host-side history), with its
    trajectories' problem y0 and its data."""

    start: np.ndarray    # (slots,) the start in each slot
    state: FitState
    y0: jax.Array        # (slots * K, d)
    data: Any


# The fields of a FitState that are per fit, and the mesh arrays that are per row.
FIT_FIELDS = ("u", "opt_state", "active", "status", "steps", "loss", "grad_norm")
ROW_FIELDS = ("h", "n_steps", "n_rejected", "status")


def check_slots(slots, S):
    if slots is None:
        return S
    if isinstance(slots, bool) or not isinstance(slots, (int, np.integer)) or slots < 1:
        raise ValueError(f"slots must be None or a positive integer, got {slots!r}")
    return min(int(slots), S)


def widths(a, b):
    """Two `h` arrays padded with zero columns to the wider one's width."""
    cols = max(a.shape[1], b.shape[1])
    return tuple(np.pad(x, ((0, 0), (0, cols - x.shape[1]))) for x in (a, b))


def rows(tree, rows):
    """Rows `rows` of every leaf, taken in NumPy (`jnp` indexing compiles once per
    shape) and handed to the device in one `device_put` (see `moved`)."""
    return jax.device_put(jax.tree.map(lambda x: np.asarray(x)[rows], tree))


def put(tree, to, new, at):
    """`tree` with its rows `to` replaced by `new`'s rows `at` (h widened to fit), in
    NumPy (`moved` hands the result to the device)."""
    def put(x, y):
        x, y = np.asarray(x), np.asarray(y)
        if x.ndim == 2 and x.shape[1] != y.shape[1]:  # a mesh's h
            x, y = widths(x, y)
        x = x.copy()
        x[to] = y[at]
        return x
    return jax.tree.map(put, tree, new)


def trajectories(fits, K):
    """The ensemble rows of fits `fits` (K trajectories each)."""
    return np.repeat(np.asarray(fits) * K, K) + np.tile(np.arange(K), np.size(fits))


def moved(dst, to, src, at, K):
    """The FitState `dst` with its fits `to` (and their mesh rows) replaced by `src`'s
    fits `at`: a window's fits into the state, or the state's starts into a window."""
    fits = {f: put(getattr(dst, f), to, getattr(src, f), at) for f in FIT_FIELDS}
    mesh_rows = {}
    if dst.mesh is not None:
        to_rows, at_rows = trajectories(to, K), trajectories(at, K)
        mesh_rows = {k: put(dst.mesh[k], to_rows, src.mesh[k], at_rows) for k in ROW_FIELDS}
    # One device_put for everything moved: one per leaf took 45 us a leaf here, one
    # for all 21 us (a fit state has dozens of leaves, moved at every slot refill and
    # before every checkpoint).
    fits, mesh_rows = jax.device_put((fits, mesh_rows))
    mesh = None if dst.mesh is None else dict(dst.mesh, **mesh_rows)
    return dst._replace(mesh=mesh, **fits)


def adopt(arrays, fresh, fits, K, growth):
    """The mesh arrays with fits `fits`' rows taken from the record `fresh`: the
    current width while those rows' steps fit in it, else wider (`grown_width` by
    `growth`)."""
    rows = np.repeat(fits, K)
    out = dict(arrays)
    width = grown_width(int(np.asarray(fresh.n_steps)[rows].max()),
                        np.shape(arrays["h"])[1], growth)
    for k in ROW_FIELDS:
        old, new = np.asarray(arrays[k]), np.asarray(getattr(fresh, k))
        if k == "h":  # beyond a row's steps its h is zero: cut or pad to the width
            old, new = (np.pad(x[:, :width], ((0, 0), (0, max(0, width - x.shape[1]))))
                        for x in (old, new))
        out[k] = jax.device_put(np.where(rows.reshape((-1,) + (1,) * (old.ndim - 1)),
                                         new, old))
    return out
