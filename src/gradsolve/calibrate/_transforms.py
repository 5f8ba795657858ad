"""Parameter transforms: fit in an unconstrained space, report in the constrained one.

A transform is a pair of elementwise maps, `forward(u) -> theta` and
`inverse(theta) -> u`. The Calibrator optimises `u`; users give and receive `theta`.

Bounds are kept one of two ways (`edges=`):

- `"squash"` (the default): `u` is the logit of theta's position (or its log's) in
  `(lo, hi)`. theta stays strictly inside and steps near a bound shrink smoothly, but
  a bound is infinitely far: a fit whose optimum lies on a bound crawls towards it.
- `"clip"`: `u` is theta (or its log) itself, and the bounds are the optimizer's:
  every step is projected back into `[lo, hi]`, and a fit on a bound that its
  gradient pushes against is held there (its Jacobian column dropped from a
  Gauss-Newton step, its gradient from the reported norm): a projected method, as
  SciPy's and Fides' bounded trust regions treat a box. A bound is a finite step
  away, and the fit's scale is the scale's own.

Measured on Boehm_JProteomeRes2014 (PEtab benchmark collection), whose optimum has
`k_exp_hetero` on its lower bound: from 8 starts, squashed Levenberg-Marquardt reached
llh -138.2269 in 400 updates and crawled on (-138.2324 after 1000 updates refreshing
every 10), 0.005 short of AMICI's reference -138.2220; 100 more updates on clipped
edges from there reached it to 1.4e-6. A search on clipped edges from the start was no
better (-138.2271 from 20 starts, in a flat valley), so docs/calibrator.md's polish
uses both; recipes/multistart.py runs on clipped edges alone.
"""

import abc
import math
from typing import ClassVar, Literal

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

    def box(self):
        """`(lo, hi)` that the optimizer keeps `u` within (`edges="clip"`), or None."""
        return None


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


def _clip(u, lo, hi):
    """`u` held in `[lo, hi]`, with slope 1 on the bounds themselves (where a fit held
    on a bound sits; `jnp.clip` would give it half a slope there)."""
    return jnp.where(u < lo, lo, jnp.where(u > hi, hi, u))


def _unclip(z, lo, hi):
    """The inverse of `_clip` on `[lo, hi]` (z itself; within a few roundoffs outside,
    the bound: a log of a value on its bound may round past it), NaN further out
    (what the Calibrator's domain check names)."""
    slack = 8 * jnp.finfo(jnp.result_type(z, float)).eps * max(abs(lo), abs(hi), hi - lo)
    return jnp.where((z >= lo - slack) & (z <= hi + slack), _clip(z, lo, hi), jnp.nan)


_EDGES = {"squash": (_squash, _unsquash), "clip": (_clip, _unclip)}


def _check_bounds(name, lo, hi, positive=False, edges="squash"):
    if edges not in _EDGES:
        raise ValueError(f"{name} edges must be one of {sorted(_EDGES)}, got {edges!r}")
    if (lo is None) != (hi is None):
        raise ValueError(f"{name} takes both bounds or neither, got lo={lo}, hi={hi}")
    if lo is None:
        if edges != "squash":
            raise ValueError(f"{name}(edges={edges!r}) needs bounds lo and hi")
        return
    if not hi > lo:
        raise ValueError(f"{name} needs hi > lo, got lo={lo}, hi={hi}")
    if positive and not lo > 0:
        raise ValueError(f"{name} bounds are on a log scale and must be > 0, got lo={lo}")


class Bounded(Transform):
    """PEtab's `lin` scale with bounds: `theta = lo + (hi - lo) * sigmoid(u)`, strictly
    inside `(lo, hi)`; the optimizer sees the logit of theta's position in the interval.
    With `edges="clip"` it sees theta itself, kept in `[lo, hi]` by the optimizer (the
    module says when which).

    Examples:
        >>> import jax.numpy as jnp, gradsolve as gs
        >>> t = gs.transforms.Bounded(0.5, 1.0)
        >>> round(float(t.forward(t.inverse(jnp.array(0.8)))), 12)
        0.8
        >>> t = gs.transforms.Bounded(0.5, 1.0, edges="clip")
        >>> float(t.forward(jnp.array(0.8))), float(t.forward(jnp.array(1.1)))
        (0.8, 1.0)
    """

    lo: float
    hi: float
    edges: Literal["squash", "clip"] = eqx.field(default="squash", static=True)

    def __check_init__(self):
        _check_bounds("Bounded", self.lo, self.hi, edges=self.edges)

    def forward(self, u):
        return _EDGES[self.edges][0](u, self.lo, self.hi)

    def inverse(self, theta):
        return _EDGES[self.edges][1](theta, self.lo, self.hi)

    def box(self):
        return (self.lo, self.hi) if self.edges == "clip" else None


