"""Generate the fused Warp kernels from the one tableau.

A kernel is generated once per (method, field, d, dtype) as Python source text: the
stage arithmetic is unrolled from the same tableau objects the JAX steps read
(`gradsolve.methods`), every coefficient emitted as `T(literal)` with all its digits,
and the step control mirrors `gradsolve.control` using its constants. One thread runs
one trajectory's whole adaptive solve: trial steps, error norm, accept/reject, step
size, the requested outputs `ts` (one extra plain step from the preceding accepted
point, as the JAX replay does), and -- when recording -- each accepted step size.

Loops are kept dynamic (`max_unroll = 0`): unrolled Gauss--Jordan elimination at
d = 8 does not finish compiling in reasonable time.

Roundoff is kept close to the JAX steps' on the CPU: XLA's CPU backend always
contracts a multiply feeding an add into one FMA, so the kernels are compiled with
`-ffp-contract=fast` (Warp's default keeps them apart), and each stage increment is
written in the form XLA leaves it in (`_increment`). Where the arithmetic still
differs in the last bit, the step-size controller can amplify it (see
docs/engines.md, "How close the two recorders are").
"""

import numpy as np

from .. import control
from ..methods import ExplicitRungeKutta, Rosenbrock23
from ..status import Status


def _lit(x) -> str:
    return f"T({float(x)!r})"


def _combo(weights, names):
    """`T(w0) * k0 + T(w1) * k1 ...` over nonzero weights."""
    terms = [f"{_lit(w)} * {k}" for w, k in zip(weights, names) if w != 0]
    return " + ".join(terms) if terms else "V()"


def _increment(weights, names):
    """`h * (sum_j w_j k_j)`, or `(h * w) * k` for one term: as `methods._erk._combine`."""
    nonzero = [(w, k) for w, k in zip(weights, names) if w != 0]
    if len(nonzero) == 1:
        return f"(h * {_lit(nonzero[0][0])}) * {nonzero[0][1]}"
    return f"h * ({_combo(weights, names)})"


def _header(d: int, bits: int) -> str:
    return f'''import warp as wp

wp.set_module_options({{"max_unroll": 0, "enable_backward": False,
                       "cpu_compiler_flags": "-march=native -ffp-contract=fast"}})

T = wp.float{bits}
V = wp.types.vector(length={d}, dtype=T)
M = wp.types.matrix(shape=({d}, {d}), dtype=T)
D = {d}
'''


_COMMON = '''

@wp.func
def error_ratio(y: V, y_new: V, err: V, rtol: T, atol: T) -> T:
    # RMS of err / (atol + rtol max(|y|, |y_new|)); NaN reads as an infinite error
    # (control.error_ratio).
    bad = int(0)
    for k in range(D):
        if wp.isnan(y_new[k]):
            bad = 1
    acc = T(0.0)
    for k in range(D):
        e = err[k]
        if wp.isnan(e):
            return T(1.0e300)
        yn = y_new[k]
        if bad == 1:
            yn = y[k]
        q = e / (atol + rtol * wp.max(wp.abs(y[k]), wp.abs(yn)))
        acc = acc + q * q
    return wp.sqrt(acc / {d_float})


@wp.func
def step_factor(ratio: T, accept: int) -> T:
    # control.propose: integral control, factor clipped to [1, MAX] after an accepted
    # step and to [MIN, SAFETY] after a rejected one.
    lo = T(1.0)
    hi = {factor_max}
    if accept == 0:
        lo = {factor_min}
        hi = {safety}
    elif ratio >= {ratio_no_growth}:
        return lo  # the factor would be below 1: skip exp and log, a fifth of the run
    factor = {safety} * wp.exp(wp.log(ratio) * (-{inv_order}))
    return wp.min(wp.max(factor, lo), hi)


@wp.func
def finite(y: V) -> int:
    for k in range(D):
        if not wp.isfinite(y[k]):
            return 0
    return 1
'''


