"""Several processes (and hosts) on one ensemble, through JAX's own runtime.

`initialize` is `jax.distributed.initialize`; after it `jax.devices()` lists every
process's devices, and the `devices=` default of `gs.solve`, `gs.record`,
`gs.value_and_grad` and `gs.Calibrator` is all of them. Every process runs the same
script on the same problem: each records its own share of the trajectories
(`layout.own_rows`), the meshes are joined, and the replay runs under `shard_map`
over every device, so the gradients of `gs.Shared` parameters are summed across
processes by XLA's collectives and every process receives the same results. A
Calibrator's checkpoints are written by the processes together (Orbax's
multi-process support) and resume on the same process count. docs/scale.md has
launch scripts for one machine and for SLURM.
"""

import jax


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, local_device_ids=None, **kwargs):
    """Join this process to a multi-process job: `jax.distributed.initialize`.

    Call it once per process, before any other JAX call. With no arguments JAX reads
    the job from the environment where it can (SLURM, Open MPI, and the variables
    `JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES`, `JAX_PROCESS_ID`); otherwise give
    the coordinator's `host:port` (process 0's), the process count and this process's
    id. On CPUs the collectives between processes run over Gloo.

    Returns:
        `(process_index, process_count)`.

    Examples:
        A job of two processes on one machine (run each line in its own shell)::

            python fit.py 0   # gs.distributed.initialize("127.0.0.1:12345", 2, 0)
            python fit.py 1   # gs.distributed.initialize("127.0.0.1:12345", 2, 1)
    """
    for name, value in (("num_processes", num_processes), ("process_id", process_id)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 0):
            raise ValueError(f"{name} must be None or a non-negative integer, got {value!r}")
    if num_processes is not None and process_id is not None and process_id >= num_processes:
        raise ValueError(f"process_id={process_id} must be < num_processes={num_processes}")
    jax.distributed.initialize(coordinator_address=coordinator_address,
                               num_processes=num_processes, process_id=process_id,
                               local_device_ids=local_device_ids, **kwargs)
    return jax.process_index(), jax.process_count()


def shutdown():
    """Leave the job (`jax.distributed.shutdown`); also done at interpreter exit."""
    jax.distributed.shutdown()
