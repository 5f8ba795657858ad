"""Scaling an ensemble: several devices, buckets by step count, a memory budget.

The three ways `gs.value_and_grad` cuts an ensemble along its rows (`layout/`), each
measured where it is meant to pay: the gradient of `sum(ys ** 2)` of the final states
w.r.t. every trajectory's parameters, Tsit5, rtol 1e-6, atol 1e-9, float64,
`engine="general_replay"`; warm medians of the gradient call (the record done before).

- `devices`: Lorenz on `devices=1` against `devices=2` in one process with two forced
  host devices, n = 64 ... 65536 (where the split starts to pay:
  `layout.MIN_ROWS_PER_DEVICE`), timed in alternating rounds; the record on each; the
  same gradient in a fresh one-device process; and the differences from one device.
- `buckets`: a heavy-tailed ensemble (`heavy_tailed`) replayed with `buckets=1`, the
  automatic rule, 4 and 8 buckets on one mesh; a control without padding to save.
- `budget`: 2^20 Lorenz trajectories under `memory_budget="2GB"` and without, each in a
  fresh one-device process (peak RSS, times, chunks, the library's estimates beside
  XLA's); at 2^16 chunked against unchunked, for their difference.

docs/benchmarks.md ("Scaling") says what every column means.

    .venv/bin/python benchmarks/scale.py [--quick] [--only devices] [--sizes 512,8192]
"""

import os
import sys

# The device count is fixed when JAX starts its backend: set it before anything
# (_harness, which imports JAX, included) can. The workers (`--worker`, fresh
# processes) run on one device, as a plain process does.
_XLA_FLAGS = os.environ.get("XLA_FLAGS", "")
_FORCE = "--xla_force_host_platform_device_count"
if "--worker" not in sys.argv and _FORCE not in _XLA_FLAGS:
    os.environ["XLA_FLAGS"] = f"{_XLA_FLAGS} {_FORCE}=2".strip()
_WORKER_FLAGS = " ".join(f for f in _XLA_FLAGS.split() if not f.startswith(_FORCE))

from _harness import (diff, fmt, log, main, md_table, peak_rss, rounds, spawn,  # noqa: E402
                      sum_squares as loss, target, warm, xla_bytes)

import time  # noqa: E402
from itertools import takewhile  # noqa: E402

import jax  # noqa: E402  (after _harness, which turns float64 on)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import gradsolve as gs  # noqa: E402
from gradsolve import layout, methods  # noqa: E402
from gradsolve.recorder import DEFAULT_CHUNK  # noqa: E402

RTOL, ATOL, ENGINE = 1e-6, 1e-9, "general_replay"
KW = dict(rtol=RTOL, atol=ATOL, engine=ENGINE)


def _spawn(task, **spec):
    """`task` in a fresh one-device process (the caller's XLA_FLAGS, no forced devices)."""
    return spawn(__file__, task, env=dict(os.environ, XLA_FLAGS=_WORKER_FLAGS), **spec)


# ---------------------------------------------------------------------- workers

def _one_device(spec):
    """The devices section's gradient in a process with one device."""
    out = {}
    for n in spec["sizes"]:
        vg = gs.value_and_grad(gs.problems.lorenz(n=n), loss, **KW)
        out[str(n)] = rounds({"grad": vg}, spec["repeats"], spec["rounds"])["grad"]
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


