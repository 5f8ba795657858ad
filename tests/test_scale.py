"""Scale: several devices (scale_cases.py, in a subprocess with four forced host
devices), two processes over `gs.distributed` on the loopback address
(scale_worker.py), buckets by recorded step count and memory-bounded chunks (here,
on one device).

What each comparison allows: a trajectory's arithmetic does not depend on where it
runs, so per-trajectory results are compared bit for bit under `jit`; sums over
trajectories (a loss, the gradient of a `gs.Shared` parameter, a chunked replay's
recomputed backward) are added in another order, and are compared at `SUM_RTOL`.
"""

import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gradsolve as gs
from gradsolve import layout, methods


HERE = pathlib.Path(__file__).parent
# Sums of up to 48 float64 terms in another order: measured at most 1.4e-16 relative
# (the Shared gradient on two processes; the bucketed and chunked values are equal to
# the bit, the chunked gradients within 6.4e-17 of their largest entry).
SUM_RTOL = 1.5e-15


def _env(**extra):
    env = dict(os.environ, **extra)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")])
    return env


@pytest.mark.exact_across_shapes
def test_several_devices_in_one_process():
    """scale_cases.py on four forced host devices (the count is fixed when JAX
    starts): split solve, record, replay, gradients and a Calibrator fit equal one
    device's. A plain Python process, not a second pytest (this test took 54 s with
    one, 46 s without, on the 2-core machine)."""
    run = subprocess.run(
        [sys.executable, str(HERE / "scale_cases.py")],
        env=_env(XLA_FLAGS=" ".join(filter(None, (
            os.environ.get("XLA_FLAGS"), "--xla_force_host_platform_device_count=4")))),
        capture_output=True, text=True, timeout=900, cwd=HERE.parent)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    assert run.stdout.splitlines()[-1] == "12 scale cases passed", run.stdout


def _two_processes(tmp_path, first_port=None):
    """Runs scale_worker.py as processes 0 and 1: `(logs, [results of process 0, 1])`."""
    args = [str(tmp_path / "port"), str(tmp_path / "ckpt"), str(tmp_path / "two")]
    args += [] if first_port is None else [str(first_port)]
    procs = [subprocess.Popen([sys.executable, str(HERE / "scale_worker.py"), str(i), "2",
                               *args], env=_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i in range(2)]
    logs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n----\n".join(x[-3000:] for x in logs)
    return logs, [np.load(tmp_path / f"two.{i}.npz") for i in range(2)]


@pytest.mark.exact_across_shapes
def test_two_processes_reproduce_one(tmp_path):
    """Two processes joined by gs.distributed.initialize on the loopback address (CPU
    collectives over Gloo): each records its own share of the trajectories and
    replays the rows on its device, and both hold the gradient and the checkpointed
    fit, extended from the checkpoint the two wrote, of the single-process run. The
    coordinator publishes its port only once it listens (no race with process 1);
    offering it a port held by another socket, to exercise its retry, hung once in a
    loaded make test (JAX logged "Failed to add port" without raising), so the retry
    is not forced here."""
    import scale_worker

    logs, two = _two_processes(tmp_path)
    assert all("of 2 done, devices 2" in x for x in logs)
    assert logs[0].count("resumed from checkpoint step 6") == 1
    assert "resumed from" not in logs[1]  # the first process reports
    one = scale_worker.results(tmp_path / "one")
    assert int(one["resumed_from"]) == 6
    # The work was split: each process recorded and replayed its own rows (the
    # replay on devices of both processes); one process did all of them.
    for name in ("recorded", "replayed", "fit_recorded"):
        every = set(range(one[name].size))
        assert set(one[name].tolist()) == every, name
        mine = [set(r[name].tolist()) for r in two]
        assert all(mine) and not mine[0] & mine[1] and mine[0] | mine[1] == every, (name, mine)
    assert [int(r["replay_devices"]) for r in (one, *two)] == [1, 2, 2]
    for r in two:  # both processes hold every result
        assert int(r["resumed_from"]) == 6
        for name in ("g_rho", "g_beta", "h", "first_theta", "theta", "loss", "history"):
            np.testing.assert_array_equal(r[name], one[name], err_msg=name)
        for name in ("value", "g_sigma"):  # sums over trajectories, on two processes
            np.testing.assert_allclose(r[name], one[name], rtol=SUM_RTOL, atol=0)


# -- buckets and chunks, on one device -------------------------------------------------

@pytest.fixture(scope="module")
def spread():
    """y' = -k y with k over three decades: the explicit method's stability limit
    makes the recorded step counts span more than 10x."""
    k = jnp.logspace(0.0, 3.0, 48)
    return gs.EnsembleProblem(f_jax=lambda t, y, k: -k * y, y0=jnp.ones((48, 1)),
                              params=k, t_span=(0.0, 1.0), name="spread")


@pytest.fixture(scope="module")
def spread_mesh(spread):
    mesh = gs.record(spread, recorder="general")
    steps = np.asarray(mesh.n_steps)
    assert steps.max() >= 10 * steps.min()
    return mesh


WEIGHTS = jnp.linspace(1.0, 2.0, 48)[:, None]


def loss(ys, k):
    """The gradient flows through the replay only: a loss that also reads `k` adds its
    direct term to the replay's, and XLA may fuse that addition into a multiply-add
    in one program and not another (1 ulp; `test_buckets_change_no_result`)."""
    return jnp.sum(ys ** 2 * WEIGHTS)


def test_buckets_change_no_result(spread, spread_mesh):
    flat = gs.value_and_grad(spread, loss, mesh=spread_mesh, buckets=1)
    bucketed = gs.value_and_grad(spread, loss, mesh=spread_mesh, buckets=4)
    widths = bucketed.arrangement.widths
    assert len(widths) == 4 and widths[0] < widths[-1] <= spread_mesh.columns
    assert bucketed.arrangement.work() < 0.6 * flat.arrangement.work()
    (v1, g1), (v4, g4) = flat(), bucketed()
    np.testing.assert_array_equal(g4, g1)
    np.testing.assert_allclose(v4, v1, rtol=SUM_RTOL, atol=0)
    direct = lambda ys, k: jnp.sum(ys ** 2 * k[:, None])  # the 1-ulp case above
    g1, g4 = (gs.value_and_grad(spread, direct, mesh=spread_mesh, buckets=b)()[1]
              for b in (1, 4))
    np.testing.assert_allclose(g4, g1, rtol=4.5e-16, atol=0)
    ts = jnp.linspace(0.0, 1.0, 6)
    np.testing.assert_array_equal(gs.replay(spread, spread_mesh, ts=ts, buckets=3),
                                  gs.replay(spread, spread_mesh, ts=ts, buckets=1))


def test_arrangement_deals_every_device_the_same_work():
    """The plan `layout.arrange` places: on 4 devices, 4 buckets, heavy-tailed step
    counts (the device count is all it reads of a device mesh)."""
    steps = np.random.default_rng(0).lognormal(3.0, 0.8, 1000).astype(int) + 5
    D = 4
    order, widths, chunks = layout._layout(steps, D, 4, None, steps.max())
    real = order >= 0
    assert sorted(order[real]) == list(range(1000)) and chunks == 1
    per = order.size // D  # every device: the same rows per bucket, the same widths
    work = [np.where(real, steps[order], 0)[d * per:(d + 1) * per].sum() for d in range(D)]
    assert max(work) <= 1.05 * min(work)
    m = per // len(widths)
    for d in range(D):  # each bucket's width holds its longest trajectory
        for b, w in enumerate(widths):
            rows = slice(d * per + b * m, d * per + (b + 1) * m)
            assert np.where(real[rows], steps[order[rows]], 0).max() <= w
    arr = layout.arrange(1000, n_steps=steps, buckets=4, columns=steps.max())
    order, real = np.asarray(arr.order), np.asarray(arr.real)
    np.testing.assert_array_equal(order[np.asarray(arr.where)], np.arange(1000))
    assert arr.work() < 0.5 * 1000 * steps.max()


def test_chunked_gradient_equals_unchunked(spread, spread_mesh):
    method = methods.get(spread_mesh.method)
    per_row = layout.replay_bytes(method, 1, spread_mesh.columns, 8, remat=True)
    budget = layout.held_bytes(48, spread_mesh.columns, 1, 8) + per_row * 12  # 12 rows
    whole = gs.value_and_grad(spread, loss, wrt="both", mesh=spread_mesh, buckets=1)
    chunked = gs.value_and_grad(spread, loss, wrt="both", mesh=spread_mesh, buckets=1,
                                memory_budget=budget)
    assert chunked.arrangement.chunks >= 3
    (v0, g0), (v1, g1) = whole(), chunked()
    np.testing.assert_allclose(v1, v0, rtol=SUM_RTOL, atol=0)
    # The chunks are recomputed in the backward sweep (another program: other fusions,
    # last bits). Gradients of the fast-decaying trajectories are ~1e-17, differences
    # of cancelling terms: they are compared relative to the largest entry.
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)):
        np.testing.assert_allclose(a, b, rtol=SUM_RTOL, atol=SUM_RTOL * np.abs(b).max())


