"""Recover the flattening q of a logarithmic dark-matter halo from stellar orbits.

    .venv/bin/python recipes/galactic_halo.py [--B 8] [--K 4] [--steps 300]
        [--checkpoint-dir runs/halo] [--plot halo.png]

Potential Phi = v_c^2 / 2 ln(r_c^2 + x^2 + y^2 + z^2 / q^2). Fit b observes K stars
(scattered initial positions and velocities) in a halo of unknown flattening q_b
(spread over [0.7, 0.95]): their positions at t = 2.5, 5, 7.5, 10 with noise 0.005.
q is fitted through a bounded transform (0.5, 1.2), starting from 0.85 for all.
"""

import _common

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import gradsolve as gs  # noqa: E402


TS = jnp.array([2.5, 5.0, 7.5, 10.0])


def build(B=8, K=4, noise=0.005, seed=1):
    """`(prob, to_params, loss, data, theta0, truth, ts)` for B flattening fits."""
    rng = np.random.default_rng(seed)
    q_true = jnp.linspace(0.7, 0.95, B)
    n = B * K
    base = gs.problems.galactic_halo(n=n)
    y0 = np.asarray(base.y0) + rng.normal(scale=0.05, size=(n, 6))
    params = {"q": jnp.repeat(q_true, K), "v_c": jnp.ones(n), "r_c": jnp.full(n, 0.1)}
    prob = base.replace(y0=jnp.asarray(y0), params=params)
    clean = gs.solve(prob, rtol=1e-10, atol=1e-12, ts=TS).raise_for_status().ys[..., :3]
    data = (clean + noise * rng.normal(size=clean.shape)).reshape(B, K, len(TS), 3)

    def to_params(theta):
        return {"q": jnp.full(K, theta["q"]), "v_c": jnp.ones(K), "r_c": jnp.full(K, 0.1)}

    def loss(ys, theta, obs):
        return jnp.mean((ys[..., :3] - obs) ** 2)

    return prob, to_params, loss, data, {"q": jnp.full(B, 0.85)}, {"q": q_true}


def main():
    args = _common.parser(__doc__, B=8, K=4, steps=300).parse_args()
    prob, to_params, loss, data, theta0, truth = build(args.B, args.K)
    cal = gs.Calibrator(prob, loss, to_params=to_params, data=data, ts=TS,
                        optimizer=optax.adam(0.05), transform={"q": gs.transforms.Bounded(0.5, 1.2)},
                        refresh_every=50, checkpoint_dir=args.checkpoint_dir,
                        checkpoint_every=args.checkpoint_every if args.checkpoint_dir else None)
    _common.run(cal, theta0, truth, args, "galactic_halo", grad_tol=1e-7)


if __name__ == "__main__":
    main()
