"""The fit state: what a fit needs to continue (it is what a checkpoint holds), its
statuses, and the format version that is part of a checkpoint's fingerprint."""

import enum
from typing import Any, NamedTuple

import jax
import numpy as np


class FitStatus(enum.IntEnum):
    """Outcome of one fit."""

    RUNNING = 0
    CONVERGED = 1
    STEP_CAP = 2
    NONFINITE = 3
    RECORD_FAILED = 4
    QUEUED = 5  # recorded, waiting for a slot (`fit(..., slots=)`)


# What a checkpointed FitState means, part of the fingerprint: 2 counts every fit's own
# updates (history and drift per fit, minibatch keys per start) -- a format-1 state
# (one global update count) would resume into different draws and refreshes.
STATE_FORMAT = 2


class FitState(NamedTuple):
    """Everything a fit needs to continue: arrays only (it is what is checkpointed).

    It holds every start of a fit; the compiled update runs on a window of them (the
    slots, see `Calibrator.fit`), which is written back before a checkpoint."""

    u: Any               # unconstrained parameters, leaves lead with B
    opt_state: Any       # per-fit optimizer state, leaves lead with B
    active: jax.Array    # (B,) still to update (queued or running)
    status: jax.Array    # (B,) FitStatus
    steps: jax.Array     # (B,) updates applied
    loss: jax.Array      # (B,) loss at the last update the fit was active in
    grad_norm: jax.Array  # (B,)
    history: np.ndarray  # (steps, B) loss at each of a fit's updates; on the host
    drift: np.ndarray    # (steps, B) drift figure at a fit's update, where a check ran
    update: jax.Array    # () updates of the window done
    refreshes: jax.Array  # () mesh refreshes so far
    key: jax.Array       # fit b's minibatch at its update t: fold_in(fold_in(key, b), t)
    mesh: Any            # the mesh's arrays (None for an engine without a mesh)


def continued(state: FitState, steps: int) -> FitState:
    """A restored state made ready for a cap of `steps`: the host history and drift
    grown to it, fits that stopped only at the old cap running again, and fits still
    running (saved by an interrupt) that are at or past the new cap stopped at it, with
    no further update. In NumPy, and
    handed back as fresh (uncommitted) arrays: Orbax's arrays are committed to a
    device, which `jit` keys apart, so they would recompile the update once more."""
    state = jax.tree.map(np.asarray, state)

    def grown(a):
        out = np.full((max(steps, a.shape[0]),) + a.shape[1:], np.nan, a.dtype)
        out[:a.shape[0]] = a
        return out
    again = (state.status == FitStatus.STEP_CAP) & (state.steps < steps)
    capped = state.active & (state.steps >= steps)
    status = np.where(again, FitStatus.RUNNING, np.where(capped, FitStatus.STEP_CAP,
                                                         state.status))
    state = state._replace(active=(state.active | again) & ~capped,
                           status=status.astype(state.status.dtype))
    # device_put, not jnp.asarray: the latter compiles a copy per shape in this JAX.
    return jax.device_put(state)._replace(history=grown(state.history),
                                          drift=grown(state.drift))
