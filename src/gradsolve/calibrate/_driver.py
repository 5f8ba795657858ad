"""The fit loop: the thin driver that owns the host side of `Calibrator.fit`.

It validates the starts, builds the initial state (or resumes a checkpoint of the same
fit, `_fingerprint`), then repeats: refill the slots (`_slots.fill`), apply the
policies due before a call (`_policies.Refresh`), run one call of the compiled update
loop for as many updates as every policy allows (`_policies.updates_due`), write the
losses into the history, report progress (`_report`) and apply the policies due
after it (`_policies.Saves`). Ctrl-C saves the work of the last completed call and
says how to resume.
"""

import functools
import json
import time
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .._version import __version__
from . import _fingerprint, _policies, _report, _slots, _state, _transforms, _validate
from ._checkpoint import Checkpoints
from ._result import FitResult
from ._state import FitState, FitStatus


def run(cal, theta0, steps, tol, grad_tol, progress, key, resume, slots):
    """`Calibrator.fit` of the Calibrator `cal` (see there)."""
    theta0 = _validate.with_fit_axis(cal, theta0)
    S, K = _validate.check_fit(cal, theta0, steps)
    B = _slots.check_slots(slots, S)
    tol, grad_tol = _validate.check_tol("tol", tol), _validate.check_tol("grad_tol", grad_tol)
    steps = int(steps)
    u0 = _transforms.apply_compiled(cal.transform, theta0, "inverse")
    _validate.check_domain(cal.transform, theta0, u0)
    u, static = eqx.partition(_strong(u0), eqx.is_inexact_array)
    state = _strong(cal._initial_state(u, static, S, K, steps, key))
    store = resumed_from = saves = None
    if cal.checkpoint_dir is not None:
        meta = {"gradsolve": __version__,
                "fit": _fingerprint.of(cal, state, static, theta0, K, tol, grad_tol)}
        json.dumps(meta)  # anything JSON cannot hold fails now, not at the first save
        store = Checkpoints(cal.checkpoint_dir)
        try:
            if not resume:
                store.discard()
            else:
                found = store.restore_latest(
                    state._asdict(), functools.partial(_fingerprint.check_meta, meta["fit"],
                                                       cal.checkpoint_dir))
                if found is not None:
                    resumed_from = found[0]
                    state = _state.continued(FitState(**found[1]), steps)
        except BaseException:
            store.close()
            raise
        saves = _policies.Saves(store, cal.checkpoint_every, meta)
    refresh = _policies.Refresh(cal, static, K)
    policies = (refresh,) if saves is None else (refresh, saves)
    cap = np.asarray(steps, np.int32)
    done = int(state.update)
    queue = B < S
    bar = _report.progress_bar(progress, S if queue else steps,
                               int(np.sum(~np.asarray(state.active))) if queue else done,
                               queue)
    if resumed_from is not None:
        _report.say(bar, f"gradsolve: resumed from checkpoint step {resumed_from} in "
                    f"{cal.checkpoint_dir} ({done} updates run in all; the fits have done "
                    f"{np.asarray(state.steps).min()}..{np.asarray(state.steps).max()} "
                    f"updates each, capped at steps={steps} per fit)")
    # `settled`: the window as the last completed call left it (or as the last fill
    # made it). Ctrl-C keeps that, not a refresh made for a call that did not finish:
    # the resumed fit refreshes there again, as the uninterrupted one did (keeping the
    # refresh would count it twice).
    window = settled = pace = stale = None
    try:
        try:
            while True:
                state, window = _slots.fill(state, window, K, B, cal.problem.y0, cal.data)
                settled = window
                if window is None or not np.asarray(window.state.active).any():
                    break  # no start left to run
                window, fresh = refresh.apply(window, state.drift, stale)
                if not np.asarray(window.state.active).any():
                    continue  # every slot's refresh failed: fill them again
                n = _policies.updates_due(policies, window, done, pace, cal._max_updates,
                                          None if saves is None else saves.seconds_left())
                began = time.perf_counter()
                new, count, (at, ran, losses), stale = cal._step(
                    window, static, tol, grad_tol, cap, n, queue, fresh)
                window, count = window._replace(state=new), int(count)
                if count:  # none: the first update found a stale mesh (refreshed next)
                    pace = (time.perf_counter() - began) / count
                # A fit's history row t is its loss at its update t.
                at, ran, losses = (np.asarray(x)[:count] for x in (at, ran, losses))
                state.history[at[ran], np.broadcast_to(window.start, ran.shape)[ran]] = \
                    losses[ran]
                # Settled only with its history written: a Ctrl-C before this line
                # keeps the window as it was before the call (the resumed fit runs those
                # updates again, to the same numbers), never updates whose losses are
                # missing from the history.
                settled = window
                done += count
                _report.show(bar, state, window, queue, count)
                if saves is not None:
                    saves.apply(state, window, done)
        except (jax.errors.JaxRuntimeError, ValueError) as err:
            # Ctrl-C while a host callback runs (kernel_adjoint's Warp kernels) reaches
            # here wrapped by XLA (a JaxRuntimeError, a ValueError through Equinox's
            # jit), with the KeyboardInterrupt only in the text.
            if not ("callback" in str(err) and "KeyboardInterrupt" in str(err)):
                raise
            raise KeyboardInterrupt from err
        if window is not None:
            state = _slots.flush(state, window)
        if saves is not None and done > 0:
            saves.finish(state, done)
    except KeyboardInterrupt:
        if settled is not None:
            state = _slots.flush(state, settled)
        _report.say(bar, f"gradsolve: fit interrupted after {int(state.update)} updates; "
                    f"{_interrupted(cal, state, saves)}")
        raise
    finally:
        if bar is not None:
            bar.close()
        if store is not None:
            store.close()
    theta = _transforms.apply_compiled(cal.transform, eqx.combine(state.u, static), "forward")
    _warn_failed(state.status)
    return FitResult.from_state(state, theta, cal.engine, FitStatus,
                                resumed_from=resumed_from)


