"""Stiff and high-order gradients: record-and-replay against Diffrax at matched
achieved accuracy (float64, a scalar loss of the final states).

- robertson: rodas5p (reverse, forward mode) and rosenbrock23 replay vs Kvaerno5;
- hires: rodas5p replay vs Kvaerno5, gradient w.r.t. the initial state;
- lorenz: vern7 (the in-kernel adjoint, which the router picks for it from n = 64, and
  the JAX replay) vs Dopri8;
- linear (d = 32): vern7 / tsit5 replay vs Dopri8 / Tsit5, against the closed form.

gradsolve's side is pinned, per row, to an engine: a method's name alone means the
general recorder and the `general_replay` engine, "vern7 (kernel_adjoint)" the fused
recorder and `kernel_adjoint`. Diffrax runs through `gs.engines.Diffrax(solver=...)`
with max_steps = its own attempted steps + 10%, reverse mode the faster of default
checkpoints and `checkpoints=max_steps`. Each side sweeps its own tolerances; ratios
are Diffrax time / gradsolve time at equal achieved error on each side's Pareto front.

    .venv/bin/python benchmarks/stiff_and_high_order.py [--quick] [--only hires]
"""

from _harness import (ROOT, cli, fmt, front, levels, log, md_table, overlap, ratio, run,
                      sum_squares, target, time_at, warm)

import gc  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402

import diffrax  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import scipy.linalg  # noqa: E402

import gradsolve as gs  # noqa: E402

LOOSE = 1e-4
RADAU = ROOT / "tests" / "data" / "stiff_references.json"
E = [1e-3, 1e-4, 1e-5, 1e-6, 1e-7, 1e-8, 1e-9, 1e-10]


def robertson_loss(ys, params):
    return jnp.sum(ys[:, 0] ** 2) + 1e4 * jnp.sum(ys[:, 1])


# Per problem: ours {method: (rtols, modes)}, theirs {Diffrax solver: (rtols, modes)},
# pairs (our method, mode, their solver, mode), the target (pair 0) and where it is read.
PROBLEMS = {
    "robertson": dict(
        build=gs.problems.robertson, loss=robertson_loss, loss_text="sum(y1**2) + 1e4 sum(y2)",
        wrt="params", keys=("k1", "k3"), atol=1e-4, error="componentwise", sizes=[8, 64, 256], quick_n=4,
        ours={"rodas5p": (E[:6], ("reverse", "forward")), "rosenbrock23": (E[:4], ("reverse",))},
        theirs={"Kvaerno5": ([1e-1, 1e-3, 1e-5, 1e-6], ("reverse", "forward"))},
        pairs=[("rodas5p", "reverse", "Kvaerno5", "reverse"),
               ("rodas5p", "forward", "Kvaerno5", "forward"),
               ("rosenbrock23", "reverse", "Kvaerno5", "reverse")],
        target=(3.0, "loose"), grad_ref=("rodas5p", 1e-10)),
    "hires": dict(
        build=gs.problems.hires, loss=sum_squares, loss_text="sum(ys**2)", wrt="y0", keys=None,
        atol=1e-4, error="componentwise", sizes=[8, 64, 256], quick_n=4,
        ours={"rodas5p": (E[:5], ("reverse",))},
        theirs={"Kvaerno5": ([1e-2, 1e-3, 1e-4, 1e-5], ("reverse",))},
        pairs=[("rodas5p", "reverse", "Kvaerno5", "reverse")],
        target=(4.0, "loose"), grad_ref=("rodas5p", 1e-10)),
    "lorenz": dict(
        build=gs.problems.lorenz, loss=sum_squares, loss_text="sum(ys**2)", wrt="params",
        keys=("sigma", "rho", "beta"), atol=1e-3, error="normwise", sizes=[1024], quick_n=16,
        ours={"vern7 (kernel_adjoint)": (E[1:], ("reverse",)), "vern7": (E[1:], ("reverse",))},
        theirs={"Dopri8": (E[1:], ("reverse",))},
        pairs=[("vern7 (kernel_adjoint)", "reverse", "Dopri8", "reverse"),
               ("vern7", "reverse", "Dopri8", "reverse")],
        target=(8.0, "overlap"), grad_ref=("vern7", 1e-12)),
    "linear": dict(
        build=lambda n: gs.problems.linear(n, d=32), loss=sum_squares, loss_text="sum(ys**2)",
        wrt="y0", keys=None, atol=1e-3, error="normwise", sizes=[256], quick_n=8,
        ours={m: (E[1::2], ("reverse",)) for m in ("vern7", "tsit5")},
        theirs={s: (E[1::2], ("reverse",)) for s in ("Dopri8", "Tsit5")},
        pairs=[("vern7", "reverse", "Dopri8", "reverse"), ("tsit5", "reverse", "Tsit5", "reverse"),
               ("vern7", "reverse", "Tsit5", "reverse")],
        target=None, grad_ref=None),
}


