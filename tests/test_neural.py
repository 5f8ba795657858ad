"""Equinox MLP right-hand sides (non-stiff) on every gradient engine.

An `eqx.nn.MLP` carries its activation function as a pytree leaf (a jitted function
for tanh and softplus, a `custom_jvp` for relu): it must pass through validation, the
remat'd replay, forward mode, Diffrax and the translator (`fused=True`) as code, not
as an array. To compile each engine once, one problem holds every case: MLPs in
`gs.Shared` (tanh, relu) and per-trajectory MLPs built with `eqx.filter_vmap`, their
array leaves leading with n = 3 (softplus, relu).
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gradsolve as gs
from helpers import rel_err, tree_rel_err


N, D = 3, 2
DT0 = 0.05  # fixed first step: the general recorder then takes Diffrax's steps exactly
SHARED = {"tanh": jnp.tanh, "relu": jax.nn.relu}
OWN = {"softplus": jax.nn.softplus, "relu": jax.nn.relu}


def _mlp(activation, key):
    mlp = eqx.nn.MLP(D, D, 3, 1, activation=activation, key=key)
    if activation is jax.nn.relu:
        # Hidden units held on one side of the kink for every state these solves
        # visit (|W y| <= 0.96 along them, measured): one unit always off, two always
        # on. Crossing the kink makes f non-smooth: the controller rejects steps
        # around it and step sizes (so gradients on two meshes) grow sensitive to
        # roundoff (7e-8 between Diffrax's and ours with kinks crossed).
        mlp = eqx.tree_at(lambda m: m.layers[0].bias, mlp, jnp.array([3.0, -3.0, 3.0]))
    return mlp


def f(t, y, p):
    nets = [*p["shared"].values(), *p["own"].values()]
    return -y + 0.5 * sum(net(y) for net in nets)


def loss(ys, params):
    return jnp.sum(ys[:, 0] ** 2) + jnp.sum(ys[:, 1])


@pytest.fixture(scope="module")
def prob():
    keys = iter(jax.random.split(jax.random.key(0), len(SHARED) + len(OWN)))
    shared = {name: _mlp(act, next(keys)) for name, act in SHARED.items()}
    own = {name: eqx.filter_vmap(lambda k, act=act: _mlp(act, k))(jax.random.split(next(keys), N))
           for name, act in OWN.items()}
    y0 = jnp.stack([jnp.linspace(0.5, 1.5, N), jnp.linspace(-1.0, 1.0, N)], axis=1)
    return gs.EnsembleProblem(f_jax=f, y0=y0, params={"shared": gs.Shared(shared), "own": own},
                              t_span=(0.0, 1.0), name="mlp")


@pytest.fixture(scope="module")
def reverse(prob):
    # remat=None: the non-stiff default, jax.checkpoint around each step (filtered).
    return gs.value_and_grad(prob, loss, engine="general_replay", dt0=DT0)


def _weights(grads):
    """The arrays of a gradient tree (the activation leaves come back as None)."""
    return eqx.filter(grads, eqx.is_inexact_array)


def test_per_trajectory_mlps_are_valid_parameters(prob):
    # The activation leaves are code, not per-trajectory arrays; the weights lead with n.
    assert prob.params["own"]["relu"].layers[0].weight.shape == (N, 3, D)
    assert prob.params["own"]["relu"].activation is jax.nn.relu


def test_general_replay_equals_diffrax(prob, reverse):
    # Same dt0, so the same accepted steps: both differentiate the same computation
    # and agree to summation-order roundoff (1e-10, as in test_grad.py; measured
    # ~1e-14).
    value, g = reverse()
    # Diffrax in forward mode (ForwardMode): the cheapest of its gradients to compile.
    ref_value, ref = gs.value_and_grad(prob, loss, engine="diffrax", mode="forward", dt0=DT0)()
    assert reverse.mesh.ok
    assert rel_err(value, ref_value) < 1e-12
    assert tree_rel_err(_weights(g), _weights(ref)) < 1e-10


def test_forward_mode_equals_reverse(prob, reverse):
    # Same replay on the same mesh, two AD modes: roundoff only (1e-12).
    fwd = gs.value_and_grad(prob, loss, mode="forward", mesh=reverse.mesh)
    (v_r, g_r), (v_f, g_f) = reverse(), fwd()
    assert fwd.engine == "general_replay"
    assert rel_err(v_r, v_f) < 1e-14
    assert tree_rel_err(_weights(g_r), _weights(g_f)) < 1e-12


@pytest.fixture(scope="module")
def fused(prob):
    return gs.value_and_grad(prob.replace(fused=True), loss, dt0=DT0)


def test_fused_replay_gradient_equals_finite_differences(prob, fused):
    # The translator turns the MLPs (activations included) into Warp code, so the
    # router takes fused_replay. Central differences of the replay on the fused
    # recorder's own mesh: truncation O(eps^2) ~ 1e-12, roundoff ~1e-16/eps ~ 1e-10,
    # so 1e-6 is safe (for relu too: no hidden unit sits within eps of its kink).
    assert fused.engine == "fused_replay" and fused.mesh.recorder == "fused"
    _, g = fused()
    eps = 1e-6
    cases = [(lambda p, n=n: p["shared"].value[n].layers[0].weight, (0, 0)) for n in SHARED]
    cases += [(lambda p, n=n: p["own"][n].layers[1].bias, (1, 0)) for n in OWN]
    for where, entry in cases:
        base = where(prob.params)
        up, dn = (eqx.tree_at(where, prob.params, base.at[entry].add(s)) for s in (eps, -eps))
        # The value of the same compiled replay on the same mesh, at moved parameters.
        fd = (fused(params=up)[0] - fused(params=dn)[0]) / (2 * eps)
        assert rel_err(where(g)[entry], fd) < 1e-6, entry


def test_fused_and_general_recorders_agree(reverse, fused):
    # Two recorders, two compilers: the same step counts and step sizes within ~1e-8
    # (docs/engines.md); the gradients on the two meshes then agree to 1e-7
    # (measured ~1e-14 on this smooth, short solve).
    np.testing.assert_array_equal(fused.mesh.n_steps, reverse.mesh.n_steps)
    (v_g, g_g), (v_f, g_f) = reverse(), fused()
    assert rel_err(v_f, v_g) < 1e-7
    assert tree_rel_err(_weights(g_f), _weights(g_g)) < 1e-7


def test_solve_record_and_replay_take_mlps(prob, reverse, fused):
    # The fused forward kernel takes the fused recorder's steps: its final states equal
    # the replay of that mesh up to XLA-vs-Warp roundoff (1e-12). The general forward
    # solve equals the replay of the general mesh, its own steps, to roundoff.
    sol = gs.solve(prob.replace(fused=True), dt0=DT0)
    assert sol.engine == "fused" and sol.ok
    assert rel_err(sol.ys, gs.replay(prob, fused.mesh)) < 1e-12
    general = gs.solve(prob, engine="general", dt0=DT0)
    mesh = gs.record(prob, recorder="general", dt0=DT0)
    assert rel_err(general.ys, gs.replay(prob, mesh, remat=True)) < 1e-14
    np.testing.assert_array_equal(mesh.h, reverse.mesh.h)


def test_a_network_is_budgeted_by_its_activations():
    # A field carrying a network replays without remat by default (config.default_remat),
    # so each stage keeps the network's activations for the backward sweep, not just
    # the state's d numbers: the memory model counts one evaluation's intermediates
    # (problem.evaluation_size: 1796 numbers for MLP(2, 2, 64, 2), measured; at least
    # its two hidden layers, 2 x 64 before and after the activation). A budget that
    # d-sized stages would fit then chunks the replay, and the gradient is unchanged
    # (its Shared sums in another order: measured 0 for the value and 4.4e-15 for the
    # weights, in 3 chunks; bound 5e-14).
    mlp = eqx.nn.MLP(2, 2, 64, 2, activation=jax.nn.softplus, key=jax.random.key(0))
    prob = gs.EnsembleProblem(lambda t, y, p: p["mlp"](y), y0=jnp.ones((64, 2)),
                              params={"mlp": gs.Shared(mlp)}, t_span=(0.0, 1.0))
    loss = lambda ys, p: jnp.sum(ys ** 2)  # noqa: E731
    whole = gs.value_and_grad(prob, loss, engine="general_replay", dt0=DT0)
    assert not whole.config.remat and whole.config.evaluation_size >= 4 * 64
    assert whole.arrangement.chunks == 1
    from gradsolve import layout, methods
    per_row = layout.replay_bytes(methods.get("tsit5"), 2, whole.mesh.columns, 8,
                                  remat=False, evaluation_size=whole.config.evaluation_size)
    d_sized = layout.replay_bytes(methods.get("tsit5"), 2, whole.mesh.columns, 8, remat=False)
    budget = 32 * per_row  # fits 64 rows at d-sized stages, 32 at the network's
    assert 64 * d_sized < budget
    chunked = gs.value_and_grad(prob, loss, engine="general_replay", mesh=whole.mesh,
                                memory_budget=budget)
    assert chunked.arrangement.chunks > 1
    (v1, g1), (v2, g2) = whole(), chunked()
    assert rel_err(v2, v1) < 5e-14 and tree_rel_err(_weights(g2), _weights(g1)) < 5e-14
