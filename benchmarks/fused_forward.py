"""Forward-solve benchmark of the fused Warp engine against the general engine and
Diffrax (Tsit5, float64, rtol 1e-6, atol 1e-9), on Warp's CPU device.

Five measurements (median of warm repeats; one untimed first call compiles and is
excluded; per-trajectory time = median / n):

1. Lorenz ensemble `gs.problems.lorenz(n)` (rho in [10, 20], t in [0, 1]) for
   n = 2^10 ... 2^20: `gs.solve(prob)` (the router's `fused`), the same with the
   thread pool cut to one thread (`gradsolve.warp._runtime.run_split` replaced by
   `lambda fn, n: fn(0, n)`, one launch over the whole ensemble), `engine="general"`,
   and Diffrax under `vmap` (the Diffrax engine's own solve function, jitted once:
   `eqx.filter_jit(gs.engines.ENGINES["diffrax"]._solve_fn(...))`; the time of
   `gs.solve(engine="diffrax")` as called, which goes through the engine's cache of
   compiled solves, is measured apart at a few sizes). Once one call of an engine takes
   longer than `--max-call-s` (20 s), its larger sizes are skipped.
2. The recorders: `gs.record(prob, recorder="fused")` vs `recorder="general"`, and
   whether both give the same accepted / rejected step counts and step sizes.
3. State dimension: `gs.problems.linear(n=1024, d=d)`, d = 2 ... 128, through
   `gradsolve.warp._fused.run_fused` directly (the router refuses fused for d > 8 on
   the CPU):
   the Warp kernel's compile time (`_fused.kernel_for`, the codegen plus Warp's
   build, in a fresh cache: this script points `GRADSOLVE_KERNEL_CACHE` and
   `warp.config.kernel_cache_dir` at new temporary folders before Warp initialises,
   and checks that each d adds a new module to Warp's cache), its run time, and the
   general engine's run time and first (compiling) call.
4. A spread-difficulty Lorenz ensemble (rho in [0.5, 100], t in [0, 5]: accepted
   steps from ~40 to ~400): fused vs general vs Diffrax at n = 2^14.
5. A translated field: `gs.problems.galactic_halo` with `fused=True` (no hand-written
   form; the translator writes it), fused vs general vs Diffrax at the same n.

Outputs: tables on stdout, `benchmarks/results/fused_forward.json` and the section
between `<!-- fused_forward:start -->` and `<!-- fused_forward:end -->` in
`docs/benchmarks.md`.

Run (from the repository root):

    .venv/bin/python benchmarks/fused_forward.py            # full run, ~10-20 min
    .venv/bin/python benchmarks/fused_forward.py --quick    # smoke test, writes nothing

Options: `--sizes`, `--record-sizes`, `--dims`, `--dim-n`, `--spread-n`,
`--max-call-s`, `--repeats`, `--out PATH`, `--docs PATH` (`''` skips writing).
"""

import atexit
import os
import shutil
import tempfile

import jax

jax.config.update("jax_enable_x64", True)

# Fresh kernel caches, before anything initialises Warp, so compile times are real.
import warp  # noqa: E402

_WARP_CACHE = tempfile.mkdtemp(prefix="fused_forward_warp_")
_GS_CACHE = tempfile.mkdtemp(prefix="fused_forward_gs_")
warp.config.kernel_cache_dir = _WARP_CACHE
os.environ["GRADSOLVE_KERNEL_CACHE"] = _GS_CACHE
atexit.register(shutil.rmtree, _WARP_CACHE, ignore_errors=True)
atexit.register(shutil.rmtree, _GS_CACHE, ignore_errors=True)

import argparse  # noqa: E402
import contextlib  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import diffrax  # noqa: E402
import equinox as eqx  # noqa: E402
import numpy as np  # noqa: E402

import gradsolve as gs  # noqa: E402
from gradsolve import methods  # noqa: E402
from gradsolve.config import make_config  # noqa: E402
from gradsolve.engines import ENGINES, FUSED_MAX_D  # noqa: E402

CPU_MAX_D = FUSED_MAX_D["cpu"]  # the router's cutoff on Warp's cpu device
from gradsolve.warp import _fused, _runtime  # noqa: E402

from _common import save, write_docs  # noqa: E402
from grad_vs_diffrax import (display_path, log, machine, md_table, text_table,  # noqa: E402
                             timeit_warm, versions)


ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "fused_forward.json"
DEFAULT_DOCS = ROOT / "docs" / "benchmarks.md"
START, END = "<!-- fused_forward:start -->", "<!-- fused_forward:end -->"
SECTION_TITLE = "## Fused forward solve (Warp kernel) vs general and Diffrax"

RTOL, ATOL = 1e-6, 1e-9
SPREAD = {"rho": (0.5, 100.0), "t_span": (0.0, 5.0)}
TARGET_N, TARGET_X = 2 ** 16, 5.0
ENGINE_LABELS = {"fused": "fused", "fused_1thread": "fused, 1 thread",
                 "general": "general", "diffrax": "Diffrax (vmap)"}


