"""Output times: each method's continuous extension against an integrated step per
output, on the same recorded mesh (float64).

- accuracy: the error of the outputs at 200 times (`interpolate=True` and `False` on
  one mesh per tolerance) and of the final state, against a reference at rtol 1e-12
  (Vern7 for Lorenz, Rodas5P for the stiff problems, integrated outputs);
  error = max over components of max|y - y_ref| / max|y_ref| (each component on its own
  scale: Robertson's y2 is 1e-5 of y1);
- cost: the reverse-mode gradient of `sum(ys ** 2)` with no outputs, 100 integrated
  outputs and 100 from the continuous extension (warm medians, compile excluded), on
  Lorenz, the neural spiral (a width-64 MLP field) and Robertson.

`interpolate=None` (the default) takes the continuous extension where its order is
at least 3 (Tsit5, Rodas5P, Vern7) and the integrated step otherwise (Rosenbrock23);
this table is the measurement behind that rule.

    .venv/bin/python benchmarks/outputs.py [--quick] [--only cost]
"""

from _harness import fmt, log, main, md_table, warm

import equinox as eqx  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import gradsolve as gs  # noqa: E402

N_TS = 200
# (problem, method, atol as a multiple of rtol, or a fixed atol; the reference method)
CASES = [("lorenz", "tsit5", ("times", 1e-3), "vern7"),
         ("lorenz", "vern7", ("times", 1e-3), "vern7"),
         ("robertson", "rodas5p", ("fixed", 1e-10), "rodas5p"),
         ("robertson", "rosenbrock23", ("fixed", 1e-10), "rodas5p"),
         ("hires", "rodas5p", ("times", 1e-3), "rodas5p")]
RTOLS = [1e-3, 1e-5, 1e-7, 1e-9]


def output_times(prob, n):
    """`n` times inside the span: log-spaced from 1e-4 of it (the stiff transients sit
    at the start), with the span's ends."""
    t0, t1 = prob.t_span
    inner = t0 + (t1 - t0) * np.geomspace(1e-4, 1.0, n - 1)
    return np.concatenate([[t0], inner])


def atol_of(spec, rtol):
    kind, value = spec
    return rtol * value if kind == "times" else value


def error(ys, ref):
    """Max over components of max|ys - ref| / max|ref| (over trajectories and times)."""
    d = ref.shape[-1]
    diff = np.abs(np.asarray(ys) - ref).reshape(-1, d).max(0)
    return float((diff / np.abs(ref).reshape(-1, d).max(0)).max())


def accuracy(args):
    n = 4 if args.quick else 8
    rtols = RTOLS[:2] if args.quick else RTOLS
    rows = []
    for name, method, atol_spec, ref_method in CASES:
        prob = getattr(gs.problems, name)(n=n)
        ts = output_times(prob, N_TS)
        ref = gs.solve(prob, ts=ts, method=ref_method, engine="general", interpolate=False,
                       rtol=1e-12, atol=1e-14, max_steps=200_000).raise_for_status()
        ref_ys, ref_final = np.asarray(ref.ys), np.asarray(ref.ys[:, -1])
        for rtol in rtols:
            mesh = gs.record(prob, method=method, rtol=rtol, atol=atol_of(atol_spec, rtol),
                             recorder="general", max_steps=200_000)
            out = {"problem": name, "method": method, "rtol": rtol,
                   "steps": int(np.max(np.asarray(mesh.n_steps))),
                   "final": error(gs.replay(prob, mesh), ref_final),
                   "integrated": error(gs.replay(prob, mesh, ts=ts, interpolate=False), ref_ys),
                   "interpolated": error(gs.replay(prob, mesh, ts=ts, interpolate=True),
                                         ref_ys)}
            rows.append(out)
            log(f"  {name} {method} rtol {rtol:g}: final {out['final']:.2e}, integrated "
                f"{out['integrated']:.2e}, interpolated {out['interpolated']:.2e}")
    return {"n": n, "outputs": N_TS, "rows": rows}


def cost(args):
    repeats = args.repeats or (3 if args.quick else 15)
    out = {}
    # The neural spiral is the Diffrax neural ODE example's field (a width-64 MLP in
    # gs.Shared) at its tolerances: a field whose evaluations cost more than the
    # outputs' gathers and weights, where Lorenz's do not.
    for name, method, n, rtol, atol in (("lorenz", "tsit5", 128, 1e-6, 1e-9),
                                        ("lorenz", "vern7", 128, 1e-6, 1e-9),
                                        ("neural_spiral", "tsit5", 32, 1e-3, 1e-6),
                                        ("neural_spiral", "vern7", 32, 1e-3, 1e-6),
                                        ("robertson", "rodas5p", 64, 1e-6, 1e-10)):
        prob = getattr(gs.problems, name)(n=n)
        ts = output_times(prob, 100)
        mesh = gs.record(prob, method=method, rtol=rtol, atol=atol, recorder="general")

        def grad_fn(out_ts, interpolate):
            @eqx.filter_jit
            def g(p):
                return eqx.filter_value_and_grad(lambda q: jnp.sum(gs.replay(
                    prob, mesh, params=q, ts=out_ts, interpolate=interpolate) ** 2))(p)
            return lambda: g(prob.params)
        times = {k: warm(grad_fn(*v), repeats)["median_s"] for k, v in (
            ("no outputs", (None, None)), ("integrated", (ts, False)),
            ("interpolated", (ts, True)))}
        out[f"{name} ({method})"] = {"n": n, "rtol": rtol, "outputs": len(ts),
                                     "steps": int(np.max(np.asarray(mesh.n_steps))),
                                     "gradient_s": times}
        log(f"  {name}: " + ", ".join(f"{k} {1e3 * v:.2f} ms" for k, v in times.items()))
    return {"repeats": repeats, "problems": out}


SECTIONS = {"accuracy": accuracy, "cost": cost}


def render(sections):
    blocks = {}
    if "accuracy" in sections:
        a = sections["accuracy"]
        blocks["accuracy"] = (
            f"n = {a['n']} trajectories, {a['outputs']} output times; errors against the "
            f"reference (see the script).\n\n" + md_table(
                ["problem", "method", "rtol", "mesh steps", "final state error",
                 "integrated outputs error", "interpolated outputs error",
                 "interpolated / integrated"],
                [[r["problem"], r["method"], f"{r['rtol']:g}", r["steps"],
                  f"{r['final']:.2e}", f"{r['integrated']:.2e}", f"{r['interpolated']:.2e}",
                  fmt(r["interpolated"] / r["integrated"])] for r in a["rows"]]))
    if "cost" in sections:
        c = sections["cost"]
        rows = []
        for name, p in c["problems"].items():
            g = p["gradient_s"]
            rows += [[name, p["n"], p["steps"], k, f"{1e3 * v:.2f}",
                      fmt(v / g["no outputs"])] for k, v in g.items()]
        blocks["cost"] = md_table(["problem", "n", "mesh steps", "100 outputs",
                                   "gradient ms", "/ no outputs"], rows)
    return blocks


def targets(sections):
    return []  # a measured table for the docs; the speed targets live in neural_ode.py


if __name__ == "__main__":
    main("outputs", __doc__, SECTIONS, render, targets)
