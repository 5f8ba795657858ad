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
import threading
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import gradsolve as gs
import fit_worker
from gradsolve.calibrate import _fingerprint
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
    # Resumed with a cap below the 23 updates done (a new user's script did this), the
    # fits stop at the cap with no further update (one more ran before).
    capped = calibrator("runs/fit", checkpoint_every=5).fit(THETA0, steps=20,
                                                           progress=False)
    assert capped.updates == 23 and np.all(np.asarray(capped.steps) == 23)
    assert np.all(np.asarray(capped.status) == gs.FitStatus.STEP_CAP)
    capsys.readouterr()
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


class _CtrlC:
    """An update's losses that raise KeyboardInterrupt when the host reads them: a
    Ctrl-C after the compiled call returned, during the host's bookkeeping."""

    def __array__(self, *args, **kwargs):
        raise KeyboardInterrupt("Ctrl-C while the host writes the history")


def test_ctrl_c_between_an_update_and_its_history_resumes_bit_identically(tmp_path,
                                                                          reference):
    # Found by a new user's script (a real SIGINT): a Ctrl-C after a call's updates
    # came back but before their losses reached the history saved their state without
    # those history rows, and the resumed fit kept them NaN (7 rows of 3000). The
    # state is now settled only with its history written.
    cal = calibrator(tmp_path / "fit", checkpoint_every=5)
    cal._max_updates = 1
    update, calls = cal._update, []

    def ctrl_c_at_13(*args, **kwargs):
        new, count, (at, ran, losses), stale = update(*args, **kwargs)
        calls.append(1)
        return new, count, (at, ran, _CtrlC() if len(calls) == 13 else losses), stale
    cal._update = ctrl_c_at_13
    with pytest.raises(KeyboardInterrupt):
        cal.fit(THETA0, steps=STEPS, progress=False)
    assert steps_in(tmp_path / "fit") == [5, 10, 12]  # update 13 is not kept
    res = calibrator(tmp_path / "fit", checkpoint_every=5).fit(THETA0, steps=STEPS,
                                                                progress=False)
    assert res.resumed_from == 12 and not np.isnan(res.history).any()
    assert_same_state(res, reference[0])


def test_a_full_disk_at_a_save_keeps_the_fit_and_names_the_last_step(tmp_path, reference):
    # A full disk during a save ended the fit with Orbax's raw `ValueError:
    # RESOURCE_EXHAUSTED ...` (measured on a 200 kB tmpfs) and the updates since the
    # last save were lost. Now each failed save is a warning naming the last step
    # saved, the fit goes on (the next save writes again), and the result holds every
    # update. The disk is "full" for the saves of steps 10, 15 and 40 (the fit's end).
    ckpt = tmp_path / "fit"
    with fit_worker.hooked_writes({10, 15, 40}, "no_space"), \
            pytest.warns(UserWarning) as caught:
        res = calibrator(ckpt, checkpoint_every=5).fit(THETA0, steps=STEPS, progress=False)
    failed = [str(w.message) for w in caught if "could not be saved" in str(w.message)]
    assert len(failed) == 3, failed
    for message, step, last in zip(failed, (10, 15, 40), (5, 5, 35)):
        assert message.startswith(f"checkpoint step {step} could not be saved") \
            and "No space left on device" in message \
            and f"the last step saved is {last}" in message, message
    assert_same_state(res, reference[0])  # every update is in the result
    assert steps_in(ckpt) == [25, 30, 35]  # step 20 was saved after 10 and 15 failed
    # The failed saves' partial directories are not listed, and go at the next start.
    assert sorted(p.name for p in ckpt.iterdir() if "tmp" in p.name) == [
        f"{step}.orbax-checkpoint-tmp" for step in (10, 15, 40)]
    # With space again, the same fit resumes from the last good step, bit for bit.
    again = calibrator(ckpt, checkpoint_every=5).fit(THETA0, steps=STEPS, progress=False)
    assert again.resumed_from == 35 and steps_in(ckpt)[-1] == STEPS
    assert not [p for p in ckpt.iterdir() if "tmp" in p.name]
    assert_same_state(again, reference[0])


