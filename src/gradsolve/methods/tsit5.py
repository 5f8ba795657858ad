"""Tsitouras' 5(4) pair (Ch. Tsitouras, Comput. Math. Appl. 62 (2011) 770--775).

Seven stages, the last one evaluated at the new state (FSAL), so an accepted step
costs six evaluations of the right-hand side. The coefficients are the published
ones rounded to double precision.

The continuous extension is Tsitouras' fourth-degree interpolant of the same paper
(order 4, no further evaluations): `dense[i]` holds the coefficients of `theta^1` to
`theta^4` in stage i's weight, the values OrdinaryDiffEq.jl tabulates as `r_i1..r_i4`
(Diffrax's `_Tsit5Interpolation` writes the same polynomials factored). The tableau
checks that they end at `b` and sum to `theta`.
"""

import numpy as np

from ._erk import ExplicitRungeKutta
from ._tableau import ButcherTableau


tableau = ButcherTableau(
    name="tsit5",
    order=5,
    c=np.array([0.161, 0.327, 0.9, 0.9800255409045097, 1.0, 1.0]),
    a_lower=(
        np.array([0.161]),
        np.array([-0.008480655492356989, 0.335480655492357]),
        np.array([2.8971530571054935, -6.359448489975075, 4.3622954328695815]),
        np.array([5.325864828439257, -11.748883564062828, 7.4955393428898365,
                  -0.09249506636175525]),
        np.array([5.86145544294642, -12.92096931784711, 8.159367898576159,
                  -0.071584973281401, -0.028269050394068383]),
        np.array([0.09646076681806523, 0.01, 0.4798896504144996, 1.379008574103742,
                  -3.290069515436081, 2.324710524099774]),
    ),
    b=np.array([0.09646076681806523, 0.01, 0.4798896504144996, 1.379008574103742,
                -3.290069515436081, 2.324710524099774, 0.0]),
    b_error=np.array([0.0017800110522257773, 0.0008164344596567463,
                      -0.007880878010261994, 0.1447110071732629, -0.5823571654525552,
                      0.45808210592918686, -0.015151515151515152]),
    dense=np.array([
        [1.0, -2.763706197274826, 2.9132554618219126, -1.0530884977290216],
        [0.0, 0.13169999999999998, -0.2234, 0.1017],
        [0.0, 3.9302962368947516, -5.941033872131505, 2.490627285651253],
        [0.0, -12.411077166933676, 30.33818863028232, -16.548102889244902],
        [0.0, 37.50931341651104, -88.1789048947664, 47.37952196281928],
        [0.0, -27.896526289197286, 65.09189467479368, -34.87065786149661],
        [0.0, 1.5, -4.0, 2.5],
    ]),
    dense_order=4,
)

method = ExplicitRungeKutta(tableau)
