"""The padded replay: equal to the recorder, padding-invariant, ts outputs."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gradsolve as gs
from gradsolve.config import make_config
from gradsolve.recorder import run_record
from helpers import rel_err


@pytest.fixture(scope="module")
def lorenz():
    prob = gs.problems.lorenz(n=6)
    mesh, y_end = run_record(prob, make_config(prob, rtol=1e-8, atol=1e-10, method="tsit5"))
    return prob, mesh, y_end


def test_replay_equals_recorder(lorenz):
    # The replay takes the recorder's accepted steps with the same stage arithmetic:
    # equal to roundoff (1e-12 relative leaves room for reassociation by XLA).
    prob, mesh, y_end = lorenz
    assert rel_err(gs.replay(prob, mesh), y_end) < 1e-12


def test_zero_padding_changes_nothing_bit_for_bit(lorenz):
    prob, mesh, _ = lorenz
    wide = mesh.padded(mesh.columns + 13)
    ts = jnp.array([0.0, 0.3, 0.77, 1.0])
    for kw in ({}, {"ts": ts}):
        np.testing.assert_array_equal(gs.replay(prob, mesh, **kw), gs.replay(prob, wide, **kw))
    loss = lambda ys, p: jnp.sum(ys[..., 0] ** 2)
    _, g = gs.value_and_grad(prob, loss, mesh=mesh)()
    _, g_wide = gs.value_and_grad(prob, loss, mesh=wide)()
    jax.tree.map(np.testing.assert_array_equal, g, g_wide)


def test_guarded_padding_is_skipped_and_changes_nothing(lorenz):
    # A guarded mesh (a Calibrator's of a network's field, padded with headroom) is
    # replayed by loops over its live columns only, forward and backward
    # (`replay._live_loop`): the same outputs and gradients as the plain replay, on
    # the replay itself (`_replay`, not trimmed to the steps by an arrangement), with
    # many skipped columns and with none. Measured: within 2.5e-15 of each leaf's
    # largest entry (XLA fuses the loop's arithmetic differently from the scan's);
    # bound 3e-14.
    from gradsolve import methods
    from gradsolve.replay import _replay
    prob, mesh, _ = lorenz
    steps = int(mesh.n_steps.max())
    tsit5, ts = methods.get("tsit5"), jnp.array([0.0, 0.3, 0.77, 1.0])
    for ts_, interpolate in ((None, False), (ts, True)):  # the replay's two scans
        def loss(p, m):
            return jnp.sum(_replay(prob.f_jax, tsit5, m, p, prob.y0, ts_, False,
                                   interpolate) ** 2)
        vg = jax.jit(jax.value_and_grad(loss))  # a compile per mesh (guarded: static)
        # The reference: every column plain, at the mesh's own width (zero columns
        # change nothing, bit for bit: test_zero_padding_changes_nothing_bit_for_bit).
        ref = vg(prob.params, mesh)
        for width in (2 * mesh.columns + 3, steps):
            guarded = dataclasses.replace(mesh.padded(width), guarded=True)
            for a, b in zip(ref, vg(prob.params, guarded)):
                for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
                    assert rel_err(y, x) < 3e-14, (width, interpolate, rel_err(y, x))


def test_guarded_padding_costs_no_evaluations(lorenz):
    # The headroom of a guarded mesh is free of steps: its value and gradient, at
    # three times the columns, evaluate the field once at the start and then
    # stages - 1 times (Tsit5 is FSAL) per column some trajectory steps in, and no
    # more in the backward loop (it applies the stored pullbacks). Counted by a
    # callback in the field. (The plain replay's scan cannot be counted so: its body's
    # callback runs once under differentiation.)
    from gradsolve import methods
    from gradsolve.replay import _replay
    prob, mesh, _ = lorenz
    tsit5 = methods.get("tsit5")
    calls = []

    def counted(t, y, p):
        jax.debug.callback(lambda: calls.append(1))
        return prob.f_jax(t, y, p)

    loss = lambda p, m: jnp.sum(_replay(counted, tsit5, m, p, prob.y0,
                                        jnp.array([0.3, 1.0]), False, True) ** 2)
    guarded = dataclasses.replace(mesh.padded(3 * mesh.columns), guarded=True)
    jax.block_until_ready(jax.jit(jax.value_and_grad(loss))(prob.params, guarded))
    jax.effects_barrier()
    assert tsit5.tableau.fsal
    assert len(calls) == 1 + (tsit5.tableau.stages - 1) * int(mesh.n_steps.max())


def test_ts_outputs_match_a_tight_reference(lorenz):
    # Each output is one extra Tsit5 step from the preceding mesh point; its local
    # error is below the record's tolerance, so the outputs agree with a 1e-13
    # reference to the mesh's own accuracy (rtol 1e-8: 1e-6 relative is generous
    # for Lorenz's error growth over t in [0, 1]).
    prob, mesh, _ = lorenz
    ts = jnp.array([0.0, 0.05, 0.3, 0.3, 0.61, 0.999, 1.0])
    ys = gs.replay(prob, mesh, ts=ts)
    ref = gs.solve(prob, rtol=1e-13, atol=1e-15, ts=ts, engine="diffrax").ys
    assert ys.shape == (prob.n, len(ts), prob.d)
    assert rel_err(ys, ref) < 1e-6
    np.testing.assert_array_equal(ys[:, 0], prob.y0)
    assert rel_err(ys[:, -1], gs.replay(prob, mesh)) < 1e-14


def test_ts_outputs_integrated_by_name():
    # interpolate=False integrates an extra step to each output. On the linear system
    # the closed form is exact: an extra step of size < h has a smaller local error
    # than the mesh steps, so the error stays at the mesh's level.
    prob = gs.problems.linear(n=4, d=5)
    mesh = gs.record(prob, rtol=1e-9, atol=1e-12)
    ts = np.linspace(0.0, 1.0, 9)
    ys = np.asarray(gs.replay(prob, mesh, ts=ts, interpolate=False))
    exact = np.stack([gs.problems.linear_exact(prob, t) for t in ts], axis=1)
    assert rel_err(ys, exact) < 1e-8


def test_default_outputs_follow_the_extension_order():
    # interpolate=None: Tsit5's order-4 and Vern7's order-7 extensions serve ts;
    # Rosenbrock23's order-2 one does not (the integrated step instead). Bit for bit
    # the named choice, and the two differ (by the extension's error), so the test
    # sees which ran.
    prob = gs.problems.linear(n=2, d=5)
    ts = np.linspace(0.0, 1.0, 7)
    for method, chosen in (("tsit5", True), ("vern7", True), ("rosenbrock23", False)):
        mesh = gs.record(prob, method=method, rtol=1e-4, atol=1e-7)
        ys = gs.replay(prob, mesh, ts=ts)
        np.testing.assert_array_equal(ys, gs.replay(prob, mesh, ts=ts, interpolate=chosen))
        assert rel_err(ys, gs.replay(prob, mesh, ts=ts, interpolate=not chosen)) > 1e-12
    sol = gs.solve(prob, ts=ts, engine="general")
    assert sol.interpolated and not gs.solve(prob, engine="general").interpolated
    # Diffrax serves ts from its own interpolant: asked for integrated outputs, the
    # router passes it over, and the result says what ran.
    off = gs.solve(prob, ts=ts, interpolate=False, fused=False)
    assert (off.engine, off.interpolated) == ("general", False)
    assert "own interpolant" in dict(off.passed_over)["diffrax"]
    with pytest.raises(ValueError, match="interpolate must be None"):
        gs.solve(prob, ts=ts, interpolate="yes")


@pytest.mark.exact_across_shapes
def test_tsit5_interpolated_outputs(lorenz):
    # interpolate=True reads each output from Tsit5's continuous extension on the step
    # containing it (fourth order, the step's own slopes). Against the same 1e-13
    # reference as the integrated outputs: measured 2.5e-9 (the integrated ones 1.7e-9),
    # at the mesh's accuracy; bound ~10x. At a mesh point or t1, the state itself.
    prob, mesh, _ = lorenz
    ts = jnp.array([0.0, 0.05, 0.3, 0.3, 0.61, 0.999, 1.0])
    ys = gs.replay(prob, mesh, ts=ts, interpolate=True)
    ref = gs.solve(prob, rtol=1e-13, atol=1e-15, ts=ts, engine="diffrax").ys
    assert ys.shape == (prob.n, len(ts), prob.d)
    assert rel_err(ys, ref) < 2.5e-8
    np.testing.assert_array_equal(ys[:, 0], prob.y0)
    np.testing.assert_array_equal(ys[:, -1], gs.replay(prob, mesh))
    t_mesh = mesh.t0 + jnp.cumsum(mesh.h[0])[4]  # the fifth mesh point of trajectory 0
    at_point = gs.replay(prob, mesh, ts=jnp.array([t_mesh]), interpolate=True)[0, 0]
    on_mesh = gs.replay(prob, mesh, ts=jnp.array([t_mesh]))[0, 0]  # a step of ~0
    np.testing.assert_allclose(at_point, on_mesh, rtol=1e-13)


def test_replay_at_other_params_moves_the_solution(lorenz):
    prob, mesh, _ = lorenz
    p = dict(prob.params, rho=prob.params["rho"] + 1.0)
    assert rel_err(gs.replay(prob, mesh, params=p), gs.replay(prob, mesh)) > 1e-3
