"""float32 without `jax_enable_x64`: how most JAX users run. `make test` runs this
folder in its own pytest with `GRADSOLVE_TEST_X64=0` (tests/conftest.py); the float64
run leaves it out, since x64 is one switch per process.

Tolerances: float32's unit roundoff is 6e-8; two engines summing the same steps in
another order differ by a few hundred roundoffs over a 60-step mesh.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import gradsolve as gs

assert not jax.config.jax_enable_x64, "run with GRADSOLVE_TEST_X64=0 (make test does)"


def loss(ys, params):
    return jnp.sum(ys[:, 0] ** 2)


@pytest.fixture(scope="module")
def lorenz_default():
    """The README's first gradient as a float32 user runs it: n = 512 routes to the
    in-kernel adjoint, whose host-call key overflowed JAX's int32 (issue 27, item 0:
    `OverflowError: Python int 784381360019701783 too large to convert to int32`)."""
    prob = gs.problems.lorenz(n=512)
    vg = gs.value_and_grad(prob, loss)
    return prob, vg, vg()


def test_problems_are_float32_without_warnings():
    # dtype=None is JAX's default float; asking for float64 without x64 warns per array
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for build in (gs.problems.lorenz, gs.problems.robertson, gs.problems.hires,
                      gs.problems.neural_spiral, gs.problems.neural_robertson):
            prob = build(n=2)
            arrays = jax.tree.leaves(eqx.filter((prob.y0, prob.params), eqx.is_array))
            assert all(x.dtype == jnp.float32 for x in arrays)


def test_default_gradient_routes_to_kernel_adjoint_and_matches_the_jax_replay(lorenz_default):
    prob, vg, (value, grads) = lorenz_default
    assert vg.engine == "kernel_adjoint"
    assert value.dtype == jnp.float32 and grads["rho"].dtype == jnp.float32
    # the JAX replay of the same mesh: an independent implementation of the same sum
    ref = gs.value_and_grad(prob, loss, engine="general_replay", mesh=vg.mesh)
    ref_value, ref_grads = ref()
    np.testing.assert_allclose(value, ref_value, rtol=1e-5)
    for name, bound in (("rho", 6e-5), ("sigma", 1.3e-4), ("beta", 3e-4)):
        # measured 5.5e-6 (rho), 1.3e-5 (sigma), 2.8e-5 (beta) of the largest entry
        scale = np.max(np.abs(ref_grads[name]))
        assert np.max(np.abs(grads[name] - ref_grads[name])) / scale < bound, name


def test_kernel_adjoint_outputs_from_the_extension_match_the_jax_replay():
    """`ts` on the in-kernel adjoint: Tsit5's continuous extension in the kernels (the
    default) against the JAX replay's on the same mesh, float32 on both sides:
    roundoff carried through ~50 steps, measured 1.2e-7 (value), 9e-7 to 1.1e-5 of the
    largest entry (gradients, sigma the largest); bounds ~10x."""
    prob = gs.problems.lorenz(n=8)
    ts = jnp.linspace(0.0, 1.0, 9)
    squares = lambda ys, p: jnp.sum(ys ** 2)  # every output time
    ka = gs.value_and_grad(prob, squares, engine="kernel_adjoint", ts=ts)
    ref = gs.value_and_grad(prob, squares, engine="general_replay", ts=ts, mesh=ka.mesh)
    assert ka.config.interpolate and ref.config.interpolate
    (value, grads), (ref_value, ref_grads) = ka(), ref()
    assert value.dtype == jnp.float32
    np.testing.assert_allclose(value, ref_value, rtol=2e-6)
    for name in ("rho", "sigma", "beta"):
        scale = np.max(np.abs(ref_grads[name]))
        assert np.max(np.abs(grads[name] - ref_grads[name])) / scale < 1.2e-4, name


def test_calibrator_fits_in_float32_on_the_in_kernel_adjoint():
    """Two rho fits from noise-free data made at the truth (12, 18): the fit stops at
    the truth up to the mesh's own error at rtol 1e-6 (the data's mesh is not the
    fit's). Measured 4e-7 and 2e-7 relative."""
    B, K = 2, 2
    rng = np.random.default_rng(0)
    prob = gs.problems.lorenz(n=B * K)
    y0 = np.tile([1.0, 0.0, 0.0], (B * K, 1)) + rng.normal(scale=0.5, size=(B * K, 3))
    rho_true = jnp.array([12.0, 18.0])
    prob = prob.replace(y0=jnp.asarray(y0, jnp.float32),
                        params={**prob.params, "rho": jnp.repeat(rho_true, K)})
    data = gs.solve(prob).raise_for_status().ys.reshape(B, K, 3)

    def to_params(theta):
        return {"sigma": jnp.full(K, 10.0), "rho": jnp.full(K, theta["rho"]),
                "beta": jnp.full(K, 8.0 / 3.0)}

    def loss(ys, theta, obs):
        return jnp.mean((ys - obs) ** 2)

    cal = gs.Calibrator(prob, loss, to_params=to_params, data=data, engine="kernel_adjoint",
                        optimizer=optax.adam(0.3), refresh_every=100)
    res = cal.fit({"rho": jnp.full(B, 15.0)}, steps=300, grad_tol=1e-4, progress=False)
    assert res.engine == "kernel_adjoint" and res.theta["rho"].dtype == jnp.float32
    assert res.converged.all()
    np.testing.assert_allclose(res.theta["rho"], rho_true, rtol=4e-6)


