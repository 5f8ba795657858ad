"""The in-kernel adjoint (`engine="kernel_adjoint"`) against the JAX replay and Diffrax.

Lorenz (`gs.problems.lorenz(n)`, Tsit5, rtol 1e-6, atol 1e-9, float64, loss
`sum(ys ** 2)` of the final states, gradient w.r.t. every trajectory's parameters):
warm medians of the kernel_adjoint gradient, the fused_replay and general_replay
gradients (the JAX replay of each recorder's mesh), Diffrax's checkpointed adjoint (the
faster of its default checkpoints and one per step, max_steps 256), the fused forward
solve of the same ensemble, and the fused record (timed apart; also reported
included). Neural: a 2-D neural ODE `y' = MLP(y)` (width 64, depth 2, tanh, in
`gs.Shared`; rtol 1e-3, atol 1e-6 as Diffrax's neural ODE example), time per gradient of
a batch of B trajectories on t in [0, 2], kernel_adjoint against fused_replay and
Diffrax (Tsit5, checkpointed). Stiff: Rosenbrock23 on Robertson and HIRES (rtol 1e-5),
against the JAX replay of the same mesh and Diffrax's Kvaerno5.

    .venv/bin/python benchmarks/kernel_adjoint.py [--quick] [--sizes 8,128]
"""

from _harness import (fmt, front, levels, log, main, md_table, overlap, sum_squares as loss,
                      target, time_at, timed_fit, warm, xla_bytes)

import tracemalloc  # noqa: E402
from unittest import mock  # noqa: E402

import diffrax  # noqa: E402
import equinox as eqx  # noqa: E402
import jax  # noqa: E402  (after _harness, which turns float64 on)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import gradsolve as gs  # noqa: E402
from gradsolve.fields import _neural  # noqa: E402
from gradsolve.warp import _jax  # noqa: E402

RTOL, ATOL, MAX_STEPS = 1e-6, 1e-9, 256
KVAERNO5 = gs.engines.Diffrax(solver=diffrax.Kvaerno5(), checkpoints=4096)


def _grad_time(prob, repeats, **kw):
    vg = gs.value_and_grad(prob, loss, **kw)
    return warm(vg, repeats)["median_s"], vg


def _diffrax(prob, repeats, **kw):
    settings = {"default": gs.engines.Diffrax(),
                f"checkpoints={MAX_STEPS}": gs.engines.Diffrax(checkpoints=MAX_STEPS)}
    times = {k: _grad_time(prob, repeats, engine=e, max_steps=MAX_STEPS, **kw)[0]
             for k, e in settings.items()}
    best = min(times, key=times.get)
    return times[best], best


def lorenz(args):
    sizes = args.sizes or ([8, 128] if args.quick else [8, 32, 128, 256, 1024, 8192])
    rows = []
    for n in sizes:
        prob = gs.problems.lorenz(n=n)
        reps = args.repeats or (3 if args.quick or n > 1024 else 7)
        kw = dict(rtol=RTOL, atol=ATOL)
        ka, vg = _grad_time(prob, reps, engine="kernel_adjoint", **kw)
        # The same kernels, their host calls traced through jax.pure_callback.
        with mock.patch.object(_jax, "default_bridge", lambda: "callback"):
            callback = _grad_time(prob, reps, engine="kernel_adjoint", mesh=vg.mesh, **kw)[0]
        row = {"n": n, "repeats": reps, "S": vg.mesh.columns, "kernel_adjoint": ka,
               "kernel_adjoint_callback": callback,
               "fused_replay": _grad_time(prob, reps, engine="fused_replay", mesh=vg.mesh, **kw)[0],
               "general_replay": _grad_time(prob, reps, engine="general_replay", **kw)[0],
               "record": warm(lambda: gs.record(prob, recorder="fused", **kw).h, reps)["median_s"],
               "fused_solve": warm(lambda: gs.solve(prob, engine="fused", **kw).ys, reps)["median_s"]}
        row["diffrax"], row["diffrax_setting"] = _diffrax(prob, reps, **kw)
        log(f"  n={n}: kernel_adjoint {ka * 1e3:.2f} ms, Diffrax x{row['diffrax'] / ka:.2f}, "
            f"fused_replay x{row['fused_replay'] / ka:.2f}, / fused solve "
            f"{ka / row['fused_solve']:.2f}")
        rows.append(row)
    return {"rtol": RTOL, "atol": ATOL, "max_steps": MAX_STEPS, "sizes": rows}


