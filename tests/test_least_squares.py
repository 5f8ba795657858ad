"""Least-squares fits: `Calibrator(..., residuals=...)` with optimistix's Gauss-Newton
family, each against a closed form; per-fit independence, resume bit for bit,
profiles, and the refusals of what is not supported."""

import sys
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import optimistix as optx
import pytest

import gradsolve as gs

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from fit_worker import assert_same_state  # noqa: E402
from helpers import rel_err  # noqa: E402

B, K = 3, 2
TS = jnp.linspace(0.25, 2.0, 8)
K_TRUE = jnp.array([0.5, 1.0, 2.0])
A_TRUE = jnp.array([1.5, 0.7, 3.0])  # each fit's initial amplitude


def _decay_problem():
    return gs.EnsembleProblem(f_jax=lambda t, y, p: -p["k"] * y, y0=jnp.ones((B * K, 1)),
                              params={"k": jnp.ones(B * K)}, t_span=(0.0, 2.0))


# Each fit's K trajectories start at a and 2a: exp(-k t) of them, observed at TS.
DATA = (A_TRUE[:, None] * jnp.array([1.0, 2.0]))[:, :, None, None] * jnp.exp(
    -K_TRUE[:, None, None, None] * TS[None, None, :, None])


def _decay(**kw):
    return gs.Calibrator(
        _decay_problem(), residuals=lambda ys, th, d: (ys - d).ravel(),
        to_params=lambda th: {"k": jnp.full(K, th["k"])},
        to_y0=lambda th: th["a"] * jnp.array([[1.0], [2.0]]), data=DATA, ts=TS,
        transform={"k": gs.transforms.Positive(), "a": None}, rtol=1e-10, atol=1e-12, **kw)


THETA0 = {"k": jnp.full(B, 1.2), "a": jnp.full(B, 1.0)}


@pytest.fixture(scope="module")
def decay_fit():
    cal = _decay()
    return cal, cal.fit(THETA0, steps=40, progress=False)


def test_levenberg_marquardt_is_the_default_and_reaches_the_closed_form(decay_fit):
    # y' = -k y from a and 2a, observed exactly: the optimum is (k, a) itself, loss 0.
    # Measured: 11-13 updates per fit at the suite's XLA level 0, 11-17 at XLA's
    # default (its own test counts after the first refresh, at 10; the update after
    # it evaluates the fit anew, then an accepted step or 5 trials rejected in a row
    # at a rounding-level loss end it; bound 20. Adam at 0.05: 356-399 to a loss of
    # 1e-18), k within 2.9e-12 and a within 4.7e-12 relative of the truth at rtol
    # 1e-10 (the replay's accuracy; bound 3e-11), losses 5e-23 to 3.7e-21.
    cal, res = decay_fit
    assert isinstance(cal.optimizer, optx.LevenbergMarquardt)
    assert (np.asarray(res.status) == gs.calibrate.FitStatus.CONVERGED).all(), res.status
    assert np.asarray(res.steps).max() <= 20, res.steps
    assert rel_err(res.theta["k"], K_TRUE) < 3e-11
    assert rel_err(res.theta["a"], A_TRUE) < 3e-11
    # The loss is half the residuals' squared norm (the scalar form of the same fit).
    assert np.asarray(res.loss).max() < 1e-20


@pytest.mark.exact_across_shapes
def test_a_fit_is_the_same_in_any_slot_and_resumes_bit_for_bit(decay_fit, tmp_path):
    cal, res = decay_fit
    alone = cal.fit(THETA0, steps=40, progress=False, slots=1)
    for name in ("loss", "steps", "status", "history", "grad_norm"):
        np.testing.assert_array_equal(getattr(alone, name), getattr(res, name), name)
    ckpt = dict(checkpoint_dir=tmp_path / "fit", checkpoint_every=1)
    _decay(**ckpt).fit(THETA0, steps=3, progress=False)
    resumed = _decay(**ckpt).fit(THETA0, steps=40, progress=False)
    assert resumed.resumed_from == 3
    assert_same_state(resumed.state, res.state)


