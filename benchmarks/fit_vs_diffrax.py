"""Fitting benchmark: time per optimizer update of `gs.Calibrator` on the replay
engine against the same loop on Diffrax gradients.

Fits (from the recipes' `build(B, K)`, same data, optimizer, transform and solver
settings on both sides):

1. Lorenz rho (`recipes/lorenz_rho.py`): K = 4 trajectories per fit, final states
   observed, `optax.adam(0.3)`, Tsit5, rtol 1e-6, atol 1e-9.
2. Galactic halo flattening q (`recipes/galactic_halo.py`): K = 4, positions at
   ts = (2.5, 5, 7.5, 10), `optax.adam(0.05)`, `Bounded(0.5, 1.2)`, Tsit5, rtol 1e-6,
   atol 1e-9.
3. (optional, `--problems ...,robertson`) Robertson k1, k3 (`recipes/robertson_rates.py`):
   K = 3, the replay engine's stiff method (Rodas5P or Rosenbrock23, reported)
   against Diffrax Kvaerno5 (Diffrax has no Rosenbrock method, so the two sides do
   NOT run the same method here), rtol 1e-7, atol 1e-11.

Sides: `gs.Calibrator(..., engine=None)` (the router picks a replay engine,
"general_replay" or, for a registered field, "fused_replay" -- the engine used is
reported; `--replay-engine NAME` forces one: record once, then every update
differentiates the JAX replay of that mesh) and
`gs.Calibrator(..., engine="diffrax")` (every update differentiates an adaptive
Diffrax solve with `RecursiveCheckpointAdjoint`, default checkpoints, the
Calibrator's default max_steps). No mesh refresh (`refresh_every=None`), no drift
check, no convergence test (`tol=None, grad_tol=None`): every fit runs all updates.

Protocol (per fit problem and B): each side's `fit(theta0, steps=N)` is called once
untimed for N = N1 and N = N2 (the Calibrator compiles one update function per
`steps`, as its history array is `(steps, B)`), then, `--repeats` times, alternating
the two sides, `fit(theta0, steps=N1)` and `fit(theta0, steps=N2)` are timed. Time
per update = (median T(N2) - median T(N1)) / (N2 - N1): the initial record, the
optimizer init and the rest of the setup cancel. The record at theta0 (the replay
engine's recorder, as `fit` calls it) is timed apart and reported; so is the whole
warm fit of N2 updates (record included, compile excluded), for a second ratio.
Agreement: after N2 updates, the largest relative difference |theta_replay -
theta_diffrax| / |theta_diffrax| over fits and parameters (the two sides
differentiate slightly different meshes).

Outputs: a table on stdout, `benchmarks/results/fit_vs_diffrax.json` (raw times,
settings, machine, versions) and the section between `<!-- fit_vs_diffrax:start -->`
and `<!-- fit_vs_diffrax:end -->` in `docs/benchmarks.md`.

Run (from the repository root):

    .venv/bin/python benchmarks/fit_vs_diffrax.py            # full run, ~10-15 min
    .venv/bin/python benchmarks/fit_vs_diffrax.py --quick    # smoke test, writes nothing

Options: `--sizes 1,8,64`, `--problems lorenz,galactic[,robertson]`,
`--robertson-sizes 1,8`, `--n1 N1 --n2 N2`, `--repeats R`, `--out PATH`,
`--docs PATH` (`--out ''` / `--docs ''` to skip writing).
"""

import jax

jax.config.update("jax_enable_x64", True)

import argparse  # noqa: E402
import datetime  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import optax  # noqa: E402

import gradsolve as gs  # noqa: E402
# Shared helpers (benchmarks/ is on sys.path when run as a script). Import these
# BEFORE the recipes: both folders have a `_common` module, and the recipes only use
# theirs in `main()`, which is never called here.
from _common import save  # noqa: E402
from grad_vs_diffrax import (display_path, log, machine, md_table,  # noqa: E402
                             text_table, versions)

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT / "recipes"))
import galactic_halo  # noqa: E402
import lorenz_rho  # noqa: E402
import robertson_rates  # noqa: E402

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "fit_vs_diffrax.json"
DEFAULT_DOCS = ROOT / "docs" / "benchmarks.md"
START, END = "<!-- fit_vs_diffrax:start -->", "<!-- fit_vs_diffrax:end -->"
SECTION_TITLE = "## Fitting loop vs Diffrax (Calibrator, time per update)"
TARGET = 3.0                       # diffrax / replay per-update time, Lorenz and galactic
TARGET_PROBLEMS = ("lorenz", "galactic")


