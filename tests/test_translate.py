"""The JAX-to-Warp translator (`gs.register_field`, `EnsembleProblem(fused=True)`):
translated kernels against the hand-written ones and against the general (JAX)
engines, which share no code with the translation."""

import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gradsolve as gs
from gradsolve.warp import _translate
from helpers import rel_err, rel_err_componentwise


# (builder, kwargs, rtol): the registered fields, whose hand-written kernels are an
# independent reference for the translation.
REGISTERED = [
    ("lorenz", {}, 1e-7),
    ("van_der_pol", {}, 1e-7),
    ("lorenz96", {"d": 6}, 1e-7),
    ("linear", {"d": 4}, 1e-7),
    ("robertson", {}, 1e-5),
    ("hires", {}, 1e-5),
    ("linear_stiff", {"d": 5}, 1e-5),
]


def _translated_twin(prob):
    """The same problem with a new function object, so that no hand-written form
    applies and `fused=True` asks for a translation."""
    f = prob.f_jax
    return gs.EnsembleProblem(lambda t, y, p: f(t, y, p), prob.y0, prob.params,
                              prob.t_span, stiff=prob.stiff, name=f"{prob.name}_twin",
                              fused=True)


@pytest.mark.parametrize("name,kw,rtol", REGISTERED)
def test_translation_matches_the_hand_written_kernel(name, kw, rtol):
    # The translation writes the field (and for stiff fields jax.jacfwd's Jacobian)
    # as scalar statements in the order JAX evaluates them; the hand-written forms
    # follow the same formulas, so the solves agree bit for bit (measured: equal on
    # all seven). Against the general engine: same steps, every state component to
    # roundoff carried through the solve, as for the hand-written kernels (measured at
    # most 1.3e-12, linear_stiff and lorenz96; Robertson 2.6e-15; bound ~10x).
    prob = getattr(gs.problems, name)(n=5, **kw)
    twin = _translated_twin(prob)
    translated = gs.solve(twin, rtol=rtol, atol=1e-10)
    hand = gs.solve(prob, rtol=rtol, atol=1e-10)
    general = gs.solve(twin, rtol=rtol, atol=1e-10, engine="general",
                       method=translated.method)
    assert translated.engine == "fused" and translated.ok
    np.testing.assert_array_equal(translated.ys, hand.ys)
    np.testing.assert_array_equal(translated.n_accepted, general.n_accepted)
    assert rel_err_componentwise(translated.ys, general.ys) < 1.5e-11


def test_unregistered_problem_with_fused_true_is_translated():
    # galactic_halo has no hand-written form; fused=True translates it (d = 6, shared
    # scalars, concatenate, integer powers). Same steps as the general engine, states
    # componentwise to roundoff (measured 1.3e-13 at n = 6; bound ~10x).
    prob = gs.problems.galactic_halo(n=6)
    assert gs.solve(prob).engine != "fused"
    twin = gs.EnsembleProblem(prob.f_jax, prob.y0, prob.params, prob.t_span, fused=True)
    fused = gs.solve(twin, rtol=1e-8, atol=1e-10)
    general = gs.solve(twin, rtol=1e-8, atol=1e-10, engine="general", method=fused.method)
    assert fused.engine == "fused" and fused.ok
    np.testing.assert_array_equal(fused.n_accepted, general.n_accepted)
    assert rel_err_componentwise(fused.ys, general.ys) < 1.5e-12


def _sir(t, y, p):
    # A smooth field with a shared matrix, a vector parameter, exp and tanh.
    s, i, r = y
    force = p["beta"] * s * i * (1 + 0.1 * jnp.tanh(t - p["shift"][0]))
    waning = p["shift"][1] * r * jnp.exp(-0.1 * t)
    mix = p["mix"] @ y
    return jnp.stack([-force + waning, force - p["gamma"] * i, p["gamma"] * i - waning]) \
        + 1e-3 * mix