def oscillator_f(t, y, p):
    return jnp.stack([y[1], -p["w"] ** 2 * y[0]])


@pytest.mark.parametrize("method,bound", [("tsit5", 6e-5), ("vern7", 2e-5)])
def test_interpolated_outputs_in_float32(method, bound):
    """Outputs from the continuous extension (interpolate=True) against the closed
    form cos(w t): at rtol 1e-5 the mesh's own error dominates float32's roundoff;
    measured 6.4e-6 for Tsit5, as its integrated outputs' (both largest at t1), and
    3.9e-6 for Vern7 (integrated 2.6e-6). Vern7's weights evaluated in the published
    monomials cancel (coefficients to 1.2e3): 4.2e-5, which its bound (~5x) refuses;
    the tableau's centred form (`dense_centered`) is what the replay evaluates."""
    w = jnp.array([1.0, 1.5, 2.0])
    prob = gs.EnsembleProblem(oscillator_f, y0=jnp.tile(jnp.array([1.0, 0.0]), (3, 1)),
                              params={"w": w}, t_span=(0.0, 5.0))
    mesh = gs.record(prob, rtol=1e-5, atol=1e-7, method=method)
    ts = jnp.linspace(0.0, 5.0, 41)
    exact = np.cos(np.outer(w, ts))
    ys = gs.replay(prob, mesh, ts=ts, interpolate=True)
    assert ys.dtype == jnp.float32
    err = np.abs(np.asarray(ys[..., 0]) - exact).max()
    err_integrated = np.abs(np.asarray(gs.replay(prob, mesh, ts=ts, interpolate=False)[..., 0])
                            - exact).max()
    assert err_integrated < 6e-5
    grads = jax.grad(lambda p: jnp.sum(gs.replay(prob, mesh, params=p, ts=ts,
                                                 interpolate=True) ** 2))({"w": w})
    assert np.all(np.isfinite(grads["w"]))
    assert err < bound


def test_checkpointed_fit_resumes_bit_for_bit_in_float32(tmp_path):
    """40 updates in one go equal 20, a checkpoint, and 20 more from it, bit for bit
    (the optimizer state, key and mesh are saved in float32 and read back as such)."""
    w_true = jnp.array([1.2, 1.8])
    prob = gs.EnsembleProblem(oscillator_f, y0=jnp.tile(jnp.array([1.0, 0.0]), (2, 1)),
                              params={"w": w_true}, t_span=(0.0, 3.0))
    ts = jnp.linspace(0.5, 3.0, 6)
    data = gs.solve(prob, ts=ts).ys[:, None]

    def fit_loss(ys, theta, obs):
        return jnp.mean((ys - obs) ** 2)

    def calibrator(directory=None):
        return gs.Calibrator(prob, fit_loss, to_params=lambda th: {"w": th[None]}, data=data,
                             ts=ts, interpolate=True, optimizer=optax.adam(0.05),
                             checkpoint_dir=directory)
    theta0 = jnp.array([1.0, 1.5])
    straight = calibrator().fit(theta0, steps=40, progress=False)
    calibrator(tmp_path).fit(theta0, steps=20, progress=False)
    resumed = calibrator(tmp_path).fit(theta0, steps=40, progress=False)
    assert resumed.resumed_from == 20 and resumed.theta.dtype == jnp.float32
    np.testing.assert_array_equal(resumed.theta, straight.theta)
    np.testing.assert_array_equal(resumed.loss, straight.loss)


@pytest.fixture(scope="module")
def small_lorenz():
    """Lorenz at n = 4 and its general_replay gradient: the reference every engine's
    float32 result is held to."""
    prob = gs.problems.lorenz(n=4)
    vg = gs.value_and_grad(prob, loss, engine="general_replay", rtol=1e-5, atol=1e-7)
    return prob, vg.mesh, vg()


@pytest.mark.parametrize("engine", ["fused", "fused_replay", "general", "general_replay",
                                    "diffrax"])
def test_every_engine_solves_in_float32(small_lorenz, engine):
    """A forward solve on each engine in float32 against the JAX replay of a float32
    mesh: both at rtol 1e-5, so they differ by the tolerance-sized gap of two meshes
    (measured 2.1e-4 relative for the fused kernel's own mesh, 2.1e-5 general, 2.7e-5
    Diffrax; bound 2e-3); with the dtype check it fails on a float64 leak or a wrong
    state (errors ~1)."""
    prob, mesh, _ = small_lorenz
    sol = gs.solve(prob, engine=engine, rtol=1e-5, atol=1e-7).raise_for_status()
    assert sol.ys.dtype == jnp.float32 and sol.engine == engine
    ref = gs.replay(prob, mesh)
    np.testing.assert_allclose(sol.ys, ref, rtol=2e-3)


