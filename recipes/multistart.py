"""Multistart calibration of Lotka-Volterra on the Hudson's Bay lynx and hare pelts.

    .venv/bin/python recipes/multistart.py [--starts 32] [--slots 8] [--steps 100]
        [--checkpoint-dir runs/lynx_hare] [--no-scipy]

The data are the Hudson's Bay Company's pelt counts (thousands) of snowshoe hares and
Canadian lynx, 1900-1920, as tabulated in Howard (2009), "Modeling Basics", and used
by the Stan case study "Predator-Prey Population Dynamics" (Carpenter, 2018):

    hare' = alpha hare - beta hare lynx        lynx' = delta hare lynx - gamma lynx

Six numbers are estimated from the 21 years: the four rates and both initial
populations (hare0, lynx0 in 1900), all on log scales -- the rates on
`gs.transforms.Log10` bounded by the start box on clipped edges (a valley that runs
to a bound ends there), the initial states on `Log` -- by least
squares on log counts (multiplicative noise), given to the Calibrator as residuals, so
each start is fitted by Levenberg-Marquardt (the default for residuals; the Jacobian
by forward mode). 32 Sobol starts spread over the box work through 8 concurrent slots:
a slot whose fit converges takes the next start. The
recipe prints the best fits, draws the waterfall (final loss of every start, sorted)
and the profile of alpha (12 grid points re-optimised through the same 8 slots), and checks
the best fit against an independent SciPy least-squares fit of the same residuals
(`scipy.integrate.solve_ivp`, DOP853 at rtol 1e-10, and `scipy.optimize.least_squares`
from round rates and the 1900 counts).
"""

import argparse
import pathlib
import time

import _common  # noqa: F401 - x64

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import gradsolve as gs  # noqa: E402


YEARS = np.arange(1900, 1921)
HARE = np.array([30.0, 47.2, 70.2, 77.4, 36.3, 20.6, 18.1, 21.4, 22.0, 25.4, 27.1,
                 40.3, 57.0, 76.6, 52.3, 19.5, 11.2, 7.6, 14.6, 16.2, 24.7])
LYNX = np.array([4.0, 6.1, 9.8, 35.2, 59.4, 41.7, 19.0, 13.0, 8.3, 9.1, 7.4,
                 8.0, 12.3, 19.5, 45.7, 51.1, 29.7, 15.8, 9.7, 10.1, 8.6])
TS = jnp.asarray(YEARS[1:] - YEARS[0], float)  # the years after 1900; 1900 is y0
RATES = ("alpha", "beta", "gamma", "delta")
LO = {"alpha": 0.1, "beta": 0.005, "gamma": 0.1, "delta": 0.005, "hare0": 10.0,
      "lynx0": 1.0}
HI = {"alpha": 2.0, "beta": 0.1, "gamma": 2.0, "delta": 0.1, "hare0": 80.0,
      "lynx0": 20.0}


def lotka_volterra(t, y, p):
    hare, lynx = y[0], y[1]
    return jnp.stack([p["alpha"] * hare - p["beta"] * hare * lynx,
                      p["delta"] * hare * lynx - p["gamma"] * lynx])


def residuals(ys, theta):
    """Log-count residuals of one fit: 1900 from its initial states, 1901-1920 from the
    solution at TS. The same function SciPy's fit below minimises."""
    first = jnp.log(jnp.stack([theta["hare0"], theta["lynx0"]])) - jnp.log(
        jnp.array([HARE[0], LYNX[0]]))
    later = jnp.log(ys) - jnp.log(jnp.stack([HARE[1:], LYNX[1:]], axis=1))
    return jnp.concatenate([first, later.ravel()])


def build(starts=32, seed=0, **kw):
    """`(calibrator, theta0)`: one trajectory per start (K = 1), `starts` Sobol starts;
    `kw` go to the Calibrator (checkpoints, say)."""
    prob = gs.EnsembleProblem(
        lotka_volterra, y0=jnp.ones((starts, 2)),
        params={k: jnp.ones(starts) for k in RATES}, t_span=(0.0, 20.0), name="lynx_hare")
    transform = {k: gs.transforms.Log10(LO[k], HI[k], edges="clip") for k in RATES}
    transform.update(hare0=gs.transforms.Log(), lynx0=gs.transforms.Log())
    cal = gs.Calibrator(
        prob, residuals=lambda ys, theta, _: residuals(ys[0], theta),
        to_params=lambda th: {k: jnp.full(1, th[k]) for k in RATES},
        to_y0=lambda th: jnp.stack([th["hare0"], th["lynx0"]])[None],
        ts=TS, rtol=1e-8, atol=1e-8, transform=transform, **kw)
    theta0 = gs.multistart(LO, HI, starts, jax.random.key(seed),
                           scale={k: "log" for k in LO})
    return cal, theta0


