"""The in-kernel adjoint: a Warp forward over a recorded mesh, and a Warp backward.

`forward` runs one thread per trajectory over its (zero-padded) step sizes and keeps
the accepted state at every mesh point, `(n, S + 1, d)`, and nothing per stage; with
`ts`, each output is one extra plain step from the last mesh point at or before it,
or (`forward_dense`, Tsit5) the continuous extension of the step containing it, the
step's stages computed once for all its outputs -- as the JAX replay does either
(`gradsolve.replay`). `backward` walks each trajectory's steps
in reverse: it recomputes a step's stage points from the stored state and applies
that step's vector-Jacobian product (`_steps.vjp_for_method`, written from the same
tableau as the forward step), whose field part is the translation of `jax.vjp` of the
field (`_translate.translate_vjp`) -- no Warp autodiff, no tape through a dynamic
loop. The cotangents of integrated `ts` outputs enter at their base points; those of
interpolated ones in their step's adjoint (`backward_dense`, `_steps.dense_vjp`).

Memory: the stored states, `n (S + 1) d` numbers (the JAX replay's reverse sweep
stores every stage of every step unless remat is on), kept once: through XLA's FFI
the forward kernel writes them straight into XLA's output buffer, which the backward
reads (`_jax.writes_into`); before, a host array held them too, copied into XLA's
(neural Robertson, B = 128: 3.8 MB a gradient, now 2.2 MB). The shared parameters'
gradient is one row per trajectory, summed by the launch driver in fixed blocks
(`_launch.block_sum`): the same bit for bit whatever the chunking or the thread
count, no atomics contended, and no more rows at a time than the memory budget holds.
A failed trajectory (`ok` 0) is skipped: its rows stay exact zeros.

A step of size zero is skipped in both directions: a padded column is exactly the
identity, and its adjoint is too.
"""

import functools
import hashlib
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .. import methods
from ..status import Status
from . import _jax, _kernels, _launch, _runtime, _steps, _translate
from ._launch import INT, INT32, block_sum, count, output, per_trajectory, scalar, shared


MEMORY_BUDGET = 1 << 30

FORWARD = _launch.Signature((
    per_trajectory("y0", "d"), per_trajectory("p", "columns"), shared("s"),
    per_trajectory("h", "width"), per_trajectory("n_steps", dtype=INT32), shared("ts"),
    scalar("n_ts", INT), scalar("t0"), scalar("width", INT), count("m"),
    output("states", "points", "d"), output("tgrid", "points"),
    output("ys_out", "n_ts", "d"), output("base", "n_ts", dtype=INT32),
))

BACKWARD = _launch.Signature((
    per_trajectory("states", "points", "d"), per_trajectory("tgrid", "points"),
    per_trajectory("h", "width"), per_trajectory("base", "n_ts", dtype=INT32),
    per_trajectory("ct", "n_ct", "d"), per_trajectory("ok", dtype=INT32),
    per_trajectory("p", "columns"), shared("s"), shared("ts"), scalar("n_ts", INT),
    scalar("width", INT), count("m"),
    output("g_y0", "d"), output("gp", "columns"), block_sum("gs", "k"),
))

# Both forward kernels start alike: the first state and time of the trajectory.
_FORWARD_START = """
    i = wp.tid()
    if i < m:
        y = V()
        for k in range(D):
            y[k] = y0[i, k]
            states[i, 0, k] = y[k]
        t = t0
        tgrid[i, 0] = t
"""

_FORWARD_BODY = _FORWARD_START + """        for c in range(width):
            hc = h[i, c]
            if hc > T(0.0):
                y = plain(t, y, hc, p, s, i)
            t = t + hc
            tgrid[i, c + 1] = t
            for k in range(D):
                states[i, c + 1, k] = y[k]
        for j in range(n_ts):
            # The last mesh point at or before ts[j], at most the last accepted one.
            b = int(0)
            for c in range(width + 1):
                if tgrid[i, c] <= ts[j]:
                    b = c
            b = wp.min(b, n_steps[i])
            base[i, j] = b
            yb = V()
            for k in range(D):
                yb[k] = states[i, b, k]
            out = plain(tgrid[i, b], yb, ts[j] - tgrid[i, b], p, s, i)
            for k in range(D):
                ys_out[i, j, k] = out[k]
"""

# Both backward kernels: a live trajectory walks its mesh points from the last to
# the first, `lam` the cotangent of the state there (`ct` at t1 without outputs),
# `j` the last output not yet taken.
_BACKWARD_START = """
    i = wp.tid()
    live = int(0)
    if i < m:
        live = ok[i]
    if live == 1:
        lam = V()
        if n_ts == 0:
            for k in range(D):
                lam[k] = ct[i, 0, k]
        j = n_ts - 1
        for back in range(width + 1):
            c = width - back
"""

