"""Stiff and higher-order methods on the general path: Rosenbrock23, Rodas5P, Vern7.

References: a stored SciPy Radau solution at rtol 1e-13 (tests/data, with the
script that made it), the published HIRES end state, finite differences of the
replay on the same mesh, forward mode, and Diffrax's Dopri8.

Stiff species span decades (Robertson's y2 ~ 6e-6 beside y1 ~ 0.6), so states are
compared componentwise: each entry relative to its own size (`rel_err_componentwise`).
A tolerance states the error measured when it was set and its margin over it.
"""

import dataclasses
import json
import pathlib

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gradsolve as gs
from helpers import rel_err, rel_err_componentwise


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


@pytest.mark.parametrize("name,bound", [("robertson", 1e-7), ("hires", 3e-8)])
def test_final_states_match_stored_reference(name, bound, request):
    # Rodas5P at rtol 1e-8 against the Radau reference, every species relative to its
    # own size. Measured 9.4e-9 (Robertson, on y2) and 2.3e-9 (HIRES): the bounds are
    # ~10x. (The atol of 1e-12 is below every final species, so the record controls
    # each to rtol.) The reference's own error (Radau vs BDF, componentwise: 3.1e-12
    # and 3.2e-12) must be negligible: under 1% of the bound.
    prob, mesh = request.getfixturevalue(name)
    assert mesh.method == "rodas5p" and mesh.ok
    ref = np.array(REFERENCES[name]["y1"])
    assert REFERENCES[name]["max_rel_diff_radau_bdf"] < 0.01 * bound
    assert rel_err_componentwise(gs.replay(prob, mesh), ref) < bound


def test_hires_field_reaches_the_published_end_state():
    # The IVP test set's HIRES solution at t = 321.8122 from the standard y0.
    published = np.array([0.7371312573325668e-3, 0.1442485726316185e-3,
                          0.5888729740967575e-4, 0.1175651343283149e-2,
                          0.2386356198831331e-2, 0.6238968252742796e-2,
                          0.2849998395185769e-2, 0.2850001604814231e-2])
    prob = gs.problems.hires(n=1, y1=(1.0, 1.0))
    sol = gs.solve(prob, rtol=1e-10, atol=1e-14, method="rodas5p")
    assert sol.engine == "general" and sol.method == "rodas5p"
    # Every species to its own size: measured 1.4e-11 (on y7, y8); the bound is ~10x.
    assert rel_err_componentwise(sol.ys[0], published) < 1.5e-10


def _fd_check(prob, mesh, loss, x, wrt, picks, bound):
    """Central differences of the replay on the SAME mesh against value_and_grad.
    Each pick carries its own step: the stiff replay's roundoff noise (~1e-13
    relative, amplified by W's conditioning) bounds it below and the curvature of
    the loss in that input above. Every pick must agree to `bound` (relative)."""
    vg = gs.value_and_grad(prob, loss, wrt=wrt, mesh=mesh)
    _, g = vg()
    if wrt == "params":
        at = jax.jit(lambda x: loss(gs.replay(prob, mesh, params=x), prob.params))
    else:
        at = jax.jit(lambda x: loss(gs.replay(prob, mesh, y0=x), prob.params))
    for path, index, eps in picks:
        def L(shift):
            leaf = x[path] if path else x
            bumped = leaf.at[index].add(shift)
            return at(dict(x, **{path: bumped}) if path else bumped)
        fd = (L(eps) - L(-eps)) / (2 * eps)
        got = g[path][index] if path else g[index]
        assert rel_err(got, fd) < bound, (path, index, float(got), float(fd))
    return vg


def robertson_loss(ys, p):
    # y2 ~ 6e-6 weighted up so that the small species counts.
    return jnp.sum(ys[:, 0] ** 2) + 1e4 * jnp.sum(ys[:, 1])


def test_robertson_rate_gradient_matches_fd_and_forward_mode(robertson):
    # Rodas5P mesh. FD measured 1.8e-9 at most (bound ~10x); forward vs reverse mode
    # 3.7e-15, roundoff (bound ~10x).
    prob, mesh = robertson
    vg = _fd_check(prob, mesh, robertson_loss, prob.params, "params",
                   [("k1", 0, 3e-8), ("k1", 3, 5e-8), ("k3", 1, 1e-2), ("k3", 2, 1e-2)],
                   bound=2e-8)
    _, g_r = vg()
    _, g_f = gs.value_and_grad(prob, robertson_loss, mode="forward", mesh=mesh)()
    assert max(rel_err_componentwise(g_r[k], g_f[k]) for k in g_r) < 4e-14


