"""Train a small MLP inside the Robertson system's autocatalytic term.

    .venv/bin/python recipes/neural_robertson.py [--steps 150] [--K 4]
        [--checkpoint-dir runs/neural] [--plot neural.png]

The "true" chemistry multiplies the autocatalytic rate k2 y2^2 by (1 + 2 y3), a
dependence the model does not know; the model (`gs.problems.neural_robertson`) writes
that rate as k2 y2^2 exp(MLP(y)), with an Equinox MLP (3 -> 16 -> 16 -> 1, tanh)
started at zero output. The MLP's weights are shared by the K reactors (gs.Shared)
and trained with Adam through the in-kernel adjoint (`engine="kernel_adjoint"`:
Rosenbrock23's replay and its adjoint in Warp) on the recorded mesh. A capability
demonstration: the loss falls and the learned factor approaches 1 + 2 y3 on the
trajectories seen.
"""

import _common

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import gradsolve as gs  # noqa: E402
from gradsolve.fields import _neural  # noqa: E402


TS = jnp.logspace(-1.0, 2.0, 8)
SCALE = jnp.array([1.0, 1e4, 1.0])
# Rosenbrock23 at rtol 1e-6 (the stiff fused method; named, as the router takes
# Rodas5P on the general path below rtol 1e-6).
SETTINGS = dict(method="rosenbrock23", rtol=1e-6, atol=1e-10)


def build(K=4, seed=3):
    """`(prob, to_params, loss, data, theta0)` for one neural fit over K reactors."""
    prob = gs.problems.neural_robertson(n=K, key=jax.random.key(seed))
    truth = prob.replace(f_jax=_neural.robertson_true_f, fused=False)
    data = (gs.solve(truth, rtol=1e-10, atol=1e-14, ts=TS).raise_for_status().ys * SCALE)[None]
    rates = {k: prob.params[k] for k in ("k1", "k2", "k3")}
    theta0 = jax.tree.map(lambda x: x[None] if eqx.is_array(x) else x, prob.params["mlp"].value)

    def to_params(mlp):
        return dict(rates, mlp=gs.Shared(mlp))

    def loss(ys, mlp, obs):
        return jnp.mean((ys * SCALE - obs) ** 2)

    return prob, to_params, loss, data, theta0


def main():
    args = _common.parser(__doc__, B=1, K=4, steps=150).parse_args()
    if args.B != 1:
        raise SystemExit("this recipe trains one network (B = 1)")
    prob, to_params, loss, data, theta0 = build(args.K)
    cal = gs.Calibrator(prob, loss, to_params=to_params, data=data, ts=TS,
                        optimizer=optax.adam(3e-3), refresh_every=25, engine="kernel_adjoint",
                        checkpoint_dir=args.checkpoint_dir,
                        checkpoint_every=args.checkpoint_every if args.checkpoint_dir else None,
                        **SETTINGS)
    res = _common.run(cal, theta0, None, args, "neural_robertson")
    first, last = res.history[0, 0], res.loss[0]
    print(f"loss {first:.4g} -> {last:.4g} ({first / last:.1f}x lower) over {res.updates} updates")
    mlp = jax.tree.map(lambda x: x[0] if eqx.is_array(x) else x, res.theta)
    ys = np.asarray(data[0]) / np.asarray(SCALE)
    learned = np.exp(np.asarray(jax.vmap(mlp)(jnp.asarray(ys.reshape(-1, 3)))))[:, 0]
    wanted = 1 + 2 * ys.reshape(-1, 3)[:, 2]
    print(f"learned factor vs 1 + 2 y3 on the observed states: max relative difference "
          f"{np.max(np.abs(learned - wanted) / wanted):.3f}")


if __name__ == "__main__":
    main()
