"""Checkpoints as users meet them: relative paths, resume after a mesh refresh,
extending a finished fit, changed setups, damage, two writers, kill -9.

The fit is tests/fit_worker.py: four decay-rate fits whose mesh widens as the rates
grow (re-recorded every 3 updates), so a resume must restore shapes that differ
from a fresh start's. Every resumed result is compared bit for bit with one
uninterrupted run: on the CPU the fit is deterministic, so any difference is a
checkpoint that lost or mixed work.
"""

import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import gradsolve as gs
import fit_worker
from fit_worker import (THETA0, assert_same_state, calibrator, flip_a_byte,
                        interrupting, steps_in)

STEPS = 40
WORKER = pathlib.Path(fit_worker.__file__)


@pytest.fixture(scope="module")
def reference():
    """One uninterrupted 40-update fit, and the mesh width it started from."""
    res = calibrator().fit(THETA0, steps=STEPS, progress=False)
    first = calibrator().fit(THETA0, steps=1, progress=False)
    return res, first.state.mesh["h"].shape[1]


def set_aside(ckpt):
    return sorted(p.name for p in pathlib.Path(ckpt).iterdir() if ".damaged" in p.name)


def test_the_reference_fit_widens_its_mesh(reference):
    # The premise of the resume tests: the saved mesh is wider than a fresh start's.
    res, start_width = reference
    assert res.refreshes == STEPS // 3 and res.state.mesh["h"].shape[1] > start_width


def test_relative_dir_ctrl_c_and_resume_after_refresh(tmp_path, monkeypatch, reference,
                                                     capsys):
    # A relative checkpoint_dir (the README's form) crashed Orbax at the first save;
    # a resume after a refresh failed to restore against the fresh start's shapes and
    # set good steps aside. Ctrl-C now saves the work done and says how to resume.
    monkeypatch.chdir(tmp_path)
    cal = interrupting(calibrator("runs/fit", checkpoint_every=5), 23)
    with pytest.raises(KeyboardInterrupt):
        cal.fit(THETA0, steps=STEPS, progress=False)
    assert "run the same fit again to resume" in capsys.readouterr().err
    assert steps_in(tmp_path / "runs/fit") == [15, 20, 23]
    res = calibrator("runs/fit", checkpoint_every=5).fit(THETA0, steps=STEPS, progress=False)
    assert res.resumed_from == 23
    assert "resumed from checkpoint step 23" in capsys.readouterr().err
    assert_same_state(res, reference[0])
    # A rerun of the finished fit resumes at its end and changes nothing.
    again = calibrator("runs/fit", checkpoint_every=5).fit(THETA0, steps=STEPS,
                                                           progress=False)
    assert again.resumed_from == STEPS
    assert_same_state(again, reference[0])
    assert set_aside(tmp_path / "runs/fit") == []


def test_ctrl_c_before_the_first_update_saves_nothing(tmp_path, capsys):
    # It used to claim "saved as step 0" with nothing saved.
    with pytest.raises(KeyboardInterrupt):
        interrupting(calibrator(tmp_path / "fit", checkpoint_every=5), 0).fit(
            THETA0, steps=STEPS, progress=False)
    assert "no update was done yet, nothing to save" in capsys.readouterr().err
    assert steps_in(tmp_path / "fit") == []


def test_a_larger_cap_extends_a_finished_fit_bit_for_bit(tmp_path, reference):
    ckpt = tmp_path / "fit"
    short = calibrator(ckpt, checkpoint_every=7).fit(THETA0, steps=25, progress=False)
    assert set(short.status_names) == {"step_cap"} and short.history.shape == (25, 4)
    assert steps_in(ckpt)[-1] == 25  # the end of a fit is saved
    longer = calibrator(ckpt, checkpoint_every=7).fit(THETA0, steps=STEPS, progress=False)
    assert longer.resumed_from == 25 and longer.history.shape == (STEPS, 4)
    assert_same_state(longer, reference[0])


@pytest.fixture(scope="module")
def six_steps(tmp_path_factory):
    """A directory holding a 6-update fit, copied by each test that changes it."""
    ckpt = tmp_path_factory.mktemp("six") / "fit"
    calibrator(ckpt, checkpoint_every=3).fit(THETA0, steps=6, progress=False)
    return ckpt


def _copy(src, tmp_path):
    dst = tmp_path / "fit"
    shutil.copytree(src, dst)
    (dst / "gradsolve.lock").unlink(missing_ok=True)
    return dst


@pytest.mark.parametrize("change,named", [
    (dict(optimizer=optax.sgd(0.3)), "the optimizer"),
    (dict(optimizer=optax.adam(0.2)), "the optimizer"),
    (dict(loss=lambda ys, k, d: jnp.sum(jnp.abs(ys - d))), "the traced loss"),
    (dict(data=fit_worker.DATA * 1.01), "the data"),
    (dict(refresh_every=4), "refresh_every: checkpoint 3 vs now 4"),
])
def test_a_changed_setup_is_refused_naming_it(six_steps, tmp_path, change, named):
    # Changing the optimizer kind used to set valid steps aside as "unreadable"; a
    # changed learning rate, loss or data resumed silently, mixing two runs.
    ckpt = _copy(six_steps, tmp_path)
    with pytest.raises(gs.calibrate.CheckpointMismatch, match=named):
        calibrator(ckpt, checkpoint_every=3, **change).fit(THETA0, steps=9, progress=False)
    assert steps_in(ckpt) == [3, 6] and set_aside(ckpt) == []
    # Starting over is explicit: the old steps go, the new fit saves its own.
    over = calibrator(ckpt, checkpoint_every=3, **change).fit(THETA0, steps=9,
                                                              progress=False, resume=False)
    assert over.resumed_from is None and over.updates == 9 and steps_in(ckpt) == [3, 6, 9]
    if named == "the data":  # one case suffices to show it is a fresh fit, bit for bit
        assert_same_state(over, calibrator(**change).fit(THETA0, steps=9, progress=False))


