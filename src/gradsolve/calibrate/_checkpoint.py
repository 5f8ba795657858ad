"""Fit checkpoints with Orbax: the fit state as a pytree of arrays plus JSON
metadata carrying the fit's fingerprint, every leaf's shape and dtype, and a SHA-256
checksum of every saved leaf.

What a checkpoint directory guarantees:

- **Atomic steps.** Orbax writes each step to a temporary directory and renames it
  when complete, so an interrupted save (Ctrl-C, kill -9, a full disk) never touches
  the previous step.
- **Asynchronous saves.** A save copies the state's leaves to the host and hands them
  to a writer process (`_writer`), which checksums, packs and writes them with Orbax
  while the fit goes on; the next save (or the fit's end) waits for it first: one save
  under way at a time. Orbax's ~20 ms of CPU per step is nearly all Python: run on a
  thread of the fit's process (as before) it held the GIL the fit's loop needs between
  its compiled calls, so the light checkpoint benchmark fit (~2.2 ms per update, a save
  every 25 updates) took 36 % longer with saves than without; with the writer process,
  17 % (measured here on 2 cores, where the writer's CPU still competes with the fit's
  XLA threads). What a save costs the fit's own process, profiled on that fit: 7 ms a
  save when it also checksummed and packed the state and wrote the window back to the
  device first, 2.9 ms with both left to the writer and the host. The writer dies with
  the fit (kill -9 stops a write under way, as before) and ignores the terminal's
  Ctrl-C, so an interrupted fit's last save is written. A job of several processes
  (`gs.distributed`) saves with Orbax's own asynchronous mode: its saves synchronise
  the processes, which belongs on each process's main thread.
- **A failed save is not fatal.** A save that fails (a full disk, a writer process
  that died; a background save's error surfaces when it is waited for) is reported by
  a warning naming the step and the last step saved; the fit's state stays in memory
  and the next save writes it (a dead writer is replaced).
- **Checksums.** A finalised step whose data were damaged afterwards (Orbax restores a
  flipped bit silently) fails its checksum; only such a step -- unreadable, or failing
  its checksum -- is set aside (renamed `<step>.damaged`), and the previous one is used.
- **Stored shapes.** A step is restored with the shapes it was saved with (a mesh
  widened by a refresh, a longer history), never against the shapes of a new start.
- **Packed leaves.** A step stores one flat array per dtype (the state's leaves in
  tree order, `_writer.pack`), its metadata the leaves' shapes: Orbax's work per save
  grows with the number of arrays (~0.5 ms each), and a fit state has dozens. On the
  checkpoint benchmark's light fit (35 leaves, 49 kB) a save took 41 ms of CPU with
  one array per leaf and 24 ms packed. Steps written one array per leaf (before this
  layout) still restore.
- **Fingerprint.** The metadata say what defines the fit (see `Calibrator.fit`); a
  checkpoint of another setup is refused naming what changed, never mixed in and
  never set aside.
- **One writer.** A lock file holds the writer's pid and host while a fit runs; a
  second live writer is refused with both named. The lock is an advisory `flock`, so
  the kernel releases it when its process dies: a dead writer's lock is taken over.
"""

import contextlib
import datetime
import errno
import json
import os
import pathlib
import socket
import time
import warnings

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from gradsolve.calibrate import _writer


LOCK_NAME = "gradsolve.lock"

# How often a fit with a checkpoint_dir and no checkpoint_every saves: a crash loses at
# most this much of its work, and at Orbax's ~20 ms of CPU per save (measured here,
# orbax-checkpoint 0.12.8) the saves cost well under 1 % of the fit.
DEFAULT_INTERVAL = datetime.timedelta(minutes=1)


class Schedule:
    """When a fit saves: every `n` updates (`every` an int) or, `every` a
    `datetime.timedelta`, at the first update that ends at least that long after the
    last save (or the fit's start).

    Orbax spends ~20 ms of CPU per save (measured here, the state packed into one
    array per dtype) in the writer process, which shares the cores with the fit:
    saving every 25 updates of a fit that takes ~2-4 ms per update costs a sizeable
    part of its time on 2 cores (docs/benchmarks.md), while a time interval bounds both
    the work a crash loses and what the saves cost (see docs/calibrator.md)."""

    def __init__(self, every):
        self.every = DEFAULT_INTERVAL if every is None else every
        self.last = time.monotonic()

    def due(self, done: int) -> bool:
        if isinstance(self.every, datetime.timedelta):
            return time.monotonic() - self.last >= self.every.total_seconds()
        return done % self.every == 0

    def saved(self):
        self.last = time.monotonic()

    def seconds_left(self) -> float | None:
        """Wall time until a save on a time interval is due (None: counted saves)."""
        if isinstance(self.every, datetime.timedelta):
            return self.every.total_seconds() - (time.monotonic() - self.last)
        return None