def _erk_steps(method: ExplicitRungeKutta) -> str:
    tab = method.tableau
    s = tab.stages
    lines = ["", "", "@wp.func",
             "def trial(t: T, y: V, f0: V, h: T, p: wp.array2d(dtype=T), "
             "s: wp.array(dtype=T), i: int):",
             "    k0 = f0"]
    names = ["k0"]
    for i in range(1, s):
        arg = _increment(tab.a_lower[i - 1], names)
        lines.append(f"    k{i} = field(t + {_lit(tab.c[i - 1])} * h, y + {arg}, p, s, i)")
        names.append(f"k{i}")
    lines.append(f"    y_new = y + {_increment(tab.b, names)}")
    # As methods._erk.error_estimate: sum_{j>0} w_j (k_j - k_0), no cancellation.
    diffs = [f"({k} - k0)" for k in names[1:]]
    lines.append(f"    err = h * ({_combo(tab.b_error[1:], diffs)})")
    f_new = f"k{s - 1}" if tab.fsal else "field(t + h, y_new, p, s, i)"
    lines.append(f"    f_new = {f_new}")
    lines.append("    return y_new, err, f_new")
    n_plain = int(np.flatnonzero(tab.b)[-1]) + 1
    lines += ["", "", "@wp.func",
              "def plain(t: T, y: V, h: T, p: wp.array2d(dtype=T), s: wp.array(dtype=T), "
              "i: int) -> V:",
              "    k0 = field(t, y, p, s, i)"]
    for i in range(1, n_plain):
        arg = _increment(tab.a_lower[i - 1], names[:i])
        lines.append(f"    k{i} = field(t + {_lit(tab.c[i - 1])} * h, y + {arg}, p, s, i)")
    lines.append(f"    return y + {_increment(tab.b[:n_plain], names[:n_plain])}")
    return "\n".join(lines) + "\n"


_INVERSE = '''

@wp.func
def inverse(A: M) -> M:
    # Gauss--Jordan elimination with partial pivoting: W is factored once per step
    # and every stage is a matrix-vector product with its inverse.
    a = A
    inv = wp.identity(n=D, dtype=T)
    for c in range(D):
        piv = c
        big = wp.abs(a[c, c])
        for r in range(c + 1, D):
            if wp.abs(a[r, c]) > big:
                big = wp.abs(a[r, c])
                piv = r
        if piv != c:
            for k in range(D):
                tmp = a[c, k]
                a[c, k] = a[piv, k]
                a[piv, k] = tmp
                tmp = inv[c, k]
                inv[c, k] = inv[piv, k]
                inv[piv, k] = tmp
        scale = T(1.0) / a[c, c]
        for k in range(D):
            a[c, k] = a[c, k] * scale
            inv[c, k] = inv[c, k] * scale
        for r in range(D):
            if r != c:
                m = a[r, c]
                for k in range(D):
                    a[r, k] = a[r, k] - m * a[c, k]
                    inv[r, k] = inv[r, k] - m * inv[c, k]
    return inv
'''


def _rosenbrock23_steps(method: Rosenbrock23) -> str:
    d, e32 = _lit(method.tableau.d), _lit(method.tableau.e32)
    return _INVERSE + f'''

@wp.func
def w_inverse(t: T, y: V, h: T, p: wp.array2d(dtype=T), s: wp.array(dtype=T), i: int) -> M:
    return inverse(wp.identity(n=D, dtype=T) - (h * {d}) * jac(t, y, p, s, i))


@wp.func
def trial(t: T, y: V, f0: V, h: T, p: wp.array2d(dtype=T), s: wp.array(dtype=T),
          i: int):
    Wi = w_inverse(t, y, h, p, s, i)
    k1 = Wi * f0
    f1 = field(t + T(0.5) * h, y + (T(0.5) * h) * k1, p, s, i)
    k2 = Wi * (f1 - k1) + k1
    y_new = y + h * k2
    f2 = field(t + h, y_new, p, s, i)
    k3 = Wi * (f2 - {e32} * (k2 - f1) - T(2.0) * (k1 - f0))
    err = (h / T(6.0)) * (k1 - T(2.0) * k2 + k3)
    return y_new, err, f2


@wp.func
def plain(t: T, y: V, h: T, p: wp.array2d(dtype=T), s: wp.array(dtype=T), i: int) -> V:
    if h == T(0.0):
        return y
    Wi = w_inverse(t, y, h, p, s, i)
    k1 = Wi * field(t, y, p, s, i)
    f1 = field(t + T(0.5) * h, y + (T(0.5) * h) * k1, p, s, i)
    return y + h * (Wi * (f1 - k1) + k1)
'''


