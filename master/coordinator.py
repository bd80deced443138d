"""The job's state machine on the master: node registry, generations, recovery, checkpoints, completion.

No gRPC here: ``master.service`` calls these methods from its handler threads
and turns ``Refused`` into status codes. Handlers only record what they saw;
the decisions (who is lost, when to plan, when the job ends) are taken by
``tick``, which one control thread calls in a loop, so they happen in one order.
Planning runs in a helper process (``master.planning``) while the control
thread goes on detecting failures; what to plan is decided by the pure
functions of ``master.recovery``.

Phases (``JobPhase``): ``waiting`` (for ``num_nodes`` agents with open
streams), or ``adopting`` (a restarted master waits for the nodes of its
journal: ``master.journal``) -> ``running`` (generation 1 and every later one) -> ``checkpointing``
(too few nodes left: the survivors write their layers) -> ``finished`` (exit
code decided).

While running, whenever the live nodes differ from the current generation's
(a node lost, a node joined), the master asks its recovery policy
(``master.policies``: live or restart) what to plan, plans it, checks that
nothing changed while it planned, and sends every worker its ``Assignment``.
Every reading of time goes through the injected ``clock``, so tests drive the
whole state machine by hand.
"""

from __future__ import annotations

import enum
import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from typing import Callable

import yaml

from master import checkpointing
from master.assignments import Sending, build_assignments
from master.detector import WORKER_FAILED, detect_failures, recent_stalls
from master.journal import KEEP_GENERATIONS, Journal
from master.planning import InlinePlanner
from master.policies import policy_for
from master.progress import Incident, Progress, StepFacts, layout_summary
from master.recovery import GenerationView, Holdings, Request, StateLost, choose_base, previous_ranks
from master.registry import RefusalCounter, Refused, Registry
from oobleck_mm.errors import ExitCode
from oobleck_mm.events import EventLog
from oobleck_mm.planning.layout import ExecutionPlan, Gpu
from oobleck_mm.planning.plan import Plan
from oobleck_mm.planning.planner import Failed, Planned
from oobleck_mm.planning.reconfigure import CannotKeepReplicas
from oobleck_mm.planning.transfers import missing_states, rank_transfers
from oobleck_mm.protocol import oobleck_pb2 as pb

log = logging.getLogger(__name__)

SETTLE_S = 0.1
"""After a loss, wait this long for others before planning: nodes that fail together (a rack, a
preemption wave) are seen milliseconds apart, and one plan for all beats a plan thrown away."""
MAX_REFORMS = 3
"""Re-forms of the same nodes in a row without a completed step before the job gives up: a
collective that times out again and again with every node alive is not the load of a moment
but a bug (collectives out of order) or a network that cannot carry the job."""
STREAM_CHECK_S = 0.1
"""Longest sleep between two looks at the agents' streams while waiting for them to hang up."""


class JobPhase(enum.Enum):
    WAITING = "waiting"
    """For ``num_nodes`` agents with open event streams."""
    RUNNING = "running"
    """Generation 1 and every later one."""
    ADOPTING = "adopting"
    """A master restarted with ``--resume-master``: waiting for the journal's nodes to register again
    (their workers train on meanwhile), at most ``fault_tolerance.adopt_window``."""
    CHECKPOINTING = "checkpointing"
    """Too few nodes left: the survivors write their layers."""
    FINISHED = "finished"
    """The exit code is decided."""


_TRAINING = (JobPhase.RUNNING, JobPhase.ADOPTING)
"""The workers train: a node leaving, lost or a stop request is handled as in a running job (a restarted
master only waits for its nodes before it plans)."""


@dataclass(frozen=True, slots=True)
class Finish:
    exit_code: int
    message: str


@dataclass(frozen=True, slots=True)
class RunOptions:
    """How this run starts, saves and recovers (``oobleck-launch master|local`` flags)."""

    resume_dir: str = ""
    """Absolute checkpoint directory the first generation loads (``--resume``)."""
    resume_step: int = 0
    save_final_dir: str = ""
    checkpoint_root: str = "."
    """Where below-threshold checkpoints (and restart mode's) are written."""
    recovery: str = "live"
    """``live`` or ``restart`` (``master.policies``)."""
    checkpoint_interval: int = 0
    """Restart mode: steps between checkpoints."""
    resume_command: str = "oobleck-launch local --config CONFIG"
    """Printed, followed by ``--resume DIR``, when the job stops below the threshold."""
    log_every: int = 1
    """Console lines every N steps (``--log-every``); the event log and metrics get every step."""


