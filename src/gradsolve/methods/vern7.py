"""Verner's "most efficient" 7(6) pair (J.H. Verner, "Numerically optimal
Runge--Kutta pairs with interpolants", Numer. Algorithms 53 (2010) 383--396).

Ten stages per step, not FSAL: the last two stages both sit at `t + h`, stage 9
feeds the 7th-order solution and stage 10 only the 6th-order embedded one
(`b[9] == 0`). The six further stages Verner adds for his interpolant are left
out. The coefficients are the published rationals rounded to double precision.
"""

import numpy as np

from ._erk import ExplicitRungeKutta
from ._tableau import ButcherTableau


tableau = ButcherTableau(
    name="vern7",
    order=7,
    c=np.array([0.005, 0.10888888888888888, 0.16333333333333333, 0.4555,
                0.6095094489978381, 0.884, 0.925, 1.0, 1.0]),
    a_lower=(
        np.array([0.005]),
        np.array([-1.07679012345679, 1.185679012345679]),
        np.array([0.04083333333333333, 0.0, 0.1225]),
        np.array([0.6389139236255726, 0.0, -2.455672638223657, 2.272258714598084]),
        np.array([-2.6615773750187572, 0.0, 10.804513886456137, -8.3539146573962,
                  0.820487594956657]),
        np.array([6.067741434696771, 0.0, -24.711273635911084, 20.427517930788895,
                  -1.9061579788166472, 1.006172249242068]),
        np.array([12.054670076253203, 0.0, -49.75478495046899, 41.142888638604674,
                  -4.461760149974004, 2.042334822239175, -0.09834843665406108]),
        np.array([10.138146522881808, 0.0, -42.6411360317175, 35.76384003992257,
                  -4.3480228403929075, 2.0098622683770357, 0.3487490460338272,
                  -0.27143900510483127]),
        np.array([-45.030072034298676, 0.0, 187.3272437654589, -154.02882369350186,
                  18.56465306347536, -7.141809679295079, 1.3088085781613785, 0.0,
                  0.0]),
    ),
    b=np.array([0.04715561848627222, 0.0, 0.0, 0.25750564298434153,
                0.2621665397741262, 0.15216092656738558, 0.49399691700324844,
                -0.29430311714032503, 0.0813174723249511, 0.0]),
    b_error=np.array([0.0025470118799310456, 0.0, 0.0, -0.00965839487279575,
                      0.0420647097563969, -0.0666822437469301, 0.26500974646212816,
                      -0.29430311714032503, 0.0813174723249511,
                      -0.020295184663356284]),
)

method = ExplicitRungeKutta(tableau)
