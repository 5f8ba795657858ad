"""`gs.record`: the routed recorder (the recorder cores are recorder.py, the general
one, and warp/, the fused one), and `record_rows`, which runs any engine's recorder
over this process's rows in memory-bounded chunks."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from . import layout
from .config import DEFAULT_MAX_STEPS
from .engines import with_recorder
from .mesh import Mesh
from .problem import as_problem, trajectory_params
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
    n = y0.shape[0]
    pieces = layout.row_pieces(n, cfg, engine.row_bytes(prob, cfg), "record")
    if len(pieces) == 1 and pieces[0][0].size == n:
        return engine.record(prob, cfg, params=params, y0=y0)
    # The chunks' meshes joined on the host as they come (one host copy of the mesh,
    # grown when a chunk is wider), then moved to the device once.
    lo = pieces[0][0][0]
    h = counts = None
    for rows, sub in pieces:
        part = engine.record(prob, sub, params=trajectory_params(params, rows), y0=y0[rows])
        if h is None:
            h = np.zeros((pieces[-1][0][-1] + 1 - lo, part.columns), part.h.dtype)
            counts = {k: np.zeros(h.shape[0], getattr(part, k).dtype)
                      for k in ("n_steps", "n_rejected", "status")}
            first = part
        if part.columns > h.shape[1]:
            h = np.pad(h, ((0, 0), (0, part.columns - h.shape[1])))
        h[rows - lo, :part.columns] = np.asarray(part.h)
        for k in counts:
            counts[k][rows - lo] = np.asarray(getattr(part, k))
        del part
    mesh = eqx.tree_at(lambda m: (m.h, m.n_steps, m.n_rejected, m.status), first,
                       (jnp.asarray(h), *(jnp.asarray(counts[k]) for k in counts)))
    return layout.gather_processes(mesh, n) if jax.process_count() > 1 else mesh
