"""Gradients on the recorded mesh against independent references: Diffrax's
RecursiveCheckpointAdjoint on the same steps, forward mode, and central finite
differences of the replay on the same mesh."""

import jax.numpy as jnp
import numpy as np
import pytest

import gradsolve as gs
from helpers import rel_err, tree_rel_err


def loss(ys, params):
    return jnp.sum(ys[..., 0] ** 2) + 0.5 * jnp.sum(ys[..., 2])


@pytest.fixture(scope="module")
def lorenz():
    return gs.problems.lorenz(n=6)


@pytest.fixture(scope="module")
def reverse(lorenz):
    # The general recorder: Diffrax's step sequence exactly (the fused recorder's is
    # checked against it in test_fused.py).
    return gs.value_and_grad(lorenz, loss, wrt="both", dt0=0.01, engine="general_replay")


def test_gradient_equals_diffrax_checkpointed_adjoint(lorenz, reverse):
    # Same dt0 -> same accepted steps (test_record), so both differentiate the same
    # computation; 1e-10 allows for summation order only.
    value, (g_p, g_y0) = reverse()
    ref = gs.value_and_grad(lorenz, loss, wrt="both", dt0=0.01, engine="diffrax")
    ref_value, (ref_p, ref_y0) = ref()
    assert ref.engine == "diffrax" and reverse.engine == "general_replay"
    assert rel_err(value, ref_value) < 1e-12
    assert tree_rel_err(g_p, ref_p) < 1e-10
    assert rel_err(g_y0, ref_y0) < 1e-10


def test_reverse_equals_forward_mode(lorenz, reverse):
    # Same replay, two AD modes: agreement to roundoff (1e-12).
    fwd = gs.value_and_grad(lorenz, loss, wrt="both", dt0=0.01, mode="forward")
    (v_r, g_r), (v_f, g_f) = reverse(), fwd()
    assert rel_err(v_r, v_f) < 1e-14
    assert tree_rel_err(g_r, g_f) < 1e-12


def test_gradient_equals_finite_differences_on_the_same_mesh(lorenz, reverse):
    # Central differences of the replay with the mesh held fixed: truncation
    # O(eps^2) ~ 1e-12 and roundoff ~1e-16/eps ~ 1e-10, so 1e-6 is safe.
    _, (g_p, g_y0) = reverse()
    mesh = reverse.mesh

    def L(params, y0):
        return loss(gs.replay(lorenz, mesh, params=params, y0=y0), params)

    p, y0 = lorenz.params, lorenz.y0
    for i in (0, 3, 5):
        eps = 1e-6 * float(p["rho"][i])
        up = dict(p, rho=p["rho"].at[i].add(eps))
        dn = dict(p, rho=p["rho"].at[i].add(-eps))
        fd = (L(up, y0) - L(dn, y0)) / (2 * eps)
        assert rel_err(g_p["rho"][i], fd) < 1e-6
        eps = 1e-6
        fd = (L(p, y0.at[i, 1].add(eps)) - L(p, y0.at[i, 1].add(-eps))) / (2 * eps)
        assert rel_err(g_y0[i, 1], fd) < 1e-6


def test_wrt_selects_the_differentiated_input(lorenz, reverse):
    _, (g_p, g_y0) = reverse()
    _, only_p = gs.value_and_grad(lorenz, loss, wrt="params", mesh=reverse.mesh)()
    _, only_y0 = gs.value_and_grad(lorenz, loss, wrt="y0", mesh=reverse.mesh)()
    assert tree_rel_err(only_p, g_p) < 1e-14
    assert rel_err(only_y0, g_y0) < 1e-14


def test_shared_parameters_sum_over_trajectories():
    # The linear family keeps its matrix A in gs.Shared: its gradient is one matrix,
    # the sum of every trajectory's contribution. Checked against forward mode and
    # against the per-trajectory sum computed by differentiating each row alone.
    prob = gs.problems.linear(n=5, d=3)
    vg = gs.value_and_grad(prob, loss)
    _, g = vg()
    assert isinstance(g["A"], gs.Shared) and g["A"].value.shape == (3, 3)
    _, g_f = gs.value_and_grad(prob, loss, mode="forward", mesh=vg.mesh)()
    assert tree_rel_err(g, g_f) < 1e-12
    rows = []
    for i in range(prob.n):
        row_loss = lambda ys, p, i=i: loss(ys[i:i + 1], p)
        rows.append(gs.value_and_grad(prob, row_loss, mesh=vg.mesh)()[1]["A"].value)
    assert rel_err(g["A"].value, sum(rows)) < 1e-12


def test_ts_gradient_equals_finite_differences():
    prob = gs.problems.van_der_pol(n=4)
    ts = jnp.array([0.5, 2.0, 4.5])
    vg = gs.value_and_grad(prob, lambda ys, p: jnp.sum(ys ** 3), ts=ts)
    _, g = vg()

    def L(mu):
        ys = gs.replay(prob, vg.mesh, params={"mu": mu}, ts=ts)
        return jnp.sum(ys ** 3)

    mu = prob.params["mu"]
    for i in range(prob.n):
        eps = 1e-6
        fd = (L(mu.at[i].add(eps)) - L(mu.at[i].add(-eps))) / (2 * eps)
        assert rel_err(g["mu"][i], fd) < 1e-6


