"""Kernel skeletons of the fused solve: the module header and the `solve` kernel.

A kernel is generated once per (method, field, d, dtype, lanes per thread) as Python
source text: the module header (types `T`, `V`, `M`, `D`), the field (`_registry`),
the step control and step bodies written from the method (`_steps`), and a skeleton
that runs whole adaptive solves per thread: trial steps, error norm, accept/reject,
step size, the requested outputs `ts` (the continuous extension of the accepted step
containing each, from its trial stages, or one extra plain step from the preceding
accepted point: as the JAX replay does either), and -- when recording -- each
accepted step size. The skeleton's parameters are data (`SOLVE`, a `_launch.Signature`): the same
object writes its header and drives its launch.

Loops are kept dynamic (`max_unroll = 0`): unrolled Gauss--Jordan elimination at
d = 8 does not finish compiling in reasonable time. Modules compile at -O3 (on this
CPU about 20% faster than Warp's CPU default -O2 on Lorenz and HIRES); the
environment variable `GRADSOLVE_WARP_OPT_LEVEL` (0-3) changes it, for compiles that
matter more than run time (the test suite's, at 0). The arithmetic is the same at
every level: no fast-math, no contraction.

Each thread runs `lanes` trajectories side by side, statement by statement (two on
the CPU, `_fused.CPU_LANES`): one trajectory's step is a long chain of dependent
operations, and interleaving independent ones gives the core work to overlap. Floating
point contraction stays off (Warp's default), so a trajectory's result does not depend
on its lane or on the ensemble's size, bit for bit. (With `-ffp-contract=fast` LLVM
contracted differently per lane on d = 8 fields; it brought the step sizes closer to
XLA's, which always contracts, but not to bit-for-bit agreement -- docs/internals.md,
"How close the two recorders are".)
"""

import os
import re

from ..status import Status
from . import _launch, _steps
from ._launch import INT, INT32, count, output, per_trajectory, scalar, shared


def optimization_level() -> int:
    """LLVM's optimization level of the generated modules: 3, or the environment's
    `GRADSOLVE_WARP_OPT_LEVEL`."""
    level = os.environ.get("GRADSOLVE_WARP_OPT_LEVEL", "3").strip()
    if level not in ("0", "1", "2", "3"):
        raise ValueError(f"GRADSOLVE_WARP_OPT_LEVEL must be 0, 1, 2 or 3, got {level!r}")
    return int(level)


def header(d: int, bits: int) -> str:
    """The start of every generated module: module options and the type names."""
    return f'''import warp as wp

wp.set_module_options({{"max_unroll": 0, "optimization_level": {optimization_level()}}})

T = wp.float{bits}
V = wp.types.vector(length={d}, dtype=T)
M = wp.types.matrix(shape=({d}, {d}), dtype=T)
D = {d}
'''


# The solve kernel's parameters. `width`: step sizes kept per trajectory (0: none);
# `n_ts`: requested outputs (`ys_out` keeps at least one row so its shape is valid);
# `interp`: 1 serves them from the method's continuous extension (where the kernel
# has one, `_steps.kernel_extension`), 0 by an extra plain step each.
SOLVE = _launch.Signature((
    per_trajectory("y0", "d"), per_trajectory("p", "columns"), shared("s"),
    per_trajectory("t_first"), shared("ts"), scalar("n_ts", INT), scalar("interp", INT),
    scalar("t0"), scalar("t1"), scalar("floor"), scalar("rtol"), scalar("atol"),
    scalar("max_steps", INT), scalar("width", INT), count("m"),
    output("h_out", "width"), output("y_out", "d"), output("ys_out", "n_ts", "d"),
    output("n_acc", dtype=INT32), output("n_rej", dtype=INT32),
    output("status", dtype=INT32),
))


