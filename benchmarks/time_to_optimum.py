"""Time to a calibrated answer: a multistart fit to its optimum, gradsolve against
SciPy's least squares, both in this process (issue 23).

- lynx_hare: `recipes/multistart.py`'s Lotka-Volterra fit to the Hudson's Bay pelts
  (six numbers on log scales), from the recipe's 32 Sobol starts. SciPy:
  `least_squares` on the recipe's residuals with `solve_ivp` (DOP853, rtol 1e-10),
  from every start, one after another (the recipe's `scipy_fit`), each stopped after
  `SCIPY_LIMIT` seconds (counted as failed, its time included). gradsolve: one
  Calibrator over all 32 starts at once (rtol = atol = 1e-10) on the recipe's
  residuals, with its default for them, Levenberg-Marquardt
  (`optx.LevenbergMarquardt`, a trust region per fit, the Jacobian by forward mode,
  the mesh refreshed every 10 updates: `refresh_every="auto"`), and, the mesh
  refreshed every `REFRESH` updates, with `optax.lbfgs()` (its line search per fit)
  and with `optax.adam(0.05)`. Every start's final parameters are scored by SciPy's
  residual function (a fresh DOP853 solve), so both sides' losses are one number;
  "within 1e-8" counts the starts whose loss is within 1e-8 relative of SciPy's best.
  gradsolve's time is the whole fit, the first time (compiles included) and again
  (warm: the same Calibrator, a new fit); SciPy's is all 32 starts.
- profile: a 20-point profile of alpha over x1/1.2 to x1.2 its best value, from the
  Levenberg-Marquardt multistart's best start, by Levenberg-Marquardt:
  `Calibrator.profile` (all points at once) against SciPy's `least_squares` at each
  point in turn, each from its neighbour's solution; both profiles scored by SciPy's
  residuals, to agree within 1e-6 relative. A profile is a new Calibrator, so its time
  includes tracing and compiling its update (the persistent cache is off here; a
  user's second run reads it from there): the table gives XLA's compile seconds apart.
- petab: Boehm_JProteomeRes2014 from 20 Sobol starts inside its parameter table's
  bounds, `calibrator(least_squares=True)` (Levenberg-Marquardt, 400 updates at most),
  then every start polished on clipped edges (`edges="clip"`, 100 at most), against
  `optax.adam(0.05)` (400 at most), one cold fit each; the best start's llh against
  AMICI's reference llh.

    .venv/bin/python benchmarks/time_to_optimum.py [--quick]
"""

import contextlib
import signal
import sys
import time

from _harness import ROOT, fmt, log, main, md_table, ratio, target

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import optimistix as optx  # noqa: E402

import gradsolve as gs  # noqa: E402

sys.path.append(str(ROOT / "recipes"))
import multistart as recipe  # noqa: E402

COMPILING = []  # XLA's compile seconds (jax.monitoring), cleared by each reader
jax.monitoring.register_event_duration_secs_listener(
    lambda event, seconds, **_: COMPILING.append(seconds)
    if event == "/jax/core/compile/backend_compile_duration" else None)

STARTS, RTOL, REFRESH, MATCH = 32, 1e-10, 50, 1e-8
SCIPY_LIMIT = 60.0  # seconds per SciPy start (`time_limit`)
# The PEtab model (one condition; Fujita's six took 4.4 s an LM update of 4 starts
# here) and runs: (least_squares, optimizer, update cap, refresh_every, edges, the run
# it starts from). Refreshing every 50, not 10: LM's best on 8 starts, 400 updates,
# ended 0.0049 below the reference, not 0.011 (2026-12-07); the polish: calibrator.md.
PETAB_MODEL, PETAB_STARTS = "Boehm_JProteomeRes2014", 20
PETAB_RUNS = {"levenberg_marquardt": (True, None, 400, 50, "squash", None),
              "then on clipped edges": (True, None, 100, 10, "clip", "levenberg_marquardt"),
              "adam(0.05)": (False, optax.adam(0.05), 400, 50, "squash", None)}
