"""Multi-process runs (multi-host TPU pods, GPU clusters, several CPU processes).

One JAX process runs per host (or per launcher task); together they form one program over the
devices of all of them. `initialize` starts JAX's distributed runtime before any device is
used: from the run config's ``distributed`` keys when they are set, else when the environment
shows a multi-process launch (Slurm, Open MPI, Cloud TPU pods, Kubernetes: JAX's own cluster
detection), else not at all (one process, as before).

Batches: every process builds the same example list and the same sequence of global batches
(`batches.batched_dataset` is deterministic in the seed), but collates only the rows that its own
devices hold (`process_rows`), and `global_batch` assembles the global array from each
process's part. Global batch ``i`` is therefore the same rows in the same order whatever the
number of processes, so a run on N processes computes what a run on one process with the same
mesh shape computes.
"""

from __future__ import annotations

import jax
import numpy as np
from absl import logging
from jax._src import clusters
from jax.sharding import Sharding

from mars_jax.errors import InputError

# Values of the config's distributed keys that mean "not set".
_UNSET_ADDRESS, _UNSET_COUNT, _UNSET_ID = "", 0, -1


def cluster_launch() -> str | None:
    """The name of the cluster environment that launched this process as one of several, or
    None.

    Uses the detection of ``jax.distributed.initialize()`` itself: the first cluster type JAX
    detects without being asked for it (Slurm, Open MPI, Cloud TPU on GCE or GKE, Kubernetes;
    mpi4py is opt-in in JAX and is not considered), and only when that environment reports
    more than one process (a single-host TPU VM or a one-task Slurm job is a plain
    single-process run).
    """
    env = next(
        (
            e
            for e in clusters.ClusterEnv._cluster_types
            if not e.opt_in_only_method and e.is_env_present()
        ),
        None,
    )
    if env is not None and env.get_process_count() > 1:
        return env.__name__
    return None


def initialize(dist_cfg) -> None:
    """Starts JAX's distributed runtime where this run calls for it; call before any device use.

    ``dist_cfg`` is the run config's ``distributed`` section:
      coordinator_address: str, "host:port" of process 0's coordinator ("" = unset).
      num_processes: int, the number of processes (0 = unset).
      process_id: int, this process's index in [0, num_processes) (-1 = unset).

    With ``coordinator_address`` set, initializes from the three keys. Otherwise, when
    `cluster_launch` detects a multi-process launch, initializes from the environment
    (``jax.distributed.initialize()`` without arguments). Otherwise does nothing. Also does
    nothing when the runtime is already initialized (a second call, or a caller that started it
    itself). On CPU, processes exchange data over JAX's default CPU collectives (gloo in JAX
    0.10). In a multi-process run, processes other than 0 log warnings and errors only.

    Raises:
      ValueError: ``num_processes`` or ``process_id`` set without ``coordinator_address``, or
        ``coordinator_address`` set with ``num_processes`` < 1 or ``process_id`` outside
        [0, num_processes). The message names the keys.
      RuntimeError: from JAX, when a device was used before this call.
    """
    if not jax.distributed.is_initialized() and not _start(dist_cfg):
        return
    if jax.process_index() != 0:
        logging.set_verbosity(logging.WARNING)
    logging.info(
        "distributed runtime: %d processes, %d devices (%d local)",
        jax.process_count(),
        jax.device_count(),
        jax.local_device_count(),
    )


def _start(dist_cfg) -> bool:
    """Initializes JAX's distributed runtime as `initialize` describes; whether it did."""
    address = dist_cfg.coordinator_address
    count, index = int(dist_cfg.num_processes), int(dist_cfg.process_id)
    if address != _UNSET_ADDRESS:
        if count < 1 or not 0 <= index < count:
            raise InputError(
                f"distributed.coordinator_address={address!r} needs distributed.num_processes "
                f">= 1 and 0 <= distributed.process_id < num_processes, got num_processes="
                f"{count} and process_id={index}"
            )
        jax.distributed.initialize(address, num_processes=count, process_id=index)
        return True
    if count != _UNSET_COUNT or index != _UNSET_ID:
        raise InputError(
            f"distributed.num_processes={count} / distributed.process_id={index} are set but "
            "distributed.coordinator_address is not: set all three, or none of them to let the "
            "cluster environment decide"
        )
    if (cluster := cluster_launch()) is not None:
        logging.info("multi-process launch detected (%s)", cluster)
        jax.distributed.initialize()
        return True
    return False


def is_primary() -> bool:
    """Whether this process writes the run's files and logs (process 0; always, with one)."""
    return jax.process_index() == 0


def process_rows(batch_sharding: Sharding, batch_size: int) -> np.ndarray:
    """The rows of a [batch_size, ...] global batch that this process's devices hold under
    ``batch_sharding``, ascending: int64[k], k <= batch_size (all rows with one process).

    This is the local data that ``jax.make_array_from_process_local_data`` expects, in its
    order: rows of this process's shards sorted by their first row. A row that several
    processes hold (a batch replicated across processes) is in each of their lists.
    """
    index_map = batch_sharding.addressable_devices_indices_map((batch_size,))
    rows = {r for index in index_map.values() for r in range(*index[0].indices(batch_size))}
    return np.array(sorted(rows), dtype=np.int64)


def global_batch(local: dict, batch_sharding: Sharding, batch_size: int) -> dict:
    """The global batch arrays from this process's rows of them.

    Args:
      local: {name: int32[k, L]} numpy arrays (or [k] per-row arrays), the rows `process_rows`
        names, in its order.
      batch_sharding: the sharding of the global arrays (rows split over its batch axes).
      batch_size: the number of rows of the global batch.

    Returns {name: jax.Array[batch_size, L]} placed by ``batch_sharding``. Every process must
    call this with its own rows of the same global batch. Raises ValueError (from JAX) when
    ``local`` does not have the row count that this process's devices hold.
    """
    return {
        name: jax.make_array_from_process_local_data(
            _rows_sharding(batch_sharding, rows.ndim), rows, (batch_size, *rows.shape[1:])
        )
        for name, rows in local.items()
    }


def _rows_sharding(batch_sharding: Sharding, ndim: int) -> Sharding:
    """``batch_sharding`` (of [batch, L] arrays) for an array of rank ``ndim`` split the same way
    along its rows (e.g. [batch] per-row weights)."""
    if ndim == len(batch_sharding.spec):
        return batch_sharding
    spec = (*batch_sharding.spec[:ndim], *(None,) * (ndim - len(batch_sharding.spec)))
    return jax.sharding.NamedSharding(batch_sharding.mesh, jax.sharding.PartitionSpec(*spec))
