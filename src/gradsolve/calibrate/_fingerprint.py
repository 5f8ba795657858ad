"""A fit's fingerprint, checked when a checkpoint is resumed: the traced loss and
optimizer, the shapes of data, theta0 and y0, and the state format; a mismatch names
what changed."""

import hashlib
import re

import equinox as eqx
import jax
import numpy as np

from .._version import __version__
from ._checkpoint import CheckpointMismatch, checksum


def abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype)
                        if eqx.is_array(x) or isinstance(x, np.ndarray) else x, tree)


def array_shapes(tree) -> dict:
    """`{leaf path: 'dtype[shape]'}` of the array leaves."""
    return {jax.tree_util.keystr(p): f"{np.dtype(x.dtype).name}{list(x.shape)}"
            for p, x in jax.tree_util.tree_leaves_with_path(tree)
            if isinstance(x, jax.ShapeDtypeStruct) or eqx.is_array(x)}


def jaxpr_hash(closed) -> str:
    """A hash of a traced function: its equations and its constants' bytes. What
    differs between two traces of the same function is removed: the printed addresses
    of Python objects, and a host call's FFI target name and call id (Warp numbers
    them in the order of tracing; `gradsolve.warp._jax` keys the call itself by what
    it computes)."""
    text = re.sub(r" at 0x[0-9a-fA-F]+", "", str(closed.jaxpr))
    text = re.sub(r"target_name=\S+|\('call_id', \d+\)", "", text)
    return hashlib.sha256(text.encode() + checksum(closed.consts).encode()).hexdigest()[:16]


FINGERPRINT_NAMES = {
    "loss": "the traced loss (loss, f_jax, to_params, to_y0 or transform)",
    "optimizer": "the optimizer (its kind or its constants, e.g. the learning rate)",
    "data": "the data", "theta0": "theta0", "y0": "the problem's y0",
    "state_format": "the fit state's format (the checkpoint is from an older gradsolve)"}


def check_meta(expected, directory, found):
    stored = found.get("fit")
    version = found.get("gradsolve")
    written_by = "" if version == __version__ else \
        f"; it was written by gradsolve {version}, this is {__version__}"
    if not isinstance(stored, dict):
        raise CheckpointMismatch(
            f"the checkpoint in {directory} was written without a fit fingerprint (an "
            f"older gradsolve); pass resume=False to start over, or use another "
            f"checkpoint_dir")
    keys = [k for k in expected if stored.get(k) != expected[k]]
    if keys:
        diffs = ", ".join(
            f"{FINGERPRINT_NAMES[k]} changed" if k in FINGERPRINT_NAMES else
            f"{k}: checkpoint {stored.get(k)!r} vs now {expected[k]!r}" for k in keys)
        raise CheckpointMismatch(
            f"the checkpoint does not match this fit ({diffs}{written_by}); resume with "
            f"the same setup, use another checkpoint_dir, or pass resume=False to start "
            f"over (deletes the checkpoints in {directory})")