PROFILE_RATE, PROFILE_POINTS, SPAN = "alpha", 20, 1.2
# optimizer -> (its settings, update cap per start, grad_tol)
OPTIMIZERS = {"levenberg_marquardt": (optx.LevenbergMarquardt,
                                      {"rtol": 1e-8, "atol": 1e-10}, 100, 1e-9),
              "lbfgs": (optax.lbfgs, {}, 100, 1e-9),
              "adam(0.05)": (optax.adam, {"learning_rate": 0.05}, 2000, 1e-4)}


def calibrator(optimizer):
    least_squares = isinstance(optimizer, optx.AbstractLeastSquaresSolver)
    prob = gs.EnsembleProblem(recipe.lotka_volterra, y0=jnp.ones((STARTS, 2)), params={
        k: jnp.ones(STARTS) for k in recipe.RATES}, t_span=(0.0, 20.0), name="lynx_hare")
    transform = {k: gs.transforms.Log10(recipe.LO[k], recipe.HI[k], edges="clip")
                 for k in recipe.RATES}  # the recipe's: a valley to a bound ends there
    transform.update(hare0=gs.transforms.Log(), lynx0=gs.transforms.Log())
    return gs.Calibrator(
        prob, residuals=lambda ys, theta, _: recipe.residuals(ys[0], theta),
        to_params=lambda th: {k: jnp.full(1, th[k]) for k in recipe.RATES},
        to_y0=lambda th: jnp.stack([th["hare0"], th["lynx0"]])[None],
        ts=recipe.TS, rtol=RTOL, atol=RTOL, optimizer=optimizer, transform=transform,
        refresh_every="auto" if least_squares else REFRESH)


def scipy_residuals(th):
    """The recipe's residuals at `th` (a dict of six numbers) by a DOP853 solve at rtol
    1e-10, as the recipe's `scipy_fit` computes them; None where the solve fails."""
    from scipy.integrate import solve_ivp

    a, b, g, d = (th[k] for k in recipe.RATES)
    sol = solve_ivp(lambda t, y: [a * y[0] - b * y[0] * y[1], d * y[0] * y[1] - g * y[1]],
                    (0.0, 20.0), [th["hare0"], th["lynx0"]], t_eval=np.asarray(recipe.TS),
                    method="DOP853", rtol=1e-10, atol=1e-10)
    if not sol.success:
        return None
    return np.asarray(recipe.residuals(jnp.asarray(sol.y.T),
                                       {k: jnp.asarray(v) for k, v in th.items()}))


def scored(thetas):
    """Each start's loss by SciPy's residuals: the recipe's least-squares objective
    at the start's final parameters."""
    return np.asarray([np.nan if (r := scipy_residuals(th)) is None
                       else 0.5 * float(np.sum(r ** 2)) for th in thetas])


@contextlib.contextmanager
def time_limit(seconds):
    """Raise TimeoutError in this (main) thread after `seconds`: a SciPy start whose
    least_squares steps into a region where solve_ivp crawls (start 13 here ran for
    14 minutes in one run) is stopped and counted as failed, its time included."""
    def stop(*_):
        raise TimeoutError
    signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def starts_of(theta, i):
    return {k: float(np.asarray(v)[i]) for k, v in theta.items()}


def summary(losses, best, seconds, **kw):
    rel = (losses - best) / best
    return {"seconds": seconds, "best_loss": float(np.nanmin(losses)),
            "best_rel": float(np.nanmin(rel)),
            "within": int(np.sum(np.abs(rel) <= MATCH)), "losses": losses.tolist(), **kw}


