"""One process of a two-process job on the loopback address, run by test_scale.py.

    python tests/scale_worker.py PROCESS_ID NUM_PROCESSES PORT CHECKPOINT_DIR OUT.npz

Joins the job with `gs.distributed.initialize`, then computes what `results()`
computes on one process: a Lorenz gradient on the general path (per-trajectory and
`gs.Shared` parameters), and a checkpointed Calibrator fit (fit_worker's decay fit)
that is then extended by a second Calibrator on the same directory, so the second
fit resumes from a checkpoint the processes wrote together. Process 0 writes the
arrays to OUT.npz.
"""

import sys

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import gradsolve as gs  # noqa: E402


def lorenz_problem(n=37):
    prob = gs.problems.lorenz(n=n)
    params = dict(prob.params, sigma=gs.Shared(jnp.asarray(10.0)))
    return prob.replace(params=params)


def loss(ys, p):
    return jnp.sum(ys ** 2) * p["sigma"].value


def results(checkpoint_dir, **kw):
    """The arrays both runs compare: gradient, then a fit of 6 updates extended to
    12 from its checkpoint."""
    import fit_worker

    vg = gs.value_and_grad(lorenz_problem(), loss, engine="general_replay", **kw)
    value, grads = vg()
    first = fit_worker.calibrator(checkpoint_dir, checkpoint_every=2, **kw).fit(
        fit_worker.THETA0, steps=6, progress=False)
    extended = fit_worker.calibrator(checkpoint_dir, checkpoint_every=2, **kw).fit(
        fit_worker.THETA0, steps=12, progress=False)
    out = dict(value=value, g_rho=grads["rho"], g_beta=grads["beta"],
               g_sigma=grads["sigma"].value, h=vg.mesh.h, first_theta=first.theta,
               theta=extended.theta, loss=extended.loss,
               resumed_from=np.asarray(-1 if extended.resumed_from is None
                                       else extended.resumed_from),
               history=extended.history)
    return {k: np.asarray(v) for k, v in out.items()}


def main():
    pid, count, port, checkpoint_dir, out = sys.argv[1:6]
    index, total = gs.distributed.initialize(f"127.0.0.1:{port}", int(count), int(pid))
    assert jax.device_count() == total * jax.local_device_count()
    arrays = results(checkpoint_dir)
    if index == 0:
        np.savez(out, **arrays)
    print(f"process {index} of {total} done, devices {jax.device_count()}", flush=True)


if __name__ == "__main__":
    sys.path.insert(0, __import__("os").path.dirname(__file__))
    main()