_BACKWARD_BODY = _BACKWARD_START + """            yc = V()
            for k in range(D):
                yc[k] = states[i, c, k]
            # The outputs based at mesh point c (base is nondecreasing in j).
            more = int(1)
            while more == 1:
                more = 0
                if j >= 0:
                    if base[i, j] == c:
                        more = 1
                if more == 1:
                    ctj = V()
                    for k in range(D):
                        ctj[k] = ct[i, j, k]
                    lam = lam + step_vjp(tgrid[i, c], yc, ts[j] - tgrid[i, c], ctj, p, s, i, gp, gs)
                    j = j - 1
            if c > 0:
                hc = h[i, c - 1]
                if hc > T(0.0):
                    yp = V()
                    for k in range(D):
                        yp[k] = states[i, c - 1, k]
                    lam = step_vjp(tgrid[i, c - 1], yp, hc, lam, p, s, i, gp, gs)
        for k in range(D):
            g_y0[i, k] = lam[k]
"""


_FORWARD_DENSE_BODY = _FORWARD_START + """        j = int(0)
        for c in range(width):
            hc = h[i, c]
            if hc > T(0.0):
                # The outputs inside [t, t + hc), from this step's extension.
                j0 = j
                while j < n_ts and ts[j] < t + hc:
                    base[i, j] = c
                    j = j + 1
                y = dense_advance(t, y, hc, ts, j0, j, ys_out, p, s, i)
            t = t + hc
            tgrid[i, c + 1] = t
            for k in range(D):
                states[i, c + 1, k] = y[k]
        # The outputs at or after the last accepted point: its state.
        b = n_steps[i]
        while j < n_ts:
            base[i, j] = b
            for k in range(D):
                ys_out[i, j, k] = states[i, b, k]
            j = j + 1
"""

_BACKWARD_DENSE_BODY = _BACKWARD_START + """            # The outputs at mesh point c with no step after it (the end): its state.
            more = int(1)
            while more == 1:
                more = 0
                if j >= 0:
                    if base[i, j] == c:
                        if c == width:
                            more = 1
                        elif h[i, c] == T(0.0):
                            more = 1
                if more == 1:
                    for k in range(D):
                        lam[k] = lam[k] + ct[i, j, k]
                    j = j - 1
            if c > 0:
                hc = h[i, c - 1]
                if hc > T(0.0):
                    # The step c - 1 -> c and the outputs inside it, in one adjoint.
                    j1 = j + 1
                    more = int(1)
                    while more == 1:
                        more = 0
                        if j >= 0:
                            if base[i, j] == c - 1:
                                more = 1
                        if more == 1:
                            j = j - 1
                    yp = V()
                    for k in range(D):
                        yp[k] = states[i, c - 1, k]
                    lam = dense_vjp(tgrid[i, c - 1], yp, hc, lam, ct, ts, j + 1, j1, p, s,
                                    i, gp, gs)
        for k in range(D):
            g_y0[i, k] = lam[k]
"""


class Program(NamedTuple):
    """The kernels of one (field, method, d, dtype, parameter layout): the forward and
    backward with integrated outputs, and with outputs from the continuous extension
    (None where the kernels have none for the method, `_steps.has_kernel_extension`)."""

    forward: object
    backward: object
    forward_dense: object
    backward_dense: object
    shared: tuple[bool, ...]  # per array leaf of the parameters (`_translate._flat`)
    digest: str  # of the kernels' source


def source(f_jax, params, y0, method) -> str:
    """The generated module: the field, its VJP, the plain step and its adjoint, and
    the two kernels.

    Raises:
        UntranslatableField: the field or its VJP uses something the translator does
            not handle (naming the JAX primitive).
    """
    d = y0.shape[-1]
    bits = 64 if np.dtype(y0.dtype) == np.float64 else 32
    stiff = method.implicit  # Rosenbrock23: the Jacobian and its VJP too
    return (_kernels.header(d, bits) + "\n"
            + _translate.translate(f_jax, params, y0, stiff=stiff) + "\n\n"
            + _translate.translate_vjp(f_jax, params, y0) + "\n\n"
            + (_translate.translate_vjp(f_jax, params, y0, of="jac") if stiff else "")
            + _steps.vjp_for_method(method)
            + "\n\n" + FORWARD.header("forward") + _FORWARD_BODY
            + "\n\n" + BACKWARD.header("backward") + _BACKWARD_BODY
            + ("\n\n" + FORWARD.header("forward_dense") + _FORWARD_DENSE_BODY
               + "\n\n" + BACKWARD.header("backward_dense") + _BACKWARD_DENSE_BODY
               if _steps.has_kernel_extension(method) else ""))


@functools.cache
def _load(text: str):
    module = _runtime.load(text)
    return (module.forward, module.backward, getattr(module, "forward_dense", None),
            getattr(module, "backward_dense", None))


