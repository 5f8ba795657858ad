"""Recover the Lorenz Rayleigh parameter rho of B systems from noisy observations.

    .venv/bin/python recipes/lorenz_rho.py [--B 8] [--K 4] [--steps 400]
        [--checkpoint-dir runs/lorenz] [--plot lorenz.png]

Each fit b owns K trajectories started from scattered initial states, all with the
same unknown rho_b (spread over [12, 18], below chaos); the data are their final
states at t = 1 with Gaussian noise of 0.01. Adam fits rho_b from 15 for every fit,
on the recorded mesh, refreshing it every 100 updates.
"""

import _common

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import gradsolve as gs  # noqa: E402


def build(B=8, K=4, noise=0.01, seed=0):
    """`(prob, to_params, loss, data, theta0, truth)` for B rho fits."""
    rng = np.random.default_rng(seed)
    rho_true = jnp.linspace(12.0, 18.0, B)
    y0 = np.tile([1.0, 0.0, 0.0], (B * K, 1)) + rng.normal(scale=0.5, size=(B * K, 3))
    params = {"sigma": jnp.full(B * K, 10.0), "rho": jnp.repeat(rho_true, K),
              "beta": jnp.full(B * K, 8.0 / 3.0)}
    prob = gs.problems.lorenz(n=B * K).replace(y0=jnp.asarray(y0), params=params)
    clean = gs.solve(prob, rtol=1e-10, atol=1e-12).raise_for_status().ys
    data = (clean + noise * rng.normal(size=clean.shape)).reshape(B, K, 3)

    def to_params(theta):
        return {"sigma": jnp.full(K, 10.0), "rho": jnp.full(K, theta["rho"]),
                "beta": jnp.full(K, 8.0 / 3.0)}

    def loss(ys, theta, obs):
        return jnp.mean((ys - obs) ** 2)

    return prob, to_params, loss, data, {"rho": jnp.full(B, 15.0)}, {"rho": rho_true}


def main():
    args = _common.parser(__doc__, B=8, K=4, steps=400).parse_args()
    prob, to_params, loss, data, theta0, truth = build(args.B, args.K)
    cal = gs.Calibrator(prob, loss, to_params=to_params, data=data,
                        optimizer=optax.adam(0.3), refresh_every=100,
                        checkpoint_dir=args.checkpoint_dir,
                        checkpoint_every=args.checkpoint_every if args.checkpoint_dir else None)
    _common.run(cal, theta0, truth, args, "lorenz_rho", grad_tol=1e-6)


if __name__ == "__main__":
    main()