# --------------------------------------------------------------------------- helpers

@contextlib.contextmanager
def one_thread():
    """The fused engines with one Warp launch over the whole ensemble (no pool)."""
    saved = _runtime.run_split
    _runtime.run_split = lambda fn, n: fn(0, n)
    try:
        yield
    finally:
        _runtime.run_split = saved


def diffrax_fn(prob):
    """Diffrax under vmap exactly as `gs.solve(engine="diffrax")` runs it, but jitted
    once so that warm calls reuse the compiled program."""
    cfg = make_config(prob, rtol=RTOL, atol=ATOL, method="tsit5")
    run = eqx.filter_jit(ENGINES["diffrax"]._solve_fn(
        prob, cfg, diffrax.RecursiveCheckpointAdjoint(), None, throw=False))
    return lambda: run(prob.params, prob.y0)


def diffrax_ok(result):
    """Every trajectory of a vmapped Diffrax solve succeeded."""
    return bool(np.all(np.asarray(result == diffrax.RESULTS.successful)))


def cpu_per_wall(fn):
    """Process CPU seconds per wall second of one call (~ threads actually busy)."""
    w, c = time.perf_counter(), time.process_time()
    jax.block_until_ready(fn())
    w, c = time.perf_counter() - w, time.process_time() - c
    return c / w if w > 0 else None


def timed(fn, repeats):
    out = timeit_warm(fn, repeats)
    out["first_call_s"] = float(out["first_call_s"])
    return out


def fmt_us(x):
    return "-" if x is None else (f"{x:.1f}" if x >= 10 else f"{x:.2f}")


def fmt_x(x):
    return "-" if x is None else f"{x:.2f}"


def max_diff(a, b):
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b))))


def warp_cache_entries():
    """Modules in Warp's kernel cache (Warp adds a version folder under the
    configured one at init, and `warp.config.kernel_cache_dir` then names it)."""
    root = warp.config.kernel_cache_dir
    return set(os.listdir(root)) if root and os.path.isdir(root) else set()


# ------------------------------------------------------------------ 1. Lorenz sizes

def lorenz_sizes(sizes, repeats_for, max_call_s, solve_diffrax_sizes):
    results, skipped_from = {}, {}
    runners = {
        "fused": lambda prob: (lambda: gs.solve(prob, rtol=RTOL, atol=ATOL)),
        "fused_1thread": lambda prob: (lambda: gs.solve(prob, rtol=RTOL, atol=ATOL)),
        "general": lambda prob: (lambda: gs.solve(prob, rtol=RTOL, atol=ATOL,
                                                  engine="general")),
        "diffrax": diffrax_fn,
    }
    for n in sizes:
        prob = gs.problems.lorenz(n)
        row = {"n": n, "repeats": repeats_for(n), "engines": {}}
        finals = {}
        for name, make in runners.items():
            if name in skipped_from:
                row["engines"][name] = {"skipped": f"a call at n={skipped_from[name][0]} "
                                        f"took {skipped_from[name][1]:.1f} s > {max_call_s} s"}
                log(f"  n={n} {name}: skipped")
                continue
            fn = make(prob)
            ctx = one_thread() if name == "fused_1thread" else contextlib.nullcontext()
            with ctx:
                t = timed(fn, repeats_for(n))
                res = fn()
                if name.startswith("fused"):
                    t["cpu_per_wall"] = cpu_per_wall(fn)
            if name.startswith("fused") and res.engine != "fused":
                raise RuntimeError(f"router chose {res.engine!r}, not 'fused'")
            if name == "diffrax":
                ys, result, stats = res
                ok = diffrax_ok(result)
                finals[name] = (np.asarray(ys), np.asarray(stats["num_accepted_steps"]))
            else:
                ok = res.ok
                finals[name] = (np.asarray(res.ys), np.asarray(res.n_accepted))
            if not ok:
                raise RuntimeError(f"{name} failed at n={n}")
            t["us_per_traj"] = t["median_s"] / n * 1e6
            row["engines"][name] = t
            extra = (f", cpu/wall {t['cpu_per_wall']:.2f}" if "cpu_per_wall" in t else "")
            log(f"  n={n} {name}: {t['median_s']:.4f} s ({t['us_per_traj']:.2f} us/traj; "
                f"first call {t['first_call_s']:.2f} s{extra})")
            if max(t["median_s"], max(t["times_s"])) > max_call_s:
                skipped_from[name] = (n, max(t["times_s"]))
        if n in solve_diffrax_sizes:
            t = timed(lambda: gs.solve(prob, rtol=RTOL, atol=ATOL, engine="diffrax").ys, 2)
            t["us_per_traj"] = t["median_s"] / n * 1e6
            row["diffrax_as_called"] = t
            log(f"  n={n} gs.solve(engine='diffrax') as called: {t['median_s']:.3f} s")
        ref_ys, ref_steps = finals.get("general", next(iter(finals.values())))
        row["checks"] = {
            f"{k}_vs_general_max_abs_diff": max_diff(v[0], ref_ys) for k, v in finals.items()}
        row["checks"]["same_accepted_steps"] = {k: bool(np.array_equal(v[1], ref_steps))
                                                for k, v in finals.items()}
        row["accepted_steps_max"] = int(ref_steps.max())
        row["ratios"] = ratios(row)
        results[n] = row
    return results


