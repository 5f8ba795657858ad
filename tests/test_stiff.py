"""Stiff and higher-order methods on the general path: Rosenbrock23, Rodas5P, Vern7.

References: a stored SciPy Radau solution at rtol 1e-13 (tests/data, with the
script that made it), the published HIRES end state, finite differences of the
replay on the same mesh, forward mode, and Diffrax's Dopri8.
"""

import json
import pathlib

import diffrax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gradsolve as gs
from helpers import rel_err, tree_rel_err


REFERENCES = json.loads(
    (pathlib.Path(__file__).parent / "data" / "stiff_references.json").read_text())


@pytest.fixture(scope="module")
def robertson():
    prob = gs.problems.robertson(n=REFERENCES["n"])
    mesh = gs.record(prob, rtol=1e-8, atol=1e-12, method="rodas5p")
    return prob, mesh


@pytest.fixture(scope="module")
def hires():
    prob = gs.problems.hires(n=REFERENCES["n"])
    mesh = gs.record(prob, rtol=1e-8, atol=1e-12, method="rodas5p")
    return prob, mesh


def _scaled_error(ys, ref, rtol, atol):
    """Max of |y - ref| / (atol + rtol |ref|): the error in units of the tolerance."""
    ys, ref = np.asarray(ys), np.asarray(ref)
    return float(np.max(np.abs(ys - ref) / (atol + rtol * np.abs(ref))))


@pytest.mark.parametrize("name", ["robertson", "hires"])
def test_final_states_match_stored_reference(name, request):
    # Global error of an adaptive solve is a modest multiple of the local tolerance;
    # within 100 tolerance units is "to the tolerance's accuracy" (measured: Robertson
    # ~2, HIRES ~10). The reference's own error (Radau vs BDF: 3e-12) is negligible.
    prob, mesh = request.getfixturevalue(name)
    assert mesh.method == "rodas5p" and mesh.ok
    ref = np.array(REFERENCES[name]["y1"])
    assert _scaled_error(gs.replay(prob, mesh), ref, 1e-8, 1e-12) < 100


def test_hires_field_reaches_the_published_end_state():
    # The IVP test set's HIRES solution at t = 321.8122 from the standard y0.
    published = np.array([0.7371312573325668e-3, 0.1442485726316185e-3,
                          0.5888729740967575e-4, 0.1175651343283149e-2,
                          0.2386356198831331e-2, 0.6238968252742796e-2,
                          0.2849998395185769e-2, 0.2850001604814231e-2])
    prob = gs.problems.hires(n=1, y1=(1.0, 1.0))
    sol = gs.solve(prob, rtol=1e-10, atol=1e-14, method="rodas5p")
    assert sol.engine == "general" and sol.method == "rodas5p"
    assert rel_err(sol.ys[0], published) < 1e-6


def _fd_check(prob, mesh, loss, x, wrt, picks):
    """Central differences of the replay on the SAME mesh against value_and_grad.
    Each pick carries its own step: the stiff replay's roundoff noise (~1e-13
    relative, amplified by W's conditioning) bounds it below and the curvature of
    the loss in that input above; the steps chosen sit where both are < 1e-7."""
    vg = gs.value_and_grad(prob, loss, wrt=wrt, mesh=mesh)
    _, g = vg()
    for path, index, eps in picks:
        def L(shift):
            leaf = x[path] if path else x
            bumped = leaf.at[index].add(shift)
            if wrt == "params":
                ys = gs.replay(prob, mesh, params=dict(x, **{path: bumped}))
            else:
                ys = gs.replay(prob, mesh, y0=bumped)
            return loss(ys, prob.params)
        fd = (L(eps) - L(-eps)) / (2 * eps)
        got = g[path][index] if path else g[index]
        assert rel_err(got, fd) < 1e-6, (path, index, float(got), float(fd))
    return vg


def test_robertson_rate_gradient_matches_fd_and_forward_mode(robertson):
    prob, mesh = robertson
    loss = lambda ys, p: jnp.sum(ys[:, 0] ** 2) + 1e4 * jnp.sum(ys[:, 1])
    vg = _fd_check(prob, mesh, loss, prob.params, "params",
                   [("k1", 0, 3e-8), ("k1", 3, 5e-8), ("k3", 1, 1e-2), ("k3", 2, 1e-2)])
    _, g_r = vg()
    _, g_f = gs.value_and_grad(prob, loss, mode="forward", mesh=mesh)()
    assert tree_rel_err(g_r, g_f) < 1e-10


def test_hires_initial_state_gradient_matches_fd_and_forward_mode(hires):
    prob, mesh = hires
    loss = lambda ys, p: jnp.sum(ys[:, 5] * ys[:, 7]) + jnp.sum(ys[:, 0])
    vg = _fd_check(prob, mesh, loss, prob.y0, "y0",
                   # y8(0) = 0.0057 feeds the stiff 280 y6 y8 term: a tiny step.
                   [(None, (0, 0), 1e-6), (None, (1, 7), 1e-9), (None, (3, 4), 1e-6)])
    _, g_r = vg()
    _, g_f = gs.value_and_grad(prob, loss, wrt="y0", mode="forward", mesh=mesh)()
    assert rel_err(g_r, g_f) < 1e-10


