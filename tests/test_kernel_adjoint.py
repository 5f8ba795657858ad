"""The in-kernel adjoint (`engine="kernel_adjoint"`): Warp forward over the recorded
mesh, Warp backward, against the JAX replay on the same mesh (which shares no code
with the kernels but the tableau), central differences on the same mesh, float32
against float64, and bit-for-bit reproducibility."""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import gradsolve as gs
from helpers import rel_err, tree_rel_err


TS = jnp.array([0.3, 0.55, 0.8])  # scaled into each problem's span


def _loss(ys, params):
    # A cotangent that differs per entry (a plain sum of squares would weight all
    # components alike).
    w = jnp.linspace(0.5, 1.5, ys.size).reshape(ys.shape)
    return jnp.sum(w * ys ** 2) + jnp.sum(jnp.sin(ys))


# The seven registered fields on spans short enough for Tsit5 (the only method the
# in-kernel adjoint runs) on the stiff ones.
REGISTERED = [
    ("lorenz", {}),
    ("van_der_pol", {}),
    ("lorenz96", {"d": 6}),
    ("linear", {"d": 4}),
    ("robertson", {"t_span": (0.0, 0.1)}),
    ("hires", {"t_span": (0.0, 1.0)}),
    ("linear_stiff", {"d": 5, "t_span": (0.0, 2e-3)}),
]


def _inexact(tree):
    return eqx.filter(tree, eqx.is_inexact_array)


def _same_mesh_pair(prob, ts, rtol=1e-6, method="tsit5", interpolate=None):
    """`(kernel_adjoint, general_replay)` value-and-grads on one (fused) mesh, their
    outputs served the same way: `interpolate` as given, the default resolving to
    Tsit5's and Vern7's continuous extensions and to Rosenbrock23's integrated step on
    both."""
    ka = gs.value_and_grad(prob, _loss, wrt="both", engine="kernel_adjoint", ts=ts,
                           method=method, rtol=rtol, atol=1e-9, interpolate=interpolate)
    ref = gs.value_and_grad(prob, _loss, wrt="both", engine="general_replay", ts=ts,
                            method=method, mesh=ka.mesh, interpolate=interpolate)
    want = ts is not None and interpolate is not False and method != "rosenbrock23"
    assert ka.config.interpolate == ref.config.interpolate == want
    return ka, ref


@pytest.mark.parametrize("name,kw", REGISTERED)
def test_registered_fields_equal_the_jax_replay_on_the_same_mesh(name, kw):
    # Same mesh, same arithmetic up to the order of operations (XLA contracts
    # multiply-adds, Warp does not): values and gradients agree to roundoff carried
    # through the 8-77 steps (measured at most, relative: value 2.1e-15, bound 2e-14;
    # parameter gradients 5.8e-14, bound 6e-13; y0 gradients 2.3e-13, lorenz96, bound
    # 3e-12), without ts, and with ts on four of them (the kernels are the same
    # for every field; what ts adds is the outputs and their cotangents: a 2-D, a 6-D,
    # a stiff 3-D and a stiff 5-D field, to keep a fresh clone's tests in budget), from
    # Tsit5's continuous extension (the default) on the first two and by an
    # integrated step on the others.
    prob = getattr(gs.problems, name)(n=6, **kw)
    t0, t1 = prob.t_span
    with_ts = name in ("van_der_pol", "lorenz96", "robertson", "linear_stiff")
    interpolate = False if name in ("robertson", "linear_stiff") else None
    for ts in (None, t0 + TS * (t1 - t0)) if with_ts else (None,):
        ka, ref = _same_mesh_pair(prob, ts, interpolate=interpolate)
        assert ka.engine == "kernel_adjoint" and ka.mesh.recorder == "fused" and ka.mesh.ok
        (v, (gp, gy)), (v_ref, (gp_ref, gy_ref)) = ka(), ref()
        assert rel_err(v, v_ref) < 2e-14
        assert len(jax.tree.leaves(_inexact(gp))) == len(jax.tree.leaves(_inexact(gp_ref)))
        if name != "hires":  # hires has no parameters
            assert tree_rel_err(_inexact(gp), _inexact(gp_ref)) < 6e-13, name
        assert rel_err(gy, gy_ref) < 3e-12, name