def test_a_writer_process_that_dies_is_reported_and_replaced(tmp_path, reference):
    # The steps are written by a child process (`_writer`); one that dies mid-write
    # (here it exits inside step 10's write, as the OOM killer would end it) fails that
    # save with a warning naming it, and the next save starts another writer: no update
    # is lost and the steps after it are written.
    ckpt = tmp_path / "fit"
    with fit_worker.hooked_writes({10}, "exit_writer"), pytest.warns(UserWarning) as caught:
        res = calibrator(ckpt, checkpoint_every=5).fit(THETA0, steps=STEPS, progress=False)
    failed = [str(w.message) for w in caught if "could not be saved" in str(w.message)]
    assert len(failed) == 1 and failed[0].startswith("checkpoint step 10 could not be "
                                                     "saved") \
        and "the checkpoint writer process" in failed[0] and "ended" in failed[0] \
        and "the last step saved is 5" in failed[0], failed
    assert_same_state(res, reference[0])
    assert steps_in(ckpt) == [30, 35, 40]


def test_a_writer_process_that_cannot_start_falls_back_to_the_fits_own(tmp_path,
                                                                     reference, monkeypatch):
    # A writer process that ends at once (here its interpreter is /bin/false; a broken
    # environment would do the same) fails the first save, and so does the one started
    # in its place: from the second save on, the fit writes its steps itself, saying so.
    from gradsolve.calibrate import _writer
    monkeypatch.setattr(_writer, "_shared", None)
    monkeypatch.setattr(sys, "executable", "/bin/false")
    ckpt = tmp_path / "fit"
    with pytest.warns(UserWarning) as caught:
        res = calibrator(ckpt, checkpoint_every=5).fit(THETA0, steps=STEPS, progress=False)
    said = [str(w.message) for w in caught]
    failed = [m for m in said if "could not be saved" in m]
    assert len(failed) == 1 and failed[0].startswith("checkpoint step 5 could not be saved")
    assert len([m for m in said if "ended twice" in m and "written by the fit's own "
                "process from now on" in m]) == 1, said
    assert_same_state(res, reference[0])
    assert steps_in(ckpt) == [30, 35, 40]
    monkeypatch.undo()
    again = calibrator(ckpt, checkpoint_every=5).fit(THETA0, steps=STEPS, progress=False)
    assert again.resumed_from == STEPS


def test_a_fit_on_a_thread_that_ends_leaves_the_writer_process_running(tmp_path):
    # Linux's PR_SET_PDEATHSIG, which ends the writer with the fit, fires when the
    # *thread* that started it ends: a first fit run on a short-lived thread (a thread
    # pool's) would take the writer down with that thread, and the next fit's first
    # save would fail. The writer is started by a thread of its own.
    from gradsolve.calibrate import _writer
    if _writer._shared is not None and not _writer._shared.gone:
        _writer._shared.process.kill()  # this fit's thread starts the next one
        _writer._shared.process.wait()
    thread = threading.Thread(target=lambda: calibrator(
        tmp_path / "a", checkpoint_every=5).fit(THETA0, steps=10, progress=False))
    thread.start()
    thread.join()
    time.sleep(0.2)
    assert _writer._shared.process.poll() is None
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="checkpoint step")  # a failed save warns
        calibrator(tmp_path / "b", checkpoint_every=5).fit(THETA0, steps=10, progress=False)
    assert steps_in(tmp_path / "b") == [5, 10]


def test_ctrl_c_when_its_save_fails_names_the_last_step_saved(tmp_path, capsys):
    cal = interrupting(calibrator(tmp_path / "fit", checkpoint_every=5), 13)
    with fit_worker.hooked_writes({13}, "no_space"), pytest.raises(KeyboardInterrupt), \
            pytest.warns(UserWarning, match="checkpoint step 13 could not be saved"):
        cal.fit(THETA0, steps=STEPS, progress=False)
    assert "fit interrupted after 13 updates; saving it failed (see the warning above); " \
        "the last step saved is 10" in capsys.readouterr().err
    assert steps_in(tmp_path / "fit") == [5, 10]


