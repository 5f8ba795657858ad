"""Translate a JAX right-hand side into the fused kernels' Warp form.

The field of ONE trajectory, `f(t, y, args)`, is traced to a jaxpr at the problem's
state dimension and parameter shapes; the jaxpr is then evaluated symbolically, every
array held as a NumPy object array of scalars. A scalar is a Python number (a
constant: folded on the spot) or a `_Sym`, the name of a Warp local variable that one
emitted statement assigns. Arrays exist only at translation time: the Warp function
is straight-line scalar code, as the hand-written fields are. Stiff fields also get
`jac`, the translation of `jax.jacfwd(f, argnums=1)`.

Parameters: per-trajectory leaves become columns of `p[i, :]`, `gs.Shared` leaves
entries of `s[:]`, in pytree order (`_layout`); the packer lays out the same order.

A primitive outside `_UNARY`, `_BINARY` and the structural rules is refused with
`UntranslatableField` naming it; the router then takes the general path.
"""

import dataclasses
import itertools
import math

import equinox as eqx
import jax
import jax.extend as jex
import jax.numpy as jnp
import numpy as np

from ..problem import Shared


class UntranslatableField(ValueError):
    """The right-hand side uses something the translator does not handle."""


@dataclasses.dataclass(frozen=True)
class _Sym:
    """A Warp scalar local, by name; `boolean` for comparison results."""

    name: str
    boolean: bool = False

    def __str__(self):
        return self.name


class _Builder:
    """Collects the emitted statements and names the locals."""

    def __init__(self):
        self.lines: list[str] = []
        self._count = itertools.count()

    def emit(self, expr: str, boolean: bool = False) -> _Sym:
        sym = _Sym(f"v{next(self._count)}", boolean)
        self.lines.append(f"    {sym} = {expr}")
        return sym


def _code(x) -> str:
    """A scalar as Warp source: a local's name or a typed literal."""
    if isinstance(x, _Sym):
        return x.name
    if isinstance(x, (bool, np.bool_)):
        return "True" if x else "False"
    return f"T({float(x)!r})"


# Elementwise primitives: (constant folding, Warp expression). Constants fold in
# float64 NumPy; Warp computes the same IEEE operation for + - * / and sqrt.
_UNARY = {
    "neg": (lambda a: -a, "-{0}"),
    "exp": (np.exp, "wp.exp({0})"),
    "log": (np.log, "wp.log({0})"),
    "sin": (np.sin, "wp.sin({0})"),
    "cos": (np.cos, "wp.cos({0})"),
    "tan": (np.tan, "wp.tan({0})"),
    "tanh": (np.tanh, "wp.tanh({0})"),
    "sinh": (np.sinh, "wp.sinh({0})"),
    "cosh": (np.cosh, "wp.cosh({0})"),
    "atan": (np.arctan, "wp.atan({0})"),
    "asin": (np.arcsin, "wp.asin({0})"),
    "acos": (np.arccos, "wp.acos({0})"),
    "sqrt": (np.sqrt, "wp.sqrt({0})"),
    "rsqrt": (lambda a: 1 / np.sqrt(a), "T(1.0) / wp.sqrt({0})"),
    "cbrt": (np.cbrt, "wp.cbrt({0})"),
    "abs": (abs, "wp.abs({0})"),
    "floor": (np.floor, "wp.floor({0})"),
    "ceil": (np.ceil, "wp.ceil({0})"),
    "square": (lambda a: a * a, "{0} * {0}"),
    "logistic": (lambda a: 1 / (1 + np.exp(-a)), "T(1.0) / (T(1.0) + wp.exp(-{0}))"),
    "log1p": (np.log1p, "wp.log(T(1.0) + {0})"),
    "expm1": (np.expm1, "wp.exp({0}) - T(1.0)"),
    "not": (lambda a: not a, "not {0}"),
}

