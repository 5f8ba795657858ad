"""Gradient of a Lorenz ensemble (Tsit5, float64): record-and-replay against Diffrax.

`gs.problems.lorenz(n)` (rho over [10, 20], y0 = (1, 0, 0), t in [0, 1]), loss
`sum(ys ** 2)` of the final states, gradient w.r.t. (sigma, rho, beta) of every
trajectory. Per n and rtol (atol = rtol * 1e-3), warm medians of: `gs.record`; the
replay forward pass; the replay gradient in reverse and in forward mode; Diffrax's
`RecursiveCheckpointAdjoint` (the faster of default checkpoints and one checkpoint
per step, max_steps M) and `ForwardMode`. Error of the final states: max over
trajectories of max|y - y_ref| / max|y_ref|, y_ref from the general engine at
rtol 1e-13; ratios are also taken at matched achieved error over the rtol sweep.

    .venv/bin/python benchmarks/grad_vs_diffrax.py [--quick] [--sizes 8,128]
"""

from _harness import (cli, fmt, levels, log, md_table, overlap, run, sum_squares as loss,
                      target, time_at, warm)

import jax  # noqa: E402  (after _harness, which turns float64 on)
import numpy as np  # noqa: E402

import gradsolve as gs  # noqa: E402

MAIN_RTOL, ATOL_FACTOR, MAX_STEPS = 1e-6, 1e-3, 256


def error(ys, ref):
    ys, ref = np.asarray(ys), np.asarray(ref)
    return float(np.max(np.max(np.abs(ys - ref), axis=1) / np.max(np.abs(ref), axis=1)))


def point(prob, ref, rtol, repeats):
    kw = dict(rtol=rtol, atol=rtol * ATOL_FACTOR)
    mesh = gs.record(prob, **kw)
    replay = jax_replay(prob, mesh)
    grad = lambda **k: warm(gs.value_and_grad(prob, loss, **k), repeats)["median_s"]
    dfx = lambda **k: grad(max_steps=MAX_STEPS, **kw, **k)
    ckpt = {"default": dfx(engine=gs.engines.Diffrax()),
            f"checkpoints={MAX_STEPS}": dfx(engine=gs.engines.Diffrax(checkpoints=MAX_STEPS))}
    best = min(ckpt, key=ckpt.get)
    p = {"rtol": rtol, "S": mesh.columns,
         "record": warm(lambda: gs.record(prob, **kw).h, repeats)["median_s"],
         "replay_forward": warm(replay, repeats)["median_s"],
         "replay_reverse": grad(mesh=mesh, engine="fused_replay"),
         "replay_forward_mode": grad(mesh=mesh, mode="forward", engine="fused_replay"),
         "diffrax_checkpoint": ckpt[best], "diffrax_setting": best, "diffrax_settings": ckpt,
         "diffrax_forward_mode": dfx(engine="diffrax", mode="forward"),
         "error_replay": error(replay(), ref),
         "error_diffrax": error(gs.solve(prob, engine="diffrax", max_steps=MAX_STEPS, **kw)
                                .raise_for_status().ys, ref)}
    log(f"  n={prob.n} rtol={rtol:g}: rev x{p['diffrax_checkpoint'] / p['replay_reverse']:.2f}"
        f", fwd x{p['diffrax_forward_mode'] / p['replay_forward_mode']:.2f}")
    return p


def jax_replay(prob, mesh):
    fwd = jax.jit(lambda params: gs.replay(prob, mesh, params=params))
    return lambda: fwd(prob.params)


def matched(points):
    """Ratios at equal achieved error, log(time) interpolated in log(error) on each
    side's sweep: four levels across the errors both sides reach, and the replay's
    error at rtol 1e-6."""
    side = lambda err, key: [(p[err], p[key]) for p in points]
    span = overlap(side("error_replay", "S"), side("error_diffrax", "S"))
    if span is None:
        return []
    main = main_point(points)["error_replay"]
    at = levels(span) + ([main] if span[0] <= main <= span[1] else [])
    x = lambda e, ours, theirs: (time_at(side("error_diffrax", theirs), e)
                                 / time_at(side("error_replay", ours), e))
    return sorted(({"error": e, "main": e == main,
                    "reverse": x(e, "replay_reverse", "diffrax_checkpoint"),
                    "forward": x(e, "replay_forward_mode", "diffrax_forward_mode")}
                   for e in at), key=lambda r: r["error"])