@dataclass(frozen=True, slots=True)
class _Generation:
    view: GenerationView
    plan: Plan | None
    """The planning ``Plan`` (the next reconfiguration starts from it); None for the older generations
    a restarted master read from its journal (a plan from one of them is planned afresh)."""
    template_nodes: int
    """Node count the planner's templates were built for."""


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
    ) -> None:
        self.job = job
        self.num_nodes = num_nodes
        self.steps = steps
        self.events = events
        self.clock = clock
        self.say = progress
        self.planner = planner or InlinePlanner()
        self.options = options
        self.timeouts = job.fault_tolerance
        self.policy = policy_for(options.recovery)
        periodic = self.policy.periodic_checkpoints
        self.sending = Sending(
            store_host=store_host, store_port=store_port, steps=steps, save_final_dir=options.save_final_dir,
            checkpoint_interval=options.checkpoint_interval if periodic else 0,
            checkpoint_dir=f"{options.checkpoint_root}/checkpoints" if periodic else "",
            checkpoint_async=self.policy.asynchronous_checkpoints,
        )  # fmt: skip
        # What the workers read: the job with its overrides and absolute paths, whatever their file system.
        self.config_yaml = yaml.safe_dump(job.to_dict(), sort_keys=False)
        self.phase = JobPhase.WAITING
        self.generation = 0
        self.plan: ExecutionPlan | None = None
        self.finish_result: Finish | None = None
        self.holdings: dict[Gpu, Holdings] = {}
        """(node, gpu) -> the generations its worker's states follow, as its reports say."""
        self.next_step = options.resume_step
        """First step no worker has reported done."""
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self.registry = Registry()
        self._refusals = RefusalCounter()
        self._gens: dict[int, _Generation] = {}
        self._done: dict[Gpu, tuple[int, int]] = {}
        """(node, gpu) -> (generation, last step) of its WorkerDone."""
        self._reported: dict[Gpu, int] = {}
        """(node, gpu) -> generation of its latest metrics or phase report."""
        self._stalls: dict[str, float] = {}
        """node -> clock reading of its workers' latest report of a stalled collective."""
        self._planning: tuple[Request, Future] | None = None
        self._incident: Incident | None = None
        self._round: checkpointing.CheckpointRound | None = None
        self._started_at = 0.0
        self._started_wall = 0.0
        self._last_detect: float | None = None
        self._settle_until = 0.0
        self._abandoned: tuple[float, str] | None = None
        """(clock, message) of the first report that a worker abandoned an iteration of the current
        generation; a re-form follows once ``reform_after`` passed with no node lost."""
        self._reforms = 0
        """Re-forms since the last completed step (``MAX_REFORMS``)."""
        self._failed_checkpoints: set[str] = set()
        """Periodic checkpoint directories some worker could not write (said once each)."""
        self._last_progress = clock()
        """Clock of the last step, recovery phase or plan: ``fault_tolerance.stall_timeout`` counts from it."""
        self._progress = Progress(events, steps, progress, clock, StepFacts.of(job, options.log_every))
        self.journal_to: Callable[[Journal], None] | None = None
        """Writes the journal (``master.journal``) before every generation's assignments go out; the
        server sets it once it knows its address. None: no journal (tests)."""
        self._adopting: tuple[float, float] | None = None
        """(clock when adoption began, its deadline) while ``ADOPTING``."""

    # ------------------------------------------------------------------ calls from agents
    def register(self, node: str, gpus: int, memory_bytes: int, pid: int, peer: str,
                 adopt_generation: int = 0) -> tuple[int, int]:  # fmt: skip
        """(session, gpus to run) for a new agent (or one coming back to a restarted master with its workers
        running ``adopt_generation``); raises Refused."""
        want = self.job.cluster.gpus_per_node
        with self._lock:
            try:
                self.registry.check_new(node, gpus, want)
                if self.phase in (JobPhase.FINISHED, JobPhase.CHECKPOINTING):
                    raise Refused("FAILED_PRECONDITION", f"the job is {self.phase.value}")
                most = self.job.cluster.max_nodes
                if most is not None and len(self.registry.nodes) >= most:  # registered, streams open or not
                    raise Refused("RESOURCE_EXHAUSTED", f"the job already runs on {most} nodes, its maximum "
                                                        f"(cluster.max_nodes, --nodes MIN:MAX); node {node} is not needed")
            except Refused as refusal:
                self.refused(peer, "Register", str(refusal))
                raise
            current = self._gens.get(self.generation)
            adopted = self.phase is JobPhase.ADOPTING and current is not None and node in current.view.nodes
            spare = self.phase is not JobPhase.WAITING and not adopted
            added = self.registry.add(node, want, self.clock())
            added.adopt_generation = adopt_generation
            session = added.session
            self.events.write(
                "registered", node=node, gpus=want, memory_bytes=memory_bytes, pid=pid, peer=peer, spare=spare,
                adopt_generation=adopt_generation,
            )
            log.info("registered %s (%d GPUs) from %s%s", node, want, peer, " (joins the job)" if spare else "")
            count = len(self.registry.nodes)
            if adopted:
                self.say(f"node {node} is back (its workers run generation {adopt_generation})")
            elif spare:
                self.say(f"node {node} registered: it joins once its workers are ready")
            elif self.num_nodes <= 16 or count % max(1, self.num_nodes // 10) == 0 or count >= self.num_nodes:
                self.say(f"agent {node} registered ({count}/{self.num_nodes})")  # start-up progress, no silent gap
            self._changed.notify_all()
            return session, want

    def open_stream(self, node: str, session: int) -> queue.Queue:
        """The outbox the node's Subscribe stream drains; raises Refused for an unknown session."""
        with self._lock:
            entry = self.registry.live(node, session)
            if entry.stream != "pending":
                raise Refused("FAILED_PRECONDITION", f"node {node} already has an event stream")
            entry.stream = "open"
            self.events.write("subscribed", node=node)
            self._changed.notify_all()
            return entry.outbox

    def stream_ended(self, node: str, session: int) -> None:
        with self._lock:
            entry = self.registry.nodes.get(node)
            if entry is not None and entry.session == session:
                entry.stream = "closed"
                if entry.dismissed:  # it left on notice and hung up: gone, and nothing was lost
                    self.registry.pop(node)
                    self._forget(node)
            self._changed.notify_all()

    def heartbeat(self, node: str, session: int) -> int:
        # Without the lock: a heartbeat must never wait for a tick (applying a plan, writing events
        # on a busy disk). Reading the dict and setting one float are atomic under the GIL, and a
        # node popped meanwhile only gets its heartbeat recorded on an entry nobody reads again.
        self.registry.live(node, session).last_heartbeat = self.clock()
        return self.generation

    def worker_report(self, node: str, session: int, local_rank: int, report: pb.WorkerReport,
                      replayed: bool = False) -> None:  # fmt: skip
        with self._lock:
            entry = self.registry.live(node, session)
            gpu = (node, local_rank)
            kind = report.WhichOneof("report")
            if kind == "metrics":
                self._on_metrics(gpu, report.metrics, replayed)
            elif kind == "phase":
                self._on_phase(gpu, report.phase, replayed)
            elif kind == "checkpoint_done":
                self._on_checkpoint_done(gpu, report.checkpoint_done)
            elif kind == "done":
                # WorkerDone names no generation: it ends the one the worker last reported from.
                self._done[gpu] = (self._reported.get(gpu, 0), report.done.step)
            elif kind == "ready":
                self._on_ready(entry, local_rank, report.ready)
            elif kind == "stalled":
                # Evidence for the detector: this node's worker waits on its peers (see detector.py).
                self._stalls[node] = self.clock()
            elif kind == "failed":
                failed = report.failed
                self.events.write("worker_failed", node=node, local_rank=local_rank, message=failed.message,
                                  user_error=failed.user_error, bug=failed.bug)  # fmt: skip
                if failed.user_error:  # the same on every replica: stop once, naming the cause
                    self.finish(ExitCode.BAD_INPUT, f"{node}/gpu{local_rank}: {failed.message}")
                elif failed.bug:  # every replica would meet it again: recovering would only repeat it
                    self.finish(ExitCode.ERROR, f"{node}/gpu{local_rank} stopped the job: "
                                                f"{failed.message.splitlines()[0]} (traceback in {node}'s log)")  # fmt: skip
                else:
                    entry.worker_failure = WORKER_FAILED
                    entry.detail = f"local rank {local_rank}: {failed.message}"
            self._changed.notify_all()

    def _on_ready(self, entry, local_rank: int, ready: pb.WorkerReady) -> None:
        if local_rank in entry.ready:
            return
        entry.ready.add(local_rank)
        if not entry.all_ready:
            return
        current = self._gens.get(self.generation)
        joining = self.phase in _TRAINING and (current is None or entry.name not in current.view.nodes)
        self.events.write("node_ready", node=entry.name, startup_s=ready.startup_s, joining=joining)
        if joining:
            self.say(f"node {entry.name} ready (its workers started in {ready.startup_s:.1f} s): it joins at the "
                     "next step boundary")  # fmt: skip

    def worker_failure(self, node: str, session: int, local_rank: int, reason: str, message: str) -> None:
        with self._lock:
            entry = self.registry.live(node, session)
            if entry.worker_failure is None:
                entry.worker_failure = reason
                entry.detail = f"local rank {local_rank}: {message}"
            self._changed.notify_all()

    def leave(self, node: str, session: int, reason: str) -> None:
        """A preemption notice: plan the node out at the next iteration boundary while it still holds
        its state (its layers are copied off it if it has the last copies), then dismiss it."""
        with self._lock:
            entry = self.registry.live(node, session)
            if entry.leaving:
                return
            entry.leaving = reason or "preemption notice"
            current = self._gens.get(self.generation)
            in_plan = self.phase in _TRAINING and current is not None and node in current.view.nodes
            self.events.write("leaving", node=node, reason=entry.leaving, phase=self.phase.value, in_plan=in_plan,
                              generation=self.generation)  # fmt: skip
            log.warning("node %s leaves: %s", node, entry.leaving)
            if self.phase is JobPhase.CHECKPOINTING:
                pass  # it may be a writer of the round: the round decides, and the job ends with it
            elif not in_plan:  # waiting, or a spare not planned yet: nothing of the job's is on it
                self._dismiss(node, "left before it was planned in")
            else:
                self._settle_until = self.clock() + SETTLE_S  # a zone's notices come together
                self.say(f"node {node} leaves ({entry.leaving}): planning generation {self.generation + 1} "
                         "without it, at the next step boundary")  # fmt: skip
                self._add_to_incident("left", node)
            self._changed.notify_all()

    def _dismiss(self, node: str, why: str) -> None:
        """Tells a leaving node it may go (its workers finish the iteration in flight first)."""
        entry = self.registry.nodes[node]
        entry.dismissed = True
        # The stream stays open until the agent hangs up: its workers' reports of the iteration in
        # flight still count. Its hang-up then removes it (``stream_ended``).
        entry.outbox.put(pb.AgentEvent(shutdown=pb.Shutdown(reason=f"node {node} {why}", at_boundary=True)))
        self.events.write("left", node=node, reason=entry.leaving, why=why, generation=self.generation)

    def refused(self, peer: str, method: str, reason: str) -> None:
        """Records a refused call: the first few per peer host, then only every 10th, 100th... one."""
        count, logged = self._refusals.count(peer)
        if not logged:
            return
        self.events.write("refused", peer=peer, method=method, reason=reason, count=count)
        log.warning("refused %s from %s: %s (%d refusals from this host)", method, peer, reason, count)

    # ------------------------------------------------------------------ the control thread
    def tick(self) -> Finish | None:
        """Detects failures, plans when membership changed, applies finished plans, says whether the job is over."""
        with self._lock:
            if self.phase is not JobPhase.FINISHED:
                self._detect()
            if self.phase in (JobPhase.WAITING, JobPhase.RUNNING) and self._planning is None:
                self._maybe_plan()
            if self._planning is not None and self._planning[1].done():
                request, future = self._planning
                self._planning = None
                self._apply(request, future)
            if self.phase is JobPhase.RUNNING and self._planning is None:
                self._check_done()
                self._check_stall()
            if self.phase is JobPhase.CHECKPOINTING:
                self._check_round()
            if self.phase is JobPhase.ADOPTING:
                self._check_adopted()
            return self.finish_result

    def _wake(self) -> None:
        with self._changed:
            self._changed.notify_all()

    def wait_for_change(self, timeout: float) -> None:
        """Until something changed, ``timeout`` passed, or a loss's ``SETTLE_S`` ran out (so its plan
        starts then, not up to a detector tick later: the tick is 100 ms, a loss's plan ~10 ms)."""
        with self._changed:
            settled_in = self._settle_until - self.clock()
            self._changed.wait(min(timeout, settled_in) if settled_in > 0 else timeout)

    def finish(self, exit_code: int, message: str) -> None:
        """Ends the job: every live agent gets Shutdown and its stream ends."""
        with self._lock:
            if self.finish_result is not None:
                return
            self.phase = JobPhase.FINISHED
            self.finish_result = Finish(exit_code, message)
            for entry in self.registry.nodes.values():
                entry.outbox.put(pb.AgentEvent(shutdown=pb.Shutdown(reason=message)))
                entry.end_stream()
            self.events.write("shutdown", exit_code=exit_code, reason=message)
            self._changed.notify_all()

    def wait_streams_closed(self, timeout: float) -> bool:
        """After ``finish``: waits until the agents hung up (they got their Shutdown)."""
        deadline = self.clock() + timeout
        with self._changed:
            while self.registry.any_stream_open():
                left = deadline - self.clock()
                if left <= 0:
                    return False
                self._changed.wait(min(left, STREAM_CHECK_S))
        return True

    # ------------------------------------------------------------------ detection (lock held)
    def send(self, node: str, event: pb.AgentEvent) -> None:
        self.registry.nodes[node].outbox.put(event)

    def _detect(self) -> None:
        now = self.clock()
        self._forgive_own_stall(now)
        health = self.registry.health()
        self._stalls = recent_stalls(now, self._stalls, self.registry.nodes, self.timeouts)
        for failure in detect_failures(now, health, self.timeouts, self._stalls):
            self._declare_lost(failure.node, failure.reason, failure.detail)

    def _forgive_own_stall(self, now: float) -> None:
        """Time the master itself was frozen (starved of CPU, paused) is nobody's silence.

        Heartbeats that arrived meanwhile wait unread in its sockets; without this, a
        master descheduled for longer than the timeout would declare every node lost
        at its next tick (``fault_tolerance.master_stall_threshold`` says why the gap).
        """
        last, self._last_detect = self._last_detect, now
        gap = 0.0 if last is None else now - last
        if gap <= self.timeouts.master_stall_threshold.total_seconds():
            return
        self.registry.forgive(gap, now)
        self._last_progress = min(now, self._last_progress + gap)
        self.events.write("master_stalled", seconds=gap)
        log.warning("the master did not run for %.2fs; not counting it as the nodes' silence", gap)

    def _add_to_incident(self, cause: str, node: str) -> None:
        """Nodes lost (or leaving) together make one incident, timed from the first."""
        if self._incident is None or self._incident.cause != cause:
            self._incident = Incident.now(cause, [node], self.clock)
        else:
            self._incident = self._incident.with_node(node)

    def _forget(self, name: str) -> None:
        """Its state is gone with it; a node coming back under this name starts empty."""
        for table in (self.holdings, self._done, self._reported):
            for gpu in [g for g in table if g[0] == name]:
                del table[gpu]

    def _declare_lost(self, name: str, reason: str, detail: str) -> None:
        entry = self.registry.pop(name)
        current = self._gens.get(self.generation)
        in_plan = current is not None and name in current.view.nodes
        self.events.write(
            "lost", node=name, reason=reason, detail=detail, phase=self.phase.value, in_plan=in_plan,
            generation=self.generation,
        )  # fmt: skip
        log.warning("node %s lost: %s (%s)", name, reason, detail)
        self._forget(name)
        # Tell it nothing: a hung (stopped) node must not find orders when it wakes. Ending
        # the stream frees the handler thread; a live agent reads the end as "master gone" and
        # stops its workers, which is what a node declared lost must do.
        entry.end_stream()
        if self.phase in _TRAINING and in_plan:
            self._settle_until = self.clock() + SETTLE_S
            self.say(f"node {name} lost ({reason}); planning generation {self.generation + 1}")
            self._add_to_incident("lost", name)
        elif self.phase is JobPhase.CHECKPOINTING:
            self._round_lost(name)

    # ------------------------------------------------------------------ deciding what to plan
    def views(self) -> dict[int, GenerationView]:
        return {number: g.view for number, g in self._gens.items()}

    def forget_workers(self) -> None:
        """Every worker restarts empty (restart recovery): no holdings, no reports to wait for."""
        self.holdings.clear()
        self._reported.clear()

    def _wanted(self) -> Request | StateLost | None:
        """What the next plan must account for now (None: nothing to plan)."""
        live = self.registry.names()
        if self.phase is JobPhase.WAITING:
            if len(live) < self.num_nodes:
                return None
            names = tuple(live[: self.num_nodes])
            return Request(base=0, plan_from=0, lost=(), joined=names, live=names, failure=False)
        current = self._gens[self.generation].view
        # A node joins once its workers are up: admitting it earlier would hold the survivors at the
        # rendezvous for its start-up (imports, warm-up: seconds) instead of only for the state copy.
        live = [n for n in live if n in current.nodes or self.registry.nodes[n].all_ready]
        return self.policy.wanted(self, current, live)

    def abandoned(self) -> bool:
        """A worker of the current generation abandoned an iteration, and ``reform_after`` passed
        with no node lost: the generation cannot go on, and no loss will make the master plan."""
        return (self._abandoned is not None
                and self.clock() - self._abandoned[0] >= self.timeouts.reform_after.total_seconds())  # fmt: skip

    def _maybe_plan(self) -> None:
        if self.clock() < self._settle_until:
            return  # other nodes of the same failure may still be on their way out
        wanted = self._wanted()
        if wanted is None:
            return
        if isinstance(wanted, StateLost):
            if not self._checkpoint_before_leaving(wanted.reason):
                self._state_lost(wanted.reason, f"cannot recover: {wanted.reason}")
            return
        if wanted.reform and not self._may_reform():
            return
        if self.phase is JobPhase.RUNNING:
            if self._incident is None:
                cause = "abandoned" if wanted.reform else "joined"
                self._incident = Incident.now(cause, wanted.joined or wanted.live, self.clock)
            self.policy.before_planning(self, wanted)
        if wanted.reform and self._gens[wanted.plan_from].plan is not None:
            # The same nodes, the same plan: only a new generation (group, store prefix).
            future: Future = Future()
            source = self._gens[wanted.plan_from]
            future.set_result(Planned(source.plan, source.view.layout, dict(source.view.ranks), source.template_nodes,
                                      fresh=False, actions=("re-form",), seconds=0.0,
                                      reason=f"generation {self.generation} abandoned step {self.next_step} with no "
                                             f"node lost: the same nodes and plan again"))  # fmt: skip
        elif wanted.plan_from == 0:
            if self.phase is JobPhase.WAITING:
                self.say(f"planning pipelines for {len(wanted.live)} nodes")
            future = self.planner.fresh(self.config_yaml, wanted.live)
        elif self._gens[wanted.plan_from].plan is None:  # journaled without its plan: planned afresh
            future = self.planner.fresh(self.config_yaml, wanted.live)
        else:
            source = self._gens[wanted.plan_from]
            future = self.planner.reconfigure(self.config_yaml, source.template_nodes, source.plan, wanted.lost,
                                              wanted.joined)  # fmt: skip
        self._planning = (wanted, future)
        future.add_done_callback(lambda _: self._wake())

    def _checkpoint_before_leaving(self, why: str) -> bool:
        """Nodes on notice hold the last copies of some layers: they and the others write a checkpoint of
        the step they are at while they still can, and the job stops there (exit 3, nothing lost)."""
        leaving = self.registry.leaving()
        if not leaving or self.phase is not JobPhase.RUNNING:
            return False
        base = self._base_held_by_everyone_alive()
        if base is None or base.generation == 0:
            return False
        detail = why.removeprefix("the model state is gone: ")
        reason = f"{', '.join(leaving)} leave on notice with the last copies of some layers ({detail})"
        self._start_round(self._gens[base.generation].view, base.holding_nodes, reason,
                          f"{', '.join(leaving)} leave on notice holding the last copies of some layers")  # fmt: skip
        return True

    def _base_held_by_everyone_alive(self):
        """The generation the live nodes hold, nodes on notice included (they can still write it)."""
        return choose_base(self.views(), self.holdings, [*self.registry.names(), *self.registry.leaving()])[0]

    def _may_reform(self) -> bool:
        """Counts a re-form; ends the job (exit 1) when ``MAX_REFORMS`` in a row completed no step."""
        assert self._abandoned is not None
        if self._reforms >= MAX_REFORMS:
            self.finish(ExitCode.ERROR, f"step {self.next_step} was abandoned in {self._reforms + 1} generations in "
                                        f"a row with every node alive (the last: {self._abandoned[1]}); see the "
                                        "agents' logs")  # fmt: skip
            return False
        self._reforms += 1
        self.events.write("reform", generation=self.generation, step=self.next_step, attempt=self._reforms,
                          message=self._abandoned[1])  # fmt: skip
        self.say(f"generation {self.generation} abandoned step {self.next_step + 1} with every node alive "
                 f"({self._abandoned[1]}); the same nodes re-form")  # fmt: skip
        return True

    # ------------------------------------------------------------------ applying a plan
    def _apply(self, request: Request, future: Future) -> None:
        if self.phase not in (JobPhase.WAITING, JobPhase.RUNNING):
            return
        try:
            outcome = future.result()
        except Exception as exc:  # a bug in planning, or the helper process died: nothing the user can fix
            log.error("the planner failed", exc_info=exc)
            self.finish(ExitCode.ERROR, f"the planner failed: {exc!r}")
            return
        if self._wanted() != request:
            # Membership or holdings changed while planning: the next tick plans again.
            self.events.write("plan_discarded", nodes=list(request.live), reason="the job changed while planning")
            return
        if isinstance(outcome, Failed):
            code = ExitCode.BAD_INPUT if self.phase is JobPhase.WAITING else ExitCode.ERROR
            self.finish(code, f"planning {len(request.live)} nodes failed: {outcome.message}")
        elif isinstance(outcome, CannotKeepReplicas):
            self._below_threshold(request, outcome)
        else:
            assert isinstance(outcome, Planned), outcome
            self._start_generation(request, outcome)

    def _start_generation(self, request: Request, planned: Planned) -> None:
        number = self.generation + 1
        layout = planned.layout
        view = GenerationView(number, layout, dict(planned.ranks))
        base = self._gens[request.base].view if request.base else None
        holding = [n for n in base.nodes if n not in request.lost] if base else []
        previous = previous_ranks(view.ranks, base, holding)
        if base is not None:  # the copies the workers will make: the same function, the same inputs
            transfers = rank_transfers(base.layout, layout, previous, view.rank_nodes)
            moved = len(transfers)
        else:
            transfers, moved = (), missing_states(None, layout, previous)
        self._gens[number] = _Generation(view, planned.plan, planned.template_nodes)
        incident = self._incident if self.phase is JobPhase.RUNNING else None
        # This plan answers the incident: the next loss or join is a new one, timed from itself.
        # (Nodes lost while this generation recovers start a new incident too.)
        self._incident = None
        self._abandoned = None
        self.generation, self.plan, self.phase = number, layout, JobPhase.RUNNING
        self._last_progress = self.clock()
        if number == 1:
            self._started_at, self._started_wall = self.clock(), time.time()
        self.events.write(
            "plan_decided", generation=number, nodes=list(view.nodes), layout=layout.to_dict(),
            describe=layout.describe(), predicted_samples_per_s=planned.samples_per_s, seconds=planned.seconds,
            previous_generation=request.base, lost=list(request.lost), joined=list(request.joined),
            layer_states_moved=moved, transfers=[[t.layer, t.src, t.dst] for t in transfers],
            fresh=planned.fresh, reason=planned.reason, actions=list(planned.actions),
            cause=incident.cause if incident else "start",
            since_detected_s=self.clock() - incident.detected_at if incident else None,
        )  # fmt: skip
        self.say(
            f"generation {number}: {layout_summary(layout)} on {len(view.nodes)} nodes, planned in "
            f"{planned.seconds:.2f} s"
            + (f" ({moved} layer states to move from generation {request.base})" if request.base else "")
            + f": {layout.describe()}"
        )
        self._progress.start(view, incident)
        self._write_journal()  # before any worker may run the generation: a restarted master knows it
        # Only nodes that left on notice (alive until the iteration in flight ends) are dropped: the
        # workers switch at the boundary instead of abandoning that iteration.
        leaving = set(self.registry.leaving())
        at_boundary = base is not None and request.base == self.generation - 1 and set(request.lost) <= leaving
        self._send_assignments(view, base, previous, at_boundary)
        for name in leaving - set(view.nodes):
            self._dismiss(name, "was planned out after its notice")
        if number == 1:
            self.say(f"starting {view.layout.world_size} workers: each builds its layers, then they meet "
                     "(the first step follows)")  # fmt: skip

    def _send_assignments(self, view: GenerationView, base: GenerationView | None, previous: list[int],
                          at_boundary: bool = False) -> None:  # fmt: skip
        if base is not None:
            resume_dir, start = "", self.next_step  # survivors carry the state (and agree on the step)
        else:  # nobody inherits state: the job's start, a resume, or (restart mode) the last checkpoint
            resume_dir, start = self.policy.fresh_start(self)
        for gpu, assignment in build_assignments(
            view, self.sending, start_step=start, base=base, previous_ranks=previous if base else None,
            resume_dir=resume_dir, at_boundary=at_boundary,
        ):  # fmt: skip
            event = pb.AgentEvent(assignment=pb.WorkerAssignment(local_rank=gpu[1], assignment=assignment))
            self.send(gpu[0], event)
            self.events.write("assignment_sent", generation=view.number, node=gpu[0], local_rank=gpu[1],
                              rank=assignment.rank, previous_rank=previous[assignment.rank] if base else -1)  # fmt: skip

    # ------------------------------------------------------------------ the journal, a restarted master
    def _write_journal(self) -> None:
        if self.journal_to is None or self.generation == 0:
            return
        current = self._gens[self.generation]
        views = tuple(self._gens[n].view for n in sorted(self._gens) if n > self.generation - KEEP_GENERATIONS)
        journal = Journal(config_yaml=self.config_yaml, host="", port=0, options=asdict(self.options),
                          generation=self.generation, template_nodes=current.template_nodes, views=views,
                          plan=current.plan, last_checkpoint=self.policy.last_checkpoint,
                          started_wall=self._started_wall)  # fmt: skip
        try:
            self.journal_to(journal)
        except OSError as exc:  # a full disk: the job goes on; only a restarted master could not re-adopt it
            self.events.write("journal_failed", generation=self.generation, error=str(exc))
            log.warning("cannot write the master's journal (generation %d): %s; a restarted master could not "
                        "re-adopt the running workers", self.generation, exc)  # fmt: skip

    def adopt(self, journal: Journal) -> None:
        """A restarted master (``--resume-master``): the journal's generations, as if this master had sent
        them; the nodes' agents register again and their workers train on (``ADOPTING``)."""
        with self._lock:
            assert self.phase is JobPhase.WAITING and self.generation == 0
            for view in journal.views:
                plan = journal.plan if view.number == journal.generation else None
                self._gens[view.number] = _Generation(view, plan, journal.template_nodes)
                self._progress.start(view, None)
            self.generation, self.plan = journal.generation, journal.current.layout
            self.policy.last_checkpoint = journal.last_checkpoint
            now = self.clock()
            self._adopting = (now, now + self.timeouts.adopt_window.total_seconds())
            self._last_progress = now
            # The run is timed from its first plan, by the lost master (wall clocks: another process).
            self._started_wall = journal.started_wall or time.time()
            self._started_at = now - max(0.0, time.time() - self._started_wall)
            self.phase = JobPhase.ADOPTING
            # This master's planning helper is new: it builds the templates while the agents come
            # back, so the first failure after the restart is planned as fast as any other.
            self.planner.warm(self.config_yaml, journal.template_nodes)
            nodes = list(journal.current.nodes)
            self.events.write("adopting", generation=journal.generation, nodes=nodes,
                              window_s=self.timeouts.adopt_window.total_seconds())  # fmt: skip
            self.say(f"re-adopting generation {journal.generation} on {len(nodes)} nodes ({', '.join(nodes)}): "
                     f"waiting up to {self.timeouts.adopt_window.total_seconds():.0f} s for their agents")

    def _check_adopted(self) -> None:
        """Every node of the journal's generation is back, or the window passed: running again. Nodes not
        back are lost (the usual recovery follows); nodes back with workers of another generation (the
        lost master died while sending it) make the generation re-form, from the states they hold."""
        assert self._adopting is not None
        began, deadline = self._adopting
        current = self._gens[self.generation].view
        back = [n for n in current.nodes if n in self.registry.nodes and self.registry.nodes[n].stream == "open"]
        now = self.clock()
        if len(back) < len(current.nodes) and now < deadline:
            return
        missing = [n for n in current.nodes if n not in back]
        other = [n for n in back if self.registry.nodes[n].adopt_generation != self.generation]
        self._adopting = None
        self.phase = JobPhase.RUNNING
        self._last_progress = now
        self.events.write("adopted", generation=self.generation, nodes=back, missing=missing, other_generation=other,
                          next_step=self.next_step, seconds=now - began)  # fmt: skip
        if not back:  # the job ended, or its agents gave up waiting (master_timeout) and wrote a checkpoint
            why = (f"none of generation {self.generation}'s nodes came back within "
                   f"{self.timeouts.adopt_window.total_seconds():g} s (fault_tolerance.adopt_window)")
            self._state_lost(why, f"{why}: nothing runs to re-adopt (the job ended, or its agents stopped: "
                                  "their logs name the checkpoint their workers wrote)")  # fmt: skip
            return
        self.say(f"re-adopted generation {self.generation} on {len(back)} of {len(current.nodes)} nodes in "
                 f"{now - began:.2f} s: training goes on at step {self.next_step + 1}"
                 + (f"; not back: {', '.join(missing)}" if missing else ""))  # fmt: skip
        for name in missing:
            self._add_to_incident("lost", name)
        if missing:
            self._settle_until = now + SETTLE_S
        if other:
            self._abandoned = (now - self.timeouts.reform_after.total_seconds(),
                               f"{', '.join(other)} came back running another generation than {self.generation}")

    # ------------------------------------------------------------------ reports
    def _rank(self, gpu: Gpu, generation: int) -> int | None:
        gen = self._gens.get(generation)
        return None if gen is None else gen.view.ranks.get(gpu)

    def _check_stall(self) -> None:
        """The last resort against a hang nothing else bounds: no progress for ``stall_timeout``."""
        silent = self.clock() - self._last_progress
        if silent > self.timeouts.stall_timeout.total_seconds():
            self.finish(ExitCode.ERROR, f"no progress for {silent:.0f} s (fault_tolerance.stall_timeout "
                                        f"{self.timeouts.stall_timeout.total_seconds():g} s): generation "
                                        f"{self.generation}, next step {self.next_step}; see the agents' logs")  # fmt: skip

    def _on_metrics(self, gpu: Gpu, m: pb.StepMetrics, replayed: bool = False) -> None:
        self._last_progress = self.clock()
        self._reforms = 0
        self._reported[gpu] = max(self._reported.get(gpu, 0), m.generation)
        self.holdings[gpu] = self.holdings.get(gpu, Holdings()).completed_step(m.generation)
        self.next_step = max(self.next_step, m.step + 1)
        if not replayed:  # the lost master logged that step already
            self._progress.metrics(m)

    def _on_phase(self, gpu: Gpu, p: pb.PhaseDone, replayed: bool = False) -> None:
        if p.phase == "holding":  # a hold point (tests, --inject @phase:P): what the injector fires on
            self.events.write("holding", node=gpu[0], local_rank=gpu[1], generation=p.generation, point=p.message,
                              seconds=p.seconds)  # fmt: skip
            return
        self._last_progress = self.clock()
        if p.phase == "aborted" and p.generation == self.generation and self._abandoned is None:
            self._abandoned = (self.clock(), p.message.splitlines()[0] if p.message else "no message")
        self._reported[gpu] = max(self._reported.get(gpu, 0), p.generation)
        holdings = self.holdings.get(gpu, Holdings())
        if p.phase == "states_copied":
            self.holdings[gpu] = holdings.adopted(p.generation)
        elif p.phase == "resumed":
            self.holdings[gpu] = holdings.completed_step(p.generation)
        if not replayed:  # the lost master logged that phase already
            self._progress.phase(gpu[0], gpu[1], self._rank(gpu, p.generation), p)

    def _on_checkpoint_done(self, gpu: Gpu, done: pb.CheckpointDone) -> None:
        if done.error:
            self._checkpoint_failed(gpu, done)
            return
        if self.phase is JobPhase.CHECKPOINTING and self._round is not None:
            self._round.record(gpu, done)
            return
        saved = self.policy.checkpoint_done(self, gpu, done)  # a periodic checkpoint
        if saved is not None:
            self.events.write("checkpoint_saved", dir=saved[0], step=saved[1], generation=self.generation,
                              **self.policy.last_timing)  # fmt: skip
            self._write_journal()

    def _checkpoint_failed(self, gpu: Gpu, done: pb.CheckpointDone) -> None:
        """A worker could not write its share (a full disk): said as such, never taken for a lost node."""
        self.events.write("checkpoint_failed", dir=done.dir, step=done.step, node=gpu[0], local_rank=gpu[1],
                          error=done.error)  # fmt: skip
        where = f"{gpu[0]}/gpu{gpu[1]}"
        r = self._round
        if self.phase is JobPhase.CHECKPOINTING and r is not None and done.dir == r.directory:
            self.finish(ExitCode.ERROR, f"the checkpoint to {r.directory} could not be written on {where}: "
                                        f"{done.error}")  # fmt: skip
            return
        if done.dir in self._failed_checkpoints:
            return  # said once per checkpoint, not once per worker
        self._failed_checkpoints.add(done.dir)
        last = self.policy.last_checkpoint
        self.say(f"checkpoint of step {done.step} could not be written on {where}: {done.error}; training goes on"
                 f" (the last complete checkpoint: {f'step {last[1]} in {last[0]}' if last else 'none'})")

    def _check_done(self) -> None:
        current = self._gens.get(self.generation)
        if current is None or self._wanted() is not None:
            return  # a new generation is due: whoever finished will run it
        finished = (self.generation, self.steps - 1)
        if all(self._done.get(gpu, (0, -1)) >= finished for gpu in current.view.ranks):
            seconds = self.clock() - self._started_at
            self.events.write("done", generation=self.generation, steps=self.steps, last_step=self.steps - 1,
                              seconds=seconds)  # fmt: skip
            self.finish(ExitCode.OK, f"done: {self.steps} steps in {seconds:.1f} s")

    # ------------------------------------------------------------------ below the threshold
    def _below_threshold(self, request: Request, cannot: CannotKeepReplicas) -> None:
        why = f"{cannot.reason} (live nodes {cannot.live_nodes}, need {cannot.needed})"
        self.events.write("below_threshold", live=cannot.live_nodes, needed=cannot.needed, reason=cannot.reason)
        if self.phase is JobPhase.WAITING:
            self.finish(ExitCode.BAD_INPUT, f"planning {len(request.live)} nodes failed: {why}")
            return
        self.policy.below_threshold(self, request, cannot, why)

    def start_checkpoint_round(self, request: Request, cannot: CannotKeepReplicas, why: str) -> None:
        """The survivors of the base generation write its layers; the job stops once they did."""
        gen = self._gens[request.base].view
        writers = tuple(n for n in gen.nodes if n not in request.lost)
        self._start_round(gen, writers, why, f"only {cannot.live_nodes} nodes left, {cannot.needed} needed for "
                                             "f+1 replicas")  # fmt: skip

    def _start_round(self, gen: GenerationView, writers: tuple[str, ...], why: str, headline: str,
                     requested: bool = False) -> None:  # fmt: skip
        directory = checkpointing.new_checkpoint_dir(self.options.checkpoint_root, self.generation)
        now = self.clock()
        deadline = now + self.timeouts.checkpoint_round_timeout.total_seconds()
        self._round = checkpointing.CheckpointRound(directory, gen, writers, why, now, deadline, requested=requested)
        self.phase = JobPhase.CHECKPOINTING
        self._send_round()
        self.say(f"{headline}: checkpointing generation {gen.number} to {directory}")

    def _send_round(self) -> None:
        assert self._round is not None
        r = self._round
        self.events.write("checkpoint_requested", dir=r.directory, generation=r.gen.number, writers=list(r.writers),
                          surviving_ranks=r.surviving)  # fmt: skip
        for node in r.writers:
            self.send(node, r.command())

    def _round_lost(self, node: str) -> None:
        if self._round is None or node not in self._round.writers:
            return
        again = self._round.without(node)
        if again is None:
            why = f"node {node} was lost while checkpointing and took the last copy of some layers with it"
            self._state_lost(why, f"{why}; the model state is gone")
            return
        self._round = again
        self._send_round()  # the remaining writers now own the lost node's layers

    def _check_round(self) -> None:
        r = self._round
        assert r is not None
        now = self.clock()
        if not r.complete():
            if now > r.deadline:
                self.finish(ExitCode.ERROR, f"the checkpoint to {r.directory} did not complete: "
                                            f"{len(r.reports)} of {len(r.expected())} workers answered")  # fmt: skip
            return
        step, problem = r.step()
        if step is None:
            self.finish(ExitCode.ERROR, f"the checkpoint to {r.directory} is inconsistent: {problem}")
            return
        checkpointing.write_meta(r.directory, self.job, step)
        layers = sum(d.layers for d in r.reports.values())
        self.events.write("checkpoint_written", dir=r.directory, step=step, layers=layers,
                          seconds=now - r.started, generation=r.gen.number)  # fmt: skip
        headline = r.reason if r.requested else None
        self.stop_below_threshold(r.reason, (r.directory, step), headline=headline)

    def _state_lost(self, why: str, without_checkpoint: str) -> None:
        """Some layer has no copy left: stop at the newest periodic checkpoint (exit 3, never 1 while one
        exists), else end the job as failed."""
        if self.policy.last_checkpoint is not None:
            self.stop_below_threshold(why, self.policy.last_checkpoint)
        else:
            self.finish(ExitCode.ERROR, without_checkpoint)

    def stop_below_threshold(self, why: str, checkpoint: tuple[str, int] | None, detail: str = "",
                             headline: str | None = None) -> None:  # fmt: skip
        """Ends the job with exit 3, saying how to resume (from ``checkpoint``, or the run's own resume point)."""
        headline = headline or f"cannot keep f+1 replicas: {why}"
        if checkpoint is not None:
            directory, step = checkpoint
            message = (f"{headline}.\nCheckpoint of step {step} written to {directory}\n"
                       f"resume with: {self.options.resume_command} --resume {directory}")  # fmt: skip
        elif self.options.resume_dir:
            message = (f"{headline}.\nNo step was completed since the resume\n"
                       f"resume with: {self.options.resume_command} --resume {self.options.resume_dir}")  # fmt: skip
        else:
            message = f"{headline}. No checkpoint to resume from{': ' + detail if detail else ''}"
        self.finish(ExitCode.NO_REPLICAS, message)

    def request_stop(self, reason: str) -> None:
        """A graceful stop (SIGTERM to the master or to ``local``): the workers write the step they are at
        and the job ends with exit 3 and the resume command (exit 0 would tell a scheduler the run is done).
        Before any step there is nothing to write: the job ends at once."""
        with self._lock:
            if self.finish_result is not None or self.phase is JobPhase.CHECKPOINTING:
                return
            self.events.write("stop_requested", reason=reason, phase=self.phase.value, next_step=self.next_step)
            base = None
            if self.phase in _TRAINING:
                base = self._base_held_by_everyone_alive()
            if base is None or base.generation == 0:
                if self.options.resume_dir:  # nothing trained since the resume: it still resumes from there
                    self.stop_below_threshold(reason, None, headline=f"stopped on request ({reason})")
                else:
                    self.finish(ExitCode.ERROR, f"stopped on request ({reason}) before any step: nothing to save")
                return
            headline = f"stopped on request ({reason})"
            self._start_round(self._gens[base.generation].view, base.holding_nodes, headline, headline,
                              requested=True)  # fmt: skip
            self._changed.notify_all()
