"""Bad input gets a clear error naming the field, before anything compiles."""

import types

import jax.numpy as jnp
import numpy as np
import pytest

import gradsolve as gs


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