def lynx_hare(args):
    theta0 = gs.multistart(recipe.LO, recipe.HI, STARTS, jax.random.key(0),
                           scale={k: "log" for k in recipe.LO})
    n_scipy = 4 if args.quick else STARTS
    t, ref, timed_out = time.perf_counter(), [], []
    for i in range(n_scipy):
        try:
            with time_limit(SCIPY_LIMIT):
                ref.append(recipe.scipy_fit(starts_of(theta0, i))[0])
        except TimeoutError:
            ref.append(None)
            timed_out.append(i)
        except Exception:  # noqa: BLE001 - a start whose solve fails: no result
            ref.append(None)
        log(f"  SciPy start {i}: {time.perf_counter() - t:.1f} s")
    scipy_s = time.perf_counter() - t
    scipy_losses = scored([r for r in ref if r is not None])
    best = float(np.nanmin(scipy_losses))
    out = {"starts": STARTS, "rtol": RTOL, "refresh_every": REFRESH, "match": MATCH,
           "scipy": summary(scipy_losses, best, scipy_s, starts_run=n_scipy,
                            timed_out=timed_out, limit_s=SCIPY_LIMIT)}
    for name, (make, kw, steps, grad_tol) in OPTIMIZERS.items():
        steps = min(steps, 20) if args.quick else steps
        cal, runs = calibrator(make(**kw)), []
        for _ in range(2):  # the first compiles; the second reuses the compiled update
            t = time.perf_counter()
            res = cal.fit(theta0, steps=steps, grad_tol=grad_tol, progress=False)
            jax.block_until_ready(res.theta)
            runs.append(time.perf_counter() - t)
        losses = scored([starts_of(res.theta, i) for i in range(STARTS)])
        out[name] = summary(
            losses, best, runs[1], first_s=runs[0], engine=res.engine, cap=steps,
            grad_tol=grad_tol, steps=np.asarray(res.steps).tolist(),
            converged=int(np.asarray(res.converged).sum()), updates=int(res.updates))
        log(f"  {name}: {runs[1]:.1f} s warm ({runs[0]:.1f} s first), best loss "
            f"{out[name]['best_loss']:.12g} (SciPy {best:.12g}), "
            f"{out[name]['within']} starts within {MATCH:g}")
    return out


def scipy_profile(best, name, grid):
    """SciPy's profile of `name`: `least_squares` over the logs of the other five
    numbers at each grid value, one point after another, each from its neighbour's
    solution (from the best fit outwards, the usual practice); the loss per point."""
    from scipy.optimize import least_squares

    free = [k for k in recipe.RATES + ("hare0", "lynx0") if k != name]
    out = np.full(grid.size, np.nan)
    below = np.flatnonzero(grid < best[name])[::-1]
    for side in (below, np.flatnonzero(grid >= best[name])):
        z = np.log([best[k] for k in free])
        for i in side:
            fit = least_squares(lambda z: scipy_residuals(
                {**dict(zip(free, np.exp(z))), name: grid[i]}), z,
                xtol=1e-12, ftol=1e-12, gtol=1e-12)
            z, out[i] = fit.x, 0.5 * float(np.sum(fit.fun ** 2))
    return out


def profile(args):
    """A PROFILE_POINTS-point profile of one rate over +-SPAN around the best start of
    the Levenberg-Marquardt multistart: `Calibrator.profile` (every point at once, each from the
    best fit) against SciPy's sequential profile, both scored by SciPy's residuals."""
    theta0 = gs.multistart(recipe.LO, recipe.HI, STARTS, jax.random.key(0),
                           scale={k: "log" for k in recipe.LO})
    make, kw, steps, grad_tol = OPTIMIZERS["levenberg_marquardt"]
    cal = calibrator(make(**kw))
    res = cal.fit(theta0, steps=steps, grad_tol=grad_tol, progress=False)
    best = starts_of(res.theta, res.best().index)
    points = 4 if args.quick else PROFILE_POINTS
    grid = best[PROFILE_RATE] * np.geomspace(1 / SPAN, SPAN, points)
    # A profile is a new Calibrator: every call compiles its update (the harness's
    # persistent cache is off). XLA's compile seconds apart (COMPILING).
    COMPILING.clear()
    t = time.perf_counter()
    prof = cal.profile(res, PROFILE_RATE, grid, steps=steps, grad_tol=grad_tol,
                       progress=False)
    jax.block_until_ready(prof.theta)
    first, compile_s = time.perf_counter() - t, sum(COMPILING)
    ours = scored([starts_of(prof.theta, i) for i in range(points)])
    t = time.perf_counter()
    ref = scipy_profile(best, PROFILE_RATE, grid)
    scipy_s = time.perf_counter() - t
    rel = np.abs(ours - ref) / ref
    log(f"  profile: gradsolve {first:.1f} s ({compile_s:.1f} s of it XLA compiles), SciPy {scipy_s:.1f} s; largest relative difference {rel.max():.2g}")
    return {"rate": PROFILE_RATE, "points": points, "span": SPAN, "grid": grid.tolist(),
            "seconds": first - compile_s, "first_s": first, "compile_s": compile_s,
            "scipy_s": scipy_s,
            "loss": ours.tolist(), "scipy_loss": ref.tolist(), "max_rel": float(rel.max()),
            "steps": np.asarray(prof.steps).tolist(), "cap": steps,
            "converged": int(np.asarray(prof.converged).sum()), "engine": prof.engine}