def ratios(row):
    e = row["engines"]
    med = lambda k: e.get(k, {}).get("median_s")
    div = lambda a, b: (med(a) / med(b)) if med(a) and med(b) else None
    return {"diffrax_over_fused": div("diffrax", "fused"),
            "general_over_fused": div("general", "fused"),
            "fused_1thread_over_fused": div("fused_1thread", "fused"),
            "diffrax_over_general": div("diffrax", "general")}


# ---------------------------------------------------------------------- 2. recorders

def recorders(sizes, repeats_for):
    out = {}
    for n in sizes:
        prob = gs.problems.lorenz(n)
        row = {"n": n, "repeats": repeats_for(n)}
        meshes = {}
        for rec in ("fused", "general"):
            fn = lambda rec=rec: gs.record(prob, rtol=RTOL, atol=ATOL, recorder=rec).h
            row[rec] = timed(fn, repeats_for(n))
            row[rec]["us_per_traj"] = row[rec]["median_s"] / n * 1e6
            meshes[rec] = gs.record(prob, rtol=RTOL, atol=ATOL, recorder=rec)
        f, g = meshes["fused"], meshes["general"]
        cols = min(f.h.shape[1], g.h.shape[1])
        row["checks"] = {
            "same_n_steps": bool(np.array_equal(np.asarray(f.n_steps), np.asarray(g.n_steps))),
            "same_n_rejected": bool(np.array_equal(np.asarray(f.n_rejected),
                                                   np.asarray(g.n_rejected))),
            "columns": [int(f.h.shape[1]), int(g.h.shape[1])],
            "h_max_rel_diff": float(np.max(np.abs(np.asarray(f.h)[:, :cols]
                                                  - np.asarray(g.h)[:, :cols]))
                                    / np.max(np.abs(np.asarray(g.h)))),
            "both_ok": bool(f.ok and g.ok)}
        row["general_over_fused"] = row["general"]["median_s"] / row["fused"]["median_s"]
        log(f"  n={n}: record fused {row['fused']['median_s']:.4f} s, general "
            f"{row['general']['median_s']:.4f} s; same n_steps "
            f"{row['checks']['same_n_steps']}")
        out[n] = row
    return out


# ----------------------------------------------------------------- 3. state dimension

def dimensions(dims, n, repeats):
    out = {}
    method = methods.get("tsit5")
    _runtime.warp()   # Warp's own start-up, kept out of the first compile
    for d in dims:
        prob = gs.problems.linear(n=n, d=d)
        cfg = make_config(prob, rtol=RTOL, atol=ATOL, method="tsit5")
        row = {"d": d, "n": n}
        before = warp_cache_entries()
        t = time.perf_counter()
        _fused.kernel_for(prob, method, np.float64)
        row["warp_compile_s"] = time.perf_counter() - t
        row["warp_cache_new_modules"] = len(warp_cache_entries() - before)
        try:
            gs.solve(prob, rtol=RTOL, atol=ATOL, engine="fused")
            row["router"] = "fused accepted"
        except ValueError as err:
            row["router"] = f"fused refused: {err}"
        fused_fn = lambda: _fused.run_fused(prob, cfg).y
        row["fused"] = timed(fused_fn, repeats)
        gen_fn = lambda: gs.solve(prob, rtol=RTOL, atol=ATOL, engine="general")
        row["general"] = timed(gen_fn, repeats)
        fo, go = _fused.run_fused(prob, cfg), gen_fn()
        row["checks"] = {"max_abs_diff": max_diff(fo.y, go.ys),
                         "same_accepted_steps": bool(np.array_equal(fo.n_accepted,
                                                                    np.asarray(go.n_accepted))),
                         "accepted_steps_max": int(fo.n_accepted.max())}
        row["general_over_fused"] = row["general"]["median_s"] / row["fused"]["median_s"]
        comp = row["warp_compile_s"]
        log(f"  d={d}: Warp compile {comp if comp is None else f'{comp:.2f}'} s "
            f"(+{row['warp_cache_new_modules']} module), fused {row['fused']['median_s']:.4f} s,"
            f" general {row['general']['median_s']:.4f} s (first call "
            f"{row['general']['first_call_s']:.2f} s); {row['router'][:14]}")
        out[d] = row
    return out


# ---------------------------------------------------------------- 4. spread ensemble

