"""The Calibrator: B independent fits, convergence and freezing, isolation of
non-finite fits, checkpoints that resume bit for bit and survive damage."""

import datetime
import os
import pathlib
import re
import sys
import types
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import gradsolve as gs

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "recipes"))
import lorenz_rho  # noqa: E402
import fit_worker  # noqa: E402
from fit_worker import (assert_same_state, flip_a_byte, interrupting,  # noqa: E402
                        steps_in)
from gradsolve.mesh import padded_width  # noqa: E402
from helpers import rel_err, small_spiral  # noqa: E402
from gradsolve.calibrate._calibrator import MAX_UPDATES_PER_CALL as MAX_UPDATES  # noqa: E402


B, K = 8, 4
RHO_TRUE = jnp.linspace(12.0, 18.0, B)


def lorenz_fit():
    """B fits of rho, each from K trajectories with their own initial states and
    noisy final-state observations (noise 0.01 on states of size ~10): the
    `recipes/lorenz_rho.py` setup."""
    prob, to_params, loss, data, _, truth = lorenz_rho.build(B, K)
    np.testing.assert_array_equal(truth["rho"], RHO_TRUE)
    return prob, to_params, loss, data


@pytest.fixture(scope="module")
def lorenz():
    return lorenz_fit()


def calibrator(lorenz, **kw):
    prob, to_params, loss, data = lorenz
    kw.setdefault("optimizer", optax.adam(0.3))
    return gs.Calibrator(prob, loss, to_params=to_params, data=data, **kw)


THETA0 = {"rho": jnp.full(B, 15.0)}


@pytest.fixture(scope="module")
def fit40(lorenz):
    """40 updates from THETA0 with the defaults: the clean, uninterrupted run that two
    tests compare with (one fit, not one each)."""
    return calibrator(lorenz).fit(THETA0, steps=40, progress=False)


def test_lorenz_rho_fits_recover_every_rho(lorenz):
    # Noise 0.01 on ~10-sized states over 4 trajectories bounds the estimate's own
    # error far below 1% (measured <= 6e-4 relative); 400 updates is the bound.
    res = calibrator(lorenz, refresh_every=100).fit(THETA0, steps=400, grad_tol=1e-6,
                                                    progress=False)
    rel = np.abs(np.asarray(res.theta["rho"]) - RHO_TRUE) / RHO_TRUE
    assert np.all(rel < 0.01), rel
    assert res.converged.all() and res.engine == "fused_replay"
    assert res.history.shape == (400, B) and res.refreshes >= 1
    assert np.all(res.steps < 400)


def test_frozen_fits_do_not_move(lorenz, tmp_path):
    # A fit that converges stops: its parameters and optimizer state stay as they
    # were at the update it converged, bit for bit, while others keep going. The 30
    # updates are extended to 60 from their checkpoint (a resume is bit for bit,
    # test_resume_is_bit_identical), not run again from the start.
    kw = dict(checkpoint_dir=tmp_path / "fit", checkpoint_every=30)
    res = calibrator(lorenz, **kw).fit(THETA0, steps=30, tol=2e-4, progress=False)
    first = np.asarray(res.steps)
    assert res.converged.any() and not res.converged.all()
    longer = calibrator(lorenz, **kw).fit(THETA0, steps=60, tol=2e-4, progress=False)
    assert longer.resumed_from == 30
    frozen = np.flatnonzero(res.converged)
    assert np.any(np.asarray(longer.steps)[~res.converged] > 30)  # the others went on
    np.testing.assert_array_equal(np.asarray(longer.steps)[frozen], first[frozen])
    np.testing.assert_array_equal(np.asarray(longer.theta["rho"])[frozen],
                                  np.asarray(res.theta["rho"])[frozen])
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a)[frozen],
                                                            np.asarray(b)[frozen]),
                 longer.state.opt_state, res.state.opt_state)


def test_one_poisoned_fit_does_not_disturb_the_others(lorenz, fit40):
    prob, to_params, loss, data = lorenz
    # Finite data (NaN data is refused by name) whose squared misfit overflows to inf.
    bad = data.at[3].set(1e300)
    clean = fit40
    cal = gs.Calibrator(prob, loss, to_params=to_params, data=bad, optimizer=optax.adam(0.3))
    with pytest.warns(RuntimeWarning, match=r"1 of 8 fits stopped on a non-finite loss "
                      r"or gradient: fits \[3\]"):
        res = cal.fit(THETA0, steps=40, progress=False)
    assert res.status_names[3] == "nonfinite" and res.steps[3] == 0
    others = np.arange(B) != 3
    np.testing.assert_array_equal(np.asarray(res.theta["rho"])[others],
                                  np.asarray(clean.theta["rho"])[others])


def test_a_fit_whose_record_fails_is_frozen(lorenz):
    prob, to_params, loss, data = lorenz
    theta0 = {"rho": THETA0["rho"].at[5].set(1e6)}  # blows up: steps underflow / cap
    cal = gs.Calibrator(prob, loss, to_params=to_params, data=data,
                        optimizer=optax.adam(0.3), max_steps=200)
    with pytest.warns(RuntimeWarning, match=r"1 of 8 fits stopped on a failed recording "
                      r"of their mesh .*: fits \[5\]"):
        res = cal.fit(theta0, steps=5, progress=False)
    assert res.status_names[5] == "record_failed" and res.steps[5] == 0
    assert np.all(np.asarray(res.steps)[np.arange(B) != 5] == 5)


