"""Time to a calibrated answer: a multistart fit to its optimum, gradsolve against
SciPy's least squares, both in this process (issue 23).

- lynx_hare: `recipes/multistart.py`'s Lotka-Volterra fit to the Hudson's Bay pelts
  (six numbers on log scales), from the recipe's 32 Sobol starts. SciPy:
  `least_squares` on the recipe's residuals with `solve_ivp` (DOP853, rtol 1e-10),
  from every start, one after another (the recipe's `scipy_fit`). gradsolve: one
  Calibrator over all 32 starts at once (rtol = atol = 1e-10, the mesh refreshed every
  `REFRESH` updates), with `optax.lbfgs()` (its line search per fit) and with the
  recipe's `optax.adam(0.05)`. Every start's final parameters are scored by SciPy's
  residual function (a fresh DOP853 solve), so both sides' losses are one number;
  "within 1e-8" counts the starts whose loss is within 1e-8 relative of SciPy's best.
  gradsolve's time is the whole fit, the first time (compiles included) and again
  (warm: the same Calibrator, a new fit); SciPy's is all 32 starts.

    .venv/bin/python benchmarks/time_to_optimum.py [--quick]
"""

import sys
import time

from _harness import ROOT, fmt, log, main, md_table, ratio, target

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import gradsolve as gs  # noqa: E402

sys.path.append(str(ROOT / "recipes"))
import multistart as recipe  # noqa: E402

STARTS, RTOL, REFRESH, MATCH = 32, 1e-10, 50, 1e-8
# optimizer -> (its settings, update cap per start, grad_tol)
OPTIMIZERS = {"lbfgs": (optax.lbfgs, {}, 100, 1e-9),
              "adam(0.05)": (optax.adam, {"learning_rate": 0.05}, 2000, 1e-4)}


def calibrator(optimizer):
    prob = gs.EnsembleProblem(
        recipe.lotka_volterra, y0=jnp.ones((STARTS, 2)),
        params={k: jnp.ones(STARTS) for k in recipe.RATES}, t_span=(0.0, 20.0),
        name="lynx_hare")
    transform = {k: gs.transforms.Log10(recipe.LO[k], recipe.HI[k]) for k in recipe.RATES}
    transform.update(hare0=gs.transforms.Log(), lynx0=gs.transforms.Log())
    return gs.Calibrator(
        prob, lambda ys, theta, _: 0.5 * jnp.sum(recipe.residuals(ys[0], theta) ** 2),
        to_params=lambda th: {k: jnp.full(1, th[k]) for k in recipe.RATES},
        to_y0=lambda th: jnp.stack([th["hare0"], th["lynx0"]])[None],
        ts=recipe.TS, rtol=RTOL, atol=RTOL, optimizer=optimizer, transform=transform,
        refresh_every=REFRESH)


def scored(thetas):
    """Each start's loss by SciPy's residuals (a DOP853 solve at rtol 1e-10): the
    recipe's least-squares objective at the start's final parameters."""
    from scipy.integrate import solve_ivp

    out = []
    for th in thetas:
        a, b, g, d = (th[k] for k in recipe.RATES)
        sol = solve_ivp(lambda t, y: [a * y[0] - b * y[0] * y[1], d * y[0] * y[1] - g * y[1]],
                        (0.0, 20.0), [th["hare0"], th["lynx0"]], t_eval=np.asarray(recipe.TS),
                        method="DOP853", rtol=1e-10, atol=1e-10)
        if not sol.success:
            out.append(float("nan"))
            continue
        r = recipe.residuals(jnp.asarray(sol.y.T), {k: jnp.asarray(v) for k, v in th.items()})
        out.append(0.5 * float(jnp.sum(r ** 2)))
    return np.asarray(out)


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
    t, ref = time.perf_counter(), []
    for i in range(n_scipy):
        try:
            ref.append(recipe.scipy_fit(starts_of(theta0, i))[0])
        except Exception:  # noqa: BLE001 - a start whose solve fails: no result
            ref.append(None)
        log(f"  SciPy start {i}: {time.perf_counter() - t:.1f} s")
    scipy_s = time.perf_counter() - t
    scipy_losses = scored([r for r in ref if r is not None])
    best = float(np.nanmin(scipy_losses))
    out = {"starts": STARTS, "rtol": RTOL, "refresh_every": REFRESH, "match": MATCH,
           "scipy": summary(scipy_losses, best, scipy_s, starts_run=n_scipy)}
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


SECTIONS = {"lynx_hare": lynx_hare}


def render(sections):
    if "lynx_hare" not in sections:
        return {}
    s = sections["lynx_hare"]
    rows = [["SciPy least_squares + solve_ivp", "-", f"{s['scipy']['seconds']:.1f}", "-",
             "-", f"{s['scipy']['best_loss']:.12g}", s["scipy"]["within"], "-"]]
    for name in OPTIMIZERS:
        r = s.get(name)
        if r:
            rows.append([f"gradsolve, {name} ({r['engine']})", f"{r['first_s']:.1f}",
                         f"{r['seconds']:.1f}", fmt(ratio(s["scipy"]["seconds"], r["seconds"])),
                         f"{np.median(r['steps']):.0f} / {max(r['steps'])} (cap {r['cap']})",
                         f"{r['best_loss']:.12g}", r["within"],
                         f"{r['converged']} (grad_tol {r['grad_tol']:g})"])
    return {"lynx_hare": md_table(
        ["side", "first s", "warm s", "x SciPy (warm)", "updates per start (median / max)",
         "best loss (SciPy's residuals)", f"starts within {s['match']:g}",
         "converged"], rows)}


def targets(sections):
    s = sections.get("lynx_hare")
    if not s or "lbfgs" not in s:
        return []
    r = s["lbfgs"]
    reached = abs(r["best_rel"]) <= s["match"] or r["best_rel"] < 0
    # (updates per start, target <= 50: in the table; the target rows are ratios)
    return [target("Time to optimum, lynx-hare 32 starts, L-BFGS vs SciPy (warm)", ">=", 3,
                   {"x": ratio(s["scipy"]["seconds"], r["seconds"]) if reached else None})]


if __name__ == "__main__":
    main("time_to_optimum", __doc__, SECTIONS, render, targets)