def measure(args):
    sizes = args.sizes or ([8, 128] if args.quick else [8, 128, 1024, 8192])
    tols = [1e-4, 1e-6, 1e-8] if args.quick else [1e-4, 1e-5, 1e-6, 1e-7, 1e-8]
    out = []
    for n in sizes:
        prob = gs.problems.lorenz(n=n)
        ref = gs.solve(prob, rtol=1e-13, atol=1e-15, engine="general").raise_for_status().ys
        reps = args.repeats or (3 if args.quick or n > 1024 else 7)
        points = [point(prob, ref, r, reps) for r in tols]
        out.append({"n": n, "repeats": reps, "points": points, "matched": matched(points)})
    return {"tols": tols, "max_steps": MAX_STEPS, "sizes": out}


def main_point(points):
    return next(p for p in points if p["rtol"] == MAIN_RTOL)


def render(sections):
    s = sections["lorenz"]
    main = []
    for row in s["sizes"]:
        p = main_point(row["points"])
        main.append([row["n"], p["S"]] + [f"{p[k]:.4f}" for k in (
            "record", "replay_forward", "replay_reverse", "replay_forward_mode")]
            + [f"{p['diffrax_checkpoint']:.4f} ({p['diffrax_setting']})",
               f"{p['diffrax_forward_mode']:.4f}",
               fmt(p["diffrax_checkpoint"] / p["replay_reverse"]),
               fmt(p["diffrax_checkpoint"] / (p["replay_reverse"] + p["record"])),
               fmt(p["diffrax_forward_mode"] / p["replay_forward_mode"]),
               fmt(p["replay_reverse"] / p["replay_forward"])])
    head = ["n", "S", "record", "replay fwd pass", "replay rev grad", "replay fwd grad",
            "Diffrax ckpt grad (setting)", "Diffrax ForwardMode", "rev x",
            "rev x incl. record", "fwd x", "rev grad / fwd pass"]
    matched_rows = [[row["n"], f"{m['error']:.2e}", fmt(m["reverse"]), fmt(m["forward"]),
                     "replay error at rtol 1e-6" if m["main"] else ""]
                    for row in s["sizes"] for m in row["matched"]]
    return {"main": md_table(head, main),
            "matched": f"Tolerances swept: rtol in {{{', '.join(f'{t:g}' for t in s['tols'])}}}"
                       f"; Diffrax max_steps = {s['max_steps']}.\n\n"
                       + md_table(["n", "matched error", "rev x", "fwd x", "note"],
                                  matched_rows)}


def targets(sections):
    if "lorenz" not in sections:
        return []
    pts = {r["n"]: main_point(r["points"]) for r in sections["lorenz"]["sizes"]}
    pick = lambda f, ns=None: {f"n={n}": f(p) for n, p in pts.items() if ns is None or n in ns}
    return [
        target("Lorenz gradient, reverse replay vs Diffrax checkpointed", ">=", 8,
               pick(lambda p: p["diffrax_checkpoint"] / p["replay_reverse"], (1024, 8192))),
        target("Lorenz gradient, forward-mode replay vs Diffrax ForwardMode", ">=", 6,
               pick(lambda p: p["diffrax_forward_mode"] / p["replay_forward_mode"])),
        target("Lorenz, replay reverse gradient / replay forward pass", "<=", 4,
               pick(lambda p: p["replay_reverse"] / p["replay_forward"]))]


if __name__ == "__main__":
    args = cli(__doc__, {"lorenz": measure})
    run("grad_vs_diffrax", {"lorenz": measure}, render, targets, args)