def stiff(args):
    """Rosenbrock23 on Robertson and HIRES: kernel_adjoint against the JAX replay of the
    same mesh and Diffrax's Kvaerno5 at the same tolerances (not matched accuracy:
    stiff_and_high_order.py has that comparison for the JAX replay)."""
    sizes = args.sizes or ([8, 128] if args.quick else [8, 128, 1024])
    rows = []
    for name in ("robertson", "hires"):
        for n in sizes:
            prob = getattr(gs.problems, name)(n=n)
            reps = args.repeats or 3
            kw = dict(rtol=1e-5, atol=1e-9)
            ka, vg = _grad_time(prob, reps, engine="kernel_adjoint", method="rosenbrock23", **kw)
            row = {"field": name, "n": n, "repeats": reps, "S": vg.mesh.columns,
                   "kernel_adjoint": ka,
                   "fused_replay": _grad_time(prob, reps, engine="fused_replay",
                                              mesh=vg.mesh, **kw)[0]}
            row["diffrax"] = _grad_time(prob, reps, engine=KVAERNO5, max_steps=4096, **kw)[0]
            log(f"  {name} n={n}: kernel_adjoint {ka * 1e3:.2f} ms, fused_replay "
                f"x{row['fused_replay'] / ka:.2f}, Diffrax Kvaerno5 x{row['diffrax'] / ka:.2f}")
            rows.append(row)
    return {"method": "rosenbrock23", "rtol": 1e-5, "atol": 1e-9, "rows": rows}


def _memory(vg, prob):
    """`(XLA temporaries, host peak)` in bytes of one gradient call: the compiled
    function's memory analysis, and Python's traced allocations during the call (the
    in-kernel adjoint's NumPy buffers: the stored states, the per-trajectory rows)."""
    temp = xla_bytes(vg, getattr(vg, "mesh", None), prob.params, prob.y0)["temp"]
    tracemalloc.start()
    jax.block_until_ready(vg())
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return temp, peak


def _neural_robertson(B):
    """`gs.problems.neural_robertson` with its last layer's weights at 0.05 (not zero:
    the MLP's term then reaches the states)."""
    prob = gs.problems.neural_robertson(n=B)
    last = lambda p: p["mlp"].value.layers[-1].weight
    return prob.replace(params=eqx.tree_at(last, prob.params, jnp.full((1, 16), 0.05)))


def neural_stiff(args):
    """`gs.problems.neural_robertson` (an MLP 3 -> 16 -> 16 -> 1 in the autocatalytic
    rate), Rosenbrock23 at the recipe's rtol 1e-6, atol 1e-10, t in [0, 100], B
    reactors: time and memory per gradient."""
    batches = [32] if args.quick else [32, 128, 512]
    rows = []
    for B in batches:
        prob = _neural_robertson(B)
        reps = args.repeats or 3
        kw = dict(method="rosenbrock23", rtol=1e-6, atol=1e-10)
        ka, vg = _grad_time(prob, reps, engine="kernel_adjoint", **kw)
        row = {"B": B, "repeats": reps, "S": vg.mesh.columns, "kernel_adjoint": ka,
               "memory": {"kernel_adjoint": _memory(vg, prob)}}
        for name, extra in (("replay", {}), ("replay_remat", {"remat": True})):
            t, v = _grad_time(prob, reps, engine="fused_replay", mesh=vg.mesh, **kw, **extra)
            row[name], row["memory"][name] = t, _memory(v, prob)
        row["diffrax"], v = _grad_time(prob, reps, engine=KVAERNO5, max_steps=4096, rtol=1e-6,
                                       atol=1e-10)
        row["memory"]["diffrax"] = _memory(v, prob)
        log(f"  B={B}: kernel_adjoint {ka * 1e3:.1f} ms, replay x{row['replay'] / ka:.2f}, "
            f"remat x{row['replay_remat'] / ka:.2f}, Diffrax x{row['diffrax'] / ka:.2f}; "
            f"memory (MB) " + ", ".join(f"{k} {sum(m) / 1e6:.1f}" for k, m in row["memory"].items()))
        rows.append(row)
    return {"rtol": 1e-6, "atol": 1e-10, "batches": rows}


