"""The fitting loop: time per optimizer update of `gs.Calibrator` with replay
gradients (`engine=None`, the router's replay engine) against the same loop with
Diffrax gradients (`engine="diffrax"`, or Kvaerno5 for Robertson), on the recipes'
`build(B, K)`: same data, optimizer, transform and tolerances on both sides.

- fit: per fit problem and B, time per update = (median T(N2) - median T(N1)) /
  (N2 - N1), T(N) a warm `fit(theta0, steps=N)`, sides alternated;
- compile: on the galactic build (B = 8), each side in fresh processes on a new
  persistent-cache directory, then a second process on the same one; compilations
  counted through `jax.monitoring`;
- checkpoints: what saving costs `recipes/multistart.py`'s Lotka-Volterra fit, light
  (16 starts through 8 slots, ~3 ms per update here) and heavy (96 starts through 96
  slots), 1000 updates each: the whole fit's wall time without checkpoints, saving
  every 25 updates, and saving every second of wall time, medians of alternated runs
  (one Calibrator per setting: the first round compiles, the timed ones do not).

    .venv/bin/python benchmarks/fit_vs_diffrax.py [--quick] [--only compile]
"""

import time
from unittest import mock

_T_START = time.perf_counter()  # a compile worker reports its imports' time from here

from _harness import ROOT, cli, fmt, log, md_table, run, target, timed_fit, warm  # noqa: E402

import datetime  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import gradsolve as gs  # noqa: E402

sys.path.append(str(ROOT / "recipes"))
import galactic_halo  # noqa: E402
import lorenz_rho  # noqa: E402
import multistart  # noqa: E402
import robertson_rates  # noqa: E402


def kvaerno5():
    return gs.engines.Diffrax(solver=__import__("diffrax").Kvaerno5())

# title, recipe, K, Calibrator settings of both sides, Diffrax engine and label,
# B values, (N1, N2), whether it carries the >= 3x target.
PROBLEMS = {
    "lorenz": ("Lorenz rho", lorenz_rho, 4, lambda: {"optimizer": optax.adam(0.3)},
               lambda: "diffrax", "Diffrax Tsit5", [1, 8, 64], (20, 220), True),
    "galactic": ("Galactic halo q", galactic_halo, 4,
                 lambda: {"optimizer": optax.adam(0.05), "ts": galactic_halo.TS,
                          "transform": {"q": gs.transforms.Bounded(0.5, 1.2)}},
                 lambda: "diffrax", "Diffrax Tsit5", [1, 8, 64], (20, 220), True),
    "robertson": ("Robertson k1, k3", robertson_rates, 3,
                  lambda: {"optimizer": optax.adam(0.05, b1=0.5, b2=0.9),
                           "ts": robertson_rates.TS, "rtol": 1e-7, "atol": 1e-11,
                           "transform": gs.transforms.Positive()},
                  kvaerno5, "Diffrax Kvaerno5", [1, 8], (5, 45), False),
}


def calibrators(name, B, data=None, refresh_every=None, sides=("replay", "diffrax")):
    _, recipe, K, settings, diffrax_engine, *_ = PROBLEMS[name]
    prob, to_params, loss, built, theta0 = recipe.build(B, K)[:5]
    engine = {"replay": lambda: None, "diffrax": diffrax_engine}
    return prob, to_params, theta0, {s: gs.Calibrator(
        prob, loss, to_params=to_params, data=built if data is None else data,
        engine=engine[s](), refresh_every=refresh_every, **settings()) for s in sides}


