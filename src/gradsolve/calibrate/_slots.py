"""The slot scheduler: a window of starts that the compiled update runs on
(`fit(..., slots=m)`), refilled as fits stop (`fill`, `flush`), and the host-side
copies of fits and their mesh rows between the window and the whole fit state. In
NumPy: `jnp` indexing compiles once per shape."""

from typing import Any, NamedTuple

import jax
import numpy as np

from ..mesh import grown_width
from ._state import FitState, FitStatus


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


def moved(dst, to, src, at, K, to_device=True):
    """The FitState `dst` with its fits `to` (and their mesh rows) replaced by `src`'s
    fits `at`: a window's fits into the state, or the state's starts into a window.
    Without `to_device`, the replaced fields are left in NumPy (a state to save)."""
    fits = {f: put(getattr(dst, f), to, getattr(src, f), at) for f in FIT_FIELDS}
    mesh_rows = {}
    if dst.mesh is not None:
        to_rows, at_rows = trajectories(to, K), trajectories(at, K)
        mesh_rows = {k: put(dst.mesh[k], to_rows, src.mesh[k], at_rows) for k in ROW_FIELDS}
    # One device_put for everything moved: one per leaf took 45 us a leaf here, one
    # for all 21 us (a fit state has dozens of leaves, moved at every slot refill and
    # before every checkpoint).
    if to_device:
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


# -- the scheduler: which starts the compiled update runs on ----------------------------

def fill(state, window, K, B, y0, data):
    """Slots whose fit has stopped take the next queued starts, lowest index first.
    Returns the state with the stopped fits written back, and the window (None if
    no start is left to run; none of its fits active once all have stopped). `y0` and
    `data` are the whole fit's problem y0 (S * K rows) and data (S fits)."""
    S = state.active.shape[0]
    waiting = np.asarray(state.active).copy()
    if window is None:  # the first fill (or after a restore): active starts in order
        free, start = np.arange(B), np.full(B, -1, np.int32)
    else:
        free, start = np.flatnonzero(~np.asarray(window.state.active)), window.start.copy()
        waiting[window.start] = False  # the slots' own fits, running or stopped
    queue = np.flatnonzero(waiting)
    if window is None and not queue.size:
        return state, None
    if window is not None and (not free.size or not queue.size):
        return state, window
    if window is not None:  # the stopped fits back into the state
        state = flush(state, window, free)
    take = queue[:free.size]
    start[free[:take.size]] = take
    if window is None:
        # Slots no start takes hold a stopped fit, inactive: a placeholder.
        start[free[take.size:]] = np.setdiff1d(np.arange(S), take)[:B - take.size]
    entering = np.isin(np.arange(B), free[:take.size])
    window = _gather(state, window, start, entering, K, y0, data)
    status = np.asarray(window.state.status)
    status = np.where(entering & (status == FitStatus.QUEUED), FitStatus.RUNNING, status)
    return state, window._replace(state=window.state._replace(
        status=jax.device_put(status.astype(np.int32))))


def _gather(state, window, start, entering, K, y0, data):
    """The window with slots `entering` loaded from the state's starts `start`."""
    if window is None:
        at = trajectories(start, K)
        mesh = None if state.mesh is None else dict(
            state.mesh, **{k: rows(state.mesh[k], at) for k in ROW_FIELDS})
        new = state._replace(history=None, drift=None, mesh=mesh,
                             **{f: rows(getattr(state, f), start) for f in FIT_FIELDS})
    else:  # the slots that keep their fit keep the window's copy
        at = np.flatnonzero(entering)
        new = moved(window.state, at, state, start[at], K)
    y0 = jax.device_put(np.asarray(y0)[trajectories(start, K)])
    data = None if data is None else jax.tree.map(
        lambda d: jax.device_put(np.asarray(d)[start]), data)
    return Window(start=start.copy(), state=new, y0=y0, data=data)


def flush(state, window, slots=None, to_device=True):
    """The state with the window's fits in `slots` (default all) written back; the
    counters are the window's. Without `to_device`, the fields written back are
    NumPy arrays: a state to save, which the save copies to the host anyway."""
    ws = window.state
    S, B = state.active.shape[0], ws.active.shape[0]
    counters = dict(update=ws.update, refreshes=ws.refreshes)
    if B == S and slots is None and (window.start == np.arange(S)).all():
        return ws._replace(history=state.history, drift=state.drift, **counters)
    slots = np.arange(B) if slots is None else np.asarray(slots)
    K = window.y0.shape[0] // B
    return moved(state, window.start[slots], ws, slots, K, to_device)._replace(**counters)
