"""The PEtab benchmark collection (Benchmark-Models-PEtab): the 15 published models in
`../shared/data/benchmark_models_petab/` (data only, never copied into the project),
with AMICI's reference log-likelihoods at the nominal parameters in its REFERENCES.md.

Every model is loaded or refused naming what is not supported (loading is SBML ->
SymPy -> JAX source: 0.4-3.4 s a model here, Chen_MSB2009's 500 states 8.6 s; no
compile). The likelihood compiles 10-19 s a model on the 2-core machine, so one model
is simulated here against its reference, with its gradient: Bruno_JExpBot2016 (six
conditions; 10.5 s for the llh, 5 s more for the gradient).
"""

import pathlib
import re

import numpy as np
import pytest

import gradsolve as gs

DATA = pathlib.Path(__file__).resolve().parents[2] / "shared" / "data" / "benchmark_models_petab"
pytestmark = pytest.mark.skipif(
    not DATA.is_dir(), reason=f"the benchmark collection's data are not at {DATA} "
                              "(../shared/data beside the project: this project's CI has it)")

pytest.importorskip("petab", reason="the petab extra is not installed")

# What each model's load gives: the shapes (conditions n, states d, estimated
# parameters, objective priors) of those it loads, the error and its words for those
# it refuses.
LOADED = {
    "Bachmann_MSB2011": (36, 25, 113, 1), "Beer_MolBioSystems2014": (19, 4, 72, 0),
    "Blasi_CellSystems2016": (1, 16, 9, 0),  # steady-state measurements only
    "Boehm_JProteomeRes2014": (1, 8, 9, 0), "Bruno_JExpBot2016": (6, 7, 13, 0),
    # Preequilibrations of right-hand sides that read time, through timed stimuli that
    # the preequilibration condition switches off or decides for t >= 0:
    "Brannmark_JBC2010": (8, 9, 22, 0), "Isensee_JCB2018": (123, 25, 46, 20),
    "Weber_BMC2015": (2, 7, 36, 0),
    "Chen_MSB2009": (4, 500, 155, 0), "Crauste_CellSystems2017": (1, 5, 12, 0),
    "Elowitz_Nature2000": (1, 8, 21, 0), "Fujita_SciSignal2010": (6, 9, 19, 0),
    "Lucarelli_CellSystems2018": (16, 33, 84, 0), "Zheng_PNAS2012": (1, 15, 46, 0),
}
REFUSED = {
    "Smith_BMCSystBiol2013": (gs.petab.UnsupportedSBML,
                              "SBML events are not supported (the model has 3: "
                              "'insulin_stimulation_end'"),
}


def _yaml(model):
    found = sorted((DATA / "Benchmark-Models" / model).glob("*.yaml"))
    assert len(found) == 1, found
    return found[0]


def _reference_llh(model):
    text = (DATA / "REFERENCES.md").read_text()
    return float(re.search(rf"^\| {model} \| (-?[0-9][0-9.e+-]*) \|", text, re.M).group(1))


def test_the_shared_set_is_what_this_file_covers():
    models = sorted(p.name for p in (DATA / "Benchmark-Models").iterdir() if p.is_dir())
    assert models == sorted({**LOADED, **REFUSED})


@pytest.mark.parametrize("model", sorted(LOADED))
def test_model_loads(model):
    prob = gs.petab.load(_yaml(model))
    shape = (prob.problem.n, prob.problem.d, len(prob.parameter_ids), len(prob.priors))
    assert shape == LOADED[model]


@pytest.mark.parametrize("model", sorted(REFUSED))
def test_model_is_refused_by_name(model):
    error, words = REFUSED[model]
    with pytest.raises(error, match=re.escape(words)):
        gs.petab.load(_yaml(model))


def test_bruno_llh_and_gradient_at_nominal():
    # The llh against AMICI's reference: AMICI's JAX backend checks these to 1e-3
    # (REFERENCES.md); ours at load's default rtol 1e-8, atol 1e-10 differs by 4.4e-6
    # (AMICI simulated at rtol = atol = 1e-8): the second bound is ~10x that.
    prob = gs.petab.load(_yaml("Bruno_JExpBot2016"))
    llh, ref = prob.llh(), _reference_llh("Bruno_JExpBot2016")
    assert abs(llh - ref) < 1e-3
    assert abs(llh - ref) < 5e-5, (llh, ref)
    # The gradient against central differences (step 1e-6) on the same mesh, for the
    # initial states and szea: measured 2.4e-8 relative at most (bound 3e-7). The
    # rate constants (k5, kb*, kc*, ~1e-3) are left out: the llh on a fixed mesh is
    # so curved in them that central differences scatter with the step (kc1:
    # 0.340, -0.02078, -0.02079, -0.02061 at steps 1e-5, 1e-7, 1e-9, 1e-11, against
    # the gradient's -0.02081).
    mesh = prob.record()
    value, grad = prob.llh_and_grad(mesh=mesh)
    # The same states, through the loss alone (llh) and through its value_and_grad: two
    # compiled programs, equal at XLA's default optimization level and 1 ulp apart at
    # the suite's level 0 (measured: 46.68818147044116 against ...441165).
    assert abs(value - llh) <= 4 * np.finfo(float).eps * abs(llh), (value, llh)
    h, th = 1e-6, prob.nominal
    for k in [k for k in prob.parameter_ids if k.startswith("init_") or k == "szea"]:
        up, down = dict(th), dict(th)
        up[k] += h
        down[k] -= h
        fd = (prob.mesh_llh(mesh, up) - prob.mesh_llh(mesh, down)) / (2 * h)
        assert abs(grad[k] - fd) <= 3e-7 * max(1.0, abs(fd)), (k, grad[k], fd)
