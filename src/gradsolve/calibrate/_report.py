"""Progress of a fit: a tqdm bar (redrawn a few times a second at most) and
messages, from the first process only."""

import sys

import jax
import numpy as np
from tqdm.auto import tqdm

from ._state import FitStatus


def show(bar, state, window, queue, count):
    """The bar after an update: the slots' loss range and, over all starts, how many
    converged; with a queue it counts the starts that have stopped."""
    if bar is None:
        return
    status, active = np.asarray(state.status).copy(), np.asarray(state.active).copy()
    status[window.start] = np.asarray(window.state.status)
    active[window.start] = np.asarray(window.state.active)
    loss = np.asarray(window.state.loss)
    finite = loss[np.isfinite(loss)]
    # The text is set without drawing; `update` draws, at most every `mininterval`
    # (a bar that redrew at every update filled a log with one line per update).
    bar.set_postfix_str(f"loss {finite.min():.3g}..{finite.max():.3g}" if finite.size
                        else "loss n/a", refresh=False)
    bar.set_description(f"converged {int(np.sum(status == FitStatus.CONVERGED))}/"
                        f"{status.size}", refresh=False)
    bar.update(int(np.sum(~active)) - bar.n if queue else count)


def say(bar, message):
    if jax.process_index() != 0:  # several processes: the first reports
        return
    if bar is not None:
        bar.write(message, file=sys.stderr)
    else:
        print(message, file=sys.stderr)


def progress_bar(enabled, total, initial, queue=False):
    if not enabled or jax.process_index() != 0:  # several processes: the first reports
        return None
    return tqdm(total=total, initial=initial, unit="start" if queue else "update",
                dynamic_ncols=True, mininterval=0.25)