def _diffrax_kvaerno5():
    import diffrax
    return gs.engines.Diffrax(solver=diffrax.Kvaerno5())


# name -> how to build the fit; `cal` are the Calibrator settings common to both sides.
PROBLEMS = {
    "lorenz": {
        "title": "Lorenz rho", "module": lorenz_rho, "K": 4,
        "cal": lambda: {"optimizer": optax.adam(0.3)},
        "describe": "recipes/lorenz_rho.py: adam(0.3), Tsit5, rtol 1e-6, atol 1e-9, "
                    "final states observed",
        "diffrax": lambda: "diffrax", "diffrax_label": "Diffrax Tsit5"},
    "galactic": {
        "title": "Galactic halo q", "module": galactic_halo, "K": 4,
        "cal": lambda: {"optimizer": optax.adam(0.05), "ts": galactic_halo.TS,
                        "transform": {"q": gs.transforms.Bounded(0.5, 1.2)}},
        "describe": "recipes/galactic_halo.py: adam(0.05), Bounded(0.5, 1.2), Tsit5, "
                    "rtol 1e-6, atol 1e-9, 4 observation times",
        "diffrax": lambda: "diffrax", "diffrax_label": "Diffrax Tsit5"},
    "robertson": {
        "title": "Robertson k1, k3", "module": robertson_rates, "K": 3,
        "cal": lambda: {"optimizer": optax.adam(0.05, b1=0.5, b2=0.9),
                        "ts": robertson_rates.TS, "rtol": 1e-7, "atol": 1e-11,
                        "transform": gs.transforms.Positive()},
        "describe": "recipes/robertson_rates.py: adam(0.05, b1=0.5, b2=0.9), Positive, "
                    "rtol 1e-7, atol 1e-11, 6 observation times; replay with the method "
                    "the engine picks (see the table) vs Diffrax Kvaerno5 (Diffrax has "
                    "no Rosenbrock method: the two sides do not run the same method)",
        "diffrax": _diffrax_kvaerno5, "diffrax_label": "Diffrax Kvaerno5"},
}


# ---------------------------------------------------------------------- measurements

def timed_fit(cal, theta0, steps):
    """Seconds of one `fit(theta0, steps)` (every update runs) and its result."""
    t = time.perf_counter()
    res = cal.fit(theta0, steps=steps, tol=None, grad_tol=None, progress=False)
    jax.block_until_ready(res.theta)
    elapsed = time.perf_counter() - t
    if res.updates != steps or not np.all(np.asarray(res.steps) == steps):
        raise RuntimeError(f"{cal.engine}: expected {steps} updates per fit, got "
                           f"{res.updates} (per fit {np.asarray(res.steps).tolist()}, "
                           f"status {np.asarray(res.status).tolist()})")
    return elapsed, res


def full_params(to_params, theta0, B, K):
    """Per-trajectory parameters of the ensemble at theta0 (what `fit` records at)."""
    per_fit = jax.vmap(to_params)(theta0)
    return jax.tree.map(lambda x: x.reshape((B * K,) + x.shape[2:]), per_fit)


def time_record(prob, cal, params, repeats):
    """The record `fit` starts with (the Calibrator's engine's recorder, its settings,
    at theta0): first call, warm median."""
    engine = gs.engines.ENGINES[cal.engine]

    def once():
        t = time.perf_counter()
        mesh = engine.record(prob, cal.config, params=params)
        jax.block_until_ready(mesh.h)
        return time.perf_counter() - t, mesh
    first, mesh = once()
    times = [once()[0] for _ in range(repeats)]
    steps = np.asarray(mesh.n_steps)
    return {"median_s": float(np.median(times)), "times_s": times, "first_call_s": first,
            "columns": int(mesh.columns), "accepted_max": int(steps.max()),
            "accepted_min": int(steps.min()), "ok": bool(mesh.ok)}


def theta_rel_diff(a, b):
    """max over fits and leaves of |a - b| / |b|."""
    return float(max(np.max(np.abs(np.asarray(x) - np.asarray(y)) / np.abs(np.asarray(y)))
                     for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))))


