"""The seed's systems build, and the non-stiff ones solve to their references."""

import jax
import jax.numpy as jnp
import pytest

import gradsolve as gs
from gradsolve.problem import trajectory_params, unwrap_shared
from helpers import rel_err


@pytest.mark.parametrize("name,d,stiff", [
    ("lorenz", 3, False), ("van_der_pol", 2, False), ("lorenz96", 8, False),
    ("linear", 4, False), ("robertson", 3, True), ("hires", 8, True),
    ("linear_stiff", 8, True), ("galactic_halo", 6, False)])
def test_builders_make_valid_problems(name, d, stiff):
    prob = getattr(gs.problems, name)(n=5)
    assert (prob.n, prob.d, prob.stiff, prob.name) == (5, d, stiff, name)
    dy = prob.f_one(0.0, prob.y0[0], trajectory_params(prob.params, 0))
    assert dy.shape == (d,) and bool(jnp.all(jnp.isfinite(dy)))


def test_linear_family_solves_to_its_closed_form():
    # rtol 1e-10 on a well-conditioned linear system: global error ~1e-9 relative.
    prob = gs.problems.linear(n=4, d=6)
    sol = gs.solve(prob, rtol=1e-10, atol=1e-12, engine="general")
    assert rel_err(sol.ys, gs.problems.linear_exact(prob, 1.0)) < 1e-8


def test_robertson_conserves_mass():
    # y1 + y2 + y3 is constant: the right-hand side sums to zero exactly.
    prob = gs.problems.robertson(n=3)
    y = jnp.array([0.7, 1e-5, 0.3])
    p = unwrap_shared(trajectory_params(prob.params, 1))
    assert abs(float(jnp.sum(prob.f_one(0.0, y, p)))) < 1e-12


def test_galactic_halo_conserves_energy():
    # A conservative potential: the energy at t1 equals that at t0 to the solve's
    # accuracy (rtol 1e-10 -> 1e-8 relative over a few orbits).
    prob = gs.problems.galactic_halo(n=3)
    sol = gs.solve(prob, rtol=1e-10, atol=1e-12, engine="general")

    def energy(y, q):
        x, u, z = y[:3]
        phi = 0.5 * jnp.log(0.1 ** 2 + x * x + u * u + z * z / q ** 2)
        return 0.5 * jnp.sum(y[3:] ** 2) + phi

    e0 = jax.vmap(energy)(prob.y0, prob.params["q"])
    e1 = jax.vmap(energy)(sol.ys, prob.params["q"])
    assert rel_err(e1, e0) < 1e-8
