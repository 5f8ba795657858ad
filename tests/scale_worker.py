"""One process of a two-process job on the loopback address, run by test_scale.py.

    python tests/scale_worker.py PROCESS_ID NUM_PROCESSES PORT_FILE CHECKPOINT_DIR OUT [PORT]

Joins the job with `gs.distributed.initialize`, then computes what `results()`
computes on one process: a Lorenz gradient on the general path (per-trajectory and
`gs.Shared` parameters), and a checkpointed Calibrator fit (fit_worker's decay fit)
that is then extended by a second Calibrator on the same directory, so the second
fit resumes from a checkpoint the processes wrote together. Each process writes its
arrays, and the rows it recorded and replayed, to OUT.<process index>.npz.

Process 0 starts the coordinator on a free port (PORT first, if given) and writes the
port to PORT_FILE once it holds it; the others wait for that file.
"""

import os
import socket
import sys
import threading
import time

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import gradsolve as gs  # noqa: E402
from gradsolve.layout import _devices  # noqa: E402


def lorenz_problem(n=37):
    prob = gs.problems.lorenz(n=n)
    params = dict(prob.params, sigma=gs.Shared(jnp.asarray(10.0)))
    return prob.replace(params=params)


def loss(ys, p):
    return jnp.sum(ys ** 2) * p["sigma"].value


class _RecordedRows:
    """The rows this process hands the recorders (`layout.row_pieces` of a record, as
    `layout.by_rows` cuts them) inside a `with`: its share of the work, as the
    recorders receive it."""

    def __enter__(self):
        self.rows, self._real = [], _devices.row_pieces

        def spy(n, cfg, per_row, what):
            pieces = self._real(n, cfg, per_row, what)
            if what == "record":
                self.rows.extend(rows for rows, _ in pieces)
            return pieces
        _devices.row_pieces = spy
        return self

    def __exit__(self, *exc):
        _devices.row_pieces = self._real

    def unique(self):
        return np.unique(np.concatenate(self.rows))


def replayed_rows(arrangement, n):
    """The user's rows the arrangement places on this process's devices (all n on one
    device), and the number of devices it spans."""
    if arrangement.identity or arrangement.devices is None:
        return np.arange(n), 1
    devices = list(arrangement.devices.devices.flat)
    order, real = np.asarray(arrangement.order), np.asarray(arrangement.real)
    per = order.size // len(devices)
    mine = [order[d * per:(d + 1) * per][real[d * per:(d + 1) * per]]
            for d, device in enumerate(devices) if device.process_index == jax.process_index()]
    return np.sort(np.concatenate(mine)), len(devices)


def results(checkpoint_dir, **kw):
    """The arrays both runs compare: gradient, then a fit of 6 updates extended to
    12 from its checkpoint; and the rows this process recorded and replayed."""
    import fit_worker

    with _RecordedRows() as grad_rows:
        vg = gs.value_and_grad(lorenz_problem(), loss, engine="general_replay", **kw)
    value, grads = vg()
    replayed, replay_devices = replayed_rows(vg.arrangement, vg.mesh.h.shape[0])
    with _RecordedRows() as fit_rows:
        first = fit_worker.calibrator(checkpoint_dir, checkpoint_every=2, **kw).fit(
            fit_worker.THETA0, steps=6, progress=False)
        extended = fit_worker.calibrator(checkpoint_dir, checkpoint_every=2, **kw).fit(
            fit_worker.THETA0, steps=12, progress=False)
    out = dict(value=value, g_rho=grads["rho"], g_beta=grads["beta"],
               g_sigma=grads["sigma"].value, h=vg.mesh.h, first_theta=first.theta,
               theta=extended.theta, loss=extended.loss,
               resumed_from=np.asarray(-1 if extended.resumed_from is None
                                       else extended.resumed_from),
               history=extended.history, recorded=grad_rows.unique(), replayed=replayed,
               replay_devices=replay_devices, fit_recorded=fit_rows.unique())
    return {k: np.asarray(v) for k, v in out.items()}


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listens(port):
    """Whether this process has a TCP socket listening on `port` (Linux's /proc)."""
    mine = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if link.startswith("socket:["):
            mine.add(link[len("socket:["):-1])
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port \
                        and cols[9] in mine:  # 0A: LISTEN; column 9: the inode
                    return True
    return False


def coordinate(count, port_file, port=None, tries=5):
    """Process 0: start the job's coordinator and publish its port. A port found free
    can be taken by another program before the coordinator binds it (JAX then raises
    "Failed to start RPC server"): take another. The port is published only once this
    process listens on it, so no other process can join another job by mistake."""
    for _ in range(tries):
        port, stop = port or _free_port(), threading.Event()

        def publish(port=port):
            while not stop.is_set():
                if _listens(port):
                    with open(port_file + ".tmp", "w") as f:
                        f.write(str(port))
                    os.replace(port_file + ".tmp", port_file)
                    return
                time.sleep(0.02)
        threading.Thread(target=publish, daemon=True).start()
        try:
            return gs.distributed.initialize(f"127.0.0.1:{port}", count, 0)
        except jax.errors.JaxRuntimeError as e:
            if "Failed to start RPC server" not in str(e):
                raise
            print(f"port {port} taken; trying another", flush=True)
            port = None
        finally:
            stop.set()
    raise RuntimeError(f"no free port for the coordinator in {tries} tries")


def join(pid, count, port_file, timeout=300):
    """Process `pid` > 0: join once process 0 has published its port."""
    deadline = time.monotonic() + timeout
    while not os.path.exists(port_file):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no coordinator port in {port_file} after {timeout} s")
        time.sleep(0.02)
    with open(port_file) as f:
        port = int(f.read())
    return gs.distributed.initialize(f"127.0.0.1:{port}", count, pid)


def main():
    pid, count, port_file, checkpoint_dir, out = sys.argv[1:6]
    first_port = int(sys.argv[6]) if len(sys.argv) > 6 else None
    index, total = (coordinate(int(count), port_file, first_port) if int(pid) == 0
                    else join(int(pid), int(count), port_file))
    assert jax.device_count() == total * jax.local_device_count()
    np.savez(f"{out}.{index}.npz", **results(checkpoint_dir))
    print(f"process {index} of {total} done, devices {jax.device_count()}", flush=True)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(__file__))
    main()