# Generated sources per (f_jax, d, dtype, parameter layout, method): (text, why not).
_SOURCES: dict = {}


def _source(prob, method_name):
    key = (prob.f_jax, prob.d, np.dtype(prob.y0.dtype).name, _translate.layout(prob.params),
           method_name)
    try:
        hash(key)
    except TypeError:
        key = None
    if key is None or key not in _SOURCES:
        try:
            entry = (source(prob.f_jax, prob.params, prob.y0, methods.get(method_name)), None)
        except _translate.UntranslatableField as err:
            entry = (None, f"the field's VJP has no Warp form: {err}")
        except ValueError as err:  # a method the adjoint does not run
            entry = (None, str(err))
        if key is None:
            return entry
        _SOURCES[key] = entry
    return _SOURCES[key]


def why_not(prob, method_name: str) -> str | None:
    """Why the in-kernel adjoint cannot run `prob` with `method_name` (its field or
    the field's VJP does not translate), or None."""
    return _source(prob, method_name)[1]


def program(prob, method_name: str) -> Program:
    """The compiled kernels for `prob`'s field, shapes and parameter layout.

    Raises:
        UntranslatableField: see `why_not`.
    """
    text, why = _source(prob, method_name)
    if text is None:
        raise _translate.UntranslatableField(why)
    return Program(*_load(text), tuple(sh for _, sh in _translate._flat(prob.params)),
                   hashlib.sha256(text.encode()).hexdigest()[:20])


class Forward(NamedTuple):
    ys: np.ndarray       # (n, d), or (n, J, d) with ts; masked rows are zeros
    states: np.ndarray   # (n, S + 1, d)
    tgrid: np.ndarray    # (n, S + 1)
    base: np.ndarray     # (n, max(J, 1)) int32


def forward(prog: Program, h, n_steps, ok, t0, y0, leaves, ts, dense=False,
            into: Forward | None = None) -> Forward:
    """The states over the mesh `h` (rows of failed trajectories, `ok` False, must
    come with zero steps) and the outputs (`dense`: from the continuous extension).
    `into`: arrays to write the result into (XLA's output buffers), else new ones."""
    dtype = np.dtype(y0.dtype)
    n, d = y0.shape
    width = h.shape[1]
    n_ts = 0 if ts is None else len(ts)
    P, S = _translate.pack_leaves(leaves, prog.shared, n)
    kept = {} if into is None else dict(states=into.states, tgrid=into.tgrid,
                                        base=into.base)
    if into is not None and ts is not None:
        kept["ys_out"] = into.ys
    out = _launch.run(
        prog.forward_dense if dense else prog.forward, FORWARD,
        dict(y0=y0, p=P, s=S, h=h, n_steps=n_steps, ts=np.zeros(1) if ts is None else ts,
             n_ts=n_ts, t0=float(t0), width=width),
        n=n, dtype=dtype, lanes=1, budget=MEMORY_BUDGET,
        sizes=dict(d=d, points=width + 1, n_ts=max(n_ts, 1)), into=kept)
    ys = out.ys_out
    if ts is None:  # the final states, copied out of `states` (masked below, not there)
        ys = np.empty((n, d), dtype) if into is None else into.ys
        ys[...] = out.states[:, width]
    ys[~np.asarray(ok, bool)] = 0
    return Forward(ys, out.states, out.tgrid, out.base)


def backward(prog: Program, run: Forward, h, ok, ct, leaves, ts, dense=False):
    """`(g_y0, g_leaves)`: the gradients of `sum(ct * ys)` with respect to `y0` and
    each parameter leaf (in `_translate._flat` order); failed trajectories give exact
    zeros. `dense`: the outputs came from the continuous extension."""
    dtype = np.dtype(run.states.dtype)
    n, points, d = run.states.shape
    n_ts = 0 if ts is None else len(ts)
    ok = np.asarray(ok, bool)
    P, S = _translate.pack_leaves(leaves, prog.shared, n)
    out = _launch.run(
        prog.backward_dense if dense else prog.backward, BACKWARD,
        dict(states=run.states, tgrid=run.tgrid, h=h, base=run.base,
             ct=ct.reshape(n, -1, d), ok=ok.astype(np.int32), p=P, s=S,
             ts=np.zeros(1) if ts is None else ts,
             n_ts=n_ts, width=points - 1),
        n=n, dtype=dtype, lanes=1, budget=MEMORY_BUDGET,
        sizes=dict(d=d, columns=P.shape[1], k=S.shape[0]))
    return out.g_y0, _translate.unpack_leaves(out.gp, out.gs, leaves, prog.shared)


