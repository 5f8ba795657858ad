"""`gs.record`: the routed recorder (the recorder cores are recorder.py, the general
one, and warp/, the fused one), and `record_rows`, which runs any engine's recorder
over this process's rows in memory-bounded chunks."""

import equinox as eqx
import jax.numpy as jnp

from . import layout
from .config import DEFAULT_MAX_STEPS
from .engines import with_recorder
from .mesh import Mesh
from .problem import as_problem, rows_of
from .router import plan


def record(prob, *, rtol=1e-6, atol=1e-9, method=None, dt0=None,
           max_steps=DEFAULT_MAX_STEPS, recorder=None, params=None, y0=None, devices=None,
           memory_budget=None) -> Mesh:
    """Record the accepted step sizes of every trajectory (the mesh).

    Args:
        prob: an ensemble problem.
        rtol, atol: tolerances of the adaptive solve.
        method: integration method (default: `tsit5`, or the stiff default for
            `stiff=True` problems).
        dt0: first step; `None` selects it per trajectory by Hairer & Wanner's rule.
        max_steps: cap on attempted (accepted + rejected) steps per trajectory; a
            trajectory that reaches it gets `Status.MAX_STEPS`.
        recorder: None (the router: the fused recorder for a registered field with
            d <= 64, else the general one), `"general"` (the batched JAX recorder) or
            `"fused"` (the Warp recorder).
        params, y0: record at these instead of the problem's own.
        devices: the devices to split the ensemble over (None: all devices of the
            default backend from `layout.MIN_ROWS_PER_DEVICE` trajectories per device;
            a number, a sequence of `jax.Device` or a 1-D `jax.sharding.Mesh`); see
            docs/scale.md.
        memory_budget: bytes each device may use (`"2GB"`; None: half the memory
            available); the general recorder runs larger ensembles in chunks.

    Returns:
        A `gs.Mesh` (the same on every device split). Failed trajectories are marked
        in `mesh.status`, not raised.

    Examples:
        >>> import gradsolve as gs
        >>> mesh = gs.record(gs.problems.lorenz(n=3), rtol=1e-6, atol=1e-9, dt0=0.01)
        >>> mesh.h.shape[0], mesh.method, mesh.recorder, mesh.ok
        (3, 'tsit5', 'fused', True)
    """
    prob = as_problem(prob)
    engine = None if recorder is None else with_recorder(recorder)
    chosen, _, cfg = plan(prob, gradient=True, engine=engine, method=method, rtol=rtol,
                          atol=atol, dt0=dt0, max_steps=max_steps, devices=devices,
                          memory_budget=memory_budget)
    if not chosen.serves("record"):
        raise ValueError(f"engine {chosen.name!r} does not record a mesh")
    return record_rows(chosen, prob, cfg, params=params, y0=y0)


def record_rows(engine, prob, cfg, params=None, y0=None) -> Mesh:
    """`engine.record` of every trajectory: this process's rows only (the others'
    come from their processes), in chunks that fit `cfg.memory_budget` where the engine
    says what a row costs (`Engine.row_bytes`), each chunk split over this
    process's devices by the engine."""
    params = prob.params if params is None else params
    y0 = prob.y0 if y0 is None else jnp.asarray(y0)
    first = []  # the first chunk's mesh: the rest of the Mesh (its span, method, ...)

    def run(rows, sub):
        y0_rows, params_rows = (y0, params) if rows is None else rows_of(y0, params, rows)
        part = engine.record(prob, sub, params=params_rows, y0=y0_rows)
        if not first:
            first.append(part)
        return part.h, part.n_steps, part.n_rejected, part.status
    rows = layout.by_rows(y0.shape[0], cfg, engine.row_bytes(prob, cfg), "record", run)
    return eqx.tree_at(lambda m: (m.h, m.n_steps, m.n_rejected, m.status), first[0],
                       tuple(jnp.asarray(x) for x in rows))
