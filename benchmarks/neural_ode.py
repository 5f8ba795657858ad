"""Neural ODE training on Diffrax's own example (its docs/examples/neural_ode.ipynb),
both sides in one process: `eqx.nn.MLP(2, 2, 64, 2, softplus)` as the field, 256
series of 100 points on [0, 10] of `y' = (x_1, -x_0)`, `x = y / (1 + y)`, from
`y0 ~ U(-0.6, 1)^2`; minibatches of 32 series, Adam 3e-3, Tsit5 at rtol 1e-3,
atol 1e-6, outputs at the 100 times.

- gradsolve: a `gs.Calibrator` on defaults (one fit, the MLP in `gs.Shared`,
  `batch_size=32`; outputs from Tsit5's continuous extension, the mesh re-recorded at
  `refresh_tol` = 2 * 256 / 32, remat off for a network) on the router's engine;
- Diffrax: the example's `make_step` (`eqx.filter_jit` of `filter_value_and_grad`
  through `diffeqsolve` and the Optax update), minibatches from a NumPy permutation.

Sections:
- training (float64) and training_float32 (`jax_enable_x64` off): time per update =
  (median T(N2) - median T(N1)) / (N2 - N1) of warm runs; the first update (compiles
  included), median of fresh processes taking turns; the loss on all 256 series
  after N2 updates, solved by Diffrax;
- outputs: the gradient of 32 trajectories on one mesh with no outputs, 100 integrated
  (an extra step each) and 100 interpolated, beside Diffrax's with `SaveAt(ts=...)`;
- refresh: every None, 10, 25, 50, 100 updates (no check) and the default check, 300
  updates each from one network: wall time (compiles included), full-data loss;
- spiral: DiffEqFlux's example (`u' = A u^3`, u0 = (2, 0), 30 points on [0, 1.5],
  `Dense(2, 50, tanh), Dense(50, 2)` on `u^3`, Adam 0.05, Tsit5 at rtol 1e-3, atol
  1e-6): 500 updates on defaults, from building the Calibrator to the fit's end with
  every compile, in fresh processes without the persistent cache (DiffEqFlux's
  optimised figure: 2.7 s); the losses from 4 initial networks (`SPIRAL_SWEEP`).

    .venv/bin/python benchmarks/neural_ode.py [--quick] [--only outputs]
"""

import os

from _harness import ROOT, fmt, log, main, md_table, spawn, target, timed_fit, warm
from _spiral import SPIRAL_SWEEP, spiral_run

import time  # noqa: E402
import types  # noqa: E402

import diffrax  # noqa: E402
import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import gradsolve as gs  # noqa: E402

N_SERIES, BATCH, RTOL, ATOL, LR = 256, 32, 1e-3, 1e-6, 3e-3
SCRIPT = ROOT / "benchmarks" / "neural_ode.py"


def true_field(t, y, args):
    x = y / (1 + y)
    return jnp.stack([x[1], -x[0]])


def mlp_field(t, y, p):
    return p["mlp"](y)


def setup(seed=5678):
    """`(ts, data (256, 100, 2), y0, mlp)`: the example's data and initial network."""
    dtype = jnp.zeros(()).dtype  # float64 with x64, else float32
    data_key, model_key = jax.random.split(jax.random.key(seed))
    y0 = jax.random.uniform(data_key, (N_SERIES, 2), dtype, minval=-0.6, maxval=1.0)
    ts = jnp.linspace(0.0, 10.0, 100, dtype=dtype)
    truth = gs.EnsembleProblem(true_field, y0=y0, params=jnp.zeros(N_SERIES, dtype),
                               t_span=(0.0, 10.0))
    data = gs.solve(truth, ts=ts, rtol=1e-8, atol=1e-10).raise_for_status().ys
    mlp = eqx.nn.MLP(2, 2, 64, 2, activation=jax.nn.softplus, key=model_key)
    return ts, data, y0, jax.tree.map(lambda x: x.astype(dtype) if eqx.is_array(x) else x, mlp)


def diffrax_solve(mlp, y0, ts):
    sol = diffrax.diffeqsolve(
        diffrax.ODETerm(lambda t, y, m: m(y)), diffrax.Tsit5(), ts[0], ts[-1], ts[1] - ts[0],
        y0, args=mlp, saveat=diffrax.SaveAt(ts=ts),
        stepsize_controller=diffrax.PIDController(rtol=RTOL, atol=ATOL))
    return sol.ys


