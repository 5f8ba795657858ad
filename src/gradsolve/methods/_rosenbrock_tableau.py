"""Rosenbrock--Wanner tableaux as data, in the transformed form of Hairer & Wanner
(Solving ODEs II, Sec. IV.7, eq. (7.25)), the form OrdinaryDiffEq.jl publishes:

    (I / (h gamma) - J) u_i = f(t + c_i h, y + sum_{j<i} a_ij u_j)
                              + sum_{j<i} (C_ij / h) u_j + h d_i f_t
    y_new = y + sum_i m_i u_i,      error = sum_i m_err_i u_i

with J = df/dy and f_t = df/dt at (t, y). One matrix, factored once per step.
"""

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True, eq=False)
class RosenbrockTableau:
    """Coefficients of a Rosenbrock--Wanner method in transformed form.

    Args:
        name: the method's name (`method="rodas5p"`).
        order: order of the propagated solution (the controller uses it).
        gamma: the diagonal coefficient.
        a: `(s, s)` strictly lower-triangular stage-argument coefficients.
        C: `(s, s)` strictly lower-triangular stage-coupling coefficients.
        c: `(s,)` stage times.
        d: `(s,)` coefficients of `h f_t` (the `gamma_i` of the untransformed form).
        m: `(s,)` solution weights.
        m_err: `(s,)` error-estimate weights (`m - m_hat`).
        dense: `(k, s)` coefficients of the continuous extension, or None.
        dense_order: the order of that continuous extension (0 without one).
    """

    name: str
    order: int
    gamma: float
    a: np.ndarray
    C: np.ndarray
    c: np.ndarray
    d: np.ndarray
    m: np.ndarray
    m_err: np.ndarray
    dense: np.ndarray | None = None
    dense_order: int = 0

    def __post_init__(self):
        s = np.asarray(self.m).shape[0]
        for name in ("a", "C"):
            v = np.asarray(getattr(self, name), np.float64)
            if v.shape != (s, s) or np.any(np.triu(v) != 0):
                raise ValueError(f"{self.name}: {name} must be ({s}, {s}) strictly lower")
            object.__setattr__(self, name, v)
        for name in ("c", "d", "m", "m_err"):
            v = np.asarray(getattr(self, name), np.float64)
            if v.shape != (s,):
                raise ValueError(f"{self.name}: {name} must have shape ({s},)")
            object.__setattr__(self, name, v)
        if self.dense is not None:
            object.__setattr__(self, "dense", np.asarray(self.dense, np.float64))
        object.__setattr__(self, "gamma", float(self.gamma))

    @property
    def stages(self) -> int:
        return self.m.shape[0]
