"""Rosenbrock--Wanner steps: the trial step (with error estimate) and the plain step.

Each step forms `W` from `J = df/dy` (by `jax.jacfwd`: the user never supplies it),
factors it ONCE and reuses the factors for every stage. Every stage solve goes
through `jax.lax.custom_linear_solve` with the LU solve and its transpose, so
reverse mode costs one transposed solve per stage and never differentiates the
elimination steps; the dependence of `W` on the parameters enters through its
matrix-vector product.

A zero step (mesh padding) would make `W` singular; it is computed with a stand-in
step of one and discarded, so no NaN reaches a derivative.
"""

import dataclasses
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.scipy.linalg as jsl
from jax.extend.core import jaxprs_in_params

from ._base import Method
from ._rosenbrock_tableau import RosenbrockTableau


def _solver(W):
    """`b -> W^{-1} b` through one LU factorization, differentiated by the
    linear-solve rule (transposed solve) rather than through the elimination.

    On the CPU the factorization and solves are plain JAX (`_lu`), not LAPACK:
    jaxlib 0.10's batched LAPACK kernels split a batch over XLA's intra-op thread
    pool and block on it, and when as many of them run at once as the pool has
    threads (the replay's gradient runs stage solves side by side) every pool thread
    waits for work queued behind it: the PEtab gradients of Bachmann_MSB2011 and
    Lucarelli_CellSystems2018 stopped for ever there (issue 27, 9b; jax commit
    859992407d turns the splitting off from jaxlib 0.11)."""
    if jax.default_backend() != "cpu":
        lu = jsl.lu_factor(W)
        solve_, transpose_solve = (lambda r: jsl.lu_solve(lu, r),
                                   lambda r: jsl.lu_solve(lu, r, trans=1))
    else:
        # The factors carry no derivative either way: custom_linear_solve takes W's
        # through its matrix-vector product.
        lu, perm = jax.lax.stop_gradient(_lu(W))
        solve_, transpose_solve = (lambda r: _lu_solve(lu, perm, r),
                                   lambda r: _lu_solve_transposed(lu, perm, r))

    def solve(b):
        return jax.lax.custom_linear_solve(
            lambda x: W @ x, b, solve=lambda _, r: solve_(r),
            transpose_solve=lambda _, r: transpose_solve(r))
    return solve


def _lu(W):
    """`(LU, perm)` with `W[perm] = L U` (unit lower `L` below the diagonal of `LU`,
    `U` on and above it): Doolittle elimination with partial pivoting, as LAPACK's
    getrf, in JAX operations only."""
    d = W.shape[0]
    rows = jnp.arange(d)

    def eliminate(k, carry):
        A, perm = carry
        p = jnp.argmax(jnp.where(rows >= k, jnp.abs(A[:, k]), -1))
        A = A.at[k].set(A[p]).at[p].set(A[k])
        perm = perm.at[k].set(perm[p]).at[p].set(perm[k])
        below = rows > k
        m = jnp.where(below, A[:, k] / A[k, k], 0)
        A = A - jnp.outer(m, jnp.where(below, A[k], 0))
        return A.at[:, k].set(jnp.where(below, m, A[:, k])), perm
    return jax.lax.fori_loop(0, d, eliminate, (W, rows))


def _substitute(M, b, lower, unit):
    """`x` with `T x = b`, `T` the lower or upper triangle of `M` (unit diagonal if
    `unit`)."""
    d = b.shape[0]
    cols = jnp.arange(d)

    def row(n, x):
        i = n if lower else d - 1 - n
        known = cols < i if lower else cols > i
        r = x[i] - jnp.dot(jnp.where(known, M[i], 0), x)
        return x.at[i].set(r if unit else r / M[i, i])
    return jax.lax.fori_loop(0, d, row, b)


def _lu_solve(lu, perm, b):
    return _substitute(lu, _substitute(lu, b[perm], True, True), False, False)


def _lu_solve_transposed(lu, perm, b):
    """`x` with `W^T x = b`: `U^T z = b`, `L^T w = z`, `x[perm] = w`."""
    w = _substitute(lu.T, _substitute(lu.T, b, True, False), False, True)
    return jnp.zeros_like(w).at[perm].set(w)


