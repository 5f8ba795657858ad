"""Registered problems: the seed's test systems as JAX right-hand sides (their
hand-written fused Warp forms are in `gradsolve/warp/_registry.py`), and the neural
ones (`_neural.py`), whose fused forms the translator writes.
"""

from ._neural import (
    neural_robertson as neural_robertson,
    neural_spiral as neural_spiral,
)
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
