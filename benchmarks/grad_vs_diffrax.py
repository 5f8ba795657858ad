"""Gradient benchmark: gradsolve's record-and-replay against Diffrax (Lorenz, Tsit5).

Problem: `gs.problems.lorenz(n=n)`, rho spread over [10, 20] (below chaos),
y0 = (1, 0, 0), t in [0, 1], Tsit5, float64. Loss: `sum(ys ** 2)` of the final
states; gradient with respect to the parameters (sigma, rho, beta of every
trajectory).

For every ensemble size n and tolerance it measures, as the median of warm repeats
(one untimed first call compiles; compilation is reported apart and excluded):

1. `gs.record`, the adaptive solve that makes the mesh (reported on its own and
   left out of every gradient time);
2. the replay forward pass alone, `jax.jit(lambda p: gs.replay(prob, mesh, params=p))`;
3. the reverse-mode replay gradient, `gs.value_and_grad(prob, loss, mesh=mesh)`;
4. the forward-mode replay gradient (`mode="forward"`);
5. Diffrax `RecursiveCheckpointAdjoint`, both with Diffrax's default checkpoints and
   with one checkpoint per step (`gs.engines.Diffrax(checkpoints=M)`), under a tight
   `max_steps=M`; the faster of the two is the baseline, and which one it was is kept;
6. Diffrax `ForwardMode`.

Accuracy: each side's achieved error is the largest, over trajectories, of
`max|y - y_ref| / max|y_ref|` of the final state, against a tight reference
(`gs.solve(..., rtol=1e-13, atol=1e-15, engine="general")`). Over the tolerance sweep
each side gives a curve of log(gradient time) against log(error); the two curves are
interpolated at the same errors (over the range where both are defined), and the
speed ratio diffrax_time / replay_time is reported there.

Outputs: a table on stdout, `benchmarks/results/grad_vs_diffrax.json` (all raw
timings and settings, and the machine), and the section between
`<!-- grad_vs_diffrax:start -->` and `<!-- grad_vs_diffrax:end -->` in
`docs/benchmarks.md`.

Run (from the repository root):

    .venv/bin/python benchmarks/grad_vs_diffrax.py            # full run, ~5-15 min
    .venv/bin/python benchmarks/grad_vs_diffrax.py --quick    # smoke test, writes nothing

Options: `--sizes 8,128,1024,8192`, `--tols 1e-4,1e-5,1e-6,1e-7,1e-8`,
`--sweep-max-n N` (larger n run rtol 1e-6 only), `--repeats R`, `--max-steps M`,
`--out PATH`, `--docs PATH` (`--out ''` / `--docs ''` to skip writing).
"""

import jax

jax.config.update("jax_enable_x64", True)

import argparse  # noqa: E402
import datetime  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from importlib import metadata  # noqa: E402
from pathlib import Path  # noqa: E402

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import gradsolve as gs  # noqa: E402
from _common import save  # noqa: E402


ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "grad_vs_diffrax.json"
DEFAULT_DOCS = ROOT / "docs" / "benchmarks.md"
START, END = "<!-- grad_vs_diffrax:start -->", "<!-- grad_vs_diffrax:end -->"
SECTION_TITLE = "## Gradient vs Diffrax (Lorenz, Tsit5)"

MAIN_RTOL, ATOL_FACTOR = 1e-6, 1e-3          # atol = rtol * 1e-3 throughout
REF_RTOL, REF_ATOL = 1e-13, 1e-15
TARGETS = {
    "reverse_speedup": (">=", 8.0, (1024, 8192)),
    "forward_speedup": (">=", 6.0, None),       # None: every n
    "grad_over_forward_pass": ("<=", 4.0, None),
}


def loss(ys, params):
    """A scalar of the final states."""
    return jnp.sum(ys ** 2)


def log(msg):
    print(msg, flush=True)


# --------------------------------------------------------------------------- timing

def timeit_warm(fn, repeats):
    """One untimed first call (compiles), then `repeats` timed calls.

    Returns a dict with the median, every time, and the first call's time."""
    t = time.perf_counter()
    jax.block_until_ready(fn())
    first = time.perf_counter() - t
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t)
    return {"median_s": float(np.median(times)), "times_s": times,
            "first_call_s": first, "repeats": repeats}


# ---------------------------------------------------------------------- measurements