def measure(name, B, n1, n2, repeats, replay_engine=None):
    spec = PROBLEMS[name]
    K = spec["K"]
    t0 = time.perf_counter()
    prob, to_params, loss, data, theta0, truth = spec["module"].build(B, K)[:6]
    build_s = time.perf_counter() - t0
    sides = {
        "replay": gs.Calibrator(prob, loss, to_params=to_params, data=data,
                                engine=replay_engine, refresh_every=None, **spec["cal"]()),
        "diffrax": gs.Calibrator(prob, loss, to_params=to_params, data=data,
                                 engine=spec["diffrax"](), refresh_every=None,
                                 **spec["cal"]()),
    }
    out = {"B": B, "K": K, "n": prob.n, "n1": n1, "n2": n2, "build_s": build_s,
           "engines": {s: c.engine for s, c in sides.items()},
           "methods": {"replay": sides["replay"].config.method,
                       "diffrax": spec["diffrax_label"]}}
    if not gs.engines.ENGINES[sides["replay"].engine].records:
        raise RuntimeError(f"replay side got {sides['replay'].engine!r}, which records "
                           "no mesh")

    # Compile: one untimed fit per steps value and side.
    compile_s = {}
    for s, cal in sides.items():
        compile_s[s] = {str(n): timed_fit(cal, theta0, n)[0] for n in (n1, n2)}
    out["first_call_s"] = compile_s
    log(f"  {name} B={B}: built in {build_s:.1f} s; first (compiling) calls "
        + ", ".join(f"{s} {v[str(n1)]:.1f}+{v[str(n2)]:.1f} s"
                    for s, v in compile_s.items()))

    out["record"] = time_record(prob, sides["replay"], full_params(to_params, theta0, B, K),
                                repeats)

    raw = {s: {"n1_s": [], "n2_s": []} for s in sides}
    results = {}
    for _ in range(repeats):
        for s, cal in sides.items():          # alternate sides: share the machine's noise
            raw[s]["n1_s"].append(timed_fit(cal, theta0, n1)[0])
            t, results[s] = timed_fit(cal, theta0, n2)
            raw[s]["n2_s"].append(t)
    for s in sides:
        m1, m2 = float(np.median(raw[s]["n1_s"])), float(np.median(raw[s]["n2_s"]))
        raw[s].update(median_n1_s=m1, median_n2_s=m2, per_update_s=(m2 - m1) / (n2 - n1),
                      per_update_each_repeat_s=[(b - a) / (n2 - n1) for a, b in
                                                zip(raw[s]["n1_s"], raw[s]["n2_s"])])
    out["timing"] = raw
    rep, dfx = raw["replay"], raw["diffrax"]
    out["speedup_per_update"] = dfx["per_update_s"] / rep["per_update_s"]
    out["speedup_whole_fit_n2"] = dfx["median_n2_s"] / rep["median_n2_s"]
    # Alternative estimate: the N2 fit less the record, over N2 (setup not cancelled).
    out["replay_per_update_minus_record_s"] = (
        (rep["median_n2_s"] - out["record"]["median_s"]) / n2)
    out["theta"] = {s: jax.tree.map(lambda x: np.asarray(x).tolist(), r.theta)
                    for s, r in results.items()}
    out["truth"] = jax.tree.map(lambda x: np.asarray(x).tolist(), truth)
    out["final_loss"] = {s: np.asarray(r.loss).tolist() for s, r in results.items()}
    out["theta_max_rel_diff"] = theta_rel_diff(results["replay"].theta,
                                               results["diffrax"].theta)
    log(f"    record {out['record']['median_s'] * 1e3:.2f} ms; per update: replay "
        f"{rep['per_update_s'] * 1e3:.3f} ms, diffrax {dfx['per_update_s'] * 1e3:.3f} ms "
        f"-> x{out['speedup_per_update']:.2f} (whole {n2}-update fit incl. record "
        f"x{out['speedup_whole_fit_n2']:.2f}); theta max rel diff "
        f"{out['theta_max_rel_diff']:.1e}  [{time.perf_counter() - t0:.0f} s]")
    return out


# ------------------------------------------------------------------------- reporting

