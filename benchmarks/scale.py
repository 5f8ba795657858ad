"""Scaling an ensemble: several devices, buckets by step count, a memory budget.

The three ways `gs.value_and_grad` cuts an ensemble along its rows (layout.py), each
measured where it is meant to pay. Loss `sum(ys ** 2)` of the final states, gradient
w.r.t. every trajectory's parameters, Tsit5, rtol 1e-6, atol 1e-9, float64,
`engine="general_replay"` (the JAX recorder and the JAX replay); times are warm
medians of the gradient call (the record is done before, and timed apart where a
column says so).

- `devices`: the Lorenz gradient (`gs.problems.lorenz(n)`) on `devices=1` against
  `devices=2` in one process with two forced host devices
  (`--xla_force_host_platform_device_count=2`), n = 64 ... 65536, to find where the
  split starts to pay (`layout.MIN_ROWS_PER_DEVICE`, the default split's threshold,
  is a per-device count). The two are timed in alternating rounds; "cores busy" is
  the process CPU time over the wall time of the timed calls. Also the general
  record on 1 and 2 devices, the same gradient in a fresh one-device process (no
  forced devices: XLA may then thread a single computation over both cores), and
  the differences from one device: of the split gradient on the same mesh, of the
  split record's mesh, and of the gradient on that mesh.
- `buckets`: a heavy-tailed ensemble, Lorenz on t in [0, 2] with rho log-spaced over
  [0.5, 100] (rows shuffled): most trajectories decay to the origin in a few dozen
  steps, the chaotic ones take several times more. Replay gradient on one device with
  `buckets=1` (every row padded to the longest) against the automatic rule
  (`buckets=None`) and 4 and 8 buckets, on the same mesh; the padded work
  (`vg.arrangement.work()`, rows x columns replayed) and the gradients' difference.
  A control: the plain Lorenz ensemble (no padding to save) in 8 buckets, for what
  replaying smaller groups of rows changes by itself.
- `budget`: 2^20 Lorenz trajectories under `memory_budget="2GB"` in a fresh
  one-device process, and without a budget in another: peak RSS (VmHWM; and
  `ru_maxrss`, which a worker inherits from its parent at the fork; both include the
  interpreter, JAX and XLA), the time of the record and of the gradient, the chunks
  and the library's own estimate of a chunk (`layout.replay_bytes`) beside XLA's
  (`memory_analysis`); and at 2^16 the gradient chunked (`memory_budget="48MB"`,
  record and replay both chunked) against unchunked, in one process, for their
  difference.

    .venv/bin/python benchmarks/scale.py [--quick] [--only devices] [--sizes 512,8192]
"""

import os
import sys

# The device count is fixed when JAX starts its backend: set it before anything
# (_harness, which imports JAX, included) can. The workers (`--worker`, fresh
# processes) run on one device, as a plain process does.
_XLA_FLAGS = os.environ.get("XLA_FLAGS", "")
_FORCE = "--xla_force_host_platform_device_count=2"
if "--worker" not in sys.argv and "xla_force_host_platform_device_count" not in _XLA_FLAGS:
    os.environ["XLA_FLAGS"] = f"{_XLA_FLAGS} {_FORCE}".strip()

from _harness import cli, fmt, log, md_table, run, target, warm  # noqa: E402

import argparse  # noqa: E402
import json  # noqa: E402
import resource  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402  (after _harness, which turns float64 on)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import gradsolve as gs  # noqa: E402
from gradsolve import layout, methods  # noqa: E402
from gradsolve.recorder import DEFAULT_CHUNK  # noqa: E402

RTOL, ATOL, ENGINE = 1e-6, 1e-9, "general_replay"
KW = dict(rtol=RTOL, atol=ATOL, engine=ENGINE)
RESULT = "SCALE_WORKER_RESULT "


def loss(ys, params):
    return jnp.sum(ys ** 2)


def _diff(a, b):
    """Max abs and max relative difference over the leaves of two gradients, and
    whether they are bitwise equal."""
    a, b = (np.concatenate([np.ravel(x) for x in jax.tree.leaves(t)]) for t in (a, b))
    d = np.abs(a - b)
    scale = np.maximum(np.abs(a), np.finfo(a.dtype).tiny)
    return {"max_abs": float(d.max()), "max_rel": float((d / scale).max()),
            "bitwise": bool(np.array_equal(a, b))}


