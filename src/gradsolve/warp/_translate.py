"""Translate a JAX right-hand side into the fused kernels' Warp form.

The field of ONE trajectory, `f(t, y, args)`, is traced to a jaxpr at the problem's
state dimension and parameter shapes; the jaxpr is then evaluated symbolically, every
array held as a NumPy object array of scalars. A scalar is a Python number (a
constant: folded on the spot), a `_Sym` (the name of a Warp local that one emitted
statement assigns, or an entry of a local vector), or a `_Param` (an entry `p[i, k]`
or `s[k]` of the parameter arrays). Stiff fields also get `jac`, the translation of
`jax.jacfwd(f, argnums=1)`.

Each JAX primitive has one handler in `RULES` (`handler(builder, params, *ins) ->
list of outputs`), as in Equinox's jaxpr interpreters: the elementwise ones are made
from `_UNARY` and `_BINARY`, the structural ones (slices, reshapes, calls, ...) are
written out. Most emit straight-line scalar code, as the hand-written fields are.
`dot_general` with one operand a block of parameters laid out with constant strides
(an `eqx.nn.Linear` weight, a Shared matrix) is emitted as a loop over the parameter
array (`_looped_dot`), so the generated code grows with a layer's width, not with its
weight count; small products are unrolled.

Parameters: per-trajectory leaves become columns of `p[i, :]`, `gs.Shared` leaves
entries of `s[:]`, in pytree order (`_flat`); the packer lays out the same order.

A primitive without a rule is refused with `UntranslatableField` naming it (and, for
the common ones, what to write instead: `HINTS`); the router then takes the general
path.
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
from ._source import lit


class UntranslatableField(ValueError):
    """The right-hand side uses something the translator does not handle."""


@dataclasses.dataclass(frozen=True)
class _Sym:
    """A Warp scalar, by its source text; `boolean` for comparison results."""

    name: str
    boolean: bool = False

    def __str__(self):
        return self.name


@dataclasses.dataclass(frozen=True)
class _Param(_Sym):
    """Entry `index` of a parameter array: `p[i, index]` (`array="p"`, the trajectory's
    own) or `s[index]` (`array="s"`, shared)."""

    array: str = "s"
    index: int = 0


@dataclasses.dataclass(frozen=True)
class _Outer(_Sym):
    """Entry (r, c) of the outer product of the local vectors `u` and `v`: an
    expression (`name` is `(u[r] * v[c])`), emitted only where it is used -- so a
    weight cotangent written into a parameter array can be one loop (`_write_block`)."""

    u: str = ""
    v: str = ""
    r: int = 0
    c: int = 0


def _param(array: str, index: int) -> _Param:
    return _Param(f"p[i, {index}]" if array == "p" else f"s[{index}]", array=array, index=index)


class _Builder:
    """Collects the emitted statements, names the locals and declares the vector
    types the loops use."""

    def __init__(self):
        self.lines: list[str] = []
        self.types: dict[int, str] = {}
        self._count = itertools.count()

    def name(self) -> str:
        return f"v{next(self._count)}"

    def emit(self, expr: str, boolean: bool = False) -> _Sym:
        sym = _Sym(self.name(), boolean)
        self.lines.append(f"    {sym} = {expr}")
        return sym

    def vector_type(self, length: int) -> str:
        """The name of the length-`length` vector type of T, declared once."""
        self.types.setdefault(length, f"VEC{length}")
        return self.types[length]

    def declarations(self) -> str:
        return "".join(f"{name} = wp.types.vector(length={n}, dtype=T)\n"
                       for n, name in sorted(self.types.items()))


def _code(x) -> str:
    """A scalar as Warp source: a local's name or a typed literal."""
    if isinstance(x, _Sym):
        return x.name
    if isinstance(x, (bool, np.bool_)):
        return "True" if x else "False"
    return lit(x)


def _is_const(x) -> bool:
    return not isinstance(x, _Sym)


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

_LOGICAL = {"lt", "le", "gt", "ge", "eq", "ne", "and", "or", "not"}

# What to write instead of a primitive the translator refuses.
HINTS = {
    "cond": "write both branches and choose with jnp.where",
    "switch": "write every branch and choose with jnp.where",
    "while": "use a Python for loop over a fixed count (it unrolls when traced)",
    "scan": "use a Python for loop over a fixed count (it unrolls when traced)",
    "sign": "write jnp.where(x > 0, 1.0, jnp.where(x < 0, -1.0, 0.0))",
    "sort": "no sorting network is generated; keep this field on the general path",
    "gather": "index with static Python integers or slices (y[0], y[1:3])",
    "dynamic_slice": "index with static Python integers or slices (y[0], y[1:3])",
}


