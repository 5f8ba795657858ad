"""The padded replay: a fixed-length `lax.scan` over the mesh columns.

Column k advances every trajectory by one plain step of size `h[:, k]`. The step
sizes enter behind `stop_gradient`: the replay is differentiated with the mesh held
as data, which is the recorded-mesh convention (exact derivative of the replay on
`sg[R(theta_0)]`, the same as Diffrax's checkpointed adjoint on the same mesh). A
zero step is the identity, so padding costs work but never changes a result.

The masking rule (`on_failure="mask"`) lives here too, once, for every replay engine:
a trajectory whose record failed contributes exactly zero to the loss's gradients.
See `_replay`'s `mask`.
"""

import dataclasses
import functools

import equinox as eqx
import jax
import jax.numpy as jnp

from . import control, layout, methods
from .config import check_interpolate, check_ts, make_config
from .mesh import Mesh
from .problem import as_problem, field, param_axes
from .status import Status

# The replays by name other than the JAX replay below: `name -> run(prob, mesh, params,
# y0, ts, interpolate)`, registered by the engine that computes it when its module loads
# (engines/kernel_adjoint.py: the Warp kernels). The replay dispatches through this
# table and so knows nothing of Warp.
ENGINE_REPLAYS = {}


def replay(prob, mesh: Mesh, params=None, y0=None, ts=None, remat=None,
           interpolate=None, engine=None, devices=None, buckets=None, memory_budget=None):
    """Replay `mesh` from `y0` with `params`: differentiable (pure JAX, or the Warp
    kernels of the in-kernel adjoint with `engine="kernel_adjoint"`).

    Args:
        prob: the ensemble problem (its `f_jax`, and defaults for `params`, `y0`).
        mesh: a `gs.Mesh` from `gs.record` (or a Calibrator).
        params, y0: where to evaluate; default the problem's own.
        ts: optional 1-D array of output times inside `t_span` (see `interpolate`).
        remat: recompute the step in the backward sweep (`eqx.filter_checkpoint`;
            default `config.default_remat`: on for non-stiff methods unless the field
            carries a network, and for stiff ones from 16 variables on).
        interpolate: None (default): each output from the method's continuous
            extension on the mesh step containing it where the extension's order is
            >= 3 (Tsit5, Rodas5P: no evaluation of the field beyond the mesh's steps),
            else INTEGRATED by one extra plain step from the last mesh point at or
            before it (Rosenbrock23, Vern7). True or False ask for one of the two.
        engine: None (the JAX replay) or `"kernel_adjoint"`: the same function
            computed by Warp kernels, its gradient by the Warp backward (Tsit5 and
            Rosenbrock23 meshes of a field the translator accepts; its kernels serve
            Tsit5's continuous extension, and integrate Rosenbrock23's outputs;
            `remat` does not apply).
        devices, buckets, memory_budget: where the rows are replayed (as
            `gs.value_and_grad`; docs/scale.md): split over devices, grouped by the
            mesh's step counts, in chunks under the budget. Buckets need the mesh's
            step counts: a mesh traced by an outer `jit` replays as one bucket.

    Returns:
        Final states `(n, d)`, or `(n, len(ts), d)` with `ts`.

    Examples:
        >>> import jax, gradsolve as gs
        >>> prob = gs.problems.lorenz(n=4)
        >>> mesh = gs.record(prob, rtol=1e-8, atol=1e-10)
        >>> ys = gs.replay(prob, mesh)
        >>> ys.shape
        (4, 3)
        >>> g = jax.grad(lambda p: gs.replay(prob, mesh, params=p).sum())(prob.params)
        >>> g["rho"].shape
        (4,)
    """
    prob = as_problem(prob)
    params = prob.params if params is None else params
    y0 = prob.y0 if y0 is None else y0
    method = methods.get(mesh.method)
    ts = check_ts(ts, prob.t_span)
    check_interpolate(method, interpolate)
    if engine is not None:
        if engine not in ENGINE_REPLAYS:
            raise ValueError(f"engine must be None (the JAX replay) or "
                             f"{' or '.join(map(repr, sorted(ENGINE_REPLAYS)))}, "
                             f"got {engine!r}")
        if remat:
            raise ValueError(f"engine={engine!r} takes no remat (it stores one state per "
                             "mesh point and recomputes stages)")
        if devices is not None and layout.size(layout.device_mesh(devices)) > 1:
            raise ValueError(f"engine={engine!r} runs on one device (devices=)")
        return ENGINE_REPLAYS[engine](prob, mesh, params, y0, ts, interpolate)
    n = jnp.shape(y0)[0]  # (not prob.n: an engine may replay a piece of the ensemble)
    cfg = make_config(prob, mesh=mesh, ts=ts, remat=remat, interpolate=interpolate,
                      devices=devices, memory_budget=memory_budget, buckets=buckets, n=n)
    arr = layout.for_replay(mesh, n, cfg, prob.d, jnp.dtype(y0.dtype).itemsize)
    return arranged_replay(prob.f_jax, method, mesh, params, y0, cfg.ts, cfg.remat,
                           cfg.interpolate, arr)