def rows(results):
    out = []
    for name, per_b in results.items():
        for B, r in per_b.items():
            t = r["timing"]
            out.append([
                PROBLEMS[name]["title"],
                f"{r['engines']['replay']} ({r['methods']['replay']})",
                r["methods"]["diffrax"], str(B), str(r["n"]),
                str(r["record"]["columns"]),
                f"{r['record']['median_s'] * 1e3:.2f}",
                f"{t['replay']['per_update_s'] * 1e3:.3f}",
                f"{t['diffrax']['per_update_s'] * 1e3:.3f}",
                f"{r['speedup_per_update']:.2f}", f"{r['speedup_whole_fit_n2']:.2f}",
                f"{r['theta_max_rel_diff']:.1e}", f"{r['n1']}, {r['n2']}"])
    head = ["fit", "replay engine (method)", "Diffrax solver", "B", "trajectories",
            "mesh S", "record ms",
            "replay ms/update", "Diffrax ms/update", "x per update", "x whole fit",
            "theta rel diff", "N1, N2"]
    return head, out


def verdicts(results, sizes):
    out = {}
    for name in TARGET_PROBLEMS:
        per_b = results.get(name)
        if not per_b:
            continue
        met = [f"B={B}: {r['speedup_per_update']:.2f}x" for B, r in per_b.items()
               if r["speedup_per_update"] >= TARGET]
        missed = [f"B={B}: {r['speedup_per_update']:.2f}x" for B, r in per_b.items()
                  if r["speedup_per_update"] < TARGET]
        status = "met" if not missed else ("missed" if not met else "partly met")
        text = (f"{PROBLEMS[name]['title']} fit, Diffrax / replay time per update >= "
                f"{TARGET:g}x at B in {{{', '.join(map(str, per_b))}}}: {status} "
                f"({'; '.join(met + missed)})")
        out[name] = {"target": f">= {TARGET:g}", "status": status, "met": met,
                     "missed": missed, "text": text}
    return out


def markdown(report, command, out_path):
    s = report["settings"]
    m, v = report["machine"], report["versions"]
    lines = [
        SECTION_TITLE, "",
        "The same `gs.Calibrator` loop (B concurrent Optax fits, K trajectories each) with "
        "gradients from the replay of one recorded mesh (`engine=None`: the router's "
        "replay engine and method, in the table) or from Diffrax (`engine=\"diffrax\"`: "
        "`RecursiveCheckpointAdjoint` through the adaptive solve at every update, "
        "default checkpoints, max_steps "
        f"{s['max_steps']}). Same data, optimizer, transform and tolerances on both sides "
        "(the recipes' `build(B, K)`); no mesh refresh (`refresh_every=None`), no "
        "convergence test (`tol=None, grad_tol=None`), so every fit runs every update; "
        "float64, CPU.", "",
        "Time per update = (median T(N2) - median T(N1)) / (N2 - N1), T(N) the wall "
        "time of a warm `fit(theta0, steps=N)`, median of "
        f"{s['repeats']} repeats, sides alternated: compilation (one untimed call per "
        "`steps`) is excluded, and the initial record and setup cancel. The record "
        "at theta0 (the replay engine's recorder, as `fit` calls it) is timed apart "
        "(record ms). x per update = Diffrax / "
        "replay time per update; x whole fit = Diffrax / replay wall time of the warm "
        "N2-update fit, replay's record included. theta rel diff: max over fits of "
        "|theta_replay - theta_Diffrax| / |theta_Diffrax| after N2 updates (the two "
        "differentiate slightly different meshes).", "",
        md_table(*rows(report["results"])), "",
        "Fits: " + "; ".join(f"{PROBLEMS[p]['title']}: {PROBLEMS[p]['describe']}, K = "
                             f"{PROBLEMS[p]['K']}" for p in report["results"]) + ".", "",
        "### Targets", "",
    ]
    lines += [f"- {t['text']}." for t in report["verdicts"].values()]
    lines += [
        "", f"Machine: {m['cpu_model']} ({m['cpu_count']} CPUs, {m['memory_gib']} GiB), "
        f"{m['platform']}; jax {v['jax']}, diffrax {v['diffrax']}, optax "
        f"{report['optax']}, gradsolve {v['gradsolve']} (commit {v['git_commit']}"
        + (", with uncommitted changes under src/" if v["src_uncommitted_changes"] else "")
        + f"); {report['date']}. The machine was shared with other work during the run: "
        "read single ratios loosely.", "",
        f"Reproduce: `{command}`"
        + (f" (raw numbers: `{display_path(out_path)}`)." if out_path else "."),
    ]
    return "\n".join(lines)


# ------------------------------------------------------------------------------ main