def state_error(kind, ys, ref):
    """componentwise: max |y - ref| / |ref| over everything (small species count);
    normwise: max over trajectories of max|y - ref| / max|ref|."""
    ys, ref = np.asarray(ys), np.asarray(ref)
    if kind == "componentwise":
        return float(np.max(np.abs(ys - ref) / np.abs(ref)))
    return float(np.max(np.max(np.abs(ys - ref), axis=1) / np.max(np.abs(ref), axis=1)))


def grad_error(g, gref, keys):
    """Largest over differentiated inputs of max|g - g_ref| / max|g_ref| (ensemble-wide)."""
    pairs = [(g[k], gref[k]) for k in keys] if keys else [(g, gref)]
    return max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))) / np.max(np.abs(np.asarray(b))))
               for a, b in pairs)


def references(name, spec, prob):
    """Final states and gradient to measure errors against."""
    if name == "linear":
        T = float(prob.t_span[1] - prob.t_span[0])
        y = gs.problems.linear_exact(prob, float(prob.t_span[1]))
        A, lam = np.asarray(prob.params["A"].value), np.asarray(prob.params["lam"])
        dL = np.asarray(jax.grad(lambda ys: spec["loss"](ys, None))(jnp.asarray(y)))
        return y, np.stack([scipy.linalg.expm(k * T * A).T @ c for k, c in zip(lam, dL)])
    method, tight = ("vern7", 1e-14) if name == "lorenz" else ("rodas5p", 1e-12)
    ys = gs.solve(prob, rtol=tight, atol=1e-16, method=method, max_steps=100000,
                  engine="general").raise_for_status().ys
    m, r = spec["grad_ref"]
    _, g = gs.value_and_grad(prob, spec["loss"], wrt=spec["wrt"], method=m, rtol=r,
                             atol=r * spec["atol"], max_steps=100000, engine="general_replay")()
    return np.asarray(ys), jax.tree.map(np.asarray, g)


def radau_check(name, spec):
    """The stiff reference recipe against the stored SciPy Radau states (componentwise)."""
    stored = json.loads(RADAU.read_text())
    ys, _ = references(name, spec, spec["build"](stored["n"]))
    return state_error("componentwise", ys, stored[name]["y1"])


def release():
    """A run compiles hundreds of functions; keeping them all exhausts the process's
    memory mappings (XLA CPU: "LLVM compilation error: Cannot allocate memory")."""
    jax.clear_caches()
    gc.collect()


def engine_of(key):
    """`(method, recorder, engine)` of an `ours` key: "vern7", or "vern7 (kernel_adjoint)"."""
    method, _, engine = key.partition(" (")
    engine = engine.rstrip(")") or "general_replay"
    return method, "fused" if engine == "kernel_adjoint" else "general", engine


def ours(prob, spec, key, rtol, modes, ref, gref, reps):
    method, recorder, engine = engine_of(key)
    kw = dict(rtol=rtol, atol=rtol * spec["atol"], method=method)
    mesh = gs.record(prob, recorder=recorder, **kw)
    p = {"rtol": rtol, "steps": f"{int(np.max(mesh.n_steps))}+{int(np.max(mesh.n_rejected))}",
         "record": warm(lambda: gs.record(prob, recorder=recorder, **kw).h, reps)["median_s"]}
    if not mesh.ok:
        return dict(p, failed=f"record failed: {mesh.summary()}")
    p["error"] = state_error(spec["error"], gs.replay(prob, mesh), ref)
    for mode in modes:
        vg = gs.value_and_grad(prob, spec["loss"], wrt=spec["wrt"], mode=mode, mesh=mesh,
                               engine=engine, **kw)
        p[mode] = warm(vg, reps)["median_s"]
        p.setdefault("grad_error", grad_error(vg()[1], gref, spec["keys"]))
    return p


