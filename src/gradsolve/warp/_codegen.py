"""Generate the fused Warp kernels from the one tableau.

A kernel is generated once per (method, field, d, dtype) as Python source text: the
stage arithmetic is unrolled from the same tableau objects the JAX steps read
(`gradsolve.methods`), every coefficient emitted as `T(literal)` with all its digits,
and the step control mirrors `gradsolve.control` using its constants. A thread runs
whole adaptive solves: trial steps, error norm, accept/reject, step size, the
requested outputs `ts` (one extra plain step from the preceding accepted point, as the
JAX replay does), and -- when recording -- each accepted step size.

Loops are kept dynamic (`max_unroll = 0`): unrolled Gauss--Jordan elimination at
d = 8 does not finish compiling in reasonable time. Modules compile at -O3 (on this
CPU about 20% faster than Warp's CPU default -O2 on Lorenz and HIRES).

Each thread runs `lanes` trajectories side by side, statement by statement (two on
the CPU, `_fused.CPU_LANES`): one trajectory's step is a long chain of dependent
operations, and interleaving independent ones gives the core work to overlap. Floating
point contraction stays off (Warp's default), so a trajectory's result does not depend
on its lane or on the ensemble's size, bit for bit. (With `-ffp-contract=fast` LLVM
contracted differently per lane on d = 8 fields; it brought the step sizes closer to
XLA's, which always contracts, but not to bit-for-bit agreement -- docs/engines.md,
"How close the two recorders are".)
"""

import re

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


def _header(d: int, bits: int) -> str:
    return f'''import warp as wp

wp.set_module_options({{"max_unroll": 0, "enable_backward": False, "optimization_level": 3}})

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


def _erk_trial(tab) -> list[str]:
    """The statements of one trial step, from `(t, y, f0, h, i)` to
    `(y_new, err, f_new)`."""
    s = tab.stages
    body = ["k0 = f0"]
    names = ["k0"]
    for i in range(1, s):
        arg = _combo(tab.a_lower[i - 1], names)
        body.append(f"k{i} = field(t + {_lit(tab.c[i - 1])} * h, y + h * ({arg}), p, s, i)")
        names.append(f"k{i}")
    body.append(f"y_new = y + h * ({_combo(tab.b, names)})")
    # As methods._erk.error_estimate: sum_{j>0} w_j (k_j - k_0), no cancellation.
    diffs = [f"({k} - k0)" for k in names[1:]]
    body.append(f"err = h * ({_combo(tab.b_error[1:], diffs)})")
    body.append(f"f_new = {f'k{s - 1}' if tab.fsal else 'field(t + h, y_new, p, s, i)'}")
    return body


def _erk_plain(tab) -> str:
    names = [f"k{i}" for i in range(tab.stages)]
    n_plain = int(np.flatnonzero(tab.b)[-1]) + 1
    lines = ["", "", "@wp.func",
             "def plain(t: T, y: V, h: T, p: wp.array2d(dtype=T), s: wp.array(dtype=T), "
             "i: int) -> V:",
             "    k0 = field(t, y, p, s, i)"]
    for i in range(1, n_plain):
        arg = _combo(tab.a_lower[i - 1], names[:i])
        lines.append(f"    k{i} = field(t + {_lit(tab.c[i - 1])} * h, y + h * ({arg}), p, s, i)")
    lines.append(f"    return y + h * ({_combo(tab.b[:n_plain], names[:n_plain])})")
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


def _rosenbrock23_trial(method: Rosenbrock23) -> list[str]:
    d, e32 = _lit(method.tableau.d), _lit(method.tableau.e32)
    return [
        "Wi = w_inverse(t, y, h, p, s, i)",
        "k1 = Wi * f0",
        "f1 = field(t + T(0.5) * h, y + (T(0.5) * h) * k1, p, s, i)",
        "k2 = Wi * (f1 - k1) + k1",
        "y_new = y + h * k2",
        "f_new = field(t + h, y_new, p, s, i)",
        f"k3 = Wi * (f_new - {e32} * (k2 - f1) - T(2.0) * (k1 - f0))",
        "err = (h / T(6.0)) * (k1 - T(2.0) * k2 + k3)",
    ]


def _rosenbrock23_plain(method: Rosenbrock23) -> str:
    return _INVERSE + f'''