def test_a_refresh_keeps_the_trust_regions_radius(decay_fit):
    # A refresh evaluates the fit anew on its fresh mesh (optimistix's first step: an
    # evaluation, no move) and keeps the trust region's radius (Levenberg-Marquardt's
    # damping). So 6 updates refreshing at 4 end with the radius of 5 updates without
    # a refresh, exactly (the same accepted steps; the mesh changes the residuals by
    # ~1e-10, far from a trial's accept/reject margin). Before, a refresh restarted
    # the radius at 1: 3.5 after the one step that followed (150, 43, 12 here); on
    # Boehm_JProteomeRes2014 that left 0 of 8 starts converged in 100 updates
    # (124 s), against 5 of 8 (54 s) keeping it.
    refreshed = _decay(refresh_every=4).fit(THETA0, steps=6, progress=False)
    plain = decay_fit[0].fit(THETA0, steps=5, progress=False)  # its refresh at 10
    assert int(refreshed.refreshes) == 1
    radius = [np.asarray(r.state.opt_state.search_state.step_size) for r in (refreshed, plain)]
    np.testing.assert_array_equal(*radius)
    assert (radius[0] > 3.5).all(), radius



def test_a_stalled_trust_region_is_not_taken_for_an_optimum():
    # r = 1e4 sin(x) from x = 1.2: the Gauss-Newton step (-tan x, to -1.37) raises the
    # loss, and Levenberg-Marquardt's damping (1 / radius, added to J^T J = 1e8 cos^2 x
    # unscaled) stays negligible for ten rejections (optimistix alone accepts the
    # 11th trial). Five rejections in a row used to end the fit as converged at
    # x = 1.2, its gradient norm 3.4e7; now a stall counts only when the next trial is
    # predicted to change the residuals by less than the solver's tolerance, and the
    # fit goes on to sin x = 0 (measured: 21 updates, x = 2.9e-22, gradient norm
    # 2.9e-14). Bounds: |sin x| < 1e-12 (the Cauchy test's atol is 1e-10 on r, so
    # 1e-14 on sin x), gradient norm < 1e-6.
    prob = gs.EnsembleProblem(f_jax=lambda t, y, k: -k * y, y0=jnp.ones((1, 1)),
                              params=jnp.ones(1), t_span=(0.0, 1.0))
    cal = gs.Calibrator(prob, residuals=lambda ys, th, d: 1e4 * jnp.sin(th["x"])[None],
                        to_params=lambda th: jnp.ones(1), ts=jnp.array([1.0]),
                        refresh_every=None)
    res = cal.fit({"x": jnp.array([1.2])}, steps=40, progress=False)
    assert res.status[0] == gs.calibrate.FitStatus.CONVERGED, (res.status, res.steps)
    assert abs(np.sin(res.theta["x"][0])) < 1e-12 and res.grad_norm[0] < 1e-6, res.theta


CLIP_HI = 1.5  # k's upper bound below: fit 2's truth, k = 2, lies outside


def _clipped(optimizer):
    """The decay fits with k kept in [0.2, CLIP_HI] on clipped edges, and `fit`'s
    arguments."""
    kw = (dict(residuals=lambda ys, th, d: (ys - d).ravel()) if optimizer ==
          "levenberg_marquardt" else dict(loss=lambda ys, th, d: 0.5 * jnp.sum((ys - d) ** 2),
                                          optimizer=optax.adam(0.05)))
    cal = gs.Calibrator(
        _decay_problem(), to_params=lambda th: {"k": jnp.full(K, th["k"])},
        to_y0=lambda th: th["a"] * jnp.array([[1.0], [2.0]]), data=DATA, ts=TS,
        transform={"k": gs.transforms.Log(0.2, CLIP_HI, edges="clip"), "a": None},
        rtol=1e-10, atol=1e-12, **kw)
    return cal, dict(steps=40 if optimizer == "levenberg_marquardt" else 600,
                     grad_tol=None if optimizer == "levenberg_marquardt" else 1e-6,
                     progress=False)


@pytest.mark.parametrize("optimizer", ["levenberg_marquardt", "adam"])
def test_clipped_edges_reach_an_optimum_on_a_bound(optimizer):
    # k kept in [0.2, 1.5] with edges="clip": fit 2's truth (k = 2) lies outside, so its
    # optimum has k on the bound 1.5 and a at the closed-form least-squares amplitude
    # given k = 1.5 (its data 3 c exp(-2 t) against a c exp(-1.5 t), c = 1, 2: a* = 3
    # <e, f> / <e, e>); fits 0 and 1 are inside and reach their truth. Measured:
    # Levenberg-Marquardt (the bound's column dropped, trial points projected) 11, 11,
    # 12 updates, k on the bound exactly, a within 6.3e-13 of a*; Adam(0.05) (its step
    # projected, the pushing gradient dropped, so grad_tol ends it) 246-278 updates, a
    # within 1.1e-8. On the default squashed edges the same 40 Levenberg-Marquardt
    # updates left k 6.9e-3 below the bound and a 3.5e-3 off. Bounds: a within 3e-11
    # for Levenberg-Marquardt (the replay's accuracy, as the fits inside) and 1e-6
    # for Adam (grad_tol 1e-6 on a gradient of size a's error).
    hi = CLIP_HI
    cal, fit = _clipped(optimizer)
    res = cal.fit(THETA0, **fit)
    assert (np.asarray(res.status) == gs.calibrate.FitStatus.CONVERGED).all(), res.status
    e, f = np.exp(-hi * np.asarray(TS)), np.exp(-2.0 * np.asarray(TS))
    a_star = float(A_TRUE[2]) * (e @ f) / (e @ e)
    assert abs(float(res.theta["k"][2]) - hi) <= 1e-15 * hi, res.theta["k"]
    tol = 3e-11 if optimizer == "levenberg_marquardt" else 1e-6
    assert rel_err(res.theta["a"][2], a_star) < tol, res.theta["a"]
    assert rel_err(res.theta["k"][:2], K_TRUE[:2]) < 10 * tol, res.theta["k"]


