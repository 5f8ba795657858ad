"""Calibrate a PEtab problem: a model of the PEtab test suite, from random starts.

    .venv/bin/python recipes/petab_fit.py [--case 0009] [--yaml problem.yaml]
        [--starts 8] [--steps 600] [--checkpoint-dir runs/petab]

Loads the problem with `gs.petab.load` (the suite's case 0009 by default: conversion
A <=> B preequilibrated to steady state under one condition, then simulated under
another; a0, b0 and k2 estimated), checks it against the suite's expected
log-likelihood, fits every start at once with Adam on the replay gradient (through
the steady state), and prints the PEtab summary: the best start's log-likelihood and
chi^2 beside the nominal parameters'. Two measurements and three parameters: the best
fit explains the data better than the nominal parameters do, along a ridge.
"""

import _common

import jax  # noqa: E402
import optax  # noqa: E402
import yaml  # noqa: E402

import gradsolve as gs  # noqa: E402


def main():
    p = _common.parser(__doc__, B=8, steps=600)
    p.add_argument("--case", default="0009", help="a petabtests v1.0.0 SBML case")
    p.add_argument("--yaml", default=None, help="a PEtab problem file instead of a case")
    p.add_argument("--lr", type=float, default=0.05)
    args = p.parse_args()
    path = args.yaml or gs.petab.test_case(args.case)
    prob = gs.petab.load(path)
    print(f"{path}: {prob.problem.n} trajectories, {len(prob.measurements)} measurements, "
          f"estimating {list(prob.parameter_ids)}")
    if args.yaml is None:
        with open(path.replace(".yaml", "_solution.yaml")) as f:
            expected = yaml.safe_load(f)["llh"]
        print(f"nominal llh {prob.llh():.8f}; the suite expects {expected:.8f}")
    cal = prob.calibrator(args.B, optax.adam(args.lr), checkpoint_dir=args.checkpoint_dir,
                          checkpoint_every=args.checkpoint_every if args.checkpoint_dir
                          else None)
    res = cal.fit(prob.starts(args.B, jax.random.key(0)), steps=args.steps,
                  grad_tol=1e-6, progress=not args.no_progress)
    print(res.table())
    print(prob.summary(res))


if __name__ == "__main__":
    main()