def test_resume_is_bit_identical(lorenz, tmp_path):
    kw = dict(refresh_every=15)
    straight = calibrator(lorenz, **kw).fit(THETA0, steps=50, progress=False)
    ckpt = tmp_path / "fit"
    cal = interrupting(calibrator(lorenz, checkpoint_dir=ckpt, checkpoint_every=10, **kw), 27)
    with pytest.raises(KeyboardInterrupt):
        cal.fit(THETA0, steps=50, progress=False)
    resumed = calibrator(lorenz, checkpoint_dir=ckpt, checkpoint_every=10, **kw).fit(
        THETA0, steps=50, progress=False)
    assert_same_state(resumed.state, straight.state)
    assert resumed.refreshes == straight.refreshes


def test_damaged_latest_checkpoint_falls_back(lorenz, fit40, tmp_path):
    ckpt = tmp_path / "fit"
    straight = fit40
    cal = interrupting(calibrator(lorenz, checkpoint_dir=ckpt, checkpoint_every=10), 31)
    with pytest.raises(KeyboardInterrupt):
        cal.fit(THETA0, steps=40, progress=False)
    # The interruption saved step 31 after 10, 20, 30: flip one byte in the largest
    # data file of that newest step.
    assert steps_in(ckpt) == [20, 30, 31]
    flip_a_byte(ckpt / "31")
    with pytest.warns(UserWarning, match="step 31"):
        resumed = calibrator(lorenz, checkpoint_dir=ckpt, checkpoint_every=10).fit(
            THETA0, steps=40, progress=False)
    assert_same_state(resumed.state, straight.state)


def test_checkpoint_of_another_fit_is_refused(lorenz, tmp_path):
    ckpt = tmp_path / "fit"
    calibrator(lorenz, checkpoint_dir=ckpt, checkpoint_every=5).fit(THETA0, steps=5,
                                                                  progress=False)
    with pytest.raises(ValueError, match="does not match this fit.*rtol"):
        calibrator(lorenz, checkpoint_dir=ckpt, rtol=1e-7).fit(THETA0, steps=5,
                                                               progress=False)


def test_transforms_keep_parameters_in_range():
    # Decay rates over 2.7 decades, fitted in log space (the loss is the squared log
    # misfit, whose closed-form minimum is k_true) from k = 1 for all: every fit
    # converges to 1e-9 of its loss and lands on the truth to 1e-4.
    k_true = jnp.array([0.01, 0.1, 1.0, 5.0])
    prob = gs.EnsembleProblem(f_jax=lambda t, y, k: -k * y, y0=jnp.ones((4, 1)),
                              params=jnp.ones(4), t_span=(0.0, 1.0))
    data = jnp.exp(-k_true)[:, None, None]
    cal = gs.Calibrator(prob, lambda ys, k, d: jnp.sum((jnp.log(ys) - jnp.log(d)) ** 2),
                        data=data, optimizer=optax.adam(0.05, b1=0.5, b2=0.9),
                        transform=gs.transforms.Positive(), rtol=1e-10, atol=1e-12,
                        refresh_every=25)
    res = cal.fit(jnp.ones(4), steps=600, tol=1e-18, progress=False)
    assert res.converged.all()
    np.testing.assert_allclose(res.theta, k_true, rtol=1e-4)
    with pytest.raises(ValueError, match="hi > lo"):
        gs.transforms.Bounded(1.0, 0.5)
    with pytest.raises(ValueError, match=r"edges must be one of \['clip', 'squash'\]"):
        gs.transforms.Log10(1.0, 2.0, edges="reflect")
    with pytest.raises(ValueError, match=r"Log\(edges='clip'\) needs bounds"):
        gs.transforms.Log(edges="clip")


@pytest.mark.parametrize("kw,match", [
    (dict(optimizer="adam"), "optax.GradientTransformation"),
    (dict(refresh_every=0), 'refresh_every must be None or "auto" or a positive integer'),
    (dict(refresh_every="sometimes"), 'refresh_every must be None or "auto" or a positive'),
    (dict(checkpoint_every=5), "checkpoint_every needs checkpoint_dir"),
    (dict(drift_every=5), "drift_every and drift_tol go together"),
    (dict(recorder="warp"), "recorder must be None, 'general' or 'fused'"),
    (dict(refresh_tol=0.5), 'refresh_tol must be None, "auto" or a number >= 1'),
    (dict(refresh_tol=2.0), "refresh_tol=2.0 needs the replay's error check"),
])
def test_bad_calibrator_settings_are_refused(lorenz, kw, match):
    with pytest.raises((TypeError, ValueError), match=match):
        calibrator(lorenz, **kw)


def test_bad_theta0_is_refused(lorenz):
    cal = calibrator(lorenz)
    with pytest.raises(ValueError, match="do not split into B=3"):
        cal.fit({"rho": jnp.ones(3)}, steps=2, progress=False)
    with pytest.raises(ValueError, match="non-finite"):
        cal.fit({"rho": jnp.full(B, jnp.nan)}, steps=2, progress=False)


def test_drift_check_reports_and_refreshes(lorenz):
    # A drift check every 10 updates compares the replay on the current mesh with a
    # fresh record at the current parameters; with a threshold of zero every check
    # refreshes, with an unreachable one none does, and the figures are reported.
    eager = calibrator(lorenz, drift_every=10, drift_tol=0.0).fit(THETA0, steps=30,
                                                                  progress=False)
    lazy = calibrator(lorenz, drift_every=10, drift_tol=1e9).fit(THETA0, steps=30,
                                                                 progress=False)
    assert sorted(eager.drift) == sorted(lazy.drift) == [10, 20]
    assert eager.refreshes == 2 and lazy.refreshes == 0
    assert all(0 < v < 0.1 for v in lazy.drift.values())


