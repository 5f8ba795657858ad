"""The router, table-driven: which engine serves which request, and why others
were passed over."""

import pytest

import gradsolve as gs
from gradsolve.engines import Request


@pytest.mark.parametrize("request_,engine,expected,passed", [
    (Request(gradient=True, stiff=False, d=3, method="tsit5"), None, "general_replay",
     {"fused_replay": "not built into this version"}),
    (Request(gradient=True, stiff=False, d=200, method="tsit5"), None, "general_replay",
     {"fused_replay": "not built into this version"}),
    (Request(gradient=False, stiff=False, d=3, method="tsit5"), None, "diffrax",
     {"fused": "not built into this version"}),
    (Request(gradient=False, stiff=False, d=3, method="tsit5", fused=True), None, "diffrax",
     {"fused": "not built into this version"}),
    (Request(gradient=True, stiff=False, d=3, method="tsit5"), "diffrax", "diffrax", {}),
    (Request(gradient=False, stiff=False, d=3, method="tsit5"), "general", "general", {}),
    (Request(gradient=False, stiff=False, d=3, method="tsit5"), "general_replay",
     "general_replay", {}),
])
def test_route_table(request_, engine, expected, passed):
    chosen, why = gs.route(request_, engine)
    assert chosen.name == expected
    assert why == passed


def test_forced_engine_that_cannot_serve_names_the_reason():
    with pytest.raises(ValueError, match="'general' cannot serve this request: forward only"):
        gs.route(Request(gradient=True, stiff=False, d=3, method="tsit5"), "general")


def test_results_name_the_engine_that_ran():
    prob = gs.problems.lorenz(n=3)
    assert gs.solve(prob).engine == "diffrax"
    assert gs.solve(prob, engine="general").engine == "general"
    sol = gs.solve(prob)
    assert dict(sol.passed_over) == {"fused": "not built into this version"}
    vg = gs.value_and_grad(prob, lambda ys, p: ys.sum())
    assert vg.engine == "general_replay" and vg.mesh.recorder == "general"
