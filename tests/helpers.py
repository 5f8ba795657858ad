"""Shared test helpers (one home for each)."""

import numpy as np


def rel_err(a, b):
    """Max relative difference, relative to the larger of |b|'s max and 1e-300."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-300))


def tree_rel_err(a, b):
    import jax
    errs = jax.tree.leaves(jax.tree.map(rel_err, a, b))
    return max(errs)
