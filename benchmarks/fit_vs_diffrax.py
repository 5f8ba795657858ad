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
untimed for N = N1 and N = N2 (the Calibrator used to compile one update function
per `steps`; now nothing compiled depends on `steps`), then, `--repeats` times, alternating
the two sides, `fit(theta0, steps=N1)` and `fit(theta0, steps=N2)` are timed. Time
per update = (median T(N2) - median T(N1)) / (N2 - N1): the initial record, the
optimizer init and the rest of the setup cancel. The record at theta0 (the replay
engine's recorder, as `fit` calls it) is timed apart and reported; so is the whole
warm fit of N2 updates (record included, compile excluded), for a second ratio.
Agreement: after N2 updates, the largest relative difference |theta_replay -
theta_diffrax| / |theta_diffrax| over fits and parameters (the two sides
differentiate slightly different meshes).

Compile times (`--only compile` runs just these; the full run does them first):
on the galactic-halo build (B = 8, K = 4), each side in fresh subprocesses of this
script, XLA compilations counted with `jax.monitoring` on
"/jax/core/compile/backend_compile_duration" (persistent-cache hits, counted apart on
"/jax/compilation_cache/cache_hits", fire it too):
1. the first `fit(theta0, steps=1)` of a new Calibrator in a fresh process with an
   empty persistent-cache directory (`GRADSOLVE_COMPILATION_CACHE=<tmpdir>`), and
   the time from process start (imports, build, Calibrator) to it being done;
2. `fit(steps=N)` (`--compile-n2`, default 50) right after, its warm repeat, and a
   third value `fit(steps=2N)`: nothing compiled depends on `steps`;
3. (replay only; Diffrax has no mesh) a second Calibrator with `refresh_every`
   (`--refresh-every`, default 10) fitting data made at a low q (`--q-low`, 0.55) from
   q = 0.85 for `--refresh-steps` (40) updates: the mesh lengthens and a refresh
   outgrows its padded width (`Mesh.widened`); the update after it is timed and its
   compilations counted (the Calibrator's private `_maybe_refresh`/`_step` are
   wrapped for per-update timing);
4. the same process again on the same cache directory (cache hits), and a pair of
   processes with `EQX_ON_ERROR=nan` on another fresh directory (Diffrax's runtime
   checks, through Equinox, hold a host callback whose per-process pointer enters
   JAX's cache key; gradsolve's update holds none).
They are stored under the JSON's "compile" key and rendered as "### Compile times".

Outputs: a table on stdout, `benchmarks/results/fit_vs_diffrax.json` (raw times,
settings, machine, versions) and the section between `<!-- fit_vs_diffrax:start -->`
and `<!-- fit_vs_diffrax:end -->` in `docs/benchmarks.md`.

Run (from the repository root):

    .venv/bin/python benchmarks/fit_vs_diffrax.py            # full run, ~10-15 min
    .venv/bin/python benchmarks/fit_vs_diffrax.py --quick    # smoke test, writes nothing

Options: `--sizes 1,8,64`, `--problems lorenz,galactic[,robertson]`,
`--robertson-sizes 1,8`, `--n1 N1 --n2 N2`, `--repeats R`, `--out PATH`,
`--docs PATH` (`--out ''` / `--docs ''` to skip writing), `--only fit|compile` (run
one part, keeping the other's stored results), `--compile-n2 N`, `--refresh-every R`,
`--refresh-steps S`, `--q-low Q`, `--no-cache-run` (compile times: also a process with
the cache off).

    .venv/bin/python benchmarks/fit_vs_diffrax.py --only compile   # ~15 min on 2 cores
"""

import time

_T_START = time.perf_counter()  # the compile worker reports its imports' time from here

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import jax.numpy as jnp  # noqa: E402
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
COMPILE_TITLE = "### Compile times"
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


# ------------------------------------------------------------------- compile times

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
COMPILE_SIDES = ("replay", "diffrax")


class CompileCounter:
    """XLA compilations seen through `jax.monitoring`: every backend compile request
    (the event `COMPILE_EVENT`, which JAX records around `compile_or_get_cached`, so a
    persistent-cache hit counts as one too, with its load time) and the persistent-
    cache hits among them."""

    def __init__(self):
        self.events, self.hits = [], 0
        jax.monitoring.register_event_duration_secs_listener(self._duration)
        jax.monitoring.register_event_listener(self._event)

    def _duration(self, event, duration, **kwargs):
        if event == COMPILE_EVENT:
            self.events.append((str(kwargs.get("fun_name", "?")), float(duration)))

    def _event(self, event, **kwargs):
        if event == CACHE_HIT_EVENT:
            self.hits += 1

    def mark(self):
        return len(self.events), self.hits

    def since(self, mark):
        n, hits = mark
        new = self.events[n:]
        return {"compilations": len(new), "cache_hits": self.hits - hits,
                "compile_s": sum(d for _, d in new),
                "largest": sorted(({"fun": f, "s": round(d, 3)} for f, d in new),
                                  key=lambda e: -e["s"])[:3]}


def _galactic_low_q_data(prob, B, K, q):
    """Noise-free observations of the galactic build's stars in a halo of flattening
    `q` for every fit: a fit started at the recipe's 0.85 walks q down, its mesh
    lengthens (more steps at smaller q), and a refresh outgrows the padded width."""
    params = dict(prob.params, q=jnp.full(prob.n, q))
    ys = gs.solve(prob.replace(params=params), rtol=1e-10, atol=1e-12,
                  ts=galactic_halo.TS).raise_for_status().ys[..., :3]
    return ys.reshape(B, K, len(galactic_halo.TS), 3)


def _instrument(cal, counter, log_rows):
    """Wrap the Calibrator's per-update hooks (private: benchmark instrumentation
    only) to log, per update, the refresh (if any), the mesh width, the wall time and
    the compilations."""
    refresh, step = cal._maybe_refresh, cal._step
    pending = {}

    def width(state):
        return None if state.mesh is None else int(state.mesh["h"].shape[1])

    def maybe_refresh(state, static, K, done):
        mark, t = counter.mark(), time.perf_counter()
        new = refresh(state, static, K, done)
        jax.block_until_ready(new.mesh)
        pending.update(update=done + 1, width_before=width(state), width=width(new),
                       refreshed=int(new.refreshes) != int(state.refreshes),
                       refresh_s=time.perf_counter() - t, refresh=counter.since(mark))
        return new

    def timed_step(state, static, tol, grad_tol, cap):
        mark, t = counter.mark(), time.perf_counter()
        new = step(state, static, tol, grad_tol, cap)
        jax.block_until_ready(new.loss)
        log_rows.append(dict(pending, update_s=time.perf_counter() - t,
                             step=counter.since(mark)))
        pending.clear()
        return new

    cal._maybe_refresh, cal._step = maybe_refresh, timed_step


def compile_worker(side, n2, refresh_every, refresh_steps, q_low, B=8, K=4):
    """One fresh process's compile-time measurements for one side (see the module
    docstring); returns a JSON-able dict."""
    imports_s = time.perf_counter() - _T_START
    counter = CompileCounter()
    spec = PROBLEMS["galactic"]
    out = {"side": side, "B": B, "K": K, "imports_s": imports_s,
           "cache_dir": jax.config.jax_compilation_cache_dir,
           "gradsolve_cache_setting": os.environ.get("GRADSOLVE_COMPILATION_CACHE")}

    mark, t = counter.mark(), time.perf_counter()
    prob, to_params, loss, data, theta0 = galactic_halo.build(B, K)[:5]
    out["build_s"], out["build"] = time.perf_counter() - t, counter.since(mark)

    def calibrator(data, refresh):
        engine = None if side == "replay" else spec["diffrax"]()
        return gs.Calibrator(prob, loss, to_params=to_params, data=data, engine=engine,
                             refresh_every=refresh, **spec["cal"]())

    def fit(cal, steps, th=None):
        mark, t = counter.mark(), time.perf_counter()
        res = timed_fit(cal, theta0 if th is None else th, steps)[1]
        return dict(s=time.perf_counter() - t, steps=steps, **counter.since(mark)), res

    mark, t = counter.mark(), time.perf_counter()
    cal = calibrator(data, None)
    out["calibrator_init_s"], out["calibrator_init"] = (time.perf_counter() - t,
                                                        counter.since(mark))
    out["engine"] = cal.engine
    out["first_update"] = fit(cal, 1)[0]
    out["new_steps"] = fit(cal, n2)[0]
    out["warm_n2"] = fit(cal, n2)[0]
    out["another_steps"] = fit(cal, 2 * n2)[0]
    out["warm_first_update"] = fit(cal, 1)[0]
    # Why a new steps value can compile: the recipe's theta0 (jnp.full) is weakly
    # typed, an updated state is not, so the second update of a fit traces anew.
    out["theta0_weak_type"] = any(getattr(x, "weak_type", False)
                                  for x in jax.tree.leaves(theta0))
    out["new_steps_minus_warm_s"] = out["new_steps"]["s"] - out["warm_n2"]["s"]
    out["since_start_to_first_update_s"] = (imports_s + out["build_s"]
                                            + out["calibrator_init_s"]
                                            + out["first_update"]["s"])
    if side != "replay" or not refresh_steps:
        out["refresh"] = None
        return out

    # A refresh that widens the mesh: a second Calibrator (same settings, refresh
    # every `refresh_every` updates) on data of a lower q.
    low = _galactic_low_q_data(prob, B, K, q_low)
    cal2 = calibrator(low, refresh_every)
    rows_ = []
    _instrument(cal2, counter, rows_)
    summary, res = fit(cal2, refresh_steps)
    widened = [r for r in rows_ if r.get("refreshed") and r["width"] != r["width_before"]]
    plain = [r["update_s"] for r in rows_ if not r.get("refreshed")
             and r["step"]["compilations"] == 0]
    out["refresh"] = {
        "q_low": q_low, "refresh_every": refresh_every, "steps": refresh_steps,
        "fit": summary, "refreshes": int(res.refreshes),
        "first_update": rows_[0] if rows_ else None,
        "first_refresh": next((r for r in rows_ if r.get("refreshed")), None),
        "widths": [r["width"] for r in rows_],
        "widened": widened,
        "warm_update_median_s": float(np.median(plain)) if plain else None,
        "q_final": np.asarray(res.theta["q"]).tolist(),
        "per_update": rows_}
    return out


def _cache_files(directory):
    return sum(1 for p in Path(directory).rglob("*") if p.is_file())


def measure_compile(n2, refresh_every, refresh_steps, q_low, no_cache_run=False,
                    eqx_nan_run=True):
    """Run `compile_worker` for each side in fresh processes: twice on one fresh
    persistent-cache directory (the second process finds the first one's compiles);
    with `eqx_nan_run` twice more on another fresh directory with `EQX_ON_ERROR=nan`
    (Diffrax's runtime checks, through Equinox, whose host callback puts a per-process pointer into
    the compiled code and so into JAX's cache key, switched off; no refresh fit);
    with `no_cache_run` once more with the cache off."""
    results = {}
    for side in COMPILE_SIDES:
        runs = []
        with tempfile.TemporaryDirectory(prefix="gradsolve-jax-cache-") as cache, \
                tempfile.TemporaryDirectory(prefix="gradsolve-jax-cache-") as cache_nan:
            plan_ = [("A", "first process, empty cache", cache, {}),
                     ("B", "second process, same cache", cache, {})]
            if eqx_nan_run:
                nan = {"EQX_ON_ERROR": "nan"}
                plan_ += [("A_nan", "EQX_ON_ERROR=nan, first process, empty cache",
                           cache_nan, nan),
                          ("B_nan", "EQX_ON_ERROR=nan, second process, same cache",
                           cache_nan, nan)]
            if no_cache_run:
                plan_.append(("off", "cache off (GRADSOLVE_COMPILATION_CACHE=0)", "0", {}))
            for key, label, setting, extra_env in plan_:
                env = dict(os.environ, GRADSOLVE_COMPILATION_CACHE=setting, **extra_env)
                env.pop("JAX_COMPILATION_CACHE_DIR", None)
                if not extra_env:
                    env.pop("EQX_ON_ERROR", None)
                with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
                    path = f.name
                cmd = [sys.executable, str(Path(__file__).resolve()), "--compile-worker",
                       side, "--compile-out", path, "--compile-n2", str(n2),
                       "--refresh-every", str(refresh_every),
                       "--refresh-steps", str(refresh_steps if key in ("A", "B") else 0),
                       "--q-low", str(q_low)]
                t = time.perf_counter()
                subprocess.run(cmd, env=env, check=True, cwd=ROOT)
                wall = time.perf_counter() - t
                run = json.loads(Path(path).read_text())
                Path(path).unlink()
                run.update(key=key, label=label, process_wall_s=wall, env=extra_env,
                           cache_files_after=(_cache_files(setting) if setting != "0"
                                              else None))
                runs.append(run)
                fu = run["first_update"]
                log(f"  {side}, {label}: first fit(steps=1) {fu['s']:.1f} s "
                    f"({fu['compilations']} compilations, {fu['cache_hits']} cache hits); "
                    f"new steps {run['new_steps']['s']:.2f} s "
                    f"({run['new_steps']['compilations']} compilations); process "
                    f"{wall:.1f} s")
        results[side] = {"engine": runs[0]["engine"], "runs": runs}
    return results


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


def markdown(report, out_path):
    """The docs section: the per-update comparison (when the report has it), then the
    compile times (when it has them), each with its own machine and command line."""
    parts = []
    if report.get("results"):
        parts.append(fit_markdown(report, report["command"], out_path))
    if report.get("compile"):
        parts.append(compile_markdown(report["compile"], out_path))
    return "\n\n".join(parts)


def fit_markdown(report, command, out_path):
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


def _n(count, word):
    return f"{count} {word}" + ("" if count == 1 else "s")


def _cell(entry, digits=1, count=True, hits=False):
    if entry is None:
        return "n/a"
    text = f"{entry['s']:.{digits}f} s"
    if count:
        extra = _n(entry["compilations"], "compilation")
        if hits:
            extra += ", " + _n(entry["cache_hits"], "cache hit")
        text += f" ({extra})"
    return text


def compile_rows(comp):
    s = comp["settings"]
    res = comp["results"]
    sides = [res[side] for side in COMPILE_SIDES]

    def run(side, key):
        return next((r for r in side["runs"] if r.get("key") == key), None)

    def row(label, fn):
        return [label] + [fn(side) for side in sides]

    def widened(side):
        r = run(side, "A")["refresh"]
        return r["widened"][0] if r and r["widened"] else None

    def refresh_cell(side, key):
        r = run(side, key)["refresh"]
        if r is None:
            return "n/a (no mesh)"
        w = [x for x in r["widened"]]
        if not w:
            return "no refresh widened the mesh"
        x = w[0]
        return (f"{x['update_s']:.2f} s ({_n(x['step']['compilations'], 'compilation')}, "
                f"{_n(x['step']['cache_hits'], 'cache hit')}; refresh record "
                f"{x['refresh_s'] * 1e3:.0f} ms)")

    def first_refresh(side):
        r = run(side, "A")["refresh"]
        if r is None:
            return "n/a (no mesh)"
        x = r["first_refresh"]
        if x is None:
            return "no refresh"
        return (f"{x['refresh_s']:.2f} s ({_n(x['refresh']['compilations'], 'compilation')}); "
                f"its update {x['update_s'] * 1e3:.1f} ms ({x['step']['compilations']})")

    n2 = s["n2"]
    rows_ = [
        row("1. first update, fresh process, empty cache: first `fit(steps=1)` of a fresh "
            "Calibrator (XLA compilations)", lambda d: _cell(run(d, "A")["first_update"])),
        row("   same `fit(steps=1)` again, warm",
            lambda d: f"{run(d, 'A')['warm_first_update']['s'] * 1e3:.1f} ms"),
        row("   process start to first update done (imports + build + Calibrator + fit)",
            lambda d: f"{run(d, 'A')['since_start_to_first_update_s']:.1f} s"),
        row(f"2. new steps: `fit(steps={n2})` right after `fit(steps=1)` (compilations)",
            lambda d: _cell(run(d, "A")["new_steps"], 2)),
        row(f"   warm `fit(steps={n2})` (third call)",
            lambda d: _cell(run(d, "A")["warm_n2"], 2, count=False)),
        row("   difference: recompile cost of the new steps",
            lambda d: f"{run(d, 'A')['new_steps_minus_warm_s']:+.2f} s"),
        row(f"   a third steps value: `fit(steps={2 * n2})` next (compilations)",
            lambda d: _cell(run(d, "A")["another_steps"], 2)),
        row("3. first refresh of a fit, mesh width unchanged: the refresh's record "
            "(compilations)", lambda d: first_refresh(d)),
        row("   update after a refresh that widened the mesh (" + (
            f"width {widened(sides[0])['width_before']} -> {widened(sides[0])['width']} "
            "columns"
            if widened(sides[0]) else "no widening") + ")", lambda d: refresh_cell(d, "A")),
        row("   warm update (median of the non-refresh updates)",
            lambda d: "n/a" if run(d, "A")["refresh"] is None else
            f"{run(d, 'A')['refresh']['warm_update_median_s'] * 1e3:.2f} ms"),
        row("4. first update, second process, cache filled by the first: `fit(steps=1)`",
            lambda d: _cell(run(d, "B")["first_update"], hits=True) if run(d, "B") else "-"),
        row("   process start to first update done, second process",
            lambda d: f"{run(d, 'B')['since_start_to_first_update_s']:.1f} s"
            if run(d, "B") else "-"),
        row("   update after the widening refresh, second process",
            lambda d: refresh_cell(d, "B") if run(d, "B") else "-"),
    ]
    if all(run(d, "A_nan") and run(d, "B_nan") for d in sides):
        rows_ += [
            row("   with `EQX_ON_ERROR=nan`, first process, empty cache: `fit(steps=1)`",
                lambda d: _cell(run(d, "A_nan")["first_update"], hits=True)),
            row("   with `EQX_ON_ERROR=nan`, second process, same cache: `fit(steps=1)`",
                lambda d: _cell(run(d, "B_nan")["first_update"], hits=True)),
            row("   with `EQX_ON_ERROR=nan`, process start to first update done, "
                "first / second process",
                lambda d: f"{run(d, 'A_nan')['since_start_to_first_update_s']:.1f} s / "
                          f"{run(d, 'B_nan')['since_start_to_first_update_s']:.1f} s")]
    if all(run(d, "off") for d in sides):
        rows_.append(row("   (cache off, `GRADSOLVE_COMPILATION_CACHE=0`: first `fit(steps=1)`)",
                         lambda d: _cell(run(d, "off")["first_update"])))
    head = ["measurement", f"gradsolve ({sides[0]['engine']})",
            f"Diffrax ({sides[1]['engine']} engine)"]
    return head, rows_


def _steps_note(comp):
    """What the measured counts of item 2 say (written from the numbers)."""
    notes = []
    for side in COMPILE_SIDES:
        run = comp["results"][side]["runs"][0]
        if run["new_steps"]["compilations"] and not run["another_steps"]["compilations"]:
            funs = sorted({e["fun"] for e in run["new_steps"]["largest"]})
            notes.append(
                f"{'gradsolve' if side == 'replay' else 'Diffrax'}: the second fit "
                f"compiled {_n(run['new_steps']['compilations'], 'time')} "
                f"({', '.join(f'`{f}`' for f in funs)}) and the third none")
    if not notes:
        return ""
    weak = comp["results"]["replay"]["runs"][0].get("theta0_weak_type")
    return (" Measured: " + "; ".join(notes) + ". That compile is not a dependence on "
            "`steps`: the first fit ran a single update, and the second update of any "
            "fit traces the update anew"
            + (" because the recipe's theta0 (`jnp.full(B, 0.85)`) is weakly typed, so "
               "the initial state's parameters and Adam moments are too, while an "
               "update's outputs are not" if weak else "")
            + ". A first fit of two or more updates compiles both variants.")


def _cache_note(comp):
    """What the second process's cache hits say (written from the numbers)."""
    parts = []
    for side in COMPILE_SIDES:
        runs = {r.get("key"): r for r in comp["results"][side]["runs"]}
        a, b = runs.get("A"), runs.get("B")
        if not (a and b):
            continue
        upd = [e["s"] for e in b["first_update"]["largest"] if e["fun"] == "jit(_update_impl)"]
        name = "gradsolve" if side == "replay" else "Diffrax"
        parts.append(f"{name}: {b['first_update']['cache_hits']} of "
                     f"{b['first_update']['compilations']} compile requests of the first "
                     "fit came from the cache"
                     + (f", but not the update (`jit(_update_impl)` compiled again, "
                        f"{upd[0]:.1f} s)" if upd and upd[0] > 1.0 else ""))
    note = " Measured: " + "; ".join(parts) + "." if parts else ""
    note += (" Diffrax's update holds a host callback (its runtime checks, through "
             "Equinox's `error_if`, with `EQX_ON_ERROR=raise`, the default), and JAX's "
             "cache key keeps the callback's pointer, which can differ from process to "
             "process, so whether its update hits the cache is a matter of chance; with "
             "`EQX_ON_ERROR=nan` (checks off: a failed check gives NaN) the pointer is "
             "gone (the `EQX_ON_ERROR=nan` rows). gradsolve's update holds no callback "
             "(its jaxpr, checked with `jax.make_jaxpr`, has none).")
    return note


def _refresh_note(comp):
    run = comp["results"]["replay"]["runs"][0]
    r = run["refresh"]
    x = r and r["first_refresh"]
    if not x or not x["refresh"]["compilations"]:
        return ""
    funs = [e["fun"] for e in x["refresh"]["largest"]]
    return (f" The fit's first refresh (update {x['update']}, width unchanged) compiled "
            f"{x['refresh']['compilations']} times in its record (largest: "
            + ", ".join(f"`{f}`" for f in funs) + "): the record at the updated "
            "parameters does not reuse the initial record's compiled recorder.")


def compile_markdown(comp, out_path):
    s, m, v = comp["settings"], comp["machine"], comp["versions"]
    rep = comp["results"]["replay"]["runs"][0]
    r = rep["refresh"]
    wid = r["widened"] if r else []
    lines = [
        COMPILE_TITLE, "",
        "Compile-related wall times of the same `gs.Calibrator` loop on the galactic-halo "
        f"fit (`recipes/galactic_halo.py` build, B = {s['B']}, K = {s['K']}, settings as "
        "above, `refresh_every=None`), gradsolve's replay engine (`engine=None`) against "
        "Diffrax gradients (`engine=\"diffrax\"`). Each side runs in its own fresh "
        "processes (one measurement each, no repeats): a first process on a new, empty "
        "persistent-cache directory (`GRADSOLVE_COMPILATION_CACHE=<tmpdir>`), then a "
        "second process on the same directory, which finds the first one's compiled "
        "code. Compilations are counted with `jax.monitoring` on "
        f"`{COMPILE_EVENT}`, which JAX records for every backend compile request, a "
        "persistent-cache hit included (`/jax/compilation_cache/cache_hits` counts "
        "those apart). Times are wall times and include tracing and lowering; "
        "float64, CPU.", "",
        md_table(*compile_rows(comp)), "",
        f"1. Process A's first `fit(theta0, steps=1)` on a new Calibrator: record at "
        "theta0 (replay only), the update's trace and compile, the small eager ops "
        "around it. \"Process start\" adds Python imports (jax, gradsolve, diffrax, "
        "optax), the recipe's build (a reference solve at rtol 1e-10 for the data) and "
        "the Calibrator's construction.",
        f"2. On the same Calibrator, `fit(steps={s['n2']})` after `fit(steps=1)`, then "
        f"again (warm); the difference is what the new `steps` cost beyond compute. "
        "Nothing compiled depends on `steps` (the history lives on the host), so no "
        "compilation is expected on either side; a third value, "
        f"`fit(steps={2 * s['n2']})`, follows." + _steps_note(comp),
        "3. A second Calibrator (same settings, `refresh_every="
        f"{s['refresh_every']}`) fits noise-free data made at q = {s['q_low']} from the "
        f"recipe's start q = 0.85 for {s['refresh_steps']} updates: as q falls, the "
        "recorded mesh lengthens, and a refresh outgrows the padded width "
        "(`Mesh.widened`: 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, ... columns). The "
        "row is the wall time and compilations of the update right after that "
        "refresh (the refresh's own record is timed apart)"
        + (f"; widths met: {sorted(set(r['widths']))}, widening refresh(es) before "
           f"update(s) {[x['update'] for x in wid]}" if r else "")
        + "." + _refresh_note(comp) + " Diffrax has no mesh: n/a. (Per-update "
        "timing wraps the Calibrator's "
        "private `_maybe_refresh`/`_step`; benchmark instrumentation only.)",
        "4. Process B repeats process A on A's cache directory." + _cache_note(comp)
        + " Diffrax's compiles go "
        "through JAX's persistent cache too: gradsolve enables the cache on import "
        "(`src/gradsolve/_compilation_cache.py`), and the Diffrax side runs inside "
        "`gs.Calibrator`, so its compiles are cached under the same rules; a script "
        "using Diffrax alone "
        "gets this only after enabling JAX's cache itself.",
        "",
        f"Machine: {m['cpu_model']} ({m['cpu_count']} CPUs, {m['memory_gib']} GiB), "
        f"{m['platform']}; jax {v['jax']}, diffrax {v['diffrax']}, optax "
        f"{comp['optax']}, gradsolve {v['gradsolve']} (commit {v['git_commit']}"
        + (", with uncommitted changes under src/" if v["src_uncommitted_changes"] else "")
        + f"); {comp['date']}. The machine (2 CPU cores) was shared with other "
        "developers' processes during the run, and each number is a single "
        "measurement: compile times on it vary by tens of percent from run to run.",
        "",
        f"Reproduce: `{comp['command']}`"
        + (f" (raw numbers: `{display_path(out_path)}`, key `compile`)." if out_path else "."),
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
    ap.add_argument("--only", choices=("fit", "compile"), default=None,
                    help="run one part: 'fit' (time per update; the stored compile "
                         "times are kept) or 'compile' (compile times; the stored "
                         "per-update results are kept)")
    ap.add_argument("--compile-n2", type=int, default=50,
                    help="compile times: the second fit's steps (default 50)")
    ap.add_argument("--refresh-every", type=int, default=10,
                    help="compile times: refresh_every of the widening fit (default 10)")
    ap.add_argument("--refresh-steps", type=int, default=40,
                    help="compile times: updates of the widening fit (default 40)")
    ap.add_argument("--q-low", type=float, default=0.55,
                    help="compile times: q of the widening fit's data (default 0.55)")
    ap.add_argument("--no-cache-run", action="store_true",
                    help="compile times: a third process per side with the cache off")
    ap.add_argument("--compile-worker", choices=COMPILE_SIDES, default=None,
                    help=argparse.SUPPRESS)
    ap.add_argument("--compile-out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.compile_worker:
        result = compile_worker(args.compile_worker, args.compile_n2, args.refresh_every,
                                args.refresh_steps, args.q_low)
        Path(args.compile_out).write_text(json.dumps(result, indent=1) + "\n")
        return result

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

    stored = {}
    if args.only and Path(out or DEFAULT_OUT).exists():
        stored = json.loads(Path(out or DEFAULT_OUT).read_text())
    env = versions()
    compile_report = stored.get("compile")
    if args.only != "fit":
        log(f"fit_vs_diffrax compile times: galactic B=8, K=4, new steps "
            f"{args.compile_n2}, widening fit refresh_every={args.refresh_every}, "
            f"{args.refresh_steps} updates, q_low={args.q_low}")
        t_start = time.perf_counter()
        compile_report = {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
                timespec="seconds"),
            "command": command,
            "settings": {"problem": "galactic", "B": 8, "K": 4, "n2": args.compile_n2,
                         "refresh_every": args.refresh_every,
                         "refresh_steps": args.refresh_steps, "q_low": args.q_low,
                         "no_cache_run": args.no_cache_run,
                         "compile_event": COMPILE_EVENT, "cache_hit_event": CACHE_HIT_EVENT,
                         "processes": "per side: a fresh process on an empty temporary "
                                      "cache directory, then a second on the same one"},
            "machine": machine(), "versions": env, "optax": optax.__version__,
            "results": measure_compile(args.compile_n2, args.refresh_every,
                                       args.refresh_steps, args.q_low, args.no_cache_run)}
        compile_report["total_wall_s"] = time.perf_counter() - t_start
        head, body = compile_rows(compile_report)
        log("\nCompile times\n" + text_table(head, body))
    if args.only == "compile":
        report = stored or {"benchmark": "fit_vs_diffrax", "results": {}}
        report["compile"] = compile_report
        save(report, out, docs, lambda: markdown(report, out), START, END, log)
        return report

    log(f"fit_vs_diffrax: problems {problems}, B {sizes}, updates N1={n1}, N2={n2}, "
        f"{args.repeats} repeats")
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
    if compile_report:
        report["compile"] = compile_report

    head, body = rows(results)
    log("\nTime per optimizer update (x = Diffrax / replay)\n" + text_table(head, body))
    log("\nTargets:\n" + "\n".join(f"- {t['text']}" for t in report["verdicts"].values()))
    log(f"\ntotal {report['total_wall_s']:.0f} s")
    save(report, out, docs, lambda: markdown(report, out), START, END, log)
    return report


if __name__ == "__main__":
    main()
