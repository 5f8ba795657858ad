"""PEtab v1's objective: simulated values and noise per measurement row, the negative
log-likelihood and chi^2 of the rows, and the objective priors.

Pure functions of the compiled problem (`_model.JaxModel`, which holds its
`_tables.Tables`), the replay's states `ys` `(K, len(ts), d)` and theta (a dict of the
estimated parameters); all traceable, so one `jax.value_and_grad` gives the
cotangents of `ys` and theta the gradient needs.
"""

import jax
import jax.numpy as jnp
import numpy as np

from ._model import JaxModel


def rows(model: JaxModel, ys, theta):
    """Simulated values and noise per measurement row, each `(M,)`."""
    t = model.tables
    v = model.vector(theta)
    p = model.to_params(theta)
    g = t.g.at(v)
    M = len(t.measurements)
    sim = jnp.zeros(M, ys.dtype)
    sigma = jnp.ones(M, ys.dtype)
    steady = model.steady_states(theta, model.to_y0(theta)) if t.steady_of.size else None
    for o, (obs, noise) in zip(t.observables, model.observables):
        at = o.rows
        if not at.size:
            continue
        k, tau, inf = t.row_trajectory[at], t.row_time[at], t.row_inf[at]
        time = jnp.where(inf, jnp.inf, jnp.asarray(t.ts[tau], ys.dtype))
        x, pk, q, r = ys[k, tau], p[k], o.values.at(v), o.noise_values.at(v)
        if inf.any():
            x = jnp.where(inf[:, None], steady[k], x)
        s = jax.vmap(lambda ti, x, p, q: obs(ti, x, p, q, g)[0])(time, x, pk, q)
        n = jax.vmap(lambda ti, x, p, q, r, s: noise(ti, x, p, q, r, g, s)[0])(
            time, x, pk, q, r, s)
        sim, sigma = sim.at[at].set(s), sigma.at[at].set(n)
    return sim, sigma


def _residual(transformation, s, m):
    """The residual of simulated `s` against measured `m` on the observable's scale,
    and the log of that scale's Jacobian at `m` (the likelihood's change of variables)."""
    if transformation == "lin":
        return s - m, 0.0
    if transformation == "log":
        return jnp.log(s) - jnp.log(m), jnp.log(m)
    return jnp.log10(s) - jnp.log10(m), jnp.log(m * np.log(10.0))


def terms(model: JaxModel, ys, theta, y):
    """Per-row negative log-likelihood and squared normalised residual of the
    measurements `y` `(M,)`."""
    sim, sigma = rows(model, ys, theta)
    nllh = jnp.zeros_like(sim)
    chi2 = jnp.zeros_like(sim)
    for o in model.tables.observables:
        at = o.rows
        sd = sigma[at]
        r, jac = _residual(o.transformation, sim[at], y[at])
        z = r / sd
        if o.distribution == "normal":
            term = 0.5 * jnp.log(2 * np.pi * sd ** 2) + jac + 0.5 * z ** 2
        else:
            term = jnp.log(2 * sd) + jac + jnp.abs(z)
        nllh, chi2 = nllh.at[at].set(term), chi2.at[at].set(z ** 2)
    return nllh, chi2


# The least-squares form of a normal likelihood whose noise is estimated: each row adds
# a residual sqrt(log(2 pi sigma^2) + SIGMA_OFFSET), half of whose square is the row's
# log(sigma) term plus a constant, so half the squared norm of all the residuals is
# the negative log-likelihood plus a constant. The offset keeps the root real for
# sigma >= exp(-SIGMA_OFFSET / 2) / sqrt(2 pi) = 5.5e-12 (a trial point below is
# not finite, and a trust region rejects it); the larger it is, the closer the
# Gauss-Newton Hessian of these rows is to the true one (its error ~ 1 / SIGMA_OFFSET).
SIGMA_OFFSET = 50.0


def residuals(model: JaxModel, ys, theta, y):
    """The residuals of the measurements `y` `(M,)`: the normalised residuals `(M,)`
    then the noise rows `(M,)` (see `SIGMA_OFFSET`); half their squared norm is the
    negative log-likelihood up to a constant. Normal noise only (`least_squares_refusal`)."""
    sim, sigma = rows(model, ys, theta)
    z = jnp.zeros_like(sim)
    for o in model.tables.observables:
        at = o.rows
        r, _ = _residual(o.transformation, sim[at], y[at])
        z = z.at[at].set(r / sigma[at])
    return jnp.concatenate([z, jnp.sqrt(jnp.log(2 * np.pi * sigma ** 2) + SIGMA_OFFSET)])


def least_squares_refusal(model: JaxModel) -> str | None:
    """Why the problem's objective is not a sum of squares, or None."""
    laplace = [o.id for o in model.tables.observables if o.distribution != "normal"]
    if laplace:
        return f"observables {laplace} have Laplace noise (an absolute value, not a square)"
    if model.tables.priors:
        return f"parameters {sorted(model.tables.priors)} have objective priors"
    return None


def neg_llh(model: JaxModel, ys, theta, data):
    """The negative log-likelihood of `data["measurement"]`."""
    return jnp.sum(terms(model, ys, theta, data["measurement"])[0])


def log_prior(model: JaxModel, theta):
    """The sum of the objective priors' log-densities at theta (0 without priors);
    see `_tables.PRIORS`."""
    t = model.tables
    total = jnp.zeros((), jnp.result_type(float))
    for pid, (kind, a, b) in t.priors.items():
        x = jnp.asarray(theta[pid], total.dtype)
        if kind.startswith("parameterScale"):
            z, jac = {"lin": x, "log": jnp.log(x), "log10": jnp.log10(x)}[t.scales[pid]], 0.0
        elif kind.startswith("log"):
            z, jac = jnp.log(x), jnp.log(x)
        else:
            z, jac = x, 0.0
        if kind.endswith(("uniform", "Uniform")):
            density = jnp.where((z >= a) & (z <= b), -np.log(b - a), -jnp.inf)
        elif kind.endswith(("normal", "Normal")):
            density = -0.5 * ((z - a) / b) ** 2 - np.log(b) - 0.5 * np.log(2 * np.pi)
        else:  # laplace
            density = -jnp.abs(z - a) / b - np.log(2 * b)
        total = total + density - jac
    return total