def test_the_fit_goes_on_while_a_step_is_written(tmp_path):
    # A save used to hold the fit until it was written (a 1000-update SEIR fit took
    # 47.9 s with a save every 25 updates, 22.6 s without). Now a writer process
    # writes it: step 5's write here waits until update 7 has run (the fit's process
    # makes a file then), which only an asynchronous save allows (a synchronous one
    # times out and fails the save).
    cal = calibrator(tmp_path / "fit", checkpoint_every=5)
    cal._max_updates = 1  # one update per call of the compiled loop: calls count updates
    update, calls, ran = cal._update, [], tmp_path / "update-7-ran"

    def counting(*args, **kwargs):
        calls.append(1)
        if len(calls) == 7:
            ran.touch()
        return update(*args, **kwargs)
    cal._update = counting
    with fit_worker.hooked_writes({5}, "wait_for", str(ran)), warnings.catch_warnings():
        warnings.filterwarnings("error", message="checkpoint step")  # a failed save warns
        cal.fit(THETA0, steps=10, progress=False)
    assert steps_in(tmp_path / "fit") == [5, 10]


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
    if named != "the data":  # one case shows starting over (each compiles a new fit)
        return
    # Starting over is explicit: the old steps go, the new fit saves its own, a fresh
    # fit bit for bit.
    over = calibrator(ckpt, checkpoint_every=3, **change).fit(THETA0, steps=9,
                                                              progress=False, resume=False)
    assert over.resumed_from is None and over.updates == 9 and steps_in(ckpt) == [3, 6, 9]
    assert_same_state(over, calibrator(**change).fit(THETA0, steps=9, progress=False))


def test_a_checkpoint_of_another_state_format_is_refused_naming_it(six_steps, tmp_path,
                                                                  monkeypatch):
    # A FitState field added or changed raises STATE_FORMAT; a checkpoint written under
    # the previous format is refused by name, not restored into the wrong fields.
    from gradsolve.calibrate import _fingerprint
    ckpt = _copy(six_steps, tmp_path)
    now = _fingerprint.STATE_FORMAT
    monkeypatch.setattr(_fingerprint, "STATE_FORMAT", now + 1)
    with pytest.raises(gs.calibrate.CheckpointMismatch,
                       match=r"the fit state's format \(the checkpoint is from an older "):
        calibrator(ckpt, checkpoint_every=3).fit(THETA0, steps=9, progress=False)
    assert steps_in(ckpt) == [3, 6] and set_aside(ckpt) == []


def test_another_theta0_is_refused(six_steps, tmp_path):
    ckpt = _copy(six_steps, tmp_path)
    with pytest.raises(gs.calibrate.CheckpointMismatch, match="theta0 changed"):
        calibrator(ckpt, checkpoint_every=3).fit(THETA0 * 2, steps=9, progress=False)


def test_a_refit_reuses_its_traced_fingerprint_but_not_across_a_static_leaf(
        tmp_path, monkeypatch):
    # The traced loss and optimizer are hashed once per Calibrator and signature
    # (`_fingerprint._traced`, ~0.25 s a fit). theta0's non-array leaves are traced into
    # the loss as constants (here the exponent c): a cached hash that ignored them
    # would resume a fit with another c. Its theta0 checksum covers arrays only, so
    # only the traced loss can name the change.
    traces = []
    trace = _fingerprint._trace
    monkeypatch.setattr(_fingerprint, "_trace", lambda *a: traces.append(a[2]) or trace(*a))
    cal = calibrator(tmp_path / "fit", checkpoint_every=3, transform=None,
                     to_params=lambda th: th["k"] ** th["c"] * fit_worker.RATES)
    for _ in range(2):
        cal.fit({"k": THETA0, "c": 1.0}, steps=3, progress=False, resume=False)
    assert len(traces) == 1
    with pytest.raises(gs.calibrate.CheckpointMismatch, match="^[^,]*the traced loss"):
        cal.fit({"k": THETA0, "c": 2.0}, steps=6, progress=False)
    assert len(traces) == 2 and steps_in(tmp_path / "fit") == [3]


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


def test_steps_are_packed_and_a_step_of_one_array_per_leaf_still_resumes(six_steps,
                                                                         tmp_path):
    # A step holds one array per dtype (`pack`); steps written one array per leaf, as
    # before that layout, restore too. The per-leaf step is rewritten here from the
    # packed one with Orbax directly, as the earlier writer saved it.
    import orbax.checkpoint as ocp
    from gradsolve.calibrate._checkpoint import Checkpoints, unpack
    ckpt = _copy(six_steps, tmp_path)
    args = ocp.args
    with ocp.CheckpointManager(ckpt) as manager:
        meta = manager.restore(6, args=args.Composite(meta=args.JsonRestore()))["meta"]
        packed = manager.restore(6, args=args.Composite(state=args.StandardRestore()))["state"]
    assert meta["layout"] == "packed"
    assert sorted(packed) == sorted({d for _, d in meta["shapes"].values()})
    straight = calibrator().fit(THETA0, steps=6, progress=False)
    state = unpack(packed, straight.state._asdict(), meta["shapes"])
    shutil.rmtree(ckpt)
    store = Checkpoints(ckpt, asynchronous=False)
    old = {k: v for k, v in meta.items() if k != "layout"}  # checksum, shapes kept
    store.manager.save(6, args=args.Composite(
        state=args.StandardSave(state), meta=args.JsonSave(old)), force=True)
    store.close()
    res = calibrator(ckpt, checkpoint_every=3).fit(THETA0, steps=9, progress=False)
    assert res.resumed_from == 6
    assert_same_state(res, calibrator().fit(THETA0, steps=9, progress=False))


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


