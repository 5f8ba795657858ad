"""PEtab import: calibration problems in the field's standard format.

`gs.petab.load("problem.yaml")` reads a PEtab v1 problem -- an SBML model and the
condition, measurement, observable and parameter tables -- into a `PetabProblem`:
an ensemble with one trajectory per simulation condition, the PEtab likelihood, and a
`gs.Calibrator` over multistart fits (docs/petab.md). It needs the optional
dependencies `pip install "gradsolve[petab]"` (petab, python-libsbml, sbmlmath,
sympy); the rest of gradsolve does not.
"""

import importlib.util
import os

import jax

from ..config import DEFAULT_MAX_STEPS

EXTRA = ("petab", "libsbml", "sbmlmath", "sympy")
_LAZY = ("PetabProblem", "PetabError", "UnsupportedSBML", "Model")


def _require():
    missing = [m for m in EXTRA if importlib.util.find_spec(m) is None]
    if missing:
        raise ImportError(
            f"gs.petab needs the optional dependencies {missing}: "
            f"pip install \"gradsolve[petab]\"")


def load(path, *, rtol=1e-8, atol=1e-10, max_steps=DEFAULT_MAX_STEPS, stiff=True, fused=None,
         name=None):
    """Read a PEtab v1 problem (its YAML file) into a `gs.petab.PetabProblem`.

    Args:
        path: the problem's YAML file (tables and model are found relative to it).
        rtol, atol: tolerances of every simulation, record and fit of the problem.
        max_steps: the cap on attempted steps per trajectory of every record and fit
            (a model that needs more fails naming it; raise it here).
        stiff: integrate with the stiff default method (systems-biology models are
            often stiff); False: Tsit5.
        fused: passed to `gs.solve` (None: the router; the generated right-hand side
            is a JAX function, which the Warp translator also takes).
        name: the problem's name (default: the YAML file's name).

    Returns:
        A `PetabProblem`: `.problem` (the `gs.EnsembleProblem`), `.nominal`,
        `.simulate(theta)`, `.llh(theta)`, `.chi2(theta)`, `.llh_and_grad(theta)`,
        `.calibrator(starts, optimizer)`, `.starts(n, key)`, `.summary(result)`.

    Raises:
        ImportError: the `petab` extra is not installed.
        gs.petab.UnsupportedSBML: the model uses SBML this importer does not handle
            (events, delays, algebraic rules, ...), named in the message.
        gs.petab.PetabError: a table entry it cannot take, named in the message.

    Examples:
        >>> import gradsolve as gs
        >>> prob = gs.petab.load(gs.petab.test_case("0001"))
        >>> prob.parameter_ids, prob.problem.n
        (('a0', 'b0', 'k1', 'k2'), 1)
        >>> round(prob.llh(), 6), round(prob.chi2(), 6)
        (-0.847502, 0.791838)
        >>> prob.simulate()["simulation"].round(4).tolist()
        [1.0, 0.4286]
    """
    _require()
    from petab import v1 as petab_v1  # the petab extra
    from ._problem import PetabProblem  # (needs sympy: the petab extra)
    from ._sbml import check_model, from_sbml  # (needs sympy: the petab extra)

    if isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 1:
        raise ValueError(f"max_steps must be a positive integer, got {max_steps!r}")
    if not jax.config.jax_enable_x64:
        raise ValueError("gs.petab.load needs float64: call "
                         "jax.config.update('jax_enable_x64', True) first")
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no PEtab problem file at {path!r}")
    problem = petab_v1.Problem.from_yaml(path)
    if problem.model is None or not hasattr(problem.model, "sbml_model"):
        raise ValueError(f"{path}: gs.petab reads SBML models only")
    model = from_sbml(problem.model.sbml_model)
    check_model(model)
    name = name or os.path.splitext(os.path.basename(path))[0]
    return PetabProblem(problem, model, rtol=rtol, atol=atol, max_steps=max_steps,
                        stiff=stiff, fused=fused, name=name)


def test_case(case: str, version: str = "v1.0.0", fmt: str = "sbml") -> str:
    """The YAML file of a PEtab test-suite case from the `petabtests` package, e.g.
    `test_case("0009")` (install it with `pip install --no-deps petabtests`)."""
    spec = importlib.util.find_spec("petabtests")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("the PEtab test suite is the petabtests package: "
                          "pip install --no-deps petabtests")
    folder = os.path.join(spec.submodule_search_locations[0], "cases", version, fmt, case)
    path = os.path.join(folder, f"_{case}.yaml")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no PEtab test case {case!r} ({version}, {fmt}) at {folder}")
    return path


def __getattr__(name):
    if name in _LAZY:
        _require()
        from . import _problem, _sbml, _tables  # (need sympy: the petab extra)
        return getattr(_problem, name, None) or getattr(_tables, name, None) \
            or getattr(_sbml, name)
    raise AttributeError(f"module 'gradsolve.petab' has no attribute {name!r}")
