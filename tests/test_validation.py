"""Bad input gets a clear error naming the field, before anything compiles."""

import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import gradsolve as gs
from gradsolve import layout
from gradsolve.calibrate import _validate


def f(t, y, p):
    return -p["k"] * y


def make(**changes):
    fields = dict(f_jax=f, y0=jnp.ones((4, 2)), params={"k": jnp.ones(4)}, t_span=(0.0, 1.0))
    fields.update(changes)
    return gs.EnsembleProblem(**fields)


@pytest.mark.parametrize("changes,error,match", [
    (dict(y0=jnp.ones(4)), ValueError, r"y0 must have shape \(n, d\)"),
    (dict(y0=jnp.ones((4, 2, 1))), ValueError, r"y0 must have shape \(n, d\)"),
    (dict(y0=jnp.ones((4, 2), jnp.int32)), TypeError, "y0 must be floating point"),
    (dict(y0=jnp.ones((4, 2)).at[2, 1].set(jnp.nan)), ValueError, r"non-finite .* \[2\]"),
    (dict(t_span=(1.0, 1.0)), ValueError, "t1 > t0"),
    (dict(t_span=(1.0, 0.0)), ValueError, "t1 > t0"),
    (dict(t_span=(0.0, np.inf)), ValueError, "t_span must be finite"),
    (dict(t_span="ab"), TypeError, "t_span must be a pair"),
    (dict(f_jax="not a function"), TypeError, "f_jax must be callable"),
    (dict(params={"k": jnp.ones(3)}), ValueError, r"params\['k'\] has shape \(3,\).*n=4"),
    (dict(params={"k": jnp.ones(4).at[0].set(jnp.nan)}), ValueError, r"params\['k'\] holds non-finite"),
    (dict(f_jax=lambda t, y, p: jnp.sum(y)), ValueError, r"f_jax must return dy/dt of shape \(2,\)"),
    (dict(f_jax=lambda t, y, p: y @ jnp.ones((3, 3))), TypeError, "f_jax.*failed on one trajectory"),
    (dict(stiff="yes"), TypeError, "stiff must be a bool"),
    # The dtype rule: refused, naming both dtypes, not promoted (problem._check_dtypes).
    (dict(y0=jnp.ones((4, 2), jnp.float32)), TypeError,
     r"params\['k'\] has dtype float64 but y0 has float32"),
    (dict(params={"k": jnp.ones(4, jnp.float32)}), TypeError,
     r"params\['k'\] has dtype float32 but y0 has float64"),
    (dict(params={"k": gs.Shared(jnp.ones((), jnp.float32))}), TypeError,
     r"params\['k'\] has dtype float32 but y0 has float64"),
    (dict(f_jax=lambda t, y, p: jnp.ones(2, jnp.int32)), TypeError,
     "f_jax must return dy/dt of y0's dtype float64, got int32"),
    (dict(f_jax=lambda t, y, p: y * (1 + 1j)), TypeError,
     "f_jax must return dy/dt of y0's dtype float64, got complex128"),
])
def test_bad_problem_is_refused(changes, error, match):
    with pytest.raises(error, match=match):
        make(**changes)


def test_t_span_of_jax_scalars_is_stored_as_floats():
    # t_span is static (compiled solves are keyed on it): JAX scalars, unhashable,
    # used to pass validation and fail inside the first solve.
    prob = make(t_span=(jnp.asarray(0.0), jnp.asarray(1.0)))
    assert prob.t_span == (0.0, 1.0) and all(type(t) is float for t in prob.t_span)
    ref = make()
    np.testing.assert_array_equal(gs.solve(prob, engine="general").ys,
                                  gs.solve(ref, engine="general").ys)
    loss = lambda ys, p: jnp.sum(ys)
    assert gs.value_and_grad(prob, loss)()[0] == gs.value_and_grad(ref, loss)()[0]


