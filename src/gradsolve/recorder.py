"""The general recorder: one batched adaptive solve over the whole ensemble.

This is the recorder core (no routing): the engines, the replay's callers and the
fused recorder (for its first step) import it; the routed `gs.record` lives in
record.py.

A single `jax.lax.while_loop` advances every trajectory by one trial step per
iteration, each with its own `t`, step size and accept/reject decision; finished
trajectories are frozen. Accepted step sizes are written into a chunk buffer of
`chunk` columns. The loop returns to Python whenever some trajectory fills its chunk,
the chunk is appended on the host and the same compiled loop resumes: memory scales
with n x (steps taken), never with n x max_steps, and the loop compiles once.
"""

import functools
from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from . import control, layout, methods
from .config import Config
from .mesh import Mesh
from .problem import field, param_axes, rows_of
from .status import Status


DEFAULT_CHUNK = 64


class _State(NamedTuple):
    t: jax.Array         # (n,) start of the current trial step
    t_next: jax.Array    # (n,) its end
    y: jax.Array         # (n, d)
    f0: jax.Array        # (n, d) f(t, y), carried across steps (FSAL)
    n_acc: jax.Array     # (n,)
    n_rej: jax.Array     # (n,)
    status: jax.Array    # (n,)
    done: jax.Array      # (n,)
    count: jax.Array     # (n,) entries written into this chunk
    buf: jax.Array       # (n, chunk)


@eqx.filter_jit
def _advance(state: _State, params, f_jax, method, rtol, atol, t1, max_steps, devices=None):
    """Run trial steps until every trajectory is done or one fills its chunk; with
    `devices` (a device mesh), each device runs its own loop on its own rows (its
    trajectories done or one filling its chunk), with no collective in the loop."""
    if devices is None:
        return _loop(state, params, f_jax, method, rtol, atol, t1, max_steps)
    return layout.shard_rows(
        lambda s, p: _loop(s, p, f_jax, method, rtol, atol, t1, max_steps), devices,
        (0, param_axes(params)))(state, params)


def _loop(state: _State, params, f_jax, method, rtol, atol, t1, max_steps):
    f = field(f_jax)
    trial = jax.vmap(functools.partial(method.trial_step, f),
                     in_axes=(0, 0, 0, 0, param_axes(params)))
    dtype = state.y.dtype
    floor = jnp.asarray(control.t1_snap_floor(np.asarray(t1, dtype)), dtype)
    t1 = jnp.asarray(t1, dtype)
    rows = jnp.arange(state.y.shape[0])
    chunk = state.buf.shape[1]

    def body(s: _State) -> _State:
        stalled = ~s.done & control.underflow(s.t, s.t_next)
        active = ~s.done & ~stalled
        h = s.t_next - s.t
        y_new, y_err, f_new = trial(s.t, s.y, s.f0, h, params)
        ratio = control.error_ratio(s.y, y_new, y_err, rtol, atol)
        accept, h_next = control.propose(ratio, h, method.error_order)
        accept = accept & active
        t = jnp.where(accept, s.t_next, s.t)
        t_next = control.clip_to_end(t, t + h_next, t1, floor, accept)
        t = jnp.minimum(t, t1)
        y = jnp.where(accept[:, None], y_new, s.y)
        f0 = jnp.where(accept[:, None], f_new, s.f0)
        buf = s.buf.at[rows, jnp.where(accept, s.count, chunk)].set(h, mode="drop")
        n_acc = s.n_acc + accept
        n_rej = s.n_rej + (active & ~accept)
        finished = t >= t1
        nonfinite = accept & ~jnp.isfinite(y_new).all(axis=1)
        underflow = stalled | (~finished & control.underflow(t, t_next))
        too_long = ~finished & (n_acc + n_rej >= max_steps)
        status = jnp.select(
            [s.done, nonfinite, underflow, too_long],
            [s.status, Status.NONFINITE, Status.DT_UNDERFLOW, Status.MAX_STEPS],
            s.status)
        done = s.done | finished | nonfinite | underflow | too_long
        return _State(t, t_next, y, f0, n_acc, n_rej, status.astype(s.status.dtype),
                      done, s.count + accept, buf)

    def cond(s: _State):
        return ~jnp.all(s.done) & jnp.all(s.count < chunk)

    # Each call fills a new chunk (the host appended the last one).
    return jax.lax.while_loop(cond, body, state._replace(count=jnp.zeros_like(state.count)))


@eqx.filter_jit
def first_step(f_jax, method, y0, params, t0, rtol, atol):
    """Every trajectory's first step size by Hairer & Wanner's rule
    (`control.initial_step`), and `f(t0, y0)`: `((n,), (n, d))`. Every recorder and
    the Diffrax engine start from it, so they solve the same problem."""
    f = field(f_jax)
    t = jnp.full(y0.shape[:1], t0, y0.dtype)
    f0 = jax.vmap(f, in_axes=(0, 0, param_axes(params)))(t, y0, params)
    first = functools.partial(control.initial_step, f, error_order=method.error_order,
                              rtol=rtol, atol=atol)
    return jax.vmap(first, in_axes=(0, 0, param_axes(params)))(t, y0, params), f0