def state_error(ys, ref):
    """Largest over trajectories of max|y - y_ref| / max|y_ref| (final states)."""
    ys, ref = np.asarray(ys), np.asarray(ref)
    return float(np.max(np.max(np.abs(ys - ref), axis=1) / np.max(np.abs(ref), axis=1)))


def rel_diff(a, b):
    """Normwise relative difference of two gradient pytrees, per parameter."""
    return {k: float(np.max(np.abs(np.asarray(a[k]) - np.asarray(b[k])))
                     / np.max(np.abs(np.asarray(b[k])))) for k in b}


def all_finite(value, grads):
    return bool(np.isfinite(np.asarray(value))
                and all(np.all(np.isfinite(np.asarray(g))) for g in jax.tree.leaves(grads)))


def reference(prob):
    """Tight final states from the general engine."""
    sol = gs.solve(prob, rtol=REF_RTOL, atol=REF_ATOL, engine="general")
    if not sol.ok:
        raise RuntimeError("reference solve failed")
    return np.asarray(sol.ys), int(np.max(np.asarray(sol.n_accepted)))


def measure_record(prob, rtol, atol, repeats):
    timing = timeit_warm(lambda: gs.record(prob, rtol=rtol, atol=atol), repeats)
    mesh = gs.record(prob, rtol=rtol, atol=atol)
    if not mesh.ok:
        raise RuntimeError(f"record failed: {mesh.summary()}")
    return mesh, timing


def measure_replay_forward(prob, mesh, repeats):
    fwd = jax.jit(lambda p: gs.replay(prob, mesh, params=p))
    return timeit_warm(lambda: fwd(prob.params), repeats), fwd(prob.params)


def measure_replay_grad(prob, mesh, mode, repeats):
    vg = gs.value_and_grad(prob, loss, mesh=mesh, mode=mode)
    timing = timeit_warm(vg, repeats)
    value, grads = vg()
    return timing, value, grads


def measure_diffrax_grad(prob, rtol, atol, engine, mode, max_steps, repeats):
    vg = gs.value_and_grad(prob, loss, engine=engine, mode=mode, rtol=rtol, atol=atol,
                           max_steps=max_steps)
    timing = timeit_warm(vg, repeats)
    value, grads = vg()
    if not all_finite(value, grads):
        raise RuntimeError(f"Diffrax gradient ({engine}, {mode}) is not finite")
    return timing, value, grads


def measure_diffrax_states(prob, rtol, atol, max_steps):
    """Diffrax's final states with the same settings as its gradient runs; checks
    that every trajectory finished well inside `max_steps`."""
    sol = gs.solve(prob, rtol=rtol, atol=atol, engine="diffrax", max_steps=max_steps)
    attempted = int(np.max(np.asarray(sol.n_accepted) + np.asarray(sol.n_rejected)))
    if not sol.ok or attempted >= max_steps:
        raise RuntimeError(f"Diffrax needs more than max_steps={max_steps} at rtol={rtol} "
                           f"(used {attempted}); raise --max-steps")
    return np.asarray(sol.ys), sol


