"""`gs.record`: the routed recorder (the recorder cores are recorder.py, the general
one, and warp/, the fused one)."""

from .config import DEFAULT_MAX_STEPS
from .engines import with_recorder
from .mesh import Mesh
from .problem import as_problem
from .router import plan


def record(prob, *, rtol=1e-6, atol=1e-9, method=None, dt0=None,
           max_steps=DEFAULT_MAX_STEPS, recorder=None, params=None, y0=None) -> Mesh:
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

    Returns:
        A `gs.Mesh`. Failed trajectories are marked in `mesh.status`, not raised.

    Examples:
        >>> import gradsolve as gs
        >>> mesh = gs.record(gs.problems.lorenz(n=3), rtol=1e-6, atol=1e-9, dt0=0.01)
        >>> mesh.h.shape[0], mesh.method, mesh.recorder, mesh.ok
        (3, 'tsit5', 'fused', True)
    """
    prob = as_problem(prob)
    engine = None if recorder is None else with_recorder(recorder)
    chosen, _, cfg = plan(prob, gradient=True, engine=engine, method=method, rtol=rtol,
                          atol=atol, dt0=dt0, max_steps=max_steps)
    if not chosen.serves("record"):
        raise ValueError(f"engine {chosen.name!r} does not record a mesh")
    return chosen.record(prob, cfg, params=params, y0=y0)