@pytest.mark.parametrize("engine", ["fused_replay", "kernel_adjoint", "general_replay",
                                    "diffrax"])
def test_every_engine_differentiates_in_float32(small_lorenz, engine):
    """Each gradient engine in float32 on the same problem: the JAX replay engines on
    the reference's own mesh are the same computation (equal bit for bit); the Warp
    in-kernel adjoint on that mesh sums in another order (measured 4.0e-5 of the
    largest entry) and Diffrax takes its own steps at the same tolerance (4.2e-5);
    bounds ~10x."""
    prob, mesh, (value, grads) = small_lorenz
    on_mesh = {} if engine == "diffrax" else {"mesh": mesh}
    vg = gs.value_and_grad(prob, loss, engine=engine, rtol=1e-5, atol=1e-7, **on_mesh)
    v, g = vg()
    assert v.dtype == jnp.float32 and g["rho"].dtype == jnp.float32
    bound = {"kernel_adjoint": 4e-4, "diffrax": 4e-4}.get(engine, 0.0)
    for name in ("sigma", "rho", "beta"):
        scale = np.max(np.abs(grads[name]))
        assert np.max(np.abs(g[name] - grads[name])) / scale <= bound, name


def test_multistart_starts_are_float32():
    theta0 = gs.multistart({"k": 1e-3}, {"k": 1e3}, 8, jax.random.key(0))
    assert theta0["k"].dtype == jnp.float32


def test_levenberg_marquardt_fits_in_float32():
    """Residuals (Levenberg-Marquardt, the Jacobian by forward mode) in float32:
    y' = -k y from amplitudes a and 2a, observed exactly, three fits. Measured: k and
    a within 3.6e-7 relative of the truth (6 roundoffs), 13-19 updates, all converged;
    bound 3e-6. With float64's tolerances (rtol 1e-8, below float32's resolution) the
    second fit, at the truth to the last bit, took 36 updates and, after a change of
    rounding elsewhere, ran into the 40-update cap: the default solver's tolerances
    follow the dtype."""
    B, K = 3, 2
    ts = jnp.linspace(0.25, 2.0, 8)
    k_true, a_true = jnp.array([0.5, 1.0, 2.0]), jnp.array([1.5, 0.7, 3.0])
    data = (a_true[:, None] * jnp.array([1.0, 2.0]))[:, :, None, None] * jnp.exp(
        -k_true[:, None, None, None] * ts[None, None, :, None])
    prob = gs.EnsembleProblem(f_jax=lambda t, y, p: -p["k"] * y, y0=jnp.ones((B * K, 1)),
                              params={"k": jnp.ones(B * K)}, t_span=(0.0, 2.0))
    cal = gs.Calibrator(prob, residuals=lambda ys, th, d: (ys - d).ravel(),
                        to_params=lambda th: {"k": jnp.full(K, th["k"])},
                        to_y0=lambda th: th["a"] * jnp.array([[1.0], [2.0]]), data=data,
                        ts=ts, transform={"k": gs.transforms.Positive(), "a": None})
    assert cal.optimizer.rtol == pytest.approx(10 * np.finfo(np.float32).eps)
    res = cal.fit({"k": jnp.full(B, 1.2), "a": jnp.full(B, 1.0)}, steps=40, progress=False)
    assert res.theta["k"].dtype == jnp.float32 and res.converged.all(), res.steps
    np.testing.assert_allclose(res.theta["k"], k_true, rtol=3e-6)
    np.testing.assert_allclose(res.theta["a"], a_true, rtol=3e-6)


def test_a_networks_stale_mesh_is_rerecorded_in_float32():
    """The error check of `refresh_tol` (on by default for a network's fit) in
    float32: DiffEqFlux's spiral, small (2 -> 8 tanh -> 2 on u^3, one trajectory,
    Adam at 0.05). The fit re-records its mesh when a step errs above 2 tolerances
    (measured 10 re-records in 40 updates, as in float64), and the loss it computed at
    its last update is the accurately solved loss of the network it started from
    (measured 2e-4 relative; bound 2e-2 as in float64: rtol 1e-3 is far above
    float32's roundoff)."""
    from helpers import small_spiral
    prob, ts, data = small_spiral(1e-6, 1e-8)
    cal = gs.Calibrator(prob, lambda ys, m, d: jnp.sum((ys - d) ** 2), data=data, ts=ts,
                        rtol=1e-3, atol=1e-6, optimizer=optax.adam(0.05))
    assert cal.refresh_tol == 2.0
    res = cal.fit(steps=40, progress=False)
    assert res.history.dtype == jnp.float32 and 3 <= res.refreshes < 40, res.refreshes
    net = cal.fit(steps=39, progress=False).best().theta["mlp"]
    solved = gs.solve(prob.replace(params={"mlp": gs.Shared(net)}), ts=ts, rtol=1e-6,
                      atol=1e-8).raise_for_status().ys[0]
    true_loss = float(jnp.sum((solved - data) ** 2))
    assert abs(float(res.history[39, 0]) - true_loss) <= 2e-2 * true_loss, (
        float(res.history[39, 0]), true_loss, res.refreshes)
