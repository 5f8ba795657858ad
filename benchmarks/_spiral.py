"""DiffEqFlux's neural ODE example for `neural_ode.py`'s "spiral" section: one fit in
a fresh process (`spiral_run`, the section's worker) and the runs it sweeps."""

import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import gradsolve as gs
from gradsolve.fields import _neural


def spiral_run(spec):
    """The spiral fit in this fresh process: seconds from building the Calibrator to
    the end (the data's solve timed apart), and the losses."""
    t_data = time.perf_counter()
    dtype = jnp.zeros(()).dtype
    ts = jnp.linspace(0.0, 1.5, 30, dtype=dtype)
    u0 = jnp.array([[2.0, 0.0]], dtype)
    truth = gs.EnsembleProblem(_neural.spiral_f, y0=u0, params=None, t_span=(0.0, 1.5))
    data = gs.solve(truth, ts=ts, rtol=1e-8, atol=1e-10).raise_for_status().ys
    t0 = time.perf_counter()
    mlp = eqx.nn.MLP(2, 2, 50, 1, activation=jnp.tanh, dtype=dtype,
                     key=jax.random.key(spec.get("seed", 0)))
    prob = gs.EnsembleProblem(lambda t, u, p: p["mlp"](u ** 3), y0=u0,
                              params={"mlp": gs.Shared(mlp)}, t_span=(0.0, 1.5))
    cal = gs.Calibrator(prob, lambda ys, m, d: jnp.sum((ys - d) ** 2), data=data, ts=ts,
                        rtol=1e-3, atol=1e-6, optimizer=optax.adam(0.05),
                        refresh_every=spec["refresh_every"],
                        refresh_tol=spec.get("refresh_tol", "auto"), engine=spec.get("engine"))
    built = time.perf_counter() - t0
    res = cal.fit(steps=spec["steps"], progress=False)
    jax.block_until_ready(res.theta)
    return {"wall_s": time.perf_counter() - t0, "setup_s": built, "data_s": t0 - t_data,
            "engine": res.engine, "updates": int(res.updates),
            "refreshes": int(res.refreshes), "refresh_every": cal.refresh_every,
            "refresh_tol": cal.refresh_tol, "seed": spec.get("seed", 0),
            "loss_first": float(res.history[0, 0]), "loss_last": float(res.loss[0]),
            "loss_median_last100": float(np.median(np.asarray(res.history[-100:, 0])))}


# The spiral from seeds 0-3 on defaults, refreshing every 7 updates with no error
# check (the default before it), with Diffrax's own gradient in the same loop; from
# seed 0 never refreshing and the check at 8 tolerances.
SPIRAL_SWEEP = tuple(
    [{"refresh_every": "auto", "seed": seed} for seed in (1, 2, 3)]
    + [{"refresh_every": 7, "refresh_tol": None, "seed": seed} for seed in range(4)]
    + [{"refresh_every": None, "engine": "diffrax", "seed": seed} for seed in range(4)]
    + [{"refresh_every": None, "refresh_tol": None}, {"refresh_every": None, "refresh_tol": 8.0}])