def test_vern7_adjoint_equals_the_jax_replay_on_the_same_mesh():
    # Vern7's kernels are generated from the same tableau object as its JAX step (one
    # emitter for every explicit tableau), so one field checks what Vern7 adds: its
    # ten stages and their adjoint, and outputs from its continuous extension, whose
    # six extra stages (and their adjoint) run only in steps holding outputs; seven
    # outputs over 37-49 steps, so some steps hold two. Measured, relative: value
    # 3.1e-16, bound 1e-14; parameter gradients 1.4e-13, y0 gradients 1.1e-13,
    # bounds 1e-12.
    prob = gs.problems.lorenz(n=6)
    ka, ref = _same_mesh_pair(prob, np.linspace(0.05, 0.95, 7), rtol=1e-8, method="vern7")
    assert ka.engine == "kernel_adjoint" and ka.mesh.method == "vern7" and ka.mesh.ok
    assert ka.mesh.recorder == "fused"
    (v, (gp, gy)), (v_ref, (gp_ref, gy_ref)) = ka(), ref()
    assert rel_err(v, v_ref) < 1e-14
    assert tree_rel_err(_inexact(gp), _inexact(gp_ref)) < 1e-12
    assert rel_err(gy, gy_ref) < 1e-12


# The stiff registered fields with Rosenbrock23, on spans of 100-350 steps.
STIFF = [("robertson", {"t_span": (0.0, 10.0)}), ("hires", {"t_span": (0.0, 20.0)}),
         ("linear_stiff", {"d": 5})]


@pytest.mark.parametrize("name,kw", STIFF)
def test_rosenbrock23_adjoint_equals_the_jax_replay_on_the_same_mesh(name, kw):
    # The Warp step adjoint (products with the transposed inverse of W, the Jacobian's
    # own VJP) against jax.grad of the JAX step (LU solves) on the same mesh: measured
    # at most, relative (linear_stiff): value 1.1e-13, bound 1e-12; parameter gradients
    # 4.3e-14, bound 5e-13; y0 gradients 3.1e-14, bound 3e-13.
    prob = getattr(gs.problems, name)(n=6, **kw)
    t0, t1 = prob.t_span
    for ts in (None, t0 + TS * (t1 - t0)):
        ka, ref = _same_mesh_pair(prob, ts, rtol=1e-5, method="rosenbrock23")
        assert ka.mesh.method == "rosenbrock23" and ka.mesh.ok
        (v, (gp, gy)), (v_ref, (gp_ref, gy_ref)) = ka(), ref()
        assert rel_err(v, v_ref) < 1e-12
        if name != "hires":  # hires has no parameters
            assert tree_rel_err(_inexact(gp), _inexact(gp_ref)) < 5e-13, name
        assert rel_err(gy, gy_ref) < 3e-13, name


def _field(t, y, p):
    # A user field (not registered) with an Equinox MLP in gs.Shared and a parameter of
    # every trajectory: both kinds of parameter block in the kernels.
    return p["net"](y) - p["k"] * y


@pytest.fixture(scope="module")
def neural():
    n = 8
    net = eqx.nn.MLP(2, 2, 16, 2, activation=jax.nn.softplus, key=jax.random.key(0))
    y0 = jnp.stack([jnp.linspace(0.5, 1.5, n), jnp.linspace(-1.0, 1.0, n)], axis=1)
    return gs.EnsembleProblem(_field, y0, {"net": gs.Shared(net), "k": jnp.linspace(0.5, 1.5, n)},
                              (0.0, 2.0), fused=True, name="neural")


@pytest.fixture(scope="module")
def neural_pair(neural):
    return _same_mesh_pair(neural, TS * 2.0)


@pytest.mark.parametrize("wrt", ["params", "y0", "both"])
def test_mlp_field_every_weight_equals_the_jax_replay(neural, neural_pair, wrt):
    # Every MLP weight and bias (Shared: summed over the trajectories), k, and y0, the
    # outputs from Tsit5's continuous extension (the default) on both sides: measured
    # at most 3.9e-15 relative (wrt="both" and "y0"; 2.7e-15 with integrated outputs);
    # bound 3e-14.
    ka, ref = neural_pair  # wrt="both"
    assert ka.mesh.ok
    if wrt != "both":
        ka = gs.value_and_grad(neural, _loss, wrt=wrt, engine="kernel_adjoint", ts=TS * 2.0,
                               mesh=ka.mesh)
        ref = gs.value_and_grad(neural, _loss, wrt=wrt, engine="general_replay", ts=TS * 2.0,
                                mesh=ka.mesh)
    (_, g), (_, g_ref) = ka(), ref()
    assert tree_rel_err(_inexact(g), _inexact(g_ref)) < 3e-14
    weights = jax.tree.leaves(_inexact(g if wrt == "params" else g[0] if wrt == "both" else {}))
    assert wrt == "y0" or len(weights) == 7  # 3 weights, 3 biases, k