def _refuse(name: str, what: str = "has no Warp translation"):
    hint = HINTS.get(name)
    return UntranslatableField(f"the JAX primitive {name!r} {what}"
                               + (f" ({hint})" if hint else ""))


# x + 0, 0 + x, x - 0, x * 1, 1 * x are x exactly (up to the sign of a zero): JAX's
# derivatives are full of them (the transposes of slices pad with zeros).
_NEUTRAL = {"{0} + {1}": (0.0, 0.0), "{0} - {1}": (None, 0.0), "{0} * {1}": (1.0, 1.0)}


def _apply(builder, fold, template, *scalars, boolean=False):
    if all(_is_const(x) for x in scalars):
        return fold(*scalars)
    if template in _NEUTRAL and len(scalars) == 2:
        left, right = _NEUTRAL[template]
        a, b = scalars
        if left is not None and _is_const(a) and not isinstance(a, bool) and a == left:
            return b
        if _is_const(b) and not isinstance(b, bool) and b == right:
            return a
    # Parenthesise every operand: templates compose them with operators.
    return builder.emit(template.format(*(f"({_code(x)})" for x in scalars)), boolean)


def _elementwise(fn, *arrays):
    arrays = np.broadcast_arrays(*[np.asarray(a, dtype=object) for a in arrays])
    out = np.empty(arrays[0].shape, dtype=object)
    for index in np.ndindex(out.shape):
        out[index] = fn(*(a[index] for a in arrays))
    return out


def _mul(builder, a, b):
    return _apply(builder, *_BINARY["mul"], a, b)


def _add(builder, a, b):
    return _apply(builder, *_BINARY["add"], a, b)


# The table: JAX primitive name -> handler(builder, params, *ins) -> list of outputs.
RULES = {}


def _rule(*names):
    def register(handler):
        for name in names:
            RULES[name] = handler
        return handler
    return register


def _unary_rule(name):
    fold, template = _UNARY[name]
    boolean = name in _LOGICAL

    def handler(builder, params, x):
        if name == "not":
            _refuse_bitwise(name, x)
        return [_elementwise(lambda a: _apply(builder, fold, template, a, boolean=boolean), x)]
    return handler


def _binary_rule(name):
    fold, template = _BINARY[name]
    boolean = name in _LOGICAL

    def handler(builder, params, x, y):
        if name in ("and", "or"):
            _refuse_bitwise(name, x, y)
        return [_elementwise(lambda a, b: _apply(builder, fold, template, a, b,
                                                 boolean=boolean), x, y)]
    return handler


def _refuse_bitwise(name, *ins):
    """Warp's and/or/not are logical: on integers (JAX's bitwise ops) they differ."""
    if any(isinstance(x, _Sym) and not x.boolean for a in ins for x in np.ravel(a)):
        raise _refuse(name, "on integers (bitwise) has no Warp translation")


RULES.update({name: _unary_rule(name) for name in _UNARY})
RULES.update({name: _binary_rule(name) for name in _BINARY})


@_rule("integer_pow")
def _integer_pow(builder, params, x):
    y = params["y"]

    def power(a):
        if y == 0:
            return 1.0
        result = None
        for _ in range(abs(y)):  # a * a * ... left to right, as written by hand
            result = a if result is None else _mul(builder, result, a)
        return result if y > 0 else _apply(builder, *_BINARY["div"], 1.0, result)
    return [_elementwise(power, x)]


@_rule("select_n")
def _select_n(builder, params, *ins):
    def select(pred, *cases):
        if _is_const(pred):
            return cases[int(pred)]
        if len(cases) != 2:
            raise UntranslatableField("select_n with more than two cases")
        return builder.emit(f"wp.where({_code(pred)}, {_code(cases[1])}, {_code(cases[0])})")
    return [_elementwise(select, *ins)]


