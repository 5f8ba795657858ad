"""The engine contract: a request the library accepts reaches an engine that serves it,
the `fused=` knob keeps a request on or off the Warp engines, and a new engine is one
class plus one line in the registry (the example of docs/engines.md)."""

from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gradsolve as gs
from gradsolve.problems import linear_exact
from helpers import rel_err_componentwise


def test_interpolate_on_a_stiff_fused_field_reaches_a_jax_replay():
    # linear_stiff has a fused form with a Jacobian, so the fused engine would pick
    # Rosenbrock23, whose kernel integrates a step to each output time: it must refuse
    # and the solve go on to the general engine's Rodas5P.
    prob = gs.problems.linear_stiff(n=2, d=5)
    ts = np.array([0.25, 0.5, 1.0])
    sol = gs.solve(prob, ts=ts, interpolate=True, rtol=1e-6, atol=1e-9)
    why = dict(sol.passed_over)
    assert (sol.engine, sol.method) == ("general", "rodas5p")
    assert why["fused"] == ("its Warp kernels serve ts by an integrated step "
                            "(rosenbrock23); interpolate=True runs on the JAX replay")
    assert why["diffrax"] == "Diffrax has no 'rodas5p' solver"
    # Against the closed form (SciPy's expm), entry by entry. At rtol 1e-6 the
    # interpolated outputs measured 7e-7 (the integrated ones 1.3e-7); 1e-5 leaves
    # the global error room to accumulate and still fails on a wrong output time or a
    # state at the wrong mesh point (errors ~1e-1).
    exact = np.stack([linear_exact(prob, t) for t in ts], axis=1)
    assert rel_err_componentwise(sol.ys, exact) < 1e-5
    # The gradient: the Warp recorder and the JAX replay, which interpolates
    # Rosenbrock23's steps; the in-kernel adjoint refuses.
    eng, passed = gs.route(gs.router.request_for(prob, gradient=True, interpolate=True))
    assert eng.name == "fused_replay" and "integrated step" in passed["kernel_adjoint"]


def test_fused_false_keeps_every_request_off_warp():
    prob = gs.problems.lorenz(n=2)
    loss = lambda ys, p: jnp.sum(ys ** 2)
    off = "fused=False keeps the request off the Warp engines"
    vg = gs.value_and_grad(prob, loss, fused=False)
    assert vg.engine == "general_replay" and vg.mesh.recorder == "general"
    assert dict(vg.passed_over) == {"kernel_adjoint": off, "fused_replay": off}
    sol = gs.solve(prob, fused=False)
    assert sol.engine == "diffrax" and dict(sol.passed_over) == {"fused": off}
    # the same answer either way (the fused and general recorders agree to 1e-10 on
    # their states, docs/engines.md): the knob changes the engine, not the result
    on = gs.value_and_grad(prob, loss)
    assert on.engine == "fused_replay"
    np.testing.assert_allclose(vg()[1]["rho"], on()[1]["rho"], rtol=1e-8)
    with pytest.raises(ValueError, match="'fused' runs on Warp, but fused=False"):
        gs.solve(prob, engine="fused", fused=False)
    with pytest.raises(ValueError, match="fused must be None, True or False"):
        gs.solve(prob, fused="yes")


# -- the smallest engine: docs/engines.md shows this class --------------------------

class Uniform(gs.engines.Engine, gs.engines.Records, gs.engines.Differentiates):
    """Equal steps: records a mesh of `steps` equal step sizes (no error control)
    and differentiates the replay on it."""

    name: ClassVar[str] = "uniform"
    recorder: ClassVar[str] = "uniform"
    steps: int = 64

    def record(self, prob, cfg, params=None, y0=None):
        n, (t0, t1) = prob.n, prob.t_span
        return gs.Mesh(h=jnp.full((n, self.steps), (t1 - t0) / self.steps),
                       n_steps=jnp.full(n, self.steps), n_rejected=jnp.zeros(n, int),
                       status=jnp.zeros(n, int), t0=jnp.asarray(t0), t1=jnp.asarray(t1),
                       method=cfg.method, rtol=cfg.rtol, atol=cfg.atol,
                       recorder=self.recorder)

    def ys_function(self, prob, cfg, mode):
        return lambda mesh, params, y0: gs.replay(prob, mesh, params=params, y0=y0,
                                                  ts=cfg.ts)


def test_a_new_engine_is_one_class_and_one_registry_line():
    gs.engines.register(Uniform())
    try:
        assert "uniform" in gs.engine_names()
        k = jnp.array([0.5, 1.0, 2.0])
        prob = gs.EnsembleProblem(lambda t, y, k: -k * y, jnp.ones((3, 1)), k, (0.0, 1.0))
        vg = gs.value_and_grad(prob, lambda ys, k: jnp.sum(ys), engine="uniform")
        value, grad = vg()
        assert vg.engine == "uniform" and vg.mesh.recorder == "uniform"
        # d/dk exp(-k) = -exp(-k), closed form; 64 Tsit5 steps of 1/64 on a decay at
        # rate <= 2 have a global error ~(h k)^5 ~ 1e-9 relative.
        np.testing.assert_allclose(value, np.exp(-np.asarray(k)).sum(), rtol=1e-8)
        np.testing.assert_allclose(grad, -np.exp(-np.asarray(k)), rtol=1e-8)
        assert gs.record(prob, recorder="uniform").columns == 64
        # It serves no forward solve, and the router never picks it unasked.
        with pytest.raises(ValueError, match="'uniform' cannot serve this request: it does "
                                             "not serve solves"):
            gs.solve(prob, engine="uniform")
        assert gs.value_and_grad(prob, lambda ys, k: jnp.sum(ys)).engine == "general_replay"
    finally:
        gs.engines.unregister("uniform")
    assert "uniform" not in gs.engine_names()


def test_engines_declare_what_they_serve():
    serves = {name: tuple(t for t in gs.engines.TASKS if e.serves(t))
              for name, e in gs.engines.ENGINES.items()}
    assert serves == {"fused": ("solve",),
                      "fused_replay": ("solve", "record", "gradient"),
                      "kernel_adjoint": ("solve", "record", "gradient"),
                      "diffrax": ("solve", "gradient"),
                      "general_replay": ("solve", "record", "gradient"),
                      "general": ("solve",)}
    assert {n: gs.engines.recorder_of(e) for n, e in gs.engines.ENGINES.items()} == {
        "fused": None, "fused_replay": "fused", "kernel_adjoint": "fused", "diffrax": None,
        "general_replay": "general", "general": None}
    with pytest.raises(ValueError, match="routes 'gradient' but does not serve it"):
        class Broken(gs.engines.Engine, gs.engines.Solves):
            name: ClassVar[str] = "broken"
            routes: ClassVar[tuple] = ("gradient",)

            def solve(self, prob, cfg):
                raise AssertionError
        gs.engines.register(Broken())


def test_request_carries_what_engines_refuse_on():
    prob = gs.EnsembleProblem(lambda t, y, p: -p["w"][0] * y, jnp.ones((2, 1)),
                              {"w": gs.Shared(jnp.ones((1, 1)))}, (0.0, 1.0))
    req = gs.router.request_for(prob, gradient=True, mode="forward", ts=True)
    assert (req.mode, req.ts, req.dtype, req.shared_module, req.task) == (
        "forward", True, "float64", False, "gradient")
    net = eqx.nn.MLP(1, 1, 4, 1, key=jax.random.key(0))
    prob = prob.replace(params={"net": gs.Shared(net)},
                        f_jax=lambda t, y, p: p["net"](y))
    assert gs.router.request_for(prob, gradient=False).shared_module