def test_mlp_gradient_equals_central_differences_on_the_same_mesh(neural, neural_pair):
    # Central differences of the kernel's own value on the same mesh (outputs from the
    # continuous extension): truncation O(eps^2) ~ 1e-12, roundoff ~1e-16 / eps ~ 1e-10
    # of the value (measured 1.3e-10 to 8.7e-9 relative to the entry, the largest for
    # the smallest entry; 3.9e-10 to 2.5e-8 with integrated outputs); bound 3e-7.
    ka, _ = neural_pair
    _, (g, _) = ka()
    eps = 1e-6
    for where, entry in [(lambda p: p["net"].value.layers[1].weight, (3, 5)),
                         (lambda p: p["net"].value.layers[0].bias, (2,)),
                         (lambda p: p["k"], (4,))]:
        base = where(neural.params)
        up, dn = (eqx.tree_at(where, neural.params, base.at[entry].add(s)) for s in (eps, -eps))
        fd = (ka(params=up)[0] - ka(params=dn)[0]) / (2 * eps)
        assert rel_err(where(g)[entry], fd) < 3e-7, entry


def test_float32_within_1e4_of_float64():
    # The same field in float32 on its own (float32) mesh: the two meshes differ by
    # roundoff in the controller, the gradients by float32's ~1e-7 carried through 51
    # steps (measured 2.0e-5 relative); bound 1e-4 as the design asks.
    p64 = gs.problems.lorenz(n=4)
    p32 = gs.problems.lorenz(n=4, dtype=jnp.float32)
    g64 = gs.value_and_grad(p64, _loss, engine="kernel_adjoint")()[1]
    vg32 = gs.value_and_grad(p32, _loss, engine="kernel_adjoint")
    _, g32 = vg32()
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(g32))
    assert tree_rel_err(g32, g64) < 1e-4


def test_extension_outputs_at_the_edges_and_failed_rows_equal_the_jax_replay():
    # Tsit5's continuous extension in the kernels (the default for ts), against the
    # JAX replay's on one mesh where max_steps = 45 fails some trajectories (masked:
    # zero outputs, zero gradients): outputs at t0, twice at one time, at a mesh point
    # (theta = 0), inside steps and at t1 (the end state). Measured relative: outputs
    # 1.1e-15, value 5.6e-16, gradients 1.9e-15; bound 1e-13, roundoff carried over
    # the 37 steps with room for other machines' orders of operations.
    prob = gs.problems.lorenz(n=4)
    mesh = gs.record(prob, rtol=1e-6, atol=1e-9, max_steps=45, recorder="fused")
    failed = np.asarray(mesh.status) != 0
    assert failed.any() and not failed.all()
    ok_row = int(np.flatnonzero(~failed)[0])
    t_mesh = float(mesh.t0 + np.cumsum(np.asarray(mesh.h[ok_row]))[4])
    ts = jnp.sort(jnp.array([0.0, 0.0, 0.2, 0.2, t_mesh, 0.7, 1.0]))
    kw = dict(ts=ts, mesh=mesh, wrt="both", on_failure="mask")
    ka = gs.value_and_grad(prob, _loss, engine="kernel_adjoint", **kw)
    ref = gs.value_and_grad(prob, _loss, engine="general_replay", **kw)
    assert ka.config.interpolate and ref.config.interpolate
    ys_ka = gs.replay(prob, mesh, ts=ts, engine="kernel_adjoint")
    ys_ref = gs.replay(prob, mesh, ts=ts)
    assert rel_err(ys_ka[~failed], ys_ref[~failed]) < 1e-13
    np.testing.assert_array_equal(ys_ka[:, 0][~failed], prob.y0[~failed])
    (v, (gp, gy)), (v_ref, (gp_ref, gy_ref)) = ka(), ref()
    assert rel_err(v, v_ref) < 1e-13
    assert tree_rel_err(gp, gp_ref) < 1e-13 and rel_err(gy, gy_ref) < 1e-13
    assert np.all(np.asarray(gy)[failed] == 0)


