"""Parameter transforms: fit in an unconstrained space, report in the constrained one.

A transform is a pair of elementwise maps, `forward(u) -> theta` and
`inverse(theta) -> u`. The Calibrator optimises `u`; users give and receive `theta`.
"""

import abc
import math
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp


class Transform(eqx.Module):
    """Base of the elementwise bijections below."""

    @abc.abstractmethod
    def forward(self, u):
        """Unconstrained `u` to the parameter `theta`."""

    @abc.abstractmethod
    def inverse(self, theta):
        """The parameter `theta` to its unconstrained `u`."""


class Identity(Transform):
    """No constraint."""

    def forward(self, u):
        return u

    def inverse(self, theta):
        return theta


def _squash(u, lo, hi):
    """`lo + (hi - lo) * sigmoid(u)`: the real line onto `(lo, hi)`."""
    return lo + (hi - lo) * jax.nn.sigmoid(u)


def _unsquash(z, lo, hi):
    """The inverse of `_squash` (the logit of z's position in `(lo, hi)`)."""
    x = (z - lo) / (hi - lo)
    return jnp.log(x) - jnp.log1p(-x)


def _check_bounds(name, lo, hi, positive=False):
    if (lo is None) != (hi is None):
        raise ValueError(f"{name} takes both bounds or neither, got lo={lo}, hi={hi}")
    if lo is None:
        return
    if not hi > lo:
        raise ValueError(f"{name} needs hi > lo, got lo={lo}, hi={hi}")
    if positive and not lo > 0:
        raise ValueError(f"{name} bounds are on a log scale and must be > 0, got lo={lo}")


class Bounded(Transform):
    """PEtab's `lin` scale with bounds: `theta = lo + (hi - lo) * sigmoid(u)`, strictly
    inside `(lo, hi)`. The optimizer sees the logit of theta's position in the interval.

    Examples:
        >>> import jax.numpy as jnp, gradsolve as gs
        >>> t = gs.transforms.Bounded(0.5, 1.0)
        >>> round(float(t.forward(t.inverse(jnp.array(0.8)))), 12)
        0.8
    """

    lo: float
    hi: float

    def __check_init__(self):
        _check_bounds("Bounded", self.lo, self.hi)

    def forward(self, u):
        return _squash(u, self.lo, self.hi)

    def inverse(self, theta):
        return _unsquash(theta, self.lo, self.hi)


class Log(Transform):
    """PEtab's `log` scale: the optimizer sees `u = ln(theta)`, so rates across decades
    take equal-sized steps. With bounds `lo < theta < hi` (in theta's own units, as
    PEtab's lowerBound and upperBound), `ln(theta)` is squashed into `(ln lo, ln hi)`
    and the optimizer sees the logit of its position there.

    Examples:
        >>> import jax.numpy as jnp, gradsolve as gs
        >>> t = gs.transforms.Log()
        >>> round(float(t.inverse(jnp.array(jnp.e))), 12)
        1.0
        >>> t = gs.transforms.Log(1e-3, 1e3)       # bounded: u = 0 is the geometric middle
        >>> round(float(t.forward(jnp.array(0.0))), 9)
        1.0
    """

    lo: float | None = None
    hi: float | None = None
    base: ClassVar[float] = math.e

    def __check_init__(self):
        _check_bounds(type(self).__name__, self.lo, self.hi, positive=True)

    def _log(self, x):
        return jnp.log(x) / math.log(self.base)

    def forward(self, u):
        if self.lo is not None:
            u = _squash(u, math.log(self.lo, self.base), math.log(self.hi, self.base))
        return jnp.power(self.base, u)

    def inverse(self, theta):
        z = self._log(theta)
        if self.lo is None:
            return z
        return _unsquash(z, math.log(self.lo, self.base), math.log(self.hi, self.base))


class Log10(Log):
    """PEtab's `log10` scale: the optimizer sees `u = log10(theta)` (with bounds, the
    logit of `log10(theta)`'s position in `(log10 lo, log10 hi)`).

    Examples:
        >>> import jax.numpy as jnp, gradsolve as gs
        >>> round(float(gs.transforms.Log10().inverse(jnp.array(1000.0))), 12)
        3.0
    """

    base: ClassVar[float] = 10.0


class Positive(Log):
    """`theta = exp(u)`: the map of `Log()` without bounds, under the name of the
    constraint it keeps.

    Examples:
        >>> import jax.numpy as jnp, gradsolve as gs
        >>> t = gs.transforms.Positive()
        >>> round(float(t.forward(t.inverse(jnp.array(0.04)))), 12)
        0.04
    """

    def __check_init__(self):
        if self.lo is not None or self.hi is not None:
            raise ValueError("Positive takes no bounds; use gs.transforms.Log(lo, hi)")


def _is_transform(x):
    return isinstance(x, Transform)


def _is_node(v):
    return v is None or _is_transform(v)


def apply(transforms, tree, direction):
    """Map `tree` through `transforms` (a matching pytree of `Transform`s, a single
    `Transform` for every leaf, or None for the identity). Leaves that are not arrays
    (an MLP's activation, say) pass through."""
    if transforms is None:
        return tree

    def one(t, x):
        if t is None:
            return x
        return jax.tree.map(lambda v: getattr(t, direction)(v) if eqx.is_array(v) else v, x)
    if isinstance(transforms, Transform):
        return one(transforms, tree)
    return jax.tree.map(one, transforms, tree, is_leaf=_is_node)


def check(transforms, theta):
    """Refuse a transform tree that does not match `theta`, naming the keys."""
    if transforms is None or isinstance(transforms, Transform):
        return
    try:
        jax.tree.map(lambda t, x: None, transforms, theta, is_leaf=_is_node)
    except (ValueError, TypeError) as e:
        have = [jax.tree_util.keystr(p) for p, _ in
                jax.tree_util.tree_flatten_with_path(transforms, is_leaf=_is_node)[0]]
        raise ValueError(
            f"transform must be one Transform, None, or a pytree with theta0's structure "
            f"(None where a leaf is not transformed); transform has leaves {have}, theta0 "
            f"has structure {jax.tree.structure(theta)} ({e})") from None


def for_path(transforms, path) -> Transform:
    """The transform acting on the leaf of theta at `path`."""
    if transforms is None or isinstance(transforms, Transform):
        return transforms or Identity()
    for p, t in jax.tree_util.tree_flatten_with_path(transforms, is_leaf=_is_node)[0]:
        if tuple(path[:len(p)]) == tuple(p):
            return t or Identity()
    return Identity()