def replay_function(prob, method_name: str, ts=None, interpolate=False):
    """The pure function `(mesh, params, y0) -> ys` of the in-kernel adjoint: final
    states `(n, d)`, or `(n, len(ts), d)` with `ts` (integrated by an extra step each,
    or with `interpolate` from the method's continuous extension, the step's stages
    computed once for all its outputs); a `jax.custom_vjp` whose forward
    and backward are the two kernels, called as host functions (`_jax.call`: XLA's FFI
    on the CPU; so it works under `jit` and `grad`). Failed trajectories (`mesh.status`) give exact zeros.

    Raises:
        ValueError: the field or its VJP cannot be translated (naming the primitive).
    """
    try:
        prog = program(prob, method_name)
    except _translate.UntranslatableField as err:
        raise ValueError(f"engine 'kernel_adjoint' cannot serve this problem: {err}") from None
    ts = None if ts is None else np.asarray(ts, np.dtype(prob.y0.dtype))
    dense = bool(interpolate) and ts is not None
    if dense and prog.forward_dense is None:
        raise ValueError(f"engine 'kernel_adjoint' serves ts from the continuous extension "
                         f"of explicit Runge--Kutta methods only, not {method_name!r}: "
                         f"interpolate=False integrates its outputs")
    # What the host calls compute: the kernels, the output times, the leaves' types.
    name = (f"kernel_adjoint:{prog.digest}:"
            f"{'' if ts is None else hashlib.sha256(ts.tobytes()).hexdigest()[:20]}"
            f"{':dense' if dense else ''}")

    @_jax.writes_into  # the states are written once, where XLA keeps them
    def host_forward(h, n_steps, ok, t0, y0, *leaves, out=None):
        run = forward(prog, h, n_steps, ok, float(t0), y0, list(leaves), ts, dense,
                      into=None if out is None else Forward(*out))
        return run.ys, run.states, run.tgrid, run.base

    def host_backward(states, tgrid, base, h, ok, ct, *leaves):
        g_y0, grads = backward(prog, Forward(None, states, tgrid, base), h, ok, ct,
                               list(leaves), ts, dense)
        return (g_y0, *[g for g in grads if jnp.issubdtype(g.dtype, jnp.inexact)])

    def forward_call(h, n_steps, ok, t0, y0, leaves):
        n, d = y0.shape
        points = h.shape[1] + 1
        n_ts = 0 if ts is None else len(ts)
        shapes = (jax.ShapeDtypeStruct((n, d) if ts is None else (n, n_ts, d), y0.dtype),
                  jax.ShapeDtypeStruct((n, points, d), y0.dtype),
                  jax.ShapeDtypeStruct((n, points), y0.dtype),
                  jax.ShapeDtypeStruct((n, max(n_ts, 1)), jnp.int32))
        return _jax.call(host_forward, shapes, h, n_steps, ok, t0, y0, *leaves,
                         name=name + ":forward")

    @jax.custom_vjp
    def run(h, n_steps, ok, t0, y0, *leaves):
        return forward_call(h, n_steps, ok, t0, y0, leaves)[0]

    def run_fwd(h, n_steps, ok, t0, y0, *leaves):
        ys, states, tgrid, base = forward_call(h, n_steps, ok, t0, y0, leaves)
        return ys, (h, n_steps, ok, t0, y0, leaves, states, tgrid, base)

    def run_bwd(res, ct):
        h, n_steps, ok, t0, y0, leaves, states, tgrid, base = res
        inexact = [jnp.issubdtype(x.dtype, jnp.inexact) for x in leaves]
        shapes = (jax.ShapeDtypeStruct(y0.shape, y0.dtype),
                  *[jax.ShapeDtypeStruct(x.shape, x.dtype) for x, keep in zip(leaves, inexact)
                    if keep])
        g_y0, *grads = _jax.call(host_backward, shapes, states, tgrid, base, h, ok, ct,
                                 *leaves, name=name + ":backward")
        grads = iter(grads)
        float0 = lambda x: np.zeros(x.shape, jax.dtypes.float0)
        g_leaves = [next(grads) if keep else float0(x) for x, keep in zip(leaves, inexact)]
        return (jnp.zeros_like(h), float0(n_steps), float0(ok), jnp.zeros_like(t0), g_y0,
                *g_leaves)

    run.defvjp(run_fwd, run_bwd)

    def ys_fn(mesh, params, y0):
        leaves = [x for x, _ in _translate._flat(params)]
        ok = mesh.status == Status.SUCCESS
        # The recorded-mesh convention: the step sizes are data.
        h = jnp.where(ok[:, None], jax.lax.stop_gradient(mesh.h).astype(y0.dtype), 0)
        n_steps = jnp.where(ok, mesh.n_steps, 0).astype(jnp.int32)
        t0 = jax.lax.stop_gradient(mesh.t0).astype(y0.dtype)
        return run(h, n_steps, ok.astype(jnp.int32), t0, y0, *leaves)
    return ys_fn