def test_duck_typed_problem_is_validated_too():
    ok = types.SimpleNamespace(name="duck", f_jax=f, y0=jnp.ones((4, 2)),
                               params={"k": jnp.ones(4)}, t_span=(0.0, 1.0), stiff=False)
    assert gs.solve(ok, engine="general").ys.shape == (4, 2)
    bad = types.SimpleNamespace(**{**vars(ok), "y0": jnp.ones((4, 2)).at[0, 0].set(jnp.inf)})
    with pytest.raises(ValueError, match="y0 holds non-finite"):
        gs.solve(bad)
    partial = types.SimpleNamespace(name="duck", f_jax=f, y0=jnp.ones((4, 2)))
    with pytest.raises(TypeError, match=r"lacks \['params', 't_span', 'stiff'\]"):
        gs.record(partial)


@pytest.mark.parametrize("call,error,match", [
    (lambda p: gs.solve(p, engine="warp-drive"), ValueError, "engine must be None or one of"),
    (lambda p: gs.solve(p, engine=3), TypeError, "engine must be None, a name"),
    (lambda p: gs.solve(p, method="euler"), ValueError, r"method must be one of \['rodas5p', 'rosenbrock23', 'tsit5', 'vern7'\]"),
    (lambda p: gs.solve(p, rtol=-1.0), ValueError, "rtol must be a positive finite"),
    (lambda p: gs.solve(p, atol=np.nan), ValueError, "atol must be a positive finite"),
    (lambda p: gs.solve(p, dt0=0.0), ValueError, "dt0 must be"),
    (lambda p: gs.solve(p, max_steps=0), ValueError, "max_steps must be a positive"),
    (lambda p: gs.solve(p, ts=[0.5, 0.2]), ValueError, "ts must be non-decreasing"),
    (lambda p: gs.solve(p, ts=[0.5, 2.0]), ValueError, r"ts must lie inside t_span"),
    (lambda p: gs.solve(p, ts=[[0.5]]), ValueError, "ts must be a non-empty 1-D"),
    (lambda p: gs.solve(p, dtype=jnp.int32), TypeError, "dtype must be a floating"),
    (lambda p: gs.solve(p, engine="general_replay", method="rk4"), ValueError, "method must be"),
    (lambda p: gs.value_and_grad(p, "loss"), TypeError, "loss must be callable"),
    (lambda p: gs.value_and_grad(p, lambda ys, q: 0.0, wrt="theta"), ValueError, "wrt must be one of"),
    (lambda p: gs.value_and_grad(p, lambda ys, q: 0.0, mode="sideways"), ValueError, "mode must be one of"),
    (lambda p: gs.value_and_grad(p, lambda ys, q: 0.0, engine="general"), ValueError,
     "engine 'general' cannot serve this request: forward only"),
    (lambda p: gs.record(p, recorder="fast"), ValueError, "recorder must be None, 'general' or 'fused'"),
])
def test_bad_arguments_are_refused(call, error, match):
    with pytest.raises(error, match=match):
        call(make())


def test_mesh_must_fit_the_problem():
    mesh = gs.record(make())
    other = make(y0=jnp.ones((5, 2)), params={"k": jnp.ones(5)})
    with pytest.raises(ValueError, match="mesh has 4 trajectories, the problem 5"):
        gs.value_and_grad(other, lambda ys, p: jnp.sum(ys), mesh=mesh)
    with pytest.raises(TypeError, match="mesh must be a gs.Mesh"):
        gs.value_and_grad(make(), lambda ys, p: jnp.sum(ys), mesh=np.ones((4, 3)))


# -- buckets: bounded whatever is asked (issue 27, item 1) -----------------------------