def compare(prob, repeats, tag):
    """fused vs general vs Diffrax (vmap) on one ensemble: times, step counts, checks."""
    n = prob.n
    row = {"n": n, "repeats": repeats, "engines": {}}
    fns = {"fused": lambda: gs.solve(prob, rtol=RTOL, atol=ATOL),
           "general": lambda: gs.solve(prob, rtol=RTOL, atol=ATOL, engine="general"),
           "diffrax": diffrax_fn(prob)}
    for name, fn in fns.items():
        t = timed(fn, repeats)
        t["us_per_traj"] = t["median_s"] / n * 1e6
        row["engines"][name] = t
        log(f"  {tag} n={n} {name}: {t['median_s']:.4f} s ({t['us_per_traj']:.2f} us/traj)")
    fsol, gsol = fns["fused"](), fns["general"]()
    if fsol.engine != "fused":
        raise RuntimeError(f"{tag}: the router chose {fsol.engine!r}, not 'fused'")
    _, result, stats = fns["diffrax"]()
    steps = np.asarray(fsol.n_accepted)
    row["accepted_steps"] = {"min": int(steps.min()), "median": float(np.median(steps)),
                             "mean": float(steps.mean()), "max": int(steps.max())}
    row["checks"] = {
        "all_ok": bool(fsol.ok and gsol.ok
                       and diffrax_ok(result)),
        "same_accepted_steps_general": bool(np.array_equal(steps, np.asarray(gsol.n_accepted))),
        "same_accepted_steps_diffrax": bool(np.array_equal(
            steps, np.asarray(stats["num_accepted_steps"]))),
        "fused_vs_general_max_abs_diff": max_diff(fsol.ys, gsol.ys)}
    e = row["engines"]
    row["ratios"] = {"general_over_fused": e["general"]["median_s"] / e["fused"]["median_s"],
                     "diffrax_over_fused": e["diffrax"]["median_s"] / e["fused"]["median_s"]}
    return row


def spread(n, repeats):
    return compare(gs.problems.lorenz(n, **SPREAD), repeats, "spread")


# ------------------------------------------------------------- 5. a translated field

def translated(n, repeats):
    """`gs.problems.galactic_halo` has no hand-written Warp form: with `fused=True` the
    translator writes one (`gradsolve/warp/_translate.py`)."""
    base = gs.problems.galactic_halo(n)
    prob = gs.EnsembleProblem(base.f_jax, base.y0, base.params, base.t_span,
                              name="galactic_halo", fused=True)
    return compare(prob, repeats, "translated")


# ------------------------------------------------------------------------- reporting

def size_rows(res):
    rows = []
    for n, r in res.items():
        us = lambda k: r["engines"][k].get("us_per_traj")
        x = r["ratios"]
        rows.append([f"2^{int(np.log2(n))}", str(r["accepted_steps_max"])]
                    + [fmt_us(us(k)) for k in ENGINE_LABELS]
                    + [fmt_x(x["diffrax_over_fused"]), fmt_x(x["general_over_fused"]),
                       fmt_x(x["fused_1thread_over_fused"]),
                       fmt_x(r["engines"]["fused"].get("cpu_per_wall"))])
    head = (["n", "steps"] + [f"{v} us/traj" for v in ENGINE_LABELS.values()]
            + ["Diffrax / fused", "general / fused", "1 thread / fused",
               "fused CPU s / wall s"])
    return head, rows


def record_rows(res):
    rows = [[f"2^{int(np.log2(n))}", f"{r['fused']['median_s']:.4f}",
             f"{r['general']['median_s']:.4f}", fmt_x(r["general_over_fused"]),
             "yes" if r["checks"]["same_n_steps"] else "NO",
             "yes" if r["checks"]["same_n_rejected"] else "NO",
             f"{r['checks']['h_max_rel_diff']:.1e}"] for n, r in res.items()]
    return ["n", "fused record s", "general record s", "general / fused",
            "same n_steps", "same n_rejected", "max h diff (rel.)"], rows


def dim_rows(res):
    rows = []
    for d, r in res.items():
        comp = r["warp_compile_s"]
        rows.append([str(d), str(r["checks"]["accepted_steps_max"]),
                     "-" if comp is None else f"{comp:.2f}",
                     f"{r['fused']['median_s'] * 1e3:.2f}",
                     f"{r['general']['median_s'] * 1e3:.2f}",
                     f"{r['general']['first_call_s']:.2f}", fmt_x(r["general_over_fused"]),
                     "yes" if r["router"] == "fused accepted" else f"no (d > {CPU_MAX_D})"])
    return ["d", "steps", "Warp compile s", "fused run ms", "general run ms",
            "general first call s", "general / fused", "router allows fused"], rows


def spread_rows(row):
    e = row["engines"]
    return (["engine", "median s", "us/traj", "x vs fused"],
            [[ENGINE_LABELS[k], f"{e[k]['median_s']:.4f}", fmt_us(e[k]["us_per_traj"]),
              fmt_x(e[k]["median_s"] / e["fused"]["median_s"])] for k in e])