def full_loss(mlp, y0, ts, data):
    """The mean squared error on every series, the network solved by Diffrax: the same
    judge for both sides."""
    return float(jnp.mean((jax.vmap(diffrax_solve, (None, 0, None))(mlp, y0, ts) - data) ** 2))


def calibrator(ts, data, y0, mlp, refresh_every="auto", refresh_tol="auto"):
    """One fit over the problem's shared network (no fit axis): `(cal, theta0)`."""
    prob = gs.EnsembleProblem(mlp_field, y0=y0, params={"mlp": gs.Shared(mlp)},
                              t_span=(0.0, 10.0), name="neural_ode")
    cal = gs.Calibrator(prob, lambda ys, theta, d: jnp.mean((ys - d) ** 2), data=data,
                        ts=ts, rtol=RTOL, atol=ATOL, batch_size=BATCH,
                        optimizer=optax.adam(LR), refresh_every=refresh_every,
                        refresh_tol=refresh_tol)
    return cal, {"mlp": mlp}


def diffrax_trainer(ts, data, y0):
    """The example's training loop: `train(mlp, steps) -> mlp` from a fresh Adam state,
    batches from a seeded permutation."""
    optim = optax.adam(LR)

    @eqx.filter_jit
    def make_step(mlp, yi, y0i, opt_state):
        def loss(m):
            return jnp.mean((jax.vmap(diffrax_solve, (None, 0, None))(m, y0i, ts) - yi) ** 2)
        value, grads = eqx.filter_value_and_grad(loss)(mlp)
        updates, opt_state = optim.update(grads, opt_state, eqx.filter(mlp, eqx.is_array))
        return value, eqx.apply_updates(mlp, updates), opt_state

    def train(mlp, steps):
        rng = np.random.default_rng(0)
        opt_state = optim.init(eqx.filter(mlp, eqx.is_array))
        for _ in range(steps):
            idx = rng.permutation(N_SERIES)[:BATCH]
            value, mlp, opt_state = make_step(mlp, data[idx], y0[idx], opt_state)
        jax.block_until_ready(value)
        return mlp
    return train


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def training(args):
    n1, n2 = (5, 25) if args.quick else (20, 220)
    repeats = args.repeats or (2 if args.quick else 3)
    first = {"gradsolve": [], "diffrax": []}  # fresh processes, each side first in turn
    for r in range(repeats):
        for side in sorted(first, reverse=bool(r % 2)):
            first[side].append(spawn(SCRIPT, "first", side=side)["s"])
    ts, data, y0, mlp = setup()
    cal, theta0 = calibrator(ts, data, y0, mlp)
    train = diffrax_trainer(ts, data, y0)
    times = {"gradsolve": {n1: [], n2: []}, "diffrax": {n1: [], n2: []}}
    for _ in range(repeats + 1):  # the first round compiles the other steps values
        for n in (n1, n2):
            dt, res = timed_fit(cal, theta0, n)
            times["gradsolve"][n].append(dt)
            dt, net = timed(lambda: train(mlp, n))
            times["diffrax"][n].append(dt)
    med = {s: {n: float(np.median(v[n][1:])) for n in v} for s, v in times.items()}
    per_update = {s: (m[n2] - m[n1]) / (n2 - n1) for s, m in med.items()}
    ours = res.best().theta["mlp"]
    out = {"dtype": str(ts.dtype), "n1": n1, "n2": n2, "repeats": repeats,
           "engine": res.engine, "interpolate": bool(cal.config.interpolate),
           "refreshes": int(res.refreshes), "times_s": times,
           "per_update_s": per_update, "first_update_runs_s": first,
           "first_update_s": {k: float(np.median(v)) for k, v in first.items()},
           "full_loss_start": full_loss(mlp, y0, ts, data),
           "full_loss": {"gradsolve": full_loss(ours, y0, ts, data),
                         "diffrax": full_loss(net, y0, ts, data)}}
    log(f"  {out['dtype']}: x{per_update['diffrax'] / per_update['gradsolve']:.2f} per "
        f"update; losses {out['full_loss']}")
    return out


def training_float32(args):
    env = dict(os.environ, GRADSOLVE_BENCH_X64="0")
    return spawn(SCRIPT, "training", env=env, quick=args.quick, repeats=args.repeats)