@eqx.filter_jit
def arranged_replay(f_jax, method, mesh, params, y0, ts, remat, interpolate, arr):
    """`_replay` of every row, placed as the arrangement `arr` says (`layout/`);
    compiled once per field, method, shapes and arrangement."""
    return layout.run(lambda m, p, y: _replay(f_jax, method, m, p, y, ts, remat, interpolate),
                      arr, mesh, params, y0)


def replay_function(prob, cfg, check=False, forward=False):
    """The pure function `(mesh, params, y0) -> ys` every replay engine
    differentiates: `_replay` with `cfg`'s outputs, remat and continuous extension,
    and the masking rule on (failed trajectories, allowed by `on_failure="mask"`,
    give zero outputs and zero gradients).

    With `check` (served where `checks_mesh(cfg)`), `(mesh, params, y0) -> (ys,
    ratio)`: `ratio` `(n,)` is each trajectory's largest error ratio over its mesh's
    steps at these parameters (the controller's `error_ratio` of the embedded
    estimate, against the tolerances the mesh was recorded at; not differentiated).
    Above 1, the controller would now reject a step it accepted when the mesh was
    recorded: the Calibrator's `refresh_tol` reads it.

    With `forward`, for forward-mode differentiation: a guarded mesh is replayed
    plainly (its loop over the live columns is differentiated in reverse mode only:
    `_live_loop`)."""
    method = methods.get(cfg.method)
    if check and not checks_mesh(cfg):
        raise ValueError(f"no error check of the replay for method={cfg.method!r} with "
                         f"ts={'None' if cfg.ts is None else 'given'}, "
                         f"interpolate={cfg.interpolate} (see checks_mesh)")

    def ys_fn(mesh, params, y0):
        if forward and mesh.guarded:
            mesh = dataclasses.replace(mesh, guarded=False)
        return _replay(prob.f_jax, method, mesh, params, y0, cfg.ts, cfg.remat,
                       cfg.interpolate, mask=True, check=check)
    return ys_fn


def checks_mesh(cfg) -> bool:
    """Whether the replay of `cfg` can check its mesh as it goes
    (`replay_function(..., check=True)`): outputs served from the continuous extension
    of a method whose kept slopes give its error estimate (Tsit5's, Vern7's), so that
    the check costs no evaluation of the field."""
    method = methods.get(cfg.method)
    return (cfg.ts is not None and bool(cfg.interpolate) and method.has_dense_output
            and method.dense_errors)


