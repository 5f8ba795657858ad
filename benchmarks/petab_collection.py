"""The PEtab benchmark collection (`../shared/data/benchmark_models_petab/`, data only):
per model, in a fresh process (compiles included, gradsolve's persistent compilation
cache off as in every script here):

- load: `gs.petab.load` (SBML -> SymPy -> JAX source; no compile), or its refusal;
- llh: the first `llh()` at the nominal parameters (record + replay + its backward
  pass compiled: values and gradients share one compiled function), then a second;
- gradient: the first `llh_and_grad()` after it, then a warm one;
- the llh's difference from AMICI's reference (REFERENCES.md, AMICI at rtol = atol =
  1e-8; ours at load's defaults, rtol 1e-8, atol 1e-10);
- emitters: the same worker on a few models on XLA's default CPU code generator and on
  its legacy one (`XLA_FLAGS=--xla_cpu_use_fusion_emitters=false`, set before JAX
  starts), fresh processes alternated: what the compile-bound first llh and gradient
  gain, what the warm gradient pays, whether the llh changes.

A worker that runs past `TIMEOUT` seconds is recorded as such. AMICI is not installed
here (it builds C++ with swig): its times are not measured.

    .venv/bin/python benchmarks/petab_collection.py [--quick]
"""

import os

from _harness import ROOT, main, md_table, spawn, target

import re  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402

DATA = ROOT.parent / "shared" / "data" / "benchmark_models_petab"
TIMEOUT = 420
QUICK = ("Boehm_JProteomeRes2014", "Bruno_JExpBot2016")


def references():
    text = (DATA / "REFERENCES.md").read_text()
    return {m: float(v) for m, v in re.findall(r"^\| (\w+) \| (-?[0-9][0-9.e+-]*) \|", text,
                                               re.M)}


def model_worker(spec):
    """One model in this (fresh) process."""
    import gradsolve as gs

    path = next((DATA / "Benchmark-Models" / spec["model"]).glob("*.yaml"))
    t = time.perf_counter()
    try:
        prob = gs.petab.load(path)
    except (gs.petab.PetabError, gs.petab.UnsupportedSBML) as e:
        return {"refused": f"{type(e).__name__}: {e}"}
    out = {"load_s": time.perf_counter() - t, "n": prob.problem.n, "d": prob.problem.d,
           "parameters": len(prob.parameter_ids), "priors": len(prob.priors)}
    for name, call in (("llh", prob.llh), ("llh_again", prob.llh)):
        t = time.perf_counter()
        out[name] = call()
        out[name + "_s"] = time.perf_counter() - t
    for name in ("grad", "grad_again"):
        t = time.perf_counter()
        try:
            prob.llh_and_grad()
        except gs.petab.PetabError as e:  # switch-time parameters (Beer)
            out["grad_refused"] = str(e)
            break
        out[name + "_s"] = time.perf_counter() - t
    return out


def models(args):
    ref = references()
    names = QUICK if args.quick else sorted(
        p.name for p in (DATA / "Benchmark-Models").iterdir() if p.is_dir())
    rows = {}
    for name in names:
        t = time.perf_counter()
        try:
            row = spawn(__file__, "model", env=dict(os.environ), timeout=TIMEOUT, model=name)
        except subprocess.TimeoutExpired:
            row = {"timeout_s": TIMEOUT}
        except RuntimeError as e:
            row = {"failed": str(e).strip().splitlines()[-1][:300]}
        row["process_s"] = time.perf_counter() - t
        if "llh" in row and name in ref:
            row["reference"], row["diff"] = ref[name], abs(row["llh"] - ref[name])
        rows[name] = row
        print(f"  {name}: {row}", flush=True)
    return {"timeout_s": TIMEOUT, "models": rows}


# ------------------------------------------------------------------- emitters

LEGACY = "--xla_cpu_use_fusion_emitters=false"
EMITTER_MODELS = ("Boehm_JProteomeRes2014", "Bruno_JExpBot2016", "Fujita_SciSignal2010")