def verdicts(report):
    out = {}
    sizes = report["sizes"]
    r = sizes.get(TARGET_N)
    if r is None or r["ratios"]["diffrax_over_fused"] is None:
        out["fused_vs_diffrax"] = (f"fused >= {TARGET_X:g}x faster than Diffrax per "
                                   f"trajectory at n = 2^16: not measured")
    else:
        x = r["ratios"]["diffrax_over_fused"]
        e = r["engines"]
        out["fused_vs_diffrax"] = (
            f"fused >= {TARGET_X:g}x faster than Diffrax (vmap) per trajectory at n = 2^16: "
            f"{'met' if x >= TARGET_X else 'missed'} ({x:.2f}x: "
            f"{e['fused']['us_per_traj']:.2f} vs {e['diffrax']['us_per_traj']:.2f} us/traj)")
    gains = {n: s["ratios"]["fused_1thread_over_fused"] for n, s in sizes.items()
             if s["ratios"]["fused_1thread_over_fused"]}
    if gains:
        big = {n: g for n, g in gains.items() if n >= 2 ** 14}
        show = big or gains
        cpu = [s["engines"]["fused"].get("cpu_per_wall") for n, s in sizes.items() if n in show]
        cpu = [c for c in cpu if c]
        out["thread_pool"] = (
            f"thread pool ({os.cpu_count()} workers) vs one thread: "
            + ", ".join(f"2^{int(np.log2(n))}: {g:.2f}x" for n, g in show.items())
            + (f"; the pooled fused solve kept {min(cpu):.2f}-{max(cpu):.2f} CPU-seconds "
               f"busy per wall second" if cpu else ""))
    rec = report["recorders"]
    if rec:
        same = all(r["checks"]["same_n_steps"] for r in rec.values())
        out["recorder"] = (
            "fused recorder vs general recorder: "
            + ", ".join(f"2^{int(np.log2(n))}: {r['general_over_fused']:.2f}x"
                        for n, r in rec.items())
            + f" (general time / fused time); n_steps identical at every n: "
              f"{'yes' if same else 'NO'}")
    dims = report["dimensions"]
    if dims:
        faster = [d for d, r in dims.items() if r["general_over_fused"] > 1]
        slower = [d for d, r in dims.items() if r["general_over_fused"] <= 1]
        comps = [(d, r["warp_compile_s"]) for d, r in dims.items() if r["warp_compile_s"]]
        txt = (f"d sweep (linear, n = {next(iter(dims.values()))['n']}): fused run is faster "
               f"than general at d in {faster or 'none'}, slower at d in {slower or 'none'} "
               "(general / fused: "
               + ", ".join(f"d={d}: {r['general_over_fused']:.2f}" for d, r in dims.items())
               + ")")
        if comps:
            txt += (f"; Warp compile {min(c for _, c in comps):.1f}-"
                    f"{max(c for _, c in comps):.1f} s")
        out["dimension"] = txt
    diffs = {n: r["checks"]["fused_vs_general_max_abs_diff"] for n, r in sizes.items()
             if "fused_vs_general_max_abs_diff" in r["checks"]}
    if diffs:
        unequal = [f"{k} at 2^{int(np.log2(n))}" for n, r in sizes.items()
                   for k, same in r["checks"]["same_accepted_steps"].items() if not same]
        out["agreement"] = (
            "final states, fused vs general: max abs difference "
            + ", ".join(f"2^{int(np.log2(n))}: {d:.1e}" for n, d in diffs.items())
            + "; accepted step counts equal to general's for every engine"
            + (f" except {', '.join(unequal)} (a near-tie accept/reject decision on some "
               "trajectory)" if unequal else ""))
    sp = report["spread"]
    if sp:
        s = sp["accepted_steps"]
        out["spread"] = (
            f"spread ensemble (n = {sp['n']}, accepted steps {s['min']}/{s['median']:.0f}/"
            f"{s['max']} min/median/max): general / fused {sp['ratios']['general_over_fused']:.2f}x,"
            f" Diffrax / fused {sp['ratios']['diffrax_over_fused']:.2f}x")
    tr = report.get("translated")
    if tr:
        out["translated"] = (
            f"translated field (galactic_halo with fused=True, n = {tr['n']}): Diffrax / "
            f"fused {tr['ratios']['diffrax_over_fused']:.2f}x, general / fused "
            f"{tr['ratios']['general_over_fused']:.2f}x; accepted steps equal to general's: "
            f"{'yes' if tr['checks']['same_accepted_steps_general'] else 'NO'}")
    return out