def _replay(f_jax, method, mesh, params, y0, ts, remat, interpolate=False, mask=False,
            check=False):
    """The replay (with `check`, `(ys, ratio)`: `replay_function`). With `mask=True`,
    the masking rule: each trajectory whose `mesh.status` is not SUCCESS is replayed
    on an all-zero mesh (no steps, and no extra steps to `ts`), so it only ever
    evaluates `f_jax` at its own finite `y0`
    where the record started, and its outputs are replaced by exact zeros. The loss
    therefore sees zeros for a masked trajectory (at every output time): a constant,
    so its gradient with respect to everything -- its own inputs and every `Shared`
    parameter -- is exactly zero, and a loss of squared states gets exactly zero from
    it. Zeroing the outputs alone would not do: a failed trajectory replayed on its
    own mesh can go non-finite, and `where(ok, ys, ...)` passes NaN cotangents back
    through the untaken branch (the double-where problem)."""
    f = field(f_jax)
    axes = param_axes(params)
    # The carry is laid out (d, n): each component of the ensemble is one contiguous
    # row, which the CPU backend fuses better than the strided columns of (n, d)
    # (measured ~15% on the Lorenz gradient).
    step = jax.vmap(functools.partial(method.plain_step, f), in_axes=(0, 1, 0, axes),
                    out_axes=1)
    if remat:
        # Filtered: parameters may hold non-array leaves (an MLP's activation), which
        # `jax.checkpoint` cannot take as inputs.
        step = eqx.filter_checkpoint(step)
    h = jax.lax.stop_gradient(mesh.h).astype(y0.dtype)
    n_steps = mesh.n_steps
    ok = jnp.ones(h.shape[:1], bool)
    if mask:
        ok = mesh.status == Status.SUCCESS
        h = jnp.where(ok[:, None], h, 0)
        n_steps = jnp.where(ok, n_steps, 0)
    t = jax.lax.stop_gradient(mesh.t0).astype(y0.dtype) + jnp.zeros_like(h[:, 0])
    # What a zero step is evaluated at before the select discards it: the
    # trajectory's own first step (one it took), or a 2^-20 of the span for a
    # trajectory with none (a masked one). Not a unit step:
    # from a stiff state a step of 1 overflows, and the discarded branch's infinities
    # would turn its zero cotangent into NaN gradients (the double-where problem).
    span = jax.lax.stop_gradient(mesh.t1 - mesh.t0).astype(y0.dtype)
    h_rest = jnp.where(h[:, 0] > 0, h[:, 0], span * 2.0 ** -20)

    live = jnp.max(n_steps, initial=0)

    def safe_step(t, y, dt):
        """`step` by `dt` where `dt > 0`, else `y` itself."""
        return jnp.where(dt > 0, step(t, y, jnp.where(dt > 0, dt, h_rest), params), y)

    if ts is not None and interpolate:
        ys, ratio = _interpolated(f, method, axes, remat, params, t, y0, h, h_rest,
                                  n_steps, live, mesh.guarded, jnp.asarray(ts, y0.dtype),
                                  (mesh.rtol, mesh.atol) if check else None)
        ys = jnp.where(ok[:, None, None], ys, 0)
        return (ys, ratio) if check else ys

    def column(carry, h_k):
        t, y = carry
        y_next = safe_step(t, y, h_k)
        return (t + h_k, y_next), ((t, y) if ts is not None else None)

    def skip(carry, h_k):
        return carry, (carry if ts is not None else None)

    (t_end, y_end), history = _scan_live(column, skip, (t, y0.T), h.T, live, mesh.guarded)
    if ts is None:
        return jnp.where(ok[:, None], y_end.T, 0)
    # States at every mesh point, (S + 1, d, n), then one extra step to each ts.
    t_all = jnp.concatenate([history[0], t_end[None]], axis=0)
    y_all = jnp.concatenate([history[1], y_end[None]], axis=0)
    ts = jnp.asarray(ts, y0.dtype)
    t_grid = jax.lax.stop_gradient(t_all).T                           # (n, S + 1)
    k = _containing_step(t_grid, ts, n_steps).T                       # (J, n)
    cols = jnp.arange(h.shape[0])[None, :]
    y_base = jnp.moveaxis(y_all[k, :, cols], -1, 1)                   # (J, d, n)
    t_base = t_grid.T[k, cols]                                        # (J, n)
    dt = jnp.where(ok, ts[:, None] - t_base, 0)
    ys = jax.vmap(safe_step)(t_base, y_base, dt)
    return jnp.where(ok[:, None, None], jnp.transpose(ys, (2, 0, 1)), 0)  # (n, J, d)


def _scan_live(column, skip, carry, columns, live, guarded):
    """`lax.scan(column, carry, columns)`; with `guarded`, only the first `live`
    columns (the ensemble's most steps) are evaluated, forward and backward
    (`_live_loop`): from `live` on every trajectory's step is a padding zero, the
    identity, and `skip(carry, h_k)` gives what `column` gives for it without
    evaluating the field. A Calibrator pads the mesh of a network's field with
    headroom (`mesh.grown_width`) so as not to compile its update again at every new
    width; this keeps the headroom from costing steps. `live` is one number for the
    whole ensemble."""
    if not guarded:
        return jax.lax.scan(column, carry, columns)
    converted, consts = jax.closure_convert(column, carry, columns[0])
    final, outs = _live_loop(converted, _LiveProbe(converted, carry, columns[0], consts),
                             live, carry, columns, *consts)
    keep = jnp.arange(columns.shape[0]) < live
    skipped = jax.vmap(lambda h_k: skip(final, h_k)[1])(columns)
    return final, jax.tree.map(
        lambda a, b: jnp.where(keep.reshape((-1,) + (1,) * (a.ndim - 1)), a, b),
        outs, skipped)


