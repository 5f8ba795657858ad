"""A process that writes checkpoint steps with Orbax, so that saving does not take the
fit's interpreter.

Orbax spends ~20 ms of CPU per step, nearly all of it Python (event loops, threads,
metadata, the deletion of old steps). Run on a thread of the fit's own process it holds
the GIL that the fit's loop needs between its compiled calls: on the checkpoint
benchmark's light fit (~2-5 ms per update, a save every 25 updates) the fit took 30-40 %
longer, although a second core sat idle; the fit's loop alone (the state copied to the
host at every save, Orbax not called) costs 4-5 % (measured here, docs/benchmarks.md).
This module runs Orbax in a child process instead: `Checkpoints` sends it the state's
leaves as host arrays, each with its path, and goes on; the child checksums and packs
them (`write_step`) and writes the step.

The child is this file run as a script (`python _writer.py`, not `-m`: importing the
`gradsolve` package would double its start, ~1.6 s against Orbax's ~0.8 s), started
once per process and shared by every `Checkpoints` of it. It dies with its parent: on
Linux the kernel kills it when the parent dies (`PR_SET_PDEATHSIG`), so a kill -9 of the
fit stops a write under way as it stopped one on the fit's own thread (Orbax's atomic
rename: the step is not there); elsewhere a watchdog thread exits within 50 ms. It runs
JAX on the CPU (Orbax initialises JAX's backends; a GPU's memory stays the fit's) with
x64 on, so float64 steps are written as they are.

Every request is answered, in order: `("ok", None)` or `("error", exception)`.
"""

import collections
import concurrent.futures
import contextlib
import ctypes
import hashlib
import importlib
import logging
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection

import jax
import numpy as np
import orbax.checkpoint as ocp


def _not_a_merge_notice(record) -> bool:
    # Orbax 0.12.8 tries to merge OCDBT files after every save, OCDBT or not, and warns
    # that there were none: one line per step on the user's terminal.
    return "Skipping merge of OCDBT checkpoints" not in record.getMessage()


def open_manager(directory, max_to_keep, asynchronous, cleanup):
    """The Orbax `CheckpointManager` of a checkpoint directory (here and in the child),
    keeping `max_to_keep` steps (`Checkpoints` holds it at 2 or more).

    The state is written without OCDBT: one file per packed array, not a database of
    them; its saves took ~17 % less CPU (17.5 against 21.8 ms a step, measured here).
    Steps written with OCDBT (before) restore as they are."""
    logging.getLogger("absl").addFilter(_not_a_merge_notice)
    return ocp.CheckpointManager(directory, item_handlers={
        "state": ocp.StandardCheckpointHandler(use_ocdbt=False),
        "meta": ocp.JsonCheckpointHandler()}, options=ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep, enable_async_checkpointing=asynchronous,
        cleanup_tmp_directories=cleanup, create=True))


# -- a step's leaves: `[(path, host array), ...]` in tree order (`_checkpoint.leaves`)