def fit_point(name, B, n1, n2, repeats):
    prob, to_params, theta0, cals = calibrators(name, B)
    K = PROBLEMS[name][2]
    for cal in cals.values():                 # compile: one untimed fit per steps value
        timed_fit(cal, theta0, n1), timed_fit(cal, theta0, n2)
    rep = cals["replay"]
    params = jax.tree.map(lambda x: x.reshape((B * K,) + x.shape[2:]),
                          jax.vmap(to_params)(theta0))
    record = lambda: gs.engines.ENGINES[rep.engine].record(prob, rep.config, params=params).h
    out = {"B": B, "n": prob.n, "n1": n1, "n2": n2, "engine": rep.engine,
           "method": rep.config.method, "mesh_S": int(record().shape[1]),
           "record_s": warm(record, repeats)["median_s"]}
    t = {s: {n1: [], n2: []} for s in cals}
    for _ in range(repeats):
        for s, cal in cals.items():           # alternate sides: they share the noise
            for n in (n1, n2):
                dt, out[f"theta_{s}"] = timed_fit(cal, theta0, n)
                t[s][n].append(dt)
    med = {s: {n: float(np.median(v)) for n, v in t[s].items()} for s in t}
    for s in cals:
        out[f"{s}_per_update_s"] = (med[s][n2] - med[s][n1]) / (n2 - n1)
        out[f"{s}_whole_fit_s"] = med[s][n2]
    a, b = (jax.tree.leaves(out.pop(f"theta_{s}").theta) for s in cals)
    out["theta_rel_diff"] = max(float(np.max(np.abs(x - y) / np.abs(y))) for x, y in zip(a, b))
    log(f"  {name} B={B}: x{out['diffrax_per_update_s'] / out['replay_per_update_s']:.2f}"
        " per update")
    return out


def fit(args):
    out = {}
    for name, (*_, sizes, ns, _) in PROBLEMS.items():
        ns = (3, 13) if args.quick else ns
        out[name] = [fit_point(name, B, *ns, args.repeats or 3)
                     for B in args.sizes or (sizes[:2] if args.quick else sizes)]
    return {"fits": out}


# ------------------------------------------------------------------- checkpoints

SAVES = {"none": None, "every 25 updates": 25, "every 1 s": datetime.timedelta(seconds=1)}
# (starts, slots): the recipe's light fit, one of ~20 ms an update (issue 27's SEIR fit),
# by Adam as first stored (the recipe's least-squares default ends in tens of updates).
FITS, ADAM = {"light": (16, 8), "heavy": (96, 96)}, {"optimizer": optax.adam(0.05)}


def checkpoints(args):
    steps, repeats = (200, 2) if args.quick else (1000, args.repeats or 3)
    out = {}
    for fit_name, (starts, slots) in FITS.items():
        times, saves = {name: [] for name in SAVES}, {}
        with tempfile.TemporaryDirectory() as root:
            # One Calibrator per setting, each fit a new one (resume=False discards
            # the last one's steps): its update compiles once, in the first round.
            cals = {name: multistart.build(starts, **ADAM, **({} if every is None else {
                "checkpoint_dir": os.path.join(root, f"setting{i}"), "checkpoint_every": every}))
                for i, (name, every) in enumerate(SAVES.items())}
            for rep, (name, (cal, theta0)) in itertools.product(range(repeats + 1),
                                                                 cals.items()):
                t = time.perf_counter()
                res = cal.fit(theta0, steps=steps, slots=slots, progress=False, resume=False)
                if rep:
                    times[name].append(time.perf_counter() - t)
                    saves[name] = sum(p.isdigit() for p in os.listdir(cal.checkpoint_dir or root))
        med = {name: float(np.median(v)) for name, v in times.items()}
        out[fit_name] = dict(starts=starts, slots=slots, steps=steps, steps_kept_on_disk=saves,
                             updates=int(res.updates), wall_s=times, median_s=med,
                             ms_per_update=1e3 * med["none"] / int(res.updates),
                             overhead={n: med[n] / med["none"] - 1 for n in SAVES if n != "none"})
    return out