def spiral_fit(args):
    """Training the width-64 neural spiral (one Calibrator fit on B trajectories, data
    from the true field at 8 times in [0, 2], Adam 3e-3, rtol 1e-3, atol 1e-6): time
    per update (T(25) - T(5)) / 20 of warm fits, and the loss after 25 updates, for
    kernel_adjoint, fused_replay and Diffrax (Tsit5, checkpointed)."""
    batches = [32] if args.quick else [32, 256]
    ts = jnp.linspace(0.25, 2.0, 8)
    rows = []
    for B in batches:
        prob = gs.problems.neural_spiral(B, width=64, depth=2, t_span=(0.0, 2.0))
        truth = prob.replace(f_jax=_neural.spiral_f, params=None, fused=False)
        data = gs.solve(truth, rtol=1e-10, atol=1e-12, ts=ts).ys[None]
        theta0 = jax.tree.map(lambda x: x[None] if eqx.is_array(x) else x, prob.params["net"].value)
        row = {"B": B}
        for side, engine in (("kernel_adjoint", "kernel_adjoint"), ("fused_replay", "fused_replay"),
                             ("diffrax", gs.engines.Diffrax())):
            cal = gs.Calibrator(prob, lambda ys, net, obs: jnp.mean((ys - obs) ** 2),
                                to_params=lambda net: {"net": gs.Shared(net)}, data=data, ts=ts,
                                rtol=1e-3, atol=1e-6, optimizer=optax.adam(3e-3), engine=engine)
            timed_fit(cal, theta0, 5), timed_fit(cal, theta0, 25)  # compile both
            t5, t25 = (np.median([timed_fit(cal, theta0, n)[0] for _ in range(3)]) for n in (5, 25))
            row[side] = float((t25 - t5) / 20)
            row[f"loss_{side}"] = float(timed_fit(cal, theta0, 25)[1].loss[0])
        log(f"  B={B}: per update kernel_adjoint {row['kernel_adjoint'] * 1e3:.1f} ms, "
            f"fused_replay {row['fused_replay'] * 1e3:.1f} ms, Diffrax {row['diffrax'] * 1e3:.1f} ms")
        rows.append(row)
    return {"batches": rows}


def _final_error(ys, ref):
    ys, ref = np.asarray(ys), np.asarray(ref)
    return float(np.max(np.abs(ys - ref) / np.max(np.abs(ref), axis=0)))


def neural_matched(args):
    """The neural Robertson gradient at matched achieved accuracy, B = 128: each side
    sweeps its tolerances (kernel_adjoint with Rosenbrock23, Diffrax with Kvaerno5),
    error = max over reactors and species of |y(100) - y_ref| / max|y_ref| of that
    species (y_ref: Rodas5P at rtol 1e-11), and log(time) is interpolated in log(error)
    on each side at errors both reach."""
    B = 32 if args.quick else 128
    prob = _neural_robertson(B)
    ref = gs.solve(prob, method="rodas5p", rtol=1e-11, atol=1e-14, engine="general").ys
    reps = args.repeats or 3
    sides = {"kernel_adjoint": [], "diffrax": []}
    # Each side's own range: second-order Rosenbrock23 needs tight tolerances for the
    # errors fifth-order Kvaerno5 reaches at loose ones.
    for rtol in (1e-4, 1e-5, 1e-6, 1e-7):
        kw = dict(rtol=rtol, atol=rtol * 1e-4)
        t, vg = _grad_time(prob, reps, engine="kernel_adjoint", method="rosenbrock23", **kw)
        ys = gs.replay(prob, vg.mesh, engine="kernel_adjoint")
        sides["kernel_adjoint"].append((_final_error(ys, ref), t, rtol))
        log(f"  rtol {rtol:g}: kernel_adjoint err {sides['kernel_adjoint'][-1][0]:.1e}, "
            f"{t * 1e3:.1f} ms")
    for rtol in (1e-2, 1e-3, 1e-4, 1e-5):
        kw = dict(rtol=rtol, atol=rtol * 1e-4)
        t = _grad_time(prob, reps, engine=KVAERNO5, max_steps=4096, **kw)[0]
        sol = gs.solve(prob, engine=gs.engines.Diffrax(solver=diffrax.Kvaerno5()),
                       max_steps=4096, **kw)
        sides["diffrax"].append((_final_error(sol.ys, ref), t, rtol))
        log(f"  rtol {rtol:g}: Kvaerno5 err {sides['diffrax'][-1][0]:.1e}, {t * 1e3:.1f} ms")
    fronts = {k: front([(e, t) for e, t, _ in v]) for k, v in sides.items()}
    span = overlap(fronts["kernel_adjoint"], fronts["diffrax"])
    matched = [] if span is None else [
        {"error": e, "ratio": time_at(fronts["diffrax"], e) / time_at(fronts["kernel_adjoint"], e)}
        for e in levels(span)]
    return {"B": B, "sweeps": sides, "matched": matched}


