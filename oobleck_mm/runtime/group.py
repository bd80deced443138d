"""Joining a generation's process group: the one way every worker gets one, tests and benchmarks included.

Every generation of the job has its own default process group, rendezvoused on
the master's rendezvous store (``runtime/store.py``) under the prefix ``gen{g}``, so a generation never meets
a stale key of an earlier one. ``join_generation`` does it in three steps:

1. Leave the previous generation's group (closing its connections unblocks
   peers that still wait on this worker).
2. Arrival barrier: a counter under the prefix, waited on for at most
   ``arrival_timeout`` (``fault_tolerance.rendezvous_timeout`` in a job). Long on
   purpose: survivors of a hang arrive up to a collective timeout apart and a
   joiner's worker starts from nothing. While waiting, ``poll`` is asked for a
   newer command: the master may re-plan meanwhile (a failure during recovery),
   and the wait is then abandoned.
3. ``init_process_group`` with ``collective_timeout`` (``fault_tolerance.
   collective_timeout``): every collective and point-to-point wait of the
   generation is bounded by it.

torch names groups from a process-global counter that a failed init leaves
incremented; every rank of a generation must start from the same count, or the
rendezvous never matches, so the counter is reset before each init (torch has
no public way to do it; torchft's ``ProcessGroup.configure`` re-creates its
groups the same way, from scratch per quorum).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from oobleck_mm.runtime.waiting import PeerFailure

log = logging.getLogger(__name__)

ARRIVAL_POLL_S = 0.01
"""Pause between two reads of the arrival counter."""


TORCHRUN_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
"""What torchrun gives every worker; ours are set for the current generation (``torchrun_environment``)."""


def torchrun_environment(rank: int, world_size: int, local_rank: int, node: str, rank_nodes: Sequence[str],
                         store_host: str, store_port: int) -> dict[str, str]:  # fmt: skip
    """torchrun's variables for one worker in one generation, so user code that reads them (a
    model builder, a data pipeline, a logger) sees the generation it runs in. ``MASTER_ADDR`` and
    ``MASTER_PORT`` name the generation's rendezvous store, as torchrun's do; ``LOCAL_WORLD_SIZE``
    counts this node's ranks in the generation (``rank_nodes``: the node of every rank)."""
    local_world = sum(1 for n in rank_nodes if n == node) if rank_nodes else 1
    values = (rank, local_rank, world_size, max(local_world, 1), store_host, store_port)
    return {name: str(value) for name, value in zip(TORCHRUN_VARIABLES, values)}


def connect_store(host: str, port: int, token: str, timeout: timedelta) -> dist.Store:
    """A client of the master's rendezvous store at ``host:port``; ``timeout`` bounds each of its operations."""
    from oobleck_mm.runtime.store import ControlPlaneStore

    return ControlPlaneStore(host, port, token, timeout)


def join_generation(
    store: dist.Store,
    generation: int,
    rank: int,
    world_size: int,
    backend: str,
    *,
    collective_timeout: timedelta,
    arrival_timeout: timedelta,
    poll: Callable[[], Any] | None = None,
) -> Any:
    """Join generation ``generation``'s default process group as ``rank`` of ``world_size``.

    Returns None once joined, or whatever ``poll`` returned (not None) while this
    worker waited for the others: then no group was joined. Raises ``PeerFailure``
    when not every worker arrived within ``arrival_timeout`` or the group could not
    be formed.
    """
    leave_group()
    prefixed = dist.PrefixStore(f"gen{generation}", store)
    prefixed.add("arrived", 1)
    deadline = time.monotonic() + arrival_timeout.total_seconds()
    while prefixed.add("arrived", 0) < world_size:
        if poll is not None and (pending := poll()) is not None:
            return pending
        if time.monotonic() > deadline:
            raise PeerFailure(
                f"generation {generation}: not all {world_size} workers arrived within {arrival_timeout}"
            )
        time.sleep(ARRIVAL_POLL_S)
    dist.distributed_c10d._world.group_count = 0  # see the module docstring
    try:
        dist.init_process_group(backend, store=prefixed, rank=rank, world_size=world_size,
                                timeout=collective_timeout)  # fmt: skip
    except RuntimeError as error:
        raise PeerFailure(f"generation {generation}: rendezvous failed: {error}") from error
    global _store_in_use
    # A store written in Python (the master's, runtime/store.py) must outlive the group: torch keeps
    # only its C++ half, and once the Python object is collected every later use of the store (the
    # subgroups new_group forms) fails with "Not implemented".
    _store_in_use = store
    return None


_store_in_use: dist.Store | None = None
"""The store the current default group was formed on (see the end of ``join_generation``)."""


NCCL_ABORT_WAIT = timedelta(seconds=10)
"""Longest wait for NCCL's communicators to abort after a failure before the worker goes on without."""


def leave_group(abort: bool = False) -> None:
    """Destroy this process's default group, if any: its peers' waits on this worker fail fast.

    ``abort`` (after a failure): NCCL communicators with a collective in flight to a dead peer can
    hang ``destroy_process_group``; aborting them first (torch's ``_abort_process_group``, in a
    thread bounded by ``NCCL_ABORT_WAIT``) frees the device. gloo needs nothing more than destroy.
    """
    if not dist.is_initialized():
        return
    if abort and dist.get_backend() == "nccl":
        from torch.distributed.distributed_c10d import _abort_process_group

        worker = threading.Thread(target=_abort_process_group, name="nccl-abort", daemon=True)
        worker.start()
        worker.join(NCCL_ABORT_WAIT.total_seconds())
        if worker.is_alive():
            log.warning("NCCL abort still running after %.0f s; leaving the group without it",
                        NCCL_ABORT_WAIT.total_seconds())
        if not dist.is_initialized():
            return
    try:
        dist.destroy_process_group()
    except (RuntimeError, ValueError) as error:  # an aborted group may already be gone
        log.warning("leaving the process group: %s", error)
