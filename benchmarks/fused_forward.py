"""Forward solves of the fused Warp engine against the general engine and Diffrax
(Tsit5, float64, rtol 1e-6, atol 1e-9), on the device Warp finds (here its CPU).

- sizes: Lorenz ensembles n = 2^10 ... 2^20; fused (one thread per core, and one
  thread: GRADSOLVE_CPU_THREADS=1), general, Diffrax under vmap (`engine="diffrax"`);
- recorders: `gs.record(recorder="fused")` vs `recorder="general"`;
- dims: `gs.problems.linear(n=1024, d=d)`, the fused kernel run directly (the router
  refuses it beyond its cutoff), its Warp compile time in fresh caches;
- spread: Lorenz with accepted steps from ~40 to ~400 per trajectory;
- translated: galactic_halo with `fused=True` (the translator writes its Warp form).

    .venv/bin/python benchmarks/fused_forward.py [--quick] [--only dims]
"""

import atexit
import os
import shutil
import tempfile

# Fresh kernel caches before anything initialises Warp, so that compile times are real.
import warp  # noqa: E402

_CACHES = tempfile.mkdtemp(prefix="bench_warp_"), tempfile.mkdtemp(prefix="bench_gs_")
warp.config.kernel_cache_dir, os.environ["GRADSOLVE_KERNEL_CACHE"] = _CACHES
for _dir in _CACHES:
    atexit.register(shutil.rmtree, _dir, ignore_errors=True)

from _harness import (cli, cpu_threads, fmt, log, md_table, ratio, run,  # noqa: E402
                      target, warm)

import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

import gradsolve as gs  # noqa: E402

TOL = dict(rtol=1e-6, atol=1e-9)
LABELS = {"fused": "fused", "fused_1thread": "fused, 1 thread", "general": "general",
          "diffrax": "Diffrax (vmap)"}


def fused_direct(prob):
    """The only private calls here (gradsolve.warp is being reworked: fix them in this
    one place): the fused kernel's compile, and its run whatever the router allows."""
    from gradsolve.config import make_config
    from gradsolve.warp import _fused
    cfg = make_config(prob, method="tsit5", **TOL)
    return (lambda: _fused.kernel_for(prob, gs.methods.get("tsit5"), np.float64),
            lambda: _fused.run_fused(prob, cfg))


def solvers(prob):
    return {"fused": lambda: gs.solve(prob, **TOL),
            "general": lambda: gs.solve(prob, engine="general", **TOL),
            "diffrax": lambda: gs.solve(prob, engine="diffrax", **TOL)}


def cpu_per_wall(fn):
    """Process CPU seconds per wall second of one call (~ threads kept busy)."""
    w, c = time.perf_counter(), time.process_time()
    jax.block_until_ready(fn())
    return (time.process_time() - c) / (time.perf_counter() - w)


def compare(prob, reps, skip=()):
    """Warm medians of each engine on one ensemble, and what they agree on."""
    fns, row = solvers(prob), {"n": prob.n, "us": {}}
    sols = {k: fn() for k, fn in fns.items() if k not in skip}
    if sols["fused"].engine != "fused":
        raise RuntimeError(f"the router chose {sols['fused'].engine!r}, not 'fused'")
    for k in sols:
        row["us"][k] = warm(fns[k], reps)["median_s"] / prob.n * 1e6
    steps, ref = np.asarray(sols["fused"].n_accepted), sols.get("general", sols["fused"])
    row["steps"] = {"min": int(steps.min()), "median": float(np.median(steps)),
                    "max": int(steps.max())}
    row["same_steps_as_general"] = bool(np.array_equal(steps, ref.n_accepted))
    row["max_abs_diff_vs_general"] = float(np.max(np.abs(sols["fused"].ys - ref.ys)))
    log(f"  n={prob.n}: " + ", ".join(f"{k} {v:.2f} us/traj" for k, v in row["us"].items()))
    return row


def sizes(args):
    rows, slow = [], set()
    for n in args.sizes or ([2 ** 8, 2 ** 10, 2 ** 12] if args.quick
                            else [2 ** k for k in (10, 12, 14, 16, 18, 20)]):
        reps = args.repeats or (3 if args.quick or n <= 2 ** 16 else 2 if n <= 2 ** 18 else 1)
        prob = gs.problems.lorenz(n)
        row = compare(prob, reps, skip=slow)
        with cpu_threads(1):
            row["us"]["fused_1thread"] = warm(solvers(prob)["fused"], reps)["median_s"] / n * 1e6
        row["fused_cpu_per_wall"] = cpu_per_wall(solvers(prob)["fused"])
        slow |= {k for k, us in row["us"].items() if us * n * 1e-6 > 20.0}  # skip larger n
        rows.append(row)
    return {"rows": rows}


def recorders(args):
    rows = []
    for n in [2 ** 8, 2 ** 10] if args.quick else [2 ** 10, 2 ** 14, 2 ** 16]:
        prob, row = gs.problems.lorenz(n), {"n": n}
        mesh = {r: gs.record(prob, recorder=r, **TOL) for r in ("fused", "general")}
        for r in mesh:
            row[r] = warm(lambda: gs.record(prob, recorder=r, **TOL).h,
                          args.repeats or 3)["median_s"]
        f, g = mesh["fused"], mesh["general"]
        cols = min(f.columns, g.columns)
        row["same_n_steps"] = bool(np.array_equal(f.n_steps, g.n_steps))
        row["same_n_rejected"] = bool(np.array_equal(f.n_rejected, g.n_rejected))
        row["h_max_rel_diff"] = float(np.max(np.abs(np.asarray(f.h)[:, :cols] - np.asarray(
            g.h)[:, :cols])) / np.max(np.abs(np.asarray(g.h))))
        rows.append(row)
    return {"rows": rows}