def measure_point(prob, ref, rtol, max_steps, repeats, with_checks):
    """Everything at one (n, tolerance)."""
    atol = rtol * ATOL_FACTOR
    n = prob.n
    out = {"rtol": rtol, "atol": atol}

    mesh, out["record"] = measure_record(prob, rtol, atol, repeats)
    steps = np.asarray(mesh.n_steps)
    out["mesh"] = {"columns": mesh.columns, "accepted_min": int(steps.min()),
                   "accepted_max": int(steps.max()),
                   "rejected_max": int(np.max(np.asarray(mesh.n_rejected))),
                   "padding_fraction": float(1 - steps.sum() / (n * mesh.columns))}
    log(f"  n={n} rtol={rtol:.0e}: record {out['record']['median_s']:.4f} s, "
        f"S={mesh.columns}")

    out["replay_forward"], ys_replay = measure_replay_forward(prob, mesh, repeats)
    out["replay_reverse"], _, g_rev = measure_replay_grad(prob, mesh, "reverse", repeats)
    out["replay_forward_mode"], _, g_fwd = measure_replay_grad(prob, mesh, "forward",
                                                                repeats)
    log(f"    replay: forward pass {out['replay_forward']['median_s']:.4f} s, reverse "
        f"{out['replay_reverse']['median_s']:.4f} s, forward mode "
        f"{out['replay_forward_mode']['median_s']:.4f} s")

    ys_dfx, sol = measure_diffrax_states(prob, rtol, atol, max_steps)
    out["diffrax_steps"] = {
        "attempted_max": int(np.max(np.asarray(sol.n_accepted) + np.asarray(sol.n_rejected))),
        "same_accepted_as_mesh": bool(np.array_equal(np.asarray(sol.n_accepted), steps)),
        "same_rejected_as_mesh": bool(np.array_equal(np.asarray(sol.n_rejected),
                                                     np.asarray(mesh.n_rejected)))}
    ckpt = {}
    ckpt["default"], _, g_dfx = measure_diffrax_grad(
        prob, rtol, atol, gs.engines.Diffrax(), "reverse", max_steps, repeats)
    ckpt[f"checkpoints={max_steps}"], _, _ = measure_diffrax_grad(
        prob, rtol, atol, gs.engines.Diffrax(checkpoints=max_steps), "reverse", max_steps,
        repeats)
    best = min(ckpt, key=lambda k: ckpt[k]["median_s"])
    out["diffrax_checkpoint"] = {"settings": ckpt, "fastest": best,
                                 "median_s": ckpt[best]["median_s"]}
    out["diffrax_forward_mode"], _, g_dfx_fwd = measure_diffrax_grad(
        prob, rtol, atol, "diffrax", "forward", max_steps, repeats)
    log(f"    diffrax: checkpointed default {ckpt['default']['median_s']:.4f} s, "
        f"checkpoints={max_steps} {ckpt[f'checkpoints={max_steps}']['median_s']:.4f} s "
        f"(fastest: {best}), ForwardMode {out['diffrax_forward_mode']['median_s']:.4f} s")

    out["error"] = {"replay": state_error(ys_replay, ref), "diffrax": state_error(ys_dfx, ref),
                    "replay_vs_diffrax_states": state_error(ys_replay, ys_dfx)}
    if with_checks:
        out["gradient_agreement"] = {
            "replay_reverse_vs_diffrax_checkpoint": rel_diff(g_rev, g_dfx),
            "replay_forward_vs_diffrax_forward": rel_diff(g_fwd, g_dfx_fwd),
            "replay_forward_vs_replay_reverse": rel_diff(g_fwd, g_rev)}
    out["ratios"] = ratios(out)
    r = out["ratios"]
    log(f"    errors: replay {out['error']['replay']:.2e}, diffrax "
        f"{out['error']['diffrax']:.2e}; reverse x{r['reverse_speedup']:.2f}, forward "
        f"x{r['forward_speedup']:.2f}, grad/forward pass {r['grad_over_forward_pass']:.2f}")
    return out


def ratios(point):
    rev = point["replay_reverse"]["median_s"]
    return {
        "reverse_speedup": point["diffrax_checkpoint"]["median_s"] / rev,
        "reverse_speedup_incl_record":
            point["diffrax_checkpoint"]["median_s"] / (rev + point["record"]["median_s"]),
        "forward_speedup": point["diffrax_forward_mode"]["median_s"]
            / point["replay_forward_mode"]["median_s"],
        "grad_over_forward_pass": rev / point["replay_forward"]["median_s"],
    }


# ------------------------------------------------------------------ matched accuracy

def log_interp(errors, times, at):
    """log(time) interpolated linearly in log(error), at the errors `at`."""
    x, y = np.log(np.asarray(errors)), np.log(np.asarray(times))
    order = np.argsort(x)
    return np.exp(np.interp(np.log(np.asarray(at)), x[order], y[order]))


def matched(points, levels=4):
    """Speed ratios diffrax / replay at equal achieved error, over the overlap of the
    two error ranges (None when the sweep has fewer than two tolerances or the
    ranges do not overlap)."""
    if len(points) < 2:
        return None
    e_rep = [p["error"]["replay"] for p in points]
    e_dfx = [p["error"]["diffrax"] for p in points]
    lo, hi = max(min(e_rep), min(e_dfx)), min(max(e_rep), max(e_dfx))
    if not (lo <= hi):
        return {"overlap": None, "note": "error ranges do not overlap"}
    at = [(float(e), False) for e in (np.geomspace(lo, hi, levels) if hi > lo else [lo])]
    main = [p for p in points if p["rtol"] == MAIN_RTOL]
    if main and lo <= main[0]["error"]["replay"] <= hi:
        at.append((main[0]["error"]["replay"], True))
    curves = {
        "reverse": ([p["replay_reverse"]["median_s"] for p in points],
                    [p["diffrax_checkpoint"]["median_s"] for p in points]),
        "forward": ([p["replay_forward_mode"]["median_s"] for p in points],
                    [p["diffrax_forward_mode"]["median_s"] for p in points]),
    }
    rows = []
    for e, is_main in at:
        row = {"error": e, "at_replay_error_of_rtol_1e-6": is_main}
        for name, (t_rep, t_dfx) in curves.items():
            tr = float(log_interp(e_rep, t_rep, [e])[0])
            td = float(log_interp(e_dfx, t_dfx, [e])[0])
            row[name] = {"replay_s": tr, "diffrax_s": td, "speedup": td / tr}
        rows.append(row)
    rows.sort(key=lambda r: r["error"])
    return {"overlap": [float(lo), float(hi)], "levels": rows}