def petab(args):
    """A model of the PEtab benchmark collection from `PETAB_STARTS` Sobol starts, each
    of PETAB_RUNS one fit from cold (its compiles given apart), the best start's llh by
    a fresh simulation against AMICI's reference llh."""
    from petab_collection import DATA, references

    prob = gs.petab.load(next((DATA / "Benchmark-Models" / PETAB_MODEL).glob("*.yaml")))
    S = 2 if args.quick else PETAB_STARTS
    starts = prob.starts(S, jax.random.key(0))
    out = {"model": PETAB_MODEL, "starts": S, "reference_llh": references()[PETAB_MODEL],
           "nominal_llh": prob.llh(), "parameters": len(prob.parameter_ids)}
    theta = {}
    for name, (least_squares, optimizer, steps, every, edges, after) in PETAB_RUNS.items():
        steps = 5 if args.quick else steps
        cal = prob.calibrator(S, optimizer, least_squares=least_squares, refresh_every=every,
                              edges=edges)
        COMPILING.clear()
        t = time.perf_counter()
        res = cal.fit(theta[after] if after else starts, steps=steps, progress=False)
        seconds, compile_s, theta[name] = time.perf_counter() - t, sum(COMPILING), res.theta
        llh = prob.llh({k: float(res.best().theta[k]) for k in prob.parameter_ids})
        out[name] = {"seconds": seconds, "compile_s": compile_s, "llh": llh, "every": every,
                     "gap": out["reference_llh"] - llh, "cap": steps, "after": after,
                     "steps": np.asarray(res.steps).tolist(), "engine": res.engine,
                     "converged": int(np.asarray(res.converged).sum())}
        log(f"  {name}: {seconds:.1f} s ({compile_s:.1f} s compiling), best llh "
            f"{llh:.6f} (reference {out['reference_llh']:.6f})")
    return out


SECTIONS = {"lynx_hare": lynx_hare, "profile": profile, "petab": petab}


