"""The recorded mesh: each trajectory's accepted step sizes, zero-padded.

The padding rule lives here and only here: a trajectory's steps fill the first
`n_steps[i]` columns of `h`, every later column is an exact zero, and a zero step is
the identity in the replay. `Mesh.padded` appends zero columns; nothing else pads.
"""

import equinox as eqx
import jax
import numpy as np

from .status import Status, summarize


def padded_width(columns: int) -> int:
    """The padded width for `columns` steps: 4 at least, then four widths per doubling
    (5, 6, 7, 8, 10, 12, 14, 16, 20, ...). Small meshes are common (a neural ODE's
    takes ~5 steps) and padding them to 8 made its gradient 1.5x as expensive
    (measured on benchmarks/neural_ode.py's 32 trajectories: 10.3 ms at width 8
    against 6.9 ms at 5: a zero step costs what a step costs)."""
    if columns <= 4:
        return 4
    step = 1 << (int(columns - 1).bit_length() - 3)
    return -(-columns // step) * step


# How far past its steps a network's mesh is padded (`grown_width`).
GROWTH = 5.0


def grown_width(steps: int, current: int = 0, growth: float = GROWTH) -> int:
    """The width a mesh of `steps` steps is replayed at when the compiled replay has
    `current` columns (0: nothing compiled yet): `current` while the steps fit, else
    one of `padded_width`'s widths for `growth` times the steps. A Calibrator sizes the
    meshes of a network's field so from its first record on and replays them
    `guarded` (only the columns some trajectory steps in are evaluated); others with
    `growth` 1, the padded steps.

    A network's field usually gets stiffer as it trains, and each new width compiles
    the update again (1.8 s on DiffEqFlux's spiral, whose steps go from 4 to 17 in 500
    updates). Guarded headroom costs little: measured on benchmarks/neural_ode.py's
    examples (same session, float32), the Diffrax example's update (5 to 7 steps) took
    2.10 ms at growth 5 (width 28) against 1.99 ms at growth 2 (width 10), and the
    spiral's 500 updates 5.2 s with one compile at growth 5 against 7.7 s with two at
    growth 2. The price is memory: the replay's residuals are stored for every
    column of the width."""
    if steps <= current:
        return current
    return padded_width(int(growth * steps))


class Mesh(eqx.Module):
    """Accepted step sizes of every trajectory of an ensemble, as recorded.

    A pytree of arrays (with the method, tolerances and recorder as static metadata):
    it can be saved, loaded and passed into `jax.jit`.

    Attributes:
        h: `(n, S)` accepted step sizes, zero-padded to the longest trajectory.
        n_steps: `(n,)` accepted steps per trajectory.
        n_rejected: `(n,)` rejected trial steps per trajectory (during the record).
        status: `(n,)` `gs.Status` codes of the record.
        t0, t1: the span's ends (scalars).
        method, rtol, atol, recorder: how the mesh was made.
        guarded: the replay evaluates only the columns before every trajectory's
            steps have ended, forward and backward (`replay._live_loop`; a
            Calibrator's mesh of a network's field, padded with headroom:
            `grown_width`); False replays every column (a zero step costs what a
            step costs).

    Examples:
        >>> import gradsolve as gs
        >>> prob = gs.problems.lorenz(n=4)
        >>> mesh = gs.record(prob, rtol=1e-6, atol=1e-9)
        >>> mesh.h.shape[0], mesh.recorder, bool((mesh.h.sum(axis=1) > 0.99).all())
        (4, 'fused', True)
    """

    h: jax.Array
    n_steps: jax.Array
    n_rejected: jax.Array
    status: jax.Array
    t0: jax.Array
    t1: jax.Array
    method: str = eqx.field(static=True)
    rtol: float = eqx.field(static=True)
    atol: float = eqx.field(static=True)
    recorder: str = eqx.field(static=True)
    guarded: bool = eqx.field(static=True, default=False)

    @property
    def n(self) -> int:
        return self.h.shape[0]

    @property
    def columns(self) -> int:
        """S, the padded length every trajectory is replayed to."""
        return self.h.shape[1]

    @property
    def ok(self) -> bool:
        return bool(np.all(np.asarray(self.status) == Status.SUCCESS))

    def padded(self, columns: int) -> "Mesh":
        """The same mesh with zero columns appended up to `columns` (>= S)."""
        extra = columns - self.columns
        if extra < 0:
            raise ValueError(f"columns must be >= {self.columns}, got {columns}")
        if extra == 0:
            return self
        # NumPy and device_put: jnp.pad (and even jnp.asarray) would compile once per
        # pair of widths.
        h = np.pad(np.asarray(self.h), ((0, 0), (0, extra)))
        return eqx.tree_at(lambda m: m.h, self, jax.device_put(h))

    def take(self, rows) -> "Mesh":
        """The mesh of trajectories `rows` (an integer array; works under `jit`)."""
        return eqx.tree_at(lambda m: (m.h, m.n_steps, m.n_rejected, m.status), self,
                           (self.h[rows], self.n_steps[rows], self.n_rejected[rows],
                            self.status[rows]))

    def widened(self, columns: int = 0) -> "Mesh":
        """Padded to the smallest of a few fixed widths that holds `columns` and S: a
        refreshed mesh keeps its compiled replay unless it outgrows the width, and one
        that grows lands on one of a few widths (at most 4 per doubling: 5, 6, 7, 8, 10,
        12, 14, 16, 20, 24, 28, 32, 40, ...), so the padding is at most 25% of S and a long
        fit compiles its replay a few times, not once per width."""
        return self.padded(padded_width(max(columns, self.columns)))

    def summary(self) -> str:
        n_steps = np.asarray(self.n_steps)
        return (f"Mesh({self.method}, recorder={self.recorder}, n={self.n}, "
                f"S={self.columns}, steps {n_steps.min()}..{n_steps.max()}, "
                f"{summarize(self.status)})")
