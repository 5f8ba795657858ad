"""A fit's fingerprint, checked when a checkpoint is resumed: the traced loss and
optimizer, the shapes of data, theta0 and y0, and the state format; a mismatch names
what changed."""

import functools
import hashlib
import re

import equinox as eqx
import jax
import numpy as np
import optax

from .._version import __version__
from . import _least_squares
from ._checkpoint import CheckpointMismatch, checksum
from ._state import STATE_FORMAT


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


def of(cal, state, static, theta0, K, tol, grad_tol) -> dict:
    """What a checkpoint of the Calibrator `cal`'s fit must match to be resumed: the
    settings, checksums of the inputs, and hashes of the traced loss (f_jax,
    to_params, transform, loss, the replay) and of the traced optimizer update (its
    kind and constants, such as the learning rate; `_traced`). `steps` is not part of
    it: it is a cap."""
    B = state.active.shape[0]
    cfg, prob = cal.config, cal.problem
    loss, optimizer = _traced(cal, state, static, K)
    return {
        "problem": prob.name, "t_span": [float(t) for t in prob.t_span],
        "y0": checksum(prob.y0)[:16], "method": cfg.method, "rtol": cfg.rtol,
        "atol": cfg.atol, "max_steps": cfg.max_steps, "engine": cal.engine,
        "dt0": None if cfg.dt0 is None else checksum(np.asarray(cfg.dt0))[:16],
        "ts": None if cfg.ts is None else [float(t) for t in cfg.ts],
        "dtype": str(prob.y0.dtype), "B": int(B), "K": int(K),
        "refresh_every": cal.refresh_every, "refresh_tol": cal.refresh_tol,
        "drift_every": cal.drift_every,
        "drift_tol": cal.drift_tol, "tol": tol, "grad_tol": grad_tol,
        "batch_size": cal.batch_size, "state_format": STATE_FORMAT,
        "theta0": checksum(eqx.filter(theta0, eqx.is_array))[:16],
        "data": checksum(cal.data)[:16], "loss": loss, "optimizer": optimizer}


def _traced(cal, state, static, K):
    """The hashes of the traced loss and optimizer update, kept on the Calibrator per
    signature: tracing and printing them took ~0.25 s of every fit with a
    checkpoint_dir (measured here on recipes/multistart.py's fit, ~4 % of a 2000-update
    fit of 5.6 s). The signature is what the traces depend on besides the Calibrator's
    own functions: the shapes and dtypes of the arrays traced, and `static`'s leaves
    (theta0's non-array leaves: fitted arrays are floating point, `_validate`); one
    that cannot be hashed is traced every time."""
    leaves, tree = jax.tree.flatten((
        abstract((state.u, state.opt_state, state.mesh, cal.data, cal.problem.y0)), static))
    key = (tree, tuple(leaves), int(K), id(cal.objective), id(cal.optimizer))
    cache = cal.__dict__.setdefault("_traced_hashes", {})
    try:
        return cache[key]
    except TypeError:  # an unhashable leaf
        key = None
    except KeyError:
        pass
    hashes = _trace(cal, state, static, K)
    if key is not None:
        cache[key] = hashes
    return hashes


def _trace(cal, state, static, K):
    prob = cal.problem
    mesh = None
    if state.mesh is not None:  # a fixed width: the hash must not depend on a record
        mesh = cal._mesh(dict(jax.tree.map(abstract, state.mesh),
                               h=jax.ShapeDtypeStruct((prob.n, 8), state.mesh["h"].dtype)))
    losses = functools.partial(cal.objective.losses, static=static, K=K)
    loss_jaxpr = jax.make_jaxpr(lambda u, m, d, y: losses(u, mesh=m, data=d, y0=y))(
        abstract(state.u), mesh, abstract(cal.data), abstract(prob.y0))
    # With optax's extra arguments, as the update passes them (`_objective.make_update`):
    # a transformation that ignores them traces as without them.
    if cal.optimistix:  # a step of the solver on a stand-in objective
        opt_jaxpr = _least_squares.fingerprint_jaxpr(cal.optimizer, jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), abstract(state.u)))
    else:
        extra_args = optax.with_extra_args_support(cal.optimizer)
        opt_jaxpr = jax.make_jaxpr(jax.vmap(lambda g, s, u: extra_args.update(
            g, s, u, value=0.0, grad=g, value_fn=optax.tree.norm)))(
            abstract(state.u), abstract(state.opt_state), abstract(state.u))
    return jaxpr_hash(loss_jaxpr), jaxpr_hash(opt_jaxpr)