def test_bit_identical_across_runs_and_thread_counts(neural, neural_pair, monkeypatch):
    # Each trajectory's rows depend on nothing else, and the Shared gradient is their
    # sum in trajectory order: the same bits from one thread or two, run after run.
    ka, _ = neural_pair
    first = ka()
    monkeypatch.setenv("GRADSOLVE_CPU_THREADS", "1")
    one = ka()
    monkeypatch.setenv("GRADSOLVE_CPU_THREADS", "2")
    two = ka()
    for other in (one, two, ka()):
        for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(other)):
            np.testing.assert_array_equal(a, b)


def test_ffi_and_pure_callback_bridges_give_the_same_bits(neural, neural_pair, monkeypatch):
    # On the CPU the kernels are called through XLA's FFI (in place on XLA's buffers);
    # a GPU takes jax.pure_callback. Both run the same host functions on the same
    # inputs: the same bits, and the trace says which bridge it used. Through the FFI
    # the forward kernel writes the stored states straight into XLA's output buffers
    # (once: neural Robertson, B = 128, 407 steps, measured host allocations during a
    # gradient 1.72 MB before, 0.07 MB after, XLA's temporaries 2.10 MB either way);
    # through the callback it allocates them and the bridge copies them: the same
    # bits either way.
    from gradsolve.warp import _adjoint, _jax
    ka, _ = neural_pair
    into, forward = [], _adjoint.forward

    def spy(*args, **kw):
        into.append(kw.get("into") is not None)
        return forward(*args, **kw)
    monkeypatch.setattr(_adjoint, "forward", spy)
    traced = lambda vg: str(eqx.filter_make_jaxpr(vg._call)(vg.mesh, neural.params, neural.y0)[0])
    assert "ffi_call" in traced(ka) and "pure_callback" not in traced(ka)
    by_ffi = ka()
    assert into == [True], into
    monkeypatch.setattr(_jax, "default_bridge", lambda: "callback")
    cb = gs.value_and_grad(neural, _loss, wrt="both", engine="kernel_adjoint", ts=TS * 2.0,
                           mesh=ka.mesh)
    assert "pure_callback" in traced(cb) and "ffi_call" not in traced(cb)
    by_callback = cb()
    assert into == [True, False], into
    for a, b in zip(jax.tree.leaves(by_ffi), jax.tree.leaves(by_callback)):
        np.testing.assert_array_equal(a, b)


def test_one_field_at_two_ensemble_sizes_keeps_its_own_host_calls():
    # The same kernels at n = 4 and n = 6 (the Calibrator's profile does this): each
    # compiled gradient finds its own host calls. (Keyed by the kernels alone, the
    # n = 4 gradient called after the n = 6 one was traced failed to reshape.)
    a = gs.value_and_grad(gs.problems.lorenz(n=4, t_span=(0.0, 0.05)), _loss,
                          engine="kernel_adjoint")
    first = a()
    gs.value_and_grad(gs.problems.lorenz(n=6, t_span=(0.0, 0.05)), _loss,
                      engine="kernel_adjoint")()
    for x, y in zip(jax.tree.leaves(first), jax.tree.leaves(a())):
        np.testing.assert_array_equal(x, y)


def test_vmap_of_the_replay_gradient_is_one_call_per_element(neural, neural_pair):
    # Under vmap each host call runs once per batch element (vmap_method
    # "sequential"): the batched gradients are the unbatched ones, bit for bit.
    ka, _ = neural_pair

    def grad_k(scale):
        p = dict(neural.params, k=neural.params["k"] * scale)
        return jax.grad(lambda k: jnp.sum(gs.replay(
            neural, ka.mesh, params=dict(p, k=k), engine="kernel_adjoint") ** 2))(p["k"])
    scales = jnp.array([1.0, 1.5])
    batched = eqx.filter_jit(jax.vmap(grad_k))(scales)
    for row, scale in zip(batched, scales):
        np.testing.assert_array_equal(row, eqx.filter_jit(grad_k)(scale))