_DECAY_FIT = """
import sys
import jax
jax.config.update("jax_enable_x64", sys.argv[2] == "x64")
import jax.numpy as jnp, optax, gradsolve as gs
prob = gs.EnsembleProblem(f_jax=lambda t, y, k: -k * y, y0=jnp.ones((2, 1)),
                          params=jnp.ones(2), t_span=(0.0, 1.0))
cal = gs.Calibrator(prob, lambda ys, k, d: jnp.sum((ys - d) ** 2),
                    data=jnp.full((2, 1, 1), 0.5), optimizer=optax.adam(0.1),
                    checkpoint_dir=sys.argv[1], checkpoint_every=2)
try:
    cal.fit(jnp.ones(2), steps=4, progress=False)
except ValueError as e:
    print("REFUSED:", e)
"""


def test_float64_checkpoint_is_refused_without_x64(tmp_path, monkeypatch, capsys):
    # Orbax would silently cast float64 state to float32 in a process without x64;
    # the metadata records x64 and resuming there is a clear error instead. The
    # float64 fit runs here (this process has x64 on), the resume in a process without.
    import runpy
    import subprocess
    script = tmp_path / "fit.py"
    script.write_text(_DECAY_FIT)
    ckpt = str(tmp_path / "ckpt")
    monkeypatch.setattr(sys, "argv", [str(script), ckpt, "x64"])
    runpy.run_path(str(script), run_name="__main__")
    assert "REFUSED" not in capsys.readouterr().out and jax.config.jax_enable_x64
    second = subprocess.run([sys.executable, str(script), ckpt, "x32"],
                            capture_output=True, text=True, timeout=300)
    assert "REFUSED: the checkpoint holds float64 state but jax_enable_x64 is off" in \
        second.stdout, second.stdout + second.stderr


# -- inputs a fit refuses before any work, naming what is wrong --------------------

def _rates(**kw):
    """Two fits of two decaying trajectories each; theta = {"k": (2,)}."""
    prob = gs.EnsembleProblem(f_jax=lambda t, y, p: -p["k"] * y, y0=jnp.ones((4, 1)),
                              params={"k": jnp.ones(4)}, t_span=(0.0, 1.0))
    kw.setdefault("optimizer", optax.adam(0.1))
    return gs.Calibrator(prob, lambda ys, th, d: jnp.sum((ys - d) ** 2),
                         data=jnp.full((2, 2, 1), 0.5), **kw)


P, BD = gs.transforms.Positive(), gs.transforms.Bounded(0.5, 2.0)


@pytest.mark.parametrize("theta0,kw,error,match", [
    ({"k": jnp.array([1, 2])}, {}, TypeError, r"theta0\['k'\] has dtype int"),
    ({"k": jnp.array([1.0, -1.0])}, dict(transform=P), ValueError,
     r"theta0\['k'\] of fit 1 \(-1.0\) is outside the domain of its transform Positive"),
    ({"k": jnp.array([1.0, 3.0])}, dict(transform={"k": BD}), ValueError,
     r"of fit 1 \(3.0\) is outside the domain of its transform Bounded"),
    # clipped edges take the closed interval: a start on a bound is inside
    ({"k": jnp.array([0.5, 2.5])}, dict(transform=gs.transforms.Bounded(
        0.5, 2.0, edges="clip")), ValueError,
     r"of fit 1 \(2.5\) is outside the domain of its transform Bounded"),
    ({"k": jnp.ones(2)}, dict(transform={"rate": P}), ValueError,
     r"transform has leaves \[\"\['rate'\]\"\]"),
    ({"k": jnp.ones(2)}, dict(to_params=lambda th: {"k": jnp.full(3, th["k"])}),
     ValueError, re.escape("wrong shape or dtype ['k']: float64[3] (expected float64[2])")),
    ({"k": jnp.ones(2)}, dict(to_params=lambda th: {"k": jnp.full(2, th["k"], jnp.float32)}),
     ValueError, re.escape("['k']: float32[2] (expected float64[2])")),
    ({"k": jnp.ones(2)}, dict(to_params=lambda th: {"rate": jnp.full(2, th["k"])}),
     ValueError, re.escape("""missing ["['k']"]; unexpected ["['rate']"]""")),
    ({"k": jnp.ones(2)}, dict(to_params=lambda th: th["nope"]), TypeError,
     r"to_params\(theta_b\) failed on fit 0's theta: KeyError"),
    # theta0 of 4 fits where the data holds 2: named as theta0's count (it said "data
    # must lead with B=4", the B taken from theta0 unsaid)
    ({"k": jnp.ones(4)}, {}, ValueError,
     r"data must lead with the number of fits theta0's leaves lead with, B=4, got shape "
     r"\(2, 2, 1\)"),
])
def test_bad_fit_inputs_are_named(theta0, kw, error, match):
    # These used to give NaN fits silently, or JAX's words from inside vmap.
    with pytest.raises(error, match=match):
        _rates(**kw).fit(theta0, steps=2, progress=False)


@pytest.mark.parametrize("tol", ["1e-3", -1.0, jnp.ones(2)])
def test_bad_tolerances_of_a_fit_are_refused(tol):
    with pytest.raises(ValueError, match="tol must be None or a number >= 0"):
        _rates().fit({"k": jnp.ones(2)}, steps=2, tol=tol, progress=False)


def _unwritable(tmp_path):
    """A directory this process cannot write: read-only by mode, or (as root, who
    writes through modes) one on a read-only filesystem."""
    if os.geteuid() != 0:
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o500)
        return ro / "fit"
    return pathlib.Path("/sys/fs/gradsolve-test/fit")


