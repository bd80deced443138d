"""The master process wiring: run dir, token, event log, gRPC server (coordinator and rendezvous store), control thread.

``MasterServer`` is what ``oobleck-launch master`` runs and what ``oobleck-launch
local`` embeds: ``start()`` binds (printing where), ``wait()`` returns the exit
code once the coordinator finished, ``stop()`` releases everything.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import threading
from concurrent import futures
from dataclasses import dataclass, replace
from typing import Callable

import grpc

from oobleck_mm.master.checkpointing import resume_step
from oobleck_mm.master.coordinator import Coordinator, RunOptions
from oobleck_mm.master.journal import Journal, end_journal, write_journal
from oobleck_mm.master.metrics import MetricsSink
from oobleck_mm.master.run_dir import default_run_dir, make_run_dir
from oobleck_mm.master.planning import PlannerPool
from oobleck_mm.master.stalls import StallWatch
from oobleck_mm.master.status import StatusBoard, StatusServer
from oobleck_mm.master.service import AioTokenInterceptor, CoordinatorService, add_coordinator_service
from oobleck_mm.master.store import KeyValueStore, RendezvousStoreService
from oobleck_mm.errors import ExitCode, UserError
from oobleck_mm.events import EventLog, read_events
from oobleck_mm.protocol import MESSAGE_OPTIONS
from oobleck_mm.protocol import oobleck_pb2_grpc as pb_grpc
from oobleck_mm.protocol.auth import new_token, read_token, write_token

log = logging.getLogger(__name__)

_WILDCARD_HOSTS = ("", "0.0.0.0", "::", "[::]")
UNARY_THREADS = 32
"""Threads for the unary calls (registrations, heartbeats, reports, store operations), beyond the store's
long polls: each is short; the nodes' event streams take none (coroutines on the server's loop)."""
MAX_STORE_WAITERS = 512
"""Most store ``get``s held on the server at once (a long poll each); more waiters poll (``oobleck_mm/master/store.py``)."""
MAX_PENDING_CALLS = 1 << 20
"""Calls gRPC's core may hold before the server's loop picks them up (``grpc.server.max_pending_requests``
and its ``_hard_limit``). gRPC's defaults, 1,000 and 3,000, cancel every call past them: when 4,000 agents
registered and subscribed at once, the master's streams stopped at 2,740-2,979 and the rest were
cancelled (CANCELLED at the agents), found with a bare ``grpc.aio`` server that yields once per stream
(``docs/benchmarks.md``). A node's call waits here instead; each pending call costs gRPC a few KB."""
SERVER_OPTIONS = MESSAGE_OPTIONS + [
    ("grpc.server.max_pending_requests", MAX_PENDING_CALLS),
    ("grpc.server.max_pending_requests_hard_limit", MAX_PENDING_CALLS),
]
HEARTBEATS_PER_S_BUDGET = 2000.0
"""Heartbeats a second past which the master warns at start. Measured (``scripts/bench_control_plane.py``,
2 cores shared with the emulated agents): 1,000 nodes every 0.5 s (2,000 a second) held at 0.50 cores,
about 0.25 ms of the master's CPU per beat; 4,000 nodes every 1 s were not held there (nodes lost before
any was stopped). The master's gRPC runs on one event loop, so the budget does not grow with its cores."""
STALL_LOG = "master-stalls.log"
"""In the run dir: every thread's stack, each time a control-loop pass (a tick, then a wait of at most
``detector_tick``) has not come back after ``fault_tolerance.heartbeat_timeout`` (``oobleck_mm/master/stalls.py``); the
console gets one line saying so. A stall that long delays a failure's detection by a whole timeout; shorter
ones (1-3 s on two shared cores) are only logged as ``master_stalled``, which says how long."""
SERVER_CALL_S = 30.0
"""Longest the master waits for its gRPC server's loop to start, bind or stop the server."""