# ----------------------------------------------------------------------- environment

def machine():
    model = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = None
    try:
        kb = int(re.search(r"MemTotal:\s+(\d+)", Path("/proc/meminfo").read_text()).group(1))
        mem = round(kb / 2 ** 20, 1)
    except (OSError, AttributeError):
        pass
    dev = jax.devices()[0]
    return {"processor": platform.processor(), "cpu_model": model,
            "cpu_count": os.cpu_count(), "memory_gib": mem,
            "platform": platform.platform(), "python": platform.python_version(),
            "jax_device": f"{dev.platform}:{getattr(dev, 'device_kind', '')}"}


def versions():
    out = {"gradsolve": gs.__version__, "jax": jax.__version__}
    for pkg in ("jaxlib", "diffrax", "equinox", "numpy"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    def git(*args):
        try:
            return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                                  timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None
    out["git_commit"] = git("rev-parse", "--short", "HEAD") or None
    status = git("status", "--porcelain", "--", "src")
    out["src_uncommitted_changes"] = None if status is None else bool(status)
    return out


# ------------------------------------------------------------------------- reporting

def main_rows(results):
    rows = []
    for n, res in results.items():
        p = next(p for p in res["points"] if p["rtol"] == MAIN_RTOL)
        r = p["ratios"]
        rows.append([
            str(n), str(p["mesh"]["columns"]), f"{p['record']['median_s']:.4f}",
            f"{p['replay_forward']['median_s']:.4f}", f"{p['replay_reverse']['median_s']:.4f}",
            f"{p['replay_forward_mode']['median_s']:.4f}",
            f"{p['diffrax_checkpoint']['median_s']:.4f} ({p['diffrax_checkpoint']['fastest']})",
            f"{p['diffrax_forward_mode']['median_s']:.4f}",
            f"{r['reverse_speedup']:.2f}", f"{r['reverse_speedup_incl_record']:.2f}",
            f"{r['forward_speedup']:.2f}", f"{r['grad_over_forward_pass']:.2f}"])
    head = ["n", "S", "record", "replay fwd pass", "replay rev grad", "replay fwd grad",
            "Diffrax ckpt grad (setting)", "Diffrax ForwardMode", "rev x", "rev x incl. record",
            "fwd x", "rev grad / fwd pass"]
    return head, rows


def matched_rows(results):
    rows = []
    for n, res in results.items():
        m = res["matched"]
        if not m or not m.get("levels"):
            rows.append([str(n), "-", "-", "-", "single tolerance" if not m else m["note"]])
            continue
        for lv in m["levels"]:
            rows.append([str(n), f"{lv['error']:.2e}", f"{lv['reverse']['speedup']:.2f}",
                         f"{lv['forward']['speedup']:.2f}",
                         "replay error at rtol 1e-6" if lv["at_replay_error_of_rtol_1e-6"]
                         else ""])
    return ["n", "matched error", "rev x", "fwd x", "note"], rows


def text_table(head, rows):
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    line = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))
    return "\n".join([line(head), line(["-" * w for w in widths])] + [line(r) for r in rows])


def md_table(head, rows):
    return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
                     + ["| " + " | ".join(r) + " |" for r in rows])