# SciPy's starting point: round rates and the 1900 counts as the initial states (from
# the centre of the box, least_squares ends in a local minimum with alpha -> 0).
GUESS = {"alpha": 1.0, "beta": 0.05, "gamma": 1.0, "delta": 0.05, "hare0": HARE[0],
         "lynx0": LYNX[0]}


def scipy_fit(x0):
    """Least squares on the same residuals with SciPy alone: solve_ivp (DOP853, rtol
    1e-10) for the model, least_squares over the logs of the six numbers."""
    from scipy.integrate import solve_ivp
    from scipy.optimize import least_squares

    names = RATES + ("hare0", "lynx0")

    def res(z):
        a, b, g, d, h0, l0 = np.exp(z)
        sol = solve_ivp(lambda t, y: [a * y[0] - b * y[0] * y[1], d * y[0] * y[1] - g * y[1]],
                        (0.0, 20.0), [h0, l0], t_eval=np.asarray(TS), method="DOP853",
                        rtol=1e-10, atol=1e-10)
        theta = dict(zip(names, np.exp(z)))
        return np.asarray(residuals(jnp.asarray(sol.y.T), {k: jnp.asarray(v)
                                                            for k, v in theta.items()}))
    out = least_squares(res, np.log([x0[k] for k in names]), xtol=1e-12, ftol=1e-12,
                        gtol=1e-12)
    return dict(zip(names, np.exp(out.x))), 0.5 * float(np.sum(out.fun ** 2))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--starts", type=int, default=32)
    p.add_argument("--slots", type=int, default=8, help="fits run at once")
    p.add_argument("--steps", type=int, default=100, help="update cap per start")
    p.add_argument("--checkpoint-dir", default=None, help="save/resume the starts here")
    p.add_argument("--profile-points", type=int, default=12)
    p.add_argument("--profile-steps", type=int, default=100)
    p.add_argument("--out", default="recipes/out", help="plots and the saved result")
    p.add_argument("--no-scipy", action="store_true", help="skip the SciPy comparison")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    cal, theta0 = build(args.starts, **(dict(checkpoint_dir=args.checkpoint_dir,
                                             checkpoint_every=200)
                                        if args.checkpoint_dir else {}))
    began = time.perf_counter()
    res = cal.fit(theta0, steps=args.steps, slots=args.slots, progress=not args.no_progress)
    took = time.perf_counter() - began
    order = np.argsort(np.where(np.isfinite(res.loss), res.loss, np.inf))
    print(f"{args.starts} starts through {args.slots} slots: {res.updates} updates in "
          f"{took:.1f} s (incl. compile), engine {res.engine}; converged "
          f"{int(res.converged.sum())}/{args.starts}")
    print(res.table().splitlines()[0])
    for line in np.asarray(res.table().splitlines()[1:])[order[:8]]:
        print(line)
    best = res.best()
    near = np.sum(res.loss <= best.loss * (1 + 1e-6) + 1e-12)
    print(f"best start {best.index}: loss {best.loss:.6g}; {near} starts within 1e-6 of it")
    res.save(out / "multistart.npz")
    res.plot(kind="waterfall", path=out / "multistart_waterfall.png")

    grid = float(best.theta["alpha"]) * np.exp(np.linspace(-0.15, 0.15, args.profile_points))
    prof = cal.profile(res, "alpha", grid, steps=args.profile_steps, slots=args.slots,
                       progress=not args.no_progress)
    prof.plot(kind="profile", name="alpha", path=out / "multistart_profile_alpha.png")
    print("profile of alpha (others re-optimised):")
    for a, loss, status in zip(grid, prof.loss, prof.status_names):
        print(f"  alpha {a:8.5f}  loss {loss:10.6f}  {status}")

    if not args.no_scipy:
        ref, ref_loss = scipy_fit(GUESS)
        print(f"{'':>8} {'gradsolve':>12} {'SciPy':>12} {'rel diff':>9}")
        for k, v in ref.items():
            mine = float(best.theta[k])
            print(f"{k:>8} {mine:12.6g} {v:12.6g} {abs(mine - v) / abs(v):9.2e}")
        print(f"{'loss':>8} {best.loss:12.6g} {ref_loss:12.6g} "
              f"{abs(best.loss - ref_loss) / ref_loss:9.2e}")
    print(f"plots and the result in {out}/")
    return res, prof


if __name__ == "__main__":
    main()
