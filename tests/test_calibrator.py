"""The Calibrator: B independent fits, convergence and freezing, isolation of
non-finite fits, checkpoints that resume bit for bit and survive damage."""

import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import gradsolve as gs

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "recipes"))
import lorenz_rho  # noqa: E402


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


def test_frozen_fits_do_not_move(lorenz):
    # A fit that converges stops: its parameters and optimizer state stay as they
    # were at the update it converged, bit for bit, while others keep going.
    res = calibrator(lorenz).fit(THETA0, steps=30, tol=2e-4, progress=False)
    first = np.asarray(res.steps)
    assert res.converged.any() and not res.converged.all()
    longer = calibrator(lorenz).fit(THETA0, steps=60, tol=2e-4, progress=False)
    frozen = np.flatnonzero(res.converged)
    assert np.any(np.asarray(longer.steps)[~res.converged] > 30)  # the others went on
    np.testing.assert_array_equal(np.asarray(longer.steps)[frozen], first[frozen])
    np.testing.assert_array_equal(np.asarray(longer.theta["rho"])[frozen],
                                  np.asarray(res.theta["rho"])[frozen])
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a)[frozen],
                                                            np.asarray(b)[frozen]),
                 longer.state.opt_state, res.state.opt_state)


def test_one_poisoned_fit_does_not_disturb_the_others(lorenz):
    prob, to_params, loss, data = lorenz
    bad = data.at[3].set(jnp.nan)
    clean = calibrator(lorenz).fit(THETA0, steps=40, progress=False)
    cal = gs.Calibrator(prob, loss, to_params=to_params, data=bad, optimizer=optax.adam(0.3))
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
    res = cal.fit(theta0, steps=5, progress=False)
    assert res.status_names[5] == "record_failed" and res.steps[5] == 0
    assert np.all(np.asarray(res.steps)[np.arange(B) != 5] == 5)


def _interrupting(cal, after):
    update = cal._update
    calls = {"n": 0}

    def wrapped(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] > after:
            raise KeyboardInterrupt("simulated interruption")
        return update(*args, **kwargs)
    cal._update = wrapped
    return cal


def _assert_same_state(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_resume_is_bit_identical(lorenz, tmp_path):
    kw = dict(refresh_every=15)
    straight = calibrator(lorenz, **kw).fit(THETA0, steps=50, progress=False)
    ckpt = tmp_path / "fit"
    cal = _interrupting(calibrator(lorenz, checkpoint_dir=ckpt, checkpoint_every=10, **kw), 27)
    with pytest.raises(KeyboardInterrupt):
        cal.fit(THETA0, steps=50, progress=False)
    resumed = calibrator(lorenz, checkpoint_dir=ckpt, checkpoint_every=10, **kw).fit(
        THETA0, steps=50, progress=False)
    _assert_same_state(resumed.state, straight.state)
    assert resumed.refreshes == straight.refreshes


def _steps(ckpt):
    return sorted(int(p.name) for p in pathlib.Path(ckpt).iterdir() if p.name.isdigit())


def _flip_a_byte(step_dir):
    files = [p for p in step_dir.rglob("*") if p.is_file() and "meta" not in str(p)]
    target = max(files, key=lambda p: p.stat().st_size)
    raw = bytearray(target.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    target.write_bytes(bytes(raw))


def test_damaged_latest_checkpoint_falls_back(lorenz, tmp_path):
    ckpt = tmp_path / "fit"
    straight = calibrator(lorenz).fit(THETA0, steps=40, progress=False)
    cal = _interrupting(calibrator(lorenz, checkpoint_dir=ckpt, checkpoint_every=10), 31)
    with pytest.raises(KeyboardInterrupt):
        cal.fit(THETA0, steps=40, progress=False)
    # The interruption saved step 31 after 10, 20, 30: flip one byte in the largest
    # data file of that newest step.
    assert _steps(ckpt) == [20, 30, 31]
    _flip_a_byte(ckpt / "31")
    with pytest.warns(UserWarning, match="step 31"):
        resumed = calibrator(lorenz, checkpoint_dir=ckpt, checkpoint_every=10).fit(
            THETA0, steps=40, progress=False)
    _assert_same_state(resumed.state, straight.state)


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


@pytest.mark.parametrize("kw,match", [
    (dict(optimizer="adam"), "optax.GradientTransformation"),
    (dict(refresh_every=0), "refresh_every must be None or a positive integer"),
    (dict(checkpoint_every=5), "checkpoint_every needs checkpoint_dir"),
    (dict(drift_every=5), "drift_every and drift_tol go together"),
    (dict(recorder="warp"), "recorder must be None, 'general' or 'fused'"),
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


def test_float64_checkpoint_is_refused_without_x64(tmp_path):
    # Orbax would silently cast float64 state to float32 in a process without x64;
    # the metadata records x64 and resuming there is a clear error instead.
    import subprocess
    import sys
    script = tmp_path / "fit.py"
    script.write_text(_DECAY_FIT)
    ckpt = str(tmp_path / "ckpt")
    run = lambda mode: subprocess.run([sys.executable, str(script), ckpt, mode],
                                      capture_output=True, text=True, timeout=300)
    first = run("x64")
    assert first.returncode == 0 and "REFUSED" not in first.stdout, first.stderr
    second = run("x32")
    assert "REFUSED: the checkpoint holds float64 state but jax_enable_x64 is off" in \
        second.stdout, second.stdout + second.stderr