_BINARY = {
    "add": (lambda a, b: a + b, "{0} + {1}"),
    "add_any": (lambda a, b: a + b, "{0} + {1}"),
    "sub": (lambda a, b: a - b, "{0} - {1}"),
    "mul": (lambda a, b: a * b, "{0} * {1}"),
    "div": (lambda a, b: a / b, "{0} / {1}"),
    "pow": (lambda a, b: float(np.power(np.float64(a), b)), "wp.pow({0}, {1})"),
    "max": (max, "wp.max({0}, {1})"),
    "min": (min, "wp.min({0}, {1})"),
    "atan2": (math.atan2, "wp.atan2({0}, {1})"),
    "lt": (lambda a, b: a < b, "{0} < {1}"),
    "le": (lambda a, b: a <= b, "{0} <= {1}"),
    "gt": (lambda a, b: a > b, "{0} > {1}"),
    "ge": (lambda a, b: a >= b, "{0} >= {1}"),
    "eq": (lambda a, b: a == b, "{0} == {1}"),
    "ne": (lambda a, b: a != b, "{0} != {1}"),
    "and": (lambda a, b: a and b, "{0} and {1}"),
    "or": (lambda a, b: a or b, "{0} or {1}"),
}

# Primitives whose one parameter is a jaxpr to evaluate in place.
_CALLS = {"jit": "jaxpr", "pjit": "jaxpr", "closed_call": "call_jaxpr",
          "core_call": "call_jaxpr", "custom_jvp_call": "call_jaxpr",
          "custom_vjp_call": "call_jaxpr", "custom_vjp_call_jaxpr": "fun_jaxpr",
          "remat": "jaxpr", "checkpoint": "jaxpr"}


def _elementwise(fn, *arrays):
    arrays = np.broadcast_arrays(*[np.asarray(a, dtype=object) for a in arrays])
    out = np.empty(arrays[0].shape, dtype=object)
    for index in np.ndindex(out.shape):
        out[index] = fn(*(a[index] for a in arrays))
    return out


def _is_const(x) -> bool:
    return not isinstance(x, _Sym)


_LOGICAL = {"lt", "le", "gt", "ge", "eq", "ne", "and", "or", "not"}


def _apply(builder, fold, template, *scalars, boolean=False):
    if all(_is_const(x) for x in scalars):
        return fold(*scalars)
    # Parenthesise every operand: templates compose them with operators.
    return builder.emit(template.format(*(f"({_code(x)})" for x in scalars)), boolean)


def _dot_general(builder, lhs, rhs, dimension_numbers):
    (lc, rc), (lb, rb) = dimension_numbers
    lfree = [a for a in range(lhs.ndim) if a not in lc and a not in lb]
    rfree = [a for a in range(rhs.ndim) if a not in rc and a not in rb]
    lhs = lhs.transpose(list(lb) + lfree + list(lc))
    rhs = rhs.transpose(list(rb) + rfree + list(rc))
    nb, nk = len(lb), len(lc)
    batch, lshape, rshape = lhs.shape[:nb], lhs.shape[nb:lhs.ndim - nk], rhs.shape[nb:rhs.ndim - nk]
    out = np.empty(batch + lshape + rshape, dtype=object)
    for b in np.ndindex(batch):
        for li in np.ndindex(lshape):
            for ri in np.ndindex(rshape):
                terms = [_apply(builder, *_BINARY["mul"], x, y) for x, y in
                         zip(lhs[b + li].ravel(), rhs[b + ri].ravel())]
                acc = terms[0] if terms else 0.0
                for term in terms[1:]:
                    acc = _apply(builder, *_BINARY["add"], acc, term)
                out[b + li + ri] = acc
    return out


def _integer_pow(builder, x, y):
    if y == 0:
        return 1.0
    base = x
    result = None
    for _ in range(abs(y)):  # x * x * ... left to right, as written by hand
        result = base if result is None else _apply(builder, *_BINARY["mul"], result, base)
    return result if y > 0 else _apply(builder, *_BINARY["div"], 1.0, result)


def _eval(builder, jaxpr, consts, args):
    env = {}

    def read(v):
        if isinstance(v, jex.core.Literal):
            return np.asarray(v.val, dtype=object)
        return env[v]

    for var, val in zip(jaxpr.constvars, consts):
        env[var] = np.asarray(np.asarray(val).tolist(), dtype=object)
    for var, val in zip(jaxpr.invars, args):
        env[var] = val
    for eqn in jaxpr.eqns:
        name, params = eqn.primitive.name, eqn.params
        ins = [read(v) for v in eqn.invars]
        outs = _primitive(builder, name, params, ins)
        for var, val in zip(eqn.outvars, outs):
            env[var] = np.asarray(val, dtype=object)
    return [read(v) for v in jaxpr.outvars]