def test_rosenbrock23_gradient_matches_fd_forward_mode_and_rodas5p(robertson):
    # Rosenbrock23, the fused default of every registered stiff field, on its own
    # fused-recorded mesh (rtol 1e-7: named, since the router would take Rodas5P
    # below 1e-6). (1) Central differences of the replay on the same mesh, steps
    # 1e-5 relative (the best measured: truncation ~2e-11, roundoff ~1e-10): measured
    # 5.3e-10 at most, bound ~10x. (2) Forward mode (the JAX replay) equals reverse
    # mode (the router's kernel_adjoint, Warp with explicit inverses instead of LU
    # solves) to roundoff: measured 5.9e-15, bound ~10x. (3) Against Rodas5P's gradient on its rtol 1e-8
    # mesh: two discretisations, the Rosenbrock23 one accurate to ~rtol: measured
    # 1.2e-7, bound ~10x.
    prob, rodas_mesh = robertson
    mesh = gs.record(prob, rtol=1e-7, atol=1e-11, method="rosenbrock23")
    assert (mesh.method, mesh.recorder) == ("rosenbrock23", "fused") and mesh.ok
    p = prob.params
    picks = [(k, i, 1e-5 * float(p[k][i])) for k in ("k1", "k2", "k3") for i in (0, 3)]
    vg = _fd_check(prob, mesh, robertson_loss, p, "params", picks, bound=5e-9)
    assert vg.engine == "kernel_adjoint"  # the router's Rosenbrock23 gradient: in Warp
    _, g = vg()
    _, g_f = gs.value_and_grad(prob, robertson_loss, mode="forward", mesh=mesh)()
    assert max(rel_err_componentwise(g_f[k], g[k]) for k in g) < 5e-14
    _, g_rodas = gs.value_and_grad(prob, robertson_loss, mesh=rodas_mesh)()
    assert max(rel_err_componentwise(g[k], g_rodas[k]) for k in g) < 1.2e-6


def test_hires_initial_state_gradient_matches_fd_and_forward_mode(hires):
    prob, mesh = hires
    loss = lambda ys, p: jnp.sum(ys[:, 5] * ys[:, 7]) + jnp.sum(ys[:, 0])
    # FD measured 1.2e-8 at most (bound ~10x); forward vs reverse, componentwise,
    # 3.7e-13 (bound ~10x).
    vg = _fd_check(prob, mesh, loss, prob.y0, "y0",
                   # y8(0) = 0.0057 feeds the stiff 280 y6 y8 term: a tiny step.
                   [(None, (0, 0), 1e-6), (None, (1, 7), 1e-9), (None, (3, 4), 1e-6)],
                   bound=1.5e-7)
    _, g_r = vg()
    _, g_f = gs.value_and_grad(prob, loss, wrt="y0", mode="forward", mesh=mesh)()
    assert rel_err_componentwise(g_r, g_f) < 4e-12


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
    assert (vg.engine, vg.mesh.method, vg.mesh.recorder) == ("kernel_adjoint", "rosenbrock23", "fused")
    assert gs.solve(registered, method="rodas5p").engine == "general"


def test_rosenbrock23_refuses_a_time_dependent_field():
    prob = gs.EnsembleProblem(f_jax=lambda t, y, p: -p * y * (1 + jnp.sin(t)),
                              y0=jnp.ones((2, 1)), params=jnp.ones(2), t_span=(0.0, 1.0),
                              stiff=True)
    with pytest.raises(ValueError, match="'rosenbrock23' is for autonomous systems"):
        gs.record(prob, method="rosenbrock23")
    assert gs.record(prob).method == "rodas5p"


def test_rosenbrock23_solves_robertson(robertson):
    # Second order, rtol 1e-6 with an atol (1e-12) below every species, so that y2 ~
    # 6e-6 is controlled relative to its own size too: every species measured within
    # 2.0e-7 (on y2) of the reference, bound ~10x.
    prob, _ = robertson
    mesh = gs.record(prob, rtol=1e-6, atol=1e-12, method="rosenbrock23")
    ref = np.array(REFERENCES["robertson"]["y1"])
    assert mesh.ok and rel_err_componentwise(gs.replay(prob, mesh), ref) < 2e-6


def test_rodas5p_interpolation_is_accurate():
    # The continuous extension is fourth order; at rtol 1e-9 on the stiff linear family
    # its values at in-between times match expm componentwise to 2.5e-9 as measured
    # (the integrated extra step, at the record's accuracy, to 3.2e-10). Bounds ~10x.
    prob = gs.problems.linear_stiff(n=3, d=5)
    mesh = gs.record(prob, rtol=1e-9, atol=1e-12, method="rodas5p")
    ts = np.linspace(0.0, 1.0, 11)
    exact = np.stack([gs.problems.linear_exact(prob, t) for t in ts], axis=1)
    assert rel_err_componentwise(gs.replay(prob, mesh, ts=ts, interpolate=True), exact) < 2.5e-8
    assert rel_err_componentwise(gs.replay(prob, mesh, ts=ts), exact) < 3e-9


