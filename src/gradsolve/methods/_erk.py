"""The two ingredients an explicit Runge--Kutta pair supplies: a trial step with an
embedded error estimate (for the recorder) and a plain step (for the replay).

Both act on ONE trajectory (`y` of shape `(d,)`); the recorder and the replay `vmap`
them over the ensemble. Coefficients are cast to the state's dtype at trace time, so
the same tableau serves float32 and float64.
"""

import dataclasses
from collections.abc import Callable

import jax.numpy as jnp
import numpy as np

from ._base import Method
from ._tableau import ButcherTableau


def _combine(h, weights, fs):
    """`h * sum_j w_j f_j` over the nonzero weights."""
    w = jnp.asarray(weights, fs[0].dtype)
    return h * sum(w[j] * fs[j] for j in range(len(fs)) if weights[j] != 0)


def error_estimate(h, weights, fs):
    """`h * sum_j w_j f_j` for error weights summing to zero, written as
    `h * sum_{j>0} w_j (f_j - f_0)`: the same number in exact arithmetic, but the
    differences are small and exact-ish where the naive sum cancels catastrophically
    (at tiny steps all f_j agree to many digits). It keeps the error ratio -- and so
    the step sizes -- reproducible across backends (JAX, Warp) to ~1e-12 instead of
    ~1e-6 at the first steps."""
    w = jnp.asarray(weights, fs[0].dtype)
    return h * sum(w[j] * (fs[j] - fs[0]) for j in range(1, len(fs)) if weights[j] != 0)


def _stages(tab: ButcherTableau, f, t, y, h, args, f0, n_stages):
    """Stage slopes `f_i = f(t + c_i h, y + h sum_j a_ij f_j)` for the first
    `n_stages` stages, starting from the given first slope `f0 = f(t, y)`."""
    fs = [f0]
    for i in range(1, n_stages):
        y_i = y + _combine(h, tab.a_lower[i - 1], fs)
        fs.append(f(t + jnp.asarray(tab.c[i - 1], y.dtype) * h, y_i, args))
    return fs


@dataclasses.dataclass(frozen=True, eq=False)
class ExplicitRungeKutta(Method):
    """An explicit embedded Runge--Kutta method built from a `ButcherTableau`."""

    tableau: ButcherTableau

    def _full_step(self, f, t, y, f0, h, args):
        """`(y_new, stage slopes, f(t + h, y_new))` of a step of size `h`."""
        tab = self.tableau
        fs = _stages(tab, f, t, y, h, args, f0, tab.stages)
        y_new = y + _combine(h, tab.b, fs)
        # FSAL: the last stage was evaluated at (t + h, y_new) already.
        f_new = fs[-1] if tab.fsal else f(t + h, y_new, args)
        return y_new, fs, f_new

    def trial_step(self, f: Callable, t, y, f0, h, args):
        """One attempted step of size `h` from `(t, y)`.

        Args:
            f: right-hand side `f(t, y, args)` of one trajectory.
            f0: `f(t, y, args)`, carried from the previous accepted step (FSAL).

        Returns:
            `(y_new, y_error, f_new)`: the propagated state, the embedded error
            estimate, and `f(t + h, y_new)` for the next step's first stage.
        """
        y_new, fs, f_new = self._full_step(f, t, y, f0, h, args)
        return y_new, error_estimate(h, self.tableau.b_error, fs), f_new

    @property
    def has_dense_output(self) -> bool:
        return self.tableau.dense is not None

    def dense_step(self, f: Callable, t, y, f0, h, args):
        """A step that keeps what its continuous extension needs.

        Returns:
            `(y_new, K, f_new)`: the propagated state, the slopes `K` of shape
            `(s + e, d)` (the step's stages, then the tableau's extra ones, for
            `interpolate`), and `f(t + h, y_new)`, the next step's `f0`.
        """
        tab = self.tableau
        y_new, fs, f_new = self._full_step(f, t, y, f0, h, args)
        for c, row in zip(tab.extra_c, tab.extra_a):
            if c == 1.0 and np.array_equal(row, np.pad(tab.b, (0, len(row) - len(tab.b)))):
                fs.append(f_new)  # at (t + h, y_new): the next step's f0, evaluated
            else:
                fs.append(f(t + jnp.asarray(c, y.dtype) * h, y + _combine(h, row, fs), args))
        return y_new, jnp.stack(fs), f_new

    dense_errors = True

    def dense_error(self, h, K):
        """The embedded error estimate of a step of size `h` from the slopes `K` its
        `dense_step` kept (the step's own stages first): `trial_step`'s `y_error`,
        with no evaluation of `f`."""
        return error_estimate(h, self.tableau.b_error, [K[i] for i in range(self.tableau.stages)])

    def interpolate(self, y, y_new, h, K, theta):
        """The state at `t + theta h` inside the step `(t, y) -> y_new` of size `h`
        with stage slopes `K` (from `dense_step`): `y + h sum_i b_i(theta) K_i`."""
        del y_new  # the interpolant is written from the step's start
        # Horner in theta - 1/2, every stage's weight at once (the Warp kernels write
        # the same sums, `_steps._dense_weights`).
        centered = jnp.asarray(self.tableau.dense_centered, y.dtype)
        s = theta - 0.5
        w = centered[:, -1]
        for m in range(centered.shape[1] - 2, -1, -1):
            w = centered[:, m] + s * w
        return y + h * ((theta * w) @ K)

    def plain_step(self, f: Callable, t, y, h, args):
        """One step of size `h` with no error estimate: what the replay differentiates.

        A zero step returns `y` exactly (the increment is `0 * sum(...)`).
        """
        tab = self.tableau
        # Stages after the last nonzero weight only feed the error estimate (Tsit5's
        # FSAL stage, Vern7's tenth): skip them.
        n = int(np.flatnonzero(tab.b)[-1]) + 1
        fs = _stages(tab, f, t, y, h, args, f(t, y, args), n)
        return y + _combine(h, tab.b[:n], fs)