@_rule("convert_element_type")
def _convert_element_type(builder, params, x):
    target = np.dtype(params["new_dtype"])
    if target.kind == "f":
        def to_float(a):
            if _is_const(a):
                return float(a)
            return builder.emit(f"wp.where({a}, T(1.0), T(0.0))") if a.boolean else a
        return [_elementwise(to_float, x)]
    if all(_is_const(a) for a in x.ravel()):
        return [_elementwise(lambda a: target.type(a).item(), x)]
    raise UntranslatableField(f"convert_element_type to {target} of a traced value")


@_rule("copy", "copy_p", "stop_gradient", "reduce_precision")
def _identity(builder, params, x):
    return [x]


# Primitives whose one parameter is a jaxpr to evaluate in place: the parameter's name.
_CALLS = {"jit": "jaxpr", "pjit": "jaxpr", "closed_call": "call_jaxpr",
          "core_call": "call_jaxpr", "custom_jvp_call": "call_jaxpr",
          "custom_vjp_call": "call_jaxpr", "custom_vjp_call_jaxpr": "fun_jaxpr",
          "remat": "jaxpr", "checkpoint": "jaxpr"}


def _call_rule(key):
    def handler(builder, params, *ins):
        inner = params[key]
        jaxpr, consts = (inner.jaxpr, inner.consts) if hasattr(inner, "consts") else (inner, ())
        return _eval(builder, jaxpr, consts, ins[:len(jaxpr.invars)])
    return handler


RULES.update({name: _call_rule(key) for name, key in _CALLS.items()})


@_rule("slice")
def _slice(builder, params, x):
    strides = params["strides"] or (1,) * x.ndim
    return [x[tuple(slice(a, b, c) for a, b, c in
                    zip(params["start_indices"], params["limit_indices"], strides))]]


@_rule("squeeze")
def _squeeze(builder, params, x):
    return [np.squeeze(x, axis=tuple(params["dimensions"]))]


@_rule("reshape")
def _reshape(builder, params, x):
    return [x.reshape(params["new_sizes"])]


@_rule("expand_dims")
def _expand_dims(builder, params, x):
    return [np.expand_dims(x, tuple(params["dimensions"]))]


@_rule("broadcast_in_dim")
def _broadcast_in_dim(builder, params, x):
    shape, dims = params["shape"], params["broadcast_dimensions"]
    keep = [1] * len(shape)
    for src, dst in enumerate(dims):
        keep[dst] = x.shape[src]
    return [np.broadcast_to(x.reshape(keep), shape).copy()]


@_rule("transpose")
def _transpose(builder, params, x):
    return [x.transpose(params["permutation"])]


@_rule("concatenate")
def _concatenate(builder, params, *ins):
    return [np.concatenate(ins, axis=params["dimension"])]


@_rule("stack")
def _stack(builder, params, *ins):
    return [np.stack(ins, axis=params["axis"])]


@_rule("split")
def _split(builder, params, x):
    return np.split(x, np.cumsum(params["sizes"])[:-1], axis=params["axis"])


@_rule("unstack")
def _unstack(builder, params, x):
    axis = params["axis"]
    return [np.take(x, k, axis=axis) for k in range(x.shape[axis])]


@_rule("pad")
def _pad(builder, params, x, value):
    config = params["padding_config"]
    shape = tuple(lo + hi + (n + (n - 1) * gap if n else 0)
                  for n, (lo, hi, gap) in zip(x.shape, config))
    out = np.empty(shape, dtype=object)
    out.fill(np.asarray(value, dtype=object)[()])
    for index in np.ndindex(x.shape):
        at = tuple(lo + k * (gap + 1) for k, (lo, _, gap) in zip(index, config))
        if all(0 <= a < n for a, n in zip(at, shape)):
            out[at] = x[index]
    return [out]


@_rule("iota")
def _iota(builder, params):
    shape, dim = params["shape"], params["dimension"]
    return [np.asarray(np.indices(shape)[dim].tolist(), dtype=object)]


def _reduce_rule(op):
    def handler(builder, params, x):
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
    return handler


RULES.update({"reduce_sum": _reduce_rule("add"), "reduce_max": _reduce_rule("max"),
              "reduce_min": _reduce_rule("min")})


# A product with a parameter block of at least this many entries is emitted as a loop
# over the parameter array; smaller ones are unrolled (no loop overhead; the same
# arithmetic in the same order either way).
LOOP_MIN_ENTRIES = 16


