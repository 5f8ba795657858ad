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


def rel_err_componentwise(a, b):
    """Max over the entries of |a - b| / |b| (entries equal in both count zero): every
    entry against its own size, so a small species (Robertson's y2 ~ 6e-6) is held to
    the same relative accuracy as a large one, which `rel_err` does not do."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    diff = np.abs(a - b)
    with np.errstate(divide="ignore", invalid="ignore"):
        return float(np.max(np.where(diff == 0, 0.0, diff / np.abs(b))))