def dims(args):
    rows, n = [], 256 if args.quick else 1024
    for d in [2, 8, 128] if args.quick else [2, 4, 8, 16, 32, 64, 128]:
        prob = gs.problems.linear(n=n, d=d)
        build, fused = fused_direct(prob)
        t = time.perf_counter()
        build()
        row = {"d": d, "warp_compile_s": time.perf_counter() - t,
               "fused_s": warm(lambda: fused().y, args.repeats or 5)["median_s"],
               "general": warm(solvers(prob)["general"], args.repeats or 5),
               "steps": int(np.max(fused().n_accepted))}
        try:
            gs.solve(prob, engine="fused", **TOL)
            row["router_allows_fused"] = True
        except ValueError:
            row["router_allows_fused"] = False
        log(f"  d={d}: general / fused {row['general']['median_s'] / row['fused_s']:.2f}")
        rows.append(row)
    return {"n": n, "rows": rows}


def spread(args):
    n = 2 ** 10 if args.quick else 2 ** 14
    return compare(gs.problems.lorenz(n, rho=(0.5, 100.0), t_span=(0.0, 5.0)), args.repeats or 3)


def translated(args):
    base = gs.problems.galactic_halo(2 ** 10 if args.quick else 2 ** 14)
    prob = gs.EnsembleProblem(base.f_jax, base.y0, base.params, base.t_span,
                              name="galactic_halo", fused=True)
    return compare(prob, args.repeats or 3)


def pow2(n):
    return f"2^{int(np.log2(n))}"


def engine_table(row):
    return md_table(["engine", "median s", "us/traj", "x vs fused"],
                    [[LABELS[k], f"{us * row['n'] * 1e-6:.4f}", fmt(us),
                      fmt(ratio(us, row["us"]["fused"]))]
                     for k, us in row["us"].items()])


def steps_line(row):
    s = row["steps"]
    return (f"Accepted steps per trajectory: min {s['min']}, median {s['median']:.0f}, max "
            f"{s['max']}; same as the general engine's: {'yes' if row['same_steps_as_general'] else 'no'}"
            f"; final states within {row['max_abs_diff_vs_general']:.1e} of general's.\n\n")


def render(sections):
    out = {}
    if "sizes" in sections:
        out["sizes"] = md_table(
            ["n", "steps"] + [f"{v} us/traj" for v in LABELS.values()]
            + ["Diffrax / fused", "general / fused", "1 thread / fused", "fused CPU s / wall s",
               "max abs diff fused vs general"],
            [[pow2(r["n"]), r["steps"]["max"]] + [fmt(r["us"].get(k)) for k in LABELS]
             + [fmt(ratio(r["us"].get(k), r["us"]["fused"]))
                for k in ("diffrax", "general", "fused_1thread")]
             + [fmt(r["fused_cpu_per_wall"]), f"{r['max_abs_diff_vs_general']:.1e}"]
             for r in sections["sizes"]["rows"]])
    if "recorders" in sections:
        yn = lambda b: "yes" if b else "no"
        out["recorders"] = md_table(
            ["n", "fused record s", "general record s", "general / fused", "same n_steps",
             "same n_rejected", "max h diff (rel.)"],
            [[pow2(r["n"]), f"{r['fused']:.4f}", f"{r['general']:.4f}",
              fmt(r["general"] / r["fused"]), yn(r["same_n_steps"]), yn(r["same_n_rejected"]),
              f"{r['h_max_rel_diff']:.1e}"] for r in sections["recorders"]["rows"]])
    if "dims" in sections:
        s = sections["dims"]
        out["dims"] = f"n = {s['n']}.\n\n" + md_table(
            ["d", "steps", "Warp compile s", "fused run ms", "general run ms",
             "general first call s", "general / fused", "router allows fused"],
            [[r["d"], r["steps"], f"{r['warp_compile_s']:.2f}", f"{r['fused_s'] * 1e3:.2f}",
              f"{r['general']['median_s'] * 1e3:.2f}", f"{r['general']['first_call_s']:.2f}",
              fmt(r["general"]["median_s"] / r["fused_s"]),
              "yes" if r["router_allows_fused"] else "no"] for r in s["rows"]])
    for name in ("spread", "translated"):
        if name in sections:
            out[name] = (f"n = {pow2(sections[name]['n'])}. " + steps_line(sections[name])
                         + engine_table(sections[name]))
    return out


def targets(sections):
    rows = [r for r in sections.get("sizes", {}).get("rows", []) if r["n"] == 2 ** 16]
    return [target("Fused forward solve vs Diffrax (vmap), Lorenz", ">=", 5,
                   {"n=2^16": ratio(r["us"].get("diffrax"), r["us"]["fused"]) for r in rows})]


if __name__ == "__main__":
    sections = {"sizes": sizes, "recorders": recorders, "dims": dims, "spread": spread,
                "translated": translated}
    run("fused_forward", sections, render, targets, cli(__doc__, sections))
