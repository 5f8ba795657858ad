"""Steady states for preequilibration, differentiable by the implicit function theorem.

The steady state of `dx/dt = f(x, p)` from `x0` is found in two stages:

1. pseudo-transient continuation (linearly implicit Euler steps whose size grows as
   the residual falls, "switched evolution relaxation"): robust from far away, and
   every step keeps the conserved moieties `L x` of `x0` exactly, since `L f = 0` and
   `L J = 0`;
2. Newton on `F(x) = f(x, p) + L^T (L x - L x0)`, inside `lax.custom_root`. Where
   the conservation laws make the Jacobian of `f` singular, `J + L^T L` is not (at a
   steady state that is hyperbolic within its conserved class), so the root is
   unique and its derivative with respect to `p` and `x0` -- through the conserved
   totals -- is the implicit function theorem's: exact, not that of the iterations.

`L` comes from `conservation_laws` (the model's rates, symbolically).
"""

import jax
import jax.numpy as jnp
import numpy as np
import scipy.linalg
import sympy as sp

PTC_STEPS = 200   # continuation steps (a fixed count: the loop is traced once)
NEWTON_STEPS = 8  # Newton steps polishing the continuation's result
MAX_STEP = 1e8    # largest continuation step: beyond it (I/h - J) is J's conditioning


def conservation_laws(rates, weights) -> np.ndarray:
    """The rows `l` with `sum_i l_i * weights_i * rates_i == 0` identically: the
    conserved moieties of the amounts `weights_i * x_i`.

    Args:
        rates: per state, `d x_i / dt` as a SymPy expression.
        weights: per state, the factor turning the state into an amount (a compartment
            size, a SymPy expression or number; 1 for amounts and parameters).

    Returns:
        `(r, d)` float array, orthonormal rows (r may be 0).
    """
    columns, rows = {}, []
    for rate, w in zip(rates, weights):
        row = {}
        for term in sp.Add.make_args(sp.expand(w * rate)):
            if term == 0:
                continue
            coeff, rest = term.as_coeff_Mul()
            row[rest] = row.get(rest, 0.0) + float(coeff)
            columns.setdefault(rest, len(columns))
        rows.append(row)
    C = np.zeros((len(rates), max(len(columns), 1)))
    for i, row in enumerate(rows):
        for rest, c in row.items():
            C[i, columns[rest]] = c
    return scipy.linalg.null_space(C.T, rcond=1e-12).T


def steady_state(f, x0, p, L, rtol, atol):
    """The steady state of `dx/dt = f(x, p)` reached from `x0`, with the moieties
    `L x0` conserved; differentiable in `p`, `x0` and `L` (see the module docstring).

    Returns `(x, ok)`: `ok` is False where the residual exceeds `atol + rtol |x|` in
    some component, or is not finite.
    """
    def jac(x):
        return jax.jacfwd(f)(x, p)

    def ptc(x):
        def step(carry, _):
            x, h, r = carry
            fx = f(x, p)
            dx = jnp.linalg.solve(jnp.eye(x.size, dtype=x.dtype) / h - jac(x), fx)
            x_new = x + dx
            r_new = jnp.linalg.norm(f(x_new, p))
            good = jnp.all(jnp.isfinite(x_new)) & (r_new < 10 * r + atol)
            grow = jnp.where(r_new > 0, r / r_new, 10.0)
            h_new = jnp.where(good, jnp.clip(h * grow, h, MAX_STEP), h / 10)
            return (jnp.where(good, x_new, x), h_new, jnp.where(good, r_new, r)), None
        r0 = jnp.linalg.norm(f(x, p))
        h0 = jnp.asarray(1e-3, x.dtype)
        (x, _, _), _ = jax.lax.scan(step, (x, h0, r0), None, length=PTC_STEPS)
        return x

    total = L @ x0

    def residual(x):
        return f(x, p) + L.T @ (L @ x - total)

    def newton(g, x):
        def step(x, _):
            return x - jnp.linalg.solve(jax.jacfwd(g)(x), g(x)), None
        return jax.lax.scan(step, x, None, length=NEWTON_STEPS)[0]

    def tangent(g, y):
        return jnp.linalg.solve(jax.jacfwd(g)(jnp.zeros_like(y)), y)

    guess = jax.lax.stop_gradient(ptc(x0))
    x = jax.lax.custom_root(residual, guess, newton, tangent)
    fx = f(x, p)
    ok = jnp.all(jnp.isfinite(x)) & jnp.all(jnp.abs(fx) <= atol + rtol * jnp.abs(x))
    return x, ok
