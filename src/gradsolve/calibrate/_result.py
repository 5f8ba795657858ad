"""What `Calibrator.fit` returns."""

import dataclasses
from typing import Any

import jax
import numpy as np


def _name(path) -> str:
    """`['rho']` -> `rho`, `[0]` -> `0`: leaf paths as column labels."""
    return jax.tree_util.keystr(path).replace("']['", ".").strip("[]'") or "theta"


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
        history: `(steps, B)` loss at every update (NaN where the loop had stopped).
        grad_norm: `(B,)` last gradient norm.
        refreshes: how many times the mesh was re-recorded.
        drift: `{update: relative change}` from the drift checks.
        engine: the engine that computed the gradients.
        updates: loop iterations run.
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
        drift = np.asarray(state.drift)
        return cls(
            theta=theta, loss=np.asarray(state.loss),
            converged=status == statuses.CONVERGED, status=status,
            steps=np.asarray(state.steps), history=np.asarray(state.history),
            grad_norm=np.asarray(state.grad_norm), refreshes=int(state.refreshes),
            drift={int(i): float(drift[i]) for i in np.flatnonzero(np.isfinite(drift))},
            engine=engine, updates=int(state.update),
            status_names=tuple(statuses(int(s)).name.lower() for s in status),
            state=state, resumed_from=resumed_from)

    def table(self, true=None, names=None) -> str:
        """A recovered-vs-true table of the scalar-per-fit leaves of theta."""
        leaves = jax.tree_util.tree_leaves_with_path(self.theta)
        rows = [(_name(p), np.asarray(v)) for p, v in leaves if np.ndim(v) == 1]
        truth = {}
        if true is not None:
            truth = {_name(p): np.asarray(v)
                     for p, v in jax.tree_util.tree_leaves_with_path(true)}
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

    def plot(self, true=None, path=None):
        """Loss histories and (with `true`) recovered vs true parameters; saves to
        `path` if given and returns the matplotlib figure."""
        import matplotlib  # optional (the `plot` extra): imported when a plot is asked for
        if path is not None:
            matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # after use("Agg"), which must come first
        ncols = 2 if true is not None else 1
        fig, axes = plt.subplots(1, ncols, figsize=(5.5 * ncols, 4), squeeze=False)
        ax = axes[0, 0]
        ax.semilogy(np.abs(self.history))
        ax.set_xlabel("update")
        ax.set_ylabel("loss")
        ax.set_title(f"{len(self.loss)} fits ({self.engine})")
        if true is not None:
            ax = axes[0, 1]
            for (p, est), t in zip(jax.tree_util.tree_leaves_with_path(self.theta),
                                   jax.tree.leaves(true)):
                if np.ndim(est) == 1:
                    ax.plot(np.asarray(t), np.asarray(est), "o", label=_name(p))
            lo, hi = ax.get_xlim()
            ax.plot([lo, hi], [lo, hi], "k--", lw=0.8)
            ax.set_xlabel("true")
            ax.set_ylabel("recovered")
            ax.legend()
        fig.tight_layout()
        if path is not None:
            fig.savefig(path, dpi=120)
        return fig