@wp.func
def w_inverse(t: T, y: V, h: T, p: wp.array2d(dtype=T), s: wp.array(dtype=T), i: int) -> M:
    return inverse(wp.identity(n=D, dtype=T) - (h * {_lit(method.tableau.d)}) * jac(t, y, p, s, i))


@wp.func
def plain(t: T, y: V, h: T, p: wp.array2d(dtype=T), s: wp.array(dtype=T), i: int) -> V:
    if h == T(0.0):
        return y
    Wi = w_inverse(t, y, h, p, s, i)
    k1 = Wi * field(t, y, p, s, i)
    f1 = field(t + T(0.5) * h, y + (T(0.5) * h) * k1, p, s, i)
    return y + h * (Wi * (f1 - k1) + k1)
'''


def _in_lane(statement: str, names, lane: int) -> str:
    """`statement` with each of `names` renamed to lane `lane`'s copy (`y` -> `y_1`)."""
    pattern = r"\b(" + "|".join(sorted(names, key=len, reverse=True)) + r")\b"
    return re.sub(pattern, lambda m: f"{m.group(1)}_{lane}", statement)


def _trial_lanes(body: list[str], lanes: int) -> str:
    """The trial step of every lane, statement by statement: lane 1's stage k runs
    beside lane 0's, so the CPU overlaps the two dependency chains."""
    names = {"t", "y", "f0", "h", "i"} | {line.split(" = ")[0] for line in body}
    return "".join(f"        {_in_lane(line, names, n)}\n" for line in body
                   for n in range(lanes))


# The kernel: each thread runs LANES trajectories side by side (`_L_` below becomes the
# lane number). On the CPU one trajectory's step is a long chain of dependent
# operations; interleaving independent lanes gives the core work to overlap. A lane that
# has finished keeps taking zero steps (identities) until every lane of its thread has.
_KERNEL_HEAD = """

@wp.kernel
def solve(y0: wp.array2d(dtype=T), p: wp.array2d(dtype=T), s: wp.array(dtype=T),
          t_first: wp.array(dtype=T), ts: wp.array(dtype=T), n_ts: int,
          t0: T, t1: T, floor: T, rtol: T, atol: T, max_steps: int, width: int, m: int,
          h_out: wp.array2d(dtype=T), y_out: wp.array2d(dtype=T),
          ys_out: wp.array3d(dtype=T), n_acc: wp.array(dtype=wp.int32),
          n_rej: wp.array(dtype=wp.int32), status: wp.array(dtype=wp.int32)):
    base = wp.tid() * {lanes}
"""

_LANE_START = """
    i_L_ = wp.min(base + _N_, m - 1)
    live_L_ = int(0)
    if base + _N_ < m and t0 < t1:
        live_L_ = 1
    y_L_ = V()
    for k in range(D):
        y_L_[k] = y0[i_L_, k]
    t_L_ = t0
    t_next_L_ = t_first[i_L_]
    f0_L_ = field(t_L_, y_L_, p, s, i_L_)
    acc_L_ = int(0)
    rej_L_ = int(0)
    code_L_ = int({success})
    j_L_ = int(0)
"""

_LANE_TRIAL = """
        h_L_ = T(0.0)
        if live_L_ == 1:
            if t_next_L_ <= t_L_:
                # control.underflow: a step that does not advance t is never taken.
                code_L_ = int({underflow})
                live_L_ = 0
            else:
                h_L_ = t_next_L_ - t_L_
"""

_LANE_CONTROL = """
        if live_L_ == 1:
            ratio_L_ = error_ratio(y_L_, y_new_L_, err_L_, rtol, atol)
            accept_L_ = int(0)
            if ratio_L_ < T(1.0):
                accept_L_ = 1
            h_next_L_ = h_L_ * step_factor(ratio_L_, accept_L_)
            t_new_L_ = t_L_
            if accept_L_ == 1:
                # Outputs inside [t, t + h): one extra plain step from the accepted point.
                while j_L_ < n_ts and ts[j_L_] < t_next_L_:
                    extra_L_ = plain(t_L_, y_L_, ts[j_L_] - t_L_, p, s, i_L_)
                    for k in range(D):
                        ys_out[i_L_, j_L_, k] = extra_L_[k]
                    j_L_ = j_L_ + 1
                if acc_L_ < width:
                    h_out[i_L_, acc_L_] = h_L_
                acc_L_ = acc_L_ + 1
                if finite(y_new_L_) == 0:
                    code_L_ = int({nonfinite})
                y_L_ = y_new_L_
                f0_L_ = f_new_L_
                t_new_L_ = t_next_L_
            else:
                rej_L_ = rej_L_ + 1
            # control.clip_to_end: snap onto t1 within 100 ulp, halve towards it on retry.
            t_next_L_ = t_new_L_ + h_next_L_
            if t_next_L_ > floor:
                if accept_L_ == 1:
                    t_next_L_ = t1
                else:
                    t_next_L_ = t_new_L_ + T(0.5) * (t1 - t_new_L_)
            t_L_ = wp.min(t_new_L_, t1)
            if code_L_ != int({success}):
                live_L_ = 0
            elif t_L_ >= t1:
                live_L_ = 0
            elif t_next_L_ <= t_L_:
                code_L_ = int({underflow})
                live_L_ = 0
            elif acc_L_ + rej_L_ >= max_steps:
                code_L_ = int({max_steps_code})
                live_L_ = 0
"""

_LANE_FINISH = """
    if base + _N_ < m:
        while j_L_ < n_ts:
            extra_L_ = plain(t_L_, y_L_, ts[j_L_] - t_L_, p, s, i_L_)
            for k in range(D):
                ys_out[i_L_, j_L_, k] = extra_L_[k]
            j_L_ = j_L_ + 1
        for k in range(D):
            y_out[i_L_, k] = y_L_[k]
        n_acc[i_L_] = acc_L_
        n_rej[i_L_] = rej_L_
        status[i_L_] = code_L_
"""


def _kernel(trial: list[str], lanes: int) -> str:
    codes = dict(success=int(Status.SUCCESS), nonfinite=int(Status.NONFINITE),
                 underflow=int(Status.DT_UNDERFLOW), max_steps_code=int(Status.MAX_STEPS))

    def each(template):
        text = template.format(**codes)
        return "".join(text.replace("_L_", f"_{n}").replace("_N_", str(n))
                       for n in range(lanes))

    live = " + ".join(f"live_{n}" for n in range(lanes))
    return (_KERNEL_HEAD.format(lanes=lanes) + each(_LANE_START)
            + f"    while {live} > 0:\n" + each(_LANE_TRIAL) + _trial_lanes(trial, lanes)
            + each(_LANE_CONTROL)
            + each(_LANE_FINISH))


def kernel_source(method, field_source: str, d: int, bits: int, lanes: int = 1) -> str:
    """The whole generated module for one (method, field, d, dtype, lanes per thread)."""
    if isinstance(method, ExplicitRungeKutta):
        trial, steps = _erk_trial(method.tableau), _erk_plain(method.tableau)
    elif isinstance(method, Rosenbrock23):
        trial, steps = _rosenbrock23_trial(method), _rosenbrock23_plain(method)
    else:
        raise ValueError(f"the fused kernels run tsit5 and rosenbrock23, not {method.name!r}")
    common = _COMMON.format(d_float=_lit(d), safety=_lit(control.SAFETY),
                            factor_min=_lit(control.FACTOR_MIN),
                            factor_max=_lit(control.FACTOR_MAX),
                            inv_order=_lit(1.0 / method.error_order),
                            ratio_no_growth=_lit(1.001 * control.SAFETY ** method.error_order))
    return _header(d, bits) + "\n" + field_source + common + steps + _kernel(trial, lanes)