def _sir_problem(n=6, dtype=jnp.float64):
    rng = np.random.default_rng(3)
    mix = rng.normal(size=(3, 3))
    mix -= mix.sum(axis=0)  # columns sum to zero: mixing conserves the population
    y0 = np.tile([0.98, 0.02, 0.0], (n, 1))
    params = {"beta": np.linspace(1.0, 3.0, n), "gamma": np.full(n, 0.4),
              "shift": np.tile([2.0, 0.05], (n, 1)), "mix": gs.Shared(jnp.asarray(mix, dtype))}
    params = jax.tree.map(lambda x: jnp.asarray(x, dtype), params)
    return gs.EnsembleProblem(_sir, jnp.asarray(y0, dtype), params, (0.0, 10.0), name="sir")


@pytest.fixture(scope="module")
def sir_registered():
    # One trajectory's shapes (Python floats take y0's dtype): the translation done here
    # is the one the problems of _sir_problem() find in the cache.
    gs.register_field("sir", _sir, example=(
        jnp.zeros(3), {"beta": 0.0, "gamma": 0.0, "shift": jnp.zeros(2),
                       "mix": gs.Shared(jnp.zeros((3, 3)))}))
    yield
    from gradsolve.warp import _registry
    _registry.TRANSLATED.pop(_sir)


def test_registered_user_field_runs_fused_and_matches_general(sir_registered):
    # Same steps and the same integrated step to each output (interpolate=False on
    # both: the kernel's other way to serve ts), states componentwise to roundoff
    # (measured 1.8e-15; bound ~10x).
    prob = _sir_problem()
    ts = np.linspace(0.0, 10.0, 5)
    fused = gs.solve(prob, rtol=1e-8, atol=1e-10, ts=ts, interpolate=False)
    general = gs.solve(prob, rtol=1e-8, atol=1e-10, ts=ts, engine="general",
                       interpolate=False)
    assert not fused.interpolated and not general.interpolated
    assert fused.engine == "fused" and fused.ok
    np.testing.assert_array_equal(fused.n_accepted, general.n_accepted)
    assert rel_err_componentwise(fused.ys, general.ys) < 2e-14


def test_registered_user_field_gradients_equal_general_replay(sir_registered):
    # fused_replay replays the translated field's mesh in JAX: same gradient as on the
    # general recorder's mesh, the meshes agreeing up to roundoff (measured: value
    # 8.1e-16, gradients 7.3e-15 componentwise; bounds ~10x).
    prob = _sir_problem()
    loss = lambda ys, p: jnp.sum(ys[:, 1] ** 2)
    fused = gs.value_and_grad(prob, loss, rtol=1e-8, atol=1e-10)
    general = gs.value_and_grad(prob, loss, rtol=1e-8, atol=1e-10, engine="general_replay")
    assert fused.engine == "fused_replay"
    (v_f, g_f), (v_g, g_g) = fused(), general()
    assert rel_err(v_f, v_g) < 1e-14
    assert max(rel_err_componentwise(a, b) for a, b in
               zip(jax.tree.leaves(g_f), jax.tree.leaves(g_g))) < 8e-14


def test_registered_user_field_float32(sir_registered):
    # float32 on both sides at rtol 1e-5: the solves agree to float32 roundoff carried
    # through the solve (measured 1.8e-6; bound ~10x).
    prob = _sir_problem(dtype=jnp.float32)
    fused = gs.solve(prob, rtol=1e-5, atol=1e-7)
    general = gs.solve(prob, rtol=1e-5, atol=1e-7, engine="general")
    assert fused.engine == "fused" and fused.ys.dtype == jnp.float32
    assert rel_err(fused.ys, general.ys) < 2e-5


def _stiff_user(t, y, p):
    # A stiff autonomous field with a shared coupling matrix and a cubic term: the
    # translated Jacobian (jax.jacfwd) drives the fused Rosenbrock23.
    return p["k"] * (p["A"] @ y) - y ** 3