def test_another_theta0_is_refused(six_steps, tmp_path):
    ckpt = _copy(six_steps, tmp_path)
    with pytest.raises(gs.calibrate.CheckpointMismatch, match="theta0 changed"):
        calibrator(ckpt, checkpoint_every=3).fit(THETA0 * 2, steps=9, progress=False)


def test_a_step_damaged_twice_does_not_block_resuming(six_steps, tmp_path):
    # `_set_aside` renamed onto an existing `6.damaged`: OSError, no resume at all.
    ckpt = _copy(six_steps, tmp_path)
    straight = calibrator().fit(THETA0, steps=6, progress=False)
    for _ in range(2):
        flip_a_byte(ckpt / "6")
        with pytest.warns(UserWarning, match="step 6 (fails its checksum|is unreadable)"):
            res = calibrator(ckpt, checkpoint_every=3).fit(THETA0, steps=6, progress=False)
        assert res.resumed_from == 3
        assert_same_state(res, straight)
    assert set_aside(ckpt) == ["6.damaged", "6.damaged.1"]


def test_a_live_writer_is_refused_and_a_dead_ones_lock_taken_over(six_steps, tmp_path):
    from gradsolve.calibrate._checkpoint import Checkpoints
    ckpt = _copy(six_steps, tmp_path)
    holder = Checkpoints(ckpt)
    try:
        with pytest.raises(gs.calibrate.CheckpointLocked, match=f"pid {os.getpid()} on host"):
            calibrator(ckpt, checkpoint_every=3).fit(THETA0, steps=9, progress=False)
    finally:
        holder.close()
    # A lock file left by a process that no longer exists holds no lock.
    (ckpt / "gradsolve.lock").write_text('{"pid": 999999999, "host": "gone", "since": "-"}')
    res = calibrator(ckpt, checkpoint_every=3).fit(THETA0, steps=9, progress=False)
    assert res.resumed_from == 6


def test_two_processes_on_one_directory(tmp_path):
    # Two processes started together on one directory: one fits, the other is
    # refused at once with the owner named (one of them used to die inside Orbax).
    ckpt, barrier = tmp_path / "fit", tmp_path / "barrier"
    barrier.mkdir()
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(ckpt), str(tmp_path / f"{i}.npz"),
                               "--barrier", str(barrier), "--steps", "12"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    codes = sorted(p.returncode for p in procs)
    assert codes == [0, 3], outs
    locked = next(out for (out, _), p in zip(outs, procs) if p.returncode == 3)
    assert "LOCKED: checkpoint_dir" in locked and "is in use by another fit (pid" in locked


def test_kill_9_at_random_moments_resumes_bit_identically(tmp_path, reference):
    # kill -9 six times: three at random moments of a run, three the instant a save is
    # under way (Orbax's temporary step directory exists). Then let it finish: the
    # final state equals the uninterrupted fit's bit for bit and no good step was set
    # aside. Each process resumes from the previous one's checkpoints (refresh every
    # 3 updates, a save every update).
    ckpt, out = tmp_path / "fit", tmp_path / "out.npz"
    rng = np.random.default_rng(0)
    mid_save = kills = 0
    for trial in range(6):
        proc = subprocess.Popen([sys.executable, str(WORKER), str(ckpt), str(out),
                                 "--steps", str(STEPS)],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        assert proc.stdout.readline().strip() == "ready"
        if trial % 2 == 0:
            time.sleep(rng.uniform(0.0, 1.5))
        else:
            deadline = time.monotonic() + 60
            while not any("tmp" in p.name for p in ckpt.glob("*")) \
                    and time.monotonic() < deadline and proc.poll() is None:
                time.sleep(0.0005)
        if proc.poll() is None:
            mid_save += any("tmp" in p.name for p in ckpt.glob("*"))
            proc.send_signal(signal.SIGKILL)
            kills += 1
        proc.wait()
    final = subprocess.run([sys.executable, str(WORKER), str(ckpt), str(out),
                            "--steps", str(STEPS)], capture_output=True, text=True,
                           timeout=300)
    assert final.returncode == 0, final.stderr
    assert kills == 6 and mid_save >= 1  # every run was killed, some inside a save
    print(f"kills {kills}, inside a save {mid_save}")
    assert set_aside(ckpt) == []
    saved = np.load(out)
    want = [np.asarray(x) for x in jax.tree.leaves(reference[0].state._asdict())]
    assert len(saved.files) == len(want)
    for i, w in enumerate(want):
        np.testing.assert_array_equal(saved[f"arr_{i}"], w)