def _budget(spec):
    """One gradient of `spec["n"]` Lorenz trajectories under `spec["budget"]`: peak
    RSS after each stage, times, chunks and estimates."""
    n, budget = spec["n"], spec["budget"]
    prob = gs.problems.lorenz(n=n)
    jax.block_until_ready(prob.y0)
    out = {"n": n, "budget": budget, "budget_bytes": layout.budget_bytes(budget),
           "device_count": jax.device_count(), "rss": {"start": peak_rss()}}
    t = time.perf_counter()
    vg = gs.value_and_grad(prob, loss, memory_budget=budget, **KW)
    jax.block_until_ready(vg.mesh.h)
    out["record_s"] = time.perf_counter() - t  # the first record (compilation included)
    out["rss"]["record"] = peak_rss()
    timing = warm(vg, spec["repeats"])
    out["rss"]["gradient"] = peak_rss()
    arr = vg.arrangement
    out.update(grad=timing, S=vg.mesh.columns, chunks=arr.chunks, widths=list(arr.widths),
               estimate=_estimate(vg))
    if spec.get("xla"):
        out["xla_bytes"] = xla_bytes(vg, vg.mesh, vg.problem.params, vg.problem.y0,
                                     vg.arrangement)
    return out


def _chunked_vs_whole(spec):
    """The gradient of `spec["n"]` trajectories chunked under `spec["budget"]` and
    unchunked (no budget given: half the free memory), in one process."""
    prob = gs.problems.lorenz(n=spec["n"])
    chunked = gs.value_and_grad(prob, loss, memory_budget=spec["budget"], **KW)
    whole = gs.value_and_grad(prob, loss, **KW)
    t = rounds({"chunked": chunked, "whole": whole}, spec["repeats"], spec["rounds"])
    return {"n": spec["n"], "budget": spec["budget"], "S": whole.mesh.columns,
            "chunks": chunked.arrangement.chunks, "whole_chunks": whole.arrangement.chunks,
            "estimate": _estimate(chunked),
            "chunked_s": t["chunked"]["median_s"], "whole_s": t["whole"]["median_s"],
            "mesh_diff": diff(chunked.mesh.h, whole.mesh.h),
            "grad_diff": diff(chunked()[1], whole()[1])}


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
        n_rounds = 2 if args.quick or n > 8192 else 3
        one = gs.value_and_grad(prob, loss, devices=1, **KW)
        two = gs.value_and_grad(prob, loss, devices=2, mesh=one.mesh, **KW)  # timed
        split = gs.value_and_grad(prob, loss, devices=2, **KW)  # its own split record too
        default = gs.value_and_grad(prob, loss, mesh=one.mesh, **KW)
        t = rounds({"one": one, "two": two}, reps, n_rounds)
        rec = rounds({k: (lambda k=k: gs.record(prob, recorder="general", devices=k,
                                                 rtol=RTOL, atol=ATOL).h)
                       for k in (1, 2)}, reps, 1)
        row = {"n": n, "repeats": reps * n_rounds, "S": one.mesh.columns,
               "one": t["one"]["median_s"], "two": t["two"]["median_s"],
               "busy_one": t["one"]["cores_busy"], "busy_two": t["two"]["cores_busy"],
               "record_one": rec[1]["median_s"], "record_two": rec[2]["median_s"],
               "default_devices": layout.size(default.arrangement.devices),
               "grad_diff": diff(one()[1], two()[1]),
               "value_diff": diff(one()[0], two()[0]),
               "mesh_diff": diff(one.mesh.h, split.mesh.h),
               "split_grad_diff": diff(one()[1], split()[1])}
        log(f"  n={n}: 2 devices x{row['one'] / row['two']:.2f}, "
            f"record x{row['record_one'] / row['record_two']:.2f}")
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
    faster = list(takewhile(lambda r: r[one] >= r[two], sorted(rows, key=lambda r: -r["n"])))
    return faster[-1]["n"] if faster else None


def heavy_tailed(n, t_span=(0.0, 2.0), rho=(0.5, 100.0), seed=0):
    """Lorenz with rho log-spaced over `rho`, the rows shuffled: the mean step count
    is well under half the largest."""
    prob = gs.problems.lorenz(n=n, t_span=t_span)
    rhos = np.random.default_rng(seed).permutation(np.geomspace(*rho, n))
    return prob.replace(params=dict(prob.params, rho=jnp.asarray(rhos, prob.y0.dtype)))