def test_stiff_user_field_translates_its_jacobian():
    # Same steps as the general engine, states componentwise to roundoff (measured
    # 8.9e-15; bound ~10x).
    rng = np.random.default_rng(5)
    Q, _ = np.linalg.qr(rng.normal(size=(4, 4)))
    A = Q @ np.diag([-1.0, -10.0, -100.0, -1000.0]) @ Q.T
    prob = gs.EnsembleProblem(_stiff_user, jnp.asarray(rng.normal(size=(5, 4))),
                              {"k": jnp.linspace(0.5, 1.5, 5), "A": gs.Shared(jnp.asarray(A))},
                              (0.0, 2.0), stiff=True, fused=True)
    fused = gs.solve(prob, rtol=1e-5, atol=1e-9)
    general = gs.solve(prob, rtol=1e-5, atol=1e-9, engine="general", method=fused.method)
    assert (fused.engine, fused.method) == ("fused", "rosenbrock23") and fused.ok
    np.testing.assert_array_equal(fused.n_accepted, general.n_accepted)
    assert rel_err_componentwise(fused.ys, general.ys) < 1e-13


def _sorted_field(t, y, p):
    return -p["k"] * jnp.sort(y)


def test_untranslatable_field_takes_the_general_path_and_says_why():
    prob = gs.EnsembleProblem(_sorted_field, jnp.ones((3, 2)), {"k": jnp.ones(3)},
                              (0.0, 1.0), fused=True)
    sol = gs.solve(prob)
    assert sol.engine != "fused"
    assert "'sort'" in dict(sol.passed_over)["fused"]
    with pytest.raises(ValueError, match="JAX primitive 'sort'"):
        gs.solve(prob, engine="fused")


def test_register_field_refuses_bad_input():
    with pytest.raises(TypeError, match="f_jax must be callable"):
        gs.register_field("x", 3)
    with pytest.raises(ValueError, match="hand-written"):
        gs.register_field("lorenz", gs.problems.lorenz().f_jax)


def test_translation_folds_constants_and_names_inputs():
    # The Jacobian of y -> 2 y is the constant 2 I: folded at translation, no
    # statement emitted; parameters read p[i, column] in pytree order.
    prob = gs.EnsembleProblem(lambda t, y, p: 2.0 * y + p["a"], jnp.ones((2, 2)),
                              {"a": jnp.ones((2, 2))}, (0.0, 1.0), stiff=True)
    source = _translate.translate(prob.f_jax, prob.params, prob.y0, stiff=True)
    jac = source.split("def jac")[1]
    assert "return M(T(2.0), T(0.0), T(0.0), T(2.0))" in jac
    assert "p[i, 0]" in source and "p[i, 1]" in source


def _many_primitives(t, y, p):
    # Comparisons and where, max/min/abs, sqrt/log/pow, integer powers (negative
    # too), division, sin/cos, jax.nn.sigmoid (a custom_jvp), sums and a dot.
    a, b, c = y
    k = p["k"]
    kink = jnp.where(a > 0.2, a - 0.2, 0.0)
    out0 = jnp.maximum(a, b) * jnp.minimum(b, c) + jnp.abs(c) ** 1.5 - kink
    out1 = jnp.sqrt(1.0 + a * a) * jnp.log(2.0 + b * b) / (1.0 + c ** 2) + b ** -2
    out2 = jnp.sin(k * a) * jnp.cos(t) + jax.nn.sigmoid(c) * jnp.sum(y) - p["w"] @ y
    return jnp.stack([out0, out1, out2])


def _evaluate(source, d, params, y, t):
    """The translated `field` and `jac` at the points (t[i], y[i]) with trajectory i's
    parameters, evaluated in a Warp kernel: `(f (n, d), J (n, d, d))`."""
    from gradsolve.warp import _kernels, _runtime
    wp = _runtime.warp()
    probe = _kernels.header(d, 64) + source + """

@wp.kernel(enable_backward=False)
def probe(y: wp.array2d(dtype=T), p: wp.array2d(dtype=T), s: wp.array(dtype=T),
          t: wp.array(dtype=T), f_out: wp.array2d(dtype=T), j_out: wp.array3d(dtype=T)):
    i = wp.tid()
    yy = V()
    for k in range(D):
        yy[k] = y[i, k]
    f = field(t[i], yy, p, s, i)
    J = jac(t[i], yy, p, s, i)
    for k in range(D):
        f_out[i, k] = f[k]
        for c in range(D):
            j_out[i, k, c] = J[k, c]
"""
    module = _runtime.load(probe)
    n = len(y)
    P, S = _translate.pack(params, n)
    dev = _runtime.device()
    arr = lambda x: wp.array(np.asarray(x, np.float64), dtype=wp.float64, device=dev)
    f_out = wp.zeros((n, d), dtype=wp.float64, device=dev)
    j_out = wp.zeros((n, d, d), dtype=wp.float64, device=dev)
    wp.launch(module.probe, dim=n, inputs=[arr(y), arr(P), arr(S), arr(t), f_out, j_out],
              device=dev)
    return f_out.numpy(), j_out.numpy()