_KERNEL = '''

@wp.kernel
def solve(y0: wp.array2d(dtype=T), p: wp.array2d(dtype=T), s: wp.array(dtype=T),
          t_first: wp.array(dtype=T), ts: wp.array(dtype=T), n_ts: int,
          t0: T, t1: T, floor: T, rtol: T, atol: T, max_steps: int, record: int,
          h_out: wp.array2d(dtype=T), y_out: wp.array2d(dtype=T),
          ys_out: wp.array3d(dtype=T), n_acc: wp.array(dtype=wp.int32),
          n_rej: wp.array(dtype=wp.int32), status: wp.array(dtype=wp.int32)):
    i = wp.tid()
    y = V()
    for k in range(D):
        y[k] = y0[i, k]
    t = t0
    t_next = t_first[i]
    f0 = field(t, y, p, s, i)
    acc = int(0)
    rej = int(0)
    code = int({success})
    j = int(0)
    while t < t1:
        h = t_next - t
        y_new, err, f_new = trial(t, y, f0, h, p, s, i)
        ratio = error_ratio(y, y_new, err, rtol, atol)
        accept = int(0)
        if ratio < T(1.0):
            accept = 1
        h_next = h * step_factor(ratio, accept)
        t_new = t
        if accept == 1:
            # Outputs inside [t, t + h): one extra plain step from the accepted point.
            while j < n_ts and ts[j] < t_next:
                extra = plain(t, y, ts[j] - t, p, s, i)
                for k in range(D):
                    ys_out[i, j, k] = extra[k]
                j = j + 1
            if record == 1:
                h_out[i, acc] = h
            acc = acc + 1
            if finite(y_new) == 0:
                code = int({nonfinite})
            y = y_new
            f0 = f_new
            t_new = t_next
        else:
            rej = rej + 1
        # control.clip_to_end: snap onto t1 within 100 ulp, halve towards it on retry.
        t_next = t_new + h_next
        if t_next > floor:
            if accept == 1:
                t_next = t1
            else:
                t_next = t_new + T(0.5) * (t1 - t_new)
        t = wp.min(t_new, t1)
        if code != int({success}):
            break
        if t < t1 and t_next <= t:
            code = int({underflow})
            break
        if t < t1 and acc + rej >= max_steps:
            code = int({max_steps_code})
            break
    while j < n_ts:
        extra = plain(t, y, ts[j] - t, p, s, i)
        for k in range(D):
            ys_out[i, j, k] = extra[k]
        j = j + 1
    for k in range(D):
        y_out[i, k] = y[k]
    n_acc[i] = acc
    n_rej[i] = rej
    status[i] = code
'''


def kernel_source(method, field_source: str, d: int, bits: int) -> str:
    """The whole generated module for one (method, field, d, dtype)."""
    if isinstance(method, ExplicitRungeKutta):
        steps = _erk_steps(method)
    elif isinstance(method, Rosenbrock23):
        steps = _rosenbrock23_steps(method)
    else:
        raise ValueError(f"the fused kernels run tsit5 and rosenbrock23, not {method.name!r}")
    common = _COMMON.format(d_float=_lit(d), safety=_lit(control.SAFETY),
                            factor_min=_lit(control.FACTOR_MIN),
                            factor_max=_lit(control.FACTOR_MAX),
                            inv_order=_lit(1.0 / method.error_order),
                            ratio_no_growth=_lit(1.001 * control.SAFETY ** method.error_order))
    kernel = _KERNEL.format(success=int(Status.SUCCESS), nonfinite=int(Status.NONFINITE),
                            underflow=int(Status.DT_UNDERFLOW),
                            max_steps_code=int(Status.MAX_STEPS))
    return _header(d, bits) + "\n" + field_source + common + steps + kernel