class _LiveProbe:
    """What `_live_loop` keeps of one column's `jax.vjp`: the structure of its
    pullback (`treedef`), and for each of its leaves the index of the column's
    closed-over constant it is (a parameter, stored once, not per column) or None (a
    residual, stored per column: `shapes`)."""

    def __init__(self, converted, carry, h_k, consts):
        def pullback_leaves(c, cs):
            out, pullback = jax.vjp(lambda c, cs: converted(c, h_k, *cs), c, cs)
            leaves, self.treedef = jax.tree.flatten(pullback)
            self.where = _const_index(leaves, cs)
            return out, [x for x, w in zip(leaves, self.where) if w is None]
        self.shapes = jax.eval_shape(pullback_leaves, carry, tuple(consts))[1]

    def residuals(self, leaves, consts):
        """The per-column leaves of a pullback traced like the probe's."""
        if _const_index(leaves, consts) != self.where:
            raise AssertionError("a column's pullback differs from the probe's")
        return [x for x, w in zip(leaves, self.where) if w is None]

    def pullback(self, residuals, consts):
        it = iter(residuals)
        return jax.tree.unflatten(
            self.treedef, [next(it) if w is None else consts[w] for w in self.where])


def _const_index(leaves, consts):
    ids = [id(c) for c in consts]
    return [ids.index(id(x)) if id(x) in ids else None for x in leaves]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _live_loop(converted, probe, live, carry, columns, *consts):
    """`lax.scan` of `converted(carry, h_k, *consts)` over the first `live` of
    `columns` (a `lax.while_loop`: a bound known only on the device), with zero
    outputs for the later columns. Reverse mode differentiates it with a second
    loop that runs back over the same `live` columns, applying each column's pullback
    from the residuals the forward loop stored (`_LiveProbe`), so a column past
    `live` costs neither a step nor its residuals; forward mode is not served (a
    forward-mode replay is given the unguarded mesh: `replay_function`)."""
    return _live_forward(converted, probe, live, carry, columns, consts, False)[:2]


def _live_forward(converted, probe, live, carry, columns, consts, keep):
    width = columns.shape[0]
    stacked = lambda s: jnp.zeros((width,) + s.shape, s.dtype)
    outs = jax.tree.map(stacked, jax.eval_shape(converted, carry, columns[0], *consts)[1])
    res = [stacked(s) for s in probe.shapes] if keep else []

    def body(state):
        k, c, outs, res = state
        if keep:
            (c, out), pullback = jax.vjp(lambda c, cs: converted(c, columns[k], *cs),
                                         c, tuple(consts))
            res = [r.at[k].set(x) for r, x in
                   zip(res, probe.residuals(jax.tree.leaves(pullback), consts))]
        else:
            c, out = converted(c, columns[k], *consts)
        return k + 1, c, jax.tree.map(lambda o, v: o.at[k].set(v), outs, out), res
    _, final, outs, res = jax.lax.while_loop(lambda s: s[0] < live, body,
                                             (0, carry, outs, res))
    return final, outs, res


def _live_fwd(converted, probe, live, carry, columns, *consts):
    final, outs, res = _live_forward(converted, probe, live, carry, columns, consts, True)
    return (final, outs), (live, columns, consts, res)


def _live_bwd(converted, probe, saved, cotangents):
    live, columns, consts, res = saved
    ct_final, ct_outs = cotangents

    def body(state):
        k, ct_c, ct_consts = state
        k = k - 1
        pullback = probe.pullback([r[k] for r in res], consts)
        ct_c, ct_k = pullback((ct_c, jax.tree.map(lambda o: o[k], ct_outs)))
        return k, ct_c, jax.tree.map(jnp.add, ct_consts, ct_k)
    zeros = jax.tree.map(jnp.zeros_like, tuple(consts))
    _, ct_carry, ct_consts = jax.lax.while_loop(lambda s: s[0] > 0, body,
                                                (live, ct_final, zeros))
    return (None, ct_carry, jnp.zeros_like(columns), *ct_consts)