def _strides(block) -> tuple[str, int, tuple[int, ...]] | None:
    """`(array, base, strides)` when every entry of `block` is a `_Param` of one array
    at `base + sum(strides[j] * index[j])`, else None."""
    first = block.flat[0] if block.size else None
    if not isinstance(first, _Param):
        return None
    strides = []
    for axis in range(block.ndim):
        step = [0] * block.ndim
        step[axis] = 1
        other = block[tuple(step)] if block.shape[axis] > 1 else first
        if not isinstance(other, _Param):
            return None
        strides.append(other.index - first.index)
    for index in np.ndindex(block.shape):
        x = block[index]
        if not (isinstance(x, _Param) and x.array == first.array
                and x.index == first.index + sum(s * k for s, k in zip(strides, index))):
            return None
    return first.array, first.index, tuple(strides)


def _looped_dot(builder, weights, layout, vectors):
    """`out[g, r] = sum_c weights[r, c] * vectors[g, c]` with `weights` a parameter
    block `layout = (array, base, (row stride, column stride))`: one loop per vector
    over the parameter array. Returns an object array (G, R) of vector entries."""
    array, base, (row, col) = layout
    rows, cols = weights.shape

    def entry(c):
        index = f"{base} + r * {row} + {c} * {col}"
        return f"p[i, {index}]" if array == "p" else f"s[{index}]"

    vin, vout = builder.vector_type(cols), builder.vector_type(rows)
    out = np.empty((len(vectors), rows), dtype=object)
    for g, x in enumerate(vectors):
        xs = builder.emit(f"{vin}({', '.join(_code(v) for v in x)})")
        ys = builder.name()
        builder.lines += [f"    {ys} = {vout}()",
                          f"    for r in range({rows}):",
                          f"        acc_{ys} = {entry(0)} * {xs}[0]",
                          f"        for c in range(1, {cols}):",
                          f"            acc_{ys} = acc_{ys} + {entry('c')} * {xs}[c]",
                          f"        {ys}[r] = acc_{ys}"]
        out[g] = [_Sym(f"{ys}[{r}]") for r in range(rows)]
    return out


def _outer(builder, u, v):
    """The outer product of two vectors as `_Outer` expressions over two locals."""
    names = [builder.emit(f"{builder.vector_type(x.size)}({', '.join(_code(e) for e in x)})").name
             for x in (u, v)]
    out = np.empty((u.size, v.size), dtype=object)
    for r, c in np.ndindex(out.shape):
        out[r, c] = _Outer(f"({names[0]}[{r}] * {names[1]}[{c}])", u=names[0], v=names[1],
                           r=r, c=c)
    return out


@_rule("dot_general")
def _dot_general(builder, params, lhs, rhs):
    (lc, rc), (lb, rb) = params["dimension_numbers"]
    lfree = [a for a in range(lhs.ndim) if a not in lc and a not in lb]
    rfree = [a for a in range(rhs.ndim) if a not in rc and a not in rb]
    lhs = lhs.transpose(list(lb) + lfree + list(lc))
    rhs = rhs.transpose(list(rb) + rfree + list(rc))
    nb, nk = len(lb), len(lc)
    batch, lshape, rshape = lhs.shape[:nb], lhs.shape[nb:lhs.ndim - nk], rhs.shape[nb:rhs.ndim - nk]
    k = int(np.prod(lhs.shape[lhs.ndim - nk:], dtype=int))
    if not nb and not nk and lhs.ndim == rhs.ndim == 1 \
            and lhs.size * rhs.size >= LOOP_MIN_ENTRIES:
        return [_outer(builder, lhs, rhs)]
    if not nb and k > 1:
        # (free entries, contracted entries) matrices; one side a strided parameter block?
        L = lhs.reshape(-1, k)
        R = rhs.reshape(-1, k)
        for weights, vectors, weights_first in ((L, R, True), (R, L, False)):
            layout = _strides(weights)
            if weights.size >= LOOP_MIN_ENTRIES and layout is not None:
                out = _looped_dot(builder, weights, layout, vectors)  # (vectors, weights)
                out = out.T if weights_first else out
                return [out.reshape(lshape + rshape)]
    out = np.empty(batch + lshape + rshape, dtype=object)
    for b in np.ndindex(batch):
        for li in np.ndindex(lshape):
            for ri in np.ndindex(rshape):
                terms = [_mul(builder, x, y)
                         for x, y in zip(lhs[b + li].ravel(), rhs[b + ri].ravel())]
                acc = terms[0] if terms else 0.0
                for term in terms[1:]:
                    acc = _add(builder, acc, term)
                out[b + li + ri] = acc
    return [out]


