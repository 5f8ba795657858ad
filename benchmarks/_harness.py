"""The one benchmark harness: timing, matched accuracy, targets, the JSON record and
the docs sections. Each script under benchmarks/ only declares what it compares:

    run(SCRIPT, SECTIONS, render, targets, args)

- `SECTIONS`: {name: measure(args) -> JSON-able dict}; `--only NAME` reruns one
  section and keeps the other sections' stored results.
- `render(sections) -> {block: markdown}`: each block is written between
  `<!-- SCRIPT/block:start -->` and `<!-- SCRIPT/block:end -->` in
  docs/benchmarks.md, always from the stored JSON, never from memory.
- `targets(sections) -> [target(...)]`: stored in the JSON; the summary table at the
  top of docs/benchmarks.md is built from the targets of every stored JSON.

Named `_harness` (not `_common`) so that it cannot shadow recipes/_common.py when a
script puts recipes/ on sys.path.
"""

import os

import jax

# float64 unless a script runs a worker the float32 way (GRADSOLVE_BENCH_X64=0).
jax.config.update("jax_enable_x64", os.environ.get("GRADSOLVE_BENCH_X64", "1") != "0")
# gradsolve's persistent compilation cache off (before any script imports gradsolve):
# a cache left warm by an earlier run would make "first call" and "with compiles"
# figures read a cache load. A section that measures the cache sets its own directory
# in the workers it spawns.
os.environ.setdefault("GRADSOLVE_COMPILATION_CACHE", "0")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import datetime  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import resource  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from importlib import metadata  # noqa: E402
from pathlib import Path  # noqa: E402

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
DOCS = ROOT / "docs" / "benchmarks.md"
SCRIPTS = ("grad_vs_diffrax", "stiff_and_high_order", "fit_vs_diffrax", "neural_ode",
           "fused_forward", "kernel_adjoint", "scale", "petab_collection", "outputs",
           "time_to_optimum")
PACKAGES = ("gradsolve", "jax", "jaxlib", "diffrax", "equinox", "optax", "warp-lang",
            "numpy", "scipy")


def log(msg):
    print(msg, flush=True)


# --------------------------------------------------------------------------- timing

def warm(fn, repeats):
    """One untimed call (it compiles), then `repeats` timed calls: the median excludes
    compilation; the first call's time is kept apart."""
    t = time.perf_counter()
    jax.block_until_ready(fn())
    first = time.perf_counter() - t
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t)
    return {"median_s": float(np.median(times)), "times_s": times, "first_call_s": first}


def ratio(a, b):
    """a / b, None when either is missing (same-run ratios only: both from one run)."""
    return a / b if a and b else None


def rounds(fns, repeats, n_rounds):
    """Warm medians of several functions timed in alternating rounds (`warm` per round,
    all rounds' calls pooled): slow drift of a shared machine falls on all of them
    alike. Also the process CPU time / wall time of each one's calls ("cores busy")."""
    times, cpu, wall = ({k: [] for k in fns} for _ in range(3))
    for _ in range(n_rounds):
        for k, fn in fns.items():
            c = time.process_time()
            w = warm(fn, repeats)
            cpu[k].append(time.process_time() - c)
            wall[k].append(w["first_call_s"] + sum(w["times_s"]))
            times[k] += w["times_s"]
    return {k: {"median_s": float(np.median(times[k])), "times_s": times[k],
                "cores_busy": sum(cpu[k]) / sum(wall[k])} for k in fns}


def timed_fit(cal, theta0, steps):
    """`(seconds, result)` of `cal.fit(theta0, steps=steps)` with every stopping test
    off, so that every fit runs `steps` updates (checked)."""
    t = time.perf_counter()
    res = cal.fit(theta0, steps=steps, tol=None, grad_tol=None, progress=False)
    jax.block_until_ready(res.theta)
    if res.updates != steps:
        raise RuntimeError(f"{cal.engine}: {res.updates} updates, not {steps}")
    return time.perf_counter() - t, res


def sum_squares(ys, params):
    """The scripts' usual loss: the sum of squares of the final states."""
    return jnp.sum(ys ** 2)


def diff(a, b):
    """Max abs and max relative difference over the leaves of two pytrees (gradients,
    meshes), and whether they are bitwise equal."""
    a, b = (np.concatenate([np.ravel(x) for x in jax.tree.leaves(t)]) for t in (a, b))
    d = np.abs(a - b)
    scale = np.maximum(np.abs(a), np.finfo(a.dtype).tiny)
    return {"max_abs": float(d.max()), "max_rel": float((d / scale).max()),
            "bitwise": bool(np.array_equal(a, b))}


