"""Stiff and high-order gradient benchmark: gradsolve's record-and-replay against
Diffrax at matched achieved accuracy.

Problems (float64), each an ensemble of n trajectories, loss a scalar of the final
states:

1. Robertson (`gs.problems.robertson(n)`), gradient w.r.t. the rates (k1, k2, k3 of
   every trajectory; k1 and k3 are checked), loss `sum(y1**2) + 1e4 * sum(y2)`:
   rodas5p replay (reverse and forward mode) and rosenbrock23 replay (reverse, loose
   tolerances) against Diffrax Kvaerno5 (RecursiveCheckpointAdjoint, ForwardMode).
2. HIRES (`gs.problems.hires(n)`), gradient w.r.t. the 8-component initial state,
   loss `sum(ys**2)`: rodas5p reverse replay against Kvaerno5 (checkpointed).
3. Lorenz (`gs.problems.lorenz(n)`), gradient w.r.t. (sigma, rho, beta), loss
   `sum(ys**2)`: vern7 reverse replay against Diffrax Dopri8 (checkpointed).
4. Linear, d = 32 (`gs.problems.linear(n, d=32)`), gradient w.r.t. y0, loss
   `sum(ys**2)`: vern7 and tsit5 reverse replay against Diffrax Dopri8 and Tsit5,
   every gradient also checked against the closed form
   dL/dy0 = expm(lam A T)^T dL/dy(T).

Protocol. For every problem, ensemble size n and tolerance, on each side, as the
median of warm repeats (one untimed first call compiles; compilation is excluded):
gradsolve: `gs.record(recorder="general")` (timed on its own, left out of the
gradient times), then `gs.value_and_grad(..., mesh=mesh, engine="general_replay")`
(both pinned rather than routed, so that the run measures the JAX replay whatever
other engines the working tree offers); Diffrax: the gradient through
`gs.value_and_grad(..., engine=gs.engines.Diffrax(solver=...))` with a tight
`max_steps` (Diffrax's own attempted steps, from an untimed solve, plus 10%), in
reverse mode the faster of Diffrax's default checkpoints and one checkpoint per step
(`checkpoints=max_steps`; which one is kept). atol = rtol * factor (1e-4 for the
stiff systems, whose small species sit near 1e-5, 1e-3 otherwise). The two sides use
their own tolerance lists, chosen so that their achieved errors overlap (Kvaerno5 is
much more accurate than its rtol on Robertson).

Achieved error of the final states against a reference: stiff systems componentwise,
max over trajectories and components of |y - y_ref| / |y_ref| (every species counts,
the small ones too); Lorenz and linear normwise, max over trajectories of
max|y - y_ref| / max|y_ref|. References: Robertson/HIRES at n = 4 the stored SciPy
Radau values (`tests/data/stiff_references.json`), other n `gs.solve(rodas5p,
rtol=1e-12, atol=1e-16)` (checked against the stored Radau values at n = 4); Lorenz
`gs.solve(vern7, rtol=1e-14, atol=1e-16)` (checked against grad_vs_diffrax's tsit5
reference); linear the closed form `gs.problems.linear_exact`. Gradient errors are
max|g - g_ref| / max|g_ref| over the ensemble, per differentiated input, against a
tight replay gradient (rtol 1e-10 stiff, 1e-12 Lorenz) or the closed form.

Matched accuracy. Each side's (error, gradient time) points are reduced to their
Pareto front (a point both slower and less accurate than another is dropped), and
log(time) is interpolated linearly in log(error) on each side. Ratios Diffrax time /
gradsolve time are reported at errors inside the overlap of the two error ranges:
at the "loose" error (1e-4, or the nearest end of the overlap when 1e-4 is outside
it) and at four levels across the overlap. Also reported: the time to reach error
<= 1e-4 on each side, where a side whose loosest point is already below 1e-4 is
charged that point's time (marked "clamped"; an upper bound for that side).

Outputs: tables on stdout, `benchmarks/results/stiff_and_high_order.json` (all raw
medians, settings, errors, machine, versions) and the section between
`<!-- stiff_and_high_order:start -->` and `<!-- stiff_and_high_order:end -->` in
`docs/benchmarks.md`.

Run (from the repository root):

    .venv/bin/python benchmarks/stiff_and_high_order.py            # full run, ~15-20 min
    .venv/bin/python benchmarks/stiff_and_high_order.py --quick    # smoke test, writes nothing

Options: `--problems robertson,hires,lorenz,linear`, `--stiff-sizes 8,64,256`,
`--lorenz-sizes 1024`, `--linear-sizes 256`, `--repeats R`, `--out PATH`,
`--docs PATH` (`--out ''` / `--docs ''` to skip writing).
"""

import jax

jax.config.update("jax_enable_x64", True)

import argparse  # noqa: E402
import datetime  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import diffrax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import scipy.linalg  # noqa: E402

import gradsolve as gs  # noqa: E402
from _common import write_docs  # noqa: E402
from grad_vs_diffrax import (ROOT, display_path, log, log_interp, machine,  # noqa: E402
                             md_table, reference as tsit5_reference, rel_diff, state_error,
                             text_table, timeit_warm, versions)


DEFAULT_OUT = ROOT / "benchmarks" / "results" / "stiff_and_high_order.json"
DEFAULT_DOCS = ROOT / "docs" / "benchmarks.md"
START, END = "<!-- stiff_and_high_order:start -->", "<!-- stiff_and_high_order:end -->"
SECTION_TITLE = "## Stiff and high-order gradients vs Diffrax"
STIFF_REF_PATH = ROOT / "tests" / "data" / "stiff_references.json"

