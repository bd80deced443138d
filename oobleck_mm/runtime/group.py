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

A plan every old rank outlives (a join, a leave on notice) is switched to at an
iteration boundary, and the survivors' pause there is what a join costs them.
Its gloo group is therefore formed ahead (``PreparedGroup``, steps 2 and 3 in a
background thread as soon as the assignment arrives, while the old generation
trains on), and the switch only installs it; the old groups are closed in the
background too (``RetiredGroups``). With both, leaving the old groups and
joining the new ones takes a join's survivors ~1 ms instead of 55-85 ms (5 CPU
workers, the recovery benchmark's join).

torch names groups from a process-global counter that a failed init leaves
incremented; every rank of a generation must start from the same count, or the
rendezvous never matches, so the counter is reset before each init (torch has
no public way to do it; torchft's ``ProcessGroup.configure`` re-creates its
groups the same way, from scratch per quorum).
"""

from __future__ import annotations

import atexit
import logging
import sys
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from oobleck_mm.runtime.waiting import PeerFailure

log = logging.getLogger(__name__)

ARRIVAL_FIRST_POLL_S = 0.001
"""First pause between two reads of the arrival counter: the survivors of a join arrive within
milliseconds of each other (the joiner is already there), and every pause is theirs to wait."""
ARRIVAL_POLL_S = 0.01
"""Pauses double up to this (a joiner's worker can wait seconds for the survivors of a failure)."""
ARRIVAL_PATIENT_S = 1.0
"""After this long without every worker arrived, pauses grow further, up to ``ARRIVAL_SLOW_POLL_S``: a joiner
whose join generation a loss dropped (``oobleck_mm.master.recovery.plan_request`` leaves it for the generation after)
waits there until the next join reaches it, seconds under churn, and at 100 reads a second it took CPU
from everyone (an HF churn soak with such joiners: 150.9 s for 82 events, then 131.6 s for 70 with these
pauses; the churn's events come at wall-clock times, so a slower run meets more)."""
ARRIVAL_SLOW_POLL_S = 0.1
"""The longest pause between two reads of the arrival counter (and two looks for a newer command while a
prepared group is awaited)."""
ARRIVAL_HOLD_S = 0.25
"""How long one held read of ``ARRIVED_ALL_KEY`` asks the server to wait (it caps it at
``oobleck_mm.master.store.LONG_POLL_S``); a newer command ends it sooner (``ControlPlaneStore.read_within``)."""
ARRIVED_ALL_KEY = "arrived_all"
"""Set by the last worker to arrive in a generation (its ``add`` reached the world size): the others wait
for it in held reads of the master's store (``_await_arrivals``)."""


TORCHRUN_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
"""What torchrun gives every worker; ours are set for the current generation (``torchrun_environment``)."""


def torchrun_environment(
    rank: int, world_size: int, local_rank: int, node: str, rank_nodes: Sequence[str], store_host: str, store_port: int
) -> dict[str, str]:
    """torchrun's variables for one worker in one generation, so user code that reads them (a
    model builder, a data pipeline, a logger) sees the generation it runs in. ``MASTER_ADDR`` and
    ``MASTER_PORT`` name the generation's rendezvous store, as torchrun's do; ``LOCAL_WORLD_SIZE``
    counts this node's ranks in the generation (``rank_nodes``: the node of every rank)."""
    local_world = sum(1 for n in rank_nodes if n == node) if rank_nodes else 1
    values = (rank, local_rank, world_size, max(local_world, 1), store_host, store_port)
    return {name: str(value) for name, value in zip(TORCHRUN_VARIABLES, values)}


def connect_store(
    host: str, port: int, token: str, timeout: timedelta, interrupt: Callable[[], bool] | None = None
) -> dist.Store:
    """A client of the master's rendezvous store at ``host:port``; ``timeout`` bounds each of its operations,
    ``interrupt`` (the master re-planned) ends its waits for a key at once."""
    from oobleck_mm.runtime.store import ControlPlaneStore

    return ControlPlaneStore(host, port, token, timeout, interrupt)


def join_generation(
    store: dist.Store | None,
    generation: int,
    rank: int,
    world_size: int,
    backend: str,
    *,
    collective_timeout: timedelta,
    arrival_timeout: timedelta,
    poll: Callable[[], Any] | None = None,
    prepared: PreparedGroup | None = None,
    before_connect: Callable[[], None] | None = None,
) -> Any:
    """Join generation ``generation``'s default process group as ``rank`` of ``world_size``.

    Returns None once joined, or whatever ``poll`` returned (not None) while this
    worker waited for the others: then no group was joined. Raises ``PeerFailure``
    when not every worker arrived within ``arrival_timeout`` or the group could not
    be formed. ``prepared``: the generation's group, being formed in the background
    (``PreparedGroup``); it is waited for and installed instead of forming one here.
    ``before_connect``: called once every worker arrived, before the group's construction (the
    ``connect`` hold point).

    A peer lost between the arrival and its connect leaves the others waiting inside gloo's
    construction for its address; a store made with an ``interrupt`` (``connect_store``) ends that
    wait as soon as the master re-plans, else the group's timeout (``collective_timeout``) does.
    """
    leave_group()
    if prepared is not None:
        return _install(prepared, poll, arrival_timeout)
    prefixed = dist.PrefixStore(f"gen{generation}", store)
    pending = _await_arrivals(
        prefixed, generation, world_size, arrival_timeout, poll, _arrival_reader(store, generation)
    )
    if pending is not None:
        return pending
    if before_connect is not None:
        before_connect()
    dist.distributed_c10d._world.group_count = 0  # see the module docstring
    try:
        dist.init_process_group(backend, store=prefixed, rank=rank, world_size=world_size, timeout=collective_timeout)
    except RuntimeError as error:
        raise PeerFailure(f"generation {generation}: rendezvous failed: {error}") from error
    _keep_store(store)
    return None


def _arrival_reader(store, generation: int) -> Callable[[float], bytes | None] | None:
    """A held read of generation ``generation``'s ``ARRIVED_ALL_KEY`` when ``store`` offers one (the master's
    store, ``ControlPlaneStore.read_within``); None for other stores (they poll the counter)."""
    read_within = getattr(store, "read_within", None)
    if read_within is None:
        return None
    key = f"gen{generation}/{ARRIVED_ALL_KEY}"  # as dist.PrefixStore(f"gen{generation}", store) names it
    return lambda seconds: read_within(key, seconds)


def _await_arrivals(
    prefixed: dist.Store,
    generation: int,
    world_size: int,
    timeout: timedelta,
    poll: Callable[[], Any] | None,
    read_all: Callable[[float], bytes | None] | None = None,
) -> Any:
    """The arrival barrier: counts this worker in and waits for ``world_size``; ``poll``'s answer if it has one.

    ``read_all`` (``_arrival_reader``): the last worker to arrive sets ``ARRIVED_ALL_KEY`` and the others
    wait for it in held reads, one call each ``ARRIVAL_HOLD_S`` instead of reading the counter up to 100
    times a second; without it, the counter is polled."""
    if prefixed.add("arrived", 1) >= world_size:
        if read_all is not None:
            prefixed.set(ARRIVED_ALL_KEY, b"1")
        return None
    began = time.monotonic()
    deadline = began + timeout.total_seconds()
    pause = ARRIVAL_FIRST_POLL_S
    while True:
        if read_all is not None:
            if read_all(min(ARRIVAL_HOLD_S, max(0.0, deadline - time.monotonic()))) is not None:
                return None
        elif prefixed.add("arrived", 0) >= world_size:
            return None
        if poll is not None and (pending := poll()) is not None:
            return pending
        now = time.monotonic()
        if now > deadline:
            raise PeerFailure(f"generation {generation}: not all {world_size} workers arrived within {timeout}")
        if read_all is None:
            time.sleep(pause)
            pause = min(2 * pause, ARRIVAL_SLOW_POLL_S if now - began > ARRIVAL_PATIENT_S else ARRIVAL_POLL_S)


def _keep_store(store: dist.Store) -> None:
    global _store_in_use
    # A store written in Python (the master's, runtime/store.py) must outlive the group: torch keeps
    # only its C++ half, and once the Python object is collected every later use of the store (the
    # subgroups new_group forms) fails with "Not implemented".
    _store_in_use = store


PREPARED_BACKEND = "gloo_prepared"
"""The backend name under which a ``PreparedGroup``'s gloo group becomes torch's default group."""

_handed_out: list = []
"""The prepared gloo groups, in the order torch asks for them (``_prepared_backend``): the default
group, then the subgroups this rank is in, as ``GradientSync`` forms them."""


def _prepared_backend(store, rank: int, size: int, timeout):
    """torch's backend constructor for ``PREPARED_BACKEND`` (``new_group`` uses the default group's
    backend too): the next prepared group, or a new gloo group once none of that size is left."""
    if _handed_out and _handed_out[0].size() == size:
        return _handed_out.pop(0)
    _retire_prepared()  # not the groups prepared: form this one and every later one here
    return dist.ProcessGroupGloo(store, rank, size, timeout)


# register_backend is torch's extension point for third-party backends; it is used here so that
# a gloo group built beforehand becomes the default group without re-implementing init_process_group.
dist.Backend.register_backend(PREPARED_BACKEND, _prepared_backend, devices=["cpu", "cuda"])


class PreparedGroup:
    """A generation's gloo group, formed by a background thread while the previous generation trains.

    For a plan every old rank outlives (a join, a leave on notice), the workers switch at an
    iteration boundary; forming the new group there (arrival barrier, gloo's full-mesh connect
    through the master's store: 25-45 ms on 5 CPU workers) was most of the survivors' pause. Here
    each worker forms it as soon as the assignment arrives, the survivors between their steps
    (``ProcessGroupGloo``'s constructor runs without the GIL), and the switch installs it.
    NCCL needs none of this: its communicators are formed at their first collective.
    """

    def __init__(
        self,
        connect: Callable[[], dist.Store],
        generation: int,
        rank: int,
        world_size: int,
        *,
        collective_timeout: timedelta,
        arrival_timeout: timedelta,
        subgroups: Sequence[Sequence[int]] = (),
        before: Callable[[], None] | None = None,
        gated: bool = False,
    ) -> None:
        """``subgroups``: the ranks of each subgroup the generation will form after its default group,
        in order (``runtime.grad_sync.subgroup_ranks``); those this rank is in are formed here too.
        ``before``: called first, in the background thread (the ``forming`` hold point).
        ``gated``: this rank arrives only once ``may_arrive`` is called (at most ``arrival_timeout``
        later): a joiner, once what it receives into is built (``state_transfer.prepare_arrival``).
        Its peers' groups are ready only when it arrives, so the survivors train on meanwhile; before
        the gate they switched and then waited for it inside the start-step agreement (3.7 s on
        soak (a) with a joiner building 13 layers next to another joiner's start-up)."""
        self.before = before
        self.gate = threading.Event() if gated else None
        self.generation, self.rank, self.world_size = generation, rank, world_size
        self.subgroups = [list(ranks) for ranks in subgroups]
        self.collective_timeout, self.arrival_timeout = collective_timeout, arrival_timeout
        self.done = threading.Event()
        self.store: dist.Store | None = None
        self.backends: list = []
        """The default group's gloo group, then this rank's subgroups'."""
        self.error: BaseException | None = None
        self.abandoned = False
        threading.Thread(target=self._form, args=(connect,), daemon=True, name=f"prepare-gen{generation}").start()

    def _form(self, connect: Callable[[], dist.Store]) -> None:
        try:
            if self.before is not None:
                self.before()
            if self.gate is not None:
                self.gate.wait(self.arrival_timeout.total_seconds())
            self.store = connect()
            prefixed = dist.PrefixStore(f"gen{self.generation}", self.store)
            _await_arrivals(
                prefixed,
                self.generation,
                self.world_size,
                self.arrival_timeout,
                None,
                _arrival_reader(self.store, self.generation),
            )
            prepared = dist.PrefixStore("prepared", prefixed)
            backends = [dist.ProcessGroupGloo(prepared, self.rank, self.world_size, self.collective_timeout)]
            # Every member forms its subgroups in the same global order: the lowest one still forming
            # has all its members at it, so they cannot wait on each other in a cycle.
            for k, ranks in enumerate(self.subgroups):
                if self.rank in ranks:
                    backends.append(
                        dist.ProcessGroupGloo(
                            dist.PrefixStore(f"sub{k}", prepared),
                            ranks.index(self.rank),
                            len(ranks),
                            self.collective_timeout,
                        )
                    )
            self.backends = backends
        except Exception as error:  # noqa: BLE001 - a peer gone meanwhile; said when the switch comes
            self.error = error
        finally:
            self.done.set()
        if self.abandoned:
            self.backends = []

    def ready(self) -> bool:
        return self.done.is_set()

    def may_arrive(self) -> None:
        """Open a ``gated`` group's arrival (nothing for one that is not)."""
        if self.gate is not None:
            self.gate.set()


def _install(prepared: PreparedGroup, poll: Callable[[], Any] | None, timeout: timedelta) -> Any:
    """Wait for ``prepared`` (``poll``'s answer instead if it has one) and make it the default group."""
    deadline = time.monotonic() + timeout.total_seconds()
    pause = ARRIVAL_FIRST_POLL_S  # ``done`` ends the wait at once: the pause only spaces the looks for a command
    while not prepared.done.wait(pause):
        pause = min(2 * pause, ARRIVAL_SLOW_POLL_S)
        if poll is not None and (pending := poll()) is not None:
            prepared.abandoned = True
            return pending
        if time.monotonic() > deadline:
            prepared.abandoned = True
            raise PeerFailure(
                f"generation {prepared.generation}: the group formed in the background was not ready within {timeout}"
            )
    if prepared.error is not None or not prepared.backends:
        raise PeerFailure(f"generation {prepared.generation}: rendezvous failed: {prepared.error}")
    _handed_out[:] = prepared.backends
    prepared.backends = []  # torch holds them from here
    dist.distributed_c10d._world.group_count = 0  # see the module docstring
    try:
        dist.init_process_group(
            PREPARED_BACKEND,
            store=dist.PrefixStore(f"gen{prepared.generation}", prepared.store),
            rank=prepared.rank,
            world_size=prepared.world_size,
            timeout=prepared.collective_timeout,
        )
    except RuntimeError as error:
        _retire_prepared()
        raise PeerFailure(f"generation {prepared.generation}: rendezvous failed: {error}") from error
    # The subgroups' stay in _handed_out for the engine's new_group calls.
    _keep_store(prepared.store)
    return None


_store_in_use: dist.Store | None = None
"""The store the current default group was formed on (see the end of ``join_generation``)."""


class RetiredGroups:
    """Process groups this worker left, destroyed off the training thread.

    Every group a generation formed (its default group, its subgroups, prepared ones it never
    asked for) comes here when the worker leaves the generation, aborted or not, and is destroyed
    (its C++ destructor runs, without the GIL: torch binds process groups with a GIL-free
    destructor) once this holds the last Python reference to it, each in a thread of its own.

    Why: a gloo group's destructor joins its worker threads, so it waits for every operation still
    pending on it. An iteration abandoned because the master re-planned leaves its gradient
    all-reduce pending on the old subgroup until the group's timeout (``collective_timeout``) or
    until every peer closed that group. Whichever thread drops the last reference waits that
    long: before this, the training thread, when the worker released the previous generation
    after the new one's first step, or wherever the garbage collector happened to free the
    engine's reference cycle (a forward, the data packing). The survivors' next step then took
    3-7 s on every pipeline (measured under churn, ``scripts/soak_churn.py``; a 2-process
    reproduction blocked the dropping thread for the group's full 4 s timeout). A thread per
    group, because one blocked destructor must not keep the other groups' sockets open: a peer's
    pending operation on those ends only when they close.

    An engine kept for a recovery of the recovery (the worker's "committed" generation) keeps its
    subgroups alive as long as it needs them. At exit the rest are destroyed before the
    interpreter stops (a destructor cut short by the exit aborts the process).
    """

    def __init__(self) -> None:
        self._groups: list = []
        self._lock = threading.Lock()  # the list, the destroyers
        self._destroyers: list[threading.Thread] = []
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False

    def add(self, groups) -> None:
        with self._lock:
            self._groups.extend(groups)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="retired-groups", daemon=True)
                self._thread.start()
                atexit.register(self.close)
        self._wake.set()

    def check_now(self) -> None:
        """Look for groups nobody else holds now instead of at the next ``RETIRE_POLL_S`` tick."""
        self._wake.set()

    def close(self) -> None:
        """Destroy every retired group now (at exit): those no one else holds, and wait for the destroyers.

        The retiring thread is stopped first, so that every destroyer it started is in the list joined
        here (one it started after the list was taken was never joined, and one registered but not yet
        started made the join raise: "cannot join thread before it is started", seen at a CI run's exit)."""
        with self._lock:
            self._closed = True
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        with self._lock:
            groups, self._groups = self._groups, []
            destroyers, self._destroyers = self._destroyers, []
        groups.clear()
        for thread in destroyers:
            thread.join()

    def pending(self) -> int:
        """Groups retired and not destroyed yet (held elsewhere, or their destructor still running)."""
        with self._lock:
            return len(self._groups) + sum(t.is_alive() for t in self._destroyers)

    def _run(self) -> None:
        while True:
            self._wake.wait(RETIRE_POLL_S)
            self._wake.clear()
            with self._lock:
                if self._closed:
                    return
                # getrefcount counts its own argument and the list's slot: 2 means nobody else holds it.
                unused = {i for i in range(len(self._groups)) if sys.getrefcount(self._groups[i]) <= 2}
                done = [g for i, g in enumerate(self._groups) if i in unused]
                self._groups = [g for i, g in enumerate(self._groups) if i not in unused]
                self._destroyers = [t for t in self._destroyers if t.is_alive()]
            # Outside the lock, and without binding a group to a name of this frame: this thread must never
            # hold a group's last reference. It did (the loop variable kept the last group started, and a
            # destroyer that ran before ``done.clear()`` left that list the last holder), so a group's destructor
            # ran here, under the lock, for up to the group's timeout, and every ``add`` waited: a join's
            # survivor stalled ~9.5 s in ``leave_group`` at the switch (5 of 8 runs of a scaled cornstarch job,
            # found with py-spy).
            while done:  # each started under the lock: ``close`` joins only started threads
                with self._lock:
                    thread = threading.Thread(target=_destroy, args=([done.pop()],), name="destroy-group", daemon=True)
                    self._destroyers.append(thread)
                    thread.start()


