"""Where each trajectory runs: devices, buckets by recorded step count, memory chunks.

The ensemble axis is the parallel axis, and every replay is per trajectory, so an
ensemble can be cut anywhere along it without changing a result. This module is the
one place that cuts it:

- **devices**: the rows are split over a 1-D `jax.sharding.Mesh` with `shard_map`,
  each device running its own loops (no collective per step); `gs.Shared` leaves and
  the mesh's span are replicated, and `shard_map`'s transpose sums their gradients
  over devices;
- **buckets**: the replay sorts the trajectories by recorded step count into a few
  equal-sized groups, each replayed at its own width (the zero-padded columns past a
  group's longest trajectory are dropped: they are the identity), and deals the
  sorted trajectories to the devices in turn, back and forth, so every device gets
  the same mix of short and long ones: the same padded work, about the same steps;
- **chunks**: under a memory budget, each bucket is replayed in chunks of rows, one
  after the other (`lax.map` over a checkpointed chunk: the backward sweep keeps one
  chunk's intermediates at a time), and the recorders run row chunks in turn.

`Arrangement` is the plan (an order of the rows, filler rows to make the pieces
equal, and the static widths); `arrange` makes it on the host from a mesh's step
counts, `Arrangements` keeps a fit's successive ones (widths never shrinking), `run`
evaluates a replay function through it, and the outputs come back in the user's
order. Across processes (`gs.distributed`), the device mesh spans every
process's devices and each process records its own rows (`record_rows`).

The package: `_devices.py` (devices and processes), `_memory.py` (the memory
model), `_arrangement.py` (the plan) and `_run.py` (running a replay through it).
"""

from ._devices import (  # noqa: F401
    AXIS,
    MIN_ROWS_PER_DEVICE,
    by_rows,
    device_mesh,
    gather_rows,
    local_mesh,
    own_rows,
    row_pieces,
    shard_rows,
    size,
)
from ._memory import (  # noqa: F401
    BUDGET_FRACTION,
    available_bytes,
    budget_bytes,
    held_bytes,
    record_bytes,
    replay_bytes,
    rows_within,
)
from ._arrangement import (  # noqa: F401 - _layout: tests/test_scale.py
    Arrangement,
    Arrangements,
    BUCKETS,
    BUCKET_SLACK,
    LANES,
    MAX_BUCKETS,
    MIN_BUCKET_ROWS,
    _layout,
    arrange,
    check_buckets,
    for_mesh,
    for_replay,
    replicated,
    usable_buckets,
)
from ._run import (  # noqa: F401
    run,
)