LOOSE_ERROR = 1e-4
DIFFRAX_SOLVE_MAX_STEPS = 16384       # untimed solve that finds Diffrax's step count
MAX_STEPS_MARGIN = 1.1                # tight max_steps = attempted * 1.1, rounded up
# gradsolve's side, pinned (not left to the router): the batched JAX recorder and the
# padded JAX replay, whatever other engines a working tree may route to.
OUR_RECORDER, OUR_ENGINE = "general", "general_replay"


# ------------------------------------------------------------------------ problems

def robertson_loss(ys, params):
    return jnp.sum(ys[:, 0] ** 2) + 1e4 * jnp.sum(ys[:, 1])


def sum_squares(ys, params):
    return jnp.sum(ys ** 2)


def specs(quick):
    """Per problem: builder, loss, what is differentiated, tolerance lists per side
    and per method, and the comparisons (ours method, mode) vs (theirs, mode)."""
    q = quick
    return {
        "robertson": dict(
            title="Robertson: rodas5p / rosenbrock23 replay vs Diffrax Kvaerno5",
            build=lambda n: gs.problems.robertson(n), loss=robertson_loss,
            loss_text="sum(y1(T)**2) + 1e4 * sum(y2(T))", wrt="params",
            wrt_text="rates (k1, k2, k3) of every trajectory", grad_keys=("k1", "k3"),
            atol_factor=1e-4, error="componentwise", stiff=True,
            ours={"rodas5p": ([1e-3, 1e-5] if q else [1e-3, 1e-4, 1e-5, 1e-6, 1e-7, 1e-8],
                              ("reverse", "forward")),
                  "rosenbrock23": ([1e-3, 1e-4] if q else [1e-3, 1e-4, 1e-5, 1e-6],
                                   ("reverse",))},
            theirs={"Kvaerno5": (diffrax.Kvaerno5,
                                 [1e-1, 1e-3] if q else [1e-1, 1e-3, 1e-5, 1e-6],
                                 ("reverse", "forward"))},
            pairs=[("rodas5p", "reverse", "Kvaerno5", "reverse"),
                   ("rodas5p", "forward", "Kvaerno5", "forward"),
                   ("rosenbrock23", "reverse", "Kvaerno5", "reverse")],
            target=dict(pair=0, bound=3.0, where="loose"),
            grad_ref=("rodas5p", 1e-10)),
        "hires": dict(
            title="HIRES: rodas5p replay vs Diffrax Kvaerno5",
            build=lambda n: gs.problems.hires(n), loss=sum_squares,
            loss_text="sum(ys(T)**2)", wrt="y0", wrt_text="the 8-component initial state",
            grad_keys=None, atol_factor=1e-4, error="componentwise", stiff=True,
            ours={"rodas5p": ([1e-3, 1e-5] if q else [1e-3, 1e-4, 1e-5, 1e-6, 1e-7],
                              ("reverse",))},
            theirs={"Kvaerno5": (diffrax.Kvaerno5,
                                 [1e-2, 1e-4] if q else [1e-2, 1e-3, 1e-4, 1e-5],
                                 ("reverse",))},
            pairs=[("rodas5p", "reverse", "Kvaerno5", "reverse")],
            target=dict(pair=0, bound=4.0, where="loose"),
            grad_ref=("rodas5p", 1e-10)),
        "lorenz": dict(
            title="Lorenz: vern7 replay vs Diffrax Dopri8",
            build=lambda n: gs.problems.lorenz(n), loss=sum_squares,
            loss_text="sum(ys(T)**2)", wrt="params",
            wrt_text="(sigma, rho, beta) of every trajectory",
            grad_keys=("sigma", "rho", "beta"), atol_factor=1e-3, error="normwise",
            stiff=False,
            ours={"vern7": ([1e-5, 1e-8] if q else [1e-4, 1e-5, 1e-6, 1e-7, 1e-8, 1e-9, 1e-10],
                            ("reverse",))},
            theirs={"Dopri8": (diffrax.Dopri8,
                               [1e-5, 1e-8] if q else [1e-4, 1e-5, 1e-6, 1e-7, 1e-8, 1e-9, 1e-10],
                               ("reverse",))},
            pairs=[("vern7", "reverse", "Dopri8", "reverse")],
            target=dict(pair=0, bound=8.0, where="overlap"),
            grad_ref=("vern7", 1e-12)),
        "linear": dict(
            title="Linear, d = 32: vern7 / tsit5 replay vs Diffrax Dopri8 / Tsit5",
            build=lambda n: gs.problems.linear(n, d=32), loss=sum_squares,
            loss_text="sum(ys(T)**2)", wrt="y0", wrt_text="the 32-component initial state",
            grad_keys=None, atol_factor=1e-3, error="normwise", stiff=False,
            ours={"vern7": ([1e-4, 1e-8] if q else [1e-4, 1e-6, 1e-8, 1e-10], ("reverse",)),
                  "tsit5": ([1e-4, 1e-8] if q else [1e-4, 1e-6, 1e-8, 1e-10], ("reverse",))},
            theirs={"Dopri8": (diffrax.Dopri8,
                               [1e-4, 1e-8] if q else [1e-4, 1e-6, 1e-8, 1e-10], ("reverse",)),
                    "Tsit5": (diffrax.Tsit5,
                              [1e-4, 1e-8] if q else [1e-4, 1e-6, 1e-8, 1e-10], ("reverse",))},
            pairs=[("vern7", "reverse", "Dopri8", "reverse"),
                   ("tsit5", "reverse", "Tsit5", "reverse"),
                   ("vern7", "reverse", "Tsit5", "reverse")],
            target=None, grad_ref=None),
    }


# ------------------------------------------------------------------------- errors