def checkpoint_table(c):
    return md_table(["fit", "ms per update", "saves", "fit wall s (median)", "overhead"], [
        [f"{k}: {r['starts']} starts, {r['slots']} slots", f"{r['ms_per_update']:.1f}", n,
         f"{r['median_s'][n]:.2f}", "-" if n == "none" else f"{100 * r['overhead'][n]:+.0f} %"]
        for k, r in c.items() if k in FITS for n in r["median_s"]])


# ------------------------------------------------------------------- compile times

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class Compiles:
    """Every backend compile request (`COMPILE_EVENT`, recorded for persistent-cache
    hits too) and the persistent-cache hits among them, through `jax.monitoring`."""

    def __init__(self):
        self.n = self.hits = 0
        jax.monitoring.register_event_duration_secs_listener(
            lambda event, *_, **__: setattr(self, "n", self.n + (event == COMPILE_EVENT)))
        jax.monitoring.register_event_listener(lambda event, **_: setattr(
            self, "hits", self.hits + (event == "/jax/compilation_cache/cache_hits")))

    def timed(self, fn, ready=lambda out: out):
        """fn()'s result, and its wall time, compilations and cache hits."""
        n, hits, t = self.n, self.hits, time.perf_counter()
        out = fn()
        jax.block_until_ready(ready(out))
        return out, {"s": time.perf_counter() - t, "compilations": self.n - n,
                     "cache_hits": self.hits - hits}


def compile_worker(side, n2, refresh):
    """One fresh process's measurements for one side (run as a subprocess)."""
    imports_s, count = time.perf_counter() - _T_START, Compiles()
    t = time.perf_counter()
    prob, _, theta0, cals = calibrators("galactic", 8, sides=(side,))
    cal, out, setup_s = cals[side], {"engine": cals[side].engine}, time.perf_counter() - t
    fit = lambda steps: count.timed(lambda: timed_fit(cal, theta0, steps)[1].theta)[1]
    out["first"], out["new_steps"], out["warm_n2"] = fit(1), fit(n2), fit(n2)
    out["another"], out["warm_first"] = fit(2 * n2), fit(1)
    out["start_to_first_s"] = imports_s + setup_s + out["first"]["s"]
    if side == "replay" and refresh:
        out["refresh"] = refresh_fit(prob, count, theta0)
    return out


def refresh_fit(prob, count, theta0, B=8, K=4, q_low=0.55, every=10, steps=40):
    """A fit from q = 0.85 to data made at q = 0.55, refreshing every 10 updates: the
    mesh lengthens and outgrows its width. Private hooks wrapped (instrumentation)."""
    ys = gs.solve(prob.replace(params=dict(prob.params, q=jnp.full(prob.n, q_low))),
                  rtol=1e-10, atol=1e-12, ts=galactic_halo.TS).raise_for_status().ys
    _, _, _, cals = calibrators("galactic", B, ys[..., :3].reshape(B, K, -1, 3), every,
                                sides=("replay",))
    cal, rows, pending = cals["replay"], [], {}
    refresh, step = gs.calibrate._policies.Refresh.apply, cal._step  # (wrapped below)
    width = lambda window: int(window.state.mesh["h"].shape[1])

    def maybe_refresh(policy, window, *a):
        new, r = count.timed(lambda: refresh(policy, window, *a), lambda new: new.state.mesh)
        pending.update(refresh=r, width_before=width(window), width=width(new),
                       refreshed=int(new.state.refreshes) != int(window.state.refreshes))
        return new

    def timed_step(*a):  # one call of the compiled loop: `count` updates
        new, r = count.timed(lambda: step(*a), lambda new: new[0].loss)
        rows.append(dict(pending, call=len(rows) + 1, updates=int(new[1]), step=r))
        pending.clear()
        return new
    cal._step = timed_step
    with mock.patch.object(gs.calibrate._policies.Refresh, "apply", maybe_refresh):
        timed_fit(cal, theta0, steps)
    refreshes = [r for r in rows if r.get("refreshed")]
    warm_s = [r["step"]["s"] / r["updates"] for r in rows if not (r.get("refreshed") or
                                                                   r["step"]["compilations"])]
    return {"first": refreshes[0] if refreshes else None,
            "warm_update_s": float(np.median(warm_s)),
            "widened": next((r for r in refreshes if r["width"] != r["width_before"]), None)}


