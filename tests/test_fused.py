"""The fused Warp engines on the cpu device, against the general (JAX) engines:
the same controller, the same first step, so the same accepted steps."""

import jax.numpy as jnp
import numpy as np
import pytest

import gradsolve as gs
from helpers import rel_err, tree_rel_err


# (builder, kwargs, rtol, atol): the stiff fields run Rosenbrock23 at loose tolerances
# (it is second order: tight ones take thousands of steps).
FIELDS = [
    ("lorenz", {}, 1e-7, 1e-10),
    ("van_der_pol", {}, 1e-7, 1e-10),
    ("lorenz96", {"d": 8}, 1e-7, 1e-10),
    ("linear", {"d": 5}, 1e-7, 1e-10),
    ("robertson", {}, 1e-5, 1e-10),
    ("hires", {}, 1e-5, 1e-10),
    ("linear_stiff", {"d": 6}, 1e-5, 1e-10),
]


def _problem(name, kw, n=6):
    return getattr(gs.problems, name)(n=n, **kw)


@pytest.mark.parametrize("name,kw,rtol,atol", FIELDS)
def test_fused_solve_equals_general_float64(name, kw, rtol, atol):
    # Same steps (counts equal), and outputs served the same way by default: Tsit5's
    # continuous extension (the kernel's generated from the same tableau), Rosenbrock23's
    # integrated step. The states differ only by roundoff carried through the solve
    # (measured 4.7e-14 on Lorenz, the extension's large weights cancelling), far
    # below 1e-10 relative. tests/test_translate.py compares the integrated outputs.
    prob = _problem(name, kw)
    ts = np.linspace(*prob.t_span, 4)
    fused = gs.solve(prob, rtol=rtol, atol=atol, ts=ts)
    general = gs.solve(prob, rtol=rtol, atol=atol, ts=ts, engine="general",
                       method=fused.method)
    assert fused.engine == "fused" and fused.ok and general.ok
    assert fused.interpolated == general.interpolated == (fused.method == "tsit5")
    np.testing.assert_array_equal(fused.n_accepted, general.n_accepted)
    np.testing.assert_array_equal(fused.n_rejected, general.n_rejected)
    assert rel_err(fused.ys, general.ys) < 1e-10


def test_fused_vern7_solve_equals_general():
    # Vern7's kernel comes from the same emitter as Tsit5's (one per tableau kind), so
    # one field checks it: the same steps, outputs from the continuous extension (its
    # six extra stages evaluated in the kernel) and by an integrated step, each equal
    # to the general engine's served the same way: measured 1.8e-15 relative at
    # most, bound 1e-12; the two ways differ by the extension's error (5.8e-11).
    prob = _problem("lorenz", {})
    ts = np.linspace(0.05, 0.95, 7)
    for interpolate in (None, False):
        kw = dict(method="vern7", rtol=1e-8, atol=1e-11, ts=ts, interpolate=interpolate)
        fused, general = gs.solve(prob, **kw), gs.solve(prob, engine="general", **kw)
        assert fused.engine == "fused" and fused.method == "vern7" and fused.ok and general.ok
        assert fused.interpolated == general.interpolated == (interpolate is None)
        np.testing.assert_array_equal(fused.n_accepted, general.n_accepted)
        assert rel_err(fused.ys, general.ys) < 1e-12


@pytest.mark.parametrize("name,kw,rtol,atol", FIELDS)
def test_fused_solve_equals_general_float32(name, kw, rtol, atol):
    # float32 on both sides at rtol 1e-5: float32 roundoff (1e-7) in the error
    # estimate can shift steps, so the two agree to the solve's accuracy, 1e-4.
    prob = _problem(name, kw)
    fused = gs.solve(prob, rtol=1e-5, atol=1e-8, dtype=jnp.float32)
    general = gs.solve(prob, rtol=1e-5, atol=1e-8, dtype=jnp.float32, engine="general",
                       method=fused.method)
    assert fused.ys.dtype == jnp.float32 and fused.ok and general.ok
    assert rel_err(fused.ys, general.ys) < 1e-4


@pytest.mark.parametrize("name,kw,rtol,atol", FIELDS)
def test_fused_recorder_records_the_general_mesh(name, kw, rtol, atol):
    # Accepted and rejected steps equal for every trajectory. Step sizes: the typical
    # step agrees to 1e-8 relative (measured median <= 3.3e-9, on Lorenz); the worst
    # step to 1e-7 of the span (measured <= 3.1e-8, on `linear`). Not bit for bit: XLA
    # contracts multiply-adds into FMAs and the kernels do not, and where the first
    # steps' error estimate sits near its roundoff floor the controller amplifies that
    # last-bit difference (docs/engines.md, "How close the two recorders are").
    prob = _problem(name, kw)
    fused = gs.record(prob, rtol=rtol, atol=atol, recorder="fused")
    general = gs.record(prob, rtol=rtol, atol=atol, recorder="general", method=fused.method)
    assert (fused.recorder, general.recorder) == ("fused", "general")
    np.testing.assert_array_equal(fused.n_steps, general.n_steps)
    np.testing.assert_array_equal(fused.n_rejected, general.n_rejected)
    h_f, h_g = np.asarray(fused.h), np.asarray(general.h)
    taken = h_g > 0
    np.testing.assert_array_equal(h_f > 0, taken)
    assert np.median(np.abs(h_f - h_g)[taken] / h_g[taken]) < 1e-8
    assert np.max(np.abs(h_f - h_g)) < 1e-7 * (prob.t_span[1] - prob.t_span[0])


