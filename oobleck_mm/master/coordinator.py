"""The shell around the master's state machine: threads, locks, outboxes, the planner and the files.

Every decision is ``oobleck_mm.master.machine.step``'s; this class only feeds it events
and carries out the effects it returns, in order. The gRPC handlers
(``oobleck_mm.master.service``) call ``register``, ``worker_report``, ``leave``... from
their threads; one control thread calls ``tick`` in a loop. Each call turns
into one event, applied under one lock, so events happen in one order.
Heartbeats take no lock at all: they are collected and fed to the machine at
the next tick with the time they arrived (a heartbeat must never wait for a
tick applying a plan or writing events on a busy disk).

The planner runs in a helper process (``oobleck_mm.master.planning``); its answers come
back as ``PlanAnswered`` events. Every reading of time goes through the
injected ``clock``, so tests drive the whole master by hand.
"""

from __future__ import annotations

import logging
import os
import queue
import secrets
import threading
import time
from concurrent.futures import Future
from dataclasses import replace
from typing import Callable

from oobleck_mm.master import machine
from oobleck_mm.master.checkpointing import prune_checkpoints, start_meta_sampler, write_meta
from oobleck_mm.master.effects import (
    AskPlanner,
    CancelPlan,
    EndStream,
    Finished,
    PruneCheckpoints,
    LogStep,
    ProgressMetrics,
    ProgressPhase,
    Record,
    Say,
    Send,
    StartProgress,
    WarmPlanner,
    WriteJournal,
    WriteMeta,
    PrepareMeta,
)
from oobleck_mm.master.disk import HOLD_ENV, DiskQueue, journal_hold
from oobleck_mm.master.generations import MAX_REFORMS, SETTLE_S
from oobleck_mm.master.inputs import (
    Adopt,
    Event,
    FinishRequested,
    Heartbeat,
    Leave,
    OpenStream,
    PlanAnswered,
    Register,
    Report,
    StopRequested,
    StepCompleted,
    StreamEnded,
    Tick,
    WorkerFailure,
)
from oobleck_mm.master.journal import Journal
from oobleck_mm.master.planning import InlinePlanner
from oobleck_mm.master.progress import Progress, StepFacts, logged_steps
from oobleck_mm.master.registry import RefusalCounter, Refused
from oobleck_mm.master.state import Finish, JobPhase, JobState, RunOptions, Settings
from oobleck_mm.events import EventLog
from oobleck_mm.errors import UserError
from oobleck_mm.protocol import MAX_MESSAGE_BYTES
from oobleck_mm.protocol import oobleck_pb2 as pb

log = logging.getLogger(__name__)

STREAM_CHECK_S = 0.1
"""Longest sleep between two looks at the agents' streams while waiting for them to hang up."""
END_OF_STREAM = None
"""Put on a node's outbox to end its Subscribe stream."""

__all__ = ["Coordinator", "Finish", "JobPhase", "RunOptions", "MAX_REFORMS", "SETTLE_S", "END_OF_STREAM", "Outbox"]


class Outbox(queue.Queue):
    """A node's events on their way to its Subscribe stream, put by any thread of the master.

    The stream is a task of the gRPC server's event loop (``service.CoordinatorService.Subscribe``), not a
    thread blocked in ``get``: ``listen`` gives it a callback, called after every ``put``, that wakes it."""

    def __init__(self) -> None:
        super().__init__()
        self._listener: Callable[[], None] | None = None

    def listen(self, wake: Callable[[], None]) -> None:
        self._listener = wake

    def put(self, item, block: bool = True, timeout: float | None = None) -> None:
        super().put(item, block, timeout)
        if self._listener is not None:
            self._listener()


