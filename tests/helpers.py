"""Shared test helpers (one home for each)."""

import numpy as np


def rel_err(a, b):
    """Max relative difference, relative to the larger of |b|'s max and 1e-300."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-300))


def tree_rel_err(a, b):
    import jax
    errs = jax.tree.leaves(jax.tree.map(rel_err, a, b))
    return max(errs)


def rel_err_componentwise(a, b):
    """Max over the entries of |a - b| / |b| (entries equal in both count zero): every
    entry against its own size, so a small species (Robertson's y2 ~ 6e-6) is held to
    the same relative accuracy as a large one, which `rel_err` does not do."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    diff = np.abs(a - b)
    with np.errstate(divide="ignore", invalid="ignore"):
        return float(np.max(np.where(diff == 0, 0.0, diff / np.abs(b))))


def small_spiral(rtol, atol):
    """DiffEqFlux's spiral, small: `u' = MLP(u^3)` (2 -> 8 tanh -> 2) from (2, 0) on
    [0, 1.5], data at 10 times from the true `u' = (u^3) A` solved at `rtol`, `atol`;
    Adam at 0.05 moves the network far between updates (the case a stale mesh fails).
    Returns `(prob, ts, data)`."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    import gradsolve as gs
    from gradsolve.fields import _neural
    ts = jnp.linspace(0.0, 1.5, 10)
    u0 = jnp.array([[2.0, 0.0]])
    truth = gs.EnsembleProblem(_neural.spiral_f, y0=u0, params=None, t_span=(0.0, 1.5))
    data = gs.solve(truth, ts=ts, rtol=rtol, atol=atol).raise_for_status().ys[0]
    mlp = eqx.nn.MLP(2, 2, 8, 1, activation=jnp.tanh, key=jax.random.key(0))
    prob = gs.EnsembleProblem(lambda t, u, p: p["mlp"](u ** 3), y0=u0,
                              params={"mlp": gs.Shared(mlp)}, t_span=(0.0, 1.5))
    return prob, ts, data