def _destroy(holder: list) -> None:
    holder.clear()  # the group's destructor runs here, in this thread


RETIRE_POLL_S = 0.2
"""How often the retired groups are checked for their last user (an engine kept for recovery)."""

RETIRED = RetiredGroups()


NCCL_ABORT_WAIT = timedelta(seconds=10)
"""Longest wait for NCCL's communicators to abort after a failure before the worker goes on without."""


def leave_group(abort: bool = False) -> None:
    """Destroy this process's default group, if any.

    ``abort`` (after a failure) on NCCL: communicators with a collective in flight to a dead peer
    can hang ``destroy_process_group``; aborting them first (torch's ``_abort_process_group``, in a
    thread bounded by ``NCCL_ABORT_WAIT``) frees the device, then the default group is destroyed
    here. On gloo the default group is retired like the others, even on abort: its destructor
    waits for an operation still pending on it (an abandoned start-step agreement, whose peers
    went on to a later generation and keep their side open) until the group's timeout, and in the
    training thread that held the node out of the next generation's rendezvous (``leave_s`` 7.0 s,
    and the whole job with it, under ``scripts/soak_churn.py``). ``RETIRED`` starts its destructor
    at once, so its connections still close within milliseconds when nothing is pending, and peers
    blocked on this worker (a point-to-point transfer, which cannot be interrupted) fail fast.

    Every other group of the generation (all of them, without ``abort``) is unregistered at once and
    handed to ``RETIRED``, which runs their destructors in the background: a gloo group's destructor takes 10-40 ms when
    idle (gloo's event loop retires each pair's socket on its next 10 ms tick), which the survivors
    of a join would otherwise wait out, and up to the group's timeout when an abandoned operation
    is still pending on it (see ``RetiredGroups``).
    """
    _retire_prepared()  # prepared subgroups the last generation did not ask for are not the next one's
    if not dist.is_initialized():
        return
    groups = list(dist.distributed_c10d._world.pg_names)  # before destroy drops torch's references
    nccl_abort = abort and dist.get_backend() == "nccl"
    if nccl_abort:  # the default group is destroyed here, after its communicators' abort
        world = dist.distributed_c10d._get_default_group()
        groups = [g for g in groups if g is not world]
        del world
    RETIRED.add(groups)
    if nccl_abort:
        from torch.distributed.distributed_c10d import _abort_process_group

        worker = threading.Thread(target=_abort_process_group, name="nccl-abort", daemon=True)
        worker.start()
        worker.join(NCCL_ABORT_WAIT.total_seconds())
        if worker.is_alive():
            log.warning(
                "NCCL abort still running after %.0f s; leaving the group without it", NCCL_ABORT_WAIT.total_seconds()
            )
        if not dist.is_initialized():
            return
    try:
        dist.destroy_process_group()
    except (RuntimeError, ValueError) as error:  # an aborted group may already be gone
        log.warning("leaving the process group: %s", error)
    RETIRED.check_now()  # torch let go of them just now: the default group's connections close at once


def _retire_prepared() -> None:
    """Hand the prepared groups nobody asked for to ``RETIRED`` (not destroyed in this thread)."""
    if _handed_out:
        RETIRED.add(list(_handed_out))
        _handed_out.clear()