def xla_bytes(fn, *args):
    """XLA's memory analysis of `fn._call` compiled for `args`: temporaries, arguments,
    outputs (bytes)."""
    m = fn._call.lower(*args).compile().compiled.memory_analysis()
    return {"temp": m.temp_size_in_bytes, "arguments": m.argument_size_in_bytes,
            "outputs": m.output_size_in_bytes}


# ------------------------------------------------------------------ fresh processes

WORKER_RESULT = "BENCH_WORKER_RESULT "


def spawn(script, task, env=None, timeout=1200, **spec):
    """Run `workers[task](spec)` of `script` (a path) in a fresh process (see `main`);
    its JSON result."""
    cmd = [sys.executable, str(script), "--worker", json.dumps(dict(spec, task=task))]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith(WORKER_RESULT)]
    if out.returncode or not lines:
        raise RuntimeError(f"worker {task} failed (rc {out.returncode}):\n"
                           f"{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return json.loads(lines[-1][len(WORKER_RESULT):])


def peak_rss():
    """This process's peak resident set so far, bytes: `ru_maxrss` (KiB on Linux), kept
    across fork and exec, so a worker's starts at what its parent held; and VmHWM
    (/proc/self/status), the peak of this process's own address space, which exec
    starts afresh: the measurement."""
    status = Path("/proc/self/status")
    line = next((ln for ln in status.read_text().splitlines() if ln.startswith("VmHWM:")),
                None) if status.exists() else None
    return {"ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "vm_hwm": None if line is None else int(line.split()[1]) * 1024}


@contextlib.contextmanager
def cpu_threads(n):
    """Warp CPU launches on `n` threads through the public setting
    GRADSOLVE_CPU_THREADS, read at every launch ("1": one launch on one thread;
    None: unset, one thread per core)."""
    old = os.environ.pop("GRADSOLVE_CPU_THREADS", None)
    if n is not None:
        os.environ["GRADSOLVE_CPU_THREADS"] = str(n)
    try:
        yield
    finally:
        os.environ.pop("GRADSOLVE_CPU_THREADS", None)
        if old is not None:
            os.environ["GRADSOLVE_CPU_THREADS"] = old


# ----------------------------------------------------------------- matched accuracy

def front(points):
    """The Pareto front of (error, seconds) points, fastest first: a point both slower
    and less accurate than another is dropped (it would make time(error) multivalued)."""
    kept, best = [], np.inf
    for e, t in sorted((p for p in points if p[0] and p[1] and p[0] > 0),
                       key=lambda p: (p[1], p[0])):
        if e < best:
            kept.append((e, t))
            best = e
    return kept


def time_at(front_, error):
    """Seconds to reach `error` on a front, log(time) interpolated linearly in
    log(error); None outside the front's error range."""
    errs, times = np.log([p[0] for p in front_]), np.log([p[1] for p in front_])
    if not front_ or not errs.min() - 0.05 <= np.log(error) <= errs.max() + 0.05:
        return None
    order = np.argsort(errs)
    return float(np.exp(np.interp(np.log(error), errs[order], times[order])))


def overlap(a, b):
    """[lo, hi]: the errors both fronts reach (ends within 5% count as touching), or None."""
    if not a or not b:
        return None
    lo = max(min(p[0] for p in a), min(p[0] for p in b))
    hi = min(max(p[0] for p in a), max(p[0] for p in b))
    return [lo, max(lo, hi)] if lo <= hi * 1.05 else None


def levels(span, n=4):
    """`n` errors spread log-evenly over `span`."""
    return [float(e) for e in np.geomspace(*span, n)] if span[1] > span[0] else [span[0]]


# -------------------------------------------------------------------------- targets

def target(what, op, bound, values):
    """One row of a target table, computed: `values` {where: measured ratio}; met when
    every value meets `op bound`."""
    ok = [v is not None and (v >= bound if op == ">=" else v <= bound)
          for v in values.values()]
    status = ("not measured" if not values else "met" if all(ok)
              else "missed" if not any(ok) else "partly met")
    return {"what": what, "target": f"{op} {bound:g}x", "values": values, "status": status}


def measured(row):
    return ", ".join(f"{k}: {fmt(v)}x" for k, v in row["values"].items()) or "-"


def target_table(rows):
    return md_table(["benchmark", "target", "measured", "verdict"],
                    [[r["what"], r["target"], measured(r), r["status"]] for r in rows])


# ------------------------------------------------------------------------ reporting

def fmt(x, spec=".2f"):
    return "-" if x is None else format(x, spec)


def md_table(head, rows):
    return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
                     + ["| " + " | ".join(map(str, r)) + " |" for r in rows])


def machine():
    """CPU model, cores, memory, platform and package versions."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((ln.split(":", 1)[1].strip() for ln in info.splitlines()
                  if ln.startswith("model name")), platform.processor())
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30
    versions = {}
    for pkg in PACKAGES:
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = None
    return {"cpu_model": model, "cores": os.cpu_count(), "memory_gib": round(mem, 1),
            "platform": platform.platform(), "python": platform.python_version(),
            "device": str(jax.devices()[0]), "versions": versions}


def git(*args, text=True):
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=text,
                              timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return "" if text else b""


# What a result depends on besides the installed packages: a change under these paths
# not in the commit makes the result irreproducible from the commit. The harness's own
# outputs (benchmarks/results/, docs/) are left out: `make bench` writes them between
# scripts.
CODE = ("src", "benchmarks", "recipes", "tests/data", ":(exclude)benchmarks/results")


def tree():
    """`(commit, dirty paths, sha256 of their diff)`: the uncommitted changes under
    `CODE`, untracked files included (their content hashed too)."""
    commit = git("rev-parse", "--short", "HEAD").strip()
    status = git("status", "--porcelain", "--untracked-files=all", "--", *CODE)
    entries = sorted((line[3:], line[:2]) for line in status.splitlines() if line.strip())
    digest = hashlib.sha256(git("diff", "--binary", "HEAD", "--", *CODE, text=False))
    for path, code in entries:
        if code == "??":
            digest.update(path.encode() + b"\0" + (ROOT / path).read_bytes())
    return commit, [path for path, _ in entries], digest.hexdigest() if entries else None


def check_tree(when, commit=None):
    """SystemExit unless the code is committed (and, after a run, still `commit`)."""
    now, changed, _ = tree()
    if now and not changed and commit in (None, now):
        return now
    why = (f"uncommitted changes: {', '.join(changed)}" if changed else
           "no git commit found" if not now else f"the commit moved from {commit} to {now}")
    raise SystemExit(
        f"benchmarks: not stored ({when}, {why}). A stored result must be reproducible "
        "from its commit: commit first; or pass --no-write to only print the tables, or "
        "--allow-dirty to store it marked as such (docs/benchmarks.md then flags it).")


def stamp(args):
    """When, on what code and under what load a section ran."""
    commit, changed, digest = tree()
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": commit, "dirty": changed, "diff_sha256": digest,
            "load_start": list(os.getloadavg()), "quick": args.quick,
            "threads": os.environ.get("GRADSOLVE_CPU_THREADS") or "one per core",
            "compilation_cache": os.environ.get("GRADSOLVE_COMPILATION_CACHE"),
            "command": " ".join(["benchmarks/" + Path(sys.argv[0]).name] + sys.argv[1:])}


def dirty(run):
    """A stored section's uncommitted changes, as the docs show them ('' if none).
    Results stored before `dirty` was recorded only said whether src/ had any."""
    if run.get("dirty"):
        return f"{', '.join(run['dirty'])}; diff sha256 {run['diff_sha256'][:12]}"
    return "src/, paths not recorded" if run.get("src_uncommitted") else ""


def jsonable(x):
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, (np.generic, np.ndarray)):
        return x.tolist()
    return x


def run_block(script, report):
    """The machine and, per section, when and how it ran."""
    m = report["machine"]
    v = ", ".join(f"{k} {x}" for k, x in m["versions"].items() if x)
    runs = "; ".join(
        f"{name}: {s['run']['date']}, commit {s['run']['commit']}"
        + (f" **+ uncommitted changes ({dirty(s['run'])}): not reproducible from the "
           f"commit**" if dirty(s["run"]) else "")
        + f", load average {s['run']['load_start'][0]:.1f} at start, "
        f"{s['run']['wall_s'] / 60:.1f} min" + (", **quick run**" if s["run"]["quick"] else "")
        for name, s in report["sections"].items())
    return (f"Machine: {m['cpu_model']} ({m['cores']} cores, {m['memory_gib']} GiB), "
            f"{m['platform']}; {v}. Runs: {runs}. Reproduce: `.venv/bin/python "
            f"benchmarks/{script}.py` (`--only SECTION` for one); raw numbers: "
            f"`benchmarks/results/{script}.json`.")


def write_block(text, name, body):
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    block = f"{start}\n{body.strip()}\n{end}"
    if start in text and end in text:
        head, rest = text.split(start, 1)
        return head + block + rest.split(end, 1)[1]
    return text.rstrip("\n") + "\n\n" + block + "\n"


def summary():
    """The targets of every stored JSON, one table."""
    rows = []
    for script in SCRIPTS:
        path = RESULTS / f"{script}.json"
        if path.exists():
            report = json.loads(path.read_text())
            runs = [s["run"] for s in report["sections"].values()]
            flag = "".join(f" ({f})" for f, on in (
                ("quick run", any(r["quick"] for r in runs)),
                ("uncommitted changes", any(dirty(r) for r in runs))) if on)
            rows += [[r["what"] + flag, r["target"],
                      measured(r), r["status"], f"`{script}`"] for r in report["targets"]]
    return md_table(["benchmark", "target", "measured", "verdict", "script"], rows)


def write_docs(script, blocks, report):
    docs = DOCS
    text = docs.read_text() if docs.exists() else "# Benchmarks\n"
    for name, body in blocks.items():
        text = write_block(text, f"{script}/{name}", body)
    text = write_block(text, f"{script}/run", run_block(script, report))
    text = write_block(text, "summary", summary())
    docs.write_text(text)


# ------------------------------------------------------------------ command line

def int_list(text):
    return [int(x) for x in text.split(",") if x.strip()]


def cli(doc, sections, extra=None, argv=None):
    """The one parser: --quick, --only SECTION, --sizes, --repeats, --threads,
    --render (rewrite the docs from the stored JSON), --no-write, --allow-dirty."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes, few repeats")
    ap.add_argument("--only", action="append", choices=list(sections),
                    help="run this section only (repeatable); keep the others' stored results")
    ap.add_argument("--sizes", type=int_list, help="ensemble sizes of the main sweep")
    ap.add_argument("--repeats", type=int, help="timed repeats per measurement")
    ap.add_argument("--threads", type=int,
                    help="GRADSOLVE_CPU_THREADS for the whole run (default: one per core)")
    ap.add_argument("--render", action="store_true",
                    help="only rewrite docs/benchmarks.md from the stored JSON")
    ap.add_argument("--no-write", action="store_true",
                    help="print the tables; write neither JSON nor docs")
    ap.add_argument("--allow-dirty", action="store_true",
                    help="store a result measured with uncommitted changes to the code "
                         "(recorded, with their diff's hash; the docs flag it)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)  # a `spawn`ed task (JSON)
    if extra:
        extra(ap)
    return ap.parse_args(argv)


def main(script, doc, sections, render, targets, workers=None):
    """A script's command line: a `spawn`ed worker's task, or `run`."""
    args = cli(doc, sections)
    if args.worker:
        spec = json.loads(args.worker)
        print(WORKER_RESULT + json.dumps(workers[spec["task"]](spec)), flush=True)
    else:
        run(script, sections, render, targets, args)


def run(script, sections, render, targets, args):
    """Measure the chosen sections, store the JSON, regenerate the docs from it."""
    path = RESULTS / f"{script}.json"
    stored = json.loads(path.read_text()) if path.exists() else {}
    if not args.render:
        strict = not (args.no_write or args.allow_dirty)
        commit = check_tree("before measuring") if strict else None
        if args.threads:
            os.environ["GRADSOLVE_CPU_THREADS"] = str(args.threads)
        done = {k: v for k, v in stored.get("sections", {}).items()
                if args.only and k in sections and k not in args.only}
        for name in args.only or sections:
            log(f"== {script}: {name}")
            st, t = stamp(args), time.perf_counter()
            data = sections[name](args)
            st.update(wall_s=time.perf_counter() - t, load_end=list(os.getloadavg()))
            done[name] = {"run": st, **data}
        done = {k: done[k] for k in sections if k in done}
        report = json.loads(json.dumps(jsonable(
            {"script": script, "machine": machine(), "sections": done})))
        report["targets"] = targets(report["sections"])
        if args.no_write or strict:
            log("\n\n".join(render(report["sections"]).values()))
            log(target_table(report["targets"]))
        if args.no_write:
            return report
        if strict:  # the code may have changed under a long run
            check_tree("after measuring; the tables are printed above", commit)
        RESULTS.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=1) + "\n")
        log(f"wrote {path.relative_to(ROOT)}")
    report = json.loads(path.read_text())
    write_docs(script, render(report["sections"]), report)
    log(f"wrote {DOCS.relative_to(ROOT)}")
    return report