def _check_rules(jaxpr):
    """Refuse, before translating anything, the first primitive without a rule (in
    called jaxprs too): a `lax.cond` is named as such, not by the conversion of its
    predicate that comes first."""
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name not in RULES:
            raise _refuse(name)
        if name in _CALLS:
            inner = eqn.params[_CALLS[name]]
            _check_rules(getattr(inner, "jaxpr", inner))


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
        outs = RULES[eqn.primitive.name](builder, eqn.params, *(read(v) for v in eqn.invars))
        for var, val in zip(eqn.outvars, outs):
            env[var] = np.asarray(val, dtype=object)
    return [read(v) for v in jaxpr.outvars]


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
    return pack_leaves([x for x, _ in flat], [shared for _, shared in flat], n)


def pack_leaves(leaves, shared, n):
    """`pack` of the array leaves `_flat` lists (`shared`: their flags), as float64."""
    per = [np.asarray(x, np.float64).reshape(n, -1) for x, sh in zip(leaves, shared) if not sh]
    common = [np.asarray(x, np.float64).ravel() for x, sh in zip(leaves, shared) if sh]
    return (np.concatenate(per, axis=1) if per else np.zeros((n, 1)),
            np.concatenate(common) if common else np.zeros(1))


def unpack_leaves(P, S, leaves, shared):
    """The inverse of `pack_leaves`: `P (n, m)` and `S (k,)` cut back into arrays of
    the leaves' shapes and dtypes."""
    out, column, index = [], 0, 0
    for x, sh in zip(leaves, shared):
        size = int(np.size(x)) if sh else int(np.prod(np.shape(x)[1:], dtype=int))
        if sh:
            part, index = S[index:index + size], index + size
        else:
            part, column = P[:, column:column + size], column + size
        out.append(np.asarray(part, np.asarray(x).dtype).reshape(np.shape(x)))
    return out


def _inputs(one, shared, d):
    """The jaxpr's inputs as object arrays of Warp expressions: `t`, `y[k]`, and each
    parameter leaf's entries `p[i, column]` or `s[index]`."""
    column = index = 0
    leaves = []
    for leaf, is_shared in zip(jax.tree.leaves(one), shared, strict=True):
        size = int(np.size(leaf))
        if is_shared:
            names = [_param("s", index + k) for k in range(size)]
            index += size
        else:
            names = [_param("p", column + k) for k in range(size)]
            column += size
        leaves.append(np.asarray(names, dtype=object).reshape(np.shape(leaf)))
    y = np.asarray([_Sym(f"y[{k}]") for k in range(d)], dtype=object)
    return [np.asarray(_Sym("t"), dtype=object), y, *leaves]


def _function(name, f, t, y, one, shared, d, result_type, size):
    # Only the parameters' arrays are jaxpr inputs; code leaves (an activation
    # function) are closed over, so they are traced into the jaxpr like f itself.
    one, code = eqx.partition(one, eqx.is_array)
    closed = jax.make_jaxpr(lambda t, y, a: f(t, y, eqx.combine(a, code)))(t, y, one)
    _check_rules(closed.jaxpr)
    builder = _Builder()
    outs = _eval(builder, closed.jaxpr, closed.consts, _inputs(one, shared, d))
    out = np.asarray(outs[0], dtype=object)
    if out.size != size:
        raise UntranslatableField(f"{name} returns shape {out.shape}, expected {size} values")
    header = (f"@wp.func\ndef {name}(t: T, y: V, p: wp.array2d(dtype=T), "
              f"s: wp.array(dtype=T), i: int) -> {result_type}:")
    values = ", ".join(_code(x) for x in out.ravel())
    return "\n".join([builder.declarations() + header, *builder.lines,
                      f"    return {result_type}({values})", ""])


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


