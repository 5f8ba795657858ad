"""The router, table-driven: which engine serves which request (DESIGN.md section 4),
and why the others were passed over."""

import re

import pytest

import gradsolve as gs
from gradsolve.engines import Request
from gradsolve.warp._registry import NOT_FUSED


SMALL = "n = 0 < 256: the JAX replay is faster below that here (tsit5)"
KA_METHODS = "the in-kernel adjoint runs ('rosenbrock23', 'tsit5', 'vern7')"
NO_JACOBIAN = "the field has no hand-written Jacobian for the stiff fused kernel"
INTEGRATED_R23 = ("its Warp kernels serve ts by an integrated step (rosenbrock23); "
                  "interpolate=True runs on the JAX replay")


def R(gradient, d=3, stiff=False, method=None, fused=False, jacobian=False, rtol=None, n=0,
      shared_module=False, interpolate=False):
    return Request(gradient=gradient, stiff=stiff, d=d, method=method,
                   facts={"fused": fused, "jacobian": jacobian}, rtol=rtol, n=n,
                   shared_module=shared_module,
                   interpolate=interpolate, ts=interpolate)


@pytest.mark.parametrize("request_,engine,expected,method,passed", [
    # gradient, registered field with d <= 64 -> fused_replay (Tsit5 / Rosenbrock23)
    (R(True, fused=True), None, "fused_replay", "tsit5", {"kernel_adjoint": SMALL}),
    # ... Rosenbrock23 in Warp (faster at every n measured), Tsit5 from 256 trajectories
    (R(True, stiff=True, fused=True, jacobian=True), None, "kernel_adjoint", "rosenbrock23", {}),
    # ... but not for MLP fields on the CPU
    (R(True, fused=True, n=256), None, "kernel_adjoint", "tsit5", {}),
    (R(True, fused=True, n=256, shared_module=True), None, "fused_replay", "tsit5",
     {"kernel_adjoint": "an Equinox module in the field: on the CPU the JAX replay's "
                        "batched matrix products are faster (benchmarks/kernel_adjoint.py)"}),
    # ... beyond the cutoff (8 on the cpu device), or a method the kernels do not run
    (R(True, d=8, fused=True), None, "fused_replay", "tsit5", {"kernel_adjoint": SMALL}),
    (R(True, d=9, fused=True), None, "general_replay", "tsit5",
     {"kernel_adjoint": "d = 9 > 8: past the fused kernels' cutoff on the cpu device",
      "fused_replay": "d = 9 > 8: past the fused kernels' cutoff on the cpu device"}),
    # ... Vern7 as well, in the kernels from 64 trajectories (its stages cost more)
    (R(True, method="vern7", fused=True), None, "fused_replay", "vern7",
     {"kernel_adjoint": "n = 0 < 64: the JAX replay is faster below that here (vern7)"}),
    (R(True, method="vern7", fused=True, n=64), None, "kernel_adjoint", "vern7", {}),
    (R(True, method="rodas5p", fused=True, jacobian=True), None, "general_replay", "rodas5p",
     {"kernel_adjoint": f"{KA_METHODS}, not 'rodas5p'",
      "fused_replay": "the fused kernels run ('rosenbrock23', 'tsit5', 'vern7'), not 'rodas5p'"}),
    (R(True, stiff=True, fused=True), None, "general_replay", "rodas5p",
     {"kernel_adjoint": NO_JACOBIAN, "fused_replay": NO_JACOBIAN}),
    # ... or a tight tolerance for a stiff field: second-order Rosenbrock23 would crawl
    (R(True, stiff=True, fused=True, jacobian=True, rtol=1e-6), None, "kernel_adjoint",
     "rosenbrock23", {}),
    (R(True, stiff=True, fused=True, jacobian=True, rtol=1e-8), None, "general_replay",
     "rodas5p", {"kernel_adjoint": "the fused stiff method, second-order Rosenbrock23, needs "
                                   "too many steps at rtol < 1e-06: the general path's "
                                   "Rodas5P serves it",
                 "fused_replay": "the fused stiff method, second-order Rosenbrock23, needs "
                                 "too many steps at rtol < 1e-06: the general path's "
                                 "Rodas5P serves it"}),
    (R(True, stiff=True, fused=True, jacobian=True, rtol=1e-8, method="rosenbrock23"),
     None, "kernel_adjoint", "rosenbrock23", {}),
    # ts from the continuous extension: the kernels serve Tsit5's; the Rosenbrock23
    # kernels integrate a step to each output time, so the JAX replay (fused_replay's
    # gradient is one) or the general engine serves them
    (R(True, fused=True, n=256, interpolate=True), None, "kernel_adjoint", "tsit5", {}),
    (R(False, fused=True, interpolate=True), None, "fused", "tsit5", {}),
    (R(True, stiff=True, fused=True, jacobian=True, interpolate=True), None,
     "fused_replay", "rosenbrock23", {"kernel_adjoint": INTEGRATED_R23}),
    # gradient, any other field -> general_replay (Rodas5P when stiff)
    (R(True), None, "general_replay", "tsit5",
     {"kernel_adjoint": NOT_FUSED, "fused_replay": NOT_FUSED}),
    (R(True, stiff=True, d=200), None, "general_replay", "rodas5p",
     {"kernel_adjoint": NOT_FUSED, "fused_replay": NOT_FUSED}),
    # forward only: fused, else diffrax, else general
    (R(False, fused=True), None, "fused", "tsit5", {}),
    (R(False, stiff=True, fused=True, jacobian=True), None, "fused", "rosenbrock23", {}),
    (R(False), None, "diffrax", "tsit5", {"fused": NOT_FUSED}),
    (R(False, stiff=True), None, "general", "rodas5p",
     {"fused": NOT_FUSED, "diffrax": "Diffrax has no 'rodas5p' solver"}),
    # forced by name
    (R(True, fused=True), "diffrax", "diffrax", "tsit5", {}),
    (R(True, fused=True), "general_replay", "general_replay", "tsit5", {}),
    (R(False), "general", "general", "tsit5", {}),
    (R(False), "general_replay", "general_replay", "tsit5", {}),
])
def test_route_table(request_, engine, expected, method, passed):
    chosen, why = gs.route(request_, engine)
    assert chosen.name == expected
    assert (request_.method or chosen.default_method(request_)) == method
    assert why == passed