# A Rosenbrock step's stages after the first run as one loop (`jax.lax.fori_loop`)
# where the field's jaxpr has more than this many equations, else unrolled. XLA's
# compile time grows with the program, and each unrolled stage holds the field, its
# solve and their derivatives; a loop pays a few microseconds per stage and step.
# Measured (Rodas5P, first gradient's XLA compile / warm gradient, unrolled -> looped;
# 2026-12-08): Boehm_JProteomeRes2014 (99 equations) 12.7 -> 7.0 s / 82 -> 89 ms;
# Fujita_SciSignal2010 (106) 11.1 -> 6.8 s / 103 -> 107 ms; HIRES (57, 128
# trajectories) 2.6 -> 2.0 s / 32 -> 33 ms. Below the threshold, looped, Robertson (16)
# would take 3.3 -> 2.6 s / 6.2 -> 8.9 ms and neural Robertson (27) 5.1 -> 4.1 s / 42
# -> 44 ms: their unrolled steps are cheap to compile and faster to run.
STAGE_LOOP_EQUATIONS = 40


def _equations(f, t, y, args) -> int:
    """How many equations the jaxpr of `f(t, y, args)` has, nested ones included."""
    def count(jaxpr):
        return sum(1 + sum(count(sub) for sub in jaxprs_in_params(eqn.params))
                   for eqn in jaxpr.eqns)
    return count(eqx.filter_make_jaxpr(f)(t, y, args)[0].jaxpr)


def _safe(h):
    return jnp.where(h > 0, h, jnp.ones_like(h))


def uses_time(f, t, y, args) -> bool:
    """Whether `f(t, y, args)` reads `t` (any equation of its jaxpr takes it). Only
    the arrays of `args` are traced: an MLP's activation (a function) is code."""
    arrays, code = eqx.partition(args, eqx.is_array)
    closed = jax.make_jaxpr(lambda t, y, a: f(t, y, eqx.combine(a, code)))(t, y, arrays)
    t_var = closed.jaxpr.invars[0]

    def reads(jaxpr, var):
        for eqn in jaxpr.eqns:
            if any(v is var for v in eqn.invars):
                return True
        return False
    return reads(closed.jaxpr, t_var)


@dataclasses.dataclass(frozen=True, eq=False)
class Rosenbrock(Method):
    """A Rosenbrock--Wanner method in transformed form (see `RosenbrockTableau`)."""

    tableau: RosenbrockTableau
    implicit: ClassVar[bool] = True

    def _step(self, f, t, y, h, args, f0, with_error):
        tab = self.tableau
        dtype = y.dtype
        h = _safe(h)
        J = jax.jacfwd(f, argnums=1)(t, y, args)
        needs_ft = bool((tab.d != 0).any())
        f_t = jax.jacfwd(f, argnums=0)(t, y, args) if needs_ft else None
        W = jnp.eye(y.shape[0], dtype=dtype) / (h * tab.gamma) - J
        solve = _solver(W)

        def stage(i, combined):
            """`u_i`, given `combined(w)`: `sum_{j<i} w[i, j] u_j` (None: no term)."""
            if isinstance(i, int) and i == 0:
                slope = f0
            else:
                shift = combined(tab.a)
                slope = f(t + jnp.asarray(tab.c, dtype)[i] * h,
                          y if shift is None else y + shift, args)
            rhs, coupled = slope, combined(tab.C)
            if coupled is not None:
                rhs = rhs + coupled / h
            if needs_ft and not (isinstance(i, int) and tab.d[i] == 0):
                rhs = rhs + (jnp.asarray(tab.d, dtype)[i] * h) * f_t
            return solve(rhs)

        if _equations(f, t, y, args) > STAGE_LOOP_EQUATIONS:
            def later(i, us):
                return us.at[i].set(stage(i, lambda w: jnp.asarray(w, dtype)[i] @ us))
            us = jnp.zeros((tab.stages,) + y.shape, dtype).at[0].set(stage(0, lambda w: None))
            us = list(jax.lax.fori_loop(1, tab.stages, later, us))
        else:  # term by term, the zero coefficients skipped
            us = []
            for i in range(tab.stages):
                us.append(stage(i, lambda w, i=i: _weighted(w[i, :i], us, dtype)))
        y_new = y + _weighted(tab.m, us, dtype)
        err = _weighted(tab.m_err, us, dtype) if with_error else None
        return y_new, err, us

    def trial_step(self, f, t, y, f0, h, args):
        """`(y_new, y_error, f(t + h, y_new))` of a step of size `h` from `(t, y)`."""
        y_new, err, _ = self._step(f, t, y, h, args, f0, True)
        return y_new, err, f(t + h, y_new, args)

    def plain_step(self, f, t, y, h, args):
        """The step without its error estimate; a zero step returns `y`."""
        y_new, _, _ = self._step(f, t, y, h, args, f(t, y, args), False)
        return jnp.where(h > 0, y_new, y)

    @property
    def has_dense_output(self) -> bool:
        return self.tableau.dense is not None

    def dense_step(self, f, t, y, f0, h, args):
        """`(y_new, K, f(t + h, y_new))`: the step with `f0 = f(t, y)` given, and the
        three combinations `K` of its stages that its continuous extension reads (see
        `rodas5p.py`); a zero step returns `y`."""
        y_new, _, us = self._step(f, t, y, h, args, f0, False)
        y_new = jnp.where(h > 0, y_new, y)
        K = jnp.stack([_weighted(row, us, y.dtype) for row in self.tableau.dense])
        return y_new, K, f(t + h, y_new, args)

    def interpolate(self, y, y_new, h, K, theta):
        """The state at `t + theta h` inside the step `(t, y) -> y_new` with the
        combinations `K` from `dense_step`: `(1 - theta) y + theta (y_new + (1 -
        theta) (K_0 + theta (K_1 + theta K_2)))`."""
        del h  # the stages already carry it
        one = 1 - theta
        return one * y + theta * (y_new + one * (K[0] + theta * (K[1] + theta * K[2])))


