"""The job's state machine on the master: node registry, planning, assignments, progress, completion.

No gRPC here: ``master.service`` calls these methods from its handler threads
and turns ``Refused`` into status codes. Handlers only record what they saw;
the decisions (who is lost, when to plan, when the job ends) are taken by
``tick``, which one control thread calls in a loop, so they happen in one order.
Planning itself runs in a helper process (``master.planning``) while the
control thread goes on detecting failures.

Phases: ``waiting`` (for ``num_nodes`` agents with open streams) -> ``running``
(generation 1 assigned) -> ``finished`` (exit code decided). A node that joins
while running is registered as a spare; a planned node lost while running ends
the job with exit 1 until live reconfiguration lands (issue 5).
"""

from __future__ import annotations

import logging
import queue
import re
import secrets
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Sequence

import yaml

from master.detector import WORKER_FAILED, NodeHealth, detect_failures
from master.planning import plan_inline
from oobleck_mm.events import EventLog
from oobleck_mm.protocol import oobleck_pb2 as pb
from oobleck_mm.protocol.convert import plan_to_proto
from oobleck_mm.runtime.layout import ExecutionPlan

log = logging.getLogger(__name__)

END_OF_STREAM = None
"""Put on a node's outbox to end its Subscribe stream."""

_NODE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
WAITING, RUNNING, FINISHED = "waiting", "running", "finished"

PlanSubmitter = Callable[[str, Sequence[str]], Future]
"""(job YAML, node names) -> future of ``master.planning.plan_nodes``'s result."""