def test_buckets_are_clamped_to_the_rows_and_capped():
    # buckets=64 on 4 trajectories used to build 64 buckets of filler rows, each one
    # more scan to compile (42.9 s against 5.3 s with buckets=2; a Calibrator with
    # buckets=1000 traced for 23+ minutes). A bucket holds at least LANES rows a
    # device, so more than ceil(n / (devices * LANES)) buckets only add filler.
    steps = np.arange(1, 41) * 3
    for n, asked in [(4, 2), (4, 16), (40, 16), (40, 3), (1000, 16)]:
        got = layout.arrange(n, n_steps=np.resize(steps, n), buckets=asked).widths
        assert len(got) == min(asked, -(-n // layout.LANES)), (n, asked, got)
    # Above MAX_BUCKETS: refused before anything is recorded, whatever n is.
    with pytest.raises(ValueError, match=f"buckets must be at most {layout.MAX_BUCKETS}"):
        gs.value_and_grad(make(), lambda ys, p: jnp.sum(ys), buckets=64)
    with pytest.raises(ValueError, match=f"buckets must be at most {layout.MAX_BUCKETS}"):
        gs.Calibrator(make(), lambda ys, th, d: jnp.sum(ys), buckets=1000)
    vg = gs.value_and_grad(make(), lambda ys, p: jnp.sum(ys), buckets=layout.MAX_BUCKETS)
    assert len(vg.arrangement.widths) == 1


# -- the Calibrator's inputs (issue 27, items 4-8) -------------------------------------

def _rates(data=None, loss=None, **kw):
    """Two fits of two decaying trajectories each; theta = {"k": (2,)}."""
    kw.setdefault("optimizer", optax.adam(0.1))
    return gs.Calibrator(
        make(f_jax=lambda t, y, p: -p["k"] * y, y0=jnp.ones((4, 1))),
        loss or (lambda ys, th, d: jnp.sum((ys - d["obs"]) ** 2)),
        data={"obs": jnp.full((2, 2, 1), 0.5)} if data is None else data, **kw)


@pytest.mark.parametrize("bad,shown", [(jnp.nan, "nan"), (-jnp.inf, "-inf")])
def test_nonfinite_data_is_refused_naming_leaf_and_index(bad, shown):
    # A NaN measurement used to stop its fit at step 0 as 'nonfinite', pointing
    # nowhere near the data.
    data = {"obs": jnp.full((2, 2, 1), 0.5).at[1, 0, 0].set(bad)}
    with pytest.raises(ValueError, match=re.escape(
            f"data['obs'] holds a non-finite value ({shown}) at index (1, 0, 0)")):
        _rates(data=data)


def test_loss_must_return_a_scalar_per_fit():
    # It used to fail inside the update with "shape mismatch: value array of shape
    # (2,2,2) could not be broadcast to indexing result of shape (2,)".
    cal = _rates(loss=lambda ys, th, d: (ys - d["obs"]) ** 2)
    with pytest.raises(ValueError, match=re.escape(
            "loss must return a scalar per fit (shape ()); loss(ys_b, theta_b, data_b) "
            "returned float64[2, 1]")):
        cal.fit({"k": jnp.ones(2)}, steps=2, progress=False)


def test_optimizer_that_fails_is_named_before_compiling():
    # optax.lbfgs takes optax's extra arguments (value, grad, value_fn): accepted, as
    # are the transformations that take none; an update that fails is named with the
    # parameters it was given (it used to fail as a raw TypeError inside the update's
    # trace).
    u_b = {"k": jax.ShapeDtypeStruct((), jnp.float64)}
    for ok in (optax.lbfgs(), optax.chain(optax.clip(1.0), optax.adam(0.1)),
               optax.inject_hyperparams(optax.sgd)(learning_rate=0.1), optax.adam(0.1)):
        _validate.check_optimizer(ok, u_b)
    broken = optax.GradientTransformation(lambda u: (), lambda g, s, u=None: g["missing"])
    with pytest.raises(TypeError, match=re.escape(
            "optimizer.init/update failed on fit 0's parameters {\"['k']\": 'float64[]'}: "
            "KeyError")):
        _rates(optimizer=broken).fit({"k": jnp.ones(2)}, steps=2, progress=False)


def _result(k):
    """A FitResult of two fits of theta = {"k": k}, as `_rates` would return."""
    return gs.FitResult(theta={"k": jnp.asarray(k)}, loss=jnp.array([1e-9, 3.0]),
                        converged=jnp.array([True, False]), status=jnp.array([1, 2]),
                        steps=jnp.array([40, 100]), history=jnp.zeros((100, 2)),
                        grad_norm=jnp.zeros(2), refreshes=0, drift={}, engine="e",
                        updates=100, status_names=("converged", "step_cap"))


def test_one_true_value_is_broadcast_to_every_fit():
    res = _result([0.5, 2.0])
    # |0.5 - 0.7| / 0.7 and |2.0 - 0.7| / 0.7, by hand.
    lines = res.table(true={"k": 0.7}).splitlines()[1:]
    assert [line.split()[1:4] for line in lines] == [["0.5", "0.7", "2.86e-01"],
                                                      ["2", "0.7", "1.86e+00"]]
    assert res.table(true={"k": 0.7}) == res.table(true={"k": np.full(2, 0.7)})
    with pytest.raises(ValueError, match=re.escape(
            "true['k'] has shape (3,): give one value, or one per fit (2,)")):
        res.table(true={"k": np.ones(3)})


def test_zero_devices_is_not_reported_as_too_many():
    # Was "devices=0: there are 1 devices (cpu)".
    with pytest.raises(ValueError, match="devices must be a positive number of devices, got 0"):
        gs.value_and_grad(make(), lambda ys, p: jnp.sum(ys), devices=0)


def test_theta0_of_another_dtype_is_named():
    # Was blamed on "theta_b broadcast to K (no to_params)"'s dtype.
    with pytest.raises(TypeError, match=re.escape(
            "theta0['k'] has dtype float32 but the problem is float64 (its y0)")):
        _rates().fit({"k": jnp.ones(2, jnp.float32)}, steps=2, progress=False)


def test_profile_grid_errors_name_the_grid():
    cal, res = _rates(transform={"k": gs.transforms.Bounded(0.5, 2.0)}), _result([1.0, 1.5])
    # Was "theta0['k'] of fit 1 (3.0) is outside the domain ..." and "grid must hold
    # finite values, got []".
    with pytest.raises(ValueError, match=re.escape(
            "grid[1] = 3.0 is outside the domain of theta['k']'s transform "
            "Bounded(lo=0.5, hi=2.0)")):
        cal.profile(res, "k", [1.0, 3.0], steps=2, progress=False)
    with pytest.raises(ValueError, match="grid is empty: give at least one value to fix "
                                         "'k' at"):
        cal.profile(res, "k", [], steps=2, progress=False)


def test_resume_message_says_which_count_is_per_fit(tmp_path, capsys):
    # Two starts through one slot, 3 updates each: 6 updates in all. The message used
    # to read "(6 updates done, cap 4)", a total beside a per-fit cap.
    def fit(steps):
        return _rates(checkpoint_dir=tmp_path / "fit", checkpoint_every=2).fit(
            {"k": jnp.ones(2)}, steps=steps, progress=False, slots=1)
    assert fit(3).updates == 6
    capsys.readouterr()
    assert fit(4).steps.tolist() == [4, 4]
    assert "(6 updates run in all; the fits have done 3..3 updates each, capped at " \
           "steps=4 per fit)" in capsys.readouterr().err


def test_warp_optimization_level_is_checked(monkeypatch):
    # The suite compiles Warp at 0 (conftest); users get -O3 unless they ask.
    from gradsolve.warp import _kernels
    monkeypatch.delenv("GRADSOLVE_WARP_OPT_LEVEL", raising=False)
    assert _kernels.optimization_level() == 3
    assert '"optimization_level": 3}' in _kernels.header(3, 64)
    monkeypatch.setenv("GRADSOLVE_WARP_OPT_LEVEL", "O2")
    with pytest.raises(ValueError, match="GRADSOLVE_WARP_OPT_LEVEL must be 0, 1, 2 or 3, "
                                         "got 'O2'"):
        _kernels.header(3, 64)