def componentwise_error(ys, ref):
    ys, ref = np.asarray(ys), np.asarray(ref)
    return float(np.max(np.abs(ys - ref) / np.abs(ref)))


def error_fn(kind):
    return componentwise_error if kind == "componentwise" else state_error


def grad_error(g, gref, keys):
    """Per differentiated input (each parameter, or y0): max|g - gref| / max|gref| over
    the whole ensemble (grad_vs_diffrax's `rel_diff`), and their max. Also kept, per
    input: the largest per-trajectory relative error, which blows up where a
    trajectory's own gradient is near zero (Lorenz: d/d rho, d/d sigma cross zero)."""
    g, gref = ({k: g[k] for k in keys}, {k: gref[k] for k in keys}) if keys else (
        {"y0": g}, {"y0": gref})
    out = rel_diff(g, gref)
    out["max"] = max(out.values())

    def per_traj(a, b):
        a, b = np.asarray(a).reshape(len(a), -1), np.asarray(b).reshape(len(b), -1)
        return float(np.max(np.max(np.abs(a - b), axis=1) / np.max(np.abs(b), axis=1)))
    out["per_trajectory"] = {k: per_traj(g[k], gref[k]) for k in gref}
    return out


def all_finite(value, grads):
    return bool(np.isfinite(np.asarray(value))
                and all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(grads)))


# ---------------------------------------------------------------------- references

def stiff_reference(name, prob, stored):
    """Final states: the stored Radau values where n matches, else a tight gradsolve
    solve (rodas5p); both are recorded with how they were made."""
    t = time.perf_counter()
    sol = gs.solve(prob, rtol=1e-12, atol=1e-16, max_steps=100000, method="rodas5p",
                   engine="general")
    if not sol.ok:
        raise RuntimeError(f"{name}: reference solve failed")
    own = np.asarray(sol.ys)
    info = {"gradsolve_rodas5p_rtol1e-12_atol1e-16_steps_max": int(np.max(np.asarray(
        sol.n_accepted))), "seconds": time.perf_counter() - t}
    if stored is not None and stored["n"] == prob.n:
        radau = np.asarray(stored[name]["y1"])
        info["source"] = f"stored SciPy Radau ({display_path(STIFF_REF_PATH)})"
        info["gradsolve_vs_radau_componentwise"] = componentwise_error(own, radau)
        return radau, info
    info["source"] = "gs.solve(rodas5p, rtol=1e-12, atol=1e-16)"
    return own, info


def validate_stiff_reference(name, build, stored):
    """The gradsolve reference recipe at the stored n, against the stored Radau."""
    prob = build(stored["n"])
    sol = gs.solve(prob, rtol=1e-12, atol=1e-16, max_steps=100000, method="rodas5p",
                   engine="general")
    return {"n": stored["n"], "gradsolve_rodas5p_vs_stored_radau_componentwise":
            componentwise_error(sol.ys, np.asarray(stored[name]["y1"])),
            "stored_radau_vs_bdf": stored[name]["max_rel_diff_radau_bdf"]}


def lorenz_reference(prob):
    sol = gs.solve(prob, rtol=1e-14, atol=1e-16, method="vern7", max_steps=100000,
                   engine="general")
    if not sol.ok:
        raise RuntimeError("lorenz: reference solve failed")
    other, _ = tsit5_reference(prob)
    return np.asarray(sol.ys), {
        "source": "gs.solve(vern7, rtol=1e-14, atol=1e-16)",
        "vs_tsit5_rtol1e-13_normwise": state_error(sol.ys, other)}


def linear_closed_form(prob, loss):
    """States expm(lam A T) y0 and the gradient expm(lam A T)^T dL/dy(T)."""
    T = float(prob.t_span[1])
    y = gs.problems.linear_exact(prob, T)
    A = np.asarray(prob.params["A"].value, np.float64)
    lam = np.asarray(prob.params["lam"], np.float64)
    dL = np.asarray(jax.grad(lambda ys: loss(ys, None))(jnp.asarray(y)))
    dt = T - float(prob.t_span[0])
    g = np.stack([scipy.linalg.expm(l * dt * A).T @ c for l, c in zip(lam, dL)])
    return y, g


def reference_gradient(prob, spec):
    method, rtol = spec["grad_ref"]
    t = time.perf_counter()
    vg = gs.value_and_grad(prob, spec["loss"], wrt=spec["wrt"], method=method, rtol=rtol,
                           atol=rtol * spec["atol_factor"], max_steps=100000,
                           engine=OUR_ENGINE)
    _, g = vg()
    g = jax.tree.map(np.asarray, g)
    return g, {"source": f"gradsolve {method} reverse replay at rtol {rtol:g}, atol "
                         f"{rtol * spec['atol_factor']:g}", "mesh_columns": vg.mesh.columns,
               "seconds": time.perf_counter() - t}


# -------------------------------------------------------------------- measurements

