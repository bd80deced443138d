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
- the main thread: feeds each inbox item to the agent's machine
  (``oobleck_mm.agent.machine``, where every decision is taken) and carries out
  the effects it returns: starts workers (one per GPU, once registered; they
  report ``ready`` once imported and warmed up, and a joining node is admitted
  then), hands assignments and commands over their pipes, checks them with
  psutil every heartbeat interval, stops, kills or replaces them, calls the
  master; on any exit path it kills every worker tree.

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

import grpc
import psutil

from oobleck_mm.agent import effects as fx
from oobleck_mm.agent import inputs as ev
from oobleck_mm.agent import machine
from oobleck_mm.agent.workdir import WORK_DIR_PREFIX, remove_stale_work_dirs, write_private
from oobleck_mm.agent.options import AgentOptions, fault_tolerance_of, split_address
from oobleck_mm.agent.pipes import ReportPipes
from oobleck_mm.agent.reports import ReportLog
from oobleck_mm.agent.workers import (
    REPORTS_DRAIN_S,
    Worker,
    start_worker_template,
    stop_all,
)
from oobleck_mm.errors import ExitCode
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


class Agent:
    def __init__(self, options: AgentOptions) -> None:
        self.o = options
        self.master_host, self.master_port = split_address(options.master)
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
        self.state: machine.AgentState | None = None
        """The machine's state (``oobleck_mm.agent.machine``): every decision is taken there."""
        self.settings: machine.Settings | None = None
        self._collecting = False
        """The workers' CheckpointDone reports go to the machine (``CollectShares``), not to a master."""
        self._holding = False
        """The master is lost: reports are kept for the next one (``HoldReports``, until ``Rejoin``)."""
        self._link = 0
        """Counts (re)connections: a heartbeat thread of an older one stops."""
        self._template_started: float | None = None
        """Monotonic time the worker template was started (agent.workers.start_worker_template)."""
        self._since: float | None = None
        """Where a worker started now counts its start-up from (None: its own start)."""
        self._reports = ReportLog()
        self._reports_lock = threading.Lock()
        """Orders forwarding (the reports thread) against replaying to a new master (the main thread)."""

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
            self.config_path = write_private(os.path.join(self._work_dir, "job.yaml"), reply.config_yaml)
            self.ref = pb.NodeRef(node=self.o.node, session=reply.session)
            self.timeouts = fault_tolerance_of(reply.config_yaml)
            self.interval = self.timeouts.heartbeat_interval.total_seconds()
            self.settings = machine.Settings.of(self.timeouts, self.o.left_exit_code, reply.resume_command)
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
            first = machine.registered(reply.session, reply.gpus, time.monotonic(), self.settings)
            self.state = first.state
            self._since = self._template_started  # the first workers' wait counts from the template's start
            self._carry_out(first)
            self._since = None
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
        while self.state.exit_code is None:
            try:
                kind, value = self.inbox.get(timeout=min(0.1, self.interval))
            except queue.Empty:
                kind, value = "tick", None
            self._feed(ev.from_inbox(kind, value))
        return self.state.exit_code

    def _feed(self, event: ev.Event) -> None:
        self._carry_out(machine.step(self.state, event, time.monotonic(), self.settings))

    def _carry_out(self, transition: machine.Transition) -> None:
        """Every effect in order; one that asks the outside world a question feeds its answer back in."""
        if transition.reason:
            log.debug("agent machine: %s", transition.reason)
        answers = []
        for effect in transition.effects:
            answer = _EFFECTS[type(effect)](self, effect)
            if answer is not None:
                answers.append(answer)
        for answer in answers:
            self._feed(answer)

    # ------------------------------------------------------------------ effects
    def _do_log(self, e: fx.Log) -> None:
        log.log(e.level, "%s", e.text)

    def _do_start_worker(self, e: fx.StartWorker) -> None:
        self._start_worker(e.local_rank, since=self._since)

    def _do_send_assignment(self, e: fx.SendAssignment) -> None:
        assignment = e.assignment
        # The rendezvous store is the master's RendezvousStore service, where this agent reaches the
        # master; the token goes to the worker on the local pipe only.
        assignment.store_host, assignment.store_port = self.master_host, self.master_port
        assignment.store_token = self.o.token
        log.info(
            "generation %d: local rank %d is rank %d of %d",
            assignment.generation,
            e.local_rank,
            assignment.rank,
            assignment.world_size,
        )
        self.workers[e.local_rank].send(pb.WorkerCommand(assignment=assignment))  # a dead one: supervision

    def _do_send_all(self, e: fx.SendAll) -> None:
        with self._workers_lock:
            workers = list(self.workers.values())
        for worker in workers:
            worker.send(e.command)

    def _do_stop_workers(self, e: fx.StopWorkers) -> None:
        with self._workers_lock:
            workers = list(self.workers.values())
        # The workers stay in ``self.workers`` meanwhile: the reports thread forwards their last reports.
        stop_all(workers, e.grace, e.shutdown, drain_s=REPORTS_DRAIN_S if e.drain else 0.0)
        if e.forget:
            with self._workers_lock:
                self.workers = {}
            self._pipes.retire(workers)

    def _do_kill_workers(self, e: fx.KillWorkers) -> None:
        self._kill_workers()

    def _do_quiet(self, e: fx.Quiet) -> None:
        self._stopping.set()

    def _do_ask_leave(self, e: fx.AskLeave) -> ev.LeaveAnswered:
        """The preemption notice: the master plans this node out at the next iteration boundary."""
        try:
            self.stub.Leave(
                pb.LeaveRequest(node=self.ref, reason="preemption notice (SIGTERM to its agent)"),
                metadata=self.metadata,
                timeout=self.timeouts.report_rpc_timeout.total_seconds(),
            )
        except grpc.RpcError as err:
            return ev.LeaveAnswered(False, err.code().name)
        return ev.LeaveAnswered(True)

    def _do_report_fault(self, e: fx.ReportFault) -> None:
        request = pb.WorkerFailureRequest(node=self.ref, local_rank=e.local_rank, failure=e.kind, message=e.message)
        try:
            self.stub.ReportWorkerFailure(
                request, metadata=self.metadata, timeout=self.timeouts.report_rpc_timeout.total_seconds()
            )
        except grpc.RpcError as err:  # the master sees our stream close when we exit anyway
            log.warning("could not report the failure: %s", err.code().name)

    def _do_hold_reports(self, e: fx.HoldReports) -> None:
        with self._reports_lock:
            self._holding = True

    def _do_collect_shares(self, e: fx.CollectShares) -> None:
        self._collecting = True  # the workers' CheckpointDone reports come to the machine now (_forward)

    def _do_supervise(self, e: fx.Supervise) -> ev.WorkerFailed | None:
        for worker in list(self.workers.values()):
            fault = worker.fault()
            if fault is not None:
                return ev.WorkerFailed(fault.local_rank, fault.kind, fault.reason, fault.message)
        return None

    def _do_exit(self, e: fx.Exit) -> None:
        pass  # the main loop ends; ``run``'s clean-up kills what is left

    def _start_worker(self, local_rank: int, since: float | None = None) -> Worker:
        # On the main thread: PR_SET_PDEATHSIG follows the spawning thread.
        worker = Worker(self.o.worker_target, self.config_path, self.o.node, local_rank, self.o.worker_start, since)
        with self._workers_lock:
            self.workers[local_rank] = worker
        self._pipes.watch(worker)
        log.info("started worker %d (pid %d)", local_rank, worker.pid)
        return worker

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
            if link != self._link or self._holding:
                return  # the main thread took over (``TryMaster``), or a newer registration did
            try:
                self.stub.Heartbeat(request, metadata=self.metadata, timeout=rpc_timeout)
                last_ok = time.monotonic()
            except grpc.RpcError as err:
                if err.code() == grpc.StatusCode.NOT_FOUND:
                    # Declared lost (a hang, a partition, a host too busy to heartbeat): the same path as a
                    # stream the master ended, whichever of the two this agent sees first, so the node always
                    # registers again and joins (``TryMaster``), never exits on one and joins on the other.
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

    def _forward(self, worker: Worker, report: pb.WorkerReport) -> None:
        local_rank = worker.local_rank
        if self._collecting and report.WhichOneof("report") == "checkpoint_done":
            self.inbox.put(("saved", (local_rank, report.checkpoint_done)))
            return
        if report.WhichOneof("report") == "ready":
            worker.ready = True
            # The worker measured from its own process's start; a fork of the template skipped the
            # imports the template paid after this agent asked for it. The node's real wait:
            report.ready.startup_s = max(report.ready.startup_s, time.monotonic() - worker.since)
        with self._reports_lock:  # in order with a replay to a restarted master (``_do_rejoin``)
            seq = self._reports.record(local_rank, report)
            if self._holding:
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
    def _do_try_master(self, e: fx.TryMaster) -> ev.MasterAnswers | None:
        """One try to reach a master again: the same one (only paused or cut off for a while: it still knows
        this registration), or a restarted one (it answers NOT_FOUND to the lost one's heartbeat)."""
        rpc_timeout = self.timeouts.heartbeat_rpc_timeout.total_seconds()
        try:
            self.stub.Heartbeat(pb.HeartbeatRequest(node=self.ref), metadata=self.metadata, timeout=rpc_timeout)
            return ev.MasterAnswers(None)
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.NOT_FOUND:
                return None  # nobody answers yet
        request = pb.RegisterRequest(
            node=self.o.node,
            gpus=self.o.gpus,
            memory_bytes=psutil.virtual_memory().total,
            pid=os.getpid(),
            adopt_generation=self.state.generation,
        )
        try:
            reply = self.stub.Register(request, metadata=self.metadata, timeout=rpc_timeout)
        except grpc.RpcError as err:
            log.warning("registering again with the master failed: %s %s", err.code().name, err.details())
            return None
        return ev.MasterAnswers(reply.session, reply.adopted)

    def _do_rejoin(self, e: fx.Rejoin) -> None:
        """A master answers again: replay what it missed, then talk to it as before (``e.session``: a new
        registration with a restarted master; None: the same master, which still knows this one)."""
        with self._reports_lock:
            self._link += 1
            if e.session is not None:
                self.ref = pb.NodeRef(node=self.o.node, session=e.session)
            pending = self._reports.replay(latest=e.session is not None)  # the same master saw those
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
            self._holding = False
        # Reports first, the stream after: once its stream is open the master counts the node back.
        self._start_threads(stream=e.session is not None)
        if e.session is not None and not e.adopted:
            # The master declared this node lost meanwhile (a partition, a host too busy to heartbeat): it
            # counts it as a new node, whose workers receive every layer they hold when it joins, so nothing
            # they trained on alone is kept (they are fenced by generation).
            log.warning(
                "registered again after %.1f s without the master, which counts node %s as new (it had "
                "declared it lost, or was restarted without it): it joins as a new node and its workers "
                "receive their layers from the others",
                e.waited,
                self.o.node,
            )
            return
        log.warning(
            "%s after %.1f s without it (%d reports sent again); the workers kept training",
            "re-adopted by a restarted master" if e.session is not None else "the master answers again",
            e.waited,
            len(pending),
        )


_EFFECTS = {
    fx.Log: Agent._do_log,
    fx.StartWorker: Agent._do_start_worker,
    fx.SendAssignment: Agent._do_send_assignment,
    fx.SendAll: Agent._do_send_all,
    fx.StopWorkers: Agent._do_stop_workers,
    fx.KillWorkers: Agent._do_kill_workers,
    fx.Quiet: Agent._do_quiet,
    fx.AskLeave: Agent._do_ask_leave,
    fx.ReportFault: Agent._do_report_fault,
    fx.HoldReports: Agent._do_hold_reports,
    fx.CollectShares: Agent._do_collect_shares,
    fx.TryMaster: Agent._do_try_master,
    fx.Rejoin: Agent._do_rejoin,
    fx.Supervise: Agent._do_supervise,
    fx.Exit: Agent._do_exit,
}
