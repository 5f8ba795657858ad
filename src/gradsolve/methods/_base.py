"""What every method is: a tableau (data) plus the two steps the recorder and the
replay call, `trial_step(f, t, y, f0, h, args) -> (y_new, y_error, f(t+h, y_new))` and
`plain_step(f, t, y, h, args) -> y_new`, both for ONE trajectory.

A method with a continuous extension (`has_dense_output`) adds two more, which serve
output times from the mesh's own steps: `dense_step(f, t, y, f0, h, args) -> (y_new,
K, f(t+h, y_new))` keeps the step's slopes `K`, and `interpolate(y, y_new, h, K,
theta)` is the state at `t + theta h`, `0 <= theta <= 1`, with no further evaluation
of `f`. Where the kept slopes include every stage of the step (an explicit pair's),
`dense_error(h, K)` is the step's embedded error estimate from them: what lets a
replay tell whether the controller would still accept its mesh
(`replay.replay_function(..., check=True)`)."""

import dataclasses
from typing import Any, ClassVar


@dataclasses.dataclass(frozen=True, eq=False)
class Method:
    tableau: Any
    implicit: ClassVar[bool] = False
    autonomous_only: ClassVar[bool] = False

    @property
    def name(self) -> str:
        return self.tableau.name

    has_dense_output: ClassVar[bool] = False
    dense_errors: ClassVar[bool] = False  # `dense_error(h, K)` is served

    @property
    def dense_order(self) -> int:
        """The order of the continuous extension (0 without one): outputs inside a
        step of size h are accurate to O(h^(dense_order + 1)) locally."""
        return getattr(self.tableau, "dense_order", 0) if self.has_dense_output else 0

    @property
    def error_order(self) -> int:
        """The controller's exponent is `-1 / error_order`. For a p(p-1) pair the
        estimate `y - y_hat` is locally O(h^p) (the embedded solution's local error),
        so this is the order p -- Diffrax's convention, which the recorder matches."""
        return self.tableau.order
