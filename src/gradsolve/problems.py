"""Builders for the seed's systems: `gs.problems.lorenz(n=...)` and friends."""

from .fields import (  # noqa: F401
    galactic_halo, hires, linear, linear_exact, linear_stiff, lorenz, lorenz96,
    neural_robertson, neural_spiral, robertson, van_der_pol,
)

__all__ = ["galactic_halo", "hires", "linear", "linear_exact", "linear_stiff", "lorenz",
           "lorenz96", "neural_robertson", "neural_spiral", "robertson", "van_der_pol"]
