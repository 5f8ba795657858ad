"""The fused (Warp) forms of the registered fields: the built-in systems' hand-written
ones (their Warp source beside their JAX form, in `fields/_systems.py`, with
Jacobians for the stiff ones) and the translations of `register_field`.

A fused form is Warp source text for two `@wp.func`s with fixed signatures, templated
on the state dimension `d` and the float type, plus a packer that lays the problem's
parameters out for the kernel:

    field(t: T, y: V, p: wp.array2d(dtype=T), s: wp.array(dtype=T), i: int) -> V
    jac(t: T, y: V, p: wp.array2d(dtype=T), s: wp.array(dtype=T), i: int) -> M

`p[i, k]` are trajectory i's parameters, `s` the shared ones (flattened), `V` the
length-d vector type and `M` the d x d matrix type. The registry maps each field's
JAX right-hand side (the function object) to its fused form: a problem whose `f_jax`
is a registered function can take the fused engines.
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


def _hand_written(form: _systems.WarpForm) -> FusedField:
    """The `FusedField` of a built-in system's hand-written Warp form."""
    def pack(params, n):
        P = _columns(params, form.columns, n) if form.columns else np.zeros((n, 1))
        S = (np.asarray(params[form.shared].value, np.float64).ravel() if form.shared
             else _no_shared())
        return P, S
    return FusedField(form.name, lambda d: form.source.format(d=d), pack, stiff=form.stiff,
                      d=form.d)


# The built-in systems' fused forms, from the Warp source beside each JAX form.
REGISTRY: dict[Callable, FusedField] = {
    f: _hand_written(form) for f, form in _systems.WARP_FORMS.items()}


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
