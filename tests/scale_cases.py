"""Several devices in one process: run by test_scale.py as a plain Python script in a
subprocess with four forced host devices (`XLA_FLAGS=--xla_force_host_platform_device_count=4`;
the device count is fixed when JAX starts, so it cannot be set inside the main test
process). `main()` runs every `test_*` case in order and prints how many passed; a
failing case raises.

Each split result is compared with the same call on one device. Per-trajectory
results are compared bit for bit: every row's arithmetic is the same whichever device
runs it (every piece of rows is a multiple of the vector width for that,
layout.LANES) -- but for outputs at `ts`, whose extra steps XLA fuses differently in
different programs (a last bit; see the replay test). Gradients of `gs.Shared` parameters are sums over
the devices, added in another order: they are compared at `SHARED_RTOL` (a sum of n
terms in float64 reorders to ~n * 1e-16).
"""

import inspect
import os
import sys

import equinox as eqx
import jax

# What tests/conftest.py sets under pytest (its CPU pins reach here through the
# environment test_scale.py passes on).
jax.config.update("jax_enable_x64", os.environ.get("GRADSOLVE_TEST_X64", "1") != "0")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import pytest  # noqa: E402  (pytest.raises only)

import gradsolve as gs  # noqa: E402


# Measured at most 6.0e-16 relative (a sum over 37 rows: the Shared gradient on 2 and
# 4 devices; the values, the fit's history and the MLP's gradient are equal or closer).
SHARED_RTOL = 6e-15


def test_four_devices():
    assert jax.device_count() == 4, "run through test_scale.py (four forced devices)"


def plain():
    return gs.problems.lorenz(n=37)  # 37: not divisible by 2, 3 or 4 devices


def lorenz(plain):
    """With a `gs.Shared` parameter (the general path: the registered fused form of
    Lorenz takes per-trajectory parameters only)."""
    return plain.replace(params=dict(plain.params, sigma=gs.Shared(jnp.asarray(10.0))))


def squares(ys, p):
    return jnp.sum(ys ** 2)


def same(a, b, shared_rtol=SHARED_RTOL):
    for x, y in zip(jax.tree.leaves(a, is_leaf=lambda v: isinstance(v, gs.Shared)),
                    jax.tree.leaves(b, is_leaf=lambda v: isinstance(v, gs.Shared))):
        if isinstance(x, gs.Shared):
            np.testing.assert_allclose(x.value, y.value, rtol=shared_rtol, atol=0)
        else:
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_solve_split_equals_one_device(plain, engine):
    one = gs.solve(plain, engine=engine, ts=jnp.linspace(0.0, 1.0, 4))
    for devices in (jax.devices()[:3],):
        split = gs.solve(plain, engine=engine, ts=jnp.linspace(0.0, 1.0, 4), devices=devices)
        same((one.ys, one.status, one.n_accepted), (split.ys, split.status, split.n_accepted))


def test_record_split_equals_one_device(plain, recorder):
    one = gs.record(plain, recorder=recorder)
    split = gs.record(plain, recorder=recorder, devices=3)
    same((one.h, one.n_steps, one.status), (split.h, split.n_steps, split.status))


def test_gradient_split_equals_one_device(lorenz):
    """With respect to both: per-trajectory parameters, `gs.Shared` ones and y0."""
    wrt = "both"
    mesh = gs.record(lorenz, recorder="general")
    one = gs.value_and_grad(lorenz, squares, wrt=wrt, mesh=mesh, engine="general_replay")()
    for devices in (2, 4):
        vg = gs.value_and_grad(lorenz, squares, wrt=wrt, mesh=mesh, engine="general_replay",
                               devices=devices)
        assert vg.arrangement.devices.devices.size == devices
        value, grads = vg()
        np.testing.assert_allclose(value, one[0], rtol=SHARED_RTOL, atol=0)  # a sum
        same(grads, one[1])


def test_forward_mode_split(lorenz):
    one = gs.value_and_grad(lorenz, squares, mode="forward", engine="general_replay")()
    split = gs.value_and_grad(lorenz, squares, mode="forward", engine="general_replay",
                              devices=4)()
    same(split[1], one[1])


def test_replay_split_and_bucketed(lorenz):
    """Final states bit for bit; outputs at `ts` to the last bit or two, integrated
    (one extra step from the last mesh point before each) or from Tsit5's continuous
    extension: XLA fuses those multiplies and adds differently in each program
    (measured <= 1.6e-16 relative integrated, 5.5e-16 interpolated; bound 1e-15: a few
    units in the last place)."""
    mesh = gs.record(lorenz, recorder="general")
    ts = jnp.linspace(0.0, 1.0, 5)
    end = gs.replay(lorenz, mesh, buckets=1)
    for interpolate in (False, True):
        one = gs.replay(lorenz, mesh, ts=ts, buckets=1, interpolate=interpolate)
        # (Buckets on one device: test_scale.py's test_buckets_change_no_result.)
        kw = dict(devices=4, buckets=3)
        np.testing.assert_array_equal(gs.replay(lorenz, mesh, **kw), end)
        np.testing.assert_allclose(gs.replay(lorenz, mesh, ts=ts, interpolate=interpolate,
                                             **kw), one, rtol=1e-15, atol=0)


