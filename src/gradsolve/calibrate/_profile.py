"""Profile likelihoods: one parameter held at each grid value while the others are
re-optimised, every grid point a concurrent fit of a new Calibrator.

The new Calibrator is built from the given one's settings (`Calibrator._settings`)
over the best fit's rows, once per grid point, with its engine, no checkpoints, and
the fixed leaf held (`Calibrator._hold`: its gradient is zero). The leaf then stays
at its grid value exactly -- Adam's update of a zero gradient is zero, and a
quasi-Newton direction (`optax.lbfgs`) has no component along it, so its line search
tries only points of the profile (masking the update after the optimizer would move
the points the line search accepted) -- and `grad_tol` reads the free leaves' gradient
(the fixed leaf's is not zero away from the optimum: counted, no profile converged).
"""

import equinox as eqx
import jax
import numpy as np

from ..problem import rows_of
from . import _result, _validate


def profile(cal, res, name, grid, *, steps, tol, grad_tol, progress, slots):
    """`Calibrator.profile` of the Calibrator `cal` (see there)."""
    best = res.best()
    grid = np.asarray(grid, np.asarray(jax.tree.leaves(best.theta)[0]).dtype).ravel()
    G = grid.size
    leaves = {_result._name(p): (p, x) for p, x in jax.tree_util.tree_leaves_with_path(
        best.theta) if eqx.is_array(x) or isinstance(x, np.ndarray)}
    if name not in leaves:
        raise ValueError(f"no leaf {name!r} in theta; its leaves are {sorted(leaves)}")
    fixed, value = leaves[name]
    if np.ndim(value) != 0:
        raise ValueError(f"theta[{name!r}] holds {np.shape(value)} values per fit; a "
                         f"profile fixes a leaf of one number")
    _validate.check_grid(cal.transform, name, fixed, grid)
    B = np.shape(res.loss)[0]
    K = cal.problem.n // B
    # On the host (NumPy) or in one compiled call (`rows_of`): eager jnp ops compiled a
    # small program per leaf shape, ~25 ms each.
    theta0 = jax.tree_util.tree_map_with_path(
        lambda p, x: grid if p == fixed else
        np.broadcast_to(np.asarray(x), (G,) + np.shape(x)) if eqx.is_array(x)
        or isinstance(x, np.ndarray) else x, best.theta)
    # The best fit's K trajectories and data, once per grid point.
    rows = np.tile(np.arange(best.index * K, (best.index + 1) * K, dtype=np.int32), G)
    y0, params = rows_of(cal.problem.y0, cal.problem.params, rows)
    prob = cal.problem.replace(y0=y0, params=params)
    data = None if cal.data is None else jax.tree.map(
        lambda d: np.broadcast_to(np.asarray(d)[best.index], (G,) + np.shape(d)[1:]),
        cal.data)
    hold = jax.tree_util.tree_map_with_path(  # the structure of the optimised u
        lambda p, x: p == fixed, eqx.filter(best.theta, eqx.is_inexact_array))
    settings = dict(cal._settings, engine=cal._engine, refresh_every=cal.refresh_every,
                    refresh_tol=cal.refresh_tol,
                    checkpoint_dir=None, checkpoint_every=None)
    if np.ndim(cal.config.dt0):  # a first step per trajectory: the profile's rows'
        settings["dt0"] = np.asarray(cal.config.dt0)[rows]
    # theta0 leads with the grid points: to_params is given, so never one fit (a
    # one-fit Calibrator's to_params re-wraps the shared leaves, its data has B = 1).
    loss = cal.loss if cal.residuals is None else None  # residuals are in settings
    jobs = type(cal)(prob, loss, cal.to_params, data, cal.optimizer, **settings)
    jobs._hold(hold)
    jobs._max_updates = cal._max_updates
    return jobs.fit(theta0, steps=steps, tol=tol, grad_tol=grad_tol, progress=progress,
                    slots=slots)

