"""What `Calibrator.fit` returns."""

import dataclasses
import json
import os
import pathlib
from typing import Any, NamedTuple

import equinox as eqx
import jax
import numpy as np


def _name(path) -> str:
    """`['rho']` -> `rho`, `[0]` -> `0`: leaf paths as column labels."""
    return jax.tree_util.keystr(path).replace("']['", ".").strip("[]'") or "theta"


def _per_fit(value, B, path) -> np.ndarray:
    """A true value of the leaf at `path`: one per fit, or one for all B."""
    value = np.asarray(value)
    if value.shape not in ((), (B,)):
        raise ValueError(f"true{jax.tree_util.keystr(path)} has shape {value.shape}: give "
                         f"one value, or one per fit ({B},)")
    return np.broadcast_to(value, (B,))


class Best(NamedTuple):
    """The fit with the lowest final loss: its index, parameters and loss."""

    index: int
    theta: Any
    loss: float


_FIELDS = ("loss", "converged", "status", "steps", "history", "grad_norm")


@dataclasses.dataclass(frozen=True)
class FitResult:
    """The outcome of B fits.

    Attributes:
        theta: fitted parameters (constrained space), leaves leading with B.
        loss: `(B,)` loss at the last evaluated parameters.
        converged: `(B,)` reached `tol` / `grad_tol`.
        status: `(B,)` `FitStatus` codes (converged, step cap, non-finite, record
            failed, running).
        steps: `(B,)` updates applied to each fit.
        history: `(steps, B)` each fit's loss at each of its updates (NaN once it stopped).
        grad_norm: `(B,)` last gradient norm.
        refreshes: how many times the mesh was re-recorded.
        drift: `{update: relative change}` from the drift checks (a fit checks at its
            own update counts; the figure is the largest among the fits checked).
        engine: the engine that computed the gradients.
        updates: updates of the slots run (with a start queue, more than any fit's steps).
        state: the final `FitState` (parameters in unconstrained space, optimizer
            state, mesh): what a checkpoint holds.
        resumed_from: the checkpoint step this fit resumed from (None: a fresh start).
    """

    theta: Any
    loss: np.ndarray
    converged: np.ndarray
    status: np.ndarray
    steps: np.ndarray
    history: np.ndarray
    grad_norm: np.ndarray
    refreshes: int
    drift: dict
    engine: str
    updates: int
    status_names: tuple = ()
    state: Any = None
    resumed_from: int | None = None

    @classmethod
    def from_state(cls, state, theta, engine, statuses, resumed_from=None):
        status = np.asarray(state.status)
        drift = np.asarray(state.drift).reshape(len(state.drift), -1)
        checked = np.isfinite(drift).any(axis=1)
        return cls(
            theta=theta, loss=np.asarray(state.loss),
            converged=status == statuses.CONVERGED, status=status,
            steps=np.asarray(state.steps), history=np.asarray(state.history),
            grad_norm=np.asarray(state.grad_norm), refreshes=int(state.refreshes),
            drift={int(i): float(np.nanmax(drift[i])) for i in np.flatnonzero(checked)},
            engine=engine, updates=int(state.update),
            status_names=tuple(statuses(int(s)).name.lower() for s in status),
            state=state, resumed_from=resumed_from)

    def best(self) -> Best:
        """The fit with the lowest finite final loss (of the starts of a multistart).

        Raises:
            ValueError: no fit has a finite loss.
        """
        loss = np.where(np.isfinite(self.loss), self.loss, np.inf)
        if not np.isfinite(loss).any():
            raise ValueError("no fit has a finite loss")
        b = int(np.argmin(loss))
        theta = jax.tree.map(lambda x: x[b] if eqx.is_array(x) or isinstance(x, np.ndarray)
                             else x, self.theta)
        return Best(b, theta, float(self.loss[b]))

    def save(self, path):
        """Write the result to `path` (an `.npz`): every fit's parameters, loss,
        history, status and steps, for `FitResult.load` later (the optimizer state and
        mesh are not kept: resuming a fit is what checkpoints are for)."""
        leaves = [(jax.tree_util.keystr(p), np.asarray(x)) for p, x in
                  jax.tree_util.tree_leaves_with_path(self.theta)
                  if eqx.is_array(x) or isinstance(x, np.ndarray)]
        meta = {"theta": [k for k, _ in leaves], "refreshes": self.refreshes,
                "drift": {str(k): v for k, v in self.drift.items()}, "engine": self.engine,
                "updates": self.updates, "status_names": list(self.status_names),
                "resumed_from": self.resumed_from}
        path = pathlib.Path(path)
        tmp = path.with_name(path.name + f".{os.getpid()}.tmp.npz")
        np.savez(tmp, meta=np.asarray(json.dumps(meta)),
                 **{f: np.asarray(getattr(self, f)) for f in _FIELDS},
                 **{f"theta{i}": x for i, (_, x) in enumerate(leaves)})
        tmp.replace(path)  # a crash mid-write leaves the previous file whole

    @classmethod
    def load(cls, path, like=None) -> "FitResult":
        """Read a result `save` wrote. `theta` takes `like`'s structure (a theta0 of
        the same fit, for instance) if given, else it is a dict by leaf path.

        Examples:
            >>> import tempfile, jax.numpy as jnp, gradsolve as gs
            >>> res = gs.FitResult(theta={"k": jnp.array([0.5, 2.0])}, loss=jnp.array([1e-9, 3.0]),
            ...                    converged=jnp.array([True, False]), status=jnp.array([1, 2]),
            ...                    steps=jnp.array([40, 100]), history=jnp.zeros((100, 2)),
            ...                    grad_norm=jnp.zeros(2), refreshes=0, drift={}, engine="e",
            ...                    updates=100)
            >>> path = tempfile.mkdtemp() + "/fit.npz"
            >>> res.save(path)
            >>> back = gs.FitResult.load(path, like={"k": jnp.ones(2)})
            >>> back.best().index, float(back.best().theta["k"])
            (0, 0.5)
        """
        with np.load(path) as f:
            meta = json.loads(str(f["meta"]))
            arrays = {k: f[k] for k in f.files}
        leaves = [arrays[f"theta{i}"] for i in range(len(meta["theta"]))]
        if like is None:
            theta = dict(zip(meta["theta"], leaves))
        else:
            dynamic, static = eqx.partition(like, lambda x: eqx.is_array(x)
                                            or isinstance(x, np.ndarray))
            paths = [jax.tree_util.keystr(p) for p, _ in
                     jax.tree_util.tree_leaves_with_path(dynamic)]
            if paths != meta["theta"]:
                raise ValueError(f"like has array leaves {paths}, the saved theta "
                                 f"{meta['theta']}")
            theta = eqx.combine(jax.tree.unflatten(jax.tree.structure(dynamic), leaves),
                                static)
        return cls(theta=theta, **{k: arrays[k] for k in _FIELDS},
                   refreshes=meta["refreshes"], engine=meta["engine"],
                   drift={int(k): v for k, v in meta["drift"].items()},
                   updates=meta["updates"], status_names=tuple(meta["status_names"]),
                   resumed_from=meta["resumed_from"])

    def table(self, true=None, names=None) -> str:
        """A recovered-vs-true table of the scalar-per-fit leaves of theta. `true`
        holds, per leaf, one value per fit or one value for all of them (a multistart's
        truth)."""
        leaves = jax.tree_util.tree_leaves_with_path(self.theta)
        rows = [(_name(p), np.asarray(v)) for p, v in leaves if np.ndim(v) == 1]
        truth = {}
        if true is not None:
            shown = {name for name, _ in rows}
            truth = {_name(p): _per_fit(v, len(self.loss), p)
                     for p, v in jax.tree_util.tree_leaves_with_path(true)
                     if _name(p) in shown}
        head = f"{'fit':>4} " + " ".join(
            f"{name:>12} {'true':>12} {'rel err':>9}" if name in truth else f"{name:>12}"
            for name, _ in rows) + f" {'loss':>10} {'steps':>6}  status"
        lines = [head]
        for b in range(len(self.loss)):
            cells = []
            for name, v in rows:
                if name in truth:
                    t = truth[name][b]
                    cells.append(f"{v[b]:12.6g} {t:12.6g} {abs(v[b] - t) / abs(t):9.2e}")
                else:
                    cells.append(f"{v[b]:12.6g}")
            lines.append(f"{b:>4} " + " ".join(cells) +
                         f" {self.loss[b]:10.3g} {self.steps[b]:6d}  {self.status_names[b]}")
        return "\n".join(lines)

    def plot(self, true=None, path=None, kind="history", name=None):
        """Loss histories and (with `true`) recovered vs true parameters; with
        `kind="waterfall"` the final losses sorted (a multistart's waterfall: a flat
        run of starts at the lowest loss is an optimum found repeatedly); with
        `kind="profile"` the loss against theta[`name`] (what `Calibrator.profile`
        returns). Saves to `path` if given and returns the matplotlib figure."""
        if kind not in ("history", "waterfall", "profile"):
            raise ValueError(f"kind must be 'history', 'waterfall' or 'profile', got {kind!r}")
        import matplotlib  # optional (the `plot` extra): imported when a plot is asked for
        if path is not None:
            matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # after use("Agg"), which must come first
        if kind == "profile":
            values = {_name(p): np.asarray(x)
                      for p, x in jax.tree_util.tree_leaves_with_path(self.theta)}
            if name not in values:
                raise ValueError(f"kind='profile' needs name= one of {sorted(values)}")
            x, loss = values[name], np.asarray(self.loss, float)
            order = np.argsort(x)
            fig, ax = plt.subplots(figsize=(5.5, 4))
            ax.plot(x[order], loss[order], "o-", ms=4)
            ax.set_xlabel(name)
            ax.set_ylabel("loss, others re-optimised")
            ax.set_title(f"profile of {name} ({self.engine})")
            fig.tight_layout()
            if path is not None:
                fig.savefig(path, dpi=120)
            return fig
        if kind == "waterfall":
            loss = np.asarray(self.loss, float)
            order = np.argsort(np.where(np.isfinite(loss), loss, np.inf))
            fig, ax = plt.subplots(figsize=(5.5, 4))
            ax.plot(np.arange(1, len(loss) + 1), loss[order], "o-", ms=4)
            done = np.asarray(self.converged)[order]
            ax.plot(np.flatnonzero(done) + 1, loss[order][done], "o", ms=4, label="converged")
            finite = loss[np.isfinite(loss)]
            if finite.size and (finite > 0).all():
                ax.set_yscale("log")
            ax.set_xlabel("start, sorted by final loss")
            ax.set_ylabel("final loss")
            ax.set_title(f"{len(loss)} starts ({self.engine})")
            ax.legend()
            fig.tight_layout()
            if path is not None:
                fig.savefig(path, dpi=120)
            return fig
        ncols = 2 if true is not None else 1
        fig, axes = plt.subplots(1, ncols, figsize=(5.5 * ncols, 4), squeeze=False)
        ax = axes[0, 0]
        ax.semilogy(np.abs(self.history))
        ax.set_xlabel("update")
        ax.set_ylabel("loss")
        ax.set_title(f"{len(self.loss)} fits ({self.engine})")
        if true is not None:
            ax = axes[0, 1]
            for (p, est), (q, t) in zip(jax.tree_util.tree_leaves_with_path(self.theta),
                                        jax.tree_util.tree_leaves_with_path(true)):
                if np.ndim(est) == 1:
                    ax.plot(_per_fit(t, len(self.loss), q), np.asarray(est), "o",
                            label=_name(p))
            lo, hi = ax.get_xlim()
            ax.plot([lo, hi], [lo, hi], "k--", lw=0.8)
            ax.set_xlabel("true")
            ax.set_ylabel("recovered")
            ax.legend()
        fig.tight_layout()
        if path is not None:
            fig.savefig(path, dpi=120)
        return fig