class Log(Transform):
    """PEtab's `log` scale: the optimizer sees `u = ln(theta)`, so rates across decades
    take equal-sized steps. With bounds `lo < theta < hi` (in theta's own units, as
    PEtab's lowerBound and upperBound), `ln(theta)` is squashed into `(ln lo, ln hi)`
    and the optimizer sees the logit of its position there (with `edges="clip"`,
    `ln(theta)` itself, kept in `[ln lo, ln hi]` by the optimizer; the module says
    when which).

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
    edges: Literal["squash", "clip"] = eqx.field(default="squash", static=True)
    base: ClassVar[float] = math.e

    def __check_init__(self):
        _check_bounds(type(self).__name__, self.lo, self.hi, positive=True,
                      edges=self.edges)

    def _log(self, x):
        return jnp.log(x) / math.log(self.base)

    def forward(self, u):
        if self.lo is not None:
            u = _EDGES[self.edges][0](u, *self._log_bounds())
        return jnp.power(self.base, u)

    def inverse(self, theta):
        z = self._log(theta)
        if self.lo is None:
            return z
        return _EDGES[self.edges][1](z, *self._log_bounds())

    def _log_bounds(self):
        return math.log(self.lo, self.base), math.log(self.hi, self.base)

    def box(self):
        return self._log_bounds() if self.edges == "clip" else None


class Log10(Log):
    """PEtab's `log10` scale: the optimizer sees `u = log10(theta)` (with bounds, the
    logit of `log10(theta)`'s position in `(log10 lo, log10 hi)`, or with
    `edges="clip"` `log10(theta)` kept in `[log10 lo, log10 hi]` by the optimizer).

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


def apply_compiled(transforms, tree, direction):
    """`apply` as one compiled program, for the fit's host side (theta0 in, theta
    out): run eagerly, each leaf's ops compiled a small program apiece (20 in the
    multistart recipe, 0.6 s)."""
    return tree if transforms is None else _apply_jit(transforms, tree, direction)


_apply_jit = eqx.filter_jit(apply)


def box(transforms, tree):
    """`(lower, upper)`: two trees shaped as `tree` (in the optimised space `u`), the
    box its array leaves are kept in (-inf / inf where a leaf's transform has none);
    None when no transform has one (`edges="clip"`), so that nothing else changes."""
    if transforms is None:
        return None
    boxes = []

    def one(t, x, i):
        b = None if t is None else t.box()
        boxes.append(b)
        end = (-jnp.inf, jnp.inf)[i] if b is None else b[i]
        return jax.tree.map(lambda v: jnp.full(jnp.shape(v), end, jnp.result_type(v))
                            if eqx.is_array(v) else v, x)

    def ends(i):
        if isinstance(transforms, Transform):
            return one(transforms, tree, i)
        return jax.tree.map(lambda t, x: one(t, x, i), transforms, tree, is_leaf=_is_node)
    lower, upper = ends(0), ends(1)
    return None if all(b is None for b in boxes) else (lower, upper)


def has_box(transforms) -> bool:
    """Whether any transform in `transforms` keeps a box (`edges="clip"`)."""
    if transforms is None:
        return False
    if isinstance(transforms, Transform):
        return transforms.box() is not None
    return any(t is not None and t.box() is not None
               for t in jax.tree.leaves(transforms, is_leaf=_is_transform))


def project(u, box):
    """`u` clipped into `box` (`(lower, upper)` from `box`, or None: `u` itself)."""
    if box is None:
        return u
    return jax.tree.map(lambda x, lo, hi: jnp.clip(x, lo, hi), u, *box)


def pushing_out(grad, u, box):
    """Where the gradient of a loss at `u` points a descent out of `box`: on a lower
    bound with a positive gradient, on an upper one with a negative (the components
    a projected method drops: the bound holds there). `False` trees when `box` is
    None."""
    if box is None:
        return jax.tree.map(lambda g: jnp.zeros(jnp.shape(g), bool), grad)
    return jax.tree.map(lambda g, x, lo, hi: ((x <= lo) & (g > 0)) | ((x >= hi) & (g < 0)),
                        grad, u, *box)


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