def neural(args):
    batches = [32] if args.quick else [32, 256]
    rows = []
    for B in batches:
        prob = gs.problems.neural_spiral(B, width=64, depth=2, t_span=(0.0, 2.0))
        reps = args.repeats or 5
        kw = dict(rtol=1e-3, atol=1e-6)
        ka, vg = _grad_time(prob, reps, engine="kernel_adjoint", **kw)
        row = {"B": B, "repeats": reps, "S": vg.mesh.columns, "kernel_adjoint": ka,
               "fused_replay": _grad_time(prob, reps, engine="fused_replay", mesh=vg.mesh, **kw)[0]}
        row["diffrax"], row["diffrax_setting"] = _diffrax(prob, reps, **kw)
        log(f"  B={B}: kernel_adjoint {ka * 1e3:.2f} ms, Diffrax x{row['diffrax'] / ka:.2f}, "
            f"fused_replay x{row['fused_replay'] / ka:.2f}")
        rows.append(row)
    return {"width": 64, "depth": 2, "rtol": 1e-3, "atol": 1e-6, "batches": rows}


def render(sections):
    out = {}
    if "lorenz" in sections:
        rows = [[r["n"], r["S"], f"{r['kernel_adjoint']:.4f}",
                 f"{r['kernel_adjoint_callback']:.4f}" if "kernel_adjoint_callback" in r else "-",
                 f"{r['fused_replay']:.4f}",
                 f"{r['general_replay']:.4f}", f"{r['diffrax']:.4f} ({r['diffrax_setting']})",
                 f"{r['fused_solve']:.4f}", f"{r['record']:.4f}",
                 fmt(r["diffrax"] / r["kernel_adjoint"]),
                 fmt(r["diffrax"] / (r["kernel_adjoint"] + r["record"])),
                 fmt(r["fused_replay"] / r["kernel_adjoint"]),
                 fmt(r["general_replay"] / r["kernel_adjoint"]),
                 fmt(r["kernel_adjoint"] / r["fused_solve"])]
                for r in sections["lorenz"]["sizes"]]
        out["lorenz"] = md_table(
            ["n", "S", "kernel_adjoint s", "ka via pure_callback s", "fused_replay s",
             "general_replay s",
             "Diffrax ckpt s (setting)", "fused solve s", "record s", "Diffrax / ka",
             "Diffrax / (ka + record)", "fused_replay / ka", "general_replay / ka",
             "ka / fused solve"], rows)
    if "stiff" in sections:
        rows = [[r["field"], r["n"], r["S"], f"{r['kernel_adjoint']:.4f}",
                 f"{r['fused_replay']:.4f}", f"{r['diffrax']:.4f}",
                 fmt(r["fused_replay"] / r["kernel_adjoint"]),
                 fmt(r["diffrax"] / r["kernel_adjoint"])] for r in sections["stiff"]["rows"]]
        out["stiff"] = md_table(["field", "n", "S", "kernel_adjoint s", "fused_replay s",
                                 "Diffrax Kvaerno5 s", "fused_replay / ka", "Diffrax / ka"],
                                rows)
    if "spiral_fit" in sections:
        rows = [[r["B"], f"{r['kernel_adjoint'] * 1e3:.2f}", f"{r['fused_replay'] * 1e3:.2f}",
                 f"{r['diffrax'] * 1e3:.2f}", fmt(r["diffrax"] / r["kernel_adjoint"]),
                 fmt(r["diffrax"] / r["fused_replay"]),
                 f"{r['loss_kernel_adjoint']:.4g} / {r['loss_fused_replay']:.4g} / "
                 f"{r['loss_diffrax']:.4g}"] for r in sections["spiral_fit"]["batches"]]
        out["spiral_fit"] = md_table(
            ["B", "kernel_adjoint ms/update", "fused_replay ms/update", "Diffrax ms/update",
             "Diffrax / ka", "Diffrax / fused_replay",
             "loss after 25 updates (ka / fused_replay / Diffrax)"], rows)
    if "neural_matched" in sections:
        m = sections["neural_matched"]
        sweep = [[side, f"{r:g}", f"{e:.1e}", f"{t:.4f}"] for side in ("kernel_adjoint", "diffrax")
                 for e, t, r in m["sweeps"][side]]
        out["neural_matched"] = (
            f"B = {m['B']}; atol = rtol 1e-4; `diffrax` is Kvaerno5.\n\n"
            + md_table(["side", "rtol", "final-state error", "gradient s"], sweep)
            + "\n\n" + md_table(["matched error", "Diffrax / ka"],
                                  [[f"{r['error']:.2e}", fmt(r["ratio"])] for r in m["matched"]]))
    if "neural_stiff" in sections:
        mb = lambda r, k: f"{sum(r['memory'][k]) / 1e6:.1f}"
        rows = [[r["B"], r["S"], f"{r['kernel_adjoint']:.4f}", f"{r['replay']:.4f}",
                 f"{r['replay_remat']:.4f}", f"{r['diffrax']:.4f}",
                 fmt(r["replay"] / r["kernel_adjoint"]), fmt(r["diffrax"] / r["kernel_adjoint"]),
                 mb(r, "kernel_adjoint"), mb(r, "replay"), mb(r, "replay_remat"), mb(r, "diffrax"),
                 fmt(sum(r["memory"]["replay"]) / sum(r["memory"]["kernel_adjoint"]))]
                for r in sections["neural_stiff"]["batches"]]
        out["neural_stiff"] = md_table(
            ["B", "S", "kernel_adjoint s", "JAX replay s", "JAX replay, remat s",
             "Diffrax Kvaerno5 s", "replay / ka", "Diffrax / ka", "ka MB", "replay MB",
             "remat MB", "Diffrax MB", "replay MB / ka MB"], rows)
    if "neural" in sections:
        rows = [[r["B"], r["S"], f"{r['kernel_adjoint']:.4f}", f"{r['fused_replay']:.4f}",
                 f"{r['diffrax']:.4f} ({r['diffrax_setting']})",
                 fmt(r["diffrax"] / r["kernel_adjoint"]),
                 fmt(r["fused_replay"] / r["kernel_adjoint"])]
                for r in sections["neural"]["batches"]]
        out["neural"] = md_table(["B", "S", "kernel_adjoint s", "fused_replay s",
                                  "Diffrax ckpt s (setting)", "Diffrax / ka",
                                  "fused_replay / ka"], rows)
    return out


