"""Hand-written fused (Warp) forms of the registered fields, with Jacobians for the
stiff ones.

Each field is Warp source text for two `@wp.func`s with fixed signatures, templated
on the state dimension `d` and the float type, plus a packer that lays the problem's
parameters out for the kernel:

    field(t: T, y: V, p: wp.array2d(dtype=T), s: wp.array(dtype=T), i: int) -> V
    jac(t: T, y: V, p: wp.array2d(dtype=T), s: wp.array(dtype=T), i: int) -> M

`p[i, k]` are trajectory i's parameters, `s` the shared ones (flattened), `V` the
length-d vector type and `M` the d x d matrix type. The registry maps each field's
JAX right-hand side (the function object in `_systems.py`) to its fused form: a
problem whose `f_jax` is a registered function can take the fused engines.
"""

import dataclasses
import warnings
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from ..fields import _systems
from ..problem import EnsembleProblem, Shared, unwrap_shared
from . import _translate


# Why a problem runs on no Warp engine when nothing asked for its fused form.
NOT_FUSED = ("f_jax has no fused form (EnsembleProblem(..., fused=True) or "
             "gs.register_field translates one)")


@dataclasses.dataclass(frozen=True)
class FusedField:
    """A right-hand side in the fused kernels' form.

    Attributes:
        name: the field's name.
        source: `source(d) -> str`, the Warp functions (`field`, and `jac` if stiff),
            written with the type names `T`, `V`, `M` and the literal wrapper `T(...)`.
        pack: `pack(params, n) -> (P, S)`: per-trajectory parameters `(n, m)` and the
            shared ones flattened `(k,)` as float64 NumPy arrays.
        stiff: whether `source` defines `jac` (the field can run stiff methods).
        d: the fixed state dimension, or None when any d works.
    """

    name: str
    source: Callable[[int], str]
    pack: Callable
    stiff: bool = False
    d: int | None = None


def _columns(params, names, n):
    """The hand-written kernels' per-trajectory parameter columns; a `gs.Shared`
    value (common to all trajectories) is broadcast to every row."""
    params = unwrap_shared(params)
    return np.stack([np.broadcast_to(np.asarray(params[k], np.float64), (n,))
                     for k in names], axis=1)


def _no_shared():
    return np.zeros(1)


_LORENZ = """
@wp.func
def field(t: T, y: V, p: wp.array2d(dtype=T), s: wp.array(dtype=T), i: int) -> V:
    return V(p[i, 0] * (y[1] - y[0]), y[0] * (p[i, 1] - y[2]) - y[1],
             y[0] * y[1] - p[i, 2] * y[2])
"""

_VAN_DER_POL = """
@wp.func
def field(t: T, y: V, p: wp.array2d(dtype=T), s: wp.array(dtype=T), i: int) -> V:
    return V(y[1], p[i, 0] * (T(1.0) - y[0] * y[0]) * y[1] - y[0])
"""

_LORENZ96 = """
@wp.func
def field(t: T, y: V, p: wp.array2d(dtype=T), s: wp.array(dtype=T), i: int) -> V:
    out = V()
    for k in range({d}):
        out[k] = (y[(k + 1) % {d}] - y[(k + {d} - 2) % {d}]) * y[(k + {d} - 1) % {d}] \\
            - y[k] + p[i, 0]
    return out
"""

_LINEAR = """
@wp.func
def field(t: T, y: V, p: wp.array2d(dtype=T), s: wp.array(dtype=T), i: int) -> V:
    out = V()
    for r in range({d}):
        acc = T(0.0)
        for c in range({d}):
            acc = acc + s[r * {d} + c] * y[c]
        out[r] = p[i, 0] * acc
    return out
"""

_LINEAR_JAC = """
@wp.func
def jac(t: T, y: V, p: wp.array2d(dtype=T), s: wp.array(dtype=T), i: int) -> M:
    out = M()
    for r in range({d}):
        for c in range({d}):
            out[r, c] = p[i, 0] * s[r * {d} + c]
    return out
"""

_ROBERTSON = """
@wp.func
def field(t: T, y: V, p: wp.array2d(dtype=T), s: wp.array(dtype=T), i: int) -> V:
    r1 = p[i, 0] * y[0]
    r2 = p[i, 1] * y[1] * y[1]
    r3 = p[i, 2] * y[1] * y[2]
    return V(-r1 + r3, r1 - r2 - r3, r2)


@wp.func
def jac(t: T, y: V, p: wp.array2d(dtype=T), s: wp.array(dtype=T), i: int) -> M:
    k1 = p[i, 0]
    k2 = p[i, 1]
    k3 = p[i, 2]
    return M(-k1, k3 * y[2], k3 * y[1],
             k1, -T(2.0) * k2 * y[1] - k3 * y[2], -k3 * y[1],
             T(0.0), T(2.0) * k2 * y[1], T(0.0))
"""