def cutoff_note(dims):
    """What the d sweep says about the router's CPU cutoff (warm run time)."""
    if not dims:
        return ""
    x = {d: r["general_over_fused"] for d, r in dims.items()}
    ds = sorted(x)
    listing = ", ".join(f"d={d}: {x[d]:.2f}" for d in ds)
    # the smallest d from which the fused kernel is slower at every larger d measured
    behind = next((d for d in ds if all(x[e] <= 1 for e in ds if e >= d)), None)
    if behind is None:
        return (f"On this machine the fused kernel's warm run is at least as fast as the "
                f"general engine's up to d = {ds[-1]} (general / fused: {listing}): a cutoff "
                f"at {CPU_MAX_D} does not send fused anything it loses on.")
    text = (f"On this machine (general / fused: {listing}) the fused kernel's warm run "
            f"falls behind the general engine for good from d = {behind}")
    if behind <= CPU_MAX_D:
        text += (f", so the d <= {CPU_MAX_D} cutoff routes d = {behind}..{CPU_MAX_D} to "
                 f"the slower engine on this CPU (general is {1 / x[max(d for d in ds if d <= CPU_MAX_D)]:.1f}x "
                 f"faster at d = {max(d for d in ds if d <= CPU_MAX_D)}); a CPU cutoff near "
                 f"d = {max([d for d in ds if d < behind] or [behind])} would fit these numbers "
                 f"(the GPU cutoff, d <= {FUSED_MAX_D['cuda']}, is not measured here)")
    else:
        text += f", beyond the d <= {CPU_MAX_D} cutoff, which these numbers support"
    return text + ". Warp's compile time (one-off, cached on disk) comes on top of the fused runs."


def markdown(report, command, out):
    m, v, st = report["machine"], report["versions"], report["settings"]
    lines = [
        SECTION_TITLE, "",
        "Forward solves, Tsit5, float64, rtol 1e-6, atol 1e-9. Median of warm calls "
        "(one untimed first call compiles; compilation excluded); per-trajectory time = "
        "median / n. **No CUDA device was available: every fused figure is Warp's `cpu` "
        f"device**, the ensemble split over a thread pool of os.cpu_count() = "
        f"{m['cpu_count']} workers (`_runtime.run_split`). \"fused, 1 thread\" replaces "
        "`gradsolve.warp._runtime.run_split` with `lambda fn, n: fn(0, n)` (one launch "
        "over the whole ensemble). Diffrax is the Diffrax engine's own `vmap`-ed solve "
        "function (`PIDController`, same first step), jitted once with `eqx.filter_jit` "
        "(`gs.solve(engine=\"diffrax\")` as called: see below).", "",
        "### Lorenz ensemble, n = 2^10 ... 2^20", "",
        "`gs.problems.lorenz(n)`: rho in [10, 20], t in [0, 1]. Microseconds per "
        f"trajectory; an engine's larger sizes are skipped after one call takes more than "
        f"{st['max_call_s']:g} s. Ratios are time / fused time. The last column is the "
        "process CPU time per wall second of one pooled fused call (2 = both cores busy).", "",
        md_table(*size_rows(report["sizes"])), "",
    ]
    skipped = [(n, k, e["skipped"]) for n, r in report["sizes"].items()
               for k, e in r["engines"].items() if "skipped" in e]
    if skipped:
        lines += ["Skipped: " + "; ".join(f"{ENGINE_LABELS[k]} at n = 2^{int(np.log2(n))} "
                                           f"({why})" for n, k, why in skipped) + ".", ""]
    called = {n: r["diffrax_as_called"] for n, r in report["sizes"].items()
              if "diffrax_as_called" in r}
    if called:
        lines += ["`gs.solve(prob, engine=\"diffrax\")` as called (median of 2 calls after a "
                  "first one): " + "; ".join(
                      f"n = 2^{int(np.log2(n))}: {c['median_s']:.2f} s vs "
                      f"{report['sizes'][n]['engines']['diffrax']['median_s']:.3f} s jitted once"
                      for n, c in called.items())
                  + " -- the engine reuses its compiled solve across calls.", ""]
    lines += [
        "### Recorders: `gs.record(recorder=\"fused\")` vs `recorder=\"general\"`", "",
        "Same Lorenz ensemble; seconds per call.", "",
        md_table(*record_rows(report["recorders"])), "",
        f"### State dimension: `gs.problems.linear(n={st['dim_n']}, d=d)`", "",
        "Fused through `gradsolve.warp._fused.run_fused` directly (the router refuses "
        f"fused for d > {CPU_MAX_D} on the CPU). Warp compile = `_fused.kernel_for` (code generation "
        "plus Warp's C++ build) with `GRADSOLVE_KERNEL_CACHE` and "
        "`warp.config.kernel_cache_dir` pointed at new temporary folders before Warp "
        "initialises; every d added a new module to Warp's cache "
        f"({'confirmed' if all(r['warp_cache_new_modules'] == 1 for r in report['dimensions'].values()) else 'NOT confirmed for every d'})."
        " General first call = its JAX trace and compile plus one run.", "",
        md_table(*dim_rows(report["dimensions"])), "",
        cutoff_note(report["dimensions"]), "",
    ]
    sp = report["spread"]
    if sp:
        s = sp["accepted_steps"]
        lines += [
            "### Spread difficulty", "",
            f"`gs.problems.lorenz({sp['n']}, rho={SPREAD['rho']}, t_span={SPREAD['t_span']})`:"
            f" accepted steps min {s['min']}, median {s['median']:.0f}, mean {s['mean']:.0f},"
            f" max {s['max']}. The batched engines (general, Diffrax under vmap) step "
            "every trajectory until the slowest is done; the fused kernel's threads stop "
            "on their own.", "",
            md_table(*spread_rows(sp)), ""]
    tr = report.get("translated")
    if tr:
        s = tr["accepted_steps"]
        lines += [
            "### A translated field", "",
            f"`gs.problems.galactic_halo({tr['n']})` (t in [0, 10], d = 6) rebuilt with "
            "`fused=True`: it has no hand-written Warp form, so the translator writes one "
            f"from its jaxpr. Accepted steps min {s['min']}, median {s['median']:.0f}, max "
            f"{s['max']}; same as the general engine's: "
            f"{'yes' if tr['checks']['same_accepted_steps_general'] else 'NO'}; final states "
            f"within {tr['checks']['fused_vs_general_max_abs_diff']:.1e}.", "",
            md_table(*spread_rows(tr)), ""]
    lines += ["### Targets and findings", ""]
    lines += [f"- {t}." for t in report["verdicts"].values()]
    load = report["load_average"]
    lines += [
        "", f"Machine: {m['cpu_model']} ({m['cpu_count']} CPUs, {m['memory_gib']} GiB), "
        f"{m['platform']}; Warp {v.get('warp')} (`cpu` device), jax {v['jax']}, diffrax "
        f"{v['diffrax']}, gradsolve {v['gradsolve']} (commit {v['git_commit']}"
        + (", with uncommitted changes under src/" if v["src_uncommitted_changes"] else "")
        + f"); {report['date']}. The machine was shared with other work (1-minute load "
        f"average {load['start'][0]:.1f} at the start, {load['end'][0]:.1f} at the end, on "
        f"{m['cpu_count']} CPUs), so timings are noisy and the thread-pool gain in "
        "particular may be understated: read single ratios loosely.", "",
        f"Reproduce: `{command}`" + (f" (raw numbers: `{display_path(out)}`)." if out else "."),
    ]
    return "\n".join(lines)


