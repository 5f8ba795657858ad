"""Step-size control: the error norm, the accept/reject rule, the step-size factor and
the first step. One home for all four: the JAX recorder calls these functions; the
fused Warp kernels embed copies generated from this module's constants
(`gradsolve/warp/_steps.py`) and take their first step from `initial_step` here
(through `recorder.first_step`).

The rules equal Diffrax's `PIDController(rtol, atol)` defaults (integral control,
`safety=0.9`, `factormin=0.2`, `factormax=10`), including its details: an accepted
step never shrinks the next one, a rejected step shrinks by at least `safety`, and a
step ending within 100 ulp of `t1` is snapped onto `t1`. Matching them is what lets
the recorder reproduce Diffrax's accepted and rejected steps, which the tests check.
"""

import jax.numpy as jnp
import numpy as np


SAFETY = 0.9
FACTOR_MIN = 0.2
FACTOR_MAX = 10.0


def rms_norm(x):
    """Root-mean-square over the last axis."""
    return jnp.sqrt(jnp.sum(x * x, axis=-1) / x.shape[-1])


def error_ratio(y, y_new, y_error, rtol, atol):
    """RMS of `y_error / (atol + rtol * max(|y|, |y_new|))`; a NaN anywhere reads as
    an infinite error, so the step is rejected rather than propagated."""
    y_new = jnp.where(jnp.isnan(y_new).any(axis=-1, keepdims=True), y, y_new)
    y_error = jnp.where(jnp.isnan(y_error), jnp.inf, y_error)
    scale = atol + rtol * jnp.maximum(jnp.abs(y), jnp.abs(y_new))
    return rms_norm(y_error / scale)


def propose(ratio, h, error_order):
    """Accept or reject a step of size `h` with error `ratio`; size the next one.

    Returns:
        `(accept, h_next)`.
    """
    accept = ratio < 1
    factor = SAFETY * (1 / ratio) ** (1 / error_order)  # ratio 0 gives inf: clipped
    lo = jnp.where(accept, 1.0, FACTOR_MIN)
    hi = jnp.where(accept, FACTOR_MAX, SAFETY)
    factor = jnp.clip(factor, lo, hi)
    return accept, h * factor.astype(h.dtype)


def t1_snap_floor(t1):
    """`t1` less 100 ulp: a proposed step end beyond it is moved onto `t1`, so that no
    sliver of a step is left at the end of the span."""
    t1 = np.asarray(t1)
    floor = t1
    for _ in range(100):
        floor = np.nextafter(floor, -np.inf)
    return floor


def clip_to_end(t, t_next, t1, floor, accepted):
    """The end of the next trial step, clipped to the span's end `t1`.

    After an accepted step a step reaching past `floor` is snapped onto `t1`; after a
    rejected one the retry is halved towards `t1`.
    """
    clipped = jnp.where(accepted, t1, t + 0.5 * (t1 - t))
    return jnp.where(t_next > floor, clipped, t_next)


def underflow(t, t_next):
    """Has the step size fallen below the resolution of `t`? A trial step from `t`
    to `t_next` that does not advance `t` (large `t`, tiny `h`: `t + h == t`) is
    never taken, accepted or rejected: the trajectory ends `DT_UNDERFLOW` at once.
    (Taking it would accept a zero-length step, and the retries after it would stall
    at the same size until `max_steps`.)"""
    return t_next <= t


def initial_step(f, t0, y0, args, error_order, rtol, atol):
    """Hairer & Wanner's first-step rule (Solving ODEs I, Sec. II.4), as in Diffrax's
    `_select_initial_step`, for one trajectory. Costs two evaluations of `f`."""
    scale = atol + jnp.abs(y0) * rtol
    f0 = f(t0, y0, args)
    d0 = rms_norm(y0 / scale)
    d1 = rms_norm(f0 / scale)
    small = (d0 < 1e-5) | (d1 < 1e-5)
    h0 = jnp.where(small, 1e-6, 0.01 * (d0 / jnp.where(small, 1, d1)))
    f1 = f(t0 + h0, y0 + h0 * f0, args)
    d2 = rms_norm((f1 - f0) / scale) / h0
    max_d = jnp.maximum(d1, d2)
    h1 = jnp.where(
        max_d <= 1e-15,
        jnp.maximum(1e-6, h0 * 1e-3),
        (0.01 / jnp.where(max_d <= 1e-15, 1, max_d)) ** (1 / error_order),
    )
    return jnp.minimum(100 * h0, h1).astype(y0.dtype)