def _primitive(builder, name, params, ins):
    """The outputs of one jaxpr equation, as object arrays."""
    boolean = name in _LOGICAL
    if name in ("and", "or", "not") and any(
            isinstance(x, _Sym) and not x.boolean for a in ins for x in np.ravel(a)):
        raise UntranslatableField(f"the JAX primitive {name!r} on integers (bitwise)")
    if name in _UNARY:
        fold, template = _UNARY[name]
        return [_elementwise(lambda a: _apply(builder, fold, template, a, boolean=boolean),
                             ins[0])]
    if name in _BINARY:
        fold, template = _BINARY[name]
        return [_elementwise(lambda a, b: _apply(builder, fold, template, a, b,
                                                 boolean=boolean), *ins)]
    if name == "integer_pow":
        return [_elementwise(lambda a: _integer_pow(builder, a, params["y"]), ins[0])]
    if name == "select_n":
        def select(pred, *cases):
            if _is_const(pred):
                return cases[int(pred)]
            if len(cases) != 2:
                raise UntranslatableField("select_n with more than two cases")
            return builder.emit(f"wp.where({_code(pred)}, {_code(cases[1])}, {_code(cases[0])})")
        return [_elementwise(select, *ins)]
    if name == "convert_element_type":
        target = np.dtype(params["new_dtype"])
        if target.kind == "f":
            def to_float(a):
                if _is_const(a):
                    return float(a)
                return builder.emit(f"wp.where({a}, T(1.0), T(0.0))") if a.boolean else a
            return [_elementwise(to_float, ins[0])]
        if all(_is_const(a) for a in ins[0].ravel()):
            return [_elementwise(lambda a: target.type(a).item(), ins[0])]
        raise UntranslatableField(f"convert_element_type to {target} of a traced value")
    if name in ("copy", "copy_p", "stop_gradient", "reduce_precision"):
        return [ins[0]]
    if name in _CALLS:
        inner = params[_CALLS[name]]
        jaxpr, consts = (inner.jaxpr, inner.consts) if hasattr(inner, "consts") else (inner, ())
        return _eval(builder, jaxpr, consts, ins[:len(jaxpr.invars)])
    x = ins[0] if ins else None
    if name == "slice":
        strides = params["strides"] or (1,) * x.ndim
        return [x[tuple(slice(a, b, c) for a, b, c in
                        zip(params["start_indices"], params["limit_indices"], strides))]]
    if name == "squeeze":
        return [np.squeeze(x, axis=tuple(params["dimensions"]))]
    if name == "reshape":
        return [x.reshape(params["new_sizes"])]
    if name == "expand_dims":
        return [np.expand_dims(x, tuple(params["dimensions"]))]
    if name == "broadcast_in_dim":
        shape, dims = params["shape"], params["broadcast_dimensions"]
        keep = [1] * len(shape)
        for src, dst in enumerate(dims):
            keep[dst] = x.shape[src]
        return [np.broadcast_to(x.reshape(keep), shape).copy()]
    if name == "transpose":
        return [x.transpose(params["permutation"])]
    if name == "concatenate":
        return [np.concatenate(ins, axis=params["dimension"])]
    if name == "stack":
        return [np.stack(ins, axis=params["axis"])]
    if name == "split":
        cuts = np.cumsum(params["sizes"])[:-1]
        return np.split(x, cuts, axis=params["axis"])
    if name == "iota":
        shape, dim = params["shape"], params["dimension"]
        return [np.asarray(np.indices(shape)[dim].tolist(), dtype=object)]
    if name == "dot_general":
        return [_dot_general(builder, ins[0], ins[1], params["dimension_numbers"])]
    if name in ("reduce_sum", "reduce_max", "reduce_min"):
        op = {"reduce_sum": "add", "reduce_max": "max", "reduce_min": "min"}[name]
        axes = tuple(params["axes"])
        moved = np.moveaxis(x, axes, range(x.ndim - len(axes), x.ndim))
        flat = moved.reshape(moved.shape[:x.ndim - len(axes)] + (-1,))
        out = np.empty(flat.shape[:-1], dtype=object)
        for index in np.ndindex(out.shape):
            acc = flat[index][0]
            for term in flat[index][1:]:
                acc = _apply(builder, *_BINARY[op], acc, term)
            out[index] = acc
        return [out]
    raise UntranslatableField(f"the JAX primitive {name!r} has no Warp translation")


