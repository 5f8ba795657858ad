"""Diffrax's neural ODE example as one Calibrator fit: an MLP learns the field of 256 series.

    .venv/bin/python recipes/neural_ode.py [--steps 500] [--series 256]
        [--checkpoint-dir runs/neural_ode] [--plot neural_ode.png] [--no-progress]

Diffrax's `docs/examples/neural_ode.ipynb`: series of y' = (x2, -x1), x = y / (1 + y),
from y0 uniform in [-0.6, 1]^2, observed at 100 times on [0, 10]; the model
`eqx.nn.MLP(2, 2, 64, 2, softplus)`; minibatches of 32 series; Adam 3e-3; Tsit5 at
rtol 1e-3, atol 1e-6; the example's length strategy: `--steps` updates on the first
10 % of each series, then as many on all of it. The network sits in the problem as
`gs.Shared`, so the Calibrator fits it once over every series with no fit axis
anywhere (docs/calibrator.md, section 5); the outputs come from Tsit5's continuous
extension and the mesh is re-recorded when a step of it, replayed at the current
network, errs above 16 tolerances (both defaults: the second is `refresh_tol="auto"`
for 256 series in minibatches of 32). It
prints each stage's loss and time and plots a series against the trained model's.
"""

import _common

import pathlib  # noqa: E402
import time  # noqa: E402

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import gradsolve as gs  # noqa: E402

RTOL, ATOL, BATCH, LR = 1e-3, 1e-6, 32, 3e-3
LENGTHS = (0.1, 1.0)  # the share of each series fitted in each stage


def true_field(t, y, args):
    x = y / (1 + y)
    return jnp.stack([x[1], -x[0]])


def build(series=256, seed=5678):
    """`(prob, loss, ts, data)`: the example's data `(series, 100, 2)` and a problem
    holding the initial network as its shared parameters."""
    data_key, model_key = jax.random.split(jax.random.key(seed))
    y0 = jax.random.uniform(data_key, (series, 2), minval=-0.6, maxval=1.0)
    ts = jnp.linspace(0.0, 10.0, 100)
    truth = gs.EnsembleProblem(true_field, y0=y0, params=None, t_span=(0.0, 10.0))
    data = gs.solve(truth, ts=ts, rtol=1e-8, atol=1e-10).raise_for_status().ys
    mlp = eqx.nn.MLP(2, 2, 64, 2, activation=jax.nn.softplus, key=model_key)
    prob = gs.EnsembleProblem(lambda t, y, p: p["mlp"](y), y0=y0,
                              params={"mlp": gs.Shared(mlp)}, t_span=(0.0, 10.0),
                              name="neural_ode")

    def loss(ys, theta, d):
        return jnp.mean((ys - d) ** 2)

    return prob, loss, ts, data


def stage(prob, loss, ts, data, length, args):
    """One stage of the length strategy: the fit on the first `length` of each series,
    from the problem's network; returns the trained network."""
    m = max(2, int(length * ts.size))
    cal = gs.Calibrator(prob.replace(t_span=(0.0, float(ts[m - 1]))), loss,
                        data=data[:, :m], ts=ts[:m], rtol=RTOL, atol=ATOL,
                        batch_size=min(BATCH, prob.n), optimizer=optax.adam(LR),
                        checkpoint_dir=args.checkpoint_dir and f"{args.checkpoint_dir}/{m}",
                        checkpoint_every=args.checkpoint_every if args.checkpoint_dir else None)
    start = time.perf_counter()
    res = cal.fit(steps=args.steps, progress=not args.no_progress)
    print(f"first {m} of {ts.size} times: minibatch loss {float(res.history[0, 0]):.4g} -> "
          f"{float(res.loss[0]):.4g} in {res.updates} updates, {time.perf_counter() - start:.1f} s "
          f"(compile included; engine {res.engine}, mesh refreshes {res.refreshes})")
    return res.best().theta["mlp"]


def plot(prob, mlp, ts, data, path):
    """The first series (dots) against the trained model's solution (lines)."""
    import matplotlib  # optional: the plot extra
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    model = gs.solve(prob.replace(params={"mlp": gs.Shared(mlp)}), ts=ts, rtol=RTOL,
                     atol=ATOL).ys
    fig, ax = plt.subplots(figsize=(6, 4))
    for i, color in enumerate(("C0", "C1")):
        ax.plot(ts, data[0, :, i], ".", color=color, label=f"data y{i + 1}")
        ax.plot(ts, model[0, :, i], color=color, label=f"model y{i + 1}")
    ax.set(xlabel="t", title="neural ODE: the first series")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main():
    p = _common.parser(__doc__, B=1, steps=500)
    p.add_argument("--series", type=int, default=256, help="how many series to fit")
    args = p.parse_args()
    if args.B != 1:
        raise SystemExit("this recipe trains one network (B = 1)")
    prob, loss, ts, data = build(args.series)
    for length in LENGTHS:
        mlp = stage(prob, loss, ts, data, length, args)
        prob = prob.replace(params={"mlp": gs.Shared(mlp)})  # the next stage starts here
    full = gs.solve(prob, ts=ts, rtol=RTOL, atol=ATOL).ys
    print(f"loss on all {prob.n} series at every time: {float(jnp.mean((full - data) ** 2)):.4g}")
    path = args.plot or "recipes/out/neural_ode.png"
    pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
    plot(prob, mlp, ts, data, path)
    print(f"plot saved to {path}")


if __name__ == "__main__":
    main()