def _warn_failed(status):
    """Name the fits that stopped failed (a RuntimeWarning; `res.status_names` has
    them, where a summary such as "converged 31/32" would not say why)."""
    if jax.process_index() != 0:  # several processes: the first reports
        return
    status = np.asarray(status)
    for code, why in ((FitStatus.NONFINITE, "a non-finite loss or gradient"),
                      (FitStatus.RECORD_FAILED, "a failed recording of their mesh (the "
                       "solve hit max_steps or its step size underflowed)")):
        bad = np.flatnonzero(status == code)
        if bad.size:
            warnings.warn(f"{bad.size} of {status.size} fits stopped on {why}: fits "
                          f"{bad[:10].tolist()}{' ...' if bad.size > 10 else ''} "
                          f"(res.status_names)", RuntimeWarning, stacklevel=4)


def _interrupted(cal, state, saves) -> str:
    """After Ctrl-C: the state saved (its save waited for), and what became of it."""
    done = int(state.update)
    if done == 0:
        return "no update was done yet, nothing to save"
    if saves is None:
        return "nothing saved (no checkpoint_dir)"
    why = "see the warning above"
    try:
        saves.finish(state, done)
    except BaseException as e:  # noqa: BLE001 - a second Ctrl-C
        why = type(e).__name__
    last = saves.store.saved
    if last == done:
        return (f"saved as step {done} in {cal.checkpoint_dir}; run the same fit again to "
                f"resume (a larger steps= extends it)")
    return (f"saving it failed ({why}); the last step saved is {last}" if last is not None
            else f"saving it failed ({why}); no step is saved")


def _strong(tree):
    """`tree` with no weakly typed array (`jnp.full(B, 0.85)` is one): an update's
    outputs are strongly typed, so a weak input would compile the update (and the
    recorder, at the first refresh) twice, the second time at a fit's second update
    -- or in the next `fit`."""
    def strong(x):
        return jax.device_put(np.asarray(x)) if getattr(x, "weak_type", False) else x
    return jax.tree.map(strong, tree)
