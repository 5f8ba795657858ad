"""Parameter transforms: fit in an unconstrained space, report in the constrained one.

A transform is a pair of elementwise maps, `forward(u) -> theta` and
`inverse(theta) -> u`. The Calibrator optimises `u`; users give and receive `theta`.
"""

import abc

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


class Positive(Transform):
    """`theta = exp(u)`: rates across decades take equal-sized steps in `u`.

    Examples:
        >>> import jax.numpy as jnp, gradsolve as gs
        >>> t = gs.transforms.Positive()
        >>> round(float(t.forward(t.inverse(jnp.array(0.04)))), 12)
        0.04
    """

    def forward(self, u):
        return jnp.exp(u)

    def inverse(self, theta):
        return jnp.log(theta)


class Bounded(Transform):
    """`theta = lo + (hi - lo) * sigmoid(u)`: stays strictly inside `(lo, hi)`.

    Examples:
        >>> import jax.numpy as jnp, gradsolve as gs
        >>> t = gs.transforms.Bounded(0.5, 1.0)
        >>> round(float(t.forward(t.inverse(jnp.array(0.8)))), 12)
        0.8
    """

    lo: float
    hi: float

    def __check_init__(self):
        if not self.hi > self.lo:
            raise ValueError(f"Bounded needs hi > lo, got lo={self.lo}, hi={self.hi}")

    def forward(self, u):
        return self.lo + (self.hi - self.lo) * jax.nn.sigmoid(u)

    def inverse(self, theta):
        x = (theta - self.lo) / (self.hi - self.lo)
        return jnp.log(x) - jnp.log1p(-x)


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