def measure_ours(prob, spec, method, rtol, modes, ref, gref, repeats):
    atol = rtol * spec["atol_factor"]
    pt = {"rtol": rtol, "atol": atol}
    pt["record"] = timeit_warm(lambda: gs.record(prob, rtol=rtol, atol=atol, method=method,
                                                 recorder=OUR_RECORDER), repeats)
    mesh = gs.record(prob, rtol=rtol, atol=atol, method=method, recorder=OUR_RECORDER)
    steps = np.asarray(mesh.n_steps)
    pt["mesh"] = {"columns": mesh.columns, "accepted_max": int(steps.max()),
                  "rejected_max": int(np.max(np.asarray(mesh.n_rejected)))}
    if not mesh.ok:
        pt["failed"] = f"record failed: {mesh.summary()}"
        log(f"    {method} rtol={rtol:.0e}: {pt['failed']}")
        return pt
    pt["error"] = error_fn(spec["error"])(gs.replay(prob, mesh), ref)
    msg = []
    for mode in modes:
        vg = gs.value_and_grad(prob, spec["loss"], wrt=spec["wrt"], mode=mode, mesh=mesh,
                               method=method, rtol=rtol, atol=atol, engine=OUR_ENGINE)
        timing = timeit_warm(vg, repeats)
        value, g = vg()
        timing["finite"] = all_finite(value, g)
        timing["grad_error"] = grad_error(g, gref, spec["grad_keys"])
        pt[mode] = timing
        msg.append(f"{mode} {timing['median_s']:.4f} s")
    log(f"    {method:>12} rtol={rtol:.0e}: S={mesh.columns}, error {pt['error']:.2e}, "
        f"record {pt['record']['median_s']:.4f} s, " + ", ".join(msg)
        + f", grad error {pt[modes[0]]['grad_error']['max']:.1e}")
    return pt


def tight_max_steps(attempted):
    return int(math.ceil(attempted * MAX_STEPS_MARGIN / 16) * 16)