def test_stiff_problems_take_rodas5p_on_the_general_path():
    # A stiff field without a fused form: Rodas5P on the general path. A registered
    # stiff field (Robertson) takes the fused engines with Rosenbrock23 instead,
    # unless Rodas5P is asked for by name.
    registered = gs.problems.robertson(n=2)
    prob = registered.replace(f_jax=lambda t, y, p: registered.f_jax(t, y, p))
    vg = gs.value_and_grad(prob, lambda ys, p: ys.sum())
    assert (vg.engine, vg.mesh.method) == ("general_replay", "rodas5p")
    sol = gs.solve(prob)
    assert (sol.engine, sol.method) == ("general", "rodas5p")
    assert dict(sol.passed_over)["diffrax"] == "Diffrax has no 'rodas5p' solver"
    vg = gs.value_and_grad(registered, lambda ys, p: ys.sum())
    assert (vg.engine, vg.mesh.method, vg.mesh.recorder) == ("fused_replay", "rosenbrock23", "fused")
    assert gs.solve(registered, method="rodas5p").engine == "general"


def test_rosenbrock23_refuses_a_time_dependent_field():
    prob = gs.EnsembleProblem(f_jax=lambda t, y, p: -p * y * (1 + jnp.sin(t)),
                              y0=jnp.ones((2, 1)), params=jnp.ones(2), t_span=(0.0, 1.0),
                              stiff=True)
    with pytest.raises(ValueError, match="'rosenbrock23' is for autonomous systems"):
        gs.record(prob, method="rosenbrock23")
    assert gs.record(prob).method == "rodas5p"


def test_rosenbrock23_solves_robertson(robertson):
    # Second order: at rtol 1e-6 the end state is within 100 tolerance units too.
    prob, _ = robertson
    mesh = gs.record(prob, rtol=1e-6, atol=1e-10, method="rosenbrock23")
    ref = np.array(REFERENCES["robertson"]["y1"])
    assert mesh.ok and _scaled_error(gs.replay(prob, mesh), ref, 1e-6, 1e-10) < 100


def test_rodas5p_interpolation_is_accurate():
    # The continuous extension is fourth order; at rtol 1e-9 on the stiff linear family
    # its values at in-between times match expm to 1e-7 (the integrated extra step is
    # at the record's accuracy, 1e-8). Checked against the closed form.
    prob = gs.problems.linear_stiff(n=3, d=5)
    mesh = gs.record(prob, rtol=1e-9, atol=1e-12, method="rodas5p")
    ts = np.linspace(0.0, 1.0, 11)
    exact = np.stack([gs.problems.linear_exact(prob, t) for t in ts], axis=1)
    assert rel_err(gs.replay(prob, mesh, ts=ts, interpolate=True), exact) < 1e-7
    assert rel_err(gs.replay(prob, mesh, ts=ts), exact) < 1e-8
    with pytest.raises(ValueError, match="interpolate=True needs a method"):
        gs.solve(gs.problems.lorenz(n=2), ts=ts, interpolate=True)


def test_vern7_on_lorenz_matches_a_tight_reference_and_dopri8_gradient():
    # Vern7 at rtol 1e-10 vs Diffrax Dopri8 at 1e-13: states agree to ~1e-9 relative
    # (Lorenz amplifies the local tolerance ~10-100x over t in [0, 1]). The gradients
    # are of two different discretisations, each accurate to its tolerance: they agree
    # to the same order (1e-7 allows the sensitivities' larger error growth).
    prob = gs.problems.lorenz(n=4)
    loss = lambda ys, p: jnp.sum(ys ** 2)
    vg = gs.value_and_grad(prob, loss, method="vern7", rtol=1e-10, atol=1e-12)
    assert vg.mesh.method == "vern7"
    value, g = vg()

    def dopri8(params):
        def one(y0, p):
            sol = diffrax.diffeqsolve(
                diffrax.ODETerm(prob.f_jax), diffrax.Dopri8(), 0.0, 1.0, 1e-3, y0, args=p,
                stepsize_controller=diffrax.PIDController(rtol=1e-13, atol=1e-15),
                max_steps=4096)
            return sol.ys[0]
        return loss(jax.vmap(one)(prob.y0, params), params)

    ref_value, ref_g = jax.value_and_grad(dopri8)(prob.params)
    assert rel_err(gs.replay(prob, vg.mesh), gs.solve(prob, rtol=1e-13, atol=1e-15).ys) < 1e-8
    assert rel_err(value, ref_value) < 1e-9
    assert tree_rel_err(g, ref_g) < 1e-7