def check_every(every):
    """`checkpoint_every` checked: None, a positive int or a positive timedelta."""
    if every is None or (isinstance(every, int) and not isinstance(every, bool)
                         and every >= 1):
        return every
    if isinstance(every, datetime.timedelta) and every.total_seconds() > 0:
        return every
    raise ValueError(f"checkpoint_every must be None, a positive integer (updates) or a "
                     f"positive datetime.timedelta (wall time), got {every!r}")


class CheckpointLocked(RuntimeError):
    """Another live process is writing to the same checkpoint directory."""


class CheckpointMismatch(ValueError):
    """The checkpoint directory holds a fit with another setup."""


def leaves(tree, copy=False) -> list:
    """`[(path, host array), ...]`: `tree`'s leaves in order, each with its key path,
    as the writer (`_writer.digest`, `shapes`, `pack`) takes a step."""
    return [(jax.tree_util.keystr(p), np.array(x, copy=True) if copy else np.asarray(x))
            for p, x in jax.tree_util.tree_leaves_with_path(tree)]


def checksum(tree) -> str:
    """SHA-256 over every leaf's path, dtype, shape and bytes, in tree order."""
    return _writer.digest(leaves(tree))


def packed_like(stored: dict) -> dict:
    """Empty host arrays shaped as `_writer.pack` stores leaves whose `_writer.shapes`
    are `stored`."""
    sizes = {}
    for shape, dtype in stored.values():
        sizes[dtype] = sizes.get(dtype, 0) + int(np.prod(shape, dtype=np.int64))
    return {name: np.empty(size, np.dtype(name)) for name, size in sizes.items()}


def unpack(packed: dict, like, stored: dict):
    """`like`'s structure filled from `_writer.pack`'s arrays, each leaf with its `stored`
    shape (`_writer.shapes`' entry under the leaf's path)."""
    offsets = dict.fromkeys(packed, 0)
    out = []
    for path, _ in jax.tree_util.tree_leaves_with_path(like):
        shape, dtype = stored[jax.tree_util.keystr(path)]
        size, start = int(np.prod(shape, dtype=np.int64)), offsets[dtype]
        out.append(np.asarray(packed[dtype][start:start + size]).reshape(shape))
        offsets[dtype] = start + size
    return jax.tree.unflatten(jax.tree.structure(like), out)


def check_directory(directory) -> pathlib.Path:
    """`directory` made absolute (relative to the current directory, `~` expanded),
    created if missing and probed for writing: a path that cannot hold checkpoints
    fails here, when the Calibrator is built, not at the first save."""
    if not isinstance(directory, (str, os.PathLike)):
        raise TypeError(f"checkpoint_dir must be a path (str or os.PathLike), got "
                        f"{type(directory).__name__}")
    path = pathlib.Path(directory).expanduser().absolute()
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        kind = PermissionError if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS) \
            else ValueError
        raise kind(f"checkpoint_dir {str(path)!r} cannot hold checkpoints: "
                   f"{type(e).__name__}: {e.strerror or e}") from e
    return path


