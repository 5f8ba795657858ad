"""Explicit Runge--Kutta tableaux as data.

A tableau is plain NumPy in a frozen dataclass, checked when it is built. The JAX
steps in `_erk.py` and the generated Warp step bodies (`gradsolve/warp/_steps.py`)
read the same object, so each method's coefficients exist exactly once.
"""

import dataclasses

import numpy as np
from numpy.polynomial import Polynomial


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
        dense: the continuous extension, or None: shape `(s + e, q)`, the weight of
            stage `i` at `t + theta h` being `b_i(theta) = sum_m dense[i, m]
            theta^(m+1)`, so that `y(t + theta h) = y + h sum_i b_i(theta) f_i` from
            the step's stages and its `e` extra ones. Checked: `b_i(1) = b_i` (0 for
            an extra stage: continuous at the step's end) and `sum_i b_i(theta) =
            theta` (exact on constant slopes).
        dense_order: the order of that continuous extension (0 without one).
        extra_c, extra_a: stages evaluated for the continuous extension only (Verner's
            interpolants), appended after the `s` stages of the step: their times,
            shape `(e,)`, and their rows of `a`, row `j` with `s + j` entries. None:
            the extension reads the step's own stages (Tsit5's).

    `fsal` (first stage of the next step equals the last stage of this one) is derived,
    not declared: it holds when the last stage is evaluated at `t + h` on `y_new`. So
    is `dense_centered`, the form the steps evaluate the extension in (`b_i(theta) =
    theta sum_m dense_centered[i, m] (theta - 1/2)^m`): the published monomials
    cancel (Vern7's coefficients reach 1.2e3 for weights below 0.5, so float32 would
    lose three digits), the centred ones are ~20 in all at most.

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
    extra_c: np.ndarray | None = None
    extra_a: tuple[np.ndarray, ...] | None = None
    fsal: bool = dataclasses.field(init=False)
    dense_centered: np.ndarray | None = dataclasses.field(init=False)

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
        extra_c = np.zeros(0) if self.extra_c is None else np.asarray(self.extra_c, np.float64)
        extra_a = tuple(np.asarray(row, np.float64) for row in self.extra_a or ())
        if len(extra_a) != extra_c.shape[0]:
            raise ValueError(f"{self.name}: extra_c and extra_a describe different "
                             f"numbers of extra stages")
        for j, row in enumerate(extra_a):
            if row.shape != (s + j,) or abs(row.sum() - extra_c[j]) > 1e-13:
                raise ValueError(f"{self.name}: extra stage {j + 1} needs {s + j} "
                                 f"coefficients summing to its c")
        dense = self.dense
        if dense is not None:
            dense = np.asarray(dense, dtype=np.float64)
            e = extra_c.shape[0]
            if dense.ndim != 2 or dense.shape[0] != s + e:
                raise ValueError(f"{self.name}: dense must have shape ({s + e}, q)")
            # Sums of rounded coefficients: exact up to roundoff in the terms' size
            # (Verner's reach 1.2e3, so a row's sum carries ~1e-13).
            slack = [1e-13 + 16 * np.finfo(np.float64).eps * np.abs(dense).sum(axis)
                     for axis in (0, 1)]
            if np.any(np.abs(dense.sum(axis=1) - np.pad(b, (0, e))) > slack[1]):
                raise ValueError(f"{self.name}: the continuous extension does not end "
                                 f"at the step's solution (b_i(1) != b_i)")
            if np.any(np.abs(dense.sum(axis=0) - np.eye(dense.shape[1])[0]) > slack[0]):
                raise ValueError(f"{self.name}: the continuous extension's weights do "
                                 f"not sum to theta")
        fsal = bool(c[-1] == 1.0 and np.array_equal(a_lower[-1], b[:-1]) and b[-1] == 0)
        # b_i(theta) / theta = sum_m dense[i, m] theta^m, re-expanded about theta = 1/2.
        centered = None if dense is None else np.stack(
            [np.pad(c, (0, dense.shape[1] - len(c))) for c in
             (Polynomial(row)(Polynomial([0.5, 1.0])).coef for row in dense)])
        for name, value in (("c", c), ("a_lower", a_lower), ("b", b),
                            ("b_error", b_error), ("dense", dense), ("fsal", fsal),
                            ("extra_c", extra_c), ("extra_a", extra_a),
                            ("dense_centered", centered)):
            object.__setattr__(self, name, value)

    @property
    def stages(self) -> int:
        return self.b.shape[0]

    @property
    def dense_stages(self) -> int:
        """The step's stages and the extension's extra ones."""
        return self.stages + self.extra_c.shape[0]

    @property
    def c_all(self) -> np.ndarray:
        """`c` of stages 2..s, then of the extra stages."""
        return np.concatenate([self.c, self.extra_c])

    @property
    def a_all(self) -> tuple[np.ndarray, ...]:
        """`a_lower`, then the extra stages' rows: row `j - 1` builds stage `j`."""
        return self.a_lower + self.extra_a
