"""Step bodies of the fused kernels, generated from the one tableau.

Everything here is Warp source text written from the objects the JAX steps read: the
stage arithmetic is unrolled from the tableaux in `gradsolve.methods`, every
coefficient emitted as `T(literal)` with all its digits, and the step control
(`error_ratio`, `step_factor`) is a generated copy of the rules in `gradsolve.control`,
built from its constants. The kernels do not call `control.py` (it is JAX); they embed
these copies, and the tests check that both take the same steps.

A step class contributes its emitters, one `Emitter` in `EMITTERS` (so every method
registered with that class runs in the kernels, nothing else to list):

- the *trial* step, a list of statements from `(t, y, f0, h, i)` to
  `(y_new, err, f_new)`, which the kernel skeleton (`_kernels`) copies once per lane;
- the *plain* step, a `@wp.func plain(t, y, h, p, s, i) -> V` without error estimate,
  for the requested outputs `ts`;
- the step's adjoint, for the in-kernel adjoint, and optionally the continuous
  extension's value and adjoint.

Explicit Runge--Kutta methods are generated here from their tableau; Rosenbrock23's
bodies are written by hand in `_rosenbrock23`.
"""

from typing import Callable, NamedTuple

import numpy as np

from .. import control, methods
from ..methods import ExplicitRungeKutta, Rosenbrock23
from . import _rosenbrock23
from ._source import combo, lit