def test_jit_grad_through_gs_replay_with_the_kernel_adjoint(neural, neural_pair):
    # gs.replay(engine="kernel_adjoint") is a custom_vjp over host calls: jit of
    # grad composes with it (Equinox's filtered versions: the parameters hold an MLP),
    # and gives what the ValueAndGrad gives: the same kernels, fed the loss's cotangent
    # from another XLA compilation (measured 1.1e-15 relative; bound 1e-14).
    ka, _ = neural_pair
    ts = TS * 2.0

    def loss(p, y0):
        return _loss(gs.replay(neural, ka.mesh, params=p, y0=y0, ts=ts,
                               engine="kernel_adjoint"), p)
    g = eqx.filter_jit(eqx.filter_grad(lambda x: loss(*x)))((neural.params, neural.y0))
    _, g_ka = ka()
    assert tree_rel_err(_inexact(g), _inexact(g_ka)) < 1e-14
    with pytest.raises(ValueError, match="takes no remat"):
        gs.replay(neural, ka.mesh, engine="kernel_adjoint", remat=True)


def _rho_fit(engine, **kw):
    """B = 2 Lorenz rho fits of K = 2 trajectories each: `(calibrator, theta0)`."""
    B, K = 2, 2
    prob = gs.problems.lorenz(n=B * K)
    data = gs.solve(prob, rtol=1e-10, atol=1e-12).ys.reshape(B, K, 3)

    def to_params(theta):
        return {"sigma": jnp.full(K, 10.0), "rho": jnp.full(K, theta["rho"]),
                "beta": jnp.full(K, 8.0 / 3.0)}

    def loss(ys, theta, obs):
        return jnp.mean((ys - obs) ** 2)

    cal = gs.Calibrator(prob, loss, to_params=to_params, data=data, optimizer=optax.adam(0.3),
                        refresh_every=20, engine=engine, **kw)
    return cal, {"rho": jnp.full(B, 15.0)}


def test_calibrator_on_the_kernel_adjoint_fits_as_on_the_jax_replay():
    # The Calibrator takes engine="kernel_adjoint": 60 Adam updates with a mesh
    # refresh every 20 end where the same fit on fused_replay ends -- the gradients
    # agree to roundoff each update, which Adam carries (it amplifies roundoff where a
    # gradient component crosses zero): measured 2.1e-14 relative in rho after 60
    # updates; bound 2e-13.
    fits = {}
    for engine in ("kernel_adjoint", "fused_replay"):
        cal, theta0 = _rho_fit(engine)
        res = cal.fit(theta0, steps=60, progress=False)
        assert res.engine == engine and res.updates == 60
        fits[engine] = np.asarray(res.theta["rho"])
    assert rel_err(fits["kernel_adjoint"], fits["fused_replay"]) < 2e-13


def test_ctrl_c_inside_the_kernels_saves_and_resumes(tmp_path, monkeypatch, capsys):
    # A Ctrl-C that lands while the Warp kernels run inside a host callback reaches
    # the Calibrator wrapped by XLA (a JaxRuntimeError). It is still an interrupt: the
    # work is saved, the message says how to resume, KeyboardInterrupt is raised; the
    # resumed fit ends bit for bit where an uninterrupted one does. (Found by a
    # new-user script: the wrapped interrupt lost the message and the last updates.)
    # The interrupt lands in update 8; the fit keeps what the last completed call of its
    # compiled update loop left (calls end at every save, so updates 5 to 7).
    from gradsolve.warp import _adjoint
    real, calls = _adjoint.backward, []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 8:
            raise KeyboardInterrupt
        return real(*args, **kwargs)
    monkeypatch.setattr(_adjoint, "backward", interrupted)
    cal, theta0 = _rho_fit("kernel_adjoint", checkpoint_dir=tmp_path / "fit",
                           checkpoint_every=5)
    with pytest.raises(KeyboardInterrupt):
        cal.fit(theta0, steps=30, progress=False)
    said = re.search(r"fit interrupted after (\d+) updates; saved as step (\d+)",
                     capsys.readouterr().err)
    assert said and said[1] == said[2] and 5 <= int(said[1]) <= 7, said
    monkeypatch.setattr(_adjoint, "backward", real)
    resumed = _rho_fit("kernel_adjoint", checkpoint_dir=tmp_path / "fit",
                       checkpoint_every=5)[0].fit(theta0, steps=30, progress=False)
    assert resumed.resumed_from == int(said[1])
    straight = _rho_fit("kernel_adjoint")[0].fit(theta0, steps=30, progress=False)
    np.testing.assert_array_equal(resumed.theta["rho"], straight.theta["rho"])


def _erf_field(t, y, p):
    return p["net"](y) - y