@dataclass(frozen=True, slots=True)
class MasterOptions:
    host: str = "127.0.0.1"
    port: int = 29400
    """gRPC port; 0 picks a free one."""
    run_dir: str = ""
    """Where the token and the event log go by default; created if missing."""
    token_file: str | None = None
    """Read the token from here if the file exists, else generate one and write it here (0600)."""
    event_log: str | None = None
    resume_dir: str = ""
    """Checkpoint to continue from (``--resume``)."""
    save_final_dir: str = ""
    """Where the workers write the final model and optimizer states (``--save-final``)."""
    resume_command: str = "oobleck-launch master --config CONFIG"
    """How the user restarts this job; printed with ``--resume DIR`` when it stops below the threshold."""
    log_every: int = 1
    """Console lines every N steps (``--log-every``)."""
    tensorboard: bool = True
    """TensorBoard event files in ``<run dir>/tensorboard`` next to ``metrics.csv``."""
    status_host: str = "127.0.0.1"
    """Where the live status page listens (``master.status``): this machine only by default."""
    status_port: int = 0
    """Its port: 0 a free one, -1 no page."""
    stall_dumps: bool = True
    """Write every thread's stack to ``RUN_DIR/master-stalls.log`` when a control-loop pass stalls
    (``STALL_LOG``)."""
    planner_start: str = "spawn"
    """How the planning helper starts (``master.planning.PlannerPool``): ``fork`` only where this process
    runs nothing of gRPC's before ``start`` (``oobleck-launch master``), ``spawn`` for a master embedded in
    a process that may."""


def aio_server(threads: int, interceptors: list) -> grpc.aio.Server:
    """The master's gRPC server (call on its event loop): ``threads`` for the plain-function handlers,
    ``SERVER_OPTIONS``."""
    pool = futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="grpc")
    return grpc.aio.server(migration_thread_pool=pool, interceptors=interceptors, options=SERVER_OPTIONS)


def heartbeat_load_warning(nodes: int, interval_s: float) -> str | None:
    """What to tell a user whose nodes would heartbeat more often than the master is measured to take
    (``HEARTBEATS_PER_S_BUDGET``), with the interval that would fit; None when they fit."""
    rate = nodes / interval_s
    if rate <= HEARTBEATS_PER_S_BUDGET:
        return None
    fits = nodes / HEARTBEATS_PER_S_BUDGET
    return (
        f"{nodes} nodes heartbeating every {interval_s:g}s send the master {rate:,.0f} heartbeats a second, "
        f"past the {HEARTBEATS_PER_S_BUDGET:,.0f} it was measured to keep up with (about 0.25 ms each); "
        f"a master behind on heartbeats declares healthy nodes lost. Set "
        f"fault_tolerance.heartbeat_interval to at least {fits:g}s (and heartbeat_timeout to several "
        f"intervals)."
    )


def _quiet_poller_at_exit(loop: asyncio.AbstractEventLoop, context: dict) -> None:
    """The loop's exception handler: gRPC's asyncio poller reads its notification socket after gRPC closed it
    when the process exits with the loop still running (an error exit, a signal), and asyncio logged that as
    an ERROR with a traceback after the job's own message (grpc/grpc#25364 is its multi-loop cousin; Cirq
    filters it the same way). Only that read is dropped; every other error is logged as asyncio would."""
    error = context.get("exception")
    if isinstance(error, OSError) and error.errno in (errno.EBADF, errno.EAGAIN):
        tb = error.__traceback__
        while tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
        if tb is not None and "completion_queue" in tb.tb_frame.f_code.co_filename:
            return
    loop.default_exception_handler(context)


def format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


