"""The calibration recipes recover what they generated their data from."""

import pathlib
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from scipy.integrate import solve_ivp

import gradsolve as gs
from helpers import rel_err

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "recipes"))


def _scipy_states(f, y0, ts, t_span):
    """`(len(ts), d)` states of `y' = f(t, y)` from SciPy alone (DOP853, rtol 1e-10)."""
    f = jax.jit(f)
    sol = solve_ivp(lambda t, y: np.asarray(f(t, y)), t_span, np.asarray(y0), t_eval=ts,
                    method="DOP853", rtol=1e-10, atol=1e-10)
    assert sol.success, sol.message
    return sol.y.T

import galactic_halo  # noqa: E402
import multistart  # noqa: E402
import neural_ode  # noqa: E402
import neural_robertson  # noqa: E402
import neural_spiral  # noqa: E402
import robertson_rates  # noqa: E402


def test_galactic_halo_recovers_q_within_two_percent():
    # Positions of 4 stars at 4 times with noise 0.005 pin q to ~1e-3 (measured
    # <= 8e-4 relative with B = 8); 2% is the acceptance bound.
    prob, to_params, loss, data, theta0, truth = galactic_halo.build(B=4, K=4)
    cal = gs.Calibrator(prob, loss, to_params=to_params, data=data, ts=galactic_halo.TS,
                        optimizer=optax.adam(0.05),
                        transform={"q": gs.transforms.Bounded(0.5, 1.2)}, refresh_every=50)
    res = cal.fit(theta0, steps=300, grad_tol=1e-7, progress=False)
    rel = np.abs(np.asarray(res.theta["q"]) - truth["q"]) / truth["q"]
    assert np.all(rel < 0.02), rel


def test_robertson_rates_recover_k1_k3_within_five_percent():
    # Relative noise 1e-3 on six times of three reactors: the rates come back to a
    # few 1e-3 (measured <= 1.9e-2 at the step cap); 5% is the acceptance bound.
    prob, to_params, loss, data, theta0, truth = robertson_rates.build(B=2, K=3)
    cal = gs.Calibrator(prob, loss, to_params=to_params, data=data, ts=robertson_rates.TS,
                        rtol=1e-7, atol=1e-11, method="rodas5p",
                        optimizer=optax.adam(0.05, b1=0.5, b2=0.9),
                        transform=gs.transforms.Positive(), refresh_every=50)
    res = cal.fit(theta0, steps=300, grad_tol=1e-8, progress=False)
    assert res.engine == "general_replay"  # Rodas5P by name: the general stiff path
    for name in ("k1", "k3"):
        rel = np.abs(np.asarray(res.theta[name]) - truth[name]) / truth[name]
        assert np.all(rel < 0.05), (name, rel)


def test_neural_robertson_gradient_and_training():
    # The MLP's gradient on the recorded stiff mesh equals central differences on the
    # same mesh for the largest-gradient weight of the first and last layers (1e-6:
    # eps 1e-5 on weights of size ~0.3, the loss smooth in them), and 20 Adam updates
    # on the recipe's engine (kernel_adjoint, Rosenbrock23) lower the loss below 0.6 of
    # the first (measured 0.558; 0.44 after 40). 20, not 40: at the suite's Warp
    # level 0 an update of this kernel takes ~0.2 s (~10 ms at the default -O3).
    prob, to_params, loss, data, theta0 = neural_robertson.build(K=2)
    ts = neural_robertson.TS
    mlp = jax.tree.map(lambda x: x[0] if eqx.is_array(x) else x, theta0)
    mesh = gs.record(prob, rtol=1e-7, atol=1e-11)

    @eqx.filter_jit
    def L(m):
        ys = gs.replay(prob, mesh, params=to_params(m), ts=ts)
        return loss(ys, m, data[0])

    # Move off the zero-output start so every weight has a gradient.
    mlp = eqx.tree_at(lambda m: m.layers[-1].weight, mlp, jnp.full((1, 16), 0.05))
    g = eqx.filter_jit(eqx.filter_grad(L))(mlp)
    for pick in (lambda m: m.layers[0].weight, lambda m: m.layers[-1].weight):
        w, gw = pick(mlp), pick(g)
        i = np.unravel_index(np.argmax(np.abs(gw)), gw.shape)  # the best-resolved weight
        eps = 1e-5
        up = L(eqx.tree_at(pick, mlp, w.at[i].add(eps)))
        dn = L(eqx.tree_at(pick, mlp, w.at[i].add(-eps)))
        assert rel_err(gw[i], (up - dn) / (2 * eps)) < 1e-6
    cal = gs.Calibrator(prob, loss, to_params=to_params, data=data, ts=ts,
                        optimizer=optax.adam(3e-3), engine="kernel_adjoint",
                        **neural_robertson.SETTINGS)
    res = cal.fit(theta0, steps=20, progress=False)
    assert res.engine == "kernel_adjoint" and res.loss[0] < 0.6 * res.history[0, 0]


def test_neural_spiral_training_lowers_the_loss():
    # The neural-ODE recipe's fit at a small size: 40 Adam updates of a width-8 MLP
    # on two trajectories lower the loss (measured 0.42 of the first loss). The first
    # loss is the MLP's misfit at theta0 as SciPy integrates it (the fit's rtol 1e-5:
    # measured 9.7e-7 relative; bound 1e-5).
    prob, to_params, loss, data, theta0 = neural_spiral.build(K=2, width=8)
    cal = gs.Calibrator(prob, loss, to_params=to_params, data=data, ts=neural_spiral.TS,
                        rtol=1e-5, atol=1e-8, optimizer=optax.adam(1e-2))
    res = cal.fit(theta0, steps=40, progress=False)
    assert res.updates == 40 and res.loss[0] < 0.7 * res.history[0, 0]
    net = jax.tree.map(lambda x: x[0] if eqx.is_array(x) else x, theta0)
    ys = np.stack([_scipy_states(lambda t, y: prob.f_jax(t, y, {"net": net}), y0,
                                 np.asarray(neural_spiral.TS), prob.t_span) for y0 in prob.y0])
    first = float(np.mean((ys - np.asarray(data[0])) ** 2))
    assert abs(res.history[0, 0] - first) / first < 1e-5