def _jax_reference(f, params, y, t):
    """JAX's f and jax.jacfwd(f) at the same points, trajectory by trajectory."""
    shared = lambda x: isinstance(x, gs.Shared)
    one = lambda i: jax.tree.map(lambda x: x.value if shared(x) else x[i] if eqx.is_array(x) else x,
                                 params, is_leaf=shared)
    f_ref = np.stack([f(t[i], y[i], one(i)) for i in range(len(y))])
    j_ref = np.stack([jax.jacfwd(f, argnums=1)(t[i], y[i], one(i)) for i in range(len(y))])
    return f_ref, j_ref


def test_translated_field_and_jacobian_equal_jax_pointwise():
    # Evaluate the translated `field` and `jac` in a Warp kernel at random points and
    # compare with JAX's f and jax.jacfwd(f). Warp's libm and XLA's own
    # sqrt/log/sin/... may differ in the last bits (+ - * / agree exactly): measured on
    # the CPU 9.9e-18 (f) and 5.5e-19 (J) relative to the largest entry; the bound,
    # 1e-15, leaves a few ulps for CUDA's libm (within 2 ulp of correctly rounded).
    rng = np.random.default_rng(11)
    n = 16
    params = {"k": jnp.asarray(rng.uniform(0.5, 2.0, n)),
              "w": gs.Shared(jnp.asarray(rng.normal(size=3)))}
    y = jnp.asarray(rng.uniform(0.1, 1.0, (n, 3)) * rng.choice([-1, 1], (n, 3)))
    y = y.at[:, 1].set(jnp.abs(y[:, 1]) + 0.1)  # keep b ** -2 finite
    t = jnp.asarray(rng.uniform(0.0, 3.0, n))
    source = _translate.translate(_many_primitives, params, y, stiff=True)
    f_out, j_out = _evaluate(source, 3, params, y, t)
    f_ref, j_ref = _jax_reference(_many_primitives, params, y, t)
    assert rel_err(f_out, f_ref) < 1e-15
    assert rel_err(j_out, j_ref) < 1e-15


def _mlp_field(t, y, p):
    return p["net"](y) + p["own"](y) - y


def _mlp_params(width, n, key):
    """A Shared tanh MLP (weights in s[:]) and a per-trajectory linear layer (weights
    in p[i, :], built with eqx.filter_vmap): both kinds of parameter block."""
    k1, k2 = jax.random.split(key)
    net = eqx.nn.MLP(3, 3, width, 2, activation=jnp.tanh, key=k1)
    own = eqx.filter_vmap(lambda k: eqx.nn.Linear(3, 3, key=k))(jax.random.split(k2, n))
    return {"net": gs.Shared(net), "own": own}


def test_mlp_products_are_loops_over_the_parameter_arrays():
    # dot_general with a parameter block is a loop over p / s, not one statement per
    # weight: from width 16 to 32 the weights grow about 4x (16*16 -> 32*32 in the
    # middle layer) and the code 1.5x (measured: field 122 -> 186 lines, jac 560 ->
    # 944; unrolled, width 32 took 2526 and 10320 lines). The loops compute what JAX
    # does, the same products summed in the same order, so only tanh's libm differs
    # (measured 7.8e-17 (f) and 1.6e-16 (J) relative to the largest entry; bound 2e-15).
    n = 8
    rng = np.random.default_rng(3)
    y = jnp.asarray(rng.normal(size=(n, 3)))
    t = jnp.zeros(n)
    lines = {}
    for width in (16, 32):
        params = _mlp_params(width, n, jax.random.key(width))
        source = _translate.translate(_mlp_field, params, y, stiff=True)
        field, jac = source.split("def jac")
        lines[width] = (len(field.splitlines()), len(jac.splitlines()))
        assert "for r in range(" in field and "p[i, " in field and "s[" in field
    assert lines[32][0] < 2 * lines[16][0] and lines[32][1] < 2 * lines[16][1], lines
    f_out, j_out = _evaluate(source, 3, params, y, t)
    f_ref, j_ref = _jax_reference(_mlp_field, params, y, t)
    assert rel_err(f_out, f_ref) < 2e-15
    assert rel_err(j_out, j_ref) < 2e-15