def verdicts(results):
    """One sentence per target: at which n it is met or missed, with the numbers."""
    names = {"reverse_speedup": "reverse replay vs Diffrax's fastest checkpointed adjoint",
             "forward_speedup": "forward-mode replay vs Diffrax ForwardMode",
             "grad_over_forward_pass": "replay reverse gradient / replay forward pass"}
    out = {}
    for key, (op, bound, sizes) in TARGETS.items():
        met, missed = [], []
        for n, res in results.items():
            if sizes is not None and n not in sizes:
                continue
            p = next(p for p in res["points"] if p["rtol"] == MAIN_RTOL)
            v = p["ratios"][key]
            ok = v >= bound if op == ">=" else v <= bound
            (met if ok else missed).append(f"n={n}: {v:.2f}x")
        where = "n in {1024, 8192}" if sizes else "every n"
        if not met and not missed:
            text = f"{names[key]} (target {op} {bound:g}x at {where}): not measured"
        else:
            text = (f"{names[key]} (target {op} {bound:g}x at {where}): "
                    f"met at {', '.join(met) or 'no n'}; "
                    f"missed at {', '.join(missed) or 'no n'}")
        out[key] = {"target": f"{op} {bound:g}", "sizes": list(sizes) if sizes else "all",
                    "met": met, "missed": missed, "text": text}
    return out


def markdown(report, command, out):
    res = report["results"]
    swept = [n for n in res if len(res[n]["points"]) > 1]
    single = [n for n in res if len(res[n]["points"]) == 1]
    m = report["machine"]
    v = report["versions"]
    lines = [
        SECTION_TITLE, "",
        "Lorenz ensemble (`gs.problems.lorenz(n)`: rho spread over [10, 20], y0 = (1, 0, 0), "
        "t in [0, 1]), Tsit5, float64; loss `sum(ys ** 2)` of the final states, gradient "
        "with respect to (sigma, rho, beta) of every trajectory. Median seconds of warm "
        "calls (compilation excluded); the record is timed apart and not included in "
        "the replay gradient times. Diffrax's checkpointed adjoint is the faster of its "
        f"default checkpoints and one checkpoint per step, both with max_steps = "
        f"{report['settings']['max_steps']}. Ratios: rev x = Diffrax checkpointed / replay "
        "reverse, fwd x = Diffrax ForwardMode / forward-mode replay.", "",
        f"### At rtol {MAIN_RTOL:g}, atol {MAIN_RTOL * ATOL_FACTOR:g}", "",
        md_table(*main_rows(res)), "",
        "### At matched achieved accuracy", "",
        "Error: max over trajectories of max|y - y_ref| / max|y_ref| of the final state, "
        f"y_ref from the general engine at rtol {REF_RTOL:g}, atol {REF_ATOL:g}. "
        "log(time) is interpolated against log(error) on each side's tolerance sweep "
        f"(rtol in {{{', '.join(f'{t:g}' for t in report['settings']['tols'])}}}, "
        "atol = rtol x 1e-3), at errors inside the range both sides reach. "
        + (f"Swept: n = {', '.join(map(str, swept))}. " if swept else "")
        + (f"Single tolerance (rtol 1e-6) only: n = {', '.join(map(str, single))}. "
           if single else ""), "",
        md_table(*matched_rows(res)), "",
        "### Targets", "",
    ]
    lines += [f"- {t['text']}." for t in report["verdicts"].values()]
    lines += [
        "", f"Machine: {m['cpu_model']} ({m['cpu_count']} CPUs, {m['memory_gib']} GiB), "
        f"{m['platform']}; jax {v['jax']}, diffrax {v['diffrax']}, gradsolve {v['gradsolve']}"
        f" (commit {v['git_commit']}"
        + (", with uncommitted changes under src/" if v["src_uncommitted_changes"] else "")
        + f"); {report['date']}. The machine was shared with other work during the run "
        "(timings vary by up to ~2x between neighbouring points): read single ratios "
        "loosely.", "",
        f"Reproduce: `{command}`"
        + (f" (raw numbers: `{display_path(out)}`)." if out else "."),
    ]
    return "\n".join(lines)


def display_path(path):
    """`path` relative to the repository root when it lies inside it."""
    path = Path(path).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


# ------------------------------------------------------------------------------ main