@pytest.mark.parametrize("request_,engine,reason", [
    (R(True), "general", "forward only"),
    (R(True, fused=True), "fused", "forward only \\(gradients: 'fused_replay'\\)"),
    (R(True), "fused_replay", "f_jax has no fused form"),
    (R(False, d=100, fused=True), "fused", "d = 100 > 8: past the fused kernels' cutoff"),
    (R(True, stiff=True, fused=True, jacobian=True, interpolate=True), "kernel_adjoint",
     re.escape(INTEGRATED_R23)),
])
def test_forced_engine_that_cannot_serve_names_the_reason(request_, engine, reason):
    with pytest.raises(ValueError, match=f"'{engine}' cannot serve this request: {reason}"):
        gs.route(request_, engine)


def test_results_name_the_engine_that_ran():
    prob = gs.problems.lorenz(n=3)
    assert gs.solve(prob).engine == "fused"
    assert gs.solve(prob, engine="general").engine == "general"
    own = prob.replace(f_jax=lambda t, y, p: prob.f_jax(t, y, p))
    sol = gs.solve(own)
    assert sol.engine == "diffrax" and dict(sol.passed_over) == {"fused": NOT_FUSED}
    vg = gs.value_and_grad(prob, lambda ys, p: ys.sum())
    assert vg.engine == "fused_replay" and vg.mesh.recorder == "fused"
    vg = gs.value_and_grad(own, lambda ys, p: ys.sum())
    assert vg.engine == "general_replay" and vg.mesh.recorder == "general"
    with pytest.raises(ValueError, match="'fused_replay' cannot serve.*has no fused form"):
        gs.value_and_grad(own, lambda ys, p: ys.sum(), fused=True)
