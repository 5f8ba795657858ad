"""Registered problems: the seed's test systems as JAX right-hand sides.

(Their hand-written fused Warp forms arrive with the fused engines.)
"""

from ._systems import (
    galactic_halo as galactic_halo,
    hires as hires,
    linear as linear,
    linear_exact as linear_exact,
    linear_stiff as linear_stiff,
    lorenz as lorenz,
    lorenz96 as lorenz96,
    robertson as robertson,
    van_der_pol as van_der_pol,
)
