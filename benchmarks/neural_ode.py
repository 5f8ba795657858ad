"""Neural ODE training on Diffrax's own example (its docs/examples/neural_ode.ipynb),
both sides in one process: `eqx.nn.MLP(2, 2, 64, 2, softplus)` as the field, 256
series of 100 points on [0, 10] of `y' = (x_1, -x_0)`, `x = y / (1 + y)`, from
`y0 ~ U(-0.6, 1)^2`; minibatches of 32 series, Adam 3e-3, Tsit5 at rtol 1e-3,
atol 1e-6, outputs at the 100 times.

- gradsolve: a `gs.Calibrator` on its defaults (one fit, the MLP in `gs.Shared`,
  `batch_size=32`; outputs from Tsit5's continuous extension, the mesh refreshed every
  50 updates, remat off for a network) on the router's engine;
- Diffrax: the example's `make_step` (`eqx.filter_jit` of `filter_value_and_grad`
  through `diffeqsolve` and the Optax update), minibatches from a NumPy permutation.

Sections:
- training (float64) and training_float32 (a fresh process with `jax_enable_x64`
  off): time per update = (median T(N2) - median T(N1)) / (N2 - N1) of warm runs; the
  first update, from building the Calibrator / `make_step` with every compile, median
  of fresh processes (alternating which side runs first); the loss on all 256 series
  after N2 updates, each side's network solved by Diffrax;
- outputs: the gradient of 32 trajectories on one recorded mesh with no outputs, 100
  integrated outputs (an extra step each) and 100 from the continuous extension,
  beside Diffrax's gradient with `SaveAt(ts=...)`;
- refresh: refresh_every None, 10, 25, 50, 100 on the example, 300 updates each from
  the same network: wall time (compiles included) and full-data loss;
- spiral: DiffEqFlux's neural ODE example (`u' = A u^3`, u0 = (2, 0), 30 points on
  [0, 1.5], `Dense(2, 50, tanh), Dense(50, 2)` on `u^3`, Adam 0.05, sum of squares,
  Tsit5 at DifferentialEquations.jl's default rtol 1e-3, atol 1e-6): the wall time of
  500 updates including every compile on the Calibrator's defaults, from building the
  Calibrator to the fit's end (the data's own solve apart), in a fresh process with
  the persistent compilation cache off (DiffEqFlux's optimised figure: 2.7 s); then the loss after 500 updates refreshing never, every 25, 10, 5 updates
  and at every update, and with Diffrax's own gradient in the same loop.

    .venv/bin/python benchmarks/neural_ode.py [--quick] [--only outputs]
"""

import os

from _harness import ROOT, fmt, log, main, md_table, spawn, target, timed_fit, warm

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


def calibrator(ts, data, y0, mlp, refresh_every="auto"):
    """One fit over the problem's shared network (no fit axis): `(cal, theta0)`."""
    prob = gs.EnsembleProblem(mlp_field, y0=y0, params={"mlp": gs.Shared(mlp)},
                              t_span=(0.0, 10.0), name="neural_ode")
    cal = gs.Calibrator(prob, lambda ys, theta, d: jnp.mean((ys - d) ** 2), data=data,
                        ts=ts, rtol=RTOL, atol=ATOL, batch_size=BATCH,
                        optimizer=optax.adam(LR), refresh_every=refresh_every)
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
    """Refresh policies on the example, each from the same network: the wall time of
    `steps` updates (compiles included: a refresh that widens the mesh compiles the
    update again) and the full-data loss after them."""
    steps, runs = 60 if args.quick else 300, {}
    ts, data, y0, mlp = setup()
    for every in (None, 10, 25, 50, 100):
        cal, theta0 = calibrator(ts, data, y0, mlp, refresh_every=every)
        dt, res = timed_fit(cal, theta0, steps)
        runs[str(every)] = {"wall_s": dt, "refreshes": int(res.refreshes),
                            "full_loss": full_loss(res.best().theta["mlp"], y0, ts, data)}
        log(f"  refresh_every={every}: {dt:.1f} s, full loss {runs[str(every)]['full_loss']:.4g}")
    return {"steps": steps, "full_loss_start": full_loss(mlp, y0, ts, data), "runs": runs}


