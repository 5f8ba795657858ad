"""The runnable examples in the public docstrings run and print what they say."""

import doctest
import importlib

import pytest


MODULES = ["gradsolve.problem", "gradsolve.mesh", "gradsolve.record", "gradsolve.replay", "gradsolve.layout._arrangement",
           "gradsolve.grad", "gradsolve.solve", "gradsolve.router", "gradsolve.status",
           "gradsolve.methods._tableau", "gradsolve.fields._systems", "gradsolve.fields._neural",
           "gradsolve.warp._registry",
           "gradsolve.calibrate._calibrator", "gradsolve.calibrate._transforms",
           "gradsolve.calibrate._multistart", "gradsolve.calibrate._result", "gradsolve.petab"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