def _cond_field(t, y, p):
    return jax.lax.cond(t < 1.0, lambda y: -p["k"] * y, lambda y: p["k"] * y, y)


def test_refusal_names_the_primitive_and_what_to_write_instead():
    prob = gs.EnsembleProblem(_cond_field, jnp.ones((2, 1)), {"k": jnp.ones(2)}, (0.0, 2.0))
    with pytest.raises(_translate.UntranslatableField,
                       match=r"JAX primitive 'cond'.*jnp\.where"):
        _translate.translate(prob.f_jax, prob.params, prob.y0, stiff=False)


def test_register_field_with_an_example_refuses_at_registration():
    # An explicit registration of a field that cannot be translated raises there, not
    # at the first solve; nothing stays registered.
    from gradsolve.warp import _registry
    prob = gs.EnsembleProblem(_cond_field, jnp.ones((2, 1)), {"k": jnp.ones(2)}, (0.0, 2.0))
    with pytest.raises(ValueError, match=r"'cond'.*jnp\.where"):
        gs.register_field("cond", _cond_field, example=prob)
    assert _cond_field not in _registry.TRANSLATED
    with pytest.raises(ValueError, match="example: expected an EnsembleProblem whose f_jax"):
        gs.register_field("sir", _sir, example=prob)


def test_register_field_translates_at_registration_without_a_problem():
    # Registration translates at once whatever the caller has: from one trajectory's
    # (y0, params) as well as from a problem, so a refused field raises there, naming
    # the field and the primitive, and nothing stays registered; with nothing to
    # trace at, registration is refused rather than silent. (Before: without a
    # problem, registration passed and the refusal came at the first solve.)
    from gradsolve.warp import _registry
    with pytest.raises(_translate.UntranslatableField,
                       match=r"'cond' has no fused form: the JAX primitive 'cond'.*jnp\.where"):
        gs.register_field("cond", _cond_field, example=(jnp.ones(1), {"k": 1.0}))
    assert _cond_field not in _registry.TRANSLATED
    with pytest.raises(TypeError, match=r"register_field\('cond'\): example= is required"):
        gs.register_field("cond", _cond_field)
    assert _cond_field not in _registry.TRANSLATED
    with pytest.raises(ValueError, match=r"register_field\('cond'\): example's y0 .* "
                                         r"shape \(d,\), got \(2, 1\)"):
        gs.register_field("cond", _cond_field, example=(jnp.ones((2, 1)), {"k": 1.0}))


def test_registered_field_that_fails_later_warns_once_and_solves(monkeypatch):
    # Registered at other shapes, a refusal at these is found at the first routing: a
    # warning names it, the solve takes the general path (correct against the closed
    # form y0 exp(-k t) on t < 1, then exp(k (t - 1)); measured 1.2e-9 componentwise at
    # rtol 1e-8, bound ~10x), a second solve of the same shape does not warn again.
    from gradsolve.warp import _registry
    field = lambda t, y, p: _cond_field(t, y, p)  # a new function object
    monkeypatch.setitem(_registry.TRANSLATED, field, ("cond", False))
    prob = gs.EnsembleProblem(field, jnp.ones((2, 1)), {"k": jnp.asarray([0.5, 1.0])},
                              (0.0, 0.5))
    with pytest.warns(UserWarning, match=r"register_field\('cond'\).*'cond'.*general"):
        sol = gs.solve(prob, rtol=1e-8, atol=1e-10)
    assert sol.engine != "fused" and sol.ok
    exact = np.exp(-0.5 * np.asarray(prob.params["k"]))[:, None]
    assert rel_err_componentwise(sol.ys, exact) < 1.5e-8
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gs.solve(prob, rtol=1e-8, atol=1e-10)