@pytest.mark.parametrize("name,kw,rtol,atol", [FIELDS[0], FIELDS[3], FIELDS[4]])
def test_fused_replay_gradient_equals_general_replay(name, kw, rtol, atol):
    prob = _problem(name, kw)
    loss = lambda ys, p: jnp.sum(ys ** 2)
    fused = gs.value_and_grad(prob, loss, wrt="both", rtol=rtol, atol=atol,
                              engine="fused_replay")
    general = gs.value_and_grad(prob, loss, wrt="both", rtol=rtol, atol=atol,
                                engine="general_replay", method=fused.mesh.method)
    assert fused.mesh.recorder == "fused"
    (v_f, g_f), (v_g, g_g) = fused(), general()
    assert rel_err(v_f, v_g) < 1e-10
    assert tree_rel_err(g_f, g_g) < 1e-10


@pytest.mark.parametrize("name,kw", [("lorenz", {}), ("linear", {"d": 5})])
def test_chunks_lanes_and_threads_do_not_change_results(monkeypatch, name, kw):
    # A trajectory's arithmetic must not depend on where it lands: its chunk, its lane
    # within a thread (n = 13 leaves the last thread a finished lane), its slice, or
    # whether a recording ran it twice.
    from gradsolve.warp import _fused, _runtime
    prob = getattr(gs.problems, name)(n=13, **kw)
    whole = gs.record(prob, recorder="fused")
    assert _fused.lanes() == 2
    monkeypatch.setattr(_fused, "MEMORY_BUDGET", 5 * 200)  # a few trajectories a chunk
    chunked = gs.record(prob, recorder="fused")
    monkeypatch.setattr(_fused, "CPU_LANES", 1)
    one_lane = gs.record(prob, recorder="fused")
    # Recording launches keep RECORD_WIDTH steps; longer trajectories run again.
    monkeypatch.setattr(_fused, "RECORD_WIDTH", int(np.median(whole.n_steps)))
    rerun = gs.record(prob, recorder="fused")
    for other in (chunked, one_lane, rerun):
        np.testing.assert_array_equal(whole.h, other.h)
        np.testing.assert_array_equal(whole.n_steps, other.n_steps)
    assert _runtime.slices(13, 2) in ([(0, 6), (6, 13)], [(0, 7), (7, 13)])


def test_fused_failures_are_reported():
    prob = gs.problems.van_der_pol(n=4, mu=(0.1, 25.0), t_span=(0.0, 10.0))
    sol = gs.solve(prob, max_steps=60)
    assert sol.engine == "fused"
    status = np.asarray(sol.status)
    assert np.all((status == gs.Status.SUCCESS) | (status == gs.Status.MAX_STEPS))
    assert (status == gs.Status.MAX_STEPS).any() and not sol.ok
    with pytest.raises(gs.TrajectoryFailure, match="maximum number of steps"):
        sol.raise_for_status()


def test_warp_start_is_quiet_but_passes_other_native_output_on(capfd):
    # Warp's native library prints a notice when no CUDA driver is found; gradsolve
    # drops that one line (the engines say which device ran) and nothing else.
    import os
    import subprocess
    import sys
    from gradsolve.warp import _runtime
    code = "import gradsolve.warp._runtime as r; r.warp(); print('device', r.device())"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert _runtime._NO_DRIVER not in run.stderr and "device" in run.stdout
    with _runtime._native_stderr() as printed:
        os.write(2, b"from native code\n")
    assert printed() == "from native code\n"
    assert capfd.readouterr().err == ""  # captured, not shown


def test_registered_form_takes_a_shared_parameter():
    """A `gs.Shared` parameter of a registered field (common to every trajectory) is
    broadcast to the hand-written kernel's columns (it raised a TypeError from the
    packing). Against the general engine at rtol 1e-10: the two recorders agree to
    ~1e-10 on the states (docs/engines.md), so 1e-8."""
    prob = gs.problems.lorenz(n=5)
    prob = prob.replace(params=dict(prob.params, sigma=gs.Shared(jnp.asarray(10.0))))
    fused, general = (gs.solve(prob, engine=e, rtol=1e-10, atol=1e-12)
                      for e in ("fused", "general"))
    np.testing.assert_allclose(fused.ys, general.ys, rtol=1e-8)