def parse_list(text, kind):
    return [kind(x) for x in text.split(",") if x.strip()]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default=None, help="ensemble sizes (default 8,128,1024,8192)")
    ap.add_argument("--tols", default=None,
                    help="rtol sweep, atol = rtol*1e-3 (default 1e-4,1e-5,1e-6,1e-7,1e-8)")
    ap.add_argument("--sweep-max-n", type=int, default=8192,
                    help="larger ensembles run rtol 1e-6 only (default 8192)")
    ap.add_argument("--repeats", type=int, default=None,
                    help="timed repeats (default 7 for n <= 1024, 3 above)")
    ap.add_argument("--max-steps", type=int, default=256,
                    help="Diffrax max_steps (and checkpoints) (default 256)")
    ap.add_argument("--quick", action="store_true",
                    help="smoke test: sizes 8,128, 3 tolerances, 3 repeats, writes nothing "
                         "unless --out/--docs are given")
    ap.add_argument("--out", default=None, help=f"JSON path (default {DEFAULT_OUT})")
    ap.add_argument("--docs", default=None, help=f"Markdown path (default {DEFAULT_DOCS})")
    args = ap.parse_args(argv)

    sizes = parse_list(args.sizes, int) if args.sizes else (
        [8, 128] if args.quick else [8, 128, 1024, 8192])
    tols = parse_list(args.tols, float) if args.tols else (
        [1e-4, 1e-6, 1e-8] if args.quick else [1e-4, 1e-5, 1e-6, 1e-7, 1e-8])
    if MAIN_RTOL not in tols:
        tols.append(MAIN_RTOL)
    tols = sorted(set(tols), reverse=True)
    out = args.out if args.out is not None else ("" if args.quick else str(DEFAULT_OUT))
    docs = args.docs if args.docs is not None else ("" if args.quick else str(DEFAULT_DOCS))

    def repeats_for(n):
        if args.repeats:
            return args.repeats
        return 3 if args.quick or n > 1024 else 7

    command = " ".join([".venv/bin/python", "benchmarks/grad_vs_diffrax.py"] + sys.argv[1:])
    log(f"grad_vs_diffrax: sizes {sizes}, tolerances {tols} (n > {args.sweep_max_n}: rtol "
        f"{MAIN_RTOL:g} only), Diffrax max_steps {args.max_steps}")
    env = versions()     # before measuring: the code that is imported and timed
    t_start = time.perf_counter()
    results = {}
    for n in sizes:
        prob = gs.problems.lorenz(n=n)
        t = time.perf_counter()
        ref, ref_steps = reference(prob)
        log(f"n={n}: reference ({ref_steps} steps) in {time.perf_counter() - t:.1f} s")
        points = []
        for rtol in (tols if n <= args.sweep_max_n else [MAIN_RTOL]):
            points.append(measure_point(prob, ref, rtol, args.max_steps, repeats_for(n),
                                        with_checks=rtol == MAIN_RTOL))
        results[n] = {"repeats": repeats_for(n), "reference_steps_max": ref_steps,
                      "points": points, "matched": matched(points)}
        log(f"n={n} done ({time.perf_counter() - t_start:.0f} s elapsed)")

    report = {
        "benchmark": "grad_vs_diffrax",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command,
        "settings": {
            "problem": "gs.problems.lorenz(n): rho in [10, 20], y0 = (1, 0, 0), t in [0, 1]",
            "method": "tsit5", "dtype": "float64", "loss": "sum(ys ** 2) of final states",
            "wrt": "params (sigma, rho, beta per trajectory)", "sizes": sizes, "tols": tols,
            "atol": "rtol * 1e-3", "main_rtol": MAIN_RTOL, "sweep_max_n": args.sweep_max_n,
            "max_steps": args.max_steps, "reference": f"general engine, rtol {REF_RTOL:g}, "
            f"atol {REF_ATOL:g}", "error": "max_i max|y_i - ref_i| / max|ref_i| (final states)",
            "timing": "median of warm repeats after one untimed compiling call",
            "quick": args.quick},
        "machine": machine(), "versions": env,
        "total_wall_s": time.perf_counter() - t_start,
        "results": results,
    }
    report["verdicts"] = verdicts(results)

    head, rows = main_rows(results)
    log(f"\nAt rtol {MAIN_RTOL:g}, atol {MAIN_RTOL * ATOL_FACTOR:g} (median seconds; x = "
        "Diffrax time / replay time)\n" + text_table(head, rows))
    head, rows = matched_rows(results)
    log("\nAt matched achieved error (interpolated in log-log)\n" + text_table(head, rows))
    log("\nTargets:\n" + "\n".join(f"- {t['text']}" for t in report["verdicts"].values()))
    log(f"\ntotal {report['total_wall_s']:.0f} s")

    save(report, out, docs, lambda: markdown(report, command, out), START, END, log)
    return report


if __name__ == "__main__":
    main()