def parse_list(text, kind):
    return [kind(x) for x in text.split(",") if x.strip()]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default=None, help="B values (default 1,8,64)")
    ap.add_argument("--problems", default="lorenz,galactic",
                    help="lorenz,galactic[,robertson] (default lorenz,galactic)")
    ap.add_argument("--robertson-sizes", default="1,8", help="B values for robertson")
    ap.add_argument("--robertson-n", default="5,45",
                    help="N1,N2 for robertson (its Diffrax updates are slow; default 5,45)")
    ap.add_argument("--n1", type=int, default=None, help="short fit (default 20)")
    ap.add_argument("--n2", type=int, default=None, help="long fit (default 220)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--replay-engine", default=None,
                    help="replay side's engine (default: None, the router's choice)")
    ap.add_argument("--quick", action="store_true",
                    help="smoke test: B 1,8, n1 5, n2 25, writes nothing unless "
                         "--out/--docs are given")
    ap.add_argument("--out", default=None, help=f"JSON path (default {DEFAULT_OUT})")
    ap.add_argument("--docs", default=None, help=f"Markdown path (default {DEFAULT_DOCS})")
    args = ap.parse_args(argv)

    sizes = parse_list(args.sizes, int) if args.sizes else ([1, 8] if args.quick
                                                            else [1, 8, 64])
    problems = parse_list(args.problems, str)
    for p in problems:
        if p not in PROBLEMS:
            raise SystemExit(f"unknown problem {p!r}; choose from {sorted(PROBLEMS)}")
    n1 = args.n1 or (5 if args.quick else 20)
    n2 = args.n2 or (25 if args.quick else 220)
    if not n2 > n1 >= 1:
        raise SystemExit("need n2 > n1 >= 1")
    out = args.out if args.out is not None else ("" if args.quick else str(DEFAULT_OUT))
    docs = args.docs if args.docs is not None else ("" if args.quick else str(DEFAULT_DOCS))
    command = " ".join([".venv/bin/python", "benchmarks/fit_vs_diffrax.py"] + sys.argv[1:])

    log(f"fit_vs_diffrax: problems {problems}, B {sizes}, updates N1={n1}, N2={n2}, "
        f"{args.repeats} repeats")
    env = versions()
    t_start = time.perf_counter()
    results = {}
    for name in problems:
        bs = parse_list(args.robertson_sizes, int) if name == "robertson" else sizes
        ns = parse_list(args.robertson_n, int) if name == "robertson" else (n1, n2)
        results[name] = {}
        for B in bs:
            results[name][B] = measure(name, B, *ns, args.repeats, args.replay_engine)

    from gradsolve.config import DEFAULT_MAX_STEPS
    report = {
        "benchmark": "fit_vs_diffrax",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command,
        "settings": {
            "problems": {p: PROBLEMS[p]["describe"] + f", K = {PROBLEMS[p]['K']}"
                         for p in problems},
            "sizes": sizes, "n1": n1, "n2": n2, "repeats": args.repeats,
            "robertson_sizes": parse_list(args.robertson_sizes, int),
            "robertson_n1_n2": parse_list(args.robertson_n, int),
            "replay_engine": args.replay_engine or "router (engine=None)",
            "refresh_every": None, "drift_every": None, "tol": None, "grad_tol": None,
            "max_steps": DEFAULT_MAX_STEPS,
            "diffrax_adjoint": "RecursiveCheckpointAdjoint, default checkpoints",
            "dtype": "float64",
            "per_update": "(median T(n2) - median T(n1)) / (n2 - n1), T(N) = warm "
                          "fit(theta0, steps=N) wall time; compile excluded (one untimed "
                          "call per steps value), record and setup cancel",
            "record": "the replay engine's record at theta0 with the Calibrator's "
                      "settings (as fit calls it), warm median",
            "quick": args.quick},
        "machine": machine(), "versions": env, "optax": optax.__version__,
        "total_wall_s": None, "results": results,
    }
    report["verdicts"] = verdicts(results, sizes)
    report["total_wall_s"] = time.perf_counter() - t_start

    head, body = rows(results)
    log("\nTime per optimizer update (x = Diffrax / replay)\n" + text_table(head, body))
    log("\nTargets:\n" + "\n".join(f"- {t['text']}" for t in report["verdicts"].values()))
    log(f"\ntotal {report['total_wall_s']:.0f} s")
    save(report, out, docs, lambda: markdown(report, command, out), START, END, log)
    return report


if __name__ == "__main__":
    main()