def _rounds(fns, repeats, rounds):
    """Warm medians of several functions timed in alternating rounds (`warm` per
    round, all rounds' calls pooled): slow drift of a shared machine falls on all of
    them alike. Also the process CPU time / wall time of each one's calls."""
    times, cpu, wall = ({k: [] for k in fns} for _ in range(3))
    for _ in range(rounds):
        for k, fn in fns.items():
            c = time.process_time()
            w = warm(fn, repeats)
            cpu[k].append(time.process_time() - c)
            wall[k].append(w["first_call_s"] + sum(w["times_s"]))
            times[k] += w["times_s"]
    return {k: {"median_s": float(np.median(times[k])), "times_s": times[k],
                "cores_busy": sum(cpu[k]) / sum(wall[k])} for k in fns}


# ---------------------------------------------------------------------- workers

def _worker_env():
    """The environment of a fresh one-device process: the caller's XLA_FLAGS without
    a forced device count."""
    flags = " ".join(f for f in _XLA_FLAGS.split()
                     if not f.startswith("--xla_force_host_platform_device_count"))
    env = dict(os.environ, XLA_FLAGS=flags)
    if not flags:
        env.pop("XLA_FLAGS")
    return env


def _spawn(task, timeout=1200, **spec):
    """Run `task` in a fresh one-device process; its JSON result."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker",
           json.dumps(dict(spec, task=task))]
    out = subprocess.run(cmd, env=_worker_env(), capture_output=True, text=True,
                         timeout=timeout)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith(RESULT)]
    if out.returncode or not lines:
        raise RuntimeError(f"worker {task} failed (rc {out.returncode}):\n"
                           f"{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return json.loads(lines[-1][len(RESULT):])


def _peak_rss():
    """This process's peak resident set so far, bytes: `(ru_maxrss, VmHWM)`.

    `ru_maxrss` (KiB on Linux) is kept across fork and exec, so a worker's starts at
    what its parent held when it was started; VmHWM (/proc/self/status) is the peak of
    this process's own address space, which exec starts afresh: the measurement."""
    hwm = None
    status = Path("/proc/self/status")
    if status.exists():
        line = next((ln for ln in status.read_text().splitlines() if ln.startswith("VmHWM:")),
                    None)
        hwm = None if line is None else int(line.split()[1]) * 1024
    return {"ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "vm_hwm": hwm}


def _one_device(spec):
    """The devices section's gradient in a process with one device."""
    out = {}
    for n in spec["sizes"]:
        vg = gs.value_and_grad(gs.problems.lorenz(n=n), loss, **KW)
        out[str(n)] = _rounds({"grad": vg}, spec["repeats"], spec["rounds"])["grad"]
    return {"device_count": jax.device_count(), "sizes": out}


def _estimate(vg):
    """The library's estimates (what the chunks are sized by): of one chunk of `vg`'s
    replay gradient, of what is held whole beside the chunks (the mesh, the states and
    their gradients), and of one row of the record."""
    cfg, prob, arr = vg.config, vg.problem, vg.arrangement
    method, itemsize = methods.get(cfg.method), prob.y0.dtype.itemsize
    per_row = layout.replay_bytes(method, prob.d, vg.mesh.columns, itemsize,
                                  remat=bool(cfg.remat), n_ts=0, gradient=True)
    rows = arr.rows // arr.chunks
    held = layout.held_bytes(-(-prob.n // layout.size(arr.devices)), vg.mesh.columns,
                             prob.d, itemsize)
    record_row = layout.record_bytes(method, prob.d, itemsize, DEFAULT_CHUNK)
    return {"replay_row_bytes": per_row, "rows_per_chunk": rows,
            "chunk_bytes": per_row * rows, "held_bytes": held,
            "replay_bytes": held + per_row * rows, "record_row_bytes": record_row,
            "record_rows_per_chunk": layout.rows_within(cfg.memory_budget, record_row,
                                                        "record")}


def _xla_bytes(vg):
    """XLA's memory analysis of the compiled gradient: temporaries, arguments, outputs."""
    prob = vg.problem
    m = vg._call.lower(vg.mesh, prob.params, prob.y0, vg.arrangement).compile().compiled \
        .memory_analysis()
    return {"temp": m.temp_size_in_bytes, "arguments": m.argument_size_in_bytes,
            "outputs": m.output_size_in_bytes}


def _budget(spec):
    """One gradient of `spec["n"]` Lorenz trajectories under `spec["budget"]`: peak
    RSS after each stage, times, chunks and estimates."""
    n, budget = spec["n"], spec["budget"]
    prob = gs.problems.lorenz(n=n)
    jax.block_until_ready(prob.y0)
    out = {"n": n, "budget": budget, "budget_bytes": layout.budget_bytes(budget),
           "device_count": jax.device_count(), "rss": {"start": _peak_rss()}}
    t = time.perf_counter()
    vg = gs.value_and_grad(prob, loss, memory_budget=budget, **KW)
    jax.block_until_ready(vg.mesh.h)
    out["record_s"] = time.perf_counter() - t  # the first record (compilation included)
    out["rss"]["record"] = _peak_rss()
    timing = warm(vg, spec["repeats"])
    out["rss"]["gradient"] = _peak_rss()
    arr = vg.arrangement
    out.update(grad=timing, S=vg.mesh.columns, chunks=arr.chunks, widths=list(arr.widths),
               estimate=_estimate(vg))
    if spec.get("xla"):
        out["xla_bytes"] = _xla_bytes(vg)
    return out


def _chunked_vs_whole(spec):
    """The gradient of `spec["n"]` trajectories chunked under `spec["budget"]` and
    unchunked (no budget given: half the free memory), in one process."""
    prob = gs.problems.lorenz(n=spec["n"])
    chunked = gs.value_and_grad(prob, loss, memory_budget=spec["budget"], **KW)
    whole = gs.value_and_grad(prob, loss, **KW)
    t = _rounds({"chunked": chunked, "whole": whole}, spec["repeats"], spec["rounds"])
    return {"n": spec["n"], "budget": spec["budget"], "S": whole.mesh.columns,
            "chunks": chunked.arrangement.chunks, "whole_chunks": whole.arrangement.chunks,
            "estimate": _estimate(chunked),
            "chunked_s": t["chunked"]["median_s"], "whole_s": t["whole"]["median_s"],
            "mesh_diff": _diff(chunked.mesh.h, whole.mesh.h),
            "grad_diff": _diff(chunked()[1], whole()[1])}


WORKERS = {"one_device": _one_device, "budget": _budget, "chunked_vs_whole": _chunked_vs_whole}


# ---------------------------------------------------------------------- sections

def devices(args):
    if jax.device_count() < 2:
        raise RuntimeError(f"the devices section needs 2 devices, found {jax.devices()} "
                           f"(XLA_FLAGS={os.environ.get('XLA_FLAGS')!r})")
    sizes = args.sizes or ([512, 2048] if args.quick else
                           [64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 65536])
    rows = []
    for n in sizes:
        prob = gs.problems.lorenz(n=n)
        reps = args.repeats or (3 if args.quick else 5 if n <= 8192 else 3)
        rounds = 2 if args.quick or n > 8192 else 3
        one = gs.value_and_grad(prob, loss, devices=1, **KW)
        two = gs.value_and_grad(prob, loss, devices=2, mesh=one.mesh, **KW)  # timed
        split = gs.value_and_grad(prob, loss, devices=2, **KW)  # its own split record too
        default = gs.value_and_grad(prob, loss, mesh=one.mesh, **KW)
        t = _rounds({"one": one, "two": two}, reps, rounds)
        rec = _rounds({k: (lambda k=k: gs.record(prob, recorder="general", devices=k,
                                                 rtol=RTOL, atol=ATOL).h)
                       for k in (1, 2)}, reps, 1)
        row = {"n": n, "repeats": reps * rounds, "S": one.mesh.columns,
               "one": t["one"]["median_s"], "two": t["two"]["median_s"],
               "busy_one": t["one"]["cores_busy"], "busy_two": t["two"]["cores_busy"],
               "record_one": rec[1]["median_s"], "record_two": rec[2]["median_s"],
               "default_devices": layout.size(default.arrangement.devices),
               "grad_diff": _diff(one()[1], two()[1]),
               "value_diff": _diff(one()[0], two()[0]),
               "mesh_diff": _diff(one.mesh.h, split.mesh.h),
               "split_grad_diff": _diff(one()[1], split()[1])}
        log(f"  n={n}: 1 device {row['one'] * 1e3:.1f} ms, 2 devices {row['two'] * 1e3:.1f} ms "
            f"(x{row['one'] / row['two']:.2f}; cores busy {row['busy_one']:.2f} / "
            f"{row['busy_two']:.2f}); record x{row['record_one'] / row['record_two']:.2f}; "
            f"grad diff {row['grad_diff']['max_abs']:.1e}, with the split record "
            f"{row['split_grad_diff']['max_abs']:.1e} (mesh {row['mesh_diff']['max_abs']:.1e})")
        rows.append(row)
    log("  the same gradient in a fresh one-device process")
    plain = _spawn("one_device", sizes=sizes, repeats=args.repeats or 3,
                   rounds=1 if args.quick else 2)
    for row in rows:
        row["one_process"] = plain["sizes"][str(row["n"])]["median_s"]
        row["busy_one_process"] = plain["sizes"][str(row["n"])]["cores_busy"]
    return {"rtol": RTOL, "atol": ATOL, "engine": ENGINE, "device_count": jax.device_count(),
            "xla_flags": os.environ.get("XLA_FLAGS"),
            "min_rows_per_device": layout.MIN_ROWS_PER_DEVICE,
            "crossover": _crossover(rows, "one", "two"),
            "record_crossover": _crossover(rows, "record_one", "record_two"), "sizes": rows}


def _crossover(rows, one, two):
    """The smallest n from which 2 devices are faster at it and every larger n."""
    found = None
    for row in sorted(rows, key=lambda r: -r["n"]):
        if row[one] / row[two] < 1:
            break
        found = row["n"]
    return found


def heavy_tailed(n, t_span=(0.0, 2.0), rho=(0.5, 100.0), seed=0):
    """Lorenz with rho log-spaced over `rho`, the rows shuffled: the mean step count
    is well under half the largest."""
    prob = gs.problems.lorenz(n=n, t_span=t_span)
    rhos = np.random.default_rng(seed).permutation(np.geomspace(*rho, n))
    return prob.replace(params=dict(prob.params, rho=jnp.asarray(rhos, prob.y0.dtype)))


def _bucket_runs(prob, choices, reps, rounds):
    """The replay gradient of `prob` on one device and one mesh at each `buckets=`."""
    plain = gs.value_and_grad(prob, loss, devices=1, buckets=1, **KW)
    steps = np.asarray(plain.mesh.n_steps)
    vgs = {k: plain if k == 1 else
           gs.value_and_grad(prob, loss, devices=1, buckets=k, mesh=plain.mesh, **KW)
           for k in choices}
    t = _rounds({str(k): vg for k, vg in vgs.items()}, reps, rounds)
    g1 = plain()[1]
    return {"n": prob.n, "repeats": reps * rounds, "S": plain.mesh.columns,
            "steps": {"min": int(steps.min()), "mean": float(steps.mean()),
                      "median": float(np.median(steps)), "max": int(steps.max())},
            "runs": {str(k): {"buckets": k, "widths": list(vg.arrangement.widths),
                              "work": vg.arrangement.work(), "time_s": t[str(k)]["median_s"],
                              "diff": _diff(g1, vg()[1])} for k, vg in vgs.items()}}


def buckets(args):
    """The heavy-tailed ensemble at each `buckets=`; and a control, the plain Lorenz
    ensemble (every trajectory about as long: no padding to save) in 8 buckets, which
    shows what replaying smaller groups of rows changes by itself."""
    sizes = args.sizes or ([2048] if args.quick else [4096, 16384])
    reps, rounds = args.repeats or 3, 1 if args.quick else 2
    rows = []
    for n in sizes:
        for kind, prob, choices in (("heavy-tailed", heavy_tailed(n), (1, None, 4, 8)),
                                    ("control", gs.problems.lorenz(n=n), (1, 8))):
            row = dict(_bucket_runs(prob, choices, reps, rounds), ensemble=kind)
            base = row["runs"]["1"]
            ratio = row["steps"]["mean"] / row["steps"]["max"]
            log(f"  {kind} n={n}: steps mean/max {ratio:.2f}; " + ", ".join(
                f"buckets={r['buckets']} ({len(r['widths'])}): {r['time_s'] * 1e3:.0f} ms "
                f"x{base['time_s'] / r['time_s']:.2f}, work x{base['work'] / r['work']:.2f}"
                for r in row["runs"].values()))
            rows.append(row)
    return {"rtol": RTOL, "atol": ATOL, "engine": ENGINE, "t_span": [0.0, 2.0],
            "rho": [0.5, 100.0], "sizes": rows}


def _report(r):
    log(f"    peak RSS {r['rss']['gradient']['vm_hwm'] / 1e9:.2f} GB, {r['chunks']} chunks, "
        f"gradient {r['grad']['median_s']:.1f} s")


def budget(args):
    n = 2 ** 14 if args.quick else 2 ** 20
    small = 2 ** 12 if args.quick else 2 ** 16
    log(f"  n={n}, memory_budget='2GB', fresh process")
    big = _spawn("budget", n=n, budget="2GB", repeats=args.repeats or 2, xla=True)
    _report(big)
    log(f"  n={n}, no budget (half the free memory), fresh process")
    whole = _spawn("budget", n=n, budget=None, repeats=1)
    _report(whole)
    log(f"  n={small}: chunked (memory_budget='48MB') vs unchunked")
    cmp = _spawn("chunked_vs_whole", n=small, budget="48MB", repeats=args.repeats or 3,
                 rounds=2)
    log(f"    {cmp['chunks']} chunks, x{cmp['whole_s'] / cmp['chunked_s']:.2f}, "
        f"grad diff {cmp['grad_diff']['max_abs']:.1e}")
    return {"rtol": RTOL, "atol": ATOL, "engine": ENGINE, "budgeted": big, "unbudgeted": whole,
            "compare": cmp}


# ---------------------------------------------------------------------- reporting

def _d(diff):
    return "bitwise" if diff["bitwise"] else f"{diff['max_abs']:.1e} / {diff['max_rel']:.1e}"


def _gb(x):
    return f"{x / 1e9:.2f}"


def render(sections):
    out = {}
    if "devices" in sections:
        s = sections["devices"]
        rows = [[r["n"], r["n"] // 2, r["S"], f"{r['one']:.4f}", f"{r['two']:.4f}",
                 fmt(r["one"] / r["two"]), f"{r['busy_one']:.2f} / {r['busy_two']:.2f}",
                 f"{r['one_process']:.4f} ({r['busy_one_process']:.2f})",
                 fmt(r["one_process"] / r["two"]), f"{r['record_one']:.4f}",
                 f"{r['record_two']:.4f}", fmt(r["record_one"] / r["record_two"]),
                 r["default_devices"], _d(r["grad_diff"]), _d(r["mesh_diff"]),
                 _d(r["split_grad_diff"])]
                for r in s["sizes"]]
        cross = s["crossover"]
        rc = s["record_crossover"]
        out["devices"] = (
            md_table(["n", "rows per device", "S", "1 device s", "2 devices s",
                      "speedup", "cores busy (1 / 2 devices)",
                      "1-device process s (cores busy)", "1-device process / 2 devices",
                      "record 1 device s", "record 2 devices s", "record speedup",
                      "default devices", "gradient diff, same mesh (abs / rel)",
                      "mesh diff, split record", "gradient diff, split record"],
                     rows)
            + "\n\nThe gradient on 2 devices is faster than on 1 (same process) "
            + (f"from n = {cross} ({cross // 2} rows per device) on, in this sweep"
               if cross else "at no n of this sweep")
            + "; the record " + (f"from n = {rc} ({rc // 2} per device)" if rc
                                 else "not from any n of the sweep on (not at the largest)")
            + f". `layout.MIN_ROWS_PER_DEVICE` was {s['min_rows_per_device']} when this ran.")
    if "buckets" in sections:
        s = sections["buckets"]
        rows = []
        for r in s["sizes"]:
            base = r["runs"]["1"]
            st = r["steps"]
            for run_ in r["runs"].values():
                k = run_["buckets"]
                rows.append([r.get("ensemble", "heavy-tailed"), r["n"], r["S"],
                             f"{st['mean']:.0f} / {st['max']}",
                             f"{st['mean'] / st['max']:.2f}",
                             "auto" if k is None else k, len(run_["widths"]),
                             " ".join(map(str, run_["widths"])), f"{run_['work']:,}",
                             fmt(base["work"] / run_["work"]), f"{run_['time_s']:.4f}",
                             fmt(base["time_s"] / run_["time_s"]), _d(run_["diff"])])
        out["buckets"] = md_table(
            ["ensemble", "n", "S", "steps mean / max", "mean / max", "buckets=", "buckets",
             "widths", "padded work", "work 1 / k", "gradient s", "speedup vs buckets=1",
             "gradient diff vs buckets=1 (abs / rel)"], rows)
    if "budget" in sections:
        s = sections["budget"]
        rows = []
        for name, r in (("memory_budget='2GB'", s["budgeted"]),
                        ("none (half the free memory)", s["unbudgeted"])):
            e = r["estimate"]
            x = r.get("xla_bytes")
            rows.append([r["n"], name, r["S"], r["chunks"], f"{r['record_s']:.1f}",
                         f"{r['grad']['median_s']:.1f} ({len(r['grad']['times_s'])})",
                         f"{r['grad']['first_call_s']:.1f}",
                         _gb(r["rss"]["start"]["vm_hwm"]), _gb(r["rss"]["record"]["vm_hwm"]),
                         _gb(r["rss"]["gradient"]["vm_hwm"]),
                         _gb(r["rss"]["gradient"]["vm_hwm"] - r["rss"]["start"]["vm_hwm"]),
                         _gb(r["rss"]["gradient"]["ru_maxrss"]),
                         _gb(e["record_row_bytes"] * min(r["n"], e["record_rows_per_chunk"])),
                         f"{e['replay_row_bytes']:,}", f"{e['rows_per_chunk']:,}",
                         _gb(e["chunk_bytes"]), _gb(e["held_bytes"]), _gb(e["replay_bytes"]),
                         _gb(x["temp"]) if x else "-"])
        c = s["compare"]
        out["budget"] = (
            md_table(["n", "memory budget", "S", "replay chunks", "record s (first)",
                      "gradient s (repeats)", "first gradient s", "peak RSS GB: start",
                      "after record", "after gradient", "above start", "ru_maxrss GB",
                      "record estimate GB", "replay estimate B / row", "rows per chunk",
                      "chunk estimate GB", "held estimate GB", "replay estimate GB",
                      "XLA temporaries GB"], rows)
            + f"\n\nAt n = {c['n']}: under memory_budget='{c['budget']}' "
            f"{c['chunks']} replay chunks (record: {c['estimate']['record_rows_per_chunk']:,} "
            f"rows at a time), {c['chunked_s']:.3f} s per gradient against "
            f"{c['whole_s']:.3f} s unchunked ({c['whole_chunks']} chunk); gradient "
            f"difference {_d(c['grad_diff'])}, mesh difference {_d(c['mesh_diff'])}.")
    return out


def targets(sections):
    out = []
    if "buckets" in sections:
        rows = [r for r in sections["buckets"]["sizes"]
                if r.get("ensemble", "heavy-tailed") == "heavy-tailed"]
        out.append(target("Heavy-tailed Lorenz replay gradient, buckets (automatic) vs none",
                          ">=", 1.5, {f"n={r['n']}": r["runs"]["1"]["time_s"]
                                      / r["runs"]["None"]["time_s"] for r in rows}))
    if "budget" in sections:
        # The budget bounds the ensemble's work: the process's own footprint before any
        # (the JAX runtime, ~0.4 GB) is outside it; the whole peak is shown beside.
        b = sections["budget"]["budgeted"]
        peak, start = b["rss"]["gradient"]["vm_hwm"], b["rss"]["start"]["vm_hwm"]
        out.append(target(f"2^{int(np.log2(b['n']))} Lorenz gradient under memory_budget="
                          f"'{b['budget']}', peak RSS above the process's start / budget "
                          f"(whole peak {peak / 1e9:.2f} GB)", "<=", 1,
                          {f"n={b['n']}": (peak - start) / b["budget_bytes"]}))
    return out


SECTIONS = {"devices": devices, "buckets": buckets, "budget": budget}


def _worker_arg(ap):
    ap.add_argument("--worker", help=argparse.SUPPRESS)  # a fresh process's task (JSON)


if __name__ == "__main__":
    args = cli(__doc__, SECTIONS, extra=_worker_arg)
    if args.worker:
        spec = json.loads(args.worker)
        print(RESULT + json.dumps(WORKERS[spec["task"]](spec)), flush=True)
    else:
        run("scale", SECTIONS, render, targets, args)
