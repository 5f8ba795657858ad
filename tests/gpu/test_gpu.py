"""Warp on CUDA, called from JAX through `jax.pure_callback`: the router's GPU table,
the fused solve against a tight reference, the in-kernel adjoint against the JAX
replay on the same mesh, and the callback under `jit` and `vmap`.

Run by `make test` where a GPU is visible (tests/gpu/conftest.py). The tolerances
were measured with Warp on the CPU reached through the same callback bridge (no GPU
was at hand when these were written); the GPU's kernels differ from the CPU's by
rounding (nvcc contracts multiply-adds), far below each bound, which is set by the
method's error or by roundoff carried through the steps.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import gradsolve as gs
from gradsolve.engines import Request
from gradsolve.warp import _jax, _runtime
from helpers import rel_err, tree_rel_err


def _loss(ys, params):
    w = jnp.linspace(0.5, 1.5, ys.size).reshape(ys.shape)
    return jnp.sum(w * ys ** 2) + jnp.sum(jnp.sin(ys))


def _inexact(tree):
    return eqx.filter(tree, eqx.is_inexact_array)


def test_warp_runs_on_cuda_and_jax_reaches_it_through_pure_callback():
    assert _runtime.device() == "cuda"
    assert _jax.default_bridge() == "callback"


def test_router_takes_the_gpu_table():
    # The fused kernels up to d = 64 on the GPU (8 on the CPU); the in-kernel adjoint
    # by name only there (not measured faster on a GPU yet).
    engine, passed = gs.route(Request(gradient=True, stiff=False, d=3, n=4096,
                                      facts={"fused": True}))
    assert engine.name == "fused_replay"
    assert passed["kernel_adjoint"] == ("chosen by name only on the cuda device (not yet "
                                        "measured faster)")
    assert gs.route(Request(gradient=False, stiff=False, d=64,
                            facts={"fused": True}))[0].name == "fused"
    engine, passed = gs.route(Request(gradient=False, stiff=False, d=65, facts={"fused": True}))
    assert passed["fused"] == "d = 65 > 64: past the fused kernels' cutoff on the cuda device"


def test_fused_solve_against_a_tight_reference():
    # Tsit5 at rtol 1e-8 against the JAX engine at rtol 1e-12 (an independent code
    # path): the method's global error, measured 2.2e-9 relative to the largest state
    # (Warp on the CPU, same kernels); bound ~10x.
    prob = gs.problems.lorenz(n=32, t_span=(0.0, 1.0))
    ts = np.linspace(0.0, 1.0, 5)
    sol = gs.solve(prob, rtol=1e-8, atol=1e-10, ts=ts, engine="fused", interpolate=False)
    ref = gs.solve(prob, rtol=1e-12, atol=1e-14, ts=ts, engine="general", interpolate=False)
    assert sol.engine == "fused" and sol.ok and ref.ok
    assert rel_err(sol.ys, ref.ys) < 2e-8


def _same_mesh_pair(prob, ts, method, rtol):
    # Integrated outputs on both sides: the bounds below were measured so (the CPU
    # tests cover the kernels' continuous extension).
    ka = gs.value_and_grad(prob, _loss, wrt="both", engine="kernel_adjoint", ts=ts,
                           method=method, rtol=rtol, atol=1e-9, interpolate=False)
    ref = gs.value_and_grad(prob, _loss, wrt="both", engine="general_replay", ts=ts,
                            method=method, mesh=ka.mesh, interpolate=False)
    return ka, ref


def test_kernel_adjoint_equals_the_jax_replay_on_the_same_mesh():
    # The Warp forward and backward over the fused recorder's mesh (37-104 steps)
    # against jax.grad of the JAX replay of that mesh: roundoff carried through the
    # steps, measured (Tsit5 on Lorenz / Rosenbrock23 on Robertson) value 3.2e-16 /
    # 1.3e-16, parameter gradient 5.1e-15 / 1.1e-15, y0 gradient 3.0e-15 / 3.1e-16;
    # bounds ~10x the larger.
    cases = [(gs.problems.lorenz(n=8, t_span=(0.0, 1.0)), "tsit5", 1e-6),
             (gs.problems.robertson(n=4, t_span=(0.0, 10.0)), "rosenbrock23", 1e-5)]
    for prob, method, rtol in cases:
        t0, t1 = prob.t_span
        ka, ref = _same_mesh_pair(prob, t0 + jnp.array([0.3, 0.8]) * (t1 - t0), method, rtol)
        assert ka.engine == "kernel_adjoint" and ka.mesh.recorder == "fused" and ka.mesh.ok
        traced = str(eqx.filter_make_jaxpr(ka._call)(ka.mesh, prob.params, prob.y0)[0])
        assert "pure_callback" in traced and "ffi_call" not in traced
        (v, (gp, gy)), (v_ref, (gp_ref, gy_ref)) = ka(), ref()
        assert rel_err(v, v_ref) < 3e-15, method
        assert tree_rel_err(_inexact(gp), _inexact(gp_ref)) < 5e-14, method
        assert rel_err(gy, gy_ref) < 3e-14, method


def test_the_callback_under_jit_and_vmap_is_the_unbatched_call():
    # Under vmap, pure_callback runs the host call once per batch element ("sequential"):
    # the batched, jitted gradients are the one-at-a-time ones, bit for bit.
    prob = gs.problems.lorenz(n=4, t_span=(0.0, 0.5))
    mesh = gs.record(prob, recorder="fused")

    def grad_rho(scale):
        p = dict(prob.params, rho=prob.params["rho"] * scale)
        return jax.grad(lambda rho: jnp.sum(gs.replay(
            prob, mesh, params=dict(p, rho=rho), engine="kernel_adjoint") ** 2))(p["rho"])

    scales = jnp.array([1.0, 1.01, 0.99])
    batched = jax.jit(jax.vmap(grad_rho))(scales)
    for k, s in enumerate(scales):
        np.testing.assert_array_equal(batched[k], grad_rho(s))