def _write_block(builder, values, array: str, base: int):
    """`array[i, base + q] += values[q]` for the entries of one parameter cotangent:
    one loop when they are an outer product laid out with constant strides (an
    `eqx.nn.Linear` weight's), else a statement per nonzero entry."""
    flat = values.ravel()
    first = flat[0] if flat.size else None
    if isinstance(first, _Outer) and flat.size >= LOOP_MIN_ENTRIES \
            and all(isinstance(x, _Outer) and (x.u, x.v) == (first.u, first.v) for x in flat):
        rows = max(x.r for x in flat) + 1
        cols = max(x.c for x in flat) + 1
        at = {(x.r, x.c): q for q, x in enumerate(flat)}
        if len(at) == flat.size == rows * cols:
            row = at.get((1, 0), 0) - at[(0, 0)] if rows > 1 else 0
            col = at.get((0, 1), 0) - at[(0, 0)] if cols > 1 else 0
            if all(q == at[(0, 0)] + r * row + c * col for (r, c), q in at.items()):
                target = f"{array}[i, {base + at[(0, 0)]} + r * {row} + c * {col}]"
                builder.lines += [f"    for r in range({rows}):",
                                  f"        for c in range({cols}):",
                                  f"            {target} = {target} + {first.u}[r] * {first.v}[c]"]
                return
    for q, x in enumerate(flat):
        if _is_const(x) and x == 0:
            continue
        target = f"{array}[i, {base + q}]"
        builder.lines.append(f"    {target} = {target} + {_code(x)}")


def translate_vjp(f_jax, params, y0, *, of: str = "field") -> str:
    """Warp source for the vector-Jacobian product of one trajectory's field
    (`of="field"`) or of its Jacobian `df/dy` (`of="jac"`, for Rosenbrock23's adjoint):

        field_vjp(t, y, lam: V, p, s, i, gp, gs) -> V
        jac_vjp(t, y, lam: M, p, s, i, gp, gs) -> V

    returns `lam^T dg/dy` (g the field or its Jacobian, `lam` its cotangent) and adds
    `lam^T dg/dtheta` into row `i` of `gp` (the trajectory's own parameters, `p`'s
    layout) and of `gs` (the shared ones, `s`'s layout; rows are summed over
    trajectories by the caller). It is the translation of the jaxpr of `jax.vjp` of g
    -- JAX's own derivative, written out.

    Raises:
        UntranslatableField: naming the JAX primitive it cannot translate.
    """
    one, shared = _one_trajectory(params), [s for _, s in _flat(params)]
    d = y0.shape[-1]
    arrays, code = eqx.partition(one, eqx.is_array)
    leaves, treedef = jax.tree.flatten(arrays)
    inexact = [eqx.is_inexact_array(x) for x in leaves]

    def vjp(t, y, leaves, lam):
        diff = [x for x, keep in zip(leaves, inexact) if keep]

        def f(y, diff):
            it = iter(diff)
            full = [next(it) if keep else x for x, keep in zip(leaves, inexact)]
            args = eqx.combine(jax.tree.unflatten(treedef, full), code)
            if of == "jac":
                return jax.jacfwd(f_jax, argnums=1)(t, y, args)
            return f_jax(t, y, args)
        _, back = jax.vjp(f, y, diff)
        return back(lam)

    t = jnp.zeros((), y0.dtype)
    y = jnp.zeros((d,), y0.dtype)
    shape = (d, d) if of == "jac" else (d,)
    closed = jax.make_jaxpr(vjp)(t, y, leaves, jnp.zeros(shape, y0.dtype))
    _check_rules(closed.jaxpr)
    builder = _Builder()
    lam = np.empty(shape, dtype=object)
    for k in np.ndindex(shape):
        lam[k] = _Sym(f"lam[{', '.join(map(str, k))}]")
    outs = _eval(builder, closed.jaxpr, closed.consts, [*_inputs(arrays, shared, d), lam])
    dy, grads = np.asarray(outs[0], dtype=object), iter(outs[1:])
    column = index = 0
    for leaf, is_shared, keep in zip(leaves, shared, inexact, strict=True):
        size = int(np.size(leaf))
        if keep:
            _write_block(builder, np.asarray(next(grads), dtype=object),
                         "gs" if is_shared else "gp", index if is_shared else column)
        if is_shared:
            index += size
        else:
            column += size
    header = (f"@wp.func\ndef {of}_vjp(t: T, y: V, lam: {'M' if of == 'jac' else 'V'}, "
              "p: wp.array2d(dtype=T), s: wp.array(dtype=T), i: int, "
              "gp: wp.array2d(dtype=T), gs: wp.array2d(dtype=T)) -> V:")
    values = ", ".join(_code(x) for x in dy.ravel())
    return "\n".join([builder.declarations() + header, *builder.lines,
                      f"    return V({values})", ""])