def test_checkpoint_settings_fail_when_built_not_at_the_first_save(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(ValueError, match="a-file/fit' cannot hold checkpoints"):
        _rates(checkpoint_dir=blocker / "fit", checkpoint_every=2)
    with pytest.raises(PermissionError, match="cannot hold checkpoints"):
        _rates(checkpoint_dir=_unwritable(tmp_path), checkpoint_every=2)
    for every in (0, True, 2.5, datetime.timedelta(0)):
        with pytest.raises(ValueError, match="checkpoint_every must be None, a positive "
                                             "integer .updates. or a positive datetime"):
            _rates(checkpoint_dir=tmp_path / "fit", checkpoint_every=every)
    # No checkpoint_every: once a minute (here: only the end), and no warning.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cal = _rates(checkpoint_dir=tmp_path / "fit")
    # A NumPy scalar tolerance used to fail the JSON metadata at the first save.
    res = cal.fit({"k": jnp.ones(2)}, steps=3, tol=np.float32(1e-12), progress=False)
    assert res.updates == 3
    assert _steps_on_disk(tmp_path / "fit") == [3]


def _steps_on_disk(directory):
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())


def test_checkpoint_every_wall_time(tmp_path):
    """A timedelta saves at the first update that ends that long after the last save: a
    microsecond saves after every update (Orbax keeps the newest 3), an hour only at
    the end; the fit is the same either way."""
    often = _rates(checkpoint_dir=tmp_path / "often",
                   checkpoint_every=datetime.timedelta(microseconds=1))
    rarely = _rates(checkpoint_dir=tmp_path / "rarely",
                    checkpoint_every=datetime.timedelta(hours=1))
    a, b = (c.fit({"k": jnp.ones(2)}, steps=5, tol=None, progress=False)
            for c in (often, rarely))
    assert _steps_on_disk(tmp_path / "often") == [3, 4, 5]
    assert _steps_on_disk(tmp_path / "rarely") == [5]
    np.testing.assert_array_equal(a.history, b.history)


