"""The calibration workflow: initial states as parameters, multistart designs and
the best of many starts, parameter scales, stored results. References: known true
initial states, SciPy least squares on the same residuals (closed-form model), the
stratification that defines Sobol and Latin-hypercube designs, closed-form maps."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from scipy.optimize import least_squares

import gradsolve as gs


TS = jnp.linspace(0.25, 2.0, 8)


def _decay():
    """`y' = -k y`: observed at TS, closed form `a exp(-k t)`; B = 8 fits, K = 1."""
    B = 8
    return gs.EnsembleProblem(lambda t, y, p: -p["k"] * y, jnp.ones((B, 1)),
                              {"k": jnp.ones(B)}, (0.0, 2.0), name="decay"), B


def _observations():
    # True a = 1.7, k = 0.8, with a fixed small perturbation (not noise-free: the
    # least-squares optimum is then not the truth, and the comparison is a real one).
    clean = 1.7 * jnp.exp(-0.8 * TS)
    return clean * (1 + 0.005 * jnp.sin(7.0 * TS))


def _calibrator(prob, B, obs, **kw):
    data = jnp.broadcast_to(obs[:, None], (B,) + obs.shape + (1,))
    return gs.Calibrator(
        prob, lambda ys, th, d: jnp.sum((ys[0] - d) ** 2), data=data,
        to_params=lambda th: {"k": jnp.full(1, th["k"])},
        to_y0=lambda th: jnp.full((1, 1), th["a"]), ts=TS, rtol=1e-10, atol=1e-12,
        **{"optimizer": optax.adam(0.05), **kw})


@pytest.fixture(scope="module")
def multistart_fit():
    prob, B = _decay()
    obs = _observations()
    theta0 = gs.multistart({"a": 0.5, "k": 0.05}, {"a": 3.0, "k": 5.0}, B,
                           jax.random.key(3), scale={"a": "lin", "k": "log"})
    cal = _calibrator(prob, B, obs, transform={"a": None, "k": gs.transforms.Log10()})
    return cal.fit(theta0, steps=400, grad_tol=1e-9, progress=False), obs


def test_initial_states_and_a_rate_from_multistart_equal_scipy_least_squares(multistart_fit):
    # The best of 8 Sobol starts against SciPy's least squares on the same residuals
    # (the closed form, no ODE solver): both optimise the same function, so the optima
    # agree to the solver's accuracy (rtol 1e-10) and Adam's stopping point (grad_tol
    # 1e-9): measured 7.1e-6 relative in a, 2.3e-5 in k; bounds 7e-5 and 2.5e-4.
    res, obs = multistart_fit
    best = res.best()
    ref = least_squares(lambda x: x[0] * np.exp(-x[1] * np.asarray(TS)) - np.asarray(obs),
                        x0=[1.0, 1.0], xtol=1e-14, ftol=1e-14).x
    assert abs(float(best.theta["a"]) - ref[0]) / ref[0] < 7e-5
    assert abs(float(best.theta["k"]) - ref[1]) / ref[1] < 2.5e-4
    assert best.loss == pytest.approx(float(res.loss.min()))
    # ... and the true initial state within 1% (the data were perturbed by 0.5%).
    assert abs(float(best.theta["a"]) - 1.7) / 1.7 < 0.01


def test_waterfall_plot_shows_the_final_losses_sorted(multistart_fit, tmp_path):
    res, _ = multistart_fit
    fig = res.plot(kind="waterfall", path=tmp_path / "waterfall.png")
    np.testing.assert_array_equal(fig.axes[0].lines[0].get_ydata(), np.sort(res.loss))
    assert (tmp_path / "waterfall.png").stat().st_size > 0
    with pytest.raises(ValueError, match="kind must be"):
        res.plot(kind="bars")


def test_batched_profile_equals_the_sequential_closed_form_profile(multistart_fit, tmp_path):
    # Profile of k over 6 grid points (not the 8 slots of the fit: the job is sized to
    # the grid), re-optimising a at each, as one batched fit warm-started from the
    # best start. Reference: for fixed k the best a is linear least squares in closed
    # form, one grid point after another. Adam from the warm start to grad_tol 1e-9 on
    # a (the fixed k's gradient is not counted): measured a within 1.4e-10 relative
    # (the gradient tolerance's share) and the profile loss within 4.4e-10 relative of
    # the optimum (the solve's, rtol 1e-10); bounds 1.5e-9 and 5e-9.
    res, obs = multistart_fit
    cal = _calibrator(*_decay(), obs, transform={"a": None, "k": gs.transforms.Log10()})
    k_best = float(res.best().theta["k"])
    grid = k_best * np.array([0.8, 0.9, 0.97, 1.03, 1.1, 1.25])
    prof = cal.profile(res, "k", grid, steps=600, grad_tol=1e-9, progress=False)
    np.testing.assert_allclose(prof.theta["k"], grid, rtol=1e-14)  # held fixed
    t, d = np.asarray(TS), np.asarray(obs)
    for k, a, loss in zip(grid, prof.theta["a"], prof.loss):
        e = np.exp(-k * t)
        a_ref = e @ d / (e @ e)
        loss_ref = np.sum((a_ref * e - d) ** 2)
        assert abs(float(a) - a_ref) / a_ref < 1.5e-9
        assert abs(float(loss) - loss_ref) / loss_ref < 5e-9
    # Each grid point stops at grad_tol, read on the free leaf (a): 273-349 updates.
    # With the fixed leaf's gradient counted (nonzero off the optimum) none did.
    assert np.asarray(prof.converged).all() and np.asarray(prof.steps).max() < 600
    assert np.argmin(prof.loss) in (2, 3)  # the minimum between the two nearest points
    fig = prof.plot(kind="profile", name="k", path=tmp_path / "profile.png")
    np.testing.assert_array_equal(fig.axes[0].lines[0].get_xdata(), np.sort(prof.theta["k"]))
    with pytest.raises(ValueError, match="no leaf 'rho' in theta; its leaves are"):
        cal.profile(res, "rho", grid)


def test_lbfgs_profile_keeps_the_grid_and_reaches_the_closed_form(multistart_fit):
    # The same profile with optax.lbfgs: its line search evaluates trial points, so the
    # fixed leaf is masked in the gradient it sees, not in the update it makes (masked
    # after it, the accepted trial points would move k off the grid and the profile
    # would not be one). Reference: the closed-form profile of the test above. For
    # fixed k the loss is quadratic in a: L-BFGS's first line search lands on the
    # minimum and the next update finds grad_tol 1e-9 met: measured a within 4.0e-12
    # relative, the loss within 4.4e-10 (the solve's, rtol 1e-10), 1 update each;
    # bounds 5e-11, 5e-9 and 5 updates.
    res, obs = multistart_fit
    cal = _calibrator(*_decay(), obs, transform={"a": None, "k": gs.transforms.Log10()},
                      optimizer=optax.lbfgs())
    grid = float(res.best().theta["k"]) * np.array([0.8, 1.03, 1.25])
    prof = cal.profile(res, "k", grid, steps=50, grad_tol=1e-9, progress=False)
    np.testing.assert_allclose(prof.theta["k"], grid, rtol=1e-14)  # held (log10 and back)
    t, d = np.asarray(TS), np.asarray(obs)
    for k, a, loss in zip(grid, prof.theta["a"], prof.loss):
        e = np.exp(-k * t)
        a_ref = e @ d / (e @ e)
        assert abs(float(a) - a_ref) / a_ref < 5e-11
        assert abs(float(loss) - np.sum((a_ref * e - d) ** 2)) / float(loss) < 5e-9
    assert np.asarray(prof.converged).all() and np.asarray(prof.steps).max() <= 5


def test_saved_result_loads_with_every_start(multistart_fit, tmp_path):
    res, _ = multistart_fit
    path = tmp_path / "starts.npz"
    res.save(path)
    like = {"a": jnp.ones(8), "k": jnp.ones(8)}
    back = gs.FitResult.load(path, like=like)
    for field in ("loss", "converged", "status", "steps", "history", "grad_norm"):
        np.testing.assert_array_equal(getattr(back, field), getattr(res, field))
    for key in ("a", "k"):
        np.testing.assert_array_equal(back.theta[key], res.theta[key])
    assert back.best().index == res.best().index
    assert back.status_names == res.status_names and back.engine == res.engine
    plain = gs.FitResult.load(path)
    np.testing.assert_array_equal(plain.theta["['k']"], res.theta["k"])
    assert [p.name for p in tmp_path.iterdir()] == ["starts.npz"]  # no temporary left
    with pytest.raises(ValueError, match="like has array leaves"):
        gs.FitResult.load(path, like={"a": jnp.ones(8)})


def _queue_fit(prob, B, obs, theta0, slots=None, steps=300, **kw):
    cal = _calibrator(prob, B, obs, transform={"a": None, "k": gs.transforms.Log10()},
                      refresh_every=40, **kw)
    return cal.fit(theta0, steps=steps, tol=1e-4, progress=False, slots=slots)


_QUEUE_FIELDS = ("loss", "steps", "status", "history", "grad_norm")


def _assert_same_fits(res, ref, starts=slice(None)):
    """`res`'s fits equal `ref`'s fits `starts`."""
    # Fits never meet in the update (their losses are summed, each gradient is its own),
    # so a start's computation is the same in any slot beside any others. Not bit for
    # bit: XLA compiles the update for 1, 3 and 8 fits with different vector loops,
    # which moves last bits, and 300 Adam updates carry them; the final losses (~1e-4,
    # sums of squared residuals that are small differences of O(1) values) show them
    # most. Measured: <= 8e-14 relative through 3 slots, <= 4e-11 for the start alone.
    for f in _QUEUE_FIELDS:
        np.testing.assert_allclose(np.asarray(getattr(res, f)),
                                   np.asarray(getattr(ref, f))[..., starts],
                                   rtol=1e-9, atol=0, err_msg=f)
    for key in ("a", "k"):
        np.testing.assert_allclose(res.theta[key], ref.theta[key][starts],
                                   rtol=1e-9, atol=0)


@pytest.fixture(scope="module")
def queue_starts():
    prob, B = _decay()
    theta0 = gs.multistart({"a": 0.5, "k": 0.05}, {"a": 3.0, "k": 5.0}, B,
                           jax.random.key(3), scale={"a": "lin", "k": "log"})
    obs = _observations()
    return prob, B, obs, theta0, _queue_fit(prob, B, obs, theta0)


def test_start_queue_through_three_slots_equals_all_starts_at_once_and_alone(queue_starts):
    # 8 starts through 3 slots: a slot whose fit converges (tol) takes the next start;
    # every fit re-records at its own update counts (refresh_every=40). Reference: the 8 starts as 8 concurrent fits, and start 6
    # as a fit of its own (a problem of one trajectory).
    prob, B, obs, theta0, together = queue_starts
    assert len(set(together.steps.tolist())) > 2  # the fits stop at different updates
    queued = _queue_fit(prob, B, obs, theta0, slots=3)
    _assert_same_fits(queued, together)
    assert queued.updates > together.updates  # the same work, 3 at a time
    one = prob.replace(y0=prob.y0[6:7], params={"k": prob.params["k"][6:7]})
    alone = _queue_fit(one, 1, obs, jax.tree.map(lambda x: x[6:7], theta0))
    _assert_same_fits(alone, together, slice(6, 7))


def test_start_queue_resumes_and_extends_with_other_slots(queue_starts, tmp_path):
    # A queued fit capped at 60 updates per start (checkpointed every 7 updates of the
    # slots), then extended to 300 through 5 slots instead of 3: the checkpoint holds
    # every start (the slots are written back before a save), so the extension ends
    # where the 8 starts run straight to 300 do.
    prob, B, obs, theta0, together = queue_starts
    kw = dict(checkpoint_dir=tmp_path / "q", checkpoint_every=7)
    short = _queue_fit(prob, B, obs, theta0, slots=3, steps=60, **kw)
    assert short.history.shape == (60, B) and (short.steps <= 60).all()
    longer = _queue_fit(prob, B, obs, theta0, slots=5, **kw)
    assert longer.resumed_from == short.updates
    _assert_same_fits(longer, together)
    with pytest.raises(ValueError, match="slots must be None or a positive integer"):
        _queue_fit(prob, B, obs, theta0, slots=0)


def test_a_start_whose_record_fails_gives_its_slot_to_the_next():
    # k = 1e4 needs far more than max_steps=20 steps: those starts fail to record (every
    # start is recorded at theta0 before the first update) and are reported, never
    # taking a slot; the others converge to the closed-form optimum k = ln 2
    # (exp(-k) = 0.5) as they do all at once.
    prob = gs.EnsembleProblem(lambda t, y, k: -k * y, jnp.ones((6, 1)), jnp.ones(6), (0.0, 1.0))
    cal = gs.Calibrator(prob, lambda ys, k, d: jnp.sum((ys - d) ** 2),
                        data=jnp.full((6, 1, 1), 0.5), optimizer=optax.adam(0.05), max_steps=20)
    theta0 = jnp.array([1.0, 1e4, 1e4, 2.0, 1e4, 0.5])
    named = r"3 of 6 fits stopped on a failed recording of their mesh .*: fits \[1, 2, 4\]"
    with pytest.warns(RuntimeWarning, match=named):
        together = cal.fit(theta0, steps=200, tol=1e-10, progress=False)
    with pytest.warns(RuntimeWarning, match=named):
        queued = cal.fit(theta0, steps=200, tol=1e-10, progress=False, slots=2)
    assert queued.status_names == together.status_names == (
        "converged", "record_failed", "record_failed", "converged", "record_failed", "converged")
    np.testing.assert_array_equal(queued.steps, together.steps)
    # A converged fit holds its slot for its steps plus the update that finds it
    # converged. Slots run starts 0 and 3, then 5: no update is spent on a failed start.
    s = queued.steps + 1
    assert queued.updates == max(s[0], s[3]) + s[5]
    np.testing.assert_allclose(queued.theta[queued.converged], np.log(2.0), rtol=1e-4)


def test_to_y0_of_the_wrong_shape_is_refused_before_compiling():
    prob, B = _decay()
    cal = gs.Calibrator(prob, lambda ys, th, d: jnp.sum(ys ** 2),
                        to_params=lambda th: {"k": jnp.full(1, th)},
                        to_y0=lambda th: jnp.full((2, 1), th), ts=TS)
    with pytest.raises(ValueError, match=r"to_y0\(theta_b\) must give the K=1 initial "
                                         r"states of one fit, float64\[1, 1\]; got "
                                         r"float64\[2, 1\]"):
        cal.fit(jnp.ones(B), steps=1, progress=False)
    with pytest.raises(TypeError, match="to_y0 must be callable"):
        gs.Calibrator(prob, lambda ys, th, d: 0.0, to_y0=1.0)


@pytest.mark.parametrize("method", ["sobol", "lhs"])
def test_multistart_designs_are_stratified_on_their_scales(method):
    # Both designs put exactly one of 32 points in each of 32 equal slices of every
    # coordinate (Sobol's first 2^m points: a (0, m, 1)-net per coordinate; a Latin
    # hypercube by construction), measured on the scale asked for: log for k.
    lo = {"k": jnp.array([1e-3, 1e-1]), "a": 0.0}
    hi = {"k": jnp.array([1e3, 1e1]), "a": 2.0}
    theta = gs.multistart(lo, hi, 32, jax.random.key(0), scale={"k": "log", "a": "lin"},
                          method=method)
    assert theta["k"].shape == (32, 2) and theta["a"].shape == (32,)
    columns = [(np.log(theta["k"][:, 0]), np.log(1e-3), np.log(1e3)),
               (np.log(theta["k"][:, 1]), np.log(1e-1), np.log(1e1)),
               (np.asarray(theta["a"]), 0.0, 2.0)]
    for x, a, b in columns:
        bins = np.floor((np.asarray(x) - a) / (b - a) * 32).astype(int)
        assert sorted(bins) == list(range(32))
    again = gs.multistart(lo, hi, 32, jax.random.key(0), scale={"k": "log", "a": "lin"},
                          method=method)
    np.testing.assert_array_equal(again["k"], theta["k"])  # the key fixes the design


def test_multistart_refuses_bad_boxes_by_name():
    key = jax.random.key(0)
    with pytest.raises(ValueError, match=r"lo/hi\['k'\]: a log scale needs lo > 0"):
        gs.multistart({"k": 0.0}, {"k": 1.0}, 4, key)
    with pytest.raises(ValueError, match=r"lo/hi\['k'\]: every entry needs finite lo < hi"):
        gs.multistart({"k": 2.0}, {"k": 1.0}, 4, key)
    with pytest.raises(ValueError, match="scale of \\['k'\\] must be one of"):
        gs.multistart({"k": 1.0}, {"k": 2.0}, 4, key, scale="ln")
    with pytest.raises(ValueError, match="method must be one of"):
        gs.multistart({"k": 1.0}, {"k": 2.0}, 4, key, method="halton")
    with pytest.raises(ValueError, match="n_starts must be a positive integer"):
        gs.multistart({"k": 1.0}, {"k": 2.0}, 0, key)


def test_log_scales_map_as_their_closed_forms():
    u = jnp.array([-2.0, 0.0, 3.0])
    np.testing.assert_allclose(gs.transforms.Log().forward(u), np.exp(u), rtol=1e-15)
    np.testing.assert_allclose(gs.transforms.Log10().forward(u), 10.0 ** np.asarray(u),
                               rtol=1e-14)
    np.testing.assert_array_equal(gs.transforms.Positive().forward(u),
                                  gs.transforms.Log().forward(u))
    # Bounded: sigmoid(u) of the way from log10(lo) to log10(hi), and back.
    t = gs.transforms.Log10(1e-2, 1e4)
    z = -2 + 6 / (1 + np.exp(-np.asarray(u)))
    np.testing.assert_allclose(t.forward(u), 10.0 ** z, rtol=1e-14)
    np.testing.assert_allclose(t.inverse(t.forward(u)), u, rtol=1e-12)
    far = t.forward(jnp.array([-40.0, 40.0]))
    assert 1e-2 <= float(far[0]) and float(far[1]) <= 1e4
    with pytest.raises(ValueError, match="Log10 bounds are on a log scale and must be > 0"):
        gs.transforms.Log10(0.0, 1.0)
    with pytest.raises(ValueError, match="Log takes both bounds or neither"):
        gs.transforms.Log(1.0)
    with pytest.raises(ValueError, match="Positive takes no bounds"):
        gs.transforms.Positive(1.0, 2.0)


# -- smaller things a user meets on the way --------------------------------------------

def test_solve_under_grad_or_jit_points_to_the_gradient_api():
    def loss(k):
        prob = gs.EnsembleProblem(lambda t, y, k: -k * y, jnp.ones((2, 1)), k, (0.0, 1.0))
        return gs.solve(prob).ys.sum()
    for transform in (jax.grad, jax.jit):
        with pytest.raises(TypeError, match=r"gs.solve got traced values .* "
                                            r"gs.value_and_grad\(prob, loss\)"):
            transform(loss)(jnp.ones(2))


def test_solve_throw_and_output_times():
    prob = gs.problems.lorenz(n=2)
    with pytest.raises(gs.TrajectoryFailure, match="2 of 2 trajectories failed"):
        gs.solve(prob, max_steps=3, throw=True)
    assert gs.solve(prob, max_steps=3).status.tolist() == [gs.Status.MAX_STEPS] * 2
    ts = jnp.array([0.1, 0.5])
    np.testing.assert_array_equal(gs.solve(prob, ts=ts).ts, ts)
    np.testing.assert_array_equal(gs.solve(prob).ts, [prob.t_span[1]])


def test_rerecord_keeps_the_width_and_the_padding_changes_no_value():
    # A rerecord at nearby parameters fits the current width: the compiled gradient
    # is reused; zero-size padded steps are the identity, so the gradient equals the
    # one on the unpadded fresh mesh bit for bit.
    prob = gs.problems.lorenz(n=4)
    loss = lambda ys, p: jnp.sum(ys ** 2)
    vg = gs.value_and_grad(prob, loss, engine="general_replay")
    vg.rerecord()
    width = vg.mesh.columns
    near = jax.tree.map(lambda x: x * 1.001, prob.params)
    vg.rerecord(params=near)
    assert vg.mesh.columns == width
    fresh = gs.value_and_grad(prob, loss, engine="general_replay",
                              mesh=gs.record(prob, params=near, recorder="general"))
    assert fresh.mesh.columns < width
    for a, b in zip(jax.tree.leaves(vg(near)), jax.tree.leaves(fresh(near))):
        np.testing.assert_array_equal(a, b)


# -- minibatches ------------------------------------------------------------------------

def _minibatch_fit(batch_size, **kw):
    """B = 1 fit of k on K = 4 decays with different y0 (so their gradients differ),
    observed at TS; plain SGD, no transform."""
    K = 4
    a = jnp.array([0.5, 1.0, 2.0, 4.0])
    prob = gs.EnsembleProblem(lambda t, y, p: -p["k"] * y, a[:, None], {"k": jnp.ones(K)},
                              (0.0, 2.0), name="decays")
    data = (a[:, None] * jnp.exp(-0.8 * TS))[None, :, :, None]  # (B, K, T, 1)
    return gs.Calibrator(prob, lambda ys, th, d: jnp.sum((ys - d) ** 2), data=data,
                         to_params=lambda th: {"k": jnp.full(K, th)}, ts=TS, rtol=1e-10,
                         atol=1e-12, optimizer=optax.sgd(1e-3), batch_size=batch_size, **kw), a


def test_each_minibatch_update_is_the_gradient_of_one_drawn_trajectory():
    # batch_size=1: every SGD update must be -lr times the closed-form gradient of ONE
    # trajectory's loss, L_j(k) = sum_t (a_j e^{-k t} - d_jt)^2, at the current k, and
    # the draws vary. One fit of 9 updates, read from its history: row s is the
    # minibatch loss at iterate s, which names the trajectory drawn (the four L_j at
    # one k differ by factors a_j^2 = 4); the iterates follow from k = 1.3 by the
    # closed-form updates. Solver rtol 1e-10: each row is its L_j to 2.9e-11 relative
    # (bound 3e-10), and the last k is the closed-form chain's to 8.0e-9 of the chain's
    # smallest update (bound 8e-8; an error in any one update's gradient shows there).
    cal, a = _minibatch_fit(1)
    t, a = np.asarray(TS), np.asarray(a)
    d = a[:, None] * np.exp(-0.8 * t)
    res = cal.fit(jnp.array([1.3]), steps=9, progress=False)
    assert res.history.shape == (9, 1) and res.updates == 9
    k, chosen, moves, errs = 1.3, [], [], []
    for loss in res.history[:, 0]:
        y = a[:, None] * np.exp(-k * t)
        losses = np.sum((y - d) ** 2, axis=1)  # (K,) per trajectory
        j = int(np.argmin(np.abs(losses - loss)))
        errs.append(abs(loss - losses[j]) / losses[j])
        chosen.append(j)
        move = 1e-3 * np.sum(2 * (y[j] - d[j]) * (-t) * y[j])
        moves.append(abs(move))
        k -= move
    assert max(errs) < 3e-10, errs
    assert abs(float(res.theta[0]) - k) / min(moves) < 8e-8
    assert len(set(chosen)) >= 2


def test_minibatch_fit_resumes_with_the_same_draws(tmp_path):
    # The draws come from the fit's key, which the checkpoint holds: 6 + 6 updates
    # through a checkpoint end bit for bit where 12 straight do.
    first = _minibatch_fit(2, checkpoint_dir=tmp_path / "fit", checkpoint_every=3)[0]
    first.fit(jnp.array([1.3]), steps=6, progress=False)
    resumed = _minibatch_fit(2, checkpoint_dir=tmp_path / "fit", checkpoint_every=3)[0] \
        .fit(jnp.array([1.3]), steps=12, progress=False)
    assert resumed.resumed_from == 6
    straight = _minibatch_fit(2)[0].fit(jnp.array([1.3]), steps=12, progress=False)
    np.testing.assert_array_equal(resumed.theta, straight.theta)
    np.testing.assert_array_equal(resumed.history, straight.history)


def test_minibatch_needs_data_per_trajectory_and_a_size_within_k():
    cal, _ = _minibatch_fit(5)
    with pytest.raises(ValueError, match="batch_size=5 is more than a fit's K=4"):
        cal.fit(jnp.array([1.3]), steps=1, progress=False)
    cal, _ = _minibatch_fit(2)
    cal.data = cal.data[:, 0]
    with pytest.raises(ValueError, match=r"with batch_size, data must lead with \(B, K\) = "
                                         r"\(1, 4\)"):
        cal.fit(jnp.array([1.3]), steps=1, progress=False)