def _sign_field(t, y, p):
    # y > 0 throughout: y' = -k y^2, y = y0 / (1 + k y0 t).
    return -p["k"] * jnp.sign(y) * y ** 2


# Integer bitwise ops on an integer parameter `flags` in {0, 1}, one per field.
_BITWISE = {"and": lambda flags: flags & 1, "or": lambda flags: (flags | 2) - 2,
            "not": lambda flags: ~flags & 1}


def _flag_factor(flags, op):
    return 1.0 + _BITWISE[op](flags).astype(jnp.float64)


def _bitwise_field(op):
    return lambda t, y, p: -p["k"] * _flag_factor(p["flags"], op) * y


def _refused_problem(kind):
    if kind == "sign":
        return gs.EnsembleProblem(_sign_field, jnp.asarray([[1.0], [2.0]]),
                                  {"k": jnp.asarray([0.5, 1.5])}, (0.0, 1.0), fused=True)
    return gs.EnsembleProblem(_bitwise_field(kind), jnp.asarray([[1.0], [2.0]]),
                              {"k": jnp.asarray([0.5, 1.5]), "flags": jnp.asarray([0, 1])},
                              (0.0, 1.0), fused=True)


def _exact(kind, prob):
    y0, k = np.asarray(prob.y0[:, 0]), np.asarray(prob.params["k"])
    if kind == "sign":
        return (y0 / (1 + k * y0))[:, None]
    factor = 1.0 + _BITWISE[kind](np.asarray(prob.params["flags"]))
    return (y0 * np.exp(-k * factor))[:, None]


@pytest.mark.parametrize("kind", ["sign", "and", "or", "not"])
def test_sign_and_integer_bitwise_ops_are_refused_naming_the_primitive(kind):
    # Warp's sign(0) is not JAX's, and Warp's and/or/not are logical, not bitwise: the
    # translator refuses them by name rather than emit a different function.
    prob = _refused_problem(kind)
    with pytest.raises(_translate.UntranslatableField, match=f"JAX primitive '{kind}'"):
        _translate.translate(prob.f_jax, prob.params, prob.y0, stiff=False)


@pytest.mark.parametrize("kind,bound", [("sign", 3e-7), ("and", 3e-8)])
def test_refused_field_takes_the_general_path_with_the_reason(kind, bound):
    # The refusal reaches the router: fused=True is passed over with the reason, the
    # solve runs elsewhere and is correct against the closed form (at rtol 1e-8,
    # componentwise, measured 3.2e-8 for sign, 2.9e-9 for and; bounds ~10x); forcing
    # the fused engine names the primitive.
    prob = _refused_problem(kind)
    sol = gs.solve(prob, rtol=1e-8, atol=1e-10)
    assert sol.engine != "fused" and sol.ok
    assert f"JAX primitive '{kind}'" in dict(sol.passed_over)["fused"]
    assert rel_err_componentwise(sol.ys, _exact(kind, prob)) < bound
    with pytest.raises(ValueError, match=f"JAX primitive '{kind}'"):
        gs.solve(prob, engine="fused")


def test_translator_failure_of_any_kind_takes_the_general_path(monkeypatch):
    # Not a refusal but a translator bug (any exception): the request still reaches an
    # engine, passed_over says what failed, and the solve is correct against the
    # closed form (measured 1.4e-9 componentwise at rtol 1e-8; bound ~10x).
    def broken(*args, **kwargs):
        raise IndexError("a translator bug")
    monkeypatch.setattr(_translate, "translate", broken)
    field = lambda t, y, p: -p["k"] * y  # a new function: no cached translation
    prob = gs.EnsembleProblem(field, jnp.asarray([[1.0], [2.0]]), {"k": jnp.asarray([0.5, 1.5])},
                              (0.0, 1.0), fused=True)
    sol = gs.solve(prob, rtol=1e-8, atol=1e-10)
    assert sol.engine != "fused" and sol.ok
    assert "the translator failed (IndexError: a translator bug)" in dict(sol.passed_over)["fused"]
    exact = np.asarray(prob.y0) * np.exp(-np.asarray(prob.params["k"]))[:, None]
    assert rel_err_componentwise(sol.ys, exact) < 1.5e-8