def _in_lane(statement: str, names, lane) -> str:
    """`statement` with each of `names` renamed to lane `lane`'s copy (`y` -> `y_1`;
    lane "L_": the templates' placeholder, `y_L_`)."""
    pattern = r"\b(" + "|".join(sorted(names, key=len, reverse=True)) + r")\b"
    return re.sub(pattern, lambda m: f"{m.group(1)}_{lane}", statement)


def _trial_lanes(body: list[str], lanes: int) -> str:
    """The trial step of every lane, statement by statement: lane 1's stage k runs
    beside lane 0's, so the CPU overlaps the two dependency chains."""
    names = {"t", "y", "f0", "h", "i"} | {line.split(" = ")[0] for line in body}
    return "".join(f"        {_in_lane(line, names, n)}\n" for line in body
                   for n in range(lanes))


# Each thread runs LANES trajectories side by side (`_L_` below becomes the lane
# number, `_N_` its index). A lane that has finished keeps taking zero steps
# (identities) until every lane of its thread has.
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
                # Outputs inside [t, t + h): one extra plain step from the accepted
                # point, or the continuous extension of the step just accepted.
                while j_L_ < n_ts and ts[j_L_] < t_next_L_:
{inside}
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
{after}
            for k in range(D):
                ys_out[i_L_, j_L_, k] = extra_L_[k]
            j_L_ = j_L_ + 1
        for k in range(D):
            y_out[i_L_, k] = y_L_[k]
        n_acc[i_L_] = acc_L_
        n_rej[i_L_] = rej_L_
        status[i_L_] = code_L_
"""


_PLAIN_OUTPUT = "extra_L_ = plain(t_L_, y_L_, ts[j_L_] - t_L_, p, s, i_L_)"


def _outputs(trial: list[str], extension: list[str] | None) -> dict[str, str]:
    """The statements that compute `extra`, an output at `ts[j]`: inside the accepted
    step (`inside`) and at or after the last accepted point (`after`). With the
    method's continuous extension (statements over the trial step's stages), both
    choose at run time by `interp`; after the last point the extension gives the
    state itself, as the JAX replay's does."""
    if extension is None:
        return {"inside": " " * 20 + _PLAIN_OUTPUT, "after": " " * 12 + _PLAIN_OUTPUT}
    names = {"t", "y", "h", "j", "i"} | {line.split(" = ")[0] for line in trial + extension}
    dense = [_in_lane(line, names, "L_") for line in extension]
    inside = ["extra_L_ = y_L_", "if interp == 1:", *("    " + x for x in dense),
              "else:", "    " + _PLAIN_OUTPUT]
    after = ["extra_L_ = y_L_", "if interp == 0:", "    " + _PLAIN_OUTPUT]
    return {"inside": "\n".join(" " * 20 + x for x in inside),
            "after": "\n".join(" " * 12 + x for x in after)}


def _solve_kernel(trial: list[str], lanes: int, extension=None) -> str:
    codes = dict(success=int(Status.SUCCESS), nonfinite=int(Status.NONFINITE),
                 underflow=int(Status.DT_UNDERFLOW), max_steps_code=int(Status.MAX_STEPS),
                 **_outputs(trial, extension))

    def each(template):
        text = template.format(**codes)
        return "".join(text.replace("_L_", f"_{n}").replace("_N_", str(n))
                       for n in range(lanes))

    live = " + ".join(f"live_{n}" for n in range(lanes))
    return ("\n\n" + SOLVE.header("solve") + f"    base = wp.tid() * {lanes}\n"
            + each(_LANE_START)
            + f"    while {live} > 0:\n" + each(_LANE_TRIAL) + _trial_lanes(trial, lanes)
            + each(_LANE_CONTROL)
            + each(_LANE_FINISH))


def kernel_source(method, field_source: str, d: int, bits: int, lanes: int = 1) -> str:
    """The whole generated module for one (method, field, d, dtype, lanes per thread)."""
    trial, plain = _steps.for_method(method)
    return (header(d, bits) + "\n" + field_source + _steps.control_source(method, d)
            + plain + _solve_kernel(trial, lanes, _steps.kernel_extension(method)))