# ------------------------------------------------------------------------------ main

def render(json_path, docs):
    """Rewrite the docs section (and the report's verdicts) from a saved report (JSON
    turns int keys to str)."""
    report = json.loads(Path(json_path).read_text())
    for key in ("sizes", "recorders", "dimensions"):
        report[key] = {int(k): v for k, v in report[key].items()}
    report["verdicts"] = verdicts(report)
    Path(json_path).write_text(json.dumps(report, indent=1) + "\n")   # refreshed verdicts
    write_docs(Path(docs), markdown(report, report["command"], json_path), START, END)
    log(f"wrote {docs}")
    return report


def parse_list(text, kind):
    return [kind(x) for x in text.split(",") if x.strip()]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default=None, help="Lorenz sizes (default 2^10,...,2^20)")
    ap.add_argument("--record-sizes", default=None, help="recorder sizes (default 2^10,2^14,2^16)")
    ap.add_argument("--dims", default=None, help="state dimensions (default 2,4,...,128)")
    ap.add_argument("--dim-n", type=int, default=None, help="ensemble size of the d sweep (1024)")
    ap.add_argument("--spread-n", type=int, default=None, help="spread ensemble size (2^14)")
    ap.add_argument("--solve-diffrax-sizes", default=None,
                    help="sizes at which gs.solve(engine='diffrax') is timed as called "
                         "(default 2^10,2^14)")
    ap.add_argument("--max-call-s", type=float, default=20.0,
                    help="skip an engine's larger sizes once one call takes longer (20)")
    ap.add_argument("--repeats", type=int, default=None,
                    help="timed repeats (default 5 up to 2^14, 3 at 2^16, 2 at 2^18, 1 above)")
    ap.add_argument("--render", default=None, metavar="JSON",
                    help="only rewrite the Markdown section from a saved JSON report")
    ap.add_argument("--quick", action="store_true",
                    help="smoke test with small n; writes nothing unless --out/--docs")
    ap.add_argument("--out", default=None, help=f"JSON path (default {DEFAULT_OUT})")
    ap.add_argument("--docs", default=None, help=f"Markdown path (default {DEFAULT_DOCS})")
    args = ap.parse_args(argv)

    if args.render:
        return render(args.render, args.docs if args.docs is not None else str(DEFAULT_DOCS))
    q = args.quick
    sizes = parse_list(args.sizes, int) if args.sizes else (
        [2 ** 8, 2 ** 10, 2 ** 12] if q else [2 ** k for k in (10, 12, 14, 16, 18, 20)])
    record_sizes = parse_list(args.record_sizes, int) if args.record_sizes else (
        [2 ** 8, 2 ** 10] if q else [2 ** 10, 2 ** 14, 2 ** 16])
    dims = parse_list(args.dims, int) if args.dims else (
        [2, 8, 128] if q else [2, 4, 8, 16, 32, 64, 128])
    dim_n = args.dim_n or (256 if q else 1024)
    spread_n = args.spread_n if args.spread_n is not None else (2 ** 10 if q else 2 ** 14)
    solve_dfx = parse_list(args.solve_diffrax_sizes, int) if args.solve_diffrax_sizes \
        is not None else ([2 ** 10] if q else [2 ** 10, 2 ** 14])
    out = args.out if args.out is not None else ("" if q else str(DEFAULT_OUT))
    docs = args.docs if args.docs is not None else ("" if q else str(DEFAULT_DOCS))

    def repeats_for(n):
        if args.repeats:
            return args.repeats
        if q:
            return 3
        return 5 if n <= 2 ** 14 else 3 if n <= 2 ** 16 else 2 if n <= 2 ** 18 else 1

    command = " ".join([".venv/bin/python", "benchmarks/fused_forward.py"] + sys.argv[1:])
    env = versions()
    env["warp"] = warp.__version__
    load_start = os.getloadavg()
    t_start = time.perf_counter()
    log(f"fused_forward: Warp device {_runtime.device()}, {os.cpu_count()} CPUs, load "
        f"{load_start[0]:.1f}; Warp cache {_WARP_CACHE}")
    log(f"1. Lorenz sizes {sizes}")
    res_sizes = lorenz_sizes(sizes, repeats_for, args.max_call_s, solve_dfx)
    log(f"2. recorders at {record_sizes}")
    res_rec = recorders(record_sizes, repeats_for)
    log(f"3. state dimension {dims} at n={dim_n}")
    res_dims = dimensions(dims, dim_n, 3 if q else 5)
    log(f"4. spread ensemble at n={spread_n}")
    res_spread = spread(spread_n, repeats_for(spread_n)) if spread_n else None
    log(f"5. translated field at n={spread_n}")
    res_translated = translated(spread_n, repeats_for(spread_n)) if spread_n else None

    report = {
        "benchmark": "fused_forward",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command,
        "settings": {
            "method": "tsit5", "dtype": "float64", "rtol": RTOL, "atol": ATOL,
            "lorenz": "gs.problems.lorenz(n): rho in [10, 20], y0 = (1, 0, 0), t in [0, 1]",
            "sizes": sizes, "record_sizes": record_sizes, "dims": dims, "dim_n": dim_n,
            "dim_problem": "gs.problems.linear(n=dim_n, d=d), t in [0, 1]",
            "spread": {"n": spread_n, **SPREAD}, "max_call_s": args.max_call_s,
            "timing": "median of warm repeats after one untimed (compiling) first call",
            "fused_1thread": "gradsolve.warp._runtime.run_split replaced by "
                             "lambda fn, n: fn(0, n)",
            "diffrax": "eqx.filter_jit(gs.engines.ENGINES['diffrax']._solve_fn(prob, cfg, "
                       "RecursiveCheckpointAdjoint(), None, throw=False)), jitted once",
            "warp_compile": "time of gradsolve.warp._fused.kernel_for with fresh "
                            "GRADSOLVE_KERNEL_CACHE and warp.config.kernel_cache_dir "
                            "(temporary folders set before warp.init())",
            "warp_device": _runtime.device(), "cuda_available": _runtime.device() == "cuda",
            "thread_pool_workers": os.cpu_count(), "quick": q},
        "machine": machine(), "versions": env,
        "load_average": {"start": list(load_start), "end": list(os.getloadavg())},
        "total_wall_s": time.perf_counter() - t_start,
        "sizes": res_sizes, "recorders": res_rec, "dimensions": res_dims,
        "spread": res_spread, "translated": res_translated,
    }
    report["verdicts"] = verdicts(report)

    log("\nLorenz (us per trajectory)\n" + text_table(*size_rows(res_sizes)))
    log("\nRecorders (s)\n" + text_table(*record_rows(res_rec)))
    log("\nState dimension\n" + text_table(*dim_rows(res_dims)))
    log(cutoff_note(res_dims))
    if res_spread:
        log("\nSpread ensemble\n" + text_table(*spread_rows(res_spread)))
    if res_translated:
        log("\nTranslated field\n" + text_table(*spread_rows(res_translated)))
    log("\nTargets and findings:\n" + "\n".join(f"- {t}" for t in report["verdicts"].values()))
    log(f"\ntotal {report['total_wall_s']:.0f} s")

    save(report, out, docs, lambda: markdown(report, command, out), START, END, log)
    return report


if __name__ == "__main__":
    main()