def theirs(prob, spec, solver, rtol, modes, ref, gref, reps):
    kw = dict(rtol=rtol, atol=rtol * spec["atol"])
    engine = lambda **k: gs.engines.Diffrax(solver=getattr(diffrax, solver)(), **k)
    sol = gs.solve(prob, engine=engine(), max_steps=16384, **kw)
    acc, rej = np.asarray(sol.n_accepted), np.asarray(sol.n_rejected)
    p = {"rtol": rtol, "steps": f"{acc.max()}+{rej.max()}"}
    if not sol.ok:
        return dict(p, failed="Diffrax solve did not finish in 16384 steps")
    M = p["max_steps"] = int(math.ceil(np.max(acc + rej) * 1.1 / 16) * 16)
    p["error"] = state_error(spec["error"], sol.ys, ref)

    def grad(mode, eng):
        try:
            vg = gs.value_and_grad(prob, spec["loss"], wrt=spec["wrt"], mode=mode, engine=eng,
                                   max_steps=M, **kw)
            return warm(vg, reps)["median_s"], grad_error(vg()[1], gref, spec["keys"])
        except Exception as e:  # a failing Diffrax setting is a result, not a crash
            log(f"    Diffrax {solver} {mode} failed: {type(e).__name__}: {str(e)[:200]}")
            return None, None
    if "reverse" in modes:
        ckpt = {"default": grad("reverse", engine()),
                f"checkpoints={M}": grad("reverse", engine(checkpoints=M))}
        ok = {k: v for k, v in ckpt.items() if v[0]}
        if ok:
            p["setting"] = min(ok, key=lambda k: ok[k][0])
            p["reverse"], p["grad_error"] = ok[p["setting"]]
    if "forward" in modes:
        p["forward"], fwd_error = grad("forward", engine())
        p.setdefault("grad_error", fwd_error)
    return p


def reach(f):
    """Seconds to reach error <= 1e-4, and how: clamped = the loosest point is already
    below 1e-4 (its time, an upper bound)."""
    if not f or LOOSE < min(e for e, _ in f):
        return None, "unreachable"
    if LOOSE >= max(e for e, _ in f):
        return max(f)[1], "clamped"
    return time_at(f, LOOSE), ""


def compare(ours_pts, theirs_pts, mode_o, mode_t):
    a = front([(p.get("error"), p.get(mode_o)) for p in ours_pts])
    a_rec = front([(p.get("error"), p.get(mode_o) and p[mode_o] + p["record"]) for p in ours_pts])
    b = front([(p.get("error"), p.get(mode_t)) for p in theirs_pts])
    out = {"reach": {"ours": reach(a), "diffrax": reach(b)}, "overlap": overlap(a, b)}
    if out["overlap"]:
        row = lambda e: {"error": e, "ours_s": time_at(a, e), "diffrax_s": time_at(b, e),
                         "x": ratio(time_at(b, e), time_at(a, e)),
                         "x_incl_record": ratio(time_at(b, e), time_at(a_rec, e))}
        out["levels"] = [row(e) for e in levels(out["overlap"])]
        out["loose"] = row(min(max(LOOSE, out["overlap"][0]), out["overlap"][1]))
    return out


def pair_name(mo, so, mt, st):
    return (f"{mo}{' (forward mode)' if so == 'forward' else ''} vs Diffrax {mt} "
            + ("ForwardMode" if st == "forward" else "checkpointed"))


