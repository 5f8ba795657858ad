"""A small checkpointed fit, run as a separate process by the checkpoint tests.

    python tests/fit_worker.py CHECKPOINT_DIR OUT.npz [--steps N] [--barrier DIR]

Four decay rates k (y' = -k y, two trajectories per fit at k and 2k) are fitted
from k = 1 towards k = 6..12 with the mesh re-recorded every 3 updates: as k grows
the mesh widens, so a resume must restore shapes that differ from a fresh start's.
The final state's leaves are written to OUT.npz. With `--barrier DIR`, the process
waits until two processes have arrived there before it starts the fit (the
concurrent-writer test). Exit code 3 and a line `LOCKED: ...` when another live
process holds the checkpoint directory.

With FIT_WORKER_KILL=WHERE:N in the environment the process kills itself (SIGKILL)
at a chosen point of the save of step N, so that the kill -9 test lands where it
means to, whatever the machine's speed:
- `update:N`: after update N, with step N-1 written and no save under way;
- `write:N`: inside Orbax's write of step N (in the checkpoint writer process, while
  the fit goes on): the step's temporary directory exists, being written;
- `commit:N`: every file of step N written, just before Orbax renames its temporary
  directory to `N`.
The last two kill the fit's process from the writer process (`writer_hooks`), which
the kernel then ends with it. `sigint:N` is a Ctrl-C at a terminal after update N
(SIGINT to the worker's process group, which must be its own): the fit saves step N
and exits with KeyboardInterrupt.
"""

import argparse
import contextlib
import os
import pathlib
import sys
import time

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import gradsolve as gs  # noqa: E402


B, K = 4, 2
K_TRUE = jnp.array([6.0, 8.0, 10.0, 12.0])


RATES = jnp.array([1.0, 2.0])
DATA = jnp.exp(-K_TRUE[:, None] * RATES)[:, :, None]


def squares(ys, k, d):
    return jnp.sum((ys - d) ** 2)


def calibrator(checkpoint_dir=None, checkpoint_every=None, loss=squares, data=DATA, **kw):
    prob = gs.EnsembleProblem(f_jax=lambda t, y, k: -k * y, y0=jnp.ones((B * K, 1)),
                              params=jnp.ones(B * K), t_span=(0.0, 1.0), name="decay")
    kw.setdefault("optimizer", optax.adam(0.3))
    kw.setdefault("refresh_every", 3)
    kw.setdefault("to_params", lambda k: k * RATES)
    kw.setdefault("transform", gs.transforms.Positive())
    return gs.Calibrator(
        prob, loss, data=data, rtol=1e-8, atol=1e-10,
        checkpoint_dir=checkpoint_dir, checkpoint_every=checkpoint_every, **kw)


def interrupting(cal, after):
    """`cal` with its update raising KeyboardInterrupt (a simulated Ctrl-C) once it
    has run `after` times (one update per call of the compiled loop)."""
    cal._max_updates = 1
    update = cal._update
    calls = {"n": 0}

    def wrapped(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] > after:
            raise KeyboardInterrupt("simulated interruption")
        return update(*args, **kwargs)
    cal._update = wrapped
    return cal


THETA0 = jnp.ones(B)


def steps_in(ckpt):
    """The checkpoint steps in a directory, as Orbax names them."""
    return sorted(int(p.name) for p in pathlib.Path(ckpt).iterdir() if p.name.isdigit())


def flip_a_byte(step_dir):
    """Damage a saved step as a bad disk would: one byte of its largest data file."""
    files = [p for p in pathlib.Path(step_dir).rglob("*") if p.is_file()
             and "meta" not in str(p)]
    target = max(files, key=lambda p: p.stat().st_size)
    raw = bytearray(target.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    target.write_bytes(bytes(raw))


def in_writer(name, *args):
    """Call `writer_hooks.name(*args)` in this process's checkpoint writer process."""
    from gradsolve.calibrate import _writer

    here = str(pathlib.Path(__file__).parent)
    _writer.shared().request("call", here, "writer_hooks", name, args).result()


@contextlib.contextmanager
def hooked_writes(steps, hook, *args):
    """The checkpoint writer process running `writer_hooks.<hook>(*args)` before it
    writes the JSON metadata of each step in `steps` (see `writer_hooks.install`):
    `"no_space"` is a save failing as on a full disk. It runs where Orbax writes the
    step, in the writer process while the fit goes on, so an error surfaces only when
    the save is waited for, as a real one does."""
    in_writer("install", sorted(steps), "write", hook, args)
    try:
        yield
    finally:
        in_writer("uninstall")


def kill_at(where, step):
    """Make this process SIGKILL itself at `where` of step `step`'s save (see the
    module docstring)."""
    import signal

    from gradsolve.calibrate._checkpoint import Checkpoints

    if where in ("update", "sigint"):
        if where == "sigint" and os.getpgrp() != os.getpid():
            raise RuntimeError("FIT_WORKER_KILL=sigint:N signals its whole process group: "
                               "start the worker in a session of its own")
        if where == "sigint":  # Python's own handler, as a terminal user's process has
            signal.signal(signal.SIGINT, signal.default_int_handler)  # (xdist ignores it)
        save, fired = Checkpoints.save, []

        def killing(self, n, *args, **kwargs):
            if n == step and not fired:  # once: the interrupted fit saves step N again
                fired.append(n)
                self.wait()
                if where == "update":
                    os.kill(os.getpid(), signal.SIGKILL)
                # Ctrl-C at a terminal: SIGINT to every process of the foreground
                # group, the checkpoint writer process included.
                os.killpg(os.getpgrp(), signal.SIGINT)
            return save(self, n, *args, **kwargs)
        Checkpoints.save = killing
    elif where in ("write", "commit"):
        in_writer("install", [step], where, "kill_the_fit", (0.05 if where == "write" else 0,))
    else:
        raise ValueError(f"FIT_WORKER_KILL: where must be update, sigint, write or commit, "
                         f"got {where!r}")


def assert_same_state(a, b):
    """Two fit states (or FitResults) equal leaf for leaf, bit for bit."""
    a, b = (getattr(x, "state", x) for x in (a, b))
    x, y = jax.tree.leaves(a._asdict()), jax.tree.leaves(b._asdict())
    assert len(x) == len(y)
    for u, v in zip(x, y):
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


def state_leaves(res):
    return [np.asarray(x) for x in jax.tree.leaves(res.state._asdict())]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("checkpoint_dir")
    p.add_argument("out")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--barrier", default=None)
    args = p.parse_args()
    cal = calibrator(args.checkpoint_dir, checkpoint_every=1)
    if os.environ.get("FIT_WORKER_KILL"):
        where, step = os.environ["FIT_WORKER_KILL"].split(":")
        kill_at(where, int(step))
    if args.barrier is not None:
        barrier = pathlib.Path(args.barrier)
        (barrier / str(os.getpid())).touch()
        while len(list(barrier.iterdir())) < 2:
            time.sleep(0.01)
    print("ready", flush=True)
    try:
        res = cal.fit(THETA0, steps=args.steps, progress=False)
    except gs.calibrate.CheckpointLocked as e:
        print(f"LOCKED: {e}", flush=True)
        sys.exit(3)
    np.savez(args.out, *state_leaves(res))
    print(f"done {res.updates} resumed_from {res.resumed_from}", flush=True)


if __name__ == "__main__":
    main()