def compile_times(args):
    """Per side, fresh processes: A on an empty cache directory, B on A's; with
    EQX_ON_ERROR=nan (Diffrax's runtime checks off) A and B again on another."""
    out = {}
    for side in ("replay", "diffrax"):
        out[side] = {}
        with tempfile.TemporaryDirectory() as cache, tempfile.TemporaryDirectory() as cache_nan:
            for key, d, extra in [("A", cache, {}), ("B", cache, {})] + ([] if args.quick else [
                    ("A_nan", cache_nan, {"EQX_ON_ERROR": "nan"}),
                    ("B_nan", cache_nan, {"EQX_ON_ERROR": "nan"})]):
                env = {k: v for k, v in os.environ.items()
                       if k not in ("JAX_COMPILATION_CACHE_DIR", "EQX_ON_ERROR")}
                env.update(GRADSOLVE_COMPILATION_CACHE=d, **extra)
                res = subprocess.run([sys.executable, __file__, "--compile-worker", side,
                                      "--refresh", str(int(not extra))], env=env, cwd=ROOT,
                                     check=True, capture_output=True, text=True)
                out[side][key] = json.loads(res.stdout.strip().splitlines()[-1])
                log(f"  {side} {key}: first fit {out[side][key]['first']['s']:.1f} s")
    return {"n2": 50, "runs": out}


def cell(e, digits=1, hits=False, count=True):
    if e is None:
        return "n/a"
    plural = lambda k, w: f"{k} {w}" + ("" if k == 1 else "s")
    return f"{e['s']:.{digits}f} s" + (
        f" ({plural(e['compilations'], 'compilation')}"
        + (f", {plural(e['cache_hits'], 'cache hit')}" if hits else "") + ")" if count else "")


def refresh_cell(run, key):
    r = run.get("refresh")
    if r is None or r[key] is None:
        return "n/a (no mesh)" if r is None else "none"
    x = r[key]
    if key == "first":
        return f"{cell(x['refresh'], 2)}; its update {x['step']['s'] * 1e3:.1f} ms"
    return f"{cell(x['step'], 2, hits=True)}; refresh record {x['refresh']['s'] * 1e3:.0f} ms"