def digest(leaves) -> str:
    """SHA-256 over every leaf's path, dtype, shape and bytes, in order."""
    h = hashlib.sha256()
    for path, a in leaves:
        h.update(path.encode())
        h.update(str(a.dtype).encode() + str(a.shape).encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def shapes(leaves) -> dict:
    """`{leaf path: [shape, dtype]}`: what a step is restored against."""
    return {path: [list(a.shape), str(a.dtype)] for path, a in leaves}


def pack(leaves) -> dict:
    """`{dtype name: 1-D array}`: the leaves of each dtype raveled and joined in order
    (`_checkpoint.unpack` with their `shapes` undoes it)."""
    groups = {}
    for _, a in leaves:
        groups.setdefault(a.dtype.name, []).append(a.ravel())
    return {name: np.concatenate(parts) for name, parts in groups.items()}


def write_step(manager, step, leaves, meta, wait):
    """Write one step's leaves packed, with its JSON metadata and their checksum and
    shapes, through Orbax; with `wait`, return only once it is written (a failure
    raises here)."""
    meta = dict(meta, checksum=digest(leaves), shapes=shapes(leaves), layout="packed")
    args = ocp.args
    manager.save(step, args=args.Composite(
        state=args.StandardSave(pack(leaves)), meta=args.JsonSave(meta)), force=True)
    if wait:
        manager.wait_until_finished()


class WriterGone(RuntimeError):
    """The writer process ended (killed, out of memory) with requests unanswered."""


class Writer:
    """The parent's end: `request(...)` sends one request and returns a future of its
    answer. A thread of its own starts the process, settles the futures in the order
    the requests were sent and reaps the process when it ends: Linux ties
    `PR_SET_PDEATHSIG` to the thread that started the child, so a fit run on a
    short-lived thread (a thread pool's) must not start it."""

    def __init__(self):
        requests_r, requests_w = os.pipe()
        replies_r, replies_w = os.pipe()
        # The parent's import path (a script may have extended it), JAX on the CPU.
        env = dict(os.environ, JAX_PLATFORMS="cpu",
                   PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        command = [sys.executable, __file__, str(requests_r), str(replies_w),
                   str(os.getpid())]
        self._send = Connection(requests_w, readable=False)
        self._replies = Connection(replies_r, writable=False)
        self._waiting = collections.deque()
        self._lock = threading.Lock()
        self.gone = False
        started = concurrent.futures.Future()

        def run():
            try:
                self.process = subprocess.Popen(command, pass_fds=(requests_r, replies_w),
                                                stdin=subprocess.DEVNULL, env=env)
            except BaseException as err:  # noqa: BLE001 - raised in __init__
                started.set_exception(err)
                return
            finally:
                os.close(requests_r)
                os.close(replies_w)
            started.set_result(None)
            self._read()
        threading.Thread(target=run, name="gradsolve-checkpoint-writer", daemon=True).start()
        try:
            started.result()
        except BaseException:
            self._send.close()
            self._replies.close()
            raise

    def request(self, *message) -> concurrent.futures.Future:
        future = concurrent.futures.Future()
        with self._lock:
            if self.gone:
                future.set_exception(WriterGone(self.why()))
                return future
            self._waiting.append(future)
            try:
                self._send.send(message)
            except OSError:  # its end of the pipe is closed: the reader fails them all
                pass
        return future

    def _read(self):
        while True:
            try:
                kind, value = self._replies.recv()
            except (EOFError, OSError):
                break
            with self._lock:
                future = self._waiting.popleft()
            if kind == "ok":
                future.set_result(value)
            else:
                future.set_exception(value)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=1)  # its exit status, for the messages
        with self._lock:
            self.gone = True
            waiting, self._waiting = self._waiting, collections.deque()
        for future in waiting:
            future.set_exception(WriterGone(self.why()))

    def why(self):
        code = self.process.poll()
        return (f"the checkpoint writer process (pid {self.process.pid}) ended"
                + ("" if code is None else f" with exit status {code}"))


_shared = None
_shared_lock = threading.Lock()


def shared() -> Writer:
    """This process's writer, started at the first call (or again, if it ended)."""
    global _shared
    with _shared_lock:
        if _shared is None or _shared.gone:
            _shared = Writer()
        return _shared


# ------------------------------------------------------------------- the child

def _die_with(parent: int):
    """End this process when `parent` dies."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # it died before the line above
        os._exit(0)

    def watch():
        while os.getppid() == parent:
            time.sleep(0.05)
        os._exit(0)
    threading.Thread(target=watch, daemon=True).start()


def _answerable(err: BaseException) -> BaseException:
    """`err` if it survives pickling, else a RuntimeError naming its type and text."""
    try:
        pickle.loads(pickle.dumps(err))
        return err
    except Exception:  # noqa: BLE001
        return RuntimeError(f"{type(err).__name__}: {err}")


def serve(requests: Connection, replies: Connection):
    """Answer requests until the parent closes the pipe:

    - `("save", key, directory, max_to_keep, step, leaves, meta)`: write a step and
      wait for it (with the manager of `directory` kept under `key`, opened at its
      first step);
    - `("close", key)`: close that manager, if there is one;
    - `("call", path, module, name, args)`: `module.name(*args)`, `path` added to
      `sys.path` (tests install their Orbax hooks here, where Orbax runs).
    """
    managers = {}
    while True:
        try:
            kind, *message = requests.recv()
        except EOFError:
            break
        try:
            if kind == "save":
                key, directory, max_to_keep, step, leaves, meta = message
                if key not in managers:
                    managers[key] = open_manager(directory, max_to_keep,
                                                 asynchronous=False, cleanup=False)
                write_step(managers[key], step, leaves, meta, wait=True)
            elif kind == "close":
                manager = managers.pop(message[0], None)
                if manager is not None:
                    manager.close()
            elif kind == "call":
                path, module, name, args = message
                if path not in sys.path:
                    sys.path.append(path)
                getattr(importlib.import_module(module), name)(*args)
            else:
                raise ValueError(f"unknown request {kind!r}")
            replies.send(("ok", None))
        except Exception as err:  # noqa: BLE001 - every failure is the parent's to report
            replies.send(("error", _answerable(err)))
    for manager in managers.values():
        manager.close()


def _main():
    requests_fd, replies_fd, parent = (int(a) for a in sys.argv[1:4])
    _die_with(parent)
    # A Ctrl-C at the terminal reaches every process of the fit's process group; the
    # fit saves its state when interrupted, and this process writes it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    here = os.path.realpath(os.path.dirname(__file__))  # not a package's modules
    sys.path[:] = [p for p in sys.path if os.path.realpath(p or ".") != here]
    jax.config.update("jax_enable_x64", True)
    serve(Connection(requests_fd, writable=False), Connection(replies_fd, readable=False))


if __name__ == "__main__":
    _main()
