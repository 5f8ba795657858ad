"""Per-trajectory outcomes. The values are what a user is told."""

import enum

import numpy as np


class Status(enum.IntEnum):
    """Outcome of one trajectory's solve or record.

    Examples:
        >>> from gradsolve import Status
        >>> Status(1).message
        'the maximum number of steps was reached before t1'
    """

    SUCCESS = 0
    MAX_STEPS = 1
    NONFINITE = 2
    DT_UNDERFLOW = 3

    @property
    def message(self) -> str:
        return _MESSAGES[self]


_MESSAGES = {
    Status.SUCCESS: "success",
    Status.MAX_STEPS: "the maximum number of steps was reached before t1",
    Status.NONFINITE: "the state became non-finite",
    Status.DT_UNDERFLOW: "the step size fell below the resolution of t",
}


def summarize(status) -> str:
    """One line counting each failure kind, e.g. `'2 of 8 trajectories failed: ...'`."""
    status = np.asarray(status)
    bad = status != Status.SUCCESS
    if not bad.any():
        return f"all {status.size} trajectories succeeded"
    parts = []
    for code in np.unique(status[bad]):
        idx = np.flatnonzero(status == code)
        shown = ", ".join(map(str, idx[:5])) + (", ..." if idx.size > 5 else "")
        parts.append(f"{Status(int(code)).message} (trajectories {shown})")
    return f"{int(bad.sum())} of {status.size} trajectories failed: " + "; ".join(parts)


class TrajectoryFailure(RuntimeError):
    """Raised when a result is asked for while some trajectories failed."""