class Refused(Exception):
    """A call the master rejects; ``code`` names the gRPC status (``INVALID_ARGUMENT``, ``NOT_FOUND``...)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True, slots=True)
class Finish:
    exit_code: int
    message: str


@dataclass(slots=True)
class _Node:
    name: str
    session: int
    gpus: int
    order: int
    last_heartbeat: float
    outbox: queue.Queue = field(default_factory=queue.Queue)
    stream: str = "pending"
    """pending (not subscribed yet) | open | closed."""
    closing: bool = False
    """The master ended the stream itself (shutdown, declared lost): its end is no failure."""
    worker_failure: str | None = None
    detail: str = ""
    spare: bool = False

    def health(self) -> NodeHealth:
        closed = self.stream == "closed" and not self.closing
        return NodeHealth(self.last_heartbeat, closed, self.worker_failure, self.detail)


def layout_summary(plan: ExecutionPlan) -> str:
    stages = ",".join(str(len(p.stages)) for p in plan.pipelines)
    mbs = ",".join(str(p.num_microbatches) for p in plan.pipelines)
    return f"{len(plan.pipelines)} pipelines (stages {stages}; microbatches {mbs})"


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
        submit_plan: PlanSubmitter = plan_inline,
    ) -> None:
        self.job = job
        self.num_nodes = num_nodes
        self.steps = steps
        self.store_host = store_host
        self.store_port = store_port
        self.events = events
        self.clock = clock
        self.progress = progress
        self.submit_plan = submit_plan
        self.timeout = job.fault_tolerance.heartbeat_timeout
        # What the workers read: the job with its overrides and absolute paths, whatever their file system.
        self.config_yaml = yaml.safe_dump(job.to_dict(), sort_keys=False)
        self.phase = WAITING
        self.generation = 0
        self.plan: ExecutionPlan | None = None
        self.finish_result: Finish | None = None
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._nodes: dict[str, _Node] = {}  # live nodes only
        self._registrations = 0
        self._ranks: dict[tuple[str, int], int] = {}
        self._step_reports: dict[int, dict[int, pb.StepMetrics]] = {}
        self._done_ranks: set[int] = set()
        self._started_at = 0.0
        self._planning: tuple[list[str], Future] | None = None
        self._last_detect: float | None = None

    # ------------------------------------------------------------------ calls from agents
    def register(self, node: str, gpus: int, memory_bytes: int, pid: int, peer: str) -> tuple[int, int]:
        """(session, gpus to run) for a new agent; raises Refused."""
        want = self.job.cluster.gpus_per_node
        with self._lock:
            if not _NODE_NAME.match(node):
                reason = f"node name {node!r} must match {_NODE_NAME.pattern}"
                self._refuse("INVALID_ARGUMENT", peer, "Register", reason)
            if gpus not in (0, want):
                self._refuse(
                    "INVALID_ARGUMENT", peer, "Register",
                    f"node {node} offers {gpus} GPUs; this job runs cluster.gpus_per_node = {want} per node",
                )  # fmt: skip
            if node in self._nodes:
                self._refuse("ALREADY_EXISTS", peer, "Register", f"node name {node!r} is already registered")
            if self.phase == FINISHED:
                self._refuse("FAILED_PRECONDITION", peer, "Register", "the job has finished")
            spare = self.phase == RUNNING
            session = secrets.randbits(62)
            self._nodes[node] = _Node(node, session, want, self._registrations, self.clock(), spare=spare)
            self._registrations += 1
            self.events.write(
                "registered", node=node, gpus=want, memory_bytes=memory_bytes, pid=pid, peer=peer, spare=spare
            )
            log.info("registered %s (%d GPUs) from %s%s", node, want, peer, " as a spare" if spare else "")
            self._changed.notify_all()
            return session, want

    def open_stream(self, node: str, session: int) -> queue.Queue:
        """The outbox the node's Subscribe stream drains; raises Refused for an unknown session."""
        with self._lock:
            entry = self._live(node, session)
            if entry.stream != "pending":
                raise Refused("FAILED_PRECONDITION", f"node {node} already has an event stream")
            entry.stream = "open"
            self.events.write("subscribed", node=node)
            self._changed.notify_all()
            return entry.outbox

    def stream_ended(self, node: str, session: int) -> None:
        with self._lock:
            entry = self._nodes.get(node)
            if entry is not None and entry.session == session:
                entry.stream = "closed"
            self._changed.notify_all()

    def heartbeat(self, node: str, session: int) -> int:
        with self._lock:
            self._live(node, session).last_heartbeat = self.clock()
            return self.generation

    def worker_report(self, node: str, session: int, local_rank: int, report: pb.WorkerReport) -> None:
        with self._lock:
            entry = self._live(node, session)
            kind = report.WhichOneof("report")
            if kind == "metrics":
                self._on_metrics(report.metrics)
            elif kind == "done":
                self._on_done(node, local_rank, report.done.step)
            elif kind == "failed":
                entry.worker_failure = WORKER_FAILED
                entry.detail = f"local rank {local_rank}: {report.failed.message}"
                self.events.write("worker_failed", node=node, local_rank=local_rank, message=report.failed.message)
            self._changed.notify_all()

    def worker_failure(self, node: str, session: int, local_rank: int, reason: str, message: str) -> None:
        with self._lock:
            entry = self._live(node, session)
            if entry.worker_failure is None:
                entry.worker_failure = reason
                entry.detail = f"local rank {local_rank}: {message}"
            self._changed.notify_all()

    def refused(self, peer: str, method: str, reason: str) -> None:
        """Records a call refused before it reached the coordinator (the token check)."""
        self.events.write("refused", peer=peer, method=method, reason=reason)
        log.warning("refused %s from %s: %s", method, peer, reason)

    # ------------------------------------------------------------------ the control thread
    def tick(self) -> Finish | None:
        """Detects failures, plans when enough nodes are in, and says whether the job is over.

        Planning runs elsewhere (``submit_plan``): this thread keeps detecting
        failures meanwhile and applies the plan once it is ready.
        """
        with self._lock:
            if self.phase != FINISHED:
                self._detect()
            if self.phase == WAITING and self._planning is None and (names := self._ready_nodes()):
                self._planning = (names, self.submit_plan(self.config_yaml, names))
                self._planning[1].add_done_callback(lambda _: self._wake())
            if self._planning is not None and self._planning[1].done():
                names, future = self._planning
                self._planning = None
                self._apply_plan(names, future)
            return self.finish_result

    def _wake(self) -> None:
        with self._changed:
            self._changed.notify_all()

    def wait_for_change(self, timeout: float) -> None:
        with self._changed:
            self._changed.wait(timeout)

    def finish(self, exit_code: int, message: str) -> None:
        """Ends the job: every live agent gets Shutdown and its stream ends."""
        with self._lock:
            if self.finish_result is not None:
                return
            self.phase = FINISHED
            self.finish_result = Finish(exit_code, message)
            for entry in self._nodes.values():
                self._close(entry, message)
            self.events.write("shutdown", exit_code=exit_code, reason=message)
            self._changed.notify_all()

    def wait_streams_closed(self, timeout: float) -> bool:
        """After ``finish``: waits until the agents hung up (they got their Shutdown)."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while any(n.stream == "open" for n in self._nodes.values()):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(left)
        return True

    # ------------------------------------------------------------------ internals (lock held)
    def _live(self, node: str, session: int) -> _Node:
        entry = self._nodes.get(node)
        if entry is None or entry.session != session:
            raise Refused("NOT_FOUND", f"node {node} (session {session}) is not registered; it may have been lost")
        return entry

    def _refuse(self, code: str, peer: str, method: str, reason: str) -> None:
        self.refused(peer, method, reason)
        raise Refused(code, reason)

    def _close(self, entry: _Node, reason: str) -> None:
        entry.closing = True
        entry.outbox.put(pb.AgentEvent(shutdown=pb.Shutdown(reason=reason)))
        entry.outbox.put(END_OF_STREAM)

    def _detect(self) -> None:
        now = self.clock()
        self._forgive_own_stall(now)
        health = {name: n.health() for name, n in self._nodes.items()}
        for failure in detect_failures(now, health, self.timeout):
            self._declare_lost(failure.node, failure.reason, failure.detail)

    def _forgive_own_stall(self, now: float) -> None:
        """Time the master itself was frozen (starved of CPU, paused) is nobody's silence.

        Heartbeats that arrived meanwhile wait unread in its sockets; without this, a
        master descheduled for longer than the timeout would declare every node lost
        at its next tick. The control thread ticks every ~0.1 s, so a gap of half the
        timeout means the master, not the nodes, stopped.
        """
        last, self._last_detect = self._last_detect, now
        gap = 0.0 if last is None else now - last
        if gap <= self.timeout.total_seconds() / 2:
            return
        for entry in self._nodes.values():
            entry.last_heartbeat = min(now, entry.last_heartbeat + gap)
        self.events.write("master_stalled", seconds=gap)
        log.warning("the master did not run for %.2fs; not counting it as the nodes' silence", gap)

    def _declare_lost(self, name: str, reason: str, detail: str) -> None:
        entry = self._nodes.pop(name)
        in_plan = any(node == name for node, _ in self._ranks)
        self.events.write(
            "lost", node=name, reason=reason, detail=detail, phase=self.phase, in_plan=in_plan,
            generation=self.generation,
        )  # fmt: skip
        log.warning("node %s lost: %s (%s)", name, reason, detail)
        self._close(entry, f"node {name} declared lost: {reason}")
        if self.phase == RUNNING and in_plan:
            self.finish(
                1,
                f"node {name} lost ({reason}: {detail}); live reconfiguration is not implemented yet "
                "(issue 5), so the job stops",
            )

    def _ready_nodes(self) -> list[str] | None:
        open_nodes = sorted((n for n in self._nodes.values() if n.stream == "open"), key=lambda n: n.order)
        if len(open_nodes) < self.num_nodes:
            return None
        return [n.name for n in open_nodes[: self.num_nodes]]

    def _on_metrics(self, m: pb.StepMetrics) -> None:
        if self.plan is None or m.generation != self.generation or not 0 <= m.rank < self.plan.world_size:
            return  # a late report of an older generation
        reports = self._step_reports.setdefault(m.step, {})
        reports[m.rank] = m
        if len(reports) == self.plan.world_size:
            del self._step_reports[m.step]
            self._print_step(m.step, list(reports.values()))

    def _print_step(self, step: int, reports: list[pb.StepMetrics]) -> None:
        first = min(reports, key=lambda r: r.rank)
        slowest = max(r.step_time_s for r in reports)
        self.events.write(
            "step", generation=self.generation, step=step, loss=first.loss, samples_per_s=first.samples_per_s,
            step_time_s=slowest, forward_s=max(r.forward_s for r in reports),
            backward_s=max(r.backward_s for r in reports), comm_s=max(r.comm_s for r in reports),
        )  # fmt: skip
        assert self.plan is not None
        self.progress(
            f"step {step + 1}/{self.steps}  loss {first.loss:.4f}  {first.samples_per_s:.1f} samples/s  "
            f"{slowest:.3f} s/step  gen {self.generation}: {layout_summary(self.plan)}"
        )

    def _on_done(self, node: str, local_rank: int, step: int) -> None:
        rank = self._ranks.get((node, local_rank))
        if rank is None or self.phase != RUNNING:
            return
        self._done_ranks.add(rank)
        if self.plan is not None and len(self._done_ranks) == self.plan.world_size:
            seconds = time.monotonic() - self._started_at
            self.events.write("done", generation=self.generation, steps=self.steps, last_step=step, seconds=seconds)
            self.finish(0, f"done: {self.steps} steps in {seconds:.1f} s")

    # ------------------------------------------------------------------ planning
    def _apply_plan(self, names: list[str], future: Future) -> None:
        if self.phase != WAITING:
            return
        try:
            result = future.result()
        except Exception as exc:  # the helper process died: nothing the user can fix
            self.finish(1, f"the planner failed: {exc!r}")
            return
        if "error" in result:
            self.finish(2, f"planning {len(names)} nodes failed: {result['error']}")
            return
        if any(n not in self._nodes or self._nodes[n].stream != "open" for n in names):
            # The next tick plans again with the nodes that are there.
            self.events.write("plan_discarded", nodes=names, reason="a node was lost while planning")
            return
        execution = ExecutionPlan.from_dict(result["layout"])
        self.generation += 1
        self.plan, self.phase = execution, RUNNING
        self._ranks = {(node, gpu): rank for node, gpu, rank in result["ranks"]}
        self._started_at = time.monotonic()
        self.events.write(
            "plan_decided", generation=self.generation, nodes=names, layout=result["layout"],
            describe=execution.describe(), predicted_samples_per_s=result["samples_per_s"],
            seconds=result["seconds"],
        )  # fmt: skip
        self.progress(
            f"generation {self.generation}: {layout_summary(execution)} on {len(names)} nodes, "
            f"planned in {result['seconds']:.2f} s: {execution.describe()}"
        )
        self._send_assignments(execution)

    def _send_assignments(self, execution: ExecutionPlan) -> None:
        plan_msg = plan_to_proto(execution)
        for (node, gpu), rank in sorted(self._ranks.items(), key=lambda kv: kv[1]):
            assignment = pb.Assignment(
                generation=self.generation, rank=rank, world_size=execution.world_size,
                store_host=self.store_host, store_port=self.store_port, start_step=0, steps=self.steps,
                plan=plan_msg,
            )  # fmt: skip
            event = pb.AgentEvent(assignment=pb.WorkerAssignment(local_rank=gpu, assignment=assignment))
            self._nodes[node].outbox.put(event)
            self.events.write("assignment_sent", generation=self.generation, node=node, local_rank=gpu, rank=rank)
