"""Tableau checks on build. Convergence orders and the order conditions of the
tableaux: tests/test_accuracy.py."""

import numpy as np
import pytest

from gradsolve.methods import ButcherTableau, tsit5


def test_tsit5_tableau_is_consistent():
    tab = tsit5.tableau
    assert tab.stages == 7 and tab.fsal and tab.order == 5
    # Rows of a sum to c, weights to one, error weights to zero: checked on build.
    np.testing.assert_allclose([r.sum() for r in tab.a_lower], tab.c, atol=1e-14)


def test_bad_tableau_is_refused():
    with pytest.raises(ValueError, match="do not sum to one"):
        ButcherTableau(name="bad", order=1, c=np.array([1.0]),
                       a_lower=(np.array([1.0]),), b=np.array([0.4, 0.4]),
                       b_error=np.array([0.5, -0.5]))
