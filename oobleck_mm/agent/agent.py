"""The node agent: registers with the master, heartbeats, runs and supervises the node's workers.

Threads only observe and forward; every action on processes happens on the
main thread, in the order the inbox delivers it:

- ``stream``: the Subscribe stream -> assignments and shutdown into the inbox;
  its end without a Shutdown means the master is gone.
- ``heartbeat``: a Heartbeat every interval; silence of the master past
  ``fault_tolerance.master_silence_limit``, or a master that no longer knows
  this node (it was declared lost: it registers again and joins, as when its
  stream ends), goes into the inbox.
- ``reports``: reads every worker pipe and forwards reports to the master; the only thread that
  closes a pipe (``oobleck_mm.agent.pipes``), and a failure of its own stops the node as a fault.
- the main thread: starts workers (one per GPU, once registered; they report
  ``ready`` once imported and warmed up, and a joining node is admitted then),
  hands later assignments (and checkpoint commands) over their pipes, checks
  them with psutil every heartbeat interval, kills and forgets them all on
  ``RestartWorkers`` (restart-mode recovery: the next assignment starts fresh
  ones), replaces them on ``Bench`` (a straggler planned out for a while: the
  old ones finish the iteration in flight, fresh ones wait to join again), and
  on any exit path kills every worker tree.

A SIGTERM is a preemption notice (what spot providers send before reclaiming a
node): the agent asks the master to plan its node out (``Leave``) and goes on
training until the master's Shutdown, which its workers obey at the next
iteration boundary, so the kill that follows loses nothing. Past
``fault_tolerance.preempt_grace`` without that Shutdown, or on a second signal,
it stops like on any other signal.

When the master is lost (its stream breaks, or it is silent past
``master_silence_limit``) the workers train on: nothing of a running
generation needs the master. The agent keeps their reports (``oobleck_mm.agent.reports``)
and tries every heartbeat interval to reach the master again: the same one
(it was only paused: heartbeats answer again) or one restarted with
``--resume-master`` (a new registration naming the generation the workers
run; the kept reports are replayed). Past ``fault_tolerance.master_timeout``
(or on a SIGTERM meanwhile) the workers are told ``MasterLost``: they finish
the iteration in flight and write that step together, and the agent logs the
resume command.

Exit codes (``oobleck_mm.errors.ExitCode``): 0 after the master's Shutdown
(the end of the job, or its node planned out after a notice), 3 when the
master is lost and the workers wrote the step they were at, 1 when the master
is lost with nothing written, a worker fails, a signal arrives (a SIGTERM not
honoured within ``preempt_grace``), 2 when the master refuses the agent
(token, name).
"""

from __future__ import annotations

import faulthandler
import logging
import os
import queue
import shutil
import signal
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Callable

import grpc
import psutil

from oobleck_mm.agent.pipes import ReportPipes
from oobleck_mm.agent.reports import ReportLog
from oobleck_mm.agent.workers import (
    DEFAULT_WORKER_START,
    DEFAULT_WORKER_TARGET,
    REPORTS_DRAIN_S,
    Worker,
    WorkerFault,
    start_worker_template,
    stop_all,
)
from oobleck_mm.config import FaultToleranceConfig, parse_config_text, section_from_dict
from oobleck_mm.errors import ExitCode, UserError
from oobleck_mm.protocol import MESSAGE_OPTIONS
from oobleck_mm.protocol import oobleck_pb2 as pb
from oobleck_mm.protocol import oobleck_pb2_grpc as pb_grpc
from oobleck_mm.protocol.auth import call_metadata

log = logging.getLogger(__name__)

_REFUSALS = (
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,  # the job has cluster.max_nodes nodes already
)


EXIT_STALL_S = 5.0
"""An agent still alive this long after its run ended prints every thread's stack to its log (stderr):
its exit (a kill of its workers, the channel's close, the interpreter's shutdown) takes well under a
second, and one that did not end within 10 s was seen once in CI with nothing in the log to say where."""

RECONNECT_BACKOFF_MS = (100, 1000)
"""gRPC's reconnect backoff to the master, first and longest (its defaults: 1 s growing to 120 s). A
restarted master must find every agent back within ``fault_tolerance.adopt_window``, not after the
backoff a long outage grew."""


