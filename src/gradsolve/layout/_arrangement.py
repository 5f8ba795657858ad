"""The arrangement: an order of the rows, filler rows and static widths per bucket
(`arrange`, made on the host from a mesh's step counts)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from .. import methods
from ..mesh import grown_width
from ..status import Status
from ._devices import size
from ._memory import held_bytes, replay_bytes, rows_within


# Bucketing: the default number of buckets is the smallest of `BUCKETS` whose padded
# work is within `BUCKET_SLACK` of the largest's, with at least `MIN_BUCKET_ROWS` rows
# per bucket and device (a bucket is one more scan to compile and launch).
BUCKETS = (1, 2, 4, 8)
BUCKET_SLACK = 1.15
MIN_BUCKET_ROWS = 256
# The most buckets `buckets=` may ask for: each is one more replay scan to compile,
# and a replay's compile time grows with them (issue 27: 64 buckets of Lorenz took
# 42.9 s to the first gradient on 4 rows, 2 buckets 5.3 s: ~0.6 s a bucket), while
# the padded work saved flattens out well before, the widths snapping to a few values
# (docs/benchmarks.md, Scaling: a heavy-tailed ensemble's work is 2.02x less in 4
# buckets, 2.08x in 8). Twice the largest default.
MAX_BUCKETS = 16
# XLA's CPU vector width in float64 lanes, at most (8: AVX-512). Every piece of rows
# is a multiple of it, so that no row falls in a vector loop's scalar remainder: the
# remainder rounds differently (libm `pow` in the recorder's controller, a multiply
# and add not fused in the replay), in the last bit, and the recorder's error estimate
# (a difference of near-equal states) turns that bit into 1e-12 in the step sizes.
# With it, a row's results do not depend on how many rows or devices there are -- up
# to a size: from ~1400 rows a piece XLA compiles the recorder's loop body another way
# (measured: a row's mesh is the same at 16 and 1344 rows, 1e-11 apart at 1408), so
# larger split records agree to ~1e-11 in the step sizes, not bit for bit.
LANES = 8


def check_buckets(buckets):
    """`buckets` validated: None (the default rule) or a positive integer, at most
    `MAX_BUCKETS`."""
    if buckets is not None and (isinstance(buckets, bool) or not isinstance(
            buckets, (int, np.integer)) or buckets < 1):
        raise ValueError(f"buckets must be None or a positive integer, got {buckets!r}")
    if buckets is not None and buckets > MAX_BUCKETS:
        raise ValueError(f"buckets must be at most {MAX_BUCKETS} (each bucket is one more "
                         f"replay to compile), got {buckets}; None picks a number")
    return None if buckets is None else int(buckets)


def usable_buckets(n: int, D: int) -> int:
    """The most buckets n rows on D devices can fill: a bucket holds at least `LANES`
    rows a device, so past this the buckets would hold filler rows only."""
    return max(1, -(-n // (D * LANES)))


class Arrangement(eqx.Module):
    """Where each row of an ensemble of n is replayed.

    Attributes:
        order: `(n_pad,)` the user's row at each position: device-major, each device's
            rows bucket-major (ascending step counts), each bucket `chunks` chunks.
        real: `(n_pad,)` False at filler positions (each replays a copy of the row
            with the fewest steps, which it names in `order`).
        where: `(n,)` the position of each user row in `order`.
        widths: per bucket, the mesh columns it replays (>= its longest trajectory).
        chunks: chunks per bucket (1: the bucket at once).
        devices: the device mesh (None: one device).
        identity: one device, one piece, the user's order, no filler: `run` calls the
            replay function as it is.
    """

    order: jax.Array
    real: jax.Array
    where: jax.Array
    widths: tuple = eqx.field(static=True)
    chunks: int = eqx.field(static=True)
    devices: object = eqx.field(static=True)
    identity: bool = eqx.field(static=True, default=False)

    @property
    def rows(self) -> int:
        """Rows per bucket on one device."""
        return self.order.shape[0] // (size(self.devices) * len(self.widths))

    def work(self) -> int:
        """Padded work: rows x columns replayed, over all devices."""
        return size(self.devices) * self.rows * sum(self.widths)


def _plan_sizes(n, D, k, rows_cap):
    """Chunks per bucket q and rows per bucket m (a multiple of LANES per chunk)."""
    m = -(-n // (D * k))
    q = 1 if rows_cap is None else max(1, -(-m // max(LANES, rows_cap)))
    c = -(-m // q)
    return q, -(-c // LANES) * LANES * q


def _layout(steps, D, k, rows_cap, S, growth=1.0):
    """Order (-1 at filler positions), bucket widths and chunks per bucket for
    `steps` on D devices in k buckets, each `growth` times its longest row's steps
    wide (`gs.mesh.grown_width`, at most S). Fillers stand for copies of the row with
    the fewest steps: they sort first."""
    n = steps.size
    q, m = _plan_sizes(n, D, k, rows_cap)
    n_pad = D * k * m
    ranked = np.concatenate([np.full(n_pad - n, -1), np.argsort(steps, kind="stable")])
    ranked_steps = steps[np.where(ranked >= 0, ranked, np.argmin(steps))]
    # Dealt in turn, back and forth (device 0, 1, .., D-1, D-1, .., 0, ...): each
    # device gets the same number of rows of every bucket, and about the same steps.
    r = np.arange(n_pad)
    lap, seat = r // D, r % D
    device = np.where(lap % 2 == 0, seat, D - 1 - seat)
    position = device * (k * m) + lap                # device-major, ascending within
    order = np.empty(n_pad, np.int64)
    order[position] = ranked
    widths = []
    for b in range(k):
        longest = ranked_steps[b * m * D:(b + 1) * m * D].max(initial=0)
        widths.append(min(S, grown_width(int(longest), 0, growth)) if longest > 0 else 0)
    widths = [int(w) for w in widths]
    return order, tuple(widths), q


def arrange(n: int, *, dmesh=None, n_steps=None, status=None, columns=None, buckets=None,
            rows_cap=None, min_widths=None, growth=1.0) -> Arrangement:
    """The arrangement of n rows on `dmesh` (host NumPy; `n_steps` and `status` are a
    mesh's, or None when the step counts are not known: one bucket of full width).

    `buckets`: None (the default rule: `BUCKETS`, `BUCKET_SLACK`, `MIN_BUCKET_ROWS`),
    or a number (1: no buckets; at most `usable_buckets(n, devices)` are made, the
    rest would hold only filler rows). `rows_cap`: the most rows one chunk may hold
    (None: no limit). `min_widths`: the widths compiled so far, not to shrink below
    (a Calibrator keeps its compiled update while the step counts wander). Every
    bucket, and one that outgrows its width, is given `growth` times its steps
    (`gs.mesh.grown_width`), at most `columns`.

    Examples:
        >>> import numpy as np
        >>> from gradsolve import layout
        >>> steps = np.array([10] * 600 + [100] * 400)
        >>> flat = layout.arrange(1000, n_steps=steps, buckets=1)
        >>> auto = layout.arrange(1000, n_steps=steps)
        >>> flat.widths, auto.widths, round(flat.work() / auto.work(), 2)
        ((100,), (10, 100), 1.8)
    """
    D = size(dmesh)
    S = int(columns) if columns is not None else 0
    if n_steps is None:
        steps = np.full(n, S, np.int64)
        choices = (1,)
    else:
        steps = np.asarray(n_steps, np.int64)
        if status is not None:  # a masked trajectory replays no steps
            steps = np.where(np.asarray(status) == Status.SUCCESS, steps, 0)
        S = S or int(steps.max(initial=0))
        if buckets is None:
            per = -(-n // D)
            choices = tuple(k for k in BUCKETS if k == 1 or per // k >= MIN_BUCKET_ROWS)
        else:
            choices = (min(check_buckets(buckets), usable_buckets(n, D)),)
    plans = [_layout(steps, D, k, rows_cap, S, growth) for k in choices]
    if min_widths is not None:  # a bucket that outgrew its width grows with headroom
        plans = [(o, tuple(min(S, grown_width(a, b, growth)) for a, b in zip(w, min_widths))
                  if len(w) == len(min_widths) else w, q) for o, w, q in plans]
    work = [len(o) // len(w) * sum(w) for o, w, _ in plans]
    best = min(work)
    pick = next(i for i, w in enumerate(work) if w <= BUCKET_SLACK * best)
    order, widths, q = plans[pick]
    real = order >= 0
    # A filler replays a copy of a real row, its mesh and all: whatever it computes
    # is what that row computes (finite where the row is), and it never reaches an
    # output, so its zero cotangent adds exact zeros to the row's gradients.
    order = np.where(real, order, int(np.argmin(steps)))
    where = np.empty(n, np.int64)
    where[order[real]] = np.flatnonzero(real)
    put = _replicated(dmesh)
    identity = dmesh is None and len(widths) == 1 and q == 1 and order.size == n \
        and bool((order == np.arange(n)).all())
    return Arrangement(order=put(order.astype(np.int32)), real=put(real),
                       where=put(where.astype(np.int32)), widths=widths, chunks=q,
                       devices=dmesh, identity=identity)


def _replicated(dmesh):
    if dmesh is None:
        return jnp.asarray
    sharding = NamedSharding(dmesh, PartitionSpec())
    return lambda x: jax.device_put(x, sharding)


def for_mesh(mesh, n, *, dmesh, buckets=None, rows_cap=None, min_widths=None, growth=1.0):
    """`arrange` from a concrete `gs.Mesh` (or None: no mesh, one bucket; a traced mesh:
    its step counts unknown, one bucket)."""
    if mesh is None or isinstance(mesh.n_steps, jax.core.Tracer):
        return arrange(n, dmesh=dmesh, buckets=1, rows_cap=rows_cap,
                       columns=None if mesh is None else mesh.columns)
    return arrange(n, dmesh=dmesh, n_steps=np.asarray(mesh.n_steps),
                   status=np.asarray(mesh.status), columns=mesh.columns, buckets=buckets,
                   rows_cap=rows_cap, min_widths=min_widths, growth=growth)


def for_replay(mesh, n, cfg, d, itemsize, *, gradient=True, min_widths=None, growth=1.0):
    """The arrangement a replay of `mesh` runs by under `cfg`'s devices, buckets and
    memory budget (chunks only where a device's rows would not fit)."""
    rows_cap = None
    if mesh is not None:
        per_row = replay_bytes(methods.get(cfg.method), d, mesh.columns, itemsize,
                               remat=bool(cfg.remat), n_ts=0 if cfg.ts is None else len(cfg.ts),
                               gradient=gradient, evaluation_size=cfg.evaluation_size)
        rows = -(-n // size(cfg.devices))
        held = held_bytes(rows, mesh.columns, d, itemsize)
        if held + rows * per_row > cfg.memory_budget:
            rows_cap = rows_within(cfg.memory_budget, per_row,
                                   "replay gradient" if gradient else "replay", held=held)
    return for_mesh(mesh, n, dmesh=cfg.devices, buckets=cfg.buckets, rows_cap=rows_cap,
                    min_widths=min_widths, growth=growth)


class Arrangements:
    """The arrangements of one fit's successive meshes (a Calibrator's): made anew
    when a mesh's step counts change, the bucket widths never shrinking (each new set
    of widths is one more compile of the fit's update), and the last one kept. A
    minibatch (`batch` rows drawn inside the update) is replayed as one bucket."""

    def __init__(self, cfg, d, itemsize, growth=1.0):
        self.cfg, self.d, self.itemsize, self.growth = cfg, d, itemsize, growth
        self.last = None  # (key, Arrangement)

    def __call__(self, mesh, n, batch=None, cache=True):
        """Where `n` trajectories are replayed on `mesh`; `cache=False` leaves the
        kept one as it was (a drift check's replay of a trial mesh)."""
        if batch is not None:
            return arrange(batch, dmesh=self.cfg.devices, buckets=1,
                           columns=None if mesh is None else mesh.columns)
        key = (n,) if mesh is None else (n, np.asarray(mesh.n_steps).tobytes(),
                                         np.asarray(mesh.status).tobytes(), mesh.columns)
        last = self.last if cache else None
        if last is not None and last[0] == key:
            return last[1]
        same_n = last is not None and last[0][0] == n
        arr = for_replay(mesh, n, self.cfg, self.d, self.itemsize,
                         min_widths=last[1].widths if same_n else None, growth=self.growth)
        if cache:
            self.last = (key, arr)
        return arr


def replicated(tree, arr):
    """`tree` (under `jit`) constrained to be whole on every device of `arr`'s mesh,
    where the mesh spans processes: every process can then read the results."""
    if arr is None or arr.devices is None or jax.process_count() == 1:
        return tree
    sharding = NamedSharding(arr.devices, PartitionSpec())
    return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, sharding)
                        if eqx.is_array(x) else x, tree)
