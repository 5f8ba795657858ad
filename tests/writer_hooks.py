"""Hooks the checkpoint tests install in the checkpoint writer process
(`gradsolve.calibrate._writer`), where Orbax writes the steps: `install` patches
Orbax's writer of a step's JSON metadata (or its commit) to run a hook first for chosen
steps. Imported there by `fit_worker.in_writer`; it imports only Orbax.
"""

import asyncio
import errno
import os
import pathlib
import signal
import time

from orbax.checkpoint._src.handlers import json_checkpoint_handler as jh
from orbax.checkpoint._src.path import atomicity

_ORIGINAL = {"write": jh.JsonCheckpointHandler._save_fn,
             "commit": atomicity.AtomicRenameTemporaryPath.finalize}


def step_of(path):
    """The step a path inside a checkpoint directory belongs to (`<step>` or Orbax's
    temporary `<step>.orbax-checkpoint-tmp...`; the innermost such part), or None."""
    for part in reversed(pathlib.Path(path).parts):
        head = part.split(".orbax-checkpoint-tmp")[0]
        if head.isdigit():
            return int(head)
    return None


def no_space():
    """A save failing as on a full disk."""
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def wait_for(path, timeout=60):
    """Hold the write until the fit's process has made the file `path`."""
    end = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > end:
            raise TimeoutError(f"{path} did not appear while the step was written")
        time.sleep(0.005)


def kill_the_fit(pause=0.0):
    """SIGKILL the fit's process (this one's parent) after `pause` seconds (the step's
    other writes under way too), then wait for the kernel to end this one with it
    (`_writer`'s `PR_SET_PDEATHSIG`), so nothing more of the step is written."""
    time.sleep(pause)
    os.kill(os.getppid(), signal.SIGKILL)
    time.sleep(60)


def install(steps, where, hook, args=()):
    """Run `hook(*args)` (a function of this module, by name) at `where` of each step
    in `steps`: "write", before the step's JSON metadata is written (its other
    writes under way, its temporary directory there); "commit", with every file
    written, before Orbax renames the temporary directory."""
    steps, run = set(steps), lambda: globals()[hook](*args)
    if where == "write":
        async def hooked(self, x, directory):
            if step_of(directory) in steps:
                await asyncio.to_thread(run)
            return await _ORIGINAL["write"](self, x, directory)
        jh.JsonCheckpointHandler._save_fn = hooked
    elif where == "commit":
        async def hooked(self, *a, **kw):
            if step_of(self.get_final()) in steps:
                run()
            return await _ORIGINAL["commit"](self, *a, **kw)
        atomicity.AtomicRenameTemporaryPath.finalize = hooked
    else:
        raise ValueError(f"where must be write or commit, got {where!r}")


def uninstall():
    jh.JsonCheckpointHandler._save_fn = _ORIGINAL["write"]
    atomicity.AtomicRenameTemporaryPath.finalize = _ORIGINAL["commit"]


def exit_writer():
    """End the writer process as the kernel's OOM killer would, mid-write."""
    os._exit(9)