_HIRES = """
@wp.func
def field(t: T, y: V, p: wp.array2d(dtype=T), s: wp.array(dtype=T), i: int) -> V:
    r = T(280.0) * y[5] * y[7]
    out = V()
    out[0] = -T(1.71) * y[0] + T(0.43) * y[1] + T(8.32) * y[2] + T(0.0007)
    out[1] = T(1.71) * y[0] - T(8.75) * y[1]
    out[2] = -T(10.03) * y[2] + T(0.43) * y[3] + T(0.035) * y[4]
    out[3] = T(8.32) * y[1] + T(1.71) * y[2] - T(1.12) * y[3]
    out[4] = -T(1.745) * y[4] + T(0.43) * y[5] + T(0.43) * y[6]
    out[5] = -r + T(0.69) * y[3] + T(1.71) * y[4] - T(0.43) * y[5] + T(0.69) * y[6]
    out[6] = r - T(1.81) * y[6]
    out[7] = -r + T(1.81) * y[6]
    return out


@wp.func
def jac(t: T, y: V, p: wp.array2d(dtype=T), s: wp.array(dtype=T), i: int) -> M:
    J = M()
    J[0, 0] = -T(1.71)
    J[0, 1] = T(0.43)
    J[0, 2] = T(8.32)
    J[1, 0] = T(1.71)
    J[1, 1] = -T(8.75)
    J[2, 2] = -T(10.03)
    J[2, 3] = T(0.43)
    J[2, 4] = T(0.035)
    J[3, 1] = T(8.32)
    J[3, 2] = T(1.71)
    J[3, 3] = -T(1.12)
    J[4, 4] = -T(1.745)
    J[4, 5] = T(0.43)
    J[4, 6] = T(0.43)
    J[5, 3] = T(0.69)
    J[5, 4] = T(1.71)
    J[5, 5] = -T(0.43) - T(280.0) * y[7]
    J[5, 6] = T(0.69)
    J[5, 7] = -T(280.0) * y[5]
    J[6, 5] = T(280.0) * y[7]
    J[6, 6] = -T(1.81)
    J[6, 7] = T(280.0) * y[5]
    J[7, 5] = -T(280.0) * y[7]
    J[7, 6] = T(1.81)
    J[7, 7] = -T(280.0) * y[5]
    return J
"""


def _linear_pack(params, n):
    A = np.asarray(params["A"].value, np.float64).ravel()
    return _columns(params, ["lam"], n), A


REGISTRY: dict[Callable, FusedField] = {
    _systems.lorenz_f: FusedField(
        "lorenz", lambda d: _LORENZ,
        lambda p, n: (_columns(p, ["sigma", "rho", "beta"], n), _no_shared()), d=3),
    _systems.van_der_pol_f: FusedField(
        "van_der_pol", lambda d: _VAN_DER_POL,
        lambda p, n: (_columns(p, ["mu"], n), _no_shared()), d=2),
    _systems.lorenz96_f: FusedField(
        "lorenz96", lambda d: _LORENZ96.format(d=d),
        lambda p, n: (_columns(p, ["F"], n), _no_shared())),
    _systems.linear_f: FusedField(
        "linear", lambda d: _LINEAR.format(d=d) + _LINEAR_JAC.format(d=d), _linear_pack,
        stiff=True),
    _systems.robertson_f: FusedField(
        "robertson", lambda d: _ROBERTSON,
        lambda p, n: (_columns(p, ["k1", "k2", "k3"], n), _no_shared()), stiff=True, d=3),
    _systems.hires_f: FusedField(
        "hires", lambda d: _HIRES, lambda p, n: (np.zeros((n, 1)), _no_shared()),
        stiff=True, d=8),
}


# Right-hand sides registered with `register_field`: f_jax -> (name, stiff).
TRANSLATED: dict[Callable, tuple[str, bool]] = {}
# Translations done: (f_jax, d, dtype, parameter layout, entry) -> (field, why not).
_TRANSLATIONS: dict = {}