_CONTROL = '''

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


def control_source(method, d: int) -> str:
    """`error_ratio`, `step_factor` and `finite`: generated copies of
    `control.error_ratio` and `control.propose` with its constants and the method's
    error order."""
    return _CONTROL.format(d_float=lit(d), safety=lit(control.SAFETY),
                           factor_min=lit(control.FACTOR_MIN),
                           factor_max=lit(control.FACTOR_MAX),
                           inv_order=lit(1.0 / method.error_order),
                           ratio_no_growth=lit(1.001 * control.SAFETY ** method.error_order))


def _erk_trial(tab) -> list[str]:
    s = tab.stages
    body = ["k0 = f0", *_stage_slopes(tab, 1, s, "")]
    names = [f"k{i}" for i in range(s)]
    body.append(f"y_new = y + h * ({combo(tab.b, names)})")
    # As methods._erk.error_estimate: sum_{j>0} w_j (k_j - k_0), no cancellation.
    diffs = [f"({k} - k0)" for k in names[1:]]
    body.append(f"err = h * ({combo(tab.b_error[1:], diffs)})")
    body.append(f"f_new = {f'k{s - 1}' if tab.fsal else 'field(t + h, y_new, p, s, i)'}")
    return body


def _stage_slopes(tab, lo: int, hi: int, indent: str) -> list[str]:
    """Stage slopes `k_j = f(t + c_j h, y + h sum_{l<j} a_jl k_l)` for `lo <= j < hi`."""
    names = [f"k{j}" for j in range(hi)]
    return [f"{indent}k{j} = field(t + {lit(tab.c_all[j - 1])} * h, "
            f"y + h * ({combo(tab.a_all[j - 1], names[:j])}), p, s, i)"
            for j in range(lo, hi)]


def _erk_plain(tab) -> str:
    names = [f"k{i}" for i in range(tab.stages)]
    n_plain = int(np.flatnonzero(tab.b)[-1]) + 1
    lines = ["", "", "@wp.func",
             "def plain(t: T, y: V, h: T, p: wp.array2d(dtype=T), s: wp.array(dtype=T), "
             "i: int) -> V:",
             "    k0 = field(t, y, p, s, i)"]
    lines += _stage_slopes(tab, 1, n_plain, "    ")
    lines.append(f"    return y + h * ({combo(tab.b[:n_plain], names[:n_plain])})")
    return "\n".join(lines) + "\n"


def _stage_points(tab, lo: int, hi: int, indent: str) -> list[str]:
    """Stage points `Y_j = y + h sum_{l<j} a_jl k_l` for `lo <= j < hi`, with their
    slopes `k_j` for all but the last (whose slope feeds no later stage)."""
    names = [f"k{j}" for j in range(hi)]
    lines = []
    for j in range(lo, hi):
        lines.append(f"{indent}Y{j} = y + h * ({combo(tab.a_all[j - 1][:j], names[:j])})")
        if j < hi - 1:
            lines.append(f"{indent}k{j} = field(t + {lit(tab.c_all[j - 1])} * h, Y{j}, p, s, i)")
    return lines


def _walk_back(tab, hi: int, lo: int, indent: str) -> list[str]:
    """The reverse walk over stages `hi - 1` down to `lo >= 1`: `adj(Y_j) =
    field_vjp(Y_j, adj(k_j))` added to `y`'s adjoint and passed on to the slopes it
    was built from, `adj(k_l) += h a_jl adj(Y_j)`."""
    lines = []
    for j in range(hi - 1, lo - 1, -1):
        lines.append(f"{indent}aY = field_vjp(t + {lit(tab.c_all[j - 1])} * h, Y{j}, ak{j}, "
                     f"p, s, i, gp, gs)")
        lines.append(f"{indent}adj = adj + aY")
        for l, a in enumerate(tab.a_all[j - 1][:j]):
            if a != 0:
                lines.append(f"{indent}ak{l} = ak{l} + (h * {lit(a)}) * aY")
    return lines


def _erk_step_vjp(tab) -> str:
    """`step_vjp(t, y, h, lam, ...) -> V`: `lam^T d(plain step)/dy`, adding the
    parameters' part into `gp`/`gs` through `field_vjp` (`_translate.translate_vjp`).

    The plain step is `y + h sum_j b_j k_j` with `k_j = f(t + c_j h, Y_j)` and
    `Y_j = y + h sum_{l<j} a_jl k_l`: its adjoint recomputes the stage points `Y_j`
    from `y`, then walks the stages in reverse -- `adj(k_j) = h b_j lam + h sum_{i>j}
    a_ij adj(Y_i)`, `adj(Y_j) = field_vjp(Y_j, adj(k_j))` -- and returns
    `lam + sum_j adj(Y_j)`. Nothing per stage is stored between steps."""
    n = int(np.flatnonzero(tab.b)[-1]) + 1
    lines = ["", "", "@wp.func",
             "def step_vjp(t: T, y: V, h: T, lam: V, p: wp.array2d(dtype=T), "
             "s: wp.array(dtype=T), i: int, gp: wp.array2d(dtype=T), "
             "gs: wp.array2d(dtype=T)) -> V:",
             "    k0 = field(t, y, p, s, i)"]
    lines += _stage_points(tab, 1, n, "    ")
    for j in range(n):
        lines.append(f"    ak{j} = (h * {lit(tab.b[j])}) * lam" if tab.b[j] != 0
                     else f"    ak{j} = V()")
    lines.append("    adj = lam")
    lines += _walk_back(tab, n, 1, "    ")
    lines.append("    adj = adj + field_vjp(t, y, ak0, p, s, i, gp, gs)")
    lines.append("    return adj")
    return "\n".join(lines) + "\n"


def _dense_weights(tab, indent: str) -> list[str]:
    """Statements `w{i} = b_i(theta)` for every stage with a nonzero weight in the
    continuous extension, in the form `ExplicitRungeKutta.interpolate` evaluates:
    `theta` times a polynomial in `theta - 1/2` (`tab.dense_centered`), by Horner."""
    lines = [f"{indent}sd = theta - T(0.5)"]
    for i, (row, centered) in enumerate(zip(tab.dense, tab.dense_centered)):
        if np.any(row != 0):
            poly = lit(centered[-1])
            for c in centered[-2::-1]:
                poly = f"({lit(c)} + sd * {poly})"
            lines.append(f"{indent}w{i} = theta * {poly}")
    return lines


def _dense_stages(tab):
    """`(n, used)`: the stages the plain step needs, and those the extension weighs."""
    n = int(np.flatnonzero(tab.b)[-1]) + 1
    used = [i for i, row in enumerate(tab.dense) if np.any(row != 0)]
    return n, used


def kernel_extension(method) -> list[str] | None:
    """Statements from a trial step's stages `k0..k{s-1}` (of size `h` from `(t, y)`)
    and an output time `ts[j]` inside it to `extra`, the continuous extension there;
    None where the kernels have none for `method` (`has_kernel_extension`)."""
    if not has_kernel_extension(method):
        return None
    tab = method.tableau
    _, used = _dense_stages(tab)
    return [*_stage_slopes(tab, tab.stages, tab.dense_stages, ""),
            "theta = (ts[j] - t) / h", *_dense_weights(tab, ""),
            f"extra = y + h * ({' + '.join(f'w{l} * k{l}' for l in used)})"]


def _erk_dense_advance(tab) -> str:
    """`dense_advance(t, y, h, ts, j0, j1, ys_out, p, s, i) -> V`: the plain step of
    size `h` from `(t, y)`, and the outputs `ts[j0:j1]` inside it written to
    `ys_out[i]` from the step's stages, `y + h sum_l b_l(theta) k_l` (the same
    continuous extension as `ExplicitRungeKutta.interpolate`). The stages after the
    plain step's last (Tsit5's FSAL slope at the new state, Vern7's extra stages) are
    evaluated only for a step that holds outputs."""
    n, used = _dense_stages(tab)
    s = tab.dense_stages
    names = [f"k{j}" for j in range(s)]
    lines = ["", "", "@wp.func",
             "def dense_advance(t: T, y: V, h: T, ts: wp.array(dtype=T), j0: int, j1: int, "
             "ys_out: wp.array3d(dtype=T), p: wp.array2d(dtype=T), s: wp.array(dtype=T), "
             "i: int) -> V:",
             "    k0 = field(t, y, p, s, i)"]
    lines += _stage_slopes(tab, 1, n, "    ")
    lines.append(f"    y_new = y + h * ({combo(tab.b[:n], names[:n])})")
    lines.append("    if j1 > j0:")
    lines += _stage_slopes(tab, n, s, "        ")
    lines.append("        for j in range(j0, j1):")
    lines.append("            theta = (ts[j] - t) / h")
    lines += _dense_weights(tab, "            ")
    lines.append(f"            out = y + h * ({' + '.join(f'w{l} * k{l}' for l in used)})")
    lines.append("            for k in range(D):")
    lines.append("                ys_out[i, j, k] = out[k]")
    lines.append("    return y_new")
    return "\n".join(lines) + "\n"


def _erk_dense_vjp(tab) -> str:
    """`dense_vjp(t, y, h, lam, ct, ts, j0, j1, ...) -> V`: the adjoint of
    `dense_advance` -- `lam` the cotangent of the step's new state and `ct[i, j]` those
    of its outputs `j0 <= j < j1` -- in one reverse walk over the stages, as
    `step_vjp`: each output adds `ct_j` to `y`'s adjoint and `h b_l(theta_j) ct_j` to
    stage l's slope's, beside the step's `h b_l lam`; the stages only the outputs
    weigh are walked only for a step that holds outputs."""
    n, used = _dense_stages(tab)
    s = tab.dense_stages
    lines = ["", "", "@wp.func",
             "def dense_vjp(t: T, y: V, h: T, lam: V, ct: wp.array3d(dtype=T), "
             "ts: wp.array(dtype=T), j0: int, j1: int, p: wp.array2d(dtype=T), "
             "s: wp.array(dtype=T), i: int, gp: wp.array2d(dtype=T), "
             "gs: wp.array2d(dtype=T)) -> V:",
             "    k0 = field(t, y, p, s, i)"]
    lines += _stage_points(tab, 1, n, "    ")
    for j in range(s):
        lines.append(f"    ak{j} = (h * {lit(tab.b[j])}) * lam" if j < n and tab.b[j] != 0
                     else f"    ak{j} = V()")
    lines.append("    adj = lam")
    lines.append("    if j1 > j0:")
    lines.append(f"        k{n - 1} = field(t + {lit(tab.c[n - 2])} * h, Y{n - 1}, p, s, i)")
    lines += _stage_points(tab, n, s, "        ")
    lines.append("        for j in range(j0, j1):")
    lines.append("            theta = (ts[j] - t) / h")
    lines += _dense_weights(tab, "            ")
    lines.append("            ctj = V()")
    lines.append("            for k in range(D):")
    lines.append("                ctj[k] = ct[i, j, k]")
    lines.append("            adj = adj + ctj")
    for l in used:
        lines.append(f"            ak{l} = ak{l} + (h * w{l}) * ctj")
    lines += _walk_back(tab, s, n, "        ")
    lines += _walk_back(tab, n, 1, "    ")
    lines.append("    adj = adj + field_vjp(t, y, ak0, p, s, i, gp, gs)")
    lines.append("    return adj")
    return "\n".join(lines) + "\n"


class Emitter(NamedTuple):
    """How the kernel generator writes one family of methods, each piece from the
    method's own tableau: `trial(method)`, the trial step's statements (the fused
    kernels); `plain(method)`, the plain step's `@wp.func`; `step_vjp(method)`, its
    adjoint (the in-kernel adjoint); `extension(method)`, `dense_advance` and
    `dense_vjp` for outputs from a method's continuous extension where it has one
    (None: the family's outputs are integrated)."""

    trial: Callable[..., list[str]]
    plain: Callable[..., str]
    step_vjp: Callable[..., str]
    extension: Callable[..., str] | None


# The one table of what the Warp kernels run: a method whose class (or a base of it) is
# here runs in the fused kernels and the in-kernel adjoint (`kernel_methods`, which the
# engines' method lists read); Rodas5P's class is not, yet.
EMITTERS = {
    ExplicitRungeKutta: Emitter(trial=lambda m: _erk_trial(m.tableau),
                                plain=lambda m: _erk_plain(m.tableau),
                                step_vjp=lambda m: _erk_step_vjp(m.tableau),
                                extension=lambda m: (_erk_dense_advance(m.tableau)
                                                     + _erk_dense_vjp(m.tableau))),
    Rosenbrock23: Emitter(trial=_rosenbrock23.trial, plain=_rosenbrock23.plain,
                          step_vjp=_rosenbrock23.step_vjp, extension=None),
}


def emitter(method) -> Emitter | None:
    """`method`'s entry of `EMITTERS` (by its class or the nearest base), or None."""
    return next((EMITTERS[c] for c in type(method).__mro__ if c in EMITTERS), None)


def kernel_methods() -> tuple[str, ...]:
    """The built-in methods the Warp kernels run, by name, in `methods.names()` order."""
    return tuple(n for n in methods.names() if emitter(methods.get(n)) is not None)


def _emitter(method) -> Emitter:
    e = emitter(method)
    if e is None:
        raise ValueError(f"the Warp kernels run {kernel_methods()}, not {method.name!r}")
    return e


def has_kernel_extension(method) -> bool:
    """Whether the kernels serve `ts` from `method`'s continuous extension (every
    explicit Runge--Kutta method's); Rosenbrock23's order-2 extension is not built
    into them (its outputs are integrated, as its default is everywhere)."""
    e = emitter(method)
    return e is not None and e.extension is not None and method.has_dense_output


def vjp_for_method(method) -> str:
    """The plain step and its adjoint, for the kernels of `kernel_adjoint`; with a
    continuous extension (`has_kernel_extension`), `dense_advance` and `dense_vjp`."""
    e = _emitter(method)
    return (e.plain(method) + e.step_vjp(method)
            + (e.extension(method) if has_kernel_extension(method) else ""))


def for_method(method) -> tuple[list[str], str]:
    """`(trial statements, plain-step source)` for a method the fused kernels run."""
    e = _emitter(method)
    return e.trial(method), e.plain(method)