def targets(sections):
    out = []
    if "lorenz" in sections:
        rows = sections["lorenz"]["sizes"]
        out += [target("Lorenz gradient, kernel_adjoint vs Diffrax checkpointed, n >= 128",
                       ">=", 10, {f"n={r['n']}": r["diffrax"] / r["kernel_adjoint"]
                                  for r in rows if r["n"] >= 128}),
                target("Lorenz, kernel_adjoint gradient / fused forward solve", "<=", 3,
                       {f"n={r['n']}": r["kernel_adjoint"] / r["fused_solve"] for r in rows})]
    if "neural_stiff" in sections:
        rows = sections["neural_stiff"]["batches"]
        out += [target("Neural Robertson, JAX replay memory / kernel_adjoint memory, B = 128",
                       ">=", 100, {f"B={r['B']}": sum(r["memory"]["replay"])
                                   / sum(r["memory"]["kernel_adjoint"])
                                   for r in rows if r["B"] == 128}),
                target("Neural Robertson, kernel_adjoint gradient vs Diffrax Kvaerno5", ">=", 2,
                       {f"B={r['B']}": r["diffrax"] / r["kernel_adjoint"] for r in rows})]
    if "neural_matched" in sections:
        m = sections["neural_matched"]
        out.append(target(f"Neural Robertson gradient vs Diffrax Kvaerno5, matched accuracy, "
                          f"B = {m['B']}", ">=", 2,
                          {f"err={r['error']:.1e}": r["ratio"] for r in m["matched"]}))
    if "spiral_fit" in sections:
        out.append(target("Neural spiral training, time per update, kernel_adjoint vs Diffrax",
                          ">=", 3, {f"B={r['B']}": r["diffrax"] / r["kernel_adjoint"]
                                    for r in sections["spiral_fit"]["batches"]}))
    if "neural" in sections:
        out.append(target("Neural ODE (width 64, depth 2), kernel_adjoint gradient vs Diffrax",
                          ">=", 3, {f"B={r['B']}": r["diffrax"] / r["kernel_adjoint"]
                                    for r in sections["neural"]["batches"]}))
    return out


SECTIONS = {"lorenz": lorenz, "stiff": stiff, "neural": neural, "spiral_fit": spiral_fit,
            "neural_stiff": neural_stiff, "neural_matched": neural_matched}

if __name__ == "__main__":
    main("kernel_adjoint", __doc__, SECTIONS, render, targets)