def test_chunked_record_and_solve_equal_whole(spread, spread_mesh):
    method = methods.get(spread_mesh.method)
    budget = layout.record_bytes(method, 1, 8, 64) * 10  # 10 rows at a time: 5 chunks
    mesh = gs.record(spread, recorder="general", memory_budget=budget)
    np.testing.assert_array_equal(mesh.h, spread_mesh.h)
    whole, chunked = (gs.solve(spread, engine="general", memory_budget=b)
                      for b in (None, budget))
    np.testing.assert_array_equal(chunked.ys, whole.ys)
    np.testing.assert_array_equal(chunked.n_accepted, whole.n_accepted)


def test_a_trajectory_too_large_for_the_budget_is_refused(spread, spread_mesh):
    with pytest.raises(MemoryError, match=r"memory budget of 1,000 bytes"):
        gs.value_and_grad(spread, loss, mesh=spread_mesh, memory_budget=1000)
    with pytest.raises(MemoryError, match=r"record"):
        gs.record(spread, recorder="general", memory_budget="100B")


@pytest.mark.parametrize("bad, match", [
    (dict(memory_budget="lots"), "memory_budget must be"),
    (dict(memory_budget=-1), "memory_budget must be"),
    (dict(buckets=0), "buckets must be"),
    (dict(devices=2), "there are 1 devices"),
    (dict(devices="cpu"), "jax devices"),
])
def test_bad_layout_arguments_are_named(bad, match):
    with pytest.raises((ValueError, TypeError), match=match):
        gs.value_and_grad(gs.problems.lorenz(n=4), lambda ys, p: ys.sum(), **bad)


def test_one_device_by_default():
    assert layout.device_mesh(None, 10**6) is None  # one device here
    assert layout.budget_bytes("2GB") == 2 * 10**9
    assert layout.budget_bytes("512 MiB") == 512 * 2**20
    assert layout.budget_bytes(None) > 0