class _Compiles:
    """Counts XLA compilations (JAX's own monitoring event) inside a `with`."""

    def __init__(self):
        self.n = 0
        jax.monitoring.register_event_duration_secs_listener(self._listen)

    def _listen(self, event, duration, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            self.n += 1

    def __enter__(self):
        self.n = 0
        return self

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_duration_listener(self._listen)


def test_a_new_steps_value_compiles_nothing(tmp_path):
    # Every new `steps` value used to recompile the fit (~100x the fit's compute).
    # theta0 weakly typed (as `jnp.full(B, 0.85)` is): it used to compile the update a
    # second time at the second update, i.e. inside the next fit when the first ran one.
    theta0 = jnp.full(fit_worker.B, 1.0)
    assert theta0.weak_type
    cal = fit_worker.calibrator(refresh_every=None)
    cal.fit(theta0, steps=1, progress=False)
    with _Compiles() as compiles:
        res = cal.fit(theta0, steps=9, progress=False)
    assert res.updates == 9 and compiles.n == 0
    # Extending a finished fit from its checkpoint compiles nothing new either.
    ckpt = tmp_path / "fit"
    cal = fit_worker.calibrator(ckpt, checkpoint_every=5, refresh_every=None)
    cal.fit(fit_worker.THETA0, steps=5, progress=False)
    with _Compiles() as compiles:
        res = cal.fit(fit_worker.THETA0, steps=11, progress=False)
    assert res.resumed_from == 5 and res.updates == 11 and compiles.n == 0


def _calls_of_the_update(cal, interrupt_at=None):
    """`cal` counting the calls of its compiled update loop, and the count; Ctrl-C
    (simulated) in the first call that starts with a fit at `interrupt_at` updates or
    more (a call that follows a refresh: the case that used to count it twice)."""
    update, calls = cal._update, []

    def counting(state, *args, **kwargs):
        calls.append(1)
        if interrupt_at is not None and np.asarray(state.steps).max() >= interrupt_at:
            raise KeyboardInterrupt("simulated interruption")
        return update(state, *args, **kwargs)
    cal._update = counting
    return cal, calls


def test_compiled_update_loop_equals_one_update_per_call(tmp_path):
    # The updates run in one compiled loop until a refresh, a counted save or a refill
    # of a slot is due; every update is the same compiled body either way, so a fit
    # equals bit for bit the one run an update per call: 4 starts through 3 slots (the
    # fourth enters when a slot's fit reaches the cap), refreshes every 10 updates,
    # minibatches of one of each fit's two trajectories, and a resume from a checkpoint
    # saved by Ctrl-C.
    def run(max_updates, directory=None, interrupt_at=None):
        cal = fit_worker.calibrator(directory, checkpoint_every=7 if directory else None,
                                    refresh_every=10, batch_size=1)
        cal._max_updates = max_updates
        cal, calls = _calls_of_the_update(cal, interrupt_at)
        return cal.fit(fit_worker.THETA0, steps=30, slots=3, progress=False), calls
    one, calls_one = run(1)
    many, calls_many = run(MAX_UPDATES)
    assert one.updates == many.updates == len(calls_one) == 60
    assert len(calls_many) <= 12, len(calls_many)  # 60 updates, a refresh every 10
    assert_same_state(many, one)
    np.testing.assert_array_equal(many.history, one.history)
    with pytest.raises(KeyboardInterrupt):
        run(MAX_UPDATES, tmp_path / "fit", interrupt_at=12)
    resumed, _ = run(MAX_UPDATES, tmp_path / "fit")
    assert resumed.resumed_from not in (None, 0, 60)
    assert_same_state(resumed, one)
    np.testing.assert_array_equal(resumed.history, one.history)


def test_progress_bar_redraws_a_few_times_a_second(capfd):
    # 300 updates of a few ms each: the bar used to redraw at every one (a log of 300
    # '\r' lines when stderr is a file); tqdm's mininterval of 0.25 s bounds it by the
    # fit's wall time, which is well under 150 * 0.25 s here (at every update: >= 300).
    cal = fit_worker.calibrator(refresh_every=None)
    cal.fit(fit_worker.THETA0, steps=2, progress=False)  # compile outside the count
    capfd.readouterr()
    res = cal.fit(fit_worker.THETA0, steps=300, progress=True)
    redraws = capfd.readouterr().err.count("\r")
    assert res.updates == 300 and 1 <= redraws < 150, redraws  # measured 2 redraws


def test_mesh_widths_are_few_and_tight():
    # A mesh that widens on refresh lands on one of at most four widths per doubling
    # (so a fit compiles its update a few times), and pads by at most 25%.
    widths = [padded_width(c) for c in range(1, 1025)]
    assert all(w >= c for c, w in zip(range(1, 1025), widths))
    assert max(w / c for c, w in zip(range(5, 1025), widths[4:])) <= 1.25
    for lo in (4, 8, 16, 32, 64, 128, 256, 512):
        assert len({w for w in widths if lo < w <= 2 * lo}) == 4



def test_a_mesh_that_outgrows_its_width_grows_with_headroom():
    # DiffEqFlux's spiral met 6 widths in 500 updates (4, 10, 12, 14, 16, 20: one
    # compile of the update each, ~1.3 s) as its network's field grew stiffer: the
    # bucket widths followed the step counts up one padded width at a time. A
    # network's mesh that outgrows the compiled width now gets GROWTH times its steps
    # (2 widths: 4, 20 at growth 2; at growth 5, one: 20), in the mesh's columns and in
    # every bucket's width; within it, nothing moves. Other fields keep growth 1: the
    # padded steps, as before.
    from gradsolve import layout
    from gradsolve.calibrate import _slots
    from gradsolve.mesh import GROWTH, grown_width
    big = padded_width(int(GROWTH * 9))
    assert big >= 18 and grown_width(9, 0) == big  # headroom from the start
    assert grown_width(9, 0, growth=1.0) == padded_width(9) == 10
    assert grown_width(9, 14) == 14 and grown_width(17, 20) == 20  # fits: kept
    assert grown_width(9, 4) == big and grown_width(9, 4, growth=2.0) == 20
    assert grown_width(9, 4, growth=1.0) == 10
    for growth, want in ((GROWTH, big), (1.0, 10)):
        grown = layout.arrange(1, n_steps=np.array([9]), columns=big, buckets=1,
                               min_widths=(4,), growth=growth)
        assert grown.widths == (want,)  # was (10,) either way
    kept = layout.arrange(1, n_steps=np.array([17]), columns=20, buckets=1, min_widths=(20,),
                          growth=GROWTH)
    assert kept.widths == (20,)
    h = np.zeros((2, 10))
    h[:, :9] = 0.1
    fresh = types.SimpleNamespace(h=h, n_steps=np.array([9, 9]), n_rejected=np.zeros(2, int),
                                  status=np.zeros(2, np.int32))
    old = {"h": np.full((2, 4), 0.25), "n_steps": np.array([4, 4]),
           "n_rejected": np.zeros(2, int), "status": np.zeros(2, np.int32)}
    for growth, want in ((GROWTH, big), (1.0, 10)):
        new = _slots.adopt(old, fresh, np.array([True]), 2, growth)
        assert new["h"].shape == (2, want) and np.array_equal(np.asarray(new["h"])[:, :10], h)


# -- gradients the Calibrator takes ------------------------------------------------

def test_calibrator_gradient_through_transform_and_to_params_is_exact():
    # y' = -k y with fit b's two trajectories at rates c k (c = 1, 2), theta = exp(u):
    # L = sum_c (exp(-c k) - d_c)^2 and dL/du = sum_c 2 (y_c - d_c) (-c) y_c k in
    # closed form. One SGD step of rate 1 gives g = u0 - u1. The replay's gradient is
    # exact for its mesh; the mesh's own error (rtol 1e-10) bounds the difference:
    # measured 2e-10 relative, bound 1e-8.
    c = jnp.array([1.0, 2.0])
    k0, d = jnp.array([0.7, 1.6]), jnp.array([[0.3, 0.1], [0.2, 0.05]])
    prob = gs.EnsembleProblem(f_jax=lambda t, y, k: -k * y, y0=jnp.ones((4, 1)),
                              params=jnp.ones(4), t_span=(0.0, 1.0))
    cal = gs.Calibrator(prob, lambda ys, k, d: jnp.sum((ys[:, 0] - d) ** 2), data=d,
                        to_params=lambda k: k * c, transform=gs.transforms.Positive(),
                        optimizer=optax.sgd(1.0), rtol=1e-10, atol=1e-12)
    res = cal.fit(k0, steps=1, progress=False)
    g = np.log(np.asarray(k0)) - np.asarray(res.state.u)
    y = np.exp(-np.asarray(k0)[:, None] * np.asarray(c))
    exact = np.sum(2 * (y - np.asarray(d)) * (-np.asarray(c)) * y, axis=1) * np.asarray(k0)
    np.testing.assert_allclose(g, exact, rtol=1e-8)


def _mlp(key, activation):
    return eqx.nn.MLP(2, 2, 8, 2, activation=activation, key=key)


def _neural_problem(n):
    def f(t, y, p):
        return -y + 0.5 * p["mlp"](y)
    params = {"mlp": gs.Shared(_mlp(jax.random.key(0), jax.nn.softplus))}
    y0 = jnp.stack([jnp.linspace(-1.0, 1.0, n), jnp.linspace(1.0, 0.5, n)], axis=1)
    return gs.EnsembleProblem(f_jax=f, y0=y0, params=params, t_span=(0.0, 1.0),
                              name="neural")


def test_a_fit_over_a_network_refreshes_by_default():
    # The default "auto": a network trained on the mesh recorded for its initial
    # weights stops improving or diverges (docs/calibrator.md, section 4), so a fit
    # over one -- without a fit axis, or written out as B = 1 with to_params -- refreshes
    # every ceil(6.25 K / rows) updates within [5, 50] (auto_refresh_every: the cost of
    # a record against an update's); a field without a network never; explicit values
    # stay.
    from gradsolve.calibrate._policies import LEAST_SQUARES_REFRESH, auto_refresh_every
    assert [auto_refresh_every(n, b, True, False) for n, b in (
        (3, None), (256, 32), (1, None), (10000, 10), (64, 64))] == [7, 50, 7, 50, 7]
    assert auto_refresh_every(3, None, False, True) == LEAST_SQUARES_REFRESH
    assert auto_refresh_every(3, None, False, False) is None
    prob, loss = _neural_problem(3), lambda ys, mlp, d: jnp.mean((ys - d) ** 2)  # noqa: E731
    data = jnp.full((3, 2), 0.3)
    one = gs.Calibrator(prob, loss, data=data)
    assert one.one_fit and one.refresh_every == 7
    assert gs.Calibrator(prob, loss, data=data, batch_size=1).refresh_every == 19
    written_out = gs.Calibrator(prob, loss, data=data[None],
                                to_params=lambda mlp: {"mlp": gs.Shared(mlp)})
    assert not written_out.one_fit and written_out.refresh_every == 7
    assert gs.Calibrator(prob, loss, data=data, refresh_every=None).refresh_every is None
    assert gs.Calibrator(prob, loss, data=data, refresh_every=7).refresh_every == 7
    lorenz = gs.problems.lorenz(n=4)  # three numbers per trajectory: no network
    assert gs.Calibrator(lorenz, lambda ys, th, d: jnp.sum(ys), data=jnp.zeros((4, 1)),
                         to_params=lambda th: th).refresh_every is None
    # A network per trajectory (each fit's own, vmapped): 114 numbers a trajectory.
    own = prob.replace(params={"mlp": eqx.filter_vmap(lambda k: _mlp(k, jax.nn.relu))(
        jax.random.split(jax.random.key(1), 3))})
    from gradsolve.problem import network_size
    assert network_size(own.params) == network_size(prob.params) == 114
    assert gs.Calibrator(own, loss, data=data[None], to_params=lambda m: m).refresh_every == 7


@pytest.fixture(scope="module")
def spiral():
    """`helpers.small_spiral`, its data solved tightly."""
    return small_spiral(1e-10, 1e-12)


def _spiral_calibrator(spiral, **kw):
    prob, ts, data = spiral
    return gs.Calibrator(prob, lambda ys, m, d: jnp.sum((ys - d) ** 2), data=data, ts=ts,
                         rtol=1e-3, atol=1e-6, optimizer=optax.adam(0.05), **kw)


def test_replay_error_check_equals_the_recorders_error_ratio(spiral):
    # The replay's check (replay_function(check=True)) reads each step's embedded
    # error estimate from the slopes its continuous extension keeps. Reference: the
    # recorder's own trial step (its error estimate from its stages, the controller's
    # error_ratio) scanned along the same mesh. On the mesh recorded at these
    # parameters (4 steps, the last 1.18 long) every step was accepted (ratio 2e-3);
    # with the network's output 30 times larger its last step fails (ratio 188).
    # Equal to roundoff of the estimate: it is a cancelling sum of slopes, h sum w_j
    # (K_j - K_0), about 1e-6 of them at ratio 2e-3, so eps |K| / |error| ~ 1e-10
    # (measured 3e-16 on XLA's default CPU emitters, 7e-11 on the legacy ones, which
    # order the sums otherwise; bound 1e-9).
    from gradsolve import control, methods
    from gradsolve.config import make_config
    from gradsolve.replay import replay_function
    prob, ts, _ = spiral
    tsit5 = methods.get("tsit5")
    mesh = gs.record(prob, rtol=1e-3, atol=1e-6)
    check = eqx.filter_jit(replay_function(prob, make_config(prob, ts=ts, rtol=1e-3, atol=1e-6),
                                    check=True))

    def reference(mlp):
        def f(t, y, m):
            return m(y ** 3)

        def body(carry, h):
            t, y, f0 = carry
            y_new, err, f_new = tsit5.trial_step(f, t, y, f0, jnp.where(h > 0, h, 1.0), mlp)
            ratio = control.error_ratio(y, y_new, err, 1e-3, 1e-6)
            took = h > 0
            return ((t + h, jnp.where(took, y_new, y), jnp.where(took, f_new, f0)),
                    jnp.where(took, ratio, 0.0))
        y0 = prob.y0[0]
        return jax.lax.scan(body, (jnp.zeros(()), y0, f(0.0, y0, mlp)), mesh.h[0])[1].max()
    mlp = prob.params["mlp"].value
    larger = eqx.tree_at(lambda m: (m.layers[-1].weight, m.layers[-1].bias), mlp,
                         replace_fn=lambda x: 30 * x)
    for net, accepted in ((mlp, True), (larger, False)):
        _, ratio = check(mesh, {"mlp": gs.Shared(net)}, prob.y0)
        expected = float(reference(net))
        assert (expected < 1) == accepted, expected
        assert rel_err(ratio[0], expected) <= 1e-9, (float(ratio[0]), expected)


def test_a_networks_mesh_is_rerecorded_when_its_steps_fail_the_error_check(spiral,
                                                                           tmp_path):
    # refresh_tol="auto" on a network's fit (outputs from Tsit5's continuous
    # extension): the mesh is re-recorded when one of its steps, replayed at the
    # current network, errs above 2 tolerances, and the update that found it runs
    # again on the new mesh. No periodic refresh then. On DiffEqFlux's spiral,
    # refreshing every 7 updates (the default before) ended 7-500x above Diffrax's
    # own gradient from 4 seeds; this check ended at or below it
    # (`_policies.REFRESH_TOL`).
    from gradsolve.calibrate._policies import REFRESH_TOL
    prob, ts, data = spiral
    cal = _spiral_calibrator(spiral)
    assert cal.refresh_tol == REFRESH_TOL and cal.refresh_every is None
    res = cal.fit(steps=40, progress=False)
    assert res.updates == 40 and 3 <= res.refreshes < 40, res.refreshes  # measured 10
    # The mesh stays valid: the loss the fit computed at its 40th update is the loss
    # of the network it started that update from (the 39th's result) solved
    # accurately (rtol 1e-10), to within what 2 tolerances per step allow (measured
    # 1.8e-3 relative; bound 2e-2). Never refreshing, the fit computes the loss of a
    # mesh the network outgrew (measured 0.45 relative off).
    def true_loss(cal):
        net = cal.fit(steps=39, progress=False).best().theta["mlp"]
        solved = gs.solve(prob.replace(params={"mlp": gs.Shared(net)}), ts=ts, rtol=1e-10,
                          atol=1e-12).raise_for_status().ys[0]
        return float(jnp.sum((solved - data) ** 2))
    assert rel_err(res.history[39, 0], true_loss(cal)) <= 2e-2
    stale_cal = _spiral_calibrator(spiral, refresh_tol=None, refresh_every=None)
    stale = stale_cal.fit(steps=40, progress=False)
    assert stale.refreshes == 0 and rel_err(stale.history[39, 0], true_loss(stale_cal)) > 0.1
    # Results do not depend on how updates are split into calls of the compiled loop
    # (the check depends on the fit's own parameters and mesh), nor on a Ctrl-C and
    # a resume from the checkpoint it saved.
    cal._max_updates = 1
    one = cal.fit(steps=40, progress=False)
    assert_same_state(one, res)
    np.testing.assert_array_equal(one.history, res.history)
    saving = _spiral_calibrator(spiral, checkpoint_dir=tmp_path / "fit")
    compiled = saving._update
    saving, _ = _calls_of_the_update(saving, interrupt_at=20)
    with pytest.raises(KeyboardInterrupt):
        saving.fit(steps=40, progress=False)
    saving._update = compiled
    resumed = saving.fit(steps=40, progress=False)
    assert resumed.resumed_from not in (None, 0, 40)
    assert_same_state(resumed, res)
    np.testing.assert_array_equal(resumed.history, res.history)
    # Minibatches: 2 * n / batch_size (a refresh records all n rows).
    neural = _neural_problem(3)
    assert gs.Calibrator(neural, lambda ys, m, d: jnp.mean(ys), data=jnp.zeros((3, 2, 2)),
                         ts=ts[:2], batch_size=1).refresh_tol == 6.0


@pytest.mark.parametrize("activation,B", [(jax.nn.softplus, 1), (jax.nn.relu, 2)])
def test_neural_fields_fit_on_defaults(activation, B):
    # An Equinox MLP right-hand side on the non-stiff path (Tsit5): as gs.Shared with
    # one fit, and as per-fit MLPs (vmapped) with B = 2 (114 weights a trajectory
    # either way: remat off by default, config.default_remat). These crashed in
    # jax.checkpoint / dtype inference on the activation leaf (the engines' own MLP
    # tests, tanh included, are in test_neural.py). The fit must run, stay finite and
    # lower the loss; with remat on it computes the same numbers (recomputation
    # changes no arithmetic: measured equal to the last bit; bound 1e-12).
    K = 3
    prob = _neural_problem(B * K)
    data = jnp.full((B, K, 2), 0.3)
    theta0 = eqx.filter_vmap(lambda k: _mlp(k, activation))(jax.random.split(jax.random.key(1), B))
    if B == 1:
        to_params = lambda mlp: {"mlp": gs.Shared(mlp)}  # noqa: E731
    else:  # per-fit networks: each trajectory carries its fit's copy (leaves lead with n)
        to_params = lambda mlp: {"mlp": jax.tree.map(  # noqa: E731
            lambda x: jnp.broadcast_to(x, (K,) + x.shape) if eqx.is_array(x) else x, mlp)}
        prob = prob.replace(params={"mlp": eqx.filter_vmap(lambda k: _mlp(k, activation))(
            jax.random.split(jax.random.key(1), B * K))})
    loss = lambda ys, mlp, d: jnp.mean((ys - d) ** 2)  # noqa: E731
    cals = [gs.Calibrator(prob, loss, to_params=to_params, data=data,
                          optimizer=optax.adam(1e-2), remat=remat)
            for remat in ((None, True) if B == 1 else (None,))]
    assert cals[0].config.remat is False
    results = [cal.fit(theta0, steps=10, progress=False) for cal in cals]
    res = results[0]
    assert res.engine == "general_replay"
    assert np.all(np.isfinite(res.history)) and np.all(res.loss < res.history[0] * 0.9)
    for other in results[1:]:
        np.testing.assert_allclose(other.history, res.history, rtol=1e-12, atol=0)
    if B == 2:  # one update more of the same compiled fit: nothing new to compile
        _assert_first_update_is_diffrax_adam(cals[0].fit(theta0, steps=1, progress=False),
                                             prob.y0.reshape(B, K, 2), data, theta0, loss)


def _assert_first_update_is_diffrax_adam(res, y0, data, theta0, loss):
    """Each fit's first update against Diffrax (Tsit5 at rtol 1e-10, its own
    autodiff) on that fit's own network, trajectories and data: the loss at theta0, the
    gradient's norm, and Adam's first step in closed form, -lr g / (|g| + eps) for
    every weight (a weight's gradient of the wrong sign moves it 2 lr the wrong way).
    The fit's mesh is recorded at the default rtol 1e-6, and ReLU's kinks make its
    gradient accurate to O(h) there: measured, relative, loss 1.6e-5 (bound 2e-4),
    gradient norm 7.6e-3 (bound 8e-2), step 9.6e-5 of lr (bound 1e-3)."""
    import diffrax

    def ref_loss(mlp, y0, d):
        term = diffrax.ODETerm(lambda t, y, m: -y + 0.5 * m(y))
        end = jax.vmap(lambda y: diffrax.diffeqsolve(
            term, diffrax.Tsit5(), 0.0, 1.0, None, y, args=mlp,
            stepsize_controller=diffrax.PIDController(rtol=1e-10, atol=1e-12)).ys[-1])(y0)
        return loss(end, mlp, d)

    ref = eqx.filter_jit(eqx.filter_value_and_grad(ref_loss))
    arrays = lambda tree: jax.tree.leaves(eqx.filter(tree, eqx.is_inexact_array))  # noqa: E731
    for b in range(y0.shape[0]):
        fit_b = lambda tree: jax.tree.map(lambda x: x[b] if eqx.is_array(x) else x, tree)  # noqa: E731,B023
        value, g = ref(fit_b(theta0), y0[b], data[b])
        g = [np.asarray(x) for x in arrays(g)]
        norm = np.sqrt(sum(np.sum(x ** 2) for x in g))
        moved = [np.asarray(x1 - x0) for x1, x0 in zip(arrays(fit_b(res.theta)),
                                                        arrays(fit_b(theta0)))]
        step = max(np.max(np.abs(m + 1e-2 * x / (np.abs(x) + 1e-8))) for m, x in zip(moved, g))
        assert abs(res.history[0, b] - value) / value < 2e-4, b
        assert abs(res.grad_norm[b] - norm) / norm < 8e-2, b
        assert step < 1e-3 * 1e-2, b


def test_a_profile_takes_its_rows_of_a_per_trajectory_dt0():
    # A profile replays G copies of the best fit's K trajectories (here 3 x 2 > n = 4);
    # with a first step per trajectory it indexed the original n rows' dt0 with the
    # profile's rows (IndexError: index 4 is out of bounds for axis 0 with size 4). The
    # same first step given per trajectory and as one number gives the same profile,
    # bit for bit.
    B, K = 2, 2
    rates = jnp.array([0.5, 1.0])
    prob = gs.EnsembleProblem(lambda t, y, k: -k * y, y0=jnp.ones((B * K, 1)),
                              params=jnp.ones(B * K), t_span=(0.0, 1.0))
    data = jnp.exp(-jnp.array([1.0, 2.0])[:, None] * rates)[:, :, None]

    def profile(dt0):
        cal = gs.Calibrator(prob, lambda ys, th, d: jnp.sum((th["c"] * ys - d) ** 2),
                            data=data, to_params=lambda th: th["k"] * rates,
                            optimizer=optax.adam(0.1), dt0=dt0)
        res = cal.fit({"k": jnp.ones(B), "c": jnp.ones(B)}, steps=5, progress=False)
        return cal.profile(res, "k", grid=[0.8, 1.0, 1.2], steps=3, progress=False)
    per_row, scalar = profile(jnp.full(B * K, 0.01)), profile(0.01)
    np.testing.assert_array_equal(per_row.history, scalar.history)
    assert np.all(np.isfinite(per_row.loss))


@pytest.mark.exact_across_shapes
def test_lbfgs_line_search_fits_per_fit_and_resumes_bit_for_bit(tmp_path):
    # optax.lbfgs takes value, grad and value_fn in update(): each fit gets its own,
    # value_fn its loss on its rows of the same mesh. y' = -k y fitted to exp(-k t)
    # (the closed form) from k = 1.2: every fit reaches its k to the replay's
    # accuracy in a few updates (measured 6-8 updates to grad_tol 1e-10, k within
    # 1.0e-10 relative at rtol 1e-10; bound 1e-9), where Adam takes hundreds (353-400
    # here at 0.05). The same start gives the same numbers in one slot, and a fit
    # stopped at 3 updates and extended from its checkpoint equals the straight one.
    B, K = 4, 2
    ts = jnp.linspace(0.0, 2.0, 9)
    k_true = jnp.array([0.5, 1.0, 1.5, 2.0])
    prob = gs.EnsembleProblem(f_jax=lambda t, y, p: -p["k"] * y, y0=jnp.ones((B * K, 1)),
                              params={"k": jnp.ones(B * K)}, t_span=(0.0, 2.0))
    data = jnp.broadcast_to(jnp.exp(-k_true[:, None, None, None] * ts[None, None, :, None]),
                            (B, K, len(ts), 1))

    def calibrator(**kw):
        return gs.Calibrator(prob, lambda ys, th, d: jnp.sum((ys - d) ** 2),
                             to_params=lambda th: {"k": jnp.full(K, th["k"])}, data=data,
                             ts=ts, optimizer=optax.lbfgs(), rtol=1e-10, atol=1e-12, **kw)
    theta0 = {"k": jnp.full(B, 1.2)}
    cal = calibrator()
    res = cal.fit(theta0, steps=30, grad_tol=1e-10, progress=False)
    assert (np.asarray(res.status) == gs.calibrate.FitStatus.CONVERGED).all()
    assert np.asarray(res.steps).max() <= 12, res.steps
    assert rel_err(res.theta["k"], k_true) < 1e-9
    alone = cal.fit(theta0, steps=30, grad_tol=1e-10, progress=False, slots=1)
    for name in ("loss", "steps", "status", "history", "grad_norm"):
        np.testing.assert_array_equal(getattr(alone, name), getattr(res, name), name)
    np.testing.assert_array_equal(alone.theta["k"], res.theta["k"])
    ckpt = dict(checkpoint_dir=tmp_path / "fit", checkpoint_every=1)
    calibrator(**ckpt).fit(theta0, steps=3, grad_tol=1e-10, progress=False)
    resumed = calibrator(**ckpt).fit(theta0, steps=30, grad_tol=1e-10, progress=False)
    assert resumed.resumed_from == 3
    assert_same_state(resumed.state, res.state)