def _flat(params):
    """`[(leaf, shared)]` over the array leaves, in the order `jax.tree.leaves` gives
    for the parameters with each `gs.Shared` replaced by its value."""
    is_shared = lambda x: isinstance(x, Shared)
    flat = []
    for leaf in jax.tree.leaves(params, is_leaf=is_shared):
        if is_shared(leaf):
            flat += [(x, True) for x in jax.tree.leaves(leaf.value) if eqx.is_array(x)]
        elif eqx.is_array(leaf):  # not code (an MLP's activation): it is traced
            flat.append((leaf, False))
    return flat


def _one_trajectory(params):
    """Trajectory 0's parameters, shared ones unwrapped."""
    is_shared = lambda x: isinstance(x, Shared)
    return jax.tree.map(lambda x: x.value if is_shared(x) else x[0] if eqx.is_array(x) else x,
                        params, is_leaf=is_shared)


def layout(params) -> tuple:
    """What a translation depends on besides the function and d: the pytree structure
    and each leaf's per-trajectory shape, dtype and whether it is shared."""
    treedef = jax.tree.structure(params, is_leaf=lambda x: isinstance(x, Shared))
    return (treedef, tuple((np.shape(x) if shared else np.shape(x)[1:],
                            str(jnp.result_type(x)), shared) for x, shared in _flat(params)))


def pack(params, n):
    """Per-trajectory parameters `(n, m)` and the shared ones flattened `(k,)`, in the
    order the translated functions read them."""
    flat = _flat(params)
    per = [np.asarray(x, np.float64).reshape(n, -1) for x, shared in flat if not shared]
    common = [np.asarray(x, np.float64).ravel() for x, shared in flat if shared]
    return (np.concatenate(per, axis=1) if per else np.zeros((n, 1)),
            np.concatenate(common) if common else np.zeros(1))


def _inputs(one, shared, d):
    """The jaxpr's inputs as object arrays of Warp expressions: `t`, `y[k]`, and each
    parameter leaf's entries `p[i, column]` or `s[index]`."""
    column = index = 0
    leaves = []
    for leaf, is_shared in zip(jax.tree.leaves(one), shared, strict=True):
        size = int(np.size(leaf))
        if is_shared:
            names = [_Sym(f"s[{index + k}]") for k in range(size)]
            index += size
        else:
            names = [_Sym(f"p[i, {column + k}]") for k in range(size)]
            column += size
        leaves.append(np.asarray(names, dtype=object).reshape(np.shape(leaf)))
    y = np.asarray([_Sym(f"y[{k}]") for k in range(d)], dtype=object)
    return [np.asarray(_Sym("t"), dtype=object), y, *leaves]


def _function(name, f, t, y, one, shared, d, result_type, size):
    # Only the parameters' arrays are jaxpr inputs; code leaves (an activation
    # function) are closed over, so they are traced into the jaxpr like f itself.
    one, code = eqx.partition(one, eqx.is_array)
    closed = jax.make_jaxpr(lambda t, y, a: f(t, y, eqx.combine(a, code)))(t, y, one)
    builder = _Builder()
    outs = _eval(builder, closed.jaxpr, closed.consts, _inputs(one, shared, d))
    out = np.asarray(outs[0], dtype=object)
    if out.size != size:
        raise UntranslatableField(f"{name} returns shape {out.shape}, expected {size} values")
    header = (f"@wp.func\ndef {name}(t: T, y: V, p: wp.array2d(dtype=T), "
              f"s: wp.array(dtype=T), i: int) -> {result_type}:")
    values = ", ".join(_code(x) for x in out.ravel())
    return "\n".join([header, *builder.lines, f"    return {result_type}({values})", ""])


def translate(f_jax, params, y0, *, stiff: bool) -> str:
    """Warp source for `field` (and `jac` when `stiff`) of one trajectory of `f_jax`.

    Raises:
        UntranslatableField: naming the JAX primitive (or shape) it cannot translate.
    """
    one, shared = _one_trajectory(params), [s for _, s in _flat(params)]
    d = y0.shape[-1]
    y = jnp.zeros((d,), y0.dtype)
    t = jnp.zeros((), y0.dtype)
    source = _function("field", f_jax, t, y, one, shared, d, "V", d)
    if stiff:
        jac = lambda t, y, args: jax.jacfwd(f_jax, argnums=1)(t, y, args)
        source += "\n\n" + _function("jac", jac, t, y, one, shared, d, "M", d * d)
    return source