def emitters(args):
    """Each of `EMITTER_MODELS` in fresh processes on XLA's default CPU emitters and on
    the legacy ones, alternated (which goes first swaps every round)."""
    names = EMITTER_MODELS[:1] if args.quick else EMITTER_MODELS
    repeats = 1 if args.quick else (args.repeats or 2)
    rows = {}
    for name in names:
        runs = {"default": [], "legacy": []}
        for rep in range(repeats):
            for kind in sorted(runs, reverse=bool(rep % 2)):
                env = dict(os.environ)
                if kind == "legacy":
                    env["XLA_FLAGS"] = " ".join(filter(None, (env.get("XLA_FLAGS"), LEGACY)))
                runs[kind].append(spawn(__file__, "model", env=env, timeout=TIMEOUT,
                                        model=name))
        rows[name] = runs
        print(f"  {name}: {runs}", flush=True)
    return {"flag": LEGACY, "models": rows}


def emitter_table(e):
    def med(runs, key):
        return statistics.median(r[key] for r in runs)
    rows = []
    for name, runs in e["models"].items():
        d, g = runs["default"], runs["legacy"]
        first = [med(x, "llh_s") + med(x, "grad_s") for x in (d, g)]
        warm = [1e3 * med(x, "grad_again_s") for x in (d, g)]
        rows.append([name, f"{first[0]:.2f}", f"{first[1]:.2f}", f"{first[1] / first[0]:.2f}",
                     f"{warm[0]:.0f}", f"{warm[1]:.0f}",
                     f"{max(abs(r['llh'] - d[0]['llh']) for r in d + g):.1e}"])
    return md_table(["model", "first llh + first gradient s, default", "legacy",
                     "legacy / default", "warm gradient ms, default", "legacy",
                     "largest llh difference"], rows)


def _s(row, key):
    return f"{row[key]:.2f}" if key in row else "-"


def render(sections):
    blocks = {"emitters": emitter_table(sections["emitters"])} if "emitters" in sections else {}
    if "models" not in sections:
        return blocks
    table = []
    for name, r in sections["models"]["models"].items():
        if "refused" in r:
            table.append([name, "refused: " + r["refused"][:90]] + [""] * 7)
            continue
        if "load_s" not in r:
            why = f"no result in {r['timeout_s']} s" if "timeout_s" in r else r["failed"]
            table.append([name, why] + [""] * 7)
            continue
        grad = "refused (switch times)" if "grad_refused" in r else _s(r, "grad_s")
        table.append([
            name, f"{r['n']} x {r['d']}, {r['parameters']} ({r['priors']} priors)",
            _s(r, "load_s"), _s(r, "llh_s"), _s(r, "llh_again_s"), grad,
            _s(r, "grad_again_s"), f"{r['llh']:.6f}" if "llh" in r else "-",
            f"{r['diff']:.1e}" if "diff" in r else "no reference"])
    return {**blocks, "models": md_table(
        ["model", "conditions x states, estimated parameters", "load s", "first llh s",
         "llh s", "first gradient s (after the llh)", "gradient s", "llh at nominal",
         "llh difference from AMICI's reference"], table)}


def targets(sections):
    rows = sections.get("models", {}).get("models", {})
    # As ratios to the bounds (the table's unit): 10 s, and AMICI's 1e-3.
    small = {name: (r["llh_s"] + r.get("grad_s", 0.0)) / 10 for name, r in rows.items()
             if "llh_s" in r and r["d"] <= 40}
    close = {name: r["diff"] / 1e-3 for name, r in rows.items() if "diff" in r}
    return [target("PEtab collection: (first llh + first gradient, cold) / 10 s, models "
                   "up to 40 states", "<=", 1, small),
            target("PEtab collection: abs(llh - AMICI reference) / 1e-3 at nominal", "<=", 1,
                   close)]


if __name__ == "__main__":
    if not DATA.is_dir():
        raise SystemExit(f"the benchmark collection is not at {DATA} (../shared/data)")
    main("petab_collection", __doc__, {"models": models, "emitters": emitters}, render,
         targets, workers={"model": model_worker})