class _Lock:
    """An exclusive `flock` on `<directory>/gradsolve.lock`, naming its owner."""

    def __init__(self, directory: pathlib.Path):
        import fcntl  # POSIX only: imported where a lock is taken

        self.path = directory / LOCK_NAME
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(self._fd)
            self._fd = None
            raise CheckpointLocked(
                f"checkpoint_dir {str(directory)!r} is in use by another fit "
                f"({_owner(self.path)}); one writer per directory: wait for it, stop it, "
                f"or give this fit another checkpoint_dir") from None
        owner = {"pid": os.getpid(), "host": socket.gethostname(),
                 "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        os.ftruncate(self._fd, 0)
        os.write(self._fd, json.dumps(owner).encode())
        os.fsync(self._fd)

    def release(self):
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None


class _NoLock:
    """What a process other than the first holds: its job's first process has the lock."""

    def release(self):
        pass


def _owner(path) -> str:
    try:
        owner = json.loads(pathlib.Path(path).read_text() or "{}")
        return f"pid {owner['pid']} on host {owner['host']}, since {owner['since']}"
    except (OSError, ValueError, KeyError):
        return "owner unknown"


def _skip(step, why):
    warnings.warn(f"checkpoint step {step} {why}; falling back to an earlier step",
                  stacklevel=3)
    return None


class Checkpoints:
    """Save and restore fit states in `directory` (one Orbax step per update count),
    holding the directory's lock from construction to `close()`.

    Args:
        directory: where the steps live (made absolute; created if missing).
        max_to_keep: how many steps to keep (>= 2, so there is a fallback).
        asynchronous: write each step in the writer process (`_writer`; in a job of
            several processes, Orbax's asynchronous checkpointing) while the caller
            goes on; False writes in the caller and waits for every save.

    Attributes:
        saved: the newest step known to be complete on disk (written by this object,
            or restored by `restore_latest`); None if there is none.

    Raises:
        CheckpointLocked: another live process holds the directory.
    """

    def __init__(self, directory, max_to_keep=3, asynchronous=True):
        self.directory = check_directory(directory)
        self.asynchronous = bool(asynchronous)
        self.max_to_keep = max(2, int(max_to_keep))
        self.saved = self._writing = self._pending = None
        # One process: a writer process writes the steps (see `_writer`), started now
        # so that its start overlaps the fit's compilation; several (gs.distributed):
        # Orbax's asynchronous mode on each process's main thread (their saves
        # synchronise the processes).
        self._writer = (_writer.shared() if self.asynchronous and jax.process_count() == 1
                        else None)
        self._opened = None  # the writer that was sent this directory's steps
        self._replaced = False  # a writer that died was replaced
        # Several processes of one job (gs.distributed) write one checkpoint together
        # (Orbax's multi-process saves): the first holds the lock for all of them.
        self._lock = _Lock(self.directory) if jax.process_index() == 0 else _NoLock()
        try:
            self.manager = _writer.open_manager(
                self.directory, self.max_to_keep, cleanup=True,
                asynchronous=self.asynchronous and self._writer is None)
        except BaseException:
            self._lock.release()
            raise

    def save(self, step: int, state, meta: dict) -> bool:
        """Start writing `state` as `step` and return once it is copied (asynchronous)
        or written. The save under way, if any, is finished first (see `wait`).

        Returns False, with a warning naming the step and the last step saved, when
        this save or the one before it failed; the caller keeps its state and the next
        save writes it again."""
        ok = self.wait()
        step = int(step)
        # Host copies: the caller goes on while the step is written and updates some
        # leaves in place (the loss history). The writer process checksums and packs
        # them (a few ms of this process's time per save, measured here).
        state = leaves(state, copy=True)
        meta = dict(meta, x64=bool(jax.config.jax_enable_x64))
        if self._writer is not None and self._writer.gone:
            self._replace_writer()
        if self._writer is not None:
            self._pending = self._writer.request("save", id(self), str(self.directory),
                                                 self.max_to_keep, step, state, meta)
            self._opened = self._writer
            self._writing = step
            return ok
        try:
            _writer.write_step(self.manager, step, state, meta, wait=False)
        except Exception as e:  # noqa: BLE001 - a full disk, any I/O error: the fit goes on
            return self._failed(step, e)
        self._writing = step
        if not self.asynchronous:
            ok = self.wait() and ok
        return ok

    def _replace_writer(self):
        """The writer process died (its save's failure was reported): start another,
        once; if that one dies too (it cannot start here, say), write the steps in this
        process from now on, each save holding the fit until it is written."""
        if not self._replaced:
            self._writer, self._replaced = _writer.shared(), True
            return
        warnings.warn(f"the checkpoint writer process ended twice ({self._writer.why()}); "
                      f"the steps of this fit in {self.directory} are written by the "
                      f"fit's own process from now on, each save holding the fit until "
                      f"it is written", stacklevel=4)
        self._writer = None
        self.manager.reload()  # the steps the writer process wrote

    def wait(self) -> bool:
        """Wait for the save under way, if any; False (with a warning) if it failed.

        A background save's error surfaces only here (Orbax raises it when the save
        is waited for)."""
        step = self._writing
        if step is None:
            return True
        try:
            if self._pending is not None:
                self._pending.result()
            else:
                self.manager.wait_until_finished()
        except Exception as e:  # noqa: BLE001 - see `save`
            self._writing = self._pending = None
            return self._failed(step, e)
        # Cleared only once the wait is over: a Ctrl-C inside the wait leaves the step
        # under way, to be waited for again.
        self._writing, self._pending, self.saved = None, None, step
        return True

    def _failed(self, step, err) -> bool:
        """Report a failed save. Its partial directory is left to Orbax, which removes
        it at the next start: when one of a save's writes fails, Orbax raises without
        waiting for the others, which still write there (removing it at the next save
        raced them and, under load, they made it again)."""
        last = (f"the last step saved is {self.saved}" if self.saved is not None
                else "no step is saved yet")
        warnings.warn(f"checkpoint step {step} could not be saved in {self.directory} "
                      f"({type(err).__name__}: {err}); {last}. The fit's state is kept in "
                      f"memory: the next save writes it again, and the result returned "
                      f"holds every update", stacklevel=3)
        return False

    def steps(self):
        self.manager.reload()  # the writer process's steps too
        return sorted(self.manager.all_steps())

    def discard(self):
        """Delete every step (a fit started over with `resume=False`)."""
        self.wait()
        for step in self.steps():
            self.manager.delete(step)
        self.manager.reload()
        self.saved = None

    def restore_latest(self, like, check_meta):
        """The newest step that restores and verifies, as `(step, state, meta)`, or
        None if the directory holds no step.

        `like` gives the structure (the shapes come from the step's metadata);
        `check_meta(meta)` raises on a setup mismatch, which is never skipped. Only
        steps that are unreadable or fail their checksum are set aside."""
        skipped = []
        try:
            for step in reversed(self.steps()):
                found = self._restore_step(step, like, check_meta)
                if found is not None:
                    self.saved = step
                    return (step,) + found
                skipped.append(step)
            return None
        finally:
            self._set_aside(skipped)

    def _set_aside(self, steps):
        """Move damaged steps out of Orbax's sight (kept for inspection under a name
        not used before), so the resumed fit can save those step numbers again (the
        first process moves them; every process then reloads)."""
        for step in steps if jax.process_index() == 0 else ():
            path = self.directory / str(step)
            if not path.exists():
                continue
            target, k = self.directory / f"{step}.damaged", 0
            while target.exists():
                k += 1
                target = self.directory / f"{step}.damaged.{k}"
            path.rename(target)
        if steps:
            if jax.process_count() > 1:
                multihost_utils.sync_global_devices("gradsolve: damaged steps set aside")
            self.manager.reload()

    def _abstract(self, like, meta):
        """`like`'s structure with the step's stored shapes and dtypes; None when the
        stored leaves do not match that structure."""
        stored = meta.get("shapes")
        paths = jax.tree_util.tree_leaves_with_path(like)
        if not isinstance(stored, dict) or set(stored) != {
                jax.tree_util.keystr(p) for p, _ in paths}:
            return None
        # NumPy targets: Orbax then restores to host arrays without compiling a copy
        # per shape (its device path jits one per leaf shape).
        if meta.get("layout") == "packed":
            return packed_like(stored)
        leaves = [np.empty(tuple(stored[jax.tree_util.keystr(p)][0]),
                           np.dtype(stored[jax.tree_util.keystr(p)][1])) for p, _ in paths]
        return jax.tree.unflatten(jax.tree.structure(like), leaves)

    def _restore_step(self, step, like, check_meta):
        """`(state, meta)` of one step, or None (with a warning) if it is damaged."""
        args = ocp.args
        try:
            meta = self.manager.restore(step, args=args.Composite(
                meta=args.JsonRestore()))["meta"]
        except Exception as e:  # noqa: BLE001 - any damage means: try the previous
            return _skip(step, f"is unreadable ({type(e).__name__}: {e})")
        if not isinstance(meta, dict):
            return _skip(step, "has unreadable metadata")
        if meta.get("x64") and not jax.config.jax_enable_x64:
            raise ValueError("the checkpoint holds float64 state but jax_enable_x64 is "
                             "off: enable x64 before resuming")
        check_meta(meta)
        abstract = self._abstract(like, meta)
        if abstract is None:
            return _skip(step, "holds arrays that do not match its own metadata")
        try:
            state = self.manager.restore(step, args=args.Composite(
                state=args.StandardRestore(abstract)))["state"]
            if meta.get("layout") == "packed":
                state = unpack(state, like, meta["shapes"])
        except Exception as e:  # noqa: BLE001
            return _skip(step, f"is unreadable ({type(e).__name__}: {e})")
        if checksum(state) != meta.get("checksum"):
            return _skip(step, "fails its checksum (damaged data)")
        return state, meta

    def close(self):
        """Finish the save under way (its failure is warned about), then let go of the
        directory."""
        try:
            self.wait()
        finally:
            if self._opened is not None:
                with contextlib.suppress(Exception):
                    self._opened.request("close", id(self)).result()
                self._opened = None
            with contextlib.suppress(Exception):
                self.manager.close()
            self._lock.release()