@pytest.mark.exact_across_shapes
def test_a_clipped_fit_is_the_same_in_any_slot():
    # The box, the projection and the held bound act per fit: fit 2, held on its
    # bound, and the two inside give the same bits through one slot as side by side.
    cal, fit = _clipped("levenberg_marquardt")
    res, alone = cal.fit(THETA0, **fit), cal.fit(THETA0, slots=1, **fit)
    for name in ("loss", "steps", "status", "history", "grad_norm"):
        np.testing.assert_array_equal(getattr(alone, name), getattr(res, name), name)
    jax.tree.map(np.testing.assert_array_equal, alone.theta, res.theta)


def test_gauss_newton_solves_a_linear_least_squares_fit_in_one_step():
    # y' = c from y(0) = a: y(t) = a + c t, linear in (a, c), which Tsit5 integrates
    # exactly; noisy data. One Gauss-Newton step from anywhere reaches the
    # normal-equations solution (numpy's lstsq): update 1 evaluates the start and
    # takes the step, update 2 evaluates (and accepts) its end. Measured: 4.9e-15
    # relative after 2 updates (3.5 after 1); bound 5e-14.
    ts = jnp.linspace(0.5, 3.0, 6)
    noise = jnp.array([0.1, -0.2, 0.05, 0.3, -0.1, 0.02])
    data = (0.4 + 1.3 * ts + noise)[None, :, None]
    prob = gs.EnsembleProblem(f_jax=lambda t, y, c: c * jnp.ones_like(y), y0=jnp.ones((1, 1)),
                              params=jnp.ones(1), t_span=(0.0, 3.0))
    cal = gs.Calibrator(prob, residuals=lambda ys, th, d: (ys - d).ravel(),
                        to_params=lambda th: th["c"][None],
                        to_y0=lambda th: th["a"][None, None], data=data[None], ts=ts,
                        optimizer=optx.GaussNewton(rtol=1e-12, atol=1e-12))
    res = cal.fit({"a": jnp.array([5.0]), "c": jnp.array([-2.0])}, steps=2, progress=False)
    A = np.stack([np.ones(6), np.asarray(ts)], axis=1)
    (a, c), *_ = np.linalg.lstsq(A, np.asarray(data).ravel(), rcond=None)
    assert rel_err([res.theta["a"][0], res.theta["c"][0]], [a, c]) < 5e-14


def test_profile_by_least_squares_matches_the_closed_form(decay_fit):
    # With k held, the best amplitude of fit 0 is linear least squares: a*(k) =
    # sum(e d) / sum(e e), e = exp(-k t) of the K trajectories' starts (1, 2), and the
    # profile's loss 0.5 (sum d^2 - sum(e d)^2 / sum(e e)). Measured: a within 7.3e-12,
    # the loss 1.4e-10 relative (the replay at rtol 1e-10), 12-13 updates; bound 1e-9.
    cal, res = decay_fit
    grid = np.array([0.8, 0.9, 1.1, 1.25])
    prof = cal.profile(res, "k", grid, steps=40, progress=False)
    best = res.best().index
    d = np.asarray(DATA[best]).reshape(K, -1)
    e = np.array([1.0, 2.0])[:, None] * np.exp(-grid[:, None, None] * np.asarray(TS))
    sed = np.einsum("gkt,kt->g", e, d)
    see = np.einsum("gkt,gkt->g", e, e)
    np.testing.assert_array_equal(prof.theta["k"], grid)
    assert rel_err(prof.theta["a"], sed / see) < 1e-10
    assert rel_err(prof.loss, 0.5 * (np.sum(d ** 2) - sed ** 2 / see)) < 1e-9
    assert (np.asarray(prof.status) == gs.calibrate.FitStatus.CONVERGED).all()


