"""Calibration: B concurrent Optax fits on the recorded mesh, with checkpoints."""

from . import _transforms as transforms
from ._checkpoint import CheckpointLocked as CheckpointLocked
from ._checkpoint import CheckpointMismatch as CheckpointMismatch
from ._calibrator import Calibrator as Calibrator
from ._state import FitState as FitState, FitStatus as FitStatus
from ._multistart import multistart as multistart
from ._result import FitResult as FitResult

__all__ = ["Calibrator", "CheckpointLocked", "CheckpointMismatch", "FitResult", "FitState", "FitStatus", "multistart",
           "transforms"]