class Coordinator:
    def __init__(
        self,
        job,
        *,
        num_nodes: int,
        steps: int,
        store_host: str,
        store_port: int,
        events: EventLog,
        clock: Callable[[], float] = time.monotonic,
        progress: Callable[[str], None] = print,
        planner=None,
        options: RunOptions = RunOptions(),
        disk_thread: bool = False,
    ) -> None:
        """``disk_thread``: write the run dir's files (journal, meta.json, pruning) from a thread of their own,
        outside the lock (``oobleck_mm.master.disk``; the server's master). Without it (a master driven by hand), each
        call has written them when it returns."""
        self.job = job
        self.num_nodes = num_nodes
        self.steps = steps
        self.events = events
        self.clock = clock
        self.say = progress
        self.planner = planner or InlinePlanner()
        self.options = options
        self.timeouts = job.fault_tolerance
        """When the control loop last looked for failed nodes (``Tick.detect``)."""
        self.settings = Settings.of(
            job, num_nodes=num_nodes, steps=steps, store_host=store_host, store_port=store_port, options=options
        )
        self.config_yaml = self.settings.config_yaml
        size = len(self.config_yaml.encode())
        if size > MAX_MESSAGE_BYTES // 2:  # the rest of a RegisterReply is small; half leaves room for growth
            raise UserError(
                f"the job's config is {size / 2**20:.0f} MiB as the agents receive it, more than "
                f"{MAX_MESSAGE_BYTES // 2 // 2**20} MiB: shorten its longest lists (data.excluded_samples "
                f"has {len(job.data.excluded_samples):,} entries)"
            )
        self.state = JobState(next_step=options.resume_step, last_progress=clock())
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._refusals = RefusalCounter()
        self._outboxes: dict[str, tuple[int, queue.Queue]] = {}
        """node -> (session, the outbox its Subscribe stream drains)."""
        self._beats: dict[str, tuple[int, float]] = {}
        """node -> (session, clock) of its latest heartbeat not yet fed to the machine."""
        self._futures: dict[int, Future] = {}
        """Planning calls on their way, by id."""
        self._sampler = None  # the data order meta.json records (building it reads the whole dataset)
        self._sampler_ready: Future | None = None
        """``prepare_meta``'s build of ``_sampler``, in the background."""
        self._progress = Progress(events, steps, progress, clock, StepFacts.of(job, options.log_every), judged=True)
        self._disk = DiskQueue(threaded=disk_thread)
        self.journal_to: Callable[[Journal], None] | None = None
        """Writes the journal (``oobleck_mm.master.journal``) before every generation's assignments go out; the
        server sets it once it knows its address. None: no journal (tests)."""

    # ------------------------------------------------------------------ what the state says
    @property
    def phase(self) -> JobPhase:
        return self.state.phase

    @property
    def generation(self) -> int:
        return self.state.generation

    @property
    def plan(self):
        return self.state.plan

    @property
    def next_step(self) -> int:
        return self.state.next_step

    @property
    def finish_result(self) -> Finish | None:
        return self.state.finish

    @property
    def registry(self):
        return self.state.registry

    # ------------------------------------------------------------------ calls from agents
    def register(
        self, node: str, gpus: int, memory_bytes: int, pid: int, peer: str, adopt_generation: int = 0
    ) -> tuple[int, int, bool]:
        """(session, gpus to run, adopted) for a new agent, or one coming back with its workers running
        ``adopt_generation``: adopted (they train on as they are) by a restarted master that journaled that
        generation, else a join like any new node's; raises Refused."""
        session = secrets.randbits(62)
        with self._lock:
            # The outbox exists before the machine sees the node (a plan answered in the same call may
            # already send to it); a refused registration puts back whatever was there.
            before = self._outboxes.get(node)
            self._outboxes[node] = (session, Outbox())
            try:
                return self._handle(
                    Register(node, session, gpus, memory_bytes, pid, peer, adopt_generation),
                    peer=peer,
                    method="Register",
                )
            except Refused:
                if before is None:
                    self._outboxes.pop(node, None)
                else:
                    self._outboxes[node] = before
                raise

    def open_stream(self, node: str, session: int) -> Outbox:
        """The outbox the node's Subscribe stream drains; raises Refused for an unknown session."""
        with self._lock:
            self._handle(OpenStream(node, session))
            return self._outboxes[node][1]

    def stream_ended(self, node: str, session: int) -> None:
        with self._lock:
            self._handle(StreamEnded(node, session))

    def heartbeat(self, node: str, session: int) -> int:
        # No lock: reading the dict and setting one entry are atomic under the GIL; the beat is fed
        # to the machine at the next tick with the time it arrived.
        entry = self.state.registry.nodes.get(node)
        if entry is None or entry.session != session:
            raise Refused("NOT_FOUND", f"node {node} (session {session}) is not registered; it may have been lost")
        self._beats[node] = (session, self.clock())
        return self.state.generation

    def worker_report(
        self, node: str, session: int, local_rank: int, report: pb.WorkerReport, replayed: bool = False
    ) -> None:
        with self._lock:
            self._handle(Report(node, session, local_rank, report, replayed))

    def worker_failure(self, node: str, session: int, local_rank: int, reason: str, message: str) -> None:
        with self._lock:
            self._handle(WorkerFailure(node, session, local_rank, reason, message))

    def leave(self, node: str, session: int, reason: str) -> None:
        """A preemption notice: planned out at the next iteration boundary (``machine``)."""
        with self._lock:
            self._handle(Leave(node, session, reason))

    def request_stop(self, reason: str) -> None:
        """A graceful stop (SIGTERM): the workers write the step they are at, then exit 3 (``stopping``)."""
        with self._lock:
            self._handle(StopRequested(reason))

    def finish(self, exit_code: int, message: str) -> None:
        """Ends the job: every live agent gets Shutdown and its stream ends."""
        with self._lock:
            self._handle(FinishRequested(exit_code, message))

    def adopt(self, journal: Journal) -> None:
        """A restarted master (``--resume-master``) takes over the journal's generations (``ADOPTING``)."""
        with self._lock:
            self._progress.seed_logged(logged_steps(self.events.path))  # before any report is replayed
            self._handle(Adopt(journal, max(0.0, time.time() - (journal.started_wall or time.time()))))

    def refused(self, peer: str, method: str, reason: str) -> None:
        """Records a refused call: the first few per peer host, then only every 10th, 100th... one."""
        count, logged = self._refusals.count(peer)
        if not logged:
            return
        self.events.write("refused", peer=peer, method=method, reason=reason, count=count)
        log.warning("refused %s from %s: %s (%d refusals from this host)", method, peer, reason, count)

    # ------------------------------------------------------------------ the control thread
    def tick(self) -> Finish | None:
        """Feeds the heartbeats that arrived, then the clock; says whether the job is over."""
        with self._lock:
            for node in list(self._beats):
                session, at = self._beats.pop(node)
                self._handle(Heartbeat(node, session, at))
            self._handle(Tick())  # the machine decides whether it detects (``Tick.detect``)
            return self.state.finish

    def wait_for_change(self, timeout: float) -> None:
        """Until something changed, ``timeout`` passed, or a loss's ``SETTLE_S`` ran out (so its plan
        starts then, not up to a detector tick later: the tick is 100 ms, a loss's plan ~10 ms)."""
        with self._changed:
            settled_in = self.state.settle_until - self.clock()
            self._changed.wait(min(timeout, settled_in) if settled_in > 0 else timeout)

    def wait_streams_closed(self, timeout: float) -> bool:
        """After ``finish``: waits until the agents hung up (they got their Shutdown)."""
        deadline = self.clock() + timeout
        with self._changed:
            while self.state.registry.any_stream_open():
                left = deadline - self.clock()
                if left <= 0:
                    return False
                self._changed.wait(min(left, STREAM_CHECK_S))
        return True

    def _wake(self) -> None:
        with self._changed:
            self._changed.notify_all()

    # ------------------------------------------------------------------ the machine and its effects
    def _handle(self, event: Event, peer: str = "", method: str = ""):
        """One event through the machine, its effects carried out, then the planner's finished answers
        (an inline planner answers at once: its answer is applied in the same call)."""
        transition = machine.step(self.state, event, self.clock(), self.settings)
        self._carry_out(transition.effects)
        while completed := self._progress.take_completed():  # judged by the machine, then logged (``LogStep``)
            for generation, step, ranks in completed:
                event = StepCompleted(generation, step, ranks)
                self._carry_out(machine.step(self.state, event, self.clock(), self.settings).effects)
        if transition.refused is not None:
            if peer:
                self.refused(peer, method, str(transition.refused))
            raise transition.refused
        while ready := [i for i, f in self._futures.items() if f.done()]:
            for plan_id in ready:
                self._answer(plan_id, self._futures.pop(plan_id))
        self._changed.notify_all()
        return transition.answer

    def _answer(self, plan_id: int, future: Future) -> None:
        if future.cancelled():
            return
        try:
            outcome, error = future.result(), ""
        except Exception as exc:  # a bug in planning, or the helper process died: nothing the user can fix
            log.error("the planner failed", exc_info=exc)
            outcome, error = None, repr(exc)
        self._carry_out(
            machine.step(self.state, PlanAnswered(plan_id, outcome, error), self.clock(), self.settings).effects
        )

    def _carry_out(self, effects) -> None:
        for effect in effects:
            handler = _EFFECTS.get(type(effect))
            if handler is None:
                raise TypeError(f"the master's shell cannot carry out {type(effect).__name__}")
            handler(self, effect)

    def flush_disk(self, timeout: float) -> bool:
        """Waits until the run dir's writes (and the sends queued behind them) are done; False on ``timeout``."""
        return self._disk.flush(timeout)

    def _after_disk(self, work: Callable[[], None]) -> None:
        """``work`` now, or after the run dir's writes still queued (an output that must follow them)."""
        if self._disk.busy:
            self._disk.submit(work)
        else:
            work()

    def _send(self, e: Send) -> None:
        box = self._outboxes.get(e.node)  # now: a registration of the same name later gets an outbox of its own
        if box is not None:
            self._after_disk(lambda: box[1].put(e.event))

    def _end_stream(self, e: EndStream) -> None:
        box = self._outboxes.pop(e.node, None)
        if box is not None:
            self._after_disk(lambda: box[1].put(END_OF_STREAM))

    def _record(self, e: Record) -> None:
        self._after_disk(lambda: self.events.write(e.kind, **e.fields))

    def _say(self, e: Say) -> None:
        self._after_disk(lambda: self.say(e.text))

    def _ask_planner(self, e: AskPlanner) -> None:
        if e.call == "fresh":
            future = self.planner.fresh(self.config_yaml, e.names, e.slow)
        else:
            future = self.planner.reconfigure(
                self.config_yaml, e.template_nodes, e.base, e.lost, e.joined, e.slow, e.bench
            )
        self._futures[e.id] = future
        future.add_done_callback(lambda _: self._wake())

    def _cancel_plan(self, e: CancelPlan) -> None:
        future = self._futures.pop(e.id, None)
        if future is not None:
            future.cancel()  # only one not yet started; a running one finishes and is ignored

    def _warm_planner(self, e: WarmPlanner) -> None:
        self.planner.warm(self.config_yaml, e.template_nodes)

    def _write_journal(self, e: WriteJournal) -> None:
        if (write := self.journal_to) is None:
            return
        journal = replace(e.journal, started_wall=time.time() - (self.clock() - self.state.started_at))

        def work() -> None:
            if held := journal_hold(journal.generation):  # tests only (master.disk.HOLD_ENV)
                log.warning("holding %.1f s before generation %d's journal (%s)", held, journal.generation, HOLD_ENV)
                time.sleep(held)
            try:
                write(journal)
            except OSError as exc:  # a full disk: the job goes on; only a restarted master could not re-adopt it
                self.events.write("journal_failed", generation=journal.generation, error=str(exc))
                log.warning(
                    "cannot write the master's journal (generation %d): %s; a restarted master could "
                    "not re-adopt the running workers",
                    journal.generation,
                    exc,
                )

        self._disk.submit(work)

    def prepare_meta(self) -> None:
        """Builds what ``meta.json`` records in the background now (``checkpointing.meta_sampler``), so the
        first periodic checkpoint does not hold the master's lock for it, when the job will reach one by
        steps. Without this (unit tests, or no such checkpoint) the first ``meta.json`` builds it."""
        interval = self.settings.sending.checkpoint_interval
        if not 0 < interval <= self.settings.steps:
            # No periodic checkpoint by steps will come (the tests' short runs): its imports would only take
            # CPU from the workers' start (about 1.5 s of torch's imports per master here: ~45 s of the suite).
            # A time-based or a stop's checkpoint then builds it as before.
            return
        self._prepare_meta_now()

    def _prepare_meta_now(self, e: PrepareMeta | None = None) -> None:
        if self._sampler is None and self._sampler_ready is None:
            self._sampler_ready = start_meta_sampler(self.job)

    def _write_meta(self, e: WriteMeta) -> None:
        self._disk.submit(lambda: self._meta(e))  # ``_sampler`` is the disk thread's from the first one on

    def _meta(self, e: WriteMeta) -> None:
        if self._sampler is None and self._sampler_ready is not None:
            self._sampler = self._sampler_ready.result()  # at once, unless a checkpoint came within seconds
        directory = e.directory
        if e.written_to and not os.path.exists(e.directory):
            try:
                os.replace(e.written_to, e.directory)
            except OSError as exc:
                directory = e.written_to
                log.warning(
                    "the checkpoint of step %d stays in %s (not renamed to %s: %s)",
                    e.step,
                    e.written_to,
                    e.directory,
                    exc,
                )
        elif e.written_to:
            directory = e.written_to
            log.warning("the checkpoint of step %d stays in %s: %s exists", e.step, e.written_to, e.directory)
        try:
            self._sampler = write_meta(directory, self.job, e.step, self._sampler)
        except OSError as exc:
            self.events.write(
                "checkpoint_failed", dir=directory, step=e.step, node="master", local_rank=-1, error=f"meta.json: {exc}"
            )
            log.warning("cannot complete the checkpoint %s: %s", e.directory, exc)

    def _prune(self, e: PruneCheckpoints) -> None:
        self._disk.submit(lambda: prune_checkpoints(e.directory, e.keep, e.pinned))

    def _start_progress(self, e: StartProgress) -> None:
        self._progress.start(e.view, e.incident, e.expected)

    def _progress_metrics(self, e: ProgressMetrics) -> None:
        self._progress.metrics(e.metrics)

    def _log_step(self, e: LogStep) -> None:
        self._progress.log_step(e.generation, e.step, e.stragglers, e.latest)

    def _progress_phase(self, e: ProgressPhase) -> None:
        self._progress.phase(e.node, e.local_rank, e.rank, e.phase)

    def _finished(self, e: Finished) -> None:
        for plan_id in list(self._futures):
            self._futures.pop(plan_id).cancel()


_EFFECTS: dict[type, Callable[[Coordinator, object], None]] = {
    Send: Coordinator._send,
    EndStream: Coordinator._end_stream,
    Record: Coordinator._record,
    Say: Coordinator._say,
    AskPlanner: Coordinator._ask_planner,
    CancelPlan: Coordinator._cancel_plan,
    WarmPlanner: Coordinator._warm_planner,
    WriteJournal: Coordinator._write_journal,
    WriteMeta: Coordinator._write_meta,
    PrepareMeta: Coordinator._prepare_meta_now,
    PruneCheckpoints: Coordinator._prune,
    StartProgress: Coordinator._start_progress,
    ProgressMetrics: Coordinator._progress_metrics,
    LogStep: Coordinator._log_step,
    ProgressPhase: Coordinator._progress_phase,
    Finished: Coordinator._finished,
}
"""How the shell carries out each effect (a dispatch table; an unknown one is a bug)."""