def diffrax_grad(prob, spec, engine, mode, rtol, atol, max_steps, gref, repeats):
    try:
        vg = gs.value_and_grad(prob, spec["loss"], wrt=spec["wrt"], mode=mode, engine=engine,
                               rtol=rtol, atol=atol, max_steps=max_steps)
        timing = timeit_warm(vg, repeats)
        value, g = vg()
    except Exception as e:  # a failing configuration is a result, not a crash
        return {"failed": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
    timing["finite"] = all_finite(value, g)
    timing["grad_error"] = grad_error(g, gref, spec["grad_keys"])
    return timing


def measure_theirs(prob, spec, name, solver_cls, rtol, modes, ref, gref, repeats):
    atol = rtol * spec["atol_factor"]
    pt = {"rtol": rtol, "atol": atol}
    try:
        sol = gs.solve(prob, rtol=rtol, atol=atol, max_steps=DIFFRAX_SOLVE_MAX_STEPS,
                       engine=gs.engines.Diffrax(solver=solver_cls()))
    except Exception as e:
        pt["failed"] = f"Diffrax solve raised {type(e).__name__}: {str(e)[:300]}"
        log(f"    {name:>12} rtol={rtol:.0e}: {pt['failed']}")
        return pt
    acc, rej = np.asarray(sol.n_accepted), np.asarray(sol.n_rejected)
    attempted = int(np.max(acc + rej))
    pt["steps"] = {"accepted_max": int(acc.max()), "rejected_max": int(rej.max()),
                   "attempted_max": attempted}
    if not sol.ok:
        pt["failed"] = (f"Diffrax solve did not finish within max_steps="
                        f"{DIFFRAX_SOLVE_MAX_STEPS} (status {np.asarray(sol.status).tolist()[:8]})")
        log(f"    {name:>12} rtol={rtol:.0e}: {pt['failed']}")
        return pt
    M = tight_max_steps(attempted)
    pt["max_steps"] = M
    pt["error"] = error_fn(spec["error"])(sol.ys, ref)
    msg = []
    for mode in modes:
        if mode == "reverse":
            settings = {
                "default": diffrax_grad(prob, spec, gs.engines.Diffrax(solver=solver_cls()),
                                        "reverse", rtol, atol, M, gref, repeats),
                f"checkpoints={M}": diffrax_grad(
                    prob, spec, gs.engines.Diffrax(solver=solver_cls(), checkpoints=M),
                    "reverse", rtol, atol, M, gref, repeats)}
            ok = {k: v for k, v in settings.items() if "failed" not in v}
            entry = {"settings": settings}
            if ok:
                best = min(ok, key=lambda k: ok[k]["median_s"])
                entry.update(fastest=best, median_s=ok[best]["median_s"],
                             grad_error=ok[best]["grad_error"])
                msg.append(f"reverse {entry['median_s']:.4f} s ({best}; "
                           + ", ".join(f"{k} {v['median_s']:.4f}" if "failed" not in v
                                       else f"{k} FAILED" for k, v in settings.items()) + ")")
            else:
                entry["failed"] = "every checkpoint setting failed"
                msg.append("reverse FAILED")
        else:
            entry = diffrax_grad(prob, spec, gs.engines.Diffrax(solver=solver_cls()),
                                 "forward", rtol, atol, M, gref, repeats)
            msg.append(f"ForwardMode {entry['median_s']:.4f} s" if "failed" not in entry
                       else "ForwardMode FAILED")
        pt[mode] = entry
    ge = pt[modes[0]].get("grad_error", {}).get("max", float("nan"))
    log(f"    {name:>12} rtol={rtol:.0e}: steps {pt['steps']['accepted_max']}+"
        f"{pt['steps']['rejected_max']} rejected, max_steps {M}, error {pt['error']:.2e}, "
        + ", ".join(msg) + f", grad error {ge:.1e}")
    for mode in modes:
        for k, v in (pt[mode].get("settings", {"": pt[mode]})).items():
            if "failed" in v:
                log(f"      FAILED {mode} {k}: {v['failed']}")
    return pt


# ------------------------------------------------------------------ matched accuracy

def pareto(curve):
    """(error, time) points on the Pareto front: time increasing, error decreasing."""
    kept, best = [], math.inf
    for e, t in sorted(curve, key=lambda c: (c[1], c[0])):
        if e < best:
            kept.append((e, t))
            best = e
    return kept


def curve_of(points, mode, extra=None):
    out = []
    for p in points:
        if "failed" in p or mode not in p or "median_s" not in p[mode] or not p["error"] > 0:
            continue
        t = p[mode]["median_s"] + (p[extra]["median_s"] if extra else 0.0)
        out.append((p["error"], t))
    return out


def time_at(front, e):
    errs, times = [c[0] for c in front], [c[1] for c in front]
    return float(log_interp(errs, times, [e])[0])


def time_to_reach(front, e):
    """Time to reach error <= e, and whether it is clamped to the loosest point."""
    errs = [c[0] for c in front]
    if e < min(errs):
        return None, "unreachable"
    if e >= max(errs):
        return max(front, key=lambda c: c[0])[1], "clamped"
    return time_at(front, e), "interpolated"


def compare(ours_pts, theirs_pts, mode_o, mode_t, with_record, levels=4):
    raw_o = curve_of(ours_pts, mode_o)
    raw_t = curve_of(theirs_pts, mode_t)
    if len(raw_o) < 1 or len(raw_t) < 1:
        return {"note": "no successful points on one side"}
    fo, ft = pareto(raw_o), pareto(raw_t)
    fo_rec = pareto(curve_of(ours_pts, mode_o, "record")) if with_record else None
    out = {"front_ours": fo, "front_diffrax": ft,
           "dropped_ours": len(raw_o) - len(fo), "dropped_diffrax": len(raw_t) - len(ft)}
    reach = {}
    to, so = time_to_reach(fo, LOOSE_ERROR)
    tt, st = time_to_reach(ft, LOOSE_ERROR)
    reach = {"error": LOOSE_ERROR, "ours_s": to, "ours": so, "diffrax_s": tt, "diffrax": st,
             "speedup": (tt / to) if (to and tt) else None}
    out["reach_loose"] = reach
    lo = max(min(c[0] for c in fo), min(c[0] for c in ft))
    hi = min(max(c[0] for c in fo), max(c[0] for c in ft))
    if hi < lo <= hi * 1.05:          # the ranges touch (equal errors up to rounding)
        lo = hi
    if not lo <= hi:
        out.update(overlap=None, note="error ranges do not overlap")
        return out
    out["overlap"] = [lo, hi]

    def row(e):
        r = {"error": float(e), "ours_s": time_at(fo, e), "diffrax_s": time_at(ft, e)}
        r["speedup"] = r["diffrax_s"] / r["ours_s"]
        if fo_rec and min(c[0] for c in fo_rec) <= e <= max(c[0] for c in fo_rec):
            r["speedup_incl_record"] = r["diffrax_s"] / time_at(fo_rec, e)
        return r
    at = np.geomspace(lo, hi, levels) if hi > lo else [lo]
    out["levels"] = [row(e) for e in at]
    out["loose"] = row(min(max(LOOSE_ERROR, lo), hi))
    sp = [r["speedup"] for r in out["levels"]]
    out["speedup_range"] = [min(sp), max(sp)]
    return out


def pair_name(pair):
    mo, so, mt, st = pair
    tag = lambda m: "" if m == "reverse" else " (forward mode)" if m == "forward" else m
    theirs = f"Diffrax {mt}" + (" ForwardMode" if st == "forward" else " checkpointed")
    return f"{mo}{tag(so)} vs {theirs}"


# ------------------------------------------------------------------------- running

def memory_maps():
    try:
        return sum(1 for _ in open("/proc/self/maps"))
    except OSError:
        return None


def release_compiled():
    """Drop JAX's compiled executables between points: a run compiles several hundred
    functions, and keeping all of them exhausts the process's memory mappings
    (XLA CPU: "LLVM compilation error: Cannot allocate memory", then a crash)."""
    jax.clear_caches()
    gc.collect()


def run_problem(name, spec, sizes, repeats_for, stored):
    log(f"\n== {name}: sizes {sizes}")
    out = {"sizes": {}}
    if spec["stiff"] and stored is not None:
        out["reference_check"] = validate_stiff_reference(name, spec["build"], stored)
        log(f"  reference check at n={stored['n']}: gradsolve tight vs stored Radau "
            f"{out['reference_check']['gradsolve_rodas5p_vs_stored_radau_componentwise']:.1e}"
            " (componentwise)")
    for n in sizes:
        t0 = time.perf_counter()
        prob = spec["build"](n)
        if spec["stiff"]:
            ref, ref_info = stiff_reference(name, prob, stored)
        elif name == "lorenz":
            ref, ref_info = lorenz_reference(prob)
        else:
            ref, gref = linear_closed_form(prob, spec["loss"])
            ref_info = {"source": "closed form gs.problems.linear_exact; gradient "
                                  "expm(lam A T)^T dL/dy(T) (scipy.linalg.expm)"}
        if spec["grad_ref"]:
            gref, gref_info = reference_gradient(prob, spec)
        else:
            gref_info = {"source": "closed form"}
        log(f"  n={n}: reference: {ref_info['source']}; gradient reference: "
            f"{gref_info['source']}")
        reps = repeats_for(n)
        res = {"repeats": reps, "reference": ref_info, "gradient_reference": gref_info,
               "ours": {}, "diffrax": {}}
        for method, (tols, modes) in spec["ours"].items():
            res["ours"][method] = []
            for r in tols:
                res["ours"][method].append(
                    measure_ours(prob, spec, method, r, modes, ref, gref, reps))
                release_compiled()
        for solver, (cls, tols, modes) in spec["theirs"].items():
            res["diffrax"][solver] = []
            for r in tols:
                res["diffrax"][solver].append(
                    measure_theirs(prob, spec, solver, cls, r, modes, ref, gref, reps))
                release_compiled()
        res["matched"] = {}
        for pair in spec["pairs"]:
            mo, so, mt, st = pair
            res["matched"][pair_name(pair)] = compare(
                res["ours"][mo], res["diffrax"][mt], so, st, with_record=True)
        for k, m in res["matched"].items():
            if m.get("levels"):
                log(f"  n={n} {k}: overlap {m['overlap'][0]:.1e}..{m['overlap'][1]:.1e}, "
                    f"x {m['speedup_range'][0]:.2f}..{m['speedup_range'][1]:.2f}, at "
                    f"{m['loose']['error']:.1e}: x{m['loose']['speedup']:.2f}")
            else:
                log(f"  n={n} {k}: {m.get('note')}")
        res["seconds"] = time.perf_counter() - t0
        out["sizes"][n] = res
        log(f"  n={n} done in {res['seconds']:.0f} s ({memory_maps()} memory maps)")
    return out


# ------------------------------------------------------------------------ reporting

def fmt(x, f=".2f"):
    return "-" if x is None else format(x, f)


def reach_text(r):
    if not r:
        return "-"
    if "unreachable" in (r["diffrax"], r["ours"]):
        return "-: " + " and ".join(side for side, key in (("gradsolve", "ours"),
                                                           ("Diffrax", "diffrax"))
                                    if r[key] == "unreachable") + " never reaches 1e-4"
    if r["diffrax"] == "clamped" and r["ours"] == "clamped":
        return "n/a (both below 1e-4 at their loosest)"
    return (fmt(r["speedup"]) + (" (Diffrax clamped)" if r["diffrax"] == "clamped" else "")
            + (" (ours clamped)" if r["ours"] == "clamped" else ""))


def matched_rows(results):
    rows = []
    for name, pres in results.items():
        for n, res in pres["sizes"].items():
            for k, m in res["matched"].items():
                reach = reach_text(m.get("reach_loose"))
                if not m.get("levels"):
                    rows.append([name, str(n), k, m.get("note", "-"), "-", "-", "-", reach])
                    continue
                lo, hi = m["overlap"]
                rows.append([name, str(n), k, f"{lo:.1e} .. {hi:.1e}",
                             f"{fmt(m['loose']['speedup'])} at {m['loose']['error']:.1e}",
                             fmt(m["loose"].get("speedup_incl_record")),
                             f"{m['speedup_range'][0]:.2f} .. {m['speedup_range'][1]:.2f}",
                             reach])
    head = ["problem", "n", "comparison", "error overlap", "x at loose error",
            "x incl. record", "x across overlap", "x to reach err <= 1e-4"]
    return head, rows


def level_rows(results):
    rows = []
    for name, pres in results.items():
        for n, res in pres["sizes"].items():
            for k, m in res["matched"].items():
                for lv in m.get("levels", []):
                    rows.append([name, str(n), k, f"{lv['error']:.2e}", f"{lv['ours_s']:.4f}",
                                 f"{lv['diffrax_s']:.4f}", f"{lv['speedup']:.2f}"])
    return ["problem", "n", "comparison", "matched error", "gradsolve s", "Diffrax s",
            "x"], rows


def first_mode(point):
    return next(m for m in ("reverse", "forward") if m in point)


def point_rows(results):
    rows = []
    for name, pres in results.items():
        for n, res in pres["sizes"].items():
            for method, pts in res["ours"].items():
                for p in pts:
                    if "failed" in p:
                        rows.append([name, str(n), f"gradsolve {method}", f"{p['rtol']:.0e}",
                                     str(p["mesh"]["accepted_max"]), "FAILED", "-", "-", "-",
                                     p["failed"]])
                        continue
                    rows.append([name, str(n), f"gradsolve {method}", f"{p['rtol']:.0e}",
                                 f"{p['mesh']['accepted_max']}+{p['mesh']['rejected_max']}",
                                 f"{p['error']:.1e}", f"{p['record']['median_s']:.4f}",
                                 fmt(p.get("reverse", {}).get("median_s"), ".4f"),
                                 fmt(p.get("forward", {}).get("median_s"), ".4f"),
                                 f"{p[first_mode(p)]['grad_error']['max']:.1e}"])
            for solver, pts in res["diffrax"].items():
                for p in pts:
                    steps = (f"{p['steps']['accepted_max']}+{p['steps']['rejected_max']}"
                             if "steps" in p else "-")
                    if "failed" in p:
                        rows.append([name, str(n), f"Diffrax {solver}", f"{p['rtol']:.0e}",
                                     steps, "FAILED", "-", "-", "-", p["failed"][:80]])
                        continue
                    rev, fwd = p.get("reverse"), p.get("forward")
                    rev_s = ("-" if rev is None else "FAILED" if "failed" in rev else
                             f"{rev['median_s']:.4f} ({rev['fastest']})")
                    fwd_s = ("-" if fwd is None else "FAILED" if "failed" in fwd else
                             f"{fwd['median_s']:.4f}")
                    first = rev if rev is not None else fwd
                    rows.append([name, str(n), f"Diffrax {solver}", f"{p['rtol']:.0e}", steps,
                                 f"{p['error']:.1e}", "-", rev_s, fwd_s,
                                 fmt(first.get("grad_error", {}).get("max"), ".1e")])
    head = ["problem", "n", "solver", "rtol", "steps (acc+rej)", "state error", "record s",
            "reverse grad s", "forward grad s", "grad error"]
    return head, rows


def verdicts(results, all_specs):
    out = {}
    for name, pres in results.items():
        t = all_specs[name]["target"]
        if t is None:
            continue
        pair = pair_name(all_specs[name]["pairs"][t["pair"]])
        met, missed = [], []
        for n, res in pres["sizes"].items():
            m = res["matched"][pair]
            if not m.get("levels"):
                missed.append(f"n={n}: not measurable ({m.get('note')})")
                continue
            if t["where"] == "loose":
                v = m["loose"]["speedup"]
                s = f"n={n}: {v:.2f}x at error {m['loose']['error']:.1e}"
                (met if v >= t["bound"] else missed).append(s)
            else:
                lo, hi = m["speedup_range"]
                s = f"n={n}: {lo:.2f}x .. {hi:.2f}x over errors {m['overlap'][0]:.1e} .. " \
                    f"{m['overlap'][1]:.1e}"
                (met if lo >= t["bound"] else missed).append(s)
        where = ("at loose accuracy (matched error 1e-4, or the loose end of the overlap)"
                 if t["where"] == "loose" else "across the matched-error overlap")
        text = (f"{name}: {pair}, target >= {t['bound']:g}x {where}: "
                + ("MET" if met and not missed else "MISSED" if not met else "MIXED")
                + f" - met at {'; '.join(met) or 'no n'}; missed at "
                  f"{'; '.join(missed) or 'no n'}")
        out[name] = {"comparison": pair, "target": f">= {t['bound']:g}", "where": t["where"],
                     "met": met, "missed": missed, "text": text}
    return out


def settings_lines(all_specs, results):
    lines = []
    for name in results:
        s = all_specs[name]
        ours = "; ".join(f"{m} rtol {{{', '.join(f'{r:g}' for r in tols)}}} ({'/'.join(modes)})"
                         for m, (tols, modes) in s["ours"].items())
        theirs = "; ".join(f"{m} rtol {{{', '.join(f'{r:g}' for r in tols)}}} "
                           f"({'/'.join(modes)})" for m, (_, tols, modes) in s["theirs"].items())
        sizes = ", ".join(str(n) for n in results[name]["sizes"])
        lines.append(f"- **{s['title']}** (n = {sizes}): loss `{s['loss_text']}`, gradient "
                     f"w.r.t. {s['wrt_text']}; atol = rtol x {s['atol_factor']:g}; "
                     f"{s['error']} error. gradsolve: {ours}. Diffrax: {theirs}.")
    return lines


def linear_rows(results):
    if "linear" not in results:
        return None
    rows = []
    for n, res in results["linear"]["sizes"].items():
        for side, group in (("gradsolve", res["ours"]), ("Diffrax", res["diffrax"])):
            for m, pts in group.items():
                for p in pts:
                    g = p.get("reverse", {}).get("grad_error", {}).get("max")
                    rows.append([str(n), f"{side} {m}", f"{p['rtol']:g}",
                                 fmt(p.get("error"), ".1e"), fmt(g, ".1e")])
    return ["n", "solver", "rtol", "state error vs closed form",
            "gradient rel. error vs closed form"], rows


def markdown(report, command, out, all_specs):
    res = report["results"]
    m, v = report["machine"], report["versions"]
    refs = []
    for name in ("robertson", "hires"):
        if name in res and "reference_check" in res[name]:
            c = res[name]["reference_check"]
            refs.append(f"{name} {c['gradsolve_rodas5p_vs_stored_radau_componentwise']:.1e}")
    lines = [
        SECTION_TITLE, "",
        "Gradients of a scalar loss of the final states, float64, all numbers from one run. "
        "Times are medians of warm calls (compilation excluded); gradsolve's record is timed "
        "apart and left out of its gradient time (\"x incl. record\" adds it back); its "
        "side is pinned to the general JAX recorder and the `general_replay` engine. Diffrax "
        "runs through `gs.engines.Diffrax(solver=...)` with max_steps = its own attempted "
        "steps + 10%; its reverse-mode time is the faster of default checkpoints and "
        "`checkpoints=max_steps` (the per-point choice is in the JSON). Each side sweeps its "
        "own tolerances; x = Diffrax time / gradsolve time at the same achieved error, from "
        "log(time)-log(error) interpolation on each side's Pareto front, inside the range "
        "of errors both sides reach. \"Loose error\" is 1e-4, or the nearest end of that "
        "range when 1e-4 lies outside it. \"x to reach err <= 1e-4\" charges a side whose "
        "loosest setting is already more accurate than 1e-4 with that setting's time "
        "(\"clamped\"), an upper bound for that side.", "",
        "Errors: stiff systems componentwise (max over trajectories and species of "
        "|y - y_ref| / |y_ref|), Lorenz and linear normwise (max over trajectories of "
        "max|y - y_ref| / max|y_ref|). References: Robertson and HIRES `gs.solve(rodas5p, "
        "rtol=1e-12, atol=1e-16)` (at n = 4 it agrees with the stored SciPy Radau values "
        f"of `tests/data/stiff_references.json` to {', '.join(refs) or 'n/a'}, "
        "componentwise); Lorenz `gs.solve(vern7, rtol=1e-14, atol=1e-16)`; linear the "
        "closed form. Gradient errors (max|g - g_ref| / max|g_ref| over the ensemble, per "
        "differentiated input, the largest shown) are against a replay gradient at rtol "
        "1e-10 (stiff) / 1e-12 (Lorenz), or the closed form (linear).", "",
        *settings_lines(all_specs, res), "",
        "### Matched accuracy", "",
        md_table(*matched_rows(res)), "",
        "### Targets", "",
    ]
    lines += [f"- {t['text']}." for t in report["verdicts"].values()]
    lr = linear_rows(res)
    if lr:
        lines += ["", "### Linear (d = 32): gradients against the closed form", "",
                  md_table(*lr)]
    lines += ["", "<details><summary>Speed ratio at each matched error</summary>", "",
              md_table(*level_rows(res)), "", "</details>", "",
              "<details><summary>Every point (median seconds)</summary>", "",
              md_table(*point_rows(res)), "", "</details>"]
    lines += [
        "", f"Machine: {m['cpu_model']} ({m['cpu_count']} CPUs, {m['memory_gib']} GiB), "
        f"{m['platform']}; jax {v['jax']}, diffrax {v['diffrax']}, gradsolve {v['gradsolve']}"
        f" (commit {v['git_commit']}"
        + (", with uncommitted changes under src/" if v["src_uncommitted_changes"] else "")
        + f"); {report['date']}; total {report['total_wall_s'] / 60:.0f} min. The machine "
        "was shared with other work during the run: read single ratios loosely.", "",
        f"Reproduce: `{command}`" + (f" (raw numbers: `{display_path(out)}`)." if out else "."),
    ]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- main

def parse_list(text, kind):
    return [kind(x) for x in text.split(",") if x.strip()]


def jsonable(x):
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, (np.floating, np.integer)):
        return x.item()
    return x


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--problems", default="robertson,hires,lorenz,linear")
    ap.add_argument("--stiff-sizes", default=None, help="default 8,64,256 (quick: 4)")
    ap.add_argument("--lorenz-sizes", default=None, help="default 1024 (quick: 16)")
    ap.add_argument("--linear-sizes", default=None, help="default 256 (quick: 8)")
    ap.add_argument("--repeats", type=int, default=None,
                    help="timed repeats (default 5 for n <= 64, 3 above; quick 2)")
    ap.add_argument("--quick", action="store_true",
                    help="smoke test: tiny n, 2 tolerances per side, writes nothing unless "
                         "--out/--docs are given")
    ap.add_argument("--out", default=None, help=f"JSON path (default {DEFAULT_OUT})")
    ap.add_argument("--docs", default=None, help=f"Markdown path (default {DEFAULT_DOCS})")
    args = ap.parse_args(argv)

    q = args.quick
    sizes = {
        "robertson": parse_list(args.stiff_sizes, int) if args.stiff_sizes else
        ([4] if q else [8, 64, 256]),
        "lorenz": parse_list(args.lorenz_sizes, int) if args.lorenz_sizes else
        ([16] if q else [1024]),
        "linear": parse_list(args.linear_sizes, int) if args.linear_sizes else
        ([8] if q else [256])}
    sizes["hires"] = sizes["robertson"]
    problems = [p for p in args.problems.split(",") if p]
    all_specs = specs(q)
    unknown = set(problems) - set(all_specs)
    if unknown:
        ap.error(f"unknown problems {sorted(unknown)}")
    out = args.out if args.out is not None else ("" if q else str(DEFAULT_OUT))
    docs = args.docs if args.docs is not None else ("" if q else str(DEFAULT_DOCS))

    def repeats_for(n):
        if args.repeats:
            return args.repeats
        return 2 if q else 5 if n <= 64 else 3

    stored = json.loads(STIFF_REF_PATH.read_text()) if STIFF_REF_PATH.exists() else None
    command = " ".join([".venv/bin/python", "benchmarks/stiff_and_high_order.py"] + sys.argv[1:])
    env = versions()
    log(f"stiff_and_high_order: problems {problems}, sizes "
        f"{ {p: sizes[p] for p in problems} }")
    t_start = time.perf_counter()
    results = {}
    for name in problems:
        results[name] = run_problem(name, all_specs[name], sizes[name], repeats_for, stored)
        log(f"{name} done ({time.perf_counter() - t_start:.0f} s elapsed)")

    settings = {}
    for name in problems:
        s = all_specs[name]
        settings[name] = {
            "title": s["title"], "loss": s["loss_text"], "wrt": s["wrt_text"],
            "atol": f"rtol * {s['atol_factor']:g}", "error": s["error"],
            "sizes": sizes[name],
            "gradsolve": {m: {"rtols": t, "modes": list(md)} for m, (t, md) in s["ours"].items()},
            "diffrax": {m: {"solver": f"diffrax.{c.__name__}()", "rtols": t, "modes": list(md)}
                        for m, (c, t, md) in s["theirs"].items()},
            "comparisons": [pair_name(p) for p in s["pairs"]],
            "target": s["target"]}
    report = {
        "benchmark": "stiff_and_high_order",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command,
        "settings": {"problems": settings, "dtype": "float64", "loose_error": LOOSE_ERROR,
                     "diffrax_max_steps": f"ceil(attempted * {MAX_STEPS_MARGIN} / 16) * 16",
                     "gradsolve_recorder": OUR_RECORDER, "gradsolve_engine": OUR_ENGINE,
                     "timing": "median of warm repeats after one untimed compiling call",
                     "matching": "Pareto front per side, log(time) linear in log(error)",
                     "quick": q},
        "machine": machine(), "versions": env,
        "total_wall_s": time.perf_counter() - t_start,
        "results": results,
    }
    report["verdicts"] = verdicts(results, all_specs)

    log("\nMatched accuracy (x = Diffrax time / gradsolve time)\n"
        + text_table(*matched_rows(results)))
    lr = linear_rows(results)
    if lr:
        log("\nLinear d=32 against the closed form\n" + text_table(*lr))
    log("\nTargets:\n" + "\n".join(f"- {t['text']}" for t in report["verdicts"].values()))
    log(f"\ntotal {report['total_wall_s']:.0f} s")

    if out:
        path = Path(out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(jsonable(report), indent=1) + "\n")
        log(f"wrote {path}")
    if docs:
        write_docs(Path(docs), markdown(report, command, out, all_specs), START, END)
        log(f"wrote {docs}")
    return report


if __name__ == "__main__":
    main()