@eqx.filter_jit
def start(y0, params, dt0, f_jax, method, rtol, atol, t0, t1):
    """`(t, t_next, f0)` of the first trial step: `dt0` (None: `first_step`'s),
    clipped to `t1`."""
    f = field(f_jax)
    dtype = y0.dtype
    t = jnp.full(y0.shape[:1], t0, dtype)
    if dt0 is None:
        dt0, f0 = first_step(f_jax, method, y0, params, t0, rtol, atol)
    else:
        f0 = jax.vmap(f, in_axes=(0, 0, param_axes(params)))(t, y0, params)
    t_next = jnp.minimum(t + jnp.broadcast_to(jnp.asarray(dt0, dtype), t.shape),
                         jnp.asarray(t1, dtype))
    return t, t_next, f0


def _append(h, offset, buf, count):
    """Each row's `count` new step sizes from `buf` written after its `offset` ones
    (growing `h` by doubling): column by column, so that no index array of every
    step is ever held (the memory budget counts on it)."""
    need = int((offset + count).max(initial=0))
    if need > h.shape[1]:
        h = np.pad(h, ((0, 0), (0, max(need, 2 * h.shape[1]) - h.shape[1])))
    for j in range(int(count.max(initial=0))):
        r = np.flatnonzero(count > j)
        h[r, offset[r] + j] = buf[r, j]
    return offset + count, h


def run_record(prob, cfg: Config, *, params=None, y0=None, chunk=DEFAULT_CHUNK,
               recorder="general", devices=None):
    """The general recorder. Returns `(mesh, y_final)`; `gs.record` keeps the mesh.
    With `devices` (a device mesh of this process), the rows are split over it, each
    device running its own loop (`_advance`)."""
    params = prob.params if params is None else params
    y0 = prob.y0 if y0 is None else jnp.asarray(y0)
    method = methods.get(cfg.method)
    rtol, atol, max_steps = cfg.rtol, cfg.atol, cfg.max_steps
    dt0 = None if cfg.dt0 is None else (cfg.dt0 if np.ndim(cfg.dt0) == 0 else jnp.asarray(cfg.dt0))
    n = y0.shape[0]
    # Filler rows (copies of row 0) make every device's rows a multiple of
    # `layout.LANES`: a row's mesh then does not depend on how many rows, or devices,
    # there are (see there).
    unit = layout.LANES * layout.size(devices)
    n_pad = -(-n // unit) * unit
    fill = None if n_pad == n else np.concatenate([np.arange(n, dtype=np.int32),
                                                   np.zeros(n_pad - n, np.int32)])
    t0, t1 = (float(t) for t in prob.t_span)
    state, filled = _begin(y0, params, dt0, fill, prob.f_jax, method, rtol, atol, t0, t1,
                           chunk)
    params = params if fill is None else filled
    h = np.zeros((n, chunk), y0.dtype)  # the mesh so far, grown as the steps come
    offset = np.zeros(n, np.int64)
    while True:
        state = _advance(state, params, prob.f_jax, method, rtol, atol, t1, max_steps,
                         devices)
        offset, h = _append(h, offset, np.asarray(state.buf)[:n], np.asarray(state.count)[:n])
        if np.asarray(state.done)[:n].all():
            break
    n_steps = np.asarray(state.n_acc)[:n]
    h = h[:, :max(int(n_steps.max()), 1)]
    # Built from NumPy (`_put`): a jnp op on the host's arrays would compile a program
    # per shape and dtype, ~25 ms each here.
    mesh = Mesh(h=_put(h), n_steps=_put(n_steps),
                n_rejected=_put(np.asarray(state.n_rej)[:n]),
                status=_put(np.asarray(state.status)[:n]),
                t0=_put(np.asarray(t0, y0.dtype)), t1=_put(np.asarray(t1, y0.dtype)),
                method=method.name, rtol=rtol, atol=atol, recorder=recorder)
    return mesh, _put(np.asarray(state.y)[:n])


def _put(x):
    return jax.device_put(np.asarray(x))


@eqx.filter_jit
def _begin(y0, params, dt0, fill, f_jax, method, rtol, atol, t0, t1, chunk):
    """The recorder's first state (and the rows' parameters), in one compiled call:
    rows `fill` of `y0` and `params` (None: as they are, and no parameters returned),
    their first trial step (`start`) and empty counters and chunk buffer. Run eagerly,
    the row gathers and zeros compiled a small program each (13 in a neural ODE fit's
    setup, 0.3 s)."""
    if fill is not None:
        y0, params = rows_of(y0, params, fill)
        dt0 = dt0 if dt0 is None or jnp.ndim(dt0) == 0 else dt0[fill]
    t, t_next, f0 = start(y0, params, dt0, f_jax, method, rtol, atol, t0, t1)
    zeros = jnp.zeros(y0.shape[0], jnp.int32)
    return _State(t, t_next, y0, f0, zeros, zeros, zeros, jnp.zeros(y0.shape[0], bool),
                  zeros, jnp.zeros((y0.shape[0], chunk), y0.dtype)), \
        None if fill is None else params
