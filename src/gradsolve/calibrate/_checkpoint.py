"""Fit checkpoints with Orbax: the fit state as a pytree of arrays plus JSON
metadata carrying a SHA-256 checksum of every saved leaf.

Orbax writes each step to a temporary directory and renames it when complete, so
an interrupted save never touches the previous step. What Orbax does not catch is a
silently damaged finalised step (a flipped bit restores wrong values): the checksum
does. `restore_latest` walks back from the newest step to the first one that loads
AND verifies, warning about each one it skips.
"""

import hashlib
import pathlib
import warnings

import jax
import numpy as np


def checksum(tree) -> str:
    """SHA-256 over every leaf's dtype, shape and bytes, in tree order."""
    digest = hashlib.sha256()
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        a = np.asarray(leaf)
        digest.update(jax.tree_util.keystr(path).encode())
        digest.update(str(a.dtype).encode() + str(a.shape).encode())
        digest.update(np.ascontiguousarray(a).tobytes())
    return digest.hexdigest()


def _skip(step, why):
    warnings.warn(f"checkpoint step {step} {why}; falling back to an earlier step")
    return None


class Checkpoints:
    """Save and restore fit states in `directory` (one Orbax step per update count).

    Args:
        directory: where the steps live (created if missing).
        max_to_keep: how many steps to keep (>= 2, so there is a fallback).
    """

    def __init__(self, directory, max_to_keep=3):
        import orbax.checkpoint as ocp

        self._ocp = ocp
        self.directory = pathlib.Path(directory).absolute()
        self.manager = ocp.CheckpointManager(
            directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=max(2, int(max_to_keep)), enable_async_checkpointing=False,
                cleanup_tmp_directories=True, create=True))

    def save(self, step: int, state, meta: dict):
        meta = dict(meta, checksum=checksum(state), x64=bool(jax.config.jax_enable_x64))
        args = self._ocp.args
        self.manager.save(int(step), args=args.Composite(
            state=args.StandardSave(state), meta=args.JsonSave(meta)), force=True)
        self.manager.wait_until_finished()

    def steps(self):
        return sorted(self.manager.all_steps())

    def restore_latest(self, like, check_meta):
        """The newest step that restores and verifies, as `(step, state, meta)`, or
        None if the directory holds no step. `like` is a state of the right
        structure; `check_meta(meta)` raises on a configuration mismatch (which is
        never silently skipped)."""
        abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype), like)
        skipped = []
        for step in reversed(self.steps()):
            found = self._restore_step(step, abstract, check_meta)
            if found is not None:
                self._set_aside(skipped)
                return (step,) + found
            skipped.append(step)
        self._set_aside(skipped)
        return None

    def _set_aside(self, steps):
        """Move damaged steps out of Orbax's sight (kept for inspection), so the
        resumed fit can save those step numbers again."""
        for step in steps:
            path = self.directory / str(step)
            if path.exists():
                path.rename(self.directory / f"{step}.damaged")
        if steps:
            self.manager.reload()

    def _restore_step(self, step, abstract, check_meta):
        """`(state, meta)` of one step, or None (with a warning) if it is damaged."""
        args = self._ocp.args
        try:
            meta = self.manager.restore(step, args=args.Composite(
                meta=args.JsonRestore()))["meta"]
        except Exception as e:  # noqa: BLE001 - any damage means: try the previous
            return _skip(step, f"unreadable ({type(e).__name__}: {e})")
        if meta.get("x64") and not jax.config.jax_enable_x64:
            raise ValueError("the checkpoint holds float64 state but jax_enable_x64 is "
                             "off: enable x64 before resuming")
        check_meta(meta)
        try:
            state = self.manager.restore(step, args=args.Composite(
                state=args.StandardRestore(abstract)))["state"]
        except Exception as e:  # noqa: BLE001
            return _skip(step, f"unreadable ({type(e).__name__}: {e})")
        if checksum(state) != meta.get("checksum"):
            return _skip(step, "fails its checksum (damaged data)")
        return state, meta

    def close(self):
        self.manager.close()
