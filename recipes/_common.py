"""What every recipe shares: x64, the command line, the printed table and the plot."""

import argparse
import pathlib
import time

import jax

jax.config.update("jax_enable_x64", True)


def parser(doc, B, steps, K=None):
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--B", type=int, default=B, help="concurrent fits")
    if K is not None:
        p.add_argument("--K", type=int, default=K, help="trajectories per fit")
    p.add_argument("--steps", type=int, default=steps, help="update cap per fit")
    p.add_argument("--checkpoint-dir", default=None,
                   help="save/resume the fit here (Orbax)")
    p.add_argument("--checkpoint-every", type=int, default=50)
    p.add_argument("--plot", default=None, help="save the figure here (PNG)")
    p.add_argument("--no-progress", action="store_true")
    return p


def run(cal, theta0, truth, args, name, **fit_kw):
    """Fit, print the recovered-vs-true table and timing, save the plot."""
    start = time.perf_counter()
    res = cal.fit(theta0, steps=args.steps, progress=not args.no_progress, **fit_kw)
    elapsed = time.perf_counter() - start
    print(res.table(true=truth))
    print(f"engine {res.engine}; {res.updates} updates in {elapsed:.1f} s (incl. compile); "
          f"mesh refreshes {res.refreshes}; converged {int(res.converged.sum())}/"
          f"{len(res.loss)}")
    plot = args.plot or str(pathlib.Path("recipes") / "out" / f"{name}.png")
    pathlib.Path(plot).parent.mkdir(parents=True, exist_ok=True)
    res.plot(true=truth, path=plot)
    print(f"plot saved to {plot}")
    return res