def _weighted(weights, us, dtype):
    """`sum_j weights[j] us[j]` over the nonzero weights (None if there is none)."""
    w = jnp.asarray(weights, dtype)
    terms = [w[j] * us[j] for j in range(len(weights)) if weights[j] != 0]
    return sum(terms) if terms else None


@dataclasses.dataclass(frozen=True, eq=False)
class Rosenbrock23(Method):
    """Shampine & Reichelt's second-order linearly implicit pair (MATLAB's ode23s),
    for autonomous systems: `W = I - h d J`, two solves for the step, a third (with
    the FSAL slope `f(t + h, y_new)`) for the third-order error estimate."""

    implicit: ClassVar[bool] = True
    autonomous_only: ClassVar[bool] = True

    def _step(self, f, t, y, h, args, f0):
        dtype = y.dtype
        h = _safe(h)
        d = jnp.asarray(self.tableau.d, dtype)
        J = jax.jacfwd(f, argnums=1)(t, y, args)
        solve = _solver(jnp.eye(y.shape[0], dtype=dtype) - (h * d) * J)
        k1 = solve(f0)
        f1 = f(t + 0.5 * h, y + (0.5 * h) * k1, args)
        k2 = solve(f1 - k1) + k1
        return y + h * k2, solve, k1, k2, f1

    has_dense_output: ClassVar[bool] = True

    def dense_step(self, f, t, y, f0, h, args):
        """`(y_new, K = (k1, k2), f(t + h, y_new))`; a zero step returns `y`."""
        y_new, _, k1, k2, _ = self._step(f, t, y, h, args, f0)
        y_new = jnp.where(h > 0, y_new, y)
        return y_new, jnp.stack([k1, k2]), f(t + h, y_new, args)

    def interpolate(self, y, y_new, h, K, theta):
        """The ode23s interpolant at `t + theta h` (see `rosenbrock23.py`)."""
        del y_new
        d = jnp.asarray(self.tableau.d, y.dtype)
        w1, w2 = theta * (1 - theta), theta * (theta - 2 * d)
        return y + (h / (1 - 2 * d)) * (w1 * K[0] + w2 * K[1])

    def trial_step(self, f, t, y, f0, h, args):
        y_new, solve, k1, k2, f1 = self._step(f, t, y, h, args, f0)
        f2 = f(t + h, y_new, args)
        e32 = jnp.asarray(self.tableau.e32, y.dtype)
        k3 = solve(f2 - e32 * (k2 - f1) - 2 * (k1 - f0))
        return y_new, (_safe(h) / 6) * (k1 - 2 * k2 + k3), f2

    def plain_step(self, f, t, y, h, args):
        y_new = self._step(f, t, y, h, args, f(t, y, args))[0]
        return jnp.where(h > 0, y_new, y)