def test_least_squares_refusals_name_what_is_not_supported():
    prob = _decay_problem()
    r = lambda ys, th, d: ys.ravel()  # noqa: E731
    with pytest.raises(TypeError, match="is a least-squares method: give the fit's residuals"):
        gs.Calibrator(prob, lambda ys, th, d: jnp.sum(ys), optimizer=optx.LevenbergMarquardt(
            rtol=1e-8, atol=1e-8))
    with pytest.raises(TypeError, match="optimizer=NelderMead.*quasi-Newton minimisers"):
        gs.Calibrator(prob, residuals=r, optimizer=optx.NelderMead(rtol=1e-8, atol=1e-8))
    with pytest.raises(TypeError, match="give one of loss .* and residuals"):
        gs.Calibrator(prob)
    with pytest.raises(TypeError, match="not both"):
        gs.Calibrator(prob, lambda ys, th, d: jnp.sum(ys), residuals=r)
    with pytest.raises(ValueError, match="batch_size=1 with optimizer=LevenbergMarquardt"):
        gs.Calibrator(prob, residuals=r, batch_size=1)
    with pytest.raises(TypeError, match='optimizer=BFGS does not keep a box: with edges="clip"'):
        gs.Calibrator(prob, lambda ys, th, d: jnp.sum(ys), optimizer=optx.BFGS(1e-8, 1e-8),
                      transform={"k": gs.transforms.Log(0.1, 1.0, edges="clip")})
    # Residuals with an optax optimizer: its loss is half their squared norm.
    cal = gs.Calibrator(prob, residuals=r, optimizer=optax.adam(0.1))
    assert not cal.least_squares
    ys = jnp.array([[3.0], [4.0]])
    assert float(cal.loss(ys, None, None)) == 12.5


def test_a_network_field_keeps_adam_by_default():
    # Residuals over a neural right-hand side (many parameters, a field that stiffens
    # as it trains): Adam stays the default.
    import equinox as eqx
    mlp = eqx.nn.MLP(1, 1, 8, 1, key=jax.random.key(0))
    prob = gs.EnsembleProblem(f_jax=lambda t, y, m: m(y), y0=jnp.ones((2, 1)),
                              params=gs.Shared(mlp), t_span=(0.0, 1.0))
    cal = gs.Calibrator(prob, residuals=lambda ys, th, d: ys.ravel())
    assert not cal.least_squares
    assert isinstance(cal.optimizer, optax.GradientTransformation)


def test_bfgs_minimises_rosenbrocks_function_per_fit():
    # optx.BFGS on a scalar loss: Rosenbrock's function of theta = (a, b) (the loss
    # ignores the solution: the closed form's minimum is (1, 1), loss 0), three fits
    # from different starts, each converging on its own. Measured: 4.0e-15 from
    # (1, 1) in 37-56 updates at rtol = atol = 1e-12 (optax.adam(0.01): still 0.19
    # away after 5000); bound 4e-14. One slot at a time gives the same fits: the same
    # steps and end point, the loss histories within 6.2e-12 (2e-8 relative where the
    # loss is above 1e-8: XLA's vector loops differ by batch size in the last bits,
    # and a BFGS path on Rosenbrock's valley amplifies them); bound 6e-11.
    prob = gs.EnsembleProblem(f_jax=lambda t, y, p: -p * y, y0=jnp.ones((3, 1)),
                              params=jnp.ones(3), t_span=(0.0, 1.0))

    def rosenbrock(ys, th, d):
        return (1 - th["a"]) ** 2 + 100 * (th["b"] - th["a"] ** 2) ** 2 + 0 * jnp.sum(ys)
    cal = gs.Calibrator(prob, rosenbrock, to_params=lambda th: jnp.ones(1),
                        optimizer=optx.BFGS(rtol=1e-12, atol=1e-12))
    res = cal.fit({"a": jnp.array([-1.2, 0.0, 2.0]), "b": jnp.array([1.0, 0.5, 3.0])},
                  steps=200, progress=False)
    assert (np.asarray(res.status) == gs.calibrate.FitStatus.CONVERGED).all(), res.steps
    assert rel_err(np.stack([res.theta["a"], res.theta["b"]]), np.ones((2, 3))) < 4e-14
    alone = cal.fit({"a": jnp.array([-1.2, 0.0, 2.0]), "b": jnp.array([1.0, 0.5, 3.0])},
                    steps=200, progress=False, slots=1)
    for name in ("steps", "status"):
        np.testing.assert_array_equal(getattr(alone, name), getattr(res, name), name)
    np.testing.assert_allclose(alone.history, res.history, rtol=0, atol=6e-11)
    assert rel_err(alone.theta["a"], res.theta["a"]) < 1e-14