_live_loop.defvjp(_live_fwd, _live_bwd)


def _containing_step(t_grid, ts, n_steps):
    """Per trajectory, the index of the mesh step each output time falls in: the last
    mesh point at or before it, at most `n_steps` (the end, where `t = t1`).
    `t_grid` is `(n, S + 1)`; returns `(n, J)`."""
    k = jax.vmap(lambda tg: jnp.searchsorted(tg, ts, side="right") - 1)(t_grid)
    return jnp.clip(jnp.minimum(k, n_steps[:, None]), 0, None)


def _interpolated(f, method, axes, remat, params, t, y0, h, h_rest, n_steps, live,
                  guarded, ts, check=None):
    """The replay with outputs from the method's continuous extension: the scan
    carries the next step's first slope (`f(t + h, y_new)`, which FSAL methods have
    for free) and keeps each step's slopes `K`; each output time is then a weighted
    sum of the slopes of the step containing it -- no extra evaluation of `f`, where
    the integrated outputs cost a step each. Returns `(ys (n, J, d), ratio)`: with
    `check = (rtol, atol)`, `ratio` `(n,)` is each trajectory's largest error ratio
    over its steps (`replay_function`), from the same slopes; else None."""
    dense = jax.vmap(functools.partial(method.dense_step, f), in_axes=(0, 1, 1, 0, axes),
                     out_axes=(1, 2, 1))
    if remat:
        dense = eqx.filter_checkpoint(dense)

    def ratio(y, y_new, h_k, K):
        """Each trajectory's error ratio of this step (0 where it took none)."""
        if check is None:
            return None
        y, y_new, K = (jax.lax.stop_gradient(x) for x in (y, y_new, K))
        err = jax.vmap(method.dense_error, in_axes=(0, 2), out_axes=1)(h_k, K)
        r = control.error_ratio(y.T, y_new.T, err.T, *check)
        return jnp.where(h_k > 0, r, 0).astype(y.dtype)

    def column(carry, h_k):
        t, y, f0 = carry
        took = h_k > 0
        y_new, K, f_new = dense(t, y, f0, jnp.where(took, h_k, h_rest), params)
        return ((t + h_k, jnp.where(took, y_new, y), jnp.where(took, f_new, f0)),
                (t, y, K, ratio(y, y_new, h_k, K)))

    f0 = jax.vmap(f, in_axes=(0, 1, axes), out_axes=1)(t, y0.T, params)

    def skip(carry, h_k):
        t, y, f0 = carry
        out = jax.eval_shape(column, carry, h_k)[1]
        return carry, (t, y, jnp.zeros(out[2].shape, y.dtype),
                       None if check is None else jnp.zeros(out[3].shape, y.dtype))

    (t_end, y_end, _), (t_all, y_all, K_all, ratios) = _scan_live(
        column, skip, (t, y0.T, f0), h.T, live, guarded)
    t_grid = jax.lax.stop_gradient(jnp.concatenate([t_all, t_end[None]])).T  # (n, S+1)
    y_all = jnp.moveaxis(jnp.concatenate([y_all, y_end[None]]), -1, 0)       # (n, S+1, d)
    K_all = jnp.moveaxis(K_all, -1, 0)                                       # (n, S, q, d)
    h_pad = jnp.pad(h, ((0, 0), (0, 1)))                       # 0 at the end point
    k = _containing_step(t_grid, ts, n_steps)                                # (n, J)

    def outputs(k, t_grid, y_all, K_all, h_pad):
        """One trajectory's outputs: the step k_j containing each ts_j, evaluated at
        its fraction theta_j; at a mesh point (theta = 0) or the end, the state."""
        h_k = h_pad[k]
        y_k = y_all[k]
        theta = (ts - t_grid[k]) / jnp.where(h_k > 0, h_k, 1)
        y_next = y_all[jnp.minimum(k + 1, y_all.shape[0] - 1)]
        K_k = K_all[jnp.minimum(k, K_all.shape[0] - 1)]
        y_theta = jax.vmap(method.interpolate)(y_k, y_next, h_k, K_k, theta)
        return jnp.where((h_k > 0)[:, None], y_theta, y_k)
    ys = jax.vmap(outputs)(k, t_grid, y_all, K_all, h_pad)
    return ys, None if check is None else jnp.max(ratios, axis=0, initial=0)