def _bucket_runs(prob, choices, reps, n_rounds):
    """The replay gradient of `prob` on one device and one mesh at each `buckets=`."""
    plain = gs.value_and_grad(prob, loss, devices=1, buckets=1, **KW)
    steps = np.asarray(plain.mesh.n_steps)
    vgs = {k: plain if k == 1 else
           gs.value_and_grad(prob, loss, devices=1, buckets=k, mesh=plain.mesh, **KW)
           for k in choices}
    t = rounds({str(k): vg for k, vg in vgs.items()}, reps, n_rounds)
    g1 = plain()[1]
    return {"n": prob.n, "repeats": reps * n_rounds, "S": plain.mesh.columns,
            "steps": {"min": int(steps.min()), "mean": float(steps.mean()),
                      "median": float(np.median(steps)), "max": int(steps.max())},
            "runs": {str(k): {"buckets": k, "widths": list(vg.arrangement.widths),
                              "work": vg.arrangement.work(), "time_s": t[str(k)]["median_s"],
                              "diff": diff(g1, vg()[1])} for k, vg in vgs.items()}}


def buckets(args):
    """The heavy-tailed ensemble at each `buckets=`; and a control, the plain Lorenz
    ensemble (every trajectory about as long: no padding to save) in 8 buckets, which
    shows what replaying smaller groups of rows changes by itself."""
    sizes = args.sizes or ([2048] if args.quick else [4096, 16384])
    reps, n_rounds = args.repeats or 3, 1 if args.quick else 2
    rows = []
    for n in sizes:
        for kind, prob, choices in (("heavy-tailed", heavy_tailed(n), (1, None, 4, 8)),
                                    ("control", gs.problems.lorenz(n=n), (1, 8))):
            row = dict(_bucket_runs(prob, choices, reps, n_rounds), ensemble=kind)
            log(f"  {kind} n={n}: " + ", ".join(
                f"buckets={r['buckets']} x{row['runs']['1']['time_s'] / r['time_s']:.2f}"
                for r in row["runs"].values()))
            rows.append(row)
    return {"rtol": RTOL, "atol": ATOL, "engine": ENGINE, "t_span": [0.0, 2.0],
            "rho": [0.5, 100.0], "sizes": rows}


def budget(args):
    n = 2 ** 14 if args.quick else 2 ** 20
    small = 2 ** 12 if args.quick else 2 ** 16
    log(f"  n={n}, memory_budget='2GB' and none, fresh processes; n={small} chunked")
    big = _spawn("budget", n=n, budget="2GB", repeats=args.repeats or 2, xla=True)
    whole = _spawn("budget", n=n, budget=None, repeats=1)
    cmp = _spawn("chunked_vs_whole", n=small, budget="48MB", repeats=args.repeats or 3,
                 rounds=2)
    return {"rtol": RTOL, "atol": ATOL, "engine": ENGINE, "budgeted": big, "unbudgeted": whole,
            "compare": cmp}


# ---------------------------------------------------------------------- reporting

def _d(d):
    return "bitwise" if d["bitwise"] else f"{d['max_abs']:.1e} / {d['max_rel']:.1e}"


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
        cross, rc = s["crossover"], s["record_crossover"]
        out["devices"] = (
            md_table(["n", "rows per device", "S", "1 device s", "2 devices s", "speedup",
                      "cores busy (1 / 2 devices)", "1-device process s (cores busy)",
                      "1-device process / 2 devices", "record 1 device s",
                      "record 2 devices s", "record speedup", "default devices",
                      "gradient diff, same mesh (abs / rel)", "mesh diff, split record",
                      "gradient diff, split record"], rows)
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
            base, st = r["runs"]["1"], r["steps"]
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
            e, x = r["estimate"], r.get("xla_bytes")
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


if __name__ == "__main__":
    main("scale", __doc__, SECTIONS, render, targets,
         workers={"one_device": _one_device, "budget": _budget,
                  "chunked_vs_whole": _chunked_vs_whole})
