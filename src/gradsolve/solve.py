"""`gs.solve`: forward solves of an ensemble, through the router."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from . import layout
from .config import DEFAULT_MAX_STEPS
from .problem import EnsembleProblem, as_problem, rows_of
from .router import plan
from .status import Status, TrajectoryFailure, summarize


class Solution(eqx.Module):
    """The result of `gs.solve`.

    Attributes:
        ys: final states `(n, d)`, or `(n, len(ts), d)` with `ts`.
        status: `(n,)` `gs.Status` codes; failures are reported here, not raised.
        n_accepted, n_rejected: `(n,)` step counts.
        engine: the engine that ran; method: the integration method.
        passed_over: `(engine, reason)` pairs the router did not choose.
        ts: the output times of `ys`: the `ts` asked for, or `(t1,)` without them.
        interpolated: whether the outputs at `ts` came from the method's continuous
            extension (else each was integrated by an extra step).
    """

    ys: jax.Array
    status: jax.Array
    n_accepted: jax.Array
    n_rejected: jax.Array
    engine: str = eqx.field(static=True)
    method: str = eqx.field(static=True)
    passed_over: tuple = eqx.field(static=True, default=())
    ts: jax.Array | None = None
    interpolated: bool = eqx.field(static=True, default=False)

    @property
    def stats(self) -> dict:
        return {"n_accepted": self.n_accepted, "n_rejected": self.n_rejected}

    @property
    def ok(self) -> bool:
        return bool(np.all(np.asarray(self.status) == Status.SUCCESS))

    def raise_for_status(self) -> "Solution":
        """Raise `gs.TrajectoryFailure` if any trajectory failed; else return self."""
        if not self.ok:
            raise TrajectoryFailure(summarize(self.status))
        return self


def cast_problem(prob: EnsembleProblem, dtype) -> EnsembleProblem:
    """The problem with its state and floating parameters cast to `dtype`."""
    if dtype is None:
        return prob
    dtype = jnp.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"dtype must be a floating dtype, got {dtype}")
    cast = lambda x: x.astype(dtype) if eqx.is_inexact_array(x) else x
    return prob.replace(y0=prob.y0.astype(dtype), params=jax.tree.map(cast, prob.params))


def solve_rows(engine, prob, cfg):
    """`engine.solve` of every trajectory: this process's rows (the others' come from
    their processes), in chunks under `cfg.memory_budget` where the engine says what a
    row costs (`Engine.row_bytes`)."""
    def run(rows, sub):
        if rows is None:
            return engine.solve(prob, sub)
        y0, params = rows_of(prob.y0, prob.params, rows)
        return engine.solve(prob.replace(y0=y0, params=params), sub)
    out = layout.by_rows(prob.n, cfg, engine.row_bytes(prob, cfg), "solve", run)
    return tuple(jnp.asarray(x) for x in out)


def solve(prob, *, rtol=1e-6, atol=1e-9, method=None, engine=None, ts=None, dtype=None,
          max_steps=DEFAULT_MAX_STEPS, dt0=None, interpolate=None, fused=None,
          throw=False, devices=None, memory_budget=None) -> Solution:
    """Solve every trajectory of an ensemble (forward only).

    Args:
        prob: an ensemble problem (`gs.EnsembleProblem` or any object with its six
            members).
        rtol, atol: tolerances.
        method: `"tsit5"` (default for non-stiff problems), ...
        engine: None to let the router choose, or an engine name.
        ts: optional output times (1-D, inside `t_span`).
        dtype: cast the problem to this floating dtype first.
        max_steps: cap on attempted steps per trajectory.
        dt0: first step (default: Hairer & Wanner's rule per trajectory).
        interpolate: how `ts` is served, as in `gs.value_and_grad` (None: Tsit5's and
            Rodas5P's continuous extension, else an integrated step per output);
            `.interpolated` on the result says which.
        fused: None lets the router choose; True asks for the Warp engine (an error
            says why if it cannot serve); False keeps the solve off every Warp engine.
        throw: raise `gs.TrajectoryFailure` if a trajectory failed (as Diffrax's
            `throw=True`); by default failures are reported in `.status`.
        devices: the devices to split the ensemble over (None: every device of the
            default backend from `layout.MIN_ROWS_PER_DEVICE` trajectories per device,
            else one; a number, a sequence of `jax.Device` or a 1-D
            `jax.sharding.Mesh`). Each device runs its own adaptive loop; results are
            those of one device (docs/scale.md).
        memory_budget: bytes each device may use (`"2GB"`; None: half the memory
            available): the general engine solves a larger ensemble in chunks.

    Returns:
        A `gs.Solution`; `.engine` names the engine that ran.

    Raises:
        TypeError: called on traced values (inside `jax.grad`, `jit` or `vmap`): the
            adaptive solve is not differentiated; `gs.value_and_grad` or `gs.replay`
            on a recorded mesh is.

    Examples:
        >>> import gradsolve as gs
        >>> sol = gs.solve(gs.problems.lorenz(n=4), rtol=1e-8, atol=1e-10)
        >>> sol.ys.shape, sol.engine, sol.ok
        ((4, 3), 'fused', True)
        >>> gs.solve(gs.problems.lorenz(n=4), engine="general").engine
        'general'
    """
    prob = as_problem(prob)
    if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves((prob.y0, prob.params))):
        raise TypeError(
            "gs.solve got traced values (it was called inside jax.grad, jit or vmap): the "
            "adaptive solve is forward only. To differentiate, use gs.value_and_grad(prob, "
            "loss), or record a mesh outside (mesh = gs.record(prob)) and call "
            "gs.replay(prob, mesh, params=..., y0=...) inside jax.grad")
    prob = cast_problem(prob, dtype)
    eng, passed, cfg = plan(prob, gradient=False, engine=engine, method=method, fused=fused,
                            rtol=rtol, atol=atol, dt0=dt0, max_steps=max_steps, ts=ts,
                            interpolate=interpolate, devices=devices,
                            memory_budget=memory_budget)
    ys, status, n_acc, n_rej = solve_rows(eng, prob, cfg)
    out_ts = jnp.asarray([prob.t_span[1]] if cfg.ts is None else cfg.ts, ys.dtype)
    sol = Solution(ys=ys, status=status, n_accepted=n_acc, n_rejected=n_rej,
                   engine=eng.name, method=cfg.method, passed_over=tuple(passed.items()),
                   ts=out_ts, interpolated=cfg.interpolate and cfg.ts is not None)
    return sol.raise_for_status() if throw else sol
