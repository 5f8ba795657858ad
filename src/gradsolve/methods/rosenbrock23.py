"""Constants of Shampine & Reichelt's ode23s Rosenbrock (2,3) pair
(L.F. Shampine, M.W. Reichelt, "The MATLAB ODE Suite", SIAM J. Sci. Comput. 18
(1997) 1--22, Sec. 3; `Rosenbrock23` in OrdinaryDiffEq.jl).

A modified Rosenbrock (W-) method: one matrix W = I - h d J (J = df/dy at (t, y)),
factored once per step, three solves, two new evaluations of f (three with the error
estimate). With f0 = f(t, y) and f_t = df/dt at (t, y) (drop the `h d f_t` terms for
autonomous use):

    k1    = W^{-1} (f0 + h d f_t)
    f1    = f(t + h/2, y + (h/2) k1)
    k2    = W^{-1} (f1 - k1) + k1
    y_new = y + h k2                                  (order 2, L-stable)
    f2    = f(t + h, y_new)                           (FSAL: the next step's f0)
    k3    = W^{-1} (f2 - e32 (k2 - f1) - 2 (k1 - f0) + h d f_t)
    error = (h / 6) (k1 - 2 k2 + k3)

Its continuous extension (the same paper's, MATLAB's ntrp23s; order 2, from k1 and k2
alone) at t + theta h:

    y(theta) = y + h (theta (1 - theta) k1 + theta (theta - 2 d) k2) / (1 - 2 d)

with d = 1 / (2 + sqrt(2)) and e32 = 6 + sqrt(2). gradsolve uses it for autonomous
systems only (the f_t terms are never formed; a field that reads t is refused). `error` is the order-3 solution
y + (h/6)(k1 + 4 k2 + k3) minus y_new, i.e. `y_hat - y_new` (the sign is the
opposite of `m_err`'s `y_new - y_hat`; a norm does not see it). The controller's
exponent follows `order` (the propagated order), as for the other pairs.
"""

import dataclasses

from ._rosenbrock import Rosenbrock23


@dataclasses.dataclass(frozen=True, eq=False)
class Rosenbrock23Constants:
    """The two constants of the ode23s pair (the step itself lives elsewhere)."""

    name: str
    order: int
    d: float
    e32: float
    dense_order: int = 2  # the ntrp23s interpolant above


tableau = Rosenbrock23Constants(
    name="rosenbrock23",
    order=2,
    d=0.2928932188134525,  # 1 / (2 + sqrt(2)) = 1 - 1/sqrt(2)
    e32=7.414213562373095,  # 6 + sqrt(2)
)

method = Rosenbrock23(tableau)
