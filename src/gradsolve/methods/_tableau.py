"""Explicit Runge--Kutta tableaux as data.

A tableau is plain NumPy in a frozen dataclass, checked when it is built. The JAX
steps in `_erk.py` and the generated Warp step bodies (`gradsolve/warp/_steps.py`)
read the same object, so each method's coefficients exist exactly once.
"""

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True, eq=False)
class ButcherTableau:
    """Coefficients of an explicit Runge--Kutta pair.

    Args:
        name: the method's name, as users pass it (`method="tsit5"`).
        order: order of the propagated solution.
        c: stage times of stages 2..s, shape `(s-1,)`.
        a_lower: rows 2..s of the strictly lower-triangular matrix; row `i` has `i+1`
            entries.
        b: weights of the propagated solution, shape `(s,)`.
        b_error: `b - b_hat`, the weights of the embedded error estimate, shape `(s,)`.
        dense: the continuous extension, or None: shape `(s, q)`, the weight of stage
            `i` at `t + theta h` being `b_i(theta) = sum_m dense[i, m] theta^(m+1)`, so
            that `y(t + theta h) = y + h sum_i b_i(theta) f_i` from the step's own
            stages. Checked: `b_i(1) = b_i` (continuous at the step's end) and
            `sum_i b_i(theta) = theta` (exact on constant slopes).
        dense_order: the order of that continuous extension (0 without one).

    `fsal` (first stage of the next step equals the last stage of this one) is derived,
    not declared: it holds when the last stage is evaluated at `t + h` on `y_new`.

    Examples:
        >>> from gradsolve.methods import tsit5
        >>> tsit5.tableau.stages, tsit5.tableau.fsal
        (7, True)
    """

    name: str
    order: int
    c: np.ndarray
    a_lower: tuple[np.ndarray, ...]
    b: np.ndarray
    b_error: np.ndarray
    dense: np.ndarray | None = None
    dense_order: int = 0
    fsal: bool = dataclasses.field(init=False)

    def __post_init__(self):
        c = np.asarray(self.c, dtype=np.float64)
        a_lower = tuple(np.asarray(row, dtype=np.float64) for row in self.a_lower)
        b = np.asarray(self.b, dtype=np.float64)
        b_error = np.asarray(self.b_error, dtype=np.float64)
        s = b.shape[0]
        if c.shape != (s - 1,) or len(a_lower) != s - 1 or b_error.shape != (s,):
            raise ValueError(f"{self.name}: inconsistent tableau shapes for {s} stages")
        for i, row in enumerate(a_lower):
            if row.shape != (i + 1,):
                raise ValueError(f"{self.name}: a_lower[{i}] must have {i + 1} entries")
            # Row sums equal c: the stages are consistent in time (tolerance: the
            # published coefficients carry ~16 significant digits).
            if abs(row.sum() - c[i]) > 1e-13:
                raise ValueError(f"{self.name}: row {i + 2} of a does not sum to c")
        if abs(b.sum() - 1) > 1e-13:
            raise ValueError(f"{self.name}: the weights b do not sum to one")
        if abs(b_error.sum()) > 1e-13:
            raise ValueError(f"{self.name}: the error weights do not sum to zero")
        dense = self.dense
        if dense is not None:
            dense = np.asarray(dense, dtype=np.float64)
            if dense.ndim != 2 or dense.shape[0] != s:
                raise ValueError(f"{self.name}: dense must have shape ({s}, q)")
            if np.abs(dense.sum(axis=1) - b).max() > 1e-13:
                raise ValueError(f"{self.name}: the continuous extension does not end "
                                 f"at the step's solution (b_i(1) != b_i)")
            if np.abs(dense.sum(axis=0) - np.eye(dense.shape[1])[0]).max() > 1e-13:
                raise ValueError(f"{self.name}: the continuous extension's weights do "
                                 f"not sum to theta")
        fsal = bool(c[-1] == 1.0 and np.array_equal(a_lower[-1], b[:-1]) and b[-1] == 0)
        for name, value in (("c", c), ("a_lower", a_lower), ("b", b),
                            ("b_error", b_error), ("dense", dense), ("fsal", fsal)):
            object.__setattr__(self, name, value)

    @property
    def stages(self) -> int:
        return self.b.shape[0]