def register_field(name: str, f_jax: Callable, stiff: bool = False, *, example=None) -> None:
    """Give a JAX right-hand side a fused (Warp) form, translated from its jaxpr.

    The translation traces the field at a state dimension and parameter shapes, which a
    function alone does not tell, so `example` gives them: a problem that uses `f_jax`,
    or one trajectory's `(y0, params)`. The field is translated here, at those shapes:
    a field the translator cannot handle raises at once, naming the field and the JAX
    primitive (with what to write instead). A problem with other shapes is translated
    when first routed; a refusal found then (a field whose code depends on its shapes)
    warns once per problem shape and the problem takes the general path, with the
    reason in `passed_over`.

    Args:
        name: a name for messages.
        f_jax: `f(t, y, args)` of one trajectory, the function the problems use.
        stiff: also translate its Jacobian (`jax.jacfwd`), for the stiff fused kernel.
        example: an `EnsembleProblem` whose `f_jax` is this function, or a pair
            `(y0, params)` of one trajectory: `y0` of shape `(d,)`, `params` as
            `f_jax` receives them plus `gs.Shared(...)` around the shared ones
            (values do not matter, only shapes and dtypes; Python floats take `y0`'s
            dtype).

    Raises:
        UntranslatableField: (a ValueError) the field uses something the translator
            does not handle at `example`'s shapes.
        TypeError: no `example`.

    Examples:
        >>> import jax.numpy as jnp, gradsolve as gs
        >>> def sir(t, y, p):
        ...     s, i, r = y
        ...     return jnp.stack([-p["beta"] * s * i, p["beta"] * s * i - p["gamma"] * i,
        ...                       p["gamma"] * i])
        >>> gs.register_field("sir", sir, example=(jnp.zeros(3), {"beta": 0.0, "gamma": 0.0}))
        >>> prob = gs.EnsembleProblem(sir, jnp.tile(jnp.array([0.99, 0.01, 0.0]), (4, 1)),
        ...                           {"beta": jnp.linspace(1.0, 2.0, 4),
        ...                            "gamma": jnp.full(4, 0.3)}, (0.0, 10.0))
        >>> gs.solve(prob).engine
        'fused'
    """
    if not callable(f_jax):
        raise TypeError(f"f_jax must be callable, got {type(f_jax).__name__}")
    if f_jax in REGISTRY:
        raise ValueError(f"{name!r}: this function already has a hand-written fused form")
    prob = _example_problem(str(name), f_jax, example)
    TRANSLATED[f_jax] = (str(name), bool(stiff))
    field, why = fused_form(prob, warn=False)
    if field is None:
        del TRANSLATED[f_jax]
        raise _translate.UntranslatableField(why)


def _example_problem(name: str, f_jax: Callable, example) -> EnsembleProblem:
    """`register_field`'s `example` as a problem using `f_jax` (a `(y0, params)` pair
    becomes a problem of one trajectory), refusing what gives no shapes to trace at."""
    if example is None:
        raise TypeError(
            f"register_field({name!r}): example= is required: the translation traces the "
            f"field at a state dimension and parameter shapes; give a problem that uses it, "
            f"or one trajectory's (y0, params), e.g. example=(jnp.zeros(3), {{'k': 0.0}})")
    if isinstance(example, tuple) and len(example) == 2:
        y0, params = example
        y0 = jnp.asarray(y0)
        if y0.ndim != 1:
            raise ValueError(f"register_field({name!r}): example's y0 is one trajectory's "
                             f"state, of shape (d,), got {y0.shape}")
        float_dtype = y0.dtype if jnp.issubdtype(y0.dtype, jnp.floating) else None

        def one_row(x):
            if isinstance(x, Shared) or callable(x):  # shared values, code: as they are
                return x
            return jnp.asarray(x, float_dtype if isinstance(x, float) else None)[None]

        params = jax.tree.map(one_row, params, is_leaf=lambda x: isinstance(x, Shared))
        return EnsembleProblem(f_jax, y0[None], params, (0.0, 1.0), name=name)
    if getattr(example, "f_jax", None) is not f_jax:
        raise ValueError(f"example: expected an EnsembleProblem whose f_jax is the field "
                         f"{name!r} being registered, or (y0, params) of one trajectory, "
                         f"got {type(example).__name__}")
    return example


def fused_form(prob, params=None, *, warn=True) -> tuple[FusedField | None, str | None]:
    """The fused form of `prob`'s right-hand side and, when there is none, why.

    Hand-written forms come first; then `register_field` entries and problems built
    with `fused=True` are translated (cached per shape and parameter layout). A
    registered field that fails to translate warns (once per shape) when `warn`.
    """
    try:
        field = REGISTRY.get(prob.f_jax)
        entry = TRANSLATED.get(prob.f_jax)
    except TypeError:  # an unhashable callable cannot be registered
        return None, "f_jax is not hashable, so it cannot have a fused form"
    if field is not None:
        return field, None
    registered = entry is not None
    if entry is None and getattr(prob, "fused", False):
        entry = (prob.name or "field", prob.stiff)
    if entry is None:
        return None, NOT_FUSED
    params = prob.params if params is None else params
    key = (prob.f_jax, prob.d, np.dtype(prob.y0.dtype).name, _translate.layout(params), entry)
    if key not in _TRANSLATIONS:
        try:
            source = _translate.translate(prob.f_jax, params, prob.y0, stiff=entry[1])
            _TRANSLATIONS[key] = (FusedField(entry[0], lambda d, text=source: text,
                                             _translate.pack, stiff=entry[1], d=prob.d), None)
        except _translate.UntranslatableField as err:
            _TRANSLATIONS[key] = (None, f"{entry[0]!r} has no fused form: {err}")
        except Exception as err:  # noqa: BLE001 - a translator gap must not break solve
            _TRANSLATIONS[key] = (None, f"{entry[0]!r} has no fused form: the translator "
                                        f"failed ({type(err).__name__}: {err})")
        why = _TRANSLATIONS[key][1]
        if why is not None and registered and warn:
            warnings.warn(f"gs.register_field({entry[0]!r}): {why}; its problems take the "
                          f"general (JAX) path", stacklevel=2)
    return _TRANSLATIONS[key]