def test_loss_may_depend_on_params_directly(lorenz):
    # A regularised loss: d/dp of 0.1*sum(rho^2) adds 0.2*rho in both modes.
    reg = lambda ys, p: loss(ys, p) + 0.1 * jnp.sum(p["rho"] ** 2)
    g_plain = gs.value_and_grad(lorenz, loss)()[1]["rho"]
    for mode in ("reverse", "forward"):
        g = gs.value_and_grad(lorenz, reg, mode=mode)()[1]["rho"]
        assert rel_err(g - g_plain, 0.2 * lorenz.params["rho"]) < 1e-10


def test_rerecord_and_mesh_reuse(lorenz):
    vg = gs.value_and_grad(lorenz, loss)
    first = vg.mesh
    p = dict(lorenz.params, rho=lorenz.params["rho"] * 1.1)
    v_old, _ = vg(params=p)
    vg.rerecord(params=p)
    assert vg.mesh is not first
    v_new, _ = vg(params=p)
    # Recorded at p, the replay at p is the adaptive solution at p.
    ref = gs.solve(lorenz.replace(params=p), engine="general").ys
    assert rel_err(v_new, loss(ref, p)) < 1e-12
    assert rel_err(v_old, v_new) < 1e-4  # the old mesh is still an accurate solve


def test_failed_trajectory_raises_unless_masked():
    def f(t, y, p):
        return jnp.where((t > 0.5) & (p > 0), jnp.nan, -y)
    prob = gs.EnsembleProblem(f_jax=f, y0=jnp.ones((3, 2)), params=jnp.array([0.0, 1.0, 0.0]),
                              t_span=(0.0, 1.0))
    loss = lambda ys, p: jnp.sum(jnp.where(jnp.isfinite(ys), ys, 0.0) ** 2)
    with pytest.raises(gs.TrajectoryFailure, match="1 of 3 trajectories failed"):
        gs.value_and_grad(prob, loss)
    vg = gs.value_and_grad(prob, loss, wrt="y0", on_failure="mask")
    _, g = vg()
    # Healthy members: d/dy0 of sum(y(1)^2) with y = y0 exp(-t) is 2 y0 exp(-2).
    np.testing.assert_allclose(np.asarray(g)[[0, 2]], 2 * np.exp(-2.0), rtol=1e-6)
    np.testing.assert_array_equal(g[1], 0.0)


def test_diffrax_baseline_gradient_fails_loudly():
    # The Diffrax engine has no mesh to inspect: a solve that runs out of steps must
    # raise inside the gradient rather than return a truncated solution's loss.
    vg = gs.value_and_grad(gs.problems.lorenz(n=3), loss, engine="diffrax", max_steps=16)
    with pytest.raises(RuntimeError, match="max_steps"):
        vg()


@pytest.fixture(scope="module")
def drained():
    """y' = -a s sqrt(y), y(0) = 1: y = (1 - a s t / 2)^2 until it reaches 0 at
    t = 2 / (a s). With s = 1 the last trajectory (a = 2.1) drains before t = 0.96 and
    fails its record (the step into y < 0 makes sqrt NaN: DT_UNDERFLOW); `fused=True`
    sends it to the fused recorder, the router's choice for registered fields."""
    f = lambda t, y, p: -p["a"] * p["s"] * jnp.sqrt(y)
    return gs.EnsembleProblem(
        f_jax=f, y0=jnp.ones((4, 1)), params={"a": jnp.array([0.5, 1.0, 1.5, 2.1]),
                                              "s": gs.Shared(jnp.array(1.0))},
        t_span=(0.0, 1.0), fused=True, name="drained")


@pytest.mark.parametrize("engine,mode", [
    (None, "reverse"), (None, "forward"), ("general_replay", "reverse"),
    ("kernel_adjoint", "reverse")])
def test_masked_trajectory_contributes_exactly_zero(drained, engine, mode):
    # The masking rule (replay._replay): a failed trajectory's outputs are exact zeros
    # whatever its record did, so sum(ys^2) gets nothing from it and no gradient -- its
    # own or the Shared one -- sees it. The others against the closed form
    # y(t) = (1 - a s t / 2)^2: the solve's global error at rtol 1e-6 (measured
    # ~1e-6 relative), so 1e-5.
    ts = jnp.array([0.5, 1.0])
    loss = lambda ys, p: jnp.sum(ys ** 2)
    vg = gs.value_and_grad(drained, loss, ts=ts, engine=engine, mode=mode,
                           on_failure="mask")
    assert vg.engine == (engine or "fused_replay")
    np.testing.assert_array_equal(np.asarray(vg.mesh.status) == gs.Status.SUCCESS,
                                  [True, True, True, False])
    value, g = vg()
    a, s = drained.params["a"][:3], 1.0
    u = 1 - a[:, None] * s * ts[None] / 2                     # sqrt(y) at each ts
    assert rel_err(value, jnp.sum(u ** 4)) < 1e-5
    assert rel_err(g["a"][:3], jnp.sum(-2 * s * ts * u ** 3, axis=1)) < 1e-5
    assert rel_err(g["s"].value, jnp.sum(-2 * a[:, None] * ts * u ** 3)) < 1e-5
    assert g["a"][3] == 0.0