class MasterServer:
    def __init__(
        self, job, options: MasterOptions, progress: Callable[[str], None] = print, journal: Journal | None = None
    ) -> None:
        """``journal``: a restarted master (``--resume-master``) re-adopts the job it describes; ``job``
        is then the journal's and ``options.run_dir`` the run dir it was read from."""
        # Command-line overrides are already in ``job`` (config.apply_overrides): one source of truth.
        self.job, self.options, self.progress = job, options, progress
        self.journal = journal
        self.num_nodes, self.steps = job.cluster.nodes, job.training.steps
        self.run_dir = options.run_dir or default_run_dir(job.model.name)
        if journal is not None:  # the first master checked the data and the checkpoint
            self.run_options = RunOptions(**journal.options)
        else:
            self.run_options = _run_options(job, options, self.run_dir, progress)  # checks --resume first
            _check_data(job, progress)  # every sample's files, once, before any worker reads them
        make_run_dir(self.run_dir)
        self.event_log_path = options.event_log or os.path.join(self.run_dir, "events.jsonl")
        self.token_file = options.token_file or os.path.join(self.run_dir, "token")
        self.token = _load_or_create_token(self.token_file)
        self.events = EventLog(self.event_log_path)
        self.metrics = MetricsSink(self.run_dir, tensorboard=options.tensorboard)
        self.events.subscribe(self.metrics)  # metrics.csv and TensorBoard: views of the event log
        self.port = 0
        self._server: grpc.aio.Server | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        """The gRPC server's event loop, run by a thread of its own."""
        self._store = None
        self._planner: PlannerPool | None = None
        self._done = threading.Event()
        self._exit_code = ExitCode.ERROR
        self.coordinator: Coordinator | None = None
        self.status: StatusServer | None = None
        """The live status page (``master/status.py``); None with ``status_port`` -1."""

    @property
    def address(self) -> str:
        return format_address(self.options.host, self.port)

    def start(self) -> None:
        # First, from the main thread (the helper's parent-death signal follows the thread that started it),
        # and before this master's gRPC threads exist: a forked helper copies only this thread.
        self._planner = PlannerPool(self.options.planner_start)
        host = self.options.host
        advertised = "" if host in _WILDCARD_HOSTS else host.strip("[]")
        # Long polls of the rendezvous store may hold up to this many of the unary calls' threads (the event
        # streams hold none: they are coroutines, oobleck_mm/master/service.py); the others poll (oobleck_mm/master/store.py).
        waiters = max(4, min(MAX_STORE_WAITERS, self.num_nodes // 2 + 4))
        threads = UNARY_THREADS + waiters
        self._loop = asyncio.new_event_loop()
        self._loop.set_exception_handler(_quiet_poller_at_exit)
        threading.Thread(target=self._loop.run_forever, name="grpc-aio", daemon=True).start()

        async def bind() -> tuple[grpc.aio.Server, int]:
            server = aio_server(threads, [AioTokenInterceptor(self.token, self._refused)])
            try:
                return server, server.add_insecure_port(format_address(host or "0.0.0.0", self.options.port))
            except RuntimeError:
                return server, 0

        self._server, self.port = self._on_loop(bind())
        if self.options.status_port >= 0:
            board = StatusBoard(self.job.model.name, self.steps)
            if os.path.exists(self.event_log_path):  # a restarted master's page shows the job from its start
                for record in read_events(self.event_log_path):
                    board(record)
            self.events.subscribe(board)
            try:
                self.status = StatusServer(
                    board, self.token, self.options.status_host, self.options.status_port
                ).start()
            except OSError as error:
                raise UserError(
                    f"--status-port: cannot listen on {self.options.status_host}:{self.options.status_port} "
                    f"({error.strerror}); another port, 0 for a free one, or -1 for no page"
                ) from None
        if not self.port:
            raise UserError(f"--port: cannot listen on {format_address(host, self.options.port)} (in use?)")
        # The workers' rendezvous keys: served here, behind the token, instead of by torch's TCPStore
        # (which answers anyone who reaches its port; oobleck_mm/master/store.py).
        self._store = KeyValueStore()
        self.events.subscribe(self._forget_old_rendezvous)
        self.coordinator = Coordinator(
            self.job,
            num_nodes=self.num_nodes,
            steps=self.steps,
            store_host=advertised,
            store_port=self.port,
            events=self.events,
            progress=self.progress,
            planner=self._planner,
            options=self.run_options,
            disk_thread=True,
        )
        self.coordinator.journal_to = self._write_journal
        self.coordinator.prepare_meta()
        if self.journal is not None:
            self.coordinator.adopt(self.journal)
        add_coordinator_service(CoordinatorService(self.coordinator), self._server)
        pb_grpc.add_RendezvousStoreServicer_to_server(RendezvousStoreService(self._store, waiters), self._server)
        self._on_loop(self._server.start())
        self.events.write(
            "master_started",
            address=self.address,
            nodes=self.num_nodes,
            steps=self.steps,
            pid=os.getpid(),
            status_port=self.status.port if self.status else None,
        )
        threading.Thread(target=self._control_loop, name="control", daemon=True).start()
        warning = heartbeat_load_warning(
            self.job.cluster.max_nodes or self.num_nodes, self.job.fault_tolerance.heartbeat_interval.total_seconds()
        )
        if warning:
            log.warning("%s", warning)

    def _write_journal(self, journal: Journal) -> None:
        write_journal(self.run_dir, replace(journal, host=self.options.host, port=self.port))

    def _refused(self, peer: str, method: str, reason: str) -> None:
        if self.coordinator is not None:
            self.coordinator.refused(peer, method, reason)

    def _forget_old_rendezvous(self, record) -> None:
        """Once generation g is decided, no worker rendezvouses in one before g-1 any more."""
        if record.get("event") == "plan_decided" and self._store is not None:
            self._store.forget_generations_before(int(record["generation"]) - 1)

    def _control_loop(self) -> None:
        assert self.coordinator is not None
        timeouts = self.job.fault_tolerance
        tick = timeouts.detector_tick.total_seconds()
        result = None
        watch = None
        if self.options.stall_dumps:
            watch = StallWatch(
                os.path.join(self.run_dir, STALL_LOG), timeouts.heartbeat_timeout.total_seconds(), log.warning
            ).start()
        try:
            while True:
                if watch is not None:
                    watch.passed()
                if (result := self.coordinator.tick()) is not None:
                    break
                self.coordinator.wait_for_change(tick)
        except Exception as exc:  # a bug: end the job loudly rather than hang it
            log.exception("control loop failed")
            self.coordinator.finish(ExitCode.ERROR, f"master control loop failed (a bug): {exc!r}")
            result = self.coordinator.finish_result
        finally:  # whatever failed above, the master exits: wait() must return
            if watch is not None:
                watch.stop()
            try:
                # Let every agent read its Shutdown before the server goes away (queued behind the run dir's
                # writes, if any), and let those writes end before the journal is ended.
                self.coordinator.wait_streams_closed(timeout=timeouts.shutdown_grace.total_seconds())
                # The writes are the journal, meta.json of the checkpoint the exit message names and the events
                # queued behind them: waited for as long as a checkpoint round, not the agents' grace (a stop's
                # meta.json outlasted 3 s under load: its checkpoint was left unreadable).
                flush_s = max(timeouts.shutdown_grace, timeouts.checkpoint_round_timeout).total_seconds()
                if not self.coordinator.flush_disk(timeout=flush_s):
                    log.warning("the run dir's writes did not finish within %.0f s (checkpoint_round_timeout)", flush_s)
            finally:
                self._exit_code = result.exit_code if result is not None else ExitCode.ERROR
                end_journal(self.run_dir, self._exit_code)  # its agents were told: nothing left to re-adopt
                self._done.set()

    def wait(self, timeout: float | None = None) -> int | None:
        """The exit code once the job finished, or None if ``timeout`` passed first."""
        return self._exit_code if self._done.wait(timeout) else None

    def request_stop(self, reason: str) -> None:
        """A graceful stop from outside (a first SIGTERM or SIGINT): checkpoint the step, then exit 3."""
        if self.coordinator is not None:
            self.coordinator.request_stop(reason)
        else:
            self.finish(ExitCode.ERROR, f"stopped on request ({reason}) before the job started")

    def finish(self, exit_code: int, message: str) -> None:
        """Ends the job from outside (a signal, the local launcher)."""
        if self.coordinator is not None:
            self.coordinator.finish(exit_code, message)
        else:
            self._done.set()

    @property
    def message(self) -> str:
        result = self.coordinator.finish_result if self.coordinator else None
        return result.message if result else ""

    def _on_loop(self, coroutine, timeout: float = SERVER_CALL_S):
        """Runs ``coroutine`` on the gRPC server's event loop and returns its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout)

    def stop(self) -> None:
        if self.status is not None:
            self.status.stop()
            self.status = None
        if self._server is not None:
            self._on_loop(self._server.stop(grace=0.5))
            self._server = None
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
        if self._planner is not None:
            self._planner.close()
        self.events.close()
        self.metrics.close()


def _run_options(job, options: MasterOptions, run_dir: str, progress: Callable[[str], None]) -> RunOptions:
    """The coordinator's options; raises ValueError naming the flag when a checkpoint does not fit the job."""
    ft = job.fault_tolerance
    if ft.recovery == "restart" and ft.checkpoint_interval == 0:
        log.warning("recovery: restart with checkpoint_interval 0 restarts every failure from the first step")
    resume_dir = os.path.abspath(options.resume_dir) if options.resume_dir else ""
    return RunOptions(
        resume_dir=resume_dir,
        resume_step=resume_step(resume_dir, job, progress) if resume_dir else 0,
        save_final_dir=os.path.abspath(options.save_final_dir) if options.save_final_dir else "",
        checkpoint_root=os.path.abspath(run_dir),
        recovery=ft.recovery,
        checkpoint_interval=ft.checkpoint_interval,
        resume_command=options.resume_command,
        log_every=options.log_every,
    )


def _check_data(job, progress: Callable[[str], None]) -> None:
    """Every sample checked once in the master, before any worker reads one (``data/check.py``): a bad
    one is a ``UserError`` naming it, or, with ``data.skip_bad_samples``, left out of the config the
    workers get (``data.excluded_samples``)."""
    from oobleck_mm.data.check import check_samples  # torch: the master's planning imports it anyway

    check_samples(job, progress)


def _load_or_create_token(path: str) -> str:
    if os.path.exists(path):
        return read_token(path)
    token = new_token()
    write_token(path, token)
    return token