def test_calibrator_fit_split_equals_one_device():
    B, K = 3, 3  # 9 trajectories over 2 devices
    rates = jnp.array([0.5, 1.0, 2.0])
    data = jnp.exp(-jnp.array([1.5, 3.0, 6.0])[:, None] * rates)[:, :, None]
    prob = gs.EnsembleProblem(f_jax=lambda t, y, k: -k * y, y0=jnp.ones((B * K, 1)),
                              params=jnp.ones(B * K), t_span=(0.0, 1.0))

    def fit(**kw):
        cal = gs.Calibrator(prob, lambda ys, k, d: jnp.sum((ys - d) ** 2), data=data,
                            to_params=lambda k: k * rates, optimizer=optax.adam(0.2),
                            transform=gs.transforms.Positive(), refresh_every=3, **kw)
        return cal.fit(jnp.ones(B), steps=6, progress=False)  # a refresh at 3

    one, split = fit(), fit(devices=2)
    assert one.refreshes == split.refreshes == 1
    np.testing.assert_array_equal(split.theta, one.theta)
    # A fit's loss sums its K trajectories, which may lie on two devices.
    np.testing.assert_allclose(split.history, one.history, rtol=SHARED_RTOL, atol=0)


def test_kernel_adjoint_and_diffrax_refuse_several_devices(lorenz):
    with pytest.raises(ValueError, match="one device"):
        gs.value_and_grad(lorenz, squares, engine="kernel_adjoint", devices=2)
    with pytest.raises(ValueError, match="one device"):
        gs.solve(gs.problems.lorenz(n=4), engine="diffrax", devices=2)
    # Unnamed, the router passes over them and says why.
    sol = gs.solve(gs.problems.lorenz(n=4), fused=False, devices=2)
    assert sol.engine == "general" and "one device" in dict(sol.passed_over)["diffrax"]


def test_device_arguments_are_checked():
    with pytest.raises(ValueError, match="there are 4 devices"):
        gs.record(gs.problems.lorenz(n=4), devices=5)
    with pytest.raises(ValueError, match="twice"):
        gs.record(gs.problems.lorenz(n=4), devices=[jax.devices()[0]] * 2)
    with pytest.raises(TypeError, match="jax devices"):
        gs.record(gs.problems.lorenz(n=4), devices=["cpu:0"])
    two_d = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 2), ("a", "b"))
    with pytest.raises(ValueError, match="1-D"):
        gs.record(gs.problems.lorenz(n=4), devices=two_d)


def test_mlp_field_split():
    """An Equinox MLP in `gs.Shared` (activation functions among its leaves) through
    the split replay: its gradient is the sum over devices."""
    mlp = eqx.nn.MLP(2, 2, 8, 1, activation=jnp.tanh, key=jax.random.key(0))
    mlp = jax.tree.map(lambda x: x.astype(jnp.float64) if eqx.is_inexact_array(x) else x, mlp)
    prob = gs.EnsembleProblem(f_jax=lambda t, y, p: p(y) - y, y0=jnp.linspace(0.1, 1.0, 22
                                                                           ).reshape(11, 2),
                              params=gs.Shared(mlp), t_span=(0.0, 1.0))
    loss = lambda ys, p: jnp.sum(ys ** 2)
    one = gs.value_and_grad(prob, loss, engine="general_replay")()
    split = gs.value_and_grad(prob, loss, engine="general_replay", devices=2)()
    np.testing.assert_allclose(split[0], one[0], rtol=SHARED_RTOL, atol=0)
    for a, b in zip(jax.tree.leaves(eqx.filter(split[1], eqx.is_array)),
                    jax.tree.leaves(eqx.filter(one[1], eqx.is_array))):
        np.testing.assert_allclose(a, b, rtol=SHARED_RTOL, atol=1e-15)


# The cases' arguments: the problems, and the values a case runs once each with.
SWEEPS = {"engine": ("general", "fused"), "recorder": ("general", "fused")}


def main():
    """Every `test_*` case in file order, once per value of its swept argument; prints
    a line per case and the count (test_scale.py checks it)."""
    made = {"plain": plain()}
    made["lorenz"] = lorenz(made["plain"])
    done = 0
    for name, case in [(k, f) for k, f in globals().items() if k.startswith("test_")]:
        args = inspect.signature(case).parameters
        fixed = {k: made[k] for k in args if k in made}
        swept = [(k, v) for k in args if k in SWEEPS for v in SWEEPS[k]] or [(None, None)]
        for key, value in swept:
            case(**fixed, **({} if key is None else {key: value}))
            done += 1
            print(f"ok {name}" + ("" if key is None else f"[{value}]"), flush=True)
    print(f"{done} scale cases passed", flush=True)


if __name__ == "__main__":
    sys.exit(main())