def compile_table(s):
    runs, n2 = s["runs"], s["n2"]
    w = runs["replay"]["A"].get("refresh", {}).get("widened")
    rows = [
        ("1. first update, fresh process, empty cache: first `fit(steps=1)` (compilations)",
         "A", lambda r: cell(r["first"])),
        ("   same `fit(steps=1)` again, warm", "A", lambda r: f"{r['warm_first']['s'] * 1e3:.1f} ms"),
        ("   process start to first update done (imports + build + Calibrator + fit)", "A",
         lambda r: f"{r['start_to_first_s']:.1f} s"),
        (f"2. new steps: `fit(steps={n2})` right after `fit(steps=1)`", "A",
         lambda r: cell(r["new_steps"], 2)),
        (f"   warm `fit(steps={n2})` (third call)", "A", lambda r: cell(r["warm_n2"], 2, count=False)),
        ("   difference: recompile cost of the new steps", "A",
         lambda r: f"{r['new_steps']['s'] - r['warm_n2']['s']:+.2f} s"),
        (f"   a third steps value: `fit(steps={2 * n2})` next", "A", lambda r: cell(r["another"], 2)),
        ("3. first refresh of a fit, mesh width unchanged: the refresh's record", "A",
         lambda r: refresh_cell(r, "first")),
        ("   update after a refresh that widened the mesh"
         + (f" (width {w['width_before']} -> {w['width']} columns)" if w else ""), "A",
         lambda r: refresh_cell(r, "widened")),
        ("   warm update (median of the non-refresh updates)", "A", lambda r: "n/a" if not
         r.get("refresh") else f"{r['refresh']['warm_update_s'] * 1e3:.2f} ms"),
        ("4. first update, second process, same cache: `fit(steps=1)`", "B",
         lambda r: cell(r["first"], hits=True)),
        ("   process start to first update done, second process", "B",
         lambda r: f"{r['start_to_first_s']:.1f} s"),
        ("   update after the widening refresh, second process", "B",
         lambda r: refresh_cell(r, "widened")),
        ("   `EQX_ON_ERROR=nan`, first process, empty cache: `fit(steps=1)`", "A_nan",
         lambda r: cell(r["first"], hits=True)),
        ("   `EQX_ON_ERROR=nan`, second process, same cache: `fit(steps=1)`", "B_nan",
         lambda r: cell(r["first"], hits=True)),
        ("   `EQX_ON_ERROR=nan`, process start to first update done", "B_nan",
         lambda r: f"{r['start_to_first_s']:.1f} s")]
    return md_table(["measurement", f"gradsolve ({runs['replay']['A']['engine']})",
                     "Diffrax (diffrax engine)"],
                    [[label] + [fn(runs[side][key]) if key in runs[side] else "-"
                                for side in ("replay", "diffrax")] for label, key, fn in rows])


def render(sections):
    out = {}
    if "fit" in sections:
        rows = [[PROBLEMS[name][0], f"{r['engine']} ({r['method']})", PROBLEMS[name][5], r["B"],
                 r["n"], r["mesh_S"], f"{r['record_s'] * 1e3:.2f}",
                 f"{r['replay_per_update_s'] * 1e3:.3f}", f"{r['diffrax_per_update_s'] * 1e3:.3f}",
                 fmt(r["diffrax_per_update_s"] / r["replay_per_update_s"]),
                 fmt(r["diffrax_whole_fit_s"] / r["replay_whole_fit_s"]),
                 f"{r['theta_rel_diff']:.1e}", f"{r['n1']}, {r['n2']}"]
                for name, per_b in sections["fit"]["fits"].items() for r in per_b]
        out["fit"] = md_table(
            ["fit", "replay engine (method)", "Diffrax solver", "B", "trajectories", "mesh S",
             "record ms", "replay ms/update", "Diffrax ms/update", "x per update",
             "x whole fit", "theta rel diff", "N1, N2"], rows)
    if "compile" in sections:
        out["compile"] = compile_table(sections["compile"])
    if "checkpoints" in sections:
        out["checkpoints"] = checkpoint_table(sections["checkpoints"])
    return out


def targets(sections):
    fits = sections.get("fit", {}).get("fits", {})
    saves = {f"{k}, {n}": 1 + v for k, r in sections.get("checkpoints", {}).items()
             if k in FITS for n, v in r["overhead"].items()}
    return [target("Checkpoints, fit time with saves / without (a light fit and a heavy "
                   "one)", "<=", 1.10, saves)] * bool(saves) + [
        target(f"Fitting loop, {PROBLEMS[name][0]}, time per update", ">=", 3,
               {f"B={r['B']}": r["diffrax_per_update_s"] / r["replay_per_update_s"]
                for r in fits[name]}) for name in fits if PROBLEMS[name][-1]]


if __name__ == "__main__":
    sections = {"fit": fit, "compile": compile_times, "checkpoints": checkpoints}
    args = cli(__doc__, sections, lambda ap: (
        ap.add_argument("--compile-worker", choices=("replay", "diffrax")),
        ap.add_argument("--refresh", type=int, default=1)))
    if args.compile_worker:
        print(json.dumps(compile_worker(args.compile_worker, 50, args.refresh)))
    else:
        run("fit_vs_diffrax", sections, render, targets, args)