def test_neural_ode_one_fit_over_the_shared_network_is_the_b1_fit_written_out():
    # recipes/neural_ode.py's stage at a small size (8 series, their first 10 times,
    # minibatches of 4, a refresh every 3 updates): the Calibrator's one fit over the
    # problem's gs.Shared network (no theta0, no fit axis on the data) runs the same
    # program as the B = 1 fit written out (theta0 and data with a leading 1, to_params
    # wrapping the network), so histories and networks are equal bit for bit. The data
    # are the true field's solution as SciPy integrates it (DOP853, rtol 1e-10 against
    # the recipe's 1e-8: measured 8.5e-9 largest difference; bound 1e-7).
    prob, loss, ts, data = neural_ode.build(series=8)
    want = np.stack([_scipy_states(lambda t, y: neural_ode.true_field(t, y, None), y0,
                                   np.asarray(ts), prob.t_span) for y0 in prob.y0])
    assert np.max(np.abs(np.asarray(data) - want)) < 1e-7
    short = prob.replace(t_span=(0.0, float(ts[9])))
    kw = dict(ts=ts[:10], rtol=neural_ode.RTOL, atol=neural_ode.ATOL,
              batch_size=4, optimizer=optax.adam(neural_ode.LR), refresh_every=3)
    one = gs.Calibrator(short, loss, data=data[:, :10], **kw)
    assert one.one_fit and one.config.interpolate  # the recipe's defaults: Tsit5's extension
    res = one.fit(steps=6, progress=False)
    theta0 = {"mlp": jax.tree.map(lambda x: x[None] if eqx.is_array(x) else x,
                                  short.params["mlp"].value)}
    written = gs.Calibrator(short, loss, to_params=lambda th: {"mlp": gs.Shared(th["mlp"])},
                            data=data[None, :, :10], **kw).fit(theta0, steps=6, progress=False)
    assert res.refreshes == written.refreshes == 1 and res.history.shape == (6, 1)  # at 3
    np.testing.assert_array_equal(res.history, written.history)
    for a, b in zip(jax.tree.leaves(res.best().theta), jax.tree.leaves(written.best().theta)):
        np.testing.assert_array_equal(a, b)
    # theta0 with a fit axis, or without one where fits need it, is refused by name.
    with pytest.raises(ValueError, match="without a fit axis"):
        one.fit(theta0, steps=1, progress=False)
    with pytest.raises(ValueError, match="must lead with the fit's n=8 trajectories"):
        gs.Calibrator(short, loss, data=data[:4, :10], **kw).fit(steps=1, progress=False)
    with pytest.raises(ValueError, match="theta0 is required"):
        gs.Calibrator(short, loss, to_params=lambda th: {"mlp": gs.Shared(th["mlp"])},
                      data=data[None, :, :10], **kw).fit(steps=1, progress=False)


def test_multistart_recipe_runs_end_to_end_through_a_start_queue(tmp_path, capsys):
    # The recipe at small sizes (4 starts through 2 slots, 30 updates each; a 3-point
    # profile through the 2 slots; the SciPy fit): it runs, every start is worked
    # through the queue, and the plots, the saved result and the comparison come out.
    # (Its full run -- 32 starts, SciPy's optimum to 5e-5 -- is in docs/calibrator.md;
    # the multistart-vs-SciPy check at test size is tests/test_workflow.py's.)
    res, prof = multistart.main(["--starts", "4", "--slots", "2", "--steps", "30",
                                 "--profile-points", "3", "--profile-steps", "5",
                                 "--out", str(tmp_path), "--no-progress"])
    # Every start worked and stopped, two after two through the slots: more updates in
    # all than any one start took (measured: 22, 29, 26, 26 updates, all converged, 55
    # in all; before the rates' clipped edges every start ran to the cap, 60 in all).
    assert res.history.shape == (30, 4)
    assert set(res.status_names) <= {"converged", "step_cap"}, res.status_names
    assert min(res.steps) >= 1 and res.updates > max(res.steps), (res.steps, res.updates)
    assert prof.loss.shape == (3,)
    assert {p.name for p in tmp_path.iterdir()} == {
        "multistart.npz", "multistart_waterfall.png", "multistart_profile_alpha.png"}
    out = capsys.readouterr().out
    assert "4 starts through 2 slots" in out and "SciPy" in out and "profile of alpha" in out
    # Each start's first loss is its misfit at its Sobol start as SciPy integrates it
    # (the recipe's rtol 1e-8, atol 1e-8): measured <= 9.7e-8 relative, bound 1e-6; but
    # start 0, whose hares fall to 9e-11, below atol, where the log residuals have no
    # relative accuracy left: measured 4.6e-3, bound 5e-2.
    _, theta0 = multistart.build(starts=4)
    for b in range(4):
        th = {k: float(v[b]) for k, v in theta0.items()}
        f = lambda t, y, th=th: multistart.lotka_volterra(t, y, th)  # noqa: E731
        ys = _scipy_states(f, [th["hare0"], th["lynx0"]], np.asarray(multistart.TS), (0.0, 20.0))
        first = 0.5 * float(np.sum(np.asarray(multistart.residuals(jnp.asarray(ys), th)) ** 2))
        assert abs(res.history[0, b] - first) / first < (5e-2 if b == 0 else 1e-6), b