def render(sections):
    blocks = {}
    if "petab" in sections:
        p = sections["petab"]
        blocks["petab"] = (
            f"{p['model']}, {p['starts']} starts, {p['parameters']} parameters; AMICI's "
            f"reference llh {p['reference_llh']:.6f}, ours at the nominal parameters "
            f"{p['nominal_llh']:.6f}.\n\n" + md_table(
                ["optimizer", "s (of which XLA compiles)", "updates per start (median / max)",
                 "converged", "best start's llh", "reference - best"],
                [[f"{name} ({r['engine']})", ("+" if r.get("after") else "")
                  + f"{r['seconds']:.1f} ({r['compile_s']:.1f})",
                  f"{np.median(r['steps']):.0f} / {max(r['steps'])} (cap {r['cap']})",
                  f"{r['converged']} of {p['starts']}", f"{r['llh']:.6f}", f"{r['gap']:.2g}"]
                 for name, r in ((n, p[n]) for n in PETAB_RUNS if n in p)]))
    if "profile" in sections:
        p = sections["profile"]
        blocks["profile"] = (
            f"{p['points']} points of {p['rate']} over x{1 / p['span']:.3g} to x{p['span']:g} "
            f"its best value, Levenberg-Marquardt ({p['engine']}), every point from the "
            f"best start.\n\n"
            + md_table(["side", "s", "of which XLA compiles", "s without them",
                        "x SciPy (with / without)", "updates per point (median / max)",
                        "converged", "largest loss difference (relative)"],
                       [["SciPy least_squares, point after point", f"{p['scipy_s']:.1f}",
                         "-", "-", "-", "-", "-", "-"],
                        ["gradsolve Calibrator.profile", f"{p['first_s']:.1f}",
                         f"{p['compile_s']:.1f}", f"{p['seconds']:.1f}",
                         f"{fmt(ratio(p['scipy_s'], p['first_s']))} / "
                         f"{fmt(ratio(p['scipy_s'], p['seconds']))}",
                         f"{np.median(p['steps']):.0f} / {max(p['steps'])} (cap {p['cap']})",
                         f"{p['converged']} of {p['points']}", f"{p['max_rel']:.2g}"]]))
    if "lynx_hare" not in sections:
        return blocks
    s = sections["lynx_hare"]
    stopped = s["scipy"].get("timed_out", [])
    rows = [["SciPy least_squares + solve_ivp" + (
        f" ({len(stopped)} start(s) stopped at {s['scipy']['limit_s']:g} s)" if stopped
        else ""), "-", f"{s['scipy']['seconds']:.1f}", "-", "-",
        f"{s['scipy']['best_loss']:.12g}", s["scipy"]["within"], "-"]]
    for name in OPTIMIZERS:
        r = s.get(name)
        if r:
            rows.append([f"gradsolve, {name} ({r['engine']})", f"{r['first_s']:.1f}",
                         f"{r['seconds']:.1f}", fmt(ratio(s["scipy"]["seconds"], r["seconds"])),
                         f"{np.median(r['steps']):.0f} / {max(r['steps'])} (cap {r['cap']})",
                         f"{r['best_loss']:.12g}", r["within"],
                         f"{r['converged']} (grad_tol {r['grad_tol']:g})"])
    blocks["lynx_hare"] = md_table(
        ["side", "first s", "warm s", "x SciPy (warm)", "updates per start (median / max)",
         "best loss (SciPy's residuals)", f"starts within {s['match']:g}",
         "converged"], rows)
    return blocks


def targets(sections):
    out = []
    s = sections.get("lynx_hare")
    for name, label in (("levenberg_marquardt", "Levenberg-Marquardt"), ("lbfgs", "L-BFGS")):
        if not (s and name in s):
            continue
        r = s[name]
        reached = abs(r["best_rel"]) <= s["match"] or r["best_rel"] < 0
        # (updates per start, target <= 50: in the table; the target rows are ratios)
        out.append(target(f"Time to optimum, lynx-hare 32 starts, {label} vs SciPy (warm)",
                          ">=", 3, {"x": ratio(s["scipy"]["seconds"], r["seconds"])
                                    if reached else None}))
    p = sections.get("profile")
    if p:  # values within 1e-6 of SciPy's, else no ratio counts
        close = p["max_rel"] <= 1e-6
        out.append(target(f"Profile, lynx-hare {p['rate']}, {p['points']} points, "
                          "Levenberg-Marquardt vs SciPy sequential", ">=", 1,
                          {"compiles included": ratio(p["scipy_s"], p["first_s"]) if close
                           else None, "excluded": ratio(p["scipy_s"], p["seconds"]) if close
                           else None}))
    p = sections.get("petab")
    if p:
        out.append(target(f"{p['model']}, {p['starts']} starts, (reference llh - best "
                          "start's) / 1e-3", "<=", 1,
                          {"Levenberg-Marquardt then clipped": p["then on clipped edges"]
                           ["gap"] / 1e-3} if "then on clipped edges" in p else {}))
    return out


if __name__ == "__main__":
    main("time_to_optimum", __doc__, SECTIONS, render, targets)