def test_untranslatable_activation_is_refused_by_name_and_the_request_falls_back():
    # jax.nn.gelu(approximate=False) uses erf, which the translator has no rule for:
    # the Warp engines refuse it by name, and the routed gradient takes the JAX replay.
    net = eqx.nn.MLP(2, 2, 4, 1, activation=lambda x: jax.nn.gelu(x, approximate=False),
                     key=jax.random.key(1))
    prob = gs.EnsembleProblem(_erf_field, jnp.ones((2, 2)), {"net": gs.Shared(net)},
                              (0.0, 0.5), fused=True)
    with pytest.raises(ValueError, match="kernel_adjoint.*JAX primitive 'erf"):
        gs.value_and_grad(prob, _loss, engine="kernel_adjoint")
    vg = gs.value_and_grad(prob, _loss)
    assert vg.engine == "general_replay"
    assert "JAX primitive 'erf" in dict(vg.passed_over)["fused_replay"]


def test_forward_mode_and_other_methods_are_refused_with_the_reason():
    prob = gs.problems.lorenz(n=2)
    with pytest.raises(ValueError, match="reverse mode only"):
        gs.value_and_grad(prob, _loss, engine="kernel_adjoint", mode="forward")
    with pytest.raises(ValueError,
                       match="runs \\('rosenbrock23', 'tsit5', 'vern7'\\), not 'rodas5p'"):
        gs.value_and_grad(prob, _loss, engine="kernel_adjoint", method="rodas5p")


def _routed(prob, **kw):
    """`(engine name, passed_over)` of the router's choice for a gradient of `prob`:
    what `gs.value_and_grad` asks before it records (recording the ensembles below to
    read the choice was most of these tests' time: n = 1024 MLP trajectories)."""
    from gradsolve import router
    kw = dict(dict(rtol=1e-6, atol=1e-9), **kw)  # gs.value_and_grad's defaults
    engine, passed, _ = router.plan(prob, gradient=True, **kw)
    return engine.name, passed


def test_router_policy_and_problem_check(monkeypatch):
    # From kernel_adjoint.MIN_N trajectories on the CPU the router prefers the
    # in-kernel adjoint; below it (one fewer decides it), it keeps the JAX replay and
    # says why. A field whose VJP does not translate (here the VJP translator made to
    # refuse, as for a primitive without a rule) is passed over with the reason;
    # named, it raises.
    from gradsolve.engines import kernel_adjoint
    from gradsolve.warp import _translate
    limit = kernel_adjoint.MIN_N["cpu"]["tsit5"]
    assert _routed(gs.problems.lorenz(n=limit))[0] == "kernel_adjoint"
    engine, passed = _routed(gs.problems.lorenz(n=limit - 1))
    assert engine == "fused_replay"
    assert f"n = {limit - 1} < {limit}" in passed["kernel_adjoint"]
    small = gs.value_and_grad(gs.problems.lorenz(n=4), _loss)  # the same, end to end
    assert small.engine == "fused_replay"
    assert f"n = 4 < {limit}" in dict(small.passed_over)["kernel_adjoint"]

    def refuse(*args, **kwargs):
        raise _translate.UntranslatableField("the JAX primitive 'sign' has no Warp translation")
    monkeypatch.setattr(_translate, "translate_vjp", refuse)
    field = lambda t, y, p: -p["k"] * y  # a new function: nothing cached
    prob = gs.EnsembleProblem(field, jnp.ones((limit, 1)), {"k": jnp.ones(limit)},
                              (0.0, 0.1), fused=True)
    engine, passed = _routed(prob)
    assert engine == "fused_replay"
    assert passed["kernel_adjoint"] == (
        "the field's VJP has no Warp form: the JAX primitive 'sign' has no Warp translation")
    with pytest.raises(ValueError, match="'kernel_adjoint' cannot serve this problem.*'sign'"):
        gs.value_and_grad(prob, _loss, engine="kernel_adjoint")


def test_router_keeps_mlp_fields_on_the_jax_replay_on_the_cpu(neural):
    # At n = 1024 >= MIN_N, so the Equinox module alone decides.
    many = neural.replace(y0=jnp.tile(neural.y0, (128, 1)),
                          params={"net": neural.params["net"], "k": jnp.tile(neural.params["k"], 128)})
    engine, passed = _routed(many, rtol=1e-3, atol=1e-6)
    assert engine == "fused_replay"
    assert "Equinox module" in passed["kernel_adjoint"]
