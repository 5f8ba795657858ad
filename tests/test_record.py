"""The general recorder against Diffrax: same accepted and rejected steps."""

import diffrax
import jax.numpy as jnp
import numpy as np
import pytest

import gradsolve as gs
from helpers import rel_err


def _diffrax_counts(prob, rtol, atol, dt0):
    """Accepted/rejected step counts and final states from Diffrax itself, one
    trajectory at a time (no vmap), with Diffrax's own PIDController defaults."""
    from gradsolve.problem import trajectory_params, unwrap_shared
    acc, rej, ys = [], [], []
    for i in range(prob.n):
        p = unwrap_shared(trajectory_params(prob.params, i))
        sol = diffrax.diffeqsolve(
            diffrax.ODETerm(prob.f_jax), diffrax.Tsit5(), prob.t_span[0], prob.t_span[1],
            dt0, prob.y0[i], args=p,
            stepsize_controller=diffrax.PIDController(rtol=rtol, atol=atol),
            max_steps=10_000)
        acc.append(int(sol.stats["num_accepted_steps"]))
        rej.append(int(sol.stats["num_rejected_steps"]))
        ys.append(sol.ys[0])
    return np.array(acc), np.array(rej), np.stack(ys)


@pytest.mark.parametrize("name,rtol,atol", [
    ("lorenz", 1e-6, 1e-9), ("lorenz", 1e-9, 1e-12), ("van_der_pol", 1e-7, 1e-10)])
def test_step_counts_equal_diffrax(name, rtol, atol):
    prob = getattr(gs.problems, name)(n=6)
    mesh = gs.record(prob, rtol=rtol, atol=atol, dt0=0.01)
    acc, rej, ys = _diffrax_counts(prob, rtol, atol, 0.01)
    np.testing.assert_array_equal(np.asarray(mesh.n_steps), acc)
    np.testing.assert_array_equal(np.asarray(mesh.n_rejected), rej)
    # Same steps, so the replay's final state equals Diffrax's up to roundoff.
    assert rel_err(gs.replay(prob, mesh), ys) < 1e-12


def test_initial_step_rule_equals_diffrax_engine():
    # dt0=None: both sides use Hairer & Wanner's rule (control.initial_step).
    prob = gs.problems.lorenz(n=5)
    ours = gs.solve(prob, engine="general")
    theirs = gs.solve(prob, engine="diffrax")
    np.testing.assert_array_equal(ours.n_accepted, theirs.n_accepted)
    np.testing.assert_array_equal(ours.n_rejected, theirs.n_rejected)


def test_mesh_spans_the_interval_and_is_zero_padded():
    prob = gs.problems.van_der_pol(n=5)
    mesh = gs.record(prob)
    h, n_steps = np.asarray(mesh.h), np.asarray(mesh.n_steps)
    assert mesh.columns == n_steps.max() and mesh.ok
    np.testing.assert_allclose(h.sum(axis=1), prob.t_span[1] - prob.t_span[0], rtol=1e-13)
    for i in range(prob.n):
        assert np.all(h[i, :n_steps[i]] > 0) and np.all(h[i, n_steps[i]:] == 0)


def test_chunked_buffer_records_the_same_mesh():
    # A chunk of 4 columns forces many returns to the host; the mesh must not change.
    from gradsolve.config import make_config
    from gradsolve.recorder import run_record
    prob = gs.problems.lorenz(n=7)
    cfg = make_config(prob, rtol=1e-6, atol=1e-9, method="tsit5")
    small, y_small = run_record(prob, cfg, chunk=4)
    big, y_big = run_record(prob, cfg, chunk=512)
    np.testing.assert_array_equal(small.h, big.h)
    np.testing.assert_array_equal(y_small, y_big)


def test_ensemble_with_very_different_step_counts():
    # Van der Pol with mu from 0.1 to 25: the stiffer members take 3.5x the steps.
    prob = gs.problems.van_der_pol(n=6, mu=(0.1, 25.0), t_span=(0.0, 10.0))
    mesh = gs.record(prob, rtol=1e-7, atol=1e-10, dt0=0.01)
    n_steps = np.asarray(mesh.n_steps)
    assert n_steps.max() > 3 * n_steps.min()
    acc, rej, ys = _diffrax_counts(prob, 1e-7, 1e-10, 0.01)
    np.testing.assert_array_equal(n_steps, acc)
    np.testing.assert_array_equal(np.asarray(mesh.n_rejected), rej)
    assert rel_err(gs.replay(prob, mesh), ys) < 1e-11


def test_max_steps_sets_status_and_others_finish():
    prob = gs.problems.van_der_pol(n=4, mu=(0.1, 8.0), t_span=(0.0, 10.0))
    full = gs.record(prob, rtol=1e-7, atol=1e-10)
    cap = int(np.sort(np.asarray(full.n_steps + full.n_rejected))[1]) + 1
    mesh = gs.record(prob, rtol=1e-7, atol=1e-10, max_steps=cap)
    status = np.asarray(mesh.status)
    total = np.asarray(full.n_steps + full.n_rejected)
    np.testing.assert_array_equal(status == gs.Status.MAX_STEPS, total >= cap)
    ok = status == gs.Status.SUCCESS
    assert ok.sum() == 2 and not mesh.ok
    np.testing.assert_array_equal(np.asarray(mesh.h)[ok], np.asarray(full.h)[ok][:, :mesh.columns])


def test_nonfinite_field_underflows_and_is_reported():
    # f blows up to NaN past t = 0.5 for trajectory 1 only: every trial fails, the step
    # shrinks to nothing and the recorder reports it instead of looping or hiding it.
    def f(t, y, p):
        return jnp.where((t > 0.5) & (p > 0), jnp.nan, -y)
    prob = gs.EnsembleProblem(f_jax=f, y0=jnp.ones((3, 2)), params=jnp.array([0.0, 1.0, 0.0]),
                              t_span=(0.0, 1.0))
    mesh = gs.record(prob)
    status = np.asarray(mesh.status)
    assert status[0] == status[2] == gs.Status.SUCCESS
    assert status[1] == gs.Status.DT_UNDERFLOW
    assert "step size" in mesh.summary()


@pytest.mark.parametrize("recorder", ["general", "fused"])
def test_step_below_the_resolution_of_t_is_underflow_at_once(recorder):
    # Near t = 1e15 float64 spaces times 0.125 apart, and Lorenz's first step (~1e-2)
    # rounds to a step of length zero. It must end the trajectory DT_UNDERFLOW before
    # any step is taken -- not be accepted as a zero step whose successors are then
    # rejected 4095 times until MAX_STEPS. Both recorders and both forward solves.
    t0 = 1e15
    prob = gs.problems.lorenz(n=2).replace(t_span=(t0, t0 + 1.0))
    assert np.spacing(t0) == 0.125
    mesh = gs.record(prob, recorder=recorder)
    sol = gs.solve(prob, engine=recorder)
    assert sol.engine == recorder
    for status, accepted, rejected in ((mesh.status, mesh.n_steps, mesh.n_rejected),
                                       (sol.status, sol.n_accepted, sol.n_rejected)):
        np.testing.assert_array_equal(status, gs.Status.DT_UNDERFLOW)
        np.testing.assert_array_equal(accepted, 0)
        np.testing.assert_array_equal(rejected, 0)
    np.testing.assert_array_equal(sol.ys, prob.y0)