def test_interpolate_true_refuses_a_method_without_an_extension():
    # Every built-in method has one now; a tableau built without (`dense=None`) is
    # what the check is for.
    from gradsolve.config import check_interpolate
    bare = gs.methods.ExplicitRungeKutta(dataclasses.replace(gs.methods.tsit5.tableau,
                                                             name="bare", dense=None))
    check_interpolate(bare, False)
    with pytest.raises(ValueError, match="interpolate=True needs a method with a "
                                         "continuous extension .*'bare' has none"):
        check_interpolate(bare, True)


def test_vern7_on_lorenz_matches_a_tight_reference_and_dopri8_gradient():
    # Vern7 at rtol 1e-10 vs a rtol 1e-13 solve and Diffrax Dopri8 at 1e-13: two
    # discretisations, each accurate to its tolerance. Measured componentwise: states
    # 1.4e-10, loss 2.6e-12, gradients 8.6e-11. Bounds ~10x.
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
    tight = gs.solve(prob, rtol=1e-13, atol=1e-15).ys
    assert rel_err_componentwise(gs.replay(prob, vg.mesh), tight) < 1.5e-9
    assert rel_err(value, ref_value) < 3e-11
    assert max(rel_err_componentwise(g[k], ref_g[k]) for k in g) < 1e-9


def test_masked_stiff_trajectory_gives_zero_not_nan(robertson):
    """A masked trajectory is replayed on an all-zero mesh from its y0. The discarded
    steps were evaluated at a unit step, which from Robertson's y0 overflows: the
    zero cotangent through the untaken branch then made NaN gradients. Now they are
    evaluated at a small step: exactly zero for the masked row, and the other rows'
    gradients are those of the unmasked replay."""
    prob, mesh = robertson
    failed = eqx.tree_at(lambda m: m.status, mesh,
                         mesh.status.at[0].set(gs.Status.MAX_STEPS))
    _, full = gs.value_and_grad(prob, robertson_loss, mesh=mesh)()
    _, masked = gs.value_and_grad(prob, robertson_loss, mesh=failed, on_failure="mask")()
    for name in ("k1", "k2", "k3"):
        assert masked[name][0] == 0.0
        np.testing.assert_array_equal(masked[name][1:], full[name][1:])


@pytest.mark.parametrize("field", ["hires", "robertson"])
def test_rodas5p_stage_loop_gives_the_unrolled_step(field, monkeypatch):
    # A Rodas5P step runs its stages as a loop where the field has more than
    # STAGE_LOOP_EQUATIONS equations (HIRES: 57), else unrolled (Robertson: 16). Both
    # forms of one step and of its derivative (a VJP in y and the parameters), from
    # one state: the same arithmetic but the stage combinations (a product in the
    # loop, term by term unrolled), so equal to roundoff. Measured on the default and
    # the suite's legacy emitters: 2.2e-16 relative at most (bound ~10x).
    from gradsolve.methods import _rosenbrock
    prob = getattr(gs.problems, field)(n=1)
    f = gs.problem.field(prob.f_jax)
    method = gs.methods.get("rodas5p")
    p = gs.problem.trajectory_params(prob.params, 0)
    # The recorded mesh's first step, from the initial state: a step the controller
    # took (a larger one on Robertson amplifies the roundoff by W's conditioning).
    t, y = jnp.asarray(prob.t_span[0]), prob.y0[0]
    h = gs.record(prob, rtol=1e-6, atol=1e-9, method="rodas5p").h[0, 0]
    looped = _rosenbrock._equations(f, t, y, p) > _rosenbrock.STAGE_LOOP_EQUATIONS
    assert looped == (field == "hires")

    def step(y, p):
        y_new, err, _ = method.trial_step(f, t, y, f(t, y, p), h, p)
        return y_new, err
    outs = {}
    for limit in (0, 10**9):  # every field looped; none
        monkeypatch.setattr(_rosenbrock, "STAGE_LOOP_EQUATIONS", limit)

        def both(y, p):  # compiled (a new function per limit: traced anew)
            value, pull = jax.vjp(step, y, p)
            return value, pull((jnp.ones_like(y), jnp.ones_like(y)))
        outs[limit] = jax.jit(both)(y, p)

    def flat(tree):  # one vector, relative to its largest entry
        return np.concatenate([np.ravel(x) for x in jax.tree.leaves(tree)])
    for part in (0, 1):  # the step (y_new, error), then the VJP
        a, b = flat(outs[0][part]), flat(outs[10**9][part])
        assert rel_err(a, b) < 2e-15, (part, a, b)