# Where each run of the kill -9 test stops, and the newest step then on disk: killed
# between updates, inside a save's write (in the writer process, the fit going on) and
# with a step written but not yet renamed; and a Ctrl-C at a terminal (SIGINT to the
# fit's process group, its checkpoint writer process too), which saves the step it
# stopped at. Four runs and a last one: five processes (a second write, one more,
# measured 26 s and 37 s against the six random kills' 46 s and 47 s on the loaded
# 2-core machine, and checked nothing new).
KILLS = [("update", 7, 6), ("write", 14, 13), ("commit", 22, 21), ("sigint", 27, 27)]


def test_kill_9_inside_and_between_saves_resumes_bit_identically(tmp_path, reference):
    # kill -9 three times, once at each point the worker offers: between saves, inside
    # a step's write, inside its commit (it used to sleep for a random time or poll
    # for Orbax's temporary directory, so where the kills landed, and whether any
    # landed inside a save, depended on the machine's load), then a Ctrl-C. Each run
    # resumes from the previous one's checkpoints (a save every update, a refresh
    # every 3), losing only the step being saved (a kill) or nothing (Ctrl-C: the
    # writer process, which the terminal's SIGINT reaches too, writes the step); the
    # last run finishes, and its state equals the uninterrupted fit's bit for bit,
    # with no good step set aside.
    ckpt, out = tmp_path / "fit", tmp_path / "out.npz"
    worker = [sys.executable, str(WORKER), str(ckpt), str(out), "--steps", str(STEPS)]
    resumed = None
    for where, step, last in KILLS:
        run = subprocess.run(worker, env={**os.environ, "FIT_WORKER_KILL": f"{where}:{step}"},
                             capture_output=True, text=True, timeout=300,
                             start_new_session=where == "sigint")
        if where == "sigint":
            # Python ends on an uncaught KeyboardInterrupt by SIGINT.
            assert run.returncode == -signal.SIGINT and "KeyboardInterrupt" in run.stderr \
                and f"fit interrupted after {step} updates; saved as step {step}" \
                in run.stderr, run.stderr[-2000:]
        else:
            assert run.returncode == -signal.SIGKILL, (where, step, run.stderr[-2000:])
        assert resumed is None or f"resumed from checkpoint step {resumed} " in run.stderr
        assert steps_in(ckpt)[-1] == last
        # Inside a save: the step's temporary directory is there, and not listed.
        assert (ckpt / f"{step}.orbax-checkpoint-tmp").exists() == (where in ("write",
                                                                               "commit"))
        resumed = last
    final = subprocess.run(worker, capture_output=True, text=True, timeout=300)
    assert final.returncode == 0, final.stderr[-2000:]
    assert f"done {STEPS} resumed_from {resumed}" in final.stdout
    assert set_aside(ckpt) == [] and not [p for p in ckpt.iterdir() if "tmp" in p.name]
    saved = np.load(out)
    want = [np.asarray(x) for x in jax.tree.leaves(reference[0].state._asdict())]
    assert len(saved.files) == len(want)
    for i, w in enumerate(want):
        np.testing.assert_array_equal(saved[f"arr_{i}"], w)


def test_a_step_is_saved_once_when_a_call_runs_no_update(monkeypatch):
    # A call of the update loop can run no update (its first found a stale mesh, which
    # is refreshed next), leaving the count where the last save left it. Step 20 used
    # to be saved again: orbax refused it (StepAlreadyExistsError) and the fit warned
    # -- measured on a float32 network fit (Shared MLP, refresh_tol "auto", a save
    # every 20 updates) from a fresh checkpoint directory.
    from collections import namedtuple

    from gradsolve.calibrate import _policies

    class Store:
        def __init__(self):
            self.steps = []

        def save(self, step, state, meta):
            self.steps.append(step)

    monkeypatch.setattr(_policies._slots, "flush", lambda state, window, to_device: state)
    store, state = Store(), namedtuple("State", "x")(1)
    saves = _policies.Saves(store, 20, {})
    for done in (7, 20, 20, 33, 40, 40):
        saves.apply(state, None, done)
    assert store.steps == [20, 40]