def measure_problem(name):
    spec = PROBLEMS[name]

    def measure(args):
        q = args.quick
        pick = lambda tols: [tols[0], tols[len(tols) // 2]] if q else tols
        out = {"settings": {side: {k: (pick(t), m) for k, (t, m) in spec[side].items()}
                            for side in ("ours", "theirs")}, "sizes": []}
        if name in ("robertson", "hires"):
            out["radau_check"] = radau_check(name, spec)
        for n in args.sizes or ([spec["quick_n"]] if q else spec["sizes"]):
            prob, reps = spec["build"](n), args.repeats or (2 if q else 5 if n <= 64 else 3)
            ref, gref = references(name, spec, prob)
            res = {"n": n, "ours": {}, "diffrax": {}}
            for side, fn, key in (("ours", ours, "ours"), ("theirs", theirs, "diffrax")):
                for method, (tols, modes) in out["settings"][side].items():
                    res[key][method] = []
                    for rtol in tols:
                        res[key][method].append(fn(prob, spec, method, rtol, modes, ref, gref, reps))
                        release()
            res["matched"] = {pair_name(*p): compare(res["ours"][p[0]], res["diffrax"][p[2]],
                                                     p[1], p[3]) for p in spec["pairs"]}
            for k, m in res["matched"].items():
                log(f"  {name} n={n} {k}: x at loose error {fmt(m.get('loose', {}).get('x'))}")
            out["sizes"].append(res)
        return out
    return measure


def reach_text(r):
    (to, ho), (td, hd) = r["ours"], r["diffrax"]
    if "unreachable" in (ho, hd):
        return "-: " + " and ".join(s for s, h in (("gradsolve", ho), ("Diffrax", hd))
                                    if h == "unreachable") + " never reaches 1e-4"
    if ho == hd == "clamped":
        return "n/a (both below 1e-4 at their loosest)"
    return fmt(td / to) + "".join(f" ({s} clamped)" for s, h in (("Diffrax", hd), ("ours", ho))
                                  if h == "clamped")


def render(sections):
    settings, matched, lin, lv, pts = [], [], [], [], []
    for name, s in sections.items():
        spec = PROBLEMS[name]
        sides = "; ".join(f"{k} rtol {{{', '.join(f'{r:g}' for r in t)}}} ({'/'.join(m)})"
                          for side in ("ours", "theirs") for k, (t, m) in s["settings"][side].items())
        settings.append(f"- **{name}** (n = {', '.join(str(r['n']) for r in s['sizes'])}): loss "
                        f"`{spec['loss_text']}`, gradient w.r.t. {spec['wrt']}; atol = rtol x "
                        f"{spec['atol']:g}; {spec['error']} error; {sides}"
                        + (f"; reference vs stored Radau: {s['radau_check']:.1e}"
                           if "radau_check" in s else "") + ".")
        for res in s["sizes"]:
            n = res["n"]
            for k, m in res["matched"].items():
                if not m["overlap"]:
                    matched.append([name, n, k, "no overlap", "-", "-", "-", reach_text(m["reach"])])
                    continue
                xs = [r["x"] for r in m["levels"]]
                matched.append([name, n, k, "{:.1e} .. {:.1e}".format(*m["overlap"]),
                                f"{fmt(m['loose']['x'])} at {m['loose']['error']:.1e}",
                                fmt(m["loose"]["x_incl_record"]),
                                f"{min(xs):.2f} .. {max(xs):.2f}", reach_text(m["reach"])])
                lv += [[name, n, k, f"{r['error']:.2e}", f"{r['ours_s']:.4f}",
                        f"{r['diffrax_s']:.4f}", fmt(r["x"])] for r in m["levels"]]
            for side, label in (("ours", "gradsolve"), ("diffrax", "Diffrax")):
                for method, points in res[side].items():
                    for p in points:
                        rev = fmt(p.get("reverse"), ".4f") + (f" ({p['setting']})" if "setting" in p else "")
                        pts.append([name, n, f"{label} {method}", f"{p['rtol']:.0e}", p["steps"],
                                    fmt(p.get("error"), ".1e"), fmt(p.get("record"), ".4f"), rev,
                                    fmt(p.get("forward"), ".4f"), fmt(p.get("grad_error"), ".1e"),
                                    p.get("failed", "")])
                        if name == "linear":
                            lin.append([n, f"{label} {method}", f"{p['rtol']:g}",
                                        fmt(p.get("error"), ".1e"), fmt(p.get("grad_error"), ".1e")])
    details = lambda title, t: f"<details><summary>{title}</summary>\n\n{t}\n\n</details>"
    return {
        "settings": "\n".join(settings),
        "matched": md_table(["problem", "n", "comparison", "error overlap", "x at loose error",
                             "x incl. record", "x across overlap", "x to reach err <= 1e-4"], matched),
        "linear": md_table(["n", "solver", "rtol", "state error vs closed form",
                            "gradient rel. error vs closed form"], lin),
        "details": details("Speed ratio at each matched error", md_table(
            ["problem", "n", "comparison", "matched error", "gradsolve s", "Diffrax s", "x"], lv))
        + "\n\n" + details("Every point (median seconds)", md_table(
            ["problem", "n", "solver", "rtol", "steps (acc+rej)", "state error", "record s",
             "reverse grad s", "forward grad s", "grad error", "note"], pts))}


def targets(sections):
    out = []
    for name, s in sections.items():
        if PROBLEMS[name]["target"] is None:
            continue
        bound, where = PROBLEMS[name]["target"]
        pair = pair_name(*PROBLEMS[name]["pairs"][0])
        values = {}
        for res in s["sizes"]:
            m = res["matched"][pair]
            if where == "loose":
                values[f"n={res['n']}"] = m.get("loose", {}).get("x")
            else:
                values[f"n={res['n']}, lowest over the overlap"] = min(
                    (r["x"] for r in m.get("levels", [])), default=None)
        what = f"{name.capitalize()} gradient, {pair}" + (", loose accuracy" if where == "loose" else "")
        out.append(target(what, ">=", bound, values))
    return out


if __name__ == "__main__":
    sections = {name: measure_problem(name) for name in PROBLEMS}
    run("stiff_and_high_order", sections, render, targets, cli(__doc__, sections))