def outputs(args):
    repeats = args.repeats or (5 if args.quick else 20)
    ts, data, y0, mlp = setup()
    prob = gs.EnsembleProblem(mlp_field, y0=y0[:BATCH], params={"mlp": gs.Shared(mlp)},
                              t_span=(0.0, 10.0))
    mesh = gs.record(prob, rtol=RTOL, atol=ATOL)

    def ours(out_ts, interpolate):
        @eqx.filter_jit
        def grad(p):
            return eqx.filter_value_and_grad(lambda q: jnp.mean(gs.replay(
                prob, mesh, params=q, ts=out_ts, interpolate=interpolate) ** 2))(p)
        return lambda: grad(prob.params)

    @eqx.filter_jit
    def theirs(m):
        return eqx.filter_value_and_grad(lambda q: jnp.mean(
            jax.vmap(diffrax_solve, (None, 0, None))(q, y0[:BATCH], ts) ** 2))(m)
    out = {"n": BATCH, "outputs": len(ts), "mesh_steps": int(mesh.n_steps.max()),
           "repeats": repeats, "gradient_s": {
               "no outputs": warm(ours(None, False), repeats)["median_s"],
               "integrated": warm(ours(ts, False), repeats)["median_s"],
               "interpolated": warm(ours(ts, True), repeats)["median_s"],
               "diffrax": warm(lambda: theirs(mlp), repeats)["median_s"]}}
    g = out["gradient_s"]
    log(f"  outputs: interpolated / none {g['interpolated'] / g['no outputs']:.2f}, "
        f"Diffrax / interpolated {g['diffrax'] / g['interpolated']:.2f}")
    return out


def refresh(args):
    """Refresh policies on the example from the same network: wall time of `steps`
    updates (compiles included) and the full-data loss after them."""
    steps, runs = 60 if args.quick else 300, {}
    ts, data, y0, mlp = setup()
    for every, tol in ((None, None), (10, None), (25, None), (50, None), (100, None),
                       ("auto", "auto")):
        cal, theta0 = calibrator(ts, data, y0, mlp, refresh_every=every, refresh_tol=tol)
        dt, res = timed_fit(cal, theta0, steps)
        name = (f"refresh_tol {cal.refresh_tol:g} (default)" if tol == "auto"
                else f"every {every}")
        runs[name] = {"wall_s": dt, "refreshes": int(res.refreshes),
                      "full_loss": full_loss(res.best().theta["mlp"], y0, ts, data)}
        log(f"  {name}: {dt:.1f} s, full loss {runs[name]['full_loss']:.4g}")
    return {"steps": steps, "full_loss_start": full_loss(mlp, y0, ts, data), "runs": runs}


def spiral(args):
    # The harness turns the persistent compilation cache off in its workers too.
    runs = [spawn(SCRIPT, "spiral", steps=500, refresh_every="auto")
            for _ in range(1 if args.quick else 3)]
    out = {"runs": runs, "median_wall_s": float(np.median([r["wall_s"] for r in runs]))}
    log(f"  spiral: 500 updates in {out['median_wall_s']:.2f} s (compile included)")
    out["sweep"] = [] if args.quick else [spawn(SCRIPT, "spiral", steps=500, **spec)
                                          for spec in SPIRAL_SWEEP]
    return out


SECTIONS = {"training": training, "training_float32": training_float32, "outputs": outputs,
            "refresh": refresh, "spiral": spiral}