SPIRAL_A = jnp.array([[-0.1, 2.0], [-2.0, -0.1]])


def spiral_run(spec):
    """The spiral fit in this (fresh) process: seconds from building the Calibrator to
    the end of 500 updates (the data's solve, with its compiles, timed apart), and the
    loss before and after."""
    t_data = time.perf_counter()
    dtype = jnp.zeros(()).dtype
    ts = jnp.linspace(0.0, 1.5, 30, dtype=dtype)
    u0 = jnp.array([[2.0, 0.0]], dtype)
    truth = gs.EnsembleProblem(lambda t, u, p: (u ** 3) @ SPIRAL_A.astype(u.dtype), y0=u0,
                               params=None, t_span=(0.0, 1.5))
    data = gs.solve(truth, ts=ts, rtol=1e-8, atol=1e-10).raise_for_status().ys
    t0 = time.perf_counter()
    mlp = eqx.nn.MLP(2, 2, 50, 1, activation=jnp.tanh, key=jax.random.key(0))
    mlp = jax.tree.map(lambda x: x.astype(dtype) if eqx.is_array(x) else x, mlp)
    prob = gs.EnsembleProblem(lambda t, u, p: p["mlp"](u ** 3), y0=u0,
                              params={"mlp": gs.Shared(mlp)}, t_span=(0.0, 1.5))
    cal = gs.Calibrator(prob, lambda ys, m, d: jnp.sum((ys - d) ** 2),
                        to_params=lambda m: {"mlp": gs.Shared(m)}, data=data[None], ts=ts,
                        rtol=1e-3, atol=1e-6, optimizer=optax.adam(0.05),
                        refresh_every=spec["refresh_every"], engine=spec.get("engine"))
    theta0 = jax.tree.map(lambda x: x[None] if eqx.is_array(x) else x, mlp)
    built = time.perf_counter() - t0
    res = cal.fit(theta0, steps=spec["steps"], progress=False)
    jax.block_until_ready(res.theta)
    return {"wall_s": time.perf_counter() - t0, "setup_s": built, "data_s": t0 - t_data,
            "engine": res.engine, "updates": int(res.updates),
            "refreshes": int(res.refreshes), "refresh_every": cal.refresh_every,
            "loss_first": float(res.history[0, 0]), "loss_last": float(res.loss[0])}


# The spiral's refresh sweep (the loss after 500 updates against how often the mesh is
# re-recorded), beside Diffrax's own adaptive gradient in the same loop.
SPIRAL_SWEEP = ({"refresh_every": None}, {"refresh_every": 25}, {"refresh_every": 10},
                {"refresh_every": 5}, {"refresh_every": 1},
                {"refresh_every": None, "engine": "diffrax"})


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
                                 ["refresh_every", "wall s (compiles included)", "refreshes",
                                  "full-data loss after"],
                                 [[k, f"{x['wall_s']:.2f}", x["refreshes"],
                                   f"{x['full_loss']:.4f}"] for k, x in r["runs"].items()]))
    if "spiral" in sections:
        r = sections["spiral"]
        rows = [(f"{i + 1}, defaults", x) for i, x in enumerate(r["runs"])] + \
            [("sweep", x) for x in r.get("sweep", ())]
        blocks["spiral"] = md_table(
            ["run", "engine", "refresh_every", "wall s (500 updates, compiles included)",
             "of which setup s", "data's solve s (apart)", "refreshes", "loss first -> last"],
            [[run, x["engine"], x.get("refresh_every", 25), f"{x['wall_s']:.2f}",
              f"{x['setup_s']:.2f}", f"{x['data_s']:.2f}" if "data_s" in x else "in wall",
              x["refreshes"],
              f"{x['loss_first']:.3g} -> {x['loss_last']:.3g}"] for run, x in rows])
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
        out.append(target("DiffEqFlux spiral, 500 updates incl. compile / 2.7 s", "<=", 1,
                          {"float64": sections["spiral"]["median_wall_s"] / 2.7}))
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