@dataclass(frozen=True, slots=True)
class AgentOptions:
    master: str
    """HOST:PORT of the master."""
    token: str
    node: str
    gpus: int = 0
    """Workers to run; 0: as many as the job's cluster.gpus_per_node."""
    worker_target: str = DEFAULT_WORKER_TARGET
    """"module:function" each worker process runs (see agent.workers.worker_entry)."""
    connect_timeout_s: float = 60.0
    """How long registration waits for the master to come up."""
    worker_start: str = DEFAULT_WORKER_START
    """``forkserver`` (forks of a pre-imported worker template) or ``spawn`` (agent.workers)."""
    left_exit_code: int = 0
    """Exit code when the master planned this node out after its preemption notice while the job goes on.
    0 by default; a Kubernetes Job counts a pod that exits 0 as one of its completions and never replaces
    it, so its manifest gives a code its ``podFailurePolicy`` ignores (the pod is replaced, nothing is
    counted against the Job's retries)."""


class Agent:
    def __init__(self, options: AgentOptions) -> None:
        self.o = options
        self.master_host, self.master_port = _split_address(options.master)
        self.metadata = call_metadata(options.token)
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()  # put() is safe from signal handlers
        self.workers: dict[int, Worker] = {}
        self._workers_lock = threading.Lock()  # the reports thread reads the worker list
        self._pipes = ReportPipes(self._on_report_bytes, self._on_worker_eof)
        """The workers' pipes: read, and closed, on the reports thread only (``oobleck_mm.agent.pipes`` says why)."""
        self._stopping = threading.Event()
        self._channel: grpc.Channel | None = None
        self._stream = None
        self._reports_thread: threading.Thread | None = None
        self._work_dir = ""
        self._leave_by: float | None = None
        """Monotonic deadline of a preemption notice (``preempt_grace`` after the SIGTERM)."""
        self._assigned = False
        """Some work reached this node's workers (there is a step to write if the master is lost)."""
        self._master_lost = False
        """The master is gone: the workers' CheckpointDone reports stay here (``_checkpoint_without_master``)."""
        self._generation = 0
        """The newest generation this node's workers were assigned (``RegisterRequest.adopt_generation``)."""
        self._link = 0
        """Counts (re)connections: a heartbeat thread of an older one stops."""
        self._orphaned_at: float | None = None
        """Monotonic time the master was lost while the workers train on; None: a master listens."""
        self._next_try = 0.0
        self._template_started: float | None = None
        """Monotonic time the worker template was started (agent.workers.start_worker_template)."""
        self._reports = ReportLog()
        self._reports_lock = threading.Lock()
        """Orders forwarding (the reports thread) against replaying to a new master (the main thread)."""
        self.resume_command = "oobleck-launch master --config CONFIG"

    # ------------------------------------------------------------------ entry point
    def run(self) -> int:
        first, longest = RECONNECT_BACKOFF_MS
        self._channel = grpc.insecure_channel(
            self.o.master,
            options=[
                ("grpc.initial_reconnect_backoff_ms", first),
                ("grpc.min_reconnect_backoff_ms", first),
                ("grpc.max_reconnect_backoff_ms", longest),
                *MESSAGE_OPTIONS,
            ],
        )
        self.stub = pb_grpc.CoordinatorStub(self._channel)
        old_handlers = {}
        # The worker template imports torch and the engine while this agent registers.
        self._template_started = time.monotonic()
        start_worker_template(self.o.worker_start, self.o.worker_target)
        try:
            # Until registered there is nothing to clean up: SIGINT/SIGTERM keep their default effect.
            reply = self._register()
            if isinstance(reply, int):
                return reply
            old_handlers = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
            remove_stale_work_dirs(tempfile.gettempdir(), psutil.pid_exists)  # left by SIGKILLed agents
            self._work_dir = tempfile.mkdtemp(prefix=f"{WORK_DIR_PREFIX}{self.o.node}-{os.getpid()}-")
            self.config_path = _write_private(os.path.join(self._work_dir, "job.yaml"), reply.config_yaml)
            self.resume_command = reply.resume_command or "oobleck-launch master --config CONFIG"
            self.ref = pb.NodeRef(node=self.o.node, session=reply.session)
            self.timeouts = _fault_tolerance(reply.config_yaml)
            self.interval = self.timeouts.heartbeat_interval.total_seconds()
            log.info(
                "registered as %s: %d GPUs, heartbeat every %.2fs, master given up after %.2fs of silence",
                self.o.node,
                reply.gpus,
                self.interval,
                self.timeouts.master_silence_limit.total_seconds(),
            )
            self._reports_thread = threading.Thread(
                target=self._pipes.run, args=(self._stopping, self._on_reader_failure), name="reports", daemon=True
            )
            self._reports_thread.start()
            self._start_threads()
            # The workers start now, not on the first assignment: they import and warm up while the
            # job plans (or, joining a running job, before the master admits this node).
            for local_rank in range(reply.gpus):
                self._start_worker(local_rank, since=self._template_started)
            return self._main_loop()
        finally:
            faulthandler.dump_traceback_later(EXIT_STALL_S, exit=False)  # the process's exit cancels it
            self._stopping.set()
            if self._reports_thread is not None:
                self._reports_thread.join(1.0)
            self._kill_workers()
            self._pipes.close_all()
            if self._stream is not None:
                self._stream.cancel()
            self._channel.close()
            if self._work_dir:
                shutil.rmtree(self._work_dir, ignore_errors=True)
            for sig, handler in old_handlers.items():
                signal.signal(sig, handler)
            log.info("the agent's clean-up is done; exiting")

    def _register(self) -> pb.RegisterReply | int:
        request = pb.RegisterRequest(
            node=self.o.node,
            gpus=self.o.gpus,
            memory_bytes=psutil.virtual_memory().total,
            pid=os.getpid(),
        )
        try:
            # wait_for_ready: an agent may start before its master listens.
            return self.stub.Register(
                request, metadata=self.metadata, timeout=self.o.connect_timeout_s, wait_for_ready=True
            )
        except grpc.RpcError as err:
            if err.code() in _REFUSALS:
                log.error("the master at %s refused node %s: %s", self.o.master, self.o.node, err.details())
                return ExitCode.BAD_INPUT
            log.error("cannot register with the master at %s: %s %s", self.o.master, err.code().name, err.details())
            return ExitCode.ERROR

    # ------------------------------------------------------------------ main thread
    def _main_loop(self) -> int:
        next_check = time.monotonic() + self.interval
        while True:
            try:
                kind, value = self.inbox.get(timeout=min(0.1, self.interval))
            except queue.Empty:
                kind, value = "tick", None
            if kind in ("fatal", "master_lost"):
                session, value = value
                if session != self.ref.session or self._orphaned_at is not None:
                    kind = "tick"  # a thread of an earlier registration, or the loss is known already
            if kind == "event":
                code = self._on_event(value)
                if code is not None:
                    return code
            elif kind == "fatal":
                log.error("%s; stopping the node's workers", value)
                return ExitCode.ERROR
            elif kind == "master_lost":
                if self.timeouts.master_timeout is None:
                    return self._checkpoint_without_master(value)
                # Assigned or not (a joiner not admitted yet): a restarted master takes it as it was.
                self._orphan(value)
            elif kind == "signal":
                if value == signal.SIGTERM and self._orphaned_at is not None:  # a notice, and no master to plan
                    return self._checkpoint_without_master("a preemption notice (SIGTERM) while the master is away")
                if value == signal.SIGTERM and self._leave_by is None and self._ask_to_leave():
                    continue
                log.warning("got %s; stopping the node's workers", signal.Signals(value).name)
                return ExitCode.ERROR
            if self._orphaned_at is not None:
                code = self._wait_for_master()
                if code is not None:
                    return code
            if self._leave_by is not None and time.monotonic() > self._leave_by:
                log.error(
                    "not planned out within fault_tolerance.preempt_grace (%.0f s) of the preemption "
                    "notice; stopping the node's workers",
                    self.timeouts.preempt_grace.total_seconds(),
                )
                return ExitCode.ERROR
            if kind == "worker_eof" or time.monotonic() >= next_check:
                next_check = time.monotonic() + self.interval
                fault = self._supervise()
                if fault is not None:
                    return self._report_fault(fault)

    def _on_event(self, event: pb.AgentEvent) -> int | None:
        which = event.WhichOneof("event")
        if which == "shutdown":
            log.info("shutdown from the master: %s", event.shutdown.reason)
            grace = self.timeouts.worker_stop_timeout.total_seconds()
            if event.shutdown.at_boundary:  # planned out after our notice: the iteration in flight ends first
                left = (self._leave_by or 0.0) - time.monotonic()
                grace = max(grace, left)
            else:
                self._stopping.set()  # no more heartbeats or reports: the master is going away
            with self._workers_lock:
                workers = list(self.workers.values())
            stop_all(workers, grace, event.shutdown, drain_s=REPORTS_DRAIN_S if event.shutdown.at_boundary else 0.0)
            self._stopping.set()
            if event.shutdown.at_boundary and self.o.left_exit_code:
                log.info("left the job after the notice: exit %d (--left-exit-code)", self.o.left_exit_code)
                return self.o.left_exit_code
            return ExitCode.OK
        if which == "assignment":
            self._assign(event.assignment.local_rank, event.assignment.assignment)
        elif which == "checkpoint":
            # Every worker of the node writes its share; each answers CheckpointDone on its own.
            command = pb.WorkerCommand(checkpoint=event.checkpoint)
            for worker in list(self.workers.values()):
                worker.send(command)
        elif which == "restart":
            # Restart-mode recovery: fresh processes (started by the next assignment) load the checkpoint.
            log.warning("restarting the node's workers: %s", event.restart.reason)
            self._kill_workers()
        elif which == "bench":
            self._bench(event.bench)
        return None

    def _bench(self, bench: pb.Bench) -> None:
        """Planned out for being slow (issue 29): the workers finish the iteration in flight, as on a leave
        after a notice, and fresh ones start at once, so that the node is ready when the master takes it
        back. The node stays registered and heartbeats all along: a bench is not a failure."""
        log.warning(
            "benched: %s; the workers stop at the iteration boundary, fresh ones wait to join again", bench.reason
        )
        with self._workers_lock:
            workers = list(self.workers.values())
        # A slow node's iteration in flight is bounded like any collective of the job. The workers stay
        # in ``self.workers`` meanwhile: the reports thread forwards their last reports (a checkpoint share).
        stop_all(
            workers,
            self.timeouts.collective_timeout.total_seconds(),
            pb.Shutdown(reason=bench.reason, at_boundary=True),
            drain_s=REPORTS_DRAIN_S,
        )
        with self._workers_lock:
            self.workers = {}
        self._pipes.retire(workers)
        self._assigned, self._generation = False, 0  # the fresh workers hold nothing of the job yet
        for local_rank in sorted(w.local_rank for w in workers):
            self._start_worker(local_rank)

    def _assign(self, local_rank: int, assignment: pb.Assignment) -> None:
        self._assigned = True
        self._generation = max(self._generation, assignment.generation)
        # The rendezvous store is the master's RendezvousStore service, where this agent reaches the
        # master; the token goes to the worker on the local pipe only.
        assignment.store_host, assignment.store_port = self.master_host, self.master_port
        assignment.store_token = self.o.token
        worker = self.workers.get(local_rank) or self._start_worker(local_rank)  # restart mode killed it
        log.info(
            "generation %d: local rank %d is rank %d of %d",
            assignment.generation,
            local_rank,
            assignment.rank,
            assignment.world_size,
        )
        worker.send(pb.WorkerCommand(assignment=assignment))  # a dead worker is caught by supervision

    def _ask_to_leave(self) -> bool:
        """The preemption notice: the master plans this node out at the next iteration boundary."""
        grace = self.timeouts.preempt_grace.total_seconds()
        try:
            self.stub.Leave(
                pb.LeaveRequest(node=self.ref, reason="preemption notice (SIGTERM to its agent)"),
                metadata=self.metadata,
                timeout=self.timeouts.report_rpc_timeout.total_seconds(),
            )
        except grpc.RpcError as err:
            log.error("preemption notice: the master did not take it (%s)", err.code().name)
            return False
        self._leave_by = time.monotonic() + grace
        log.warning(
            "preemption notice (SIGTERM): leaving the job at the next step boundary; the workers stop "
            "in %.0f s at the latest (fault_tolerance.preempt_grace); another signal stops them now",
            grace,
        )
        return True

    def _start_worker(self, local_rank: int, since: float | None = None) -> Worker:
        # On the main thread: PR_SET_PDEATHSIG follows the spawning thread.
        worker = Worker(self.o.worker_target, self.config_path, self.o.node, local_rank, self.o.worker_start, since)
        with self._workers_lock:
            self.workers[local_rank] = worker
        self._pipes.watch(worker)
        log.info("started worker %d (pid %d)", local_rank, worker.pid)
        return worker

    def _supervise(self) -> WorkerFault | None:
        for worker in list(self.workers.values()):
            fault = worker.fault()
            if fault is not None:
                return fault
        return None

    def _report_fault(self, fault: WorkerFault) -> int:
        log.error("worker %d failed: %s (%s); the node is lost", fault.local_rank, fault.reason, fault.message)
        request = pb.WorkerFailureRequest(
            node=self.ref, local_rank=fault.local_rank, failure=fault.kind, message=fault.message
        )
        try:
            self.stub.ReportWorkerFailure(
                request, metadata=self.metadata, timeout=self.timeouts.report_rpc_timeout.total_seconds()
            )
        except grpc.RpcError as err:  # the master sees our stream close when we exit anyway
            log.warning("could not report the failure: %s", err.code().name)
        return ExitCode.ERROR

    def _kill_workers(self) -> None:
        with self._workers_lock:
            workers, self.workers = list(self.workers.values()), {}
        for worker in workers:
            worker.kill()
        self._pipes.retire(workers)

    def _on_signal(self, signum: int, frame) -> None:
        self.inbox.put(("signal", signum))

    # ------------------------------------------------------------------ observer threads
    def _start_threads(self, stream: bool = True) -> None:
        """The threads that talk to the master under the current registration (``_link``)."""
        threading.Thread(
            target=self._heartbeat_loop, args=(self._link, self.ref), name="heartbeat", daemon=True
        ).start()
        if stream:
            threading.Thread(target=self._stream_loop, args=(self.ref,), name="stream", daemon=True).start()

    def _stream_loop(self, ref: pb.NodeRef) -> None:
        stream = self._stream = self.stub.Subscribe(ref, metadata=self.metadata)
        try:
            for event in stream:
                self.inbox.put(("event", event))
                if event.WhichOneof("event") == "shutdown":
                    return
            self.inbox.put(("master_lost", (ref.session, "the master ended the event stream without a shutdown")))
        except grpc.RpcError as err:
            if not self._stopping.is_set():
                self.inbox.put(
                    ("master_lost", (ref.session, f"lost the event stream to the master: {err.code().name}"))
                )

    def _heartbeat_loop(self, link: int, ref: pb.NodeRef) -> None:
        last_ok = time.monotonic()
        request = pb.HeartbeatRequest(node=ref)
        rpc_timeout = self.timeouts.heartbeat_rpc_timeout.total_seconds()
        silence_limit = self.timeouts.master_silence_limit.total_seconds()
        while not self._stopping.wait(self.interval):
            if link != self._link or self._orphaned_at is not None:
                return  # the main thread took over (``_wait_for_master``), or a newer registration did
            try:
                self.stub.Heartbeat(request, metadata=self.metadata, timeout=rpc_timeout)
                last_ok = time.monotonic()
            except grpc.RpcError as err:
                if err.code() == grpc.StatusCode.NOT_FOUND:
                    # Declared lost (a hang, a partition, a host too busy to heartbeat): the same path as a
                    # stream the master ended, whichever of the two this agent sees first, so the node always
                    # registers again and joins (``_wait_for_master``), never exits on one and joins on the other.
                    self.inbox.put(
                        (
                            "master_lost",
                            (ref.session, f"the master no longer knows this node ({err.details()}): registering again"),
                        )
                    )
                    return
                silent = time.monotonic() - last_ok
                log.warning("heartbeat failed (%s); no answer for %.2fs", err.code().name, silent)
                # A dead master is seen at once (its stream breaks); see master_silence_limit for why
                # silence is given this long.
                if silent > silence_limit:
                    self.inbox.put(
                        (
                            "master_lost",
                            (ref.session, f"the master has not answered for {silent:.1f}s ({err.code().name})"),
                        )
                    )
                    return

    def _on_report_bytes(self, worker: Worker, data: bytes) -> None:
        self._forward(worker, pb.WorkerReport.FromString(data))

    def _on_worker_eof(self, worker: Worker) -> None:
        self.inbox.put(("worker_eof", worker.local_rank))  # supervision says why

    def _on_reader_failure(self, error: BaseException) -> None:
        """The reports thread failed: no later report of this node would reach the master, which would wait
        for them (issue 55). The node stops as on a fault of its own; the master replaces it."""
        self.inbox.put(
            (
                "fatal",
                (
                    self.ref.session,
                    f"the reports thread failed ({error!r}): no report of this node would reach the master",
                ),
            )
        )

    def _checkpoint_without_master(self, why: str) -> int:
        """The master is gone: the workers finish the iteration in flight and write the step they are at
        together (``MasterLost``), so the run resumes from it instead of from nothing. Exit 3 with the
        resume command once this node's workers wrote their share, 1 when there is nothing to write."""
        if not self._assigned:
            log.error("%s before any work was assigned; stopping the node's workers", why)
            return ExitCode.ERROR
        log.error("%s; the workers write the step they are at, then stop", why)
        self._master_lost = True  # their CheckpointDone reports come to us now (_forward)
        with self._workers_lock:
            workers = list(self.workers.values())
        for worker in workers:
            worker.send(pb.WorkerCommand(master_lost=pb.MasterLost(reason=why)))
        deadline = (
            time.monotonic()
            + (self.timeouts.checkpoint_round_timeout + self.timeouts.collective_timeout).total_seconds()
        )
        saved: dict[int, pb.CheckpointDone] = {}
        while len(saved) < len(workers) and time.monotonic() < deadline:
            try:
                kind, value = self.inbox.get(timeout=0.1)
            except queue.Empty:
                continue
            if kind == "saved":
                saved[value[0]] = value[1]
            elif kind == "signal":
                break
        done = list(saved.values())
        if len(done) == len(workers) and all(not d.error and d.step >= 0 for d in done):
            where, step = done[0].dir, done[0].step
            log.error(
                "the master is lost; the workers wrote the checkpoint of step %d to %s; resume with: %s --resume %s",
                step,
                where,
                self.resume_command,
                where,
            )
            return ExitCode.NO_REPLICAS
        errors = "; ".join(d.error for d in done if d.error) or "no answer from every worker in time"
        log.error("the master is lost and the workers could not write a checkpoint (%s)", errors)
        return ExitCode.ERROR

    def _forward(self, worker: Worker, report: pb.WorkerReport) -> None:
        local_rank = worker.local_rank
        if self._master_lost and report.WhichOneof("report") == "checkpoint_done":
            self.inbox.put(("saved", (local_rank, report.checkpoint_done)))
            return
        if report.WhichOneof("report") == "ready":
            worker.ready = True
            # The worker measured from its own process's start; a fork of the template skipped the
            # imports the template paid after this agent asked for it. The node's real wait:
            report.ready.startup_s = max(report.ready.startup_s, time.monotonic() - worker.since)
        with self._reports_lock:  # in order with a replay to a restarted master (``_rejoin``)
            seq = self._reports.record(local_rank, report)
            if self._orphaned_at is not None:
                self._reports.hold(seq, local_rank, report)
                return
            request = pb.WorkerReportRequest(node=self.ref, local_rank=local_rank, report=report)
            try:
                self.stub.ReportWorker(
                    request, metadata=self.metadata, timeout=self.timeouts.report_rpc_timeout.total_seconds()
                )
            except grpc.RpcError as err:  # the heartbeat thread decides whether the master is gone
                log.warning("could not forward a report of worker %d: %s", local_rank, err.code().name)
                self._reports.hold(seq, local_rank, report)  # a restarted master gets it

    # ------------------------------------------------------------------ without a master
    def _orphan(self, why: str) -> None:
        """The master is lost: the workers train on while this agent waits for it (``_wait_for_master``)."""
        with self._reports_lock:
            self._orphaned_at = time.monotonic()
        self._next_try = 0.0
        wait = self.timeouts.master_timeout.total_seconds()
        log.error(
            "%s; the workers train on while this agent waits up to %.0f s (fault_tolerance.master_timeout) "
            "for the master, or one restarted with: oobleck-launch master --resume-master RUN_DIR; then "
            "they write the step they are at",
            why,
            wait,
        )

    def _wait_for_master(self) -> int | None:
        """One try per heartbeat interval to reach a master again; past ``master_timeout`` the workers write
        the step they are at (the exit code of that), else None."""
        now = time.monotonic()
        assert self._orphaned_at is not None and self.timeouts.master_timeout is not None
        waited = now - self._orphaned_at
        if waited > self.timeouts.master_timeout.total_seconds():
            return self._checkpoint_without_master(
                f"no master came back within {waited:.0f} s (fault_tolerance.master_timeout)"
            )
        if now < self._next_try:
            return None
        self._next_try = now + self.interval
        rpc_timeout = self.timeouts.heartbeat_rpc_timeout.total_seconds()
        try:  # the same master, only paused or cut off for a while: it still knows this registration
            self.stub.Heartbeat(pb.HeartbeatRequest(node=self.ref), metadata=self.metadata, timeout=rpc_timeout)
            self._rejoin(None, waited)
            return None
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.NOT_FOUND:
                return None  # nobody answers yet
        request = pb.RegisterRequest(
            node=self.o.node,
            gpus=self.o.gpus,
            memory_bytes=psutil.virtual_memory().total,
            pid=os.getpid(),
            adopt_generation=self._generation,
        )
        try:  # a restarted master: it answers NOT_FOUND to the lost one's registration
            reply = self.stub.Register(request, metadata=self.metadata, timeout=rpc_timeout)
        except grpc.RpcError as err:
            log.warning("registering again with the master failed: %s %s", err.code().name, err.details())
            return None
        self._rejoin(reply, waited)
        return None

    def _rejoin(self, reply: pb.RegisterReply | None, waited: float) -> None:
        """A master answers again: replay what it missed, then talk to it as before (``reply``: a new
        registration with a restarted master; None: the same master, which still knows this one)."""
        with self._reports_lock:
            self._link += 1
            if reply is not None:
                self.ref = pb.NodeRef(node=self.o.node, session=reply.session)
            pending = self._reports.replay(latest=reply is not None)  # the same master saw those
            for p in pending:
                request = pb.WorkerReportRequest(
                    node=self.ref, local_rank=p.local_rank, report=p.report, replayed=p.replayed
                )
                try:
                    self.stub.ReportWorker(
                        request, metadata=self.metadata, timeout=self.timeouts.report_rpc_timeout.total_seconds()
                    )
                except grpc.RpcError as err:  # it went away again: the next loss is seen as usual
                    log.warning("could not replay a report of worker %d: %s", p.local_rank, err.code().name)
            self._orphaned_at = None
        # Reports first, the stream after: once its stream is open the master counts the node back.
        self._start_threads(stream=reply is not None)
        if reply is not None and not reply.adopted:
            # The master declared this node lost meanwhile (a partition, a host too busy to heartbeat): it
            # counts it as a new node, whose workers receive every layer they hold when it joins, so nothing
            # they trained on alone is kept (they are fenced by generation).
            log.warning(
                "registered again after %.1f s without the master, which counts node %s as new (it had "
                "declared it lost, or was restarted without it): it joins as a new node and its workers "
                "receive their layers from the others",
                waited,
                self.o.node,
            )
            return
        log.warning(
            "%s after %.1f s without it (%d reports sent again); the workers kept training",
            "re-adopted by a restarted master" if reply is not None else "the master answers again",
            waited,
            len(pending),
        )


def _split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise UserError(f"--master: expected HOST:PORT, got {address!r}")
    return host.strip("[]"), int(port)


def _fault_tolerance(config_yaml: str) -> FaultToleranceConfig:
    """The job's fault-tolerance section (every timeout the agent uses derives from it)."""
    raw = parse_config_text(config_yaml) or {}
    return section_from_dict(FaultToleranceConfig, raw.get("fault_tolerance"), "fault_tolerance")


WORK_DIR_PREFIX = "oobleck-agent-"
"""An agent's private folder (the job config its workers read): ``oobleck-agent-NODE-PID-XXXX``."""


def remove_stale_work_dirs(root: str, pid_alive: Callable[[int], bool]) -> list[str]:
    """Removes the folders under ``root`` of agents that are gone (a SIGKILLed agent cannot clean up)."""
    removed = []
    for name in os.listdir(root):
        parts = name[len(WORK_DIR_PREFIX) :].rsplit("-", 2) if name.startswith(WORK_DIR_PREFIX) else []
        if len(parts) == 3 and parts[1].isdigit() and not pid_alive(int(parts[1])):
            path = os.path.join(root, name)
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _write_private(path: str, text: str) -> str:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(text)
    return path