def render(sections):
    rows = []
    for name in ("training", "training_float32"):
        if name in sections:
            s = sections[name]
            pu, first, loss = s["per_update_s"], s["first_update_s"], s["full_loss"]
            rows.append([s["dtype"], s["engine"], f"{1e3 * pu['gradsolve']:.2f}",
                         f"{1e3 * pu['diffrax']:.2f}", fmt(pu["diffrax"] / pu["gradsolve"]),
                         f"{first['gradsolve']:.2f}", f"{first['diffrax']:.2f}",
                         f"{s['full_loss_start']:.4f}",
                         f"{loss['gradsolve']:.4f}", f"{loss['diffrax']:.4f}"])
    blocks = {"training": md_table(
        ["dtype", "engine", "ms/update", "Diffrax ms/update", "x", "first update s",
         "Diffrax first step s", "loss at start", "loss after N2", "Diffrax loss after N2"],
        rows)}
    if "outputs" in sections:
        o = sections["outputs"]
        g = o["gradient_s"]
        blocks["outputs"] = (f"n = {o['n']}, {o['outputs']} output times, a mesh of "
                             f"{o['mesh_steps']} steps.\n\n" + md_table(
                                 ["outputs", "gradient ms", "/ no outputs"],
                                 [[k, f"{1e3 * v:.2f}", fmt(v / g["no outputs"])]
                                  for k, v in g.items()]))
    if "refresh" in sections:
        r = sections["refresh"]
        blocks["refresh"] = (f"{r['steps']} updates from the same network (full-data loss "
                             f"{r['full_loss_start']:.4f} at the start).\n\n" + md_table(
                                 ["policy", "wall s (compiles included)", "refreshes",
                                  "full-data loss after"],
                                 [[k, f"{x['wall_s']:.2f}", x["refreshes"],
                                   f"{x['full_loss']:.4f}"] for k, x in r["runs"].items()]))
    if "spiral" in sections:
        r = sections["spiral"]
        rows = [(f"{i + 1}, defaults", x) for i, x in enumerate(r["runs"])] + \
            [("sweep", x) for x in r.get("sweep", ())]
        blocks["spiral"] = md_table(
            ["run", "seed", "engine", "refresh_every", "refresh_tol",
             "wall s (500 updates, compiles included)", "of which setup s",
             "data's solve s (apart)", "refreshes", "loss first -> last",
             "median loss, last 100"],
            [[run, x.get("seed", 0), x["engine"], x.get("refresh_every", 25),
              fmt(x.get("refresh_tol")), f"{x['wall_s']:.2f}", f"{x['setup_s']:.2f}",
              f"{x['data_s']:.2f}", x["refreshes"],
              f"{x['loss_first']:.3g} -> {x['loss_last']:.3g}",
              f"{x.get('loss_median_last100', np.nan):.3g}"] for run, x in rows])
    return blocks


def targets(sections):
    runs = {s["dtype"]: s for k, s in sections.items() if k.startswith("training")}
    out = [target("Neural ODE (Diffrax's example), time per update vs Diffrax", ">=", 3,
                  {d: s["per_update_s"]["diffrax"] / s["per_update_s"]["gradsolve"]
                   for d, s in runs.items()}),
           target("Neural ODE, full-data loss after N2 updates / Diffrax's", "<=", 1.05,
                  {d: s["full_loss"]["gradsolve"] / s["full_loss"]["diffrax"]
                   for d, s in runs.items()}),
           target("Neural ODE, first update (compile) / Diffrax's first step", "<=", 1,
                  {d: s["first_update_s"]["gradsolve"] / s["first_update_s"]["diffrax"]
                   for d, s in runs.items()})]
    if "outputs" in sections:
        g = sections["outputs"]["gradient_s"]
        out.append(target("Neural ODE gradient, 100 outputs / no outputs", "<=", 1.3,
                          {"interpolated": g["interpolated"] / g["no outputs"]}))
    if "spiral" in sections:  # seconds against DiffEqFlux's 2.7 s, as a ratio
        r = sections["spiral"]
        out.append(target("DiffEqFlux spiral, 500 updates incl. compile / 2.7 s", "<=", 1,
                          {"float64": r["median_wall_s"] / 2.7}))
        picked = [x for x in r["runs"][:1] + r.get("sweep", []) if x.get("refresh_every") is None]

        def by_seed(engine, tol):
            return {x.get("seed", 0): x["loss_median_last100"] for x in picked
                    if x["engine"] == engine and x.get("refresh_tol") == tol}
        ours, theirs = by_seed("general_replay", 2.0), by_seed("diffrax", None)
        out.append(target("Spiral, median loss of the last 100 updates / Diffrax's", "<=", 1,
                          {f"seed {k}": ours[k] / v for k, v in theirs.items() if k in ours}))
    return out


def first_update(spec):
    """Seconds from building one side's trainer to its first update's end, in this
    fresh process, after the data (both libraries imported before, as by a user)."""
    ts, data, y0, mlp = setup()
    if spec["side"] == "diffrax":
        return {"s": timed(lambda: diffrax_trainer(ts, data, y0)(mlp, 1))[0]}
    return {"s": timed(lambda: timed_fit(*calibrator(ts, data, y0, mlp), 1))[0]}


def worker(spec):
    return training(types.SimpleNamespace(quick=spec["quick"], repeats=spec["repeats"]))


if __name__ == "__main__":
    main("neural_ode", __doc__, SECTIONS, render, targets,
         {"training": worker, "spiral": spiral_run, "first": first_update})
