"""Regenerate `stiff_references.json`: final states of the Robertson and HIRES
ensembles of `gs.problems` (default spreads, n = 4), computed independently of
gradsolve's integrators with SciPy's Radau IIA (order 5, fully implicit) at
rtol = 1e-13 and a tiny atol, and cross-checked against SciPy's BDF at the same
tolerances. The JSON stores the values, the settings and the largest Radau-BDF
difference, componentwise: every species relative to its own size (Robertson's
y2 ~ 6e-6 included), as the tests compare.

    .venv/bin/python tests/data/make_stiff_references.py
"""

import json
import pathlib

import jax

jax.config.update("jax_enable_x64", True)

import numpy as np  # noqa: E402
import scipy  # noqa: E402
from scipy.integrate import solve_ivp  # noqa: E402

import gradsolve as gs  # noqa: E402
from gradsolve.problem import trajectory_params, unwrap_shared  # noqa: E402


N = 4
RTOL, ATOL = 1e-13, 1e-20


def reference(prob):
    out = {}
    for method in ("Radau", "BDF"):
        finals = []
        for i in range(prob.n):
            p = unwrap_shared(trajectory_params(prob.params, i))
            f = jax.jit(lambda t, y, p=p: prob.f_jax(t, y, p))
            jac = jax.jit(jax.jacfwd(lambda t, y, p=p: prob.f_jax(t, y, p), argnums=1))
            sol = solve_ivp(lambda t, y: np.asarray(f(t, y)), prob.t_span,
                            np.asarray(prob.y0[i]), method=method, rtol=RTOL, atol=ATOL,
                            jac=lambda t, y: np.asarray(jac(t, y)))
            assert sol.success, sol.message
            finals.append(sol.y[:, -1])
        out[method] = np.stack(finals)
    return out


def main():
    data = {"how": (f"scipy {scipy.__version__} solve_ivp Radau, rtol={RTOL}, atol={ATOL}, "
                    "analytic Jacobian by jax.jacfwd; cross-checked with BDF"),
            "n": N}
    for name in ("robertson", "hires"):
        prob = getattr(gs.problems, name)(n=N)
        ref = reference(prob)
        diff = np.abs(ref["Radau"] - ref["BDF"]) / (np.abs(ref["Radau"]) + 1e-300)
        data[name] = {"t_span": list(prob.t_span), "y1": ref["Radau"].tolist(),
                      "max_rel_diff_radau_bdf": float(diff.max())}
        print(name, "max relative Radau-BDF difference", diff.max())
    path = pathlib.Path(__file__).with_name("stiff_references.json")
    path.write_text(json.dumps(data, indent=1))
    print("wrote", path)


if __name__ == "__main__":
    main()
