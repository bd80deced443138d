"""A model of the master's world for ``test_cp_machine.py`` and ``scripts/bench_machine.py``.

Hypothesis drives ``oobleck_mm.master.machine.step`` with random orders of everything a
master can see: agents registering, opening their streams, dying, hanging,
giving notice; workers reporting steps, phases, aborted iterations and
checkpoints (late, twice, from old generations); a planner answering late,
out of order or after the membership changed; stop requests; the master
itself restarted from its journal. The workers are played as real ones
behave: they follow the assignments the machine sent them, and a step of a
generation completes only when every one of its workers is alive.

The planner is fake (what is under test is the machine, not the planner, and
the real one would make each of thousands of sequences cost seconds): it puts
every node it is given into pipelines of two nodes (three for an odd one out),
so ``n0 = 2`` and, with ``f = 1``, the job needs 4 nodes; below that it answers
``CannotKeepReplicas`` like the real one.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from oobleck_mm.master import machine
from oobleck_mm.master.checkpointing import doomed_checkpoints, step_of
from oobleck_mm.master.effects import (
    AskPlanner,
    EndStream,
    Finished,
    PruneCheckpoints,
    Record,
    Send,
    WriteJournal,
    WriteMeta,
)
from oobleck_mm.master.stragglers import RankCompute
from oobleck_mm.master.inputs import (
    Adopt,
    Heartbeat,
    Leave,
    OpenStream,
    PlanAnswered,
    Register,
    Report,
    StopRequested,
    StepCompleted,
    Straggler,
    StreamEnded,
    Tick,
)
from oobleck_mm.master.state import JobPhase, JobState, RunOptions, Settings
from oobleck_mm.config import apply_overrides, load_config
from oobleck_mm.errors import ExitCode
from oobleck_mm.planning.layout import ExecutionPlan, PipelineLayout, StageLayout
from oobleck_mm.planning.planner import Planned
from oobleck_mm.planning.reconfigure import CannotKeepReplicas
from oobleck_mm.protocol import oobleck_pb2 as pb

TINY = str(Path(__file__).resolve().parents[2] / "configs" / "tiny_mm.yaml")
NAMES = tuple(f"n{i}" for i in range(8))
NEEDED = 4
"""(f + 1) * n0 with the fake planner's two-node pipelines and f = 1."""
NUM_LAYERS = 4


@dataclass(frozen=True)
class FakePlan:
    """The planning ``Plan`` the fake planner hands back (what a reconfiguration starts from)."""

    nodes: tuple[str, ...]
    samples_per_s: float = 100.0


def fake_plan(nodes: tuple[str, ...], fresh: bool, slow=()) -> Planned | CannotKeepReplicas:
    """``slow`` (node, factor): a pipeline with a slow node runs one microbatch, the others two (the split
    for the speeds; the fake keeps no global batch)."""
    if len(nodes) < NEEDED:
        return CannotKeepReplicas(len(nodes), NEEDED, f"{len(nodes)} nodes cannot hold 2 replicas of 2-node pipelines")
    groups = [list(nodes[i : i + 2]) for i in range(0, len(nodes) - len(nodes) % 2, 2)]
    if len(nodes) % 2:
        groups[-1].append(nodes[-1])
    pipelines, ranks = [], {}
    for group in groups:
        bounds = [0, 2, 4] if len(group) == 2 else [0, 1, 2, 4]
        stages = []
        for i, node in enumerate(group):
            ranks[(node, 0)] = len(ranks)
            stages.append(StageLayout(ranks[(node, 0)], bounds[i], bounds[i + 1]))
        pipelines.append(PipelineLayout(tuple(stages), 1 if set(group) & {n for n, _ in slow} else 2))
    layout = ExecutionPlan(tuple(pipelines), NUM_LAYERS, 1)
    return Planned(
        FakePlan(nodes),
        layout,
        ranks,
        NEEDED,
        fresh=fresh,
        actions=(),
        reason="fake",
        seconds=0.0,
        keeps_replicas_from=NEEDED,
    )


BENCH_FROM = 3.0
"""The fake planner predicts the job faster without a slow node from this factor on (the real one weighs
the cost model's samples/s: ``planning.planner.weigh_bench``)."""


def answer(ask: AskPlanner) -> Planned | CannotKeepReplicas:
    slow = tuple(ask.slow or ())
    if ask.call == "fresh":
        return fake_plan(tuple(ask.names), fresh=True, slow=slow)
    kept = tuple(n for n in ask.base.nodes if n not in ask.lost)
    planned = fake_plan(kept + tuple(n for n in ask.joined if n not in kept), fresh=False, slow=slow)
    factors = dict(slow)
    out = tuple(n for n in ask.bench if factors.get(n, 1.0) >= BENCH_FROM)
    if out and isinstance(planned, Planned):
        without = fake_plan(tuple(n for n in planned.plan.nodes if n not in out), fresh=False, slow=slow)
        if isinstance(without, Planned):
            return dataclasses.replace(without, benched=out)
    return planned


@dataclass
class Agent:
    """One simulated node: its agent's registration and what its worker was told."""

    name: str
    session: int
    stream: bool = False
    hung: bool = False
    mute: bool = False
    """Its agent heartbeats, but its workers' reports no longer reach the master (issue 55)."""
    ready: bool = False
    dismissed: bool = False
    assignment: pb.Assignment | None = None
    checkpoint: pb.Checkpoint | None = None
    last_metrics: pb.StepMetrics | None = None


@dataclass
class World:
    """Everything outside the machine, and what the invariants need to remember."""

    agents: dict[str, Agent] = field(default_factory=dict)
    asked: dict[int, AskPlanner] = field(default_factory=dict)
    journal: object = None
    finished: list[Finished] = field(default_factory=list)
    sessions: int = 0
    max_generation: int = 0
    stop_requested: bool = False
    done_by: set = field(default_factory=set)
    """(generation, node) of every WorkerDone sent."""
    disk: set = field(default_factory=set)
    """The run's complete periodic checkpoints (their meta.json written, not pruned)."""
    pruned: set = field(default_factory=set)
    """Checkpoint folders a prune removed: their layer files are gone, so a meta.json written later (a late
    report of one) cannot make them complete again (``save_meta`` refuses)."""


class MachineModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.world = World()
        self.now = 1000.0
        self.state: JobState | None = None
        self.settings: Settings | None = None
        self.steps_judged = 0

    # ------------------------------------------------------------------ plumbing
    @initialize(
        steps=st.sampled_from([3, 10, 30, 100, 1000]),
        recovery=st.sampled_from(["live", "live", "restart"]),
        interval=st.sampled_from([0, 2, 5]),
        started=st.sampled_from([0, 4, 5, 6, 6, 7]),
    )
    def start(self, steps: int, recovery: str, interval: int, started: int, resplit: bool = True) -> None:
        """A job with ``started`` nodes trained its first step (0: the events of the start-up too)."""
        job = apply_overrides(
            load_config(TINY), nodes=4, gpus_per_node=1, steps=steps, recovery=recovery, checkpoint_interval=interval
        )
        job = dataclasses.replace(
            job,
            fault_tolerance=dataclasses.replace(
                job.fault_tolerance,
                f=1,
                straggler_resplit=resplit,
                straggler_replan_after=timedelta(seconds=2),
                straggler_bench=timedelta(seconds=10),
            ),
        )  # a bench of 80 s at most: the settling clock sees it end
        options = RunOptions(checkpoint_root="/run", recovery=recovery, checkpoint_interval=interval)
        self.settings = Settings.of(job, num_nodes=4, steps=steps, store_host="h", store_port=1, options=options)
        self.state = JobState(last_progress=self.now)
        if not started:
            return
        for name in NAMES[:started]:
            self.register(name)
            agent = self.world.agents[name]
            agent.stream = self.feed(OpenStream(name, agent.session)).refused is None
            agent.ready = True
            self.report(agent, ready=pb.WorkerReady(startup_s=1.0))
        self.time_passes(0.1)
        for plan_id in sorted(self.world.asked):
            self.feed(PlanAnswered(plan_id, answer(self.world.asked.pop(plan_id))))
        self.train_a_step(phases=True)

    def feed(self, event):
        transition = machine.step(self.state, event, self.now, self.settings)
        assert transition.state is self.state
        followups = []
        for effect in transition.effects:
            followups.extend(self.carry_out(effect))
        for follow in followups:
            self.feed(follow)
        return transition

    def carry_out(self, effect) -> list:
        w, s = self.world, self.state
        if isinstance(effect, Send):
            assert effect.node in s.registry.nodes, f"sent {effect.event} to {effect.node}, not registered"
            agent = w.agents.get(effect.node)
            if agent is None or agent.session != s.registry.nodes[effect.node].session:
                return []
            event = pb.AgentEvent.FromString(effect.event.SerializeToString())  # what the agent parses
            kind = event.WhichOneof("event")
            if kind == "assignment":
                agent.assignment = event.assignment.assignment
            elif kind == "checkpoint":
                agent.checkpoint = event.checkpoint
            elif kind == "shutdown" and s.registry.nodes[effect.node].dismissed:
                agent.dismissed = (
                    True  # a leaving node: it hangs up once its workers stopped (at a boundary or at once)
                )
            elif kind == "restart":
                agent.assignment = None
            elif kind == "bench":  # the workers finish the iteration in flight; fresh ones start up
                agent.assignment, agent.ready, agent.last_metrics = None, False, None
        elif isinstance(effect, EndStream):
            agent = w.agents.pop(effect.node, None)
            if agent is not None and agent.stream:  # the agent sees its stream end and stops its workers
                return [StreamEnded(agent.name, agent.session)]
        elif isinstance(effect, AskPlanner):
            assert s.planning is not None and s.planning.id == effect.id, "a plan asked for is not the pending one"
            w.asked[effect.id] = effect
        elif isinstance(effect, WriteJournal):
            w.journal = effect.journal
        elif isinstance(effect, WriteMeta):
            if effect.directory not in w.pruned:
                w.disk.add(effect.directory)
        elif isinstance(effect, PruneCheckpoints):
            parent = "/run/checkpoints"
            steps = {step_of(d) for d in w.disk}
            doomed = set(
                doomed_checkpoints(parent, steps, steps, effect.keep, effect.pinned, upto=step_of(effect.directory))
            )
            w.disk -= doomed
            w.pruned |= doomed
        elif isinstance(effect, Finished):
            w.finished.append(effect)
            assert len(w.finished) == 1, f"finished twice: {w.finished}"
            if effect.exit_code == ExitCode.OK:  # every worker wrote the final save and said so
                view = s.current_view()
                silent = [n for n in view.nodes if (view.number, n) not in w.done_by]
                assert not silent, f"exit 0 before {silent} of generation {view.number} reported done"
        elif isinstance(effect, Record) and effect.kind == "lost" and effect.fields["reason"] == "reports_silent":
            agent = w.agents.get(effect.fields["node"])
            assert agent is None or agent.mute, f"{agent.name} lost for silent reports, but it reported every step"
        elif isinstance(effect, Record) and effect.kind == "plan_decided":
            nodes, number = effect.fields["nodes"], effect.fields["generation"]
            eligible = set(s.registry.names())
            assert set(nodes) <= eligible, f"generation {number} uses {nodes}, live {eligible}"
            benched = set(nodes) & s.out_on_bench(self.now)
            assert not benched, f"generation {number} takes {benched}, still on the bench"
            before = s.gens.get(number - 1)
            if number > 1 and before is not None:  # a newcomer is admitted once its workers are up, never before
                unready = [
                    n
                    for n in effect.fields["joined"]
                    if n not in before.view.nodes and not s.registry.nodes[n].all_ready
                ]
                assert not unready, f"generation {number} admits {unready} before their workers are ready"
        return []

    # ------------------------------------------------------------------ the agents
    @rule(name=st.sampled_from(NAMES))
    def register(self, name: str) -> None:
        w = self.world
        if name in w.agents:
            return
        w.sessions += 1
        t = self.feed(Register(name, w.sessions, 0))
        if t.refused is None:
            w.agents[name] = Agent(name, w.sessions)

    @rule(data=st.data())
    def open_stream(self, data) -> None:
        pending = [a for a in self.world.agents.values() if not a.stream]
        if pending:
            agent = data.draw(st.sampled_from(pending))
            if self.feed(OpenStream(agent.name, agent.session)).refused is None:
                agent.stream = True

    @rule(data=st.data())
    def workers_ready(self, data) -> None:
        waiting = [a for a in self.world.agents.values() if a.stream and not a.ready]
        if waiting:
            agent = data.draw(st.sampled_from(waiting))
            agent.ready = True
            self.report(agent, ready=pb.WorkerReady(startup_s=1.0))

    @rule(data=st.data(), now=st.booleans())
    def kill(self, data, now: bool) -> None:
        """The node dies: its sockets are reset, its stream ends."""
        if self.world.agents and now:
            agent = self.world.agents.pop(data.draw(st.sampled_from(sorted(self.world.agents))))
            self.feed(StreamEnded(agent.name, agent.session))

    def kill_named(self, name: str) -> None:
        agent = self.world.agents.pop(name)
        self.feed(StreamEnded(agent.name, agent.session))

    def feed_tick(self, seconds: float) -> list:
        """The clock moves by ``seconds`` in one tick (everyone heartbeats first): the tick's effects."""
        self.now += seconds
        for agent in list(self.world.agents.values()):
            if not agent.hung:
                self.feed(Heartbeat(agent.name, agent.session, self.now))
        return list(self.feed(Tick(detect=True)).effects)

    @rule()
    def woken_by_a_change(self) -> None:
        """The control loop ticks for a change between two detections: no node's health is looked at."""
        self.feed(Tick(detect=False))

    @rule(data=st.data(), now=st.integers(0, 2))
    def hang(self, data, now: int) -> None:
        """The node stops (SIGSTOP, a dead network): no heartbeat, no report, its stream stays open."""
        awake = [a for a in self.world.agents.values() if not a.hung]
        if awake and not now:
            data.draw(st.sampled_from(awake)).hung = True

    @rule(data=st.data(), now=st.integers(0, 3))
    def mute(self, data, now: int) -> None:
        """The agent's report thread dies: it heartbeats on, its workers train, nothing they report arrives."""
        awake = [a for a in self.world.agents.values() if not a.hung and not a.mute]
        if awake and not now:
            data.draw(st.sampled_from(awake)).mute = True

    @rule(data=st.data())
    def notice(self, data) -> None:
        live = [a for a in self.world.agents.values() if not a.hung]
        if live:
            agent = data.draw(st.sampled_from(live))
            self.feed(Leave(agent.name, agent.session, "preemption notice"))

    @rule(data=st.data(), detected=st.booleans(), factor=st.sampled_from([0.5, 1.6, 2.0, 3.5]))
    def straggler_verdict(self, data, detected: bool, factor: float) -> None:
        """``oobleck_mm.master.stragglers`` found a node slow, or no longer (also a node gone, or never slow)."""
        if self.world.agents or NAMES:
            name = data.draw(st.sampled_from(sorted(self.world.agents) or list(NAMES)))
            self.feed(Straggler(name, factor, detected))

    @rule(data=st.data(), factor=st.sampled_from([1.0, 1.3, 2.0, 4.0]))
    def a_step_completes(self, data, factor: float) -> None:
        """Every rank of the current generation reported a step: the machine judges each node's compute (one
        node ``factor`` x slower than the rest), so its own verdicts meet every other event order too."""
        view = self.state.current_view()
        if view is None or not view.rank_nodes:
            return
        slow = data.draw(st.sampled_from(sorted(set(view.rank_nodes))))
        ranks = tuple(RankCompute(node, (factor if node == slow else 1.0) * 0.1, 0.1) for node in view.rank_nodes)
        self.steps_judged += 1
        self.feed(StepCompleted(view.number, self.steps_judged, ranks))

    @rule(data=st.data())
    def dismissed_hang_up(self, data) -> None:
        gone = [a for a in self.world.agents.values() if a.dismissed]
        if gone:
            agent = self.world.agents.pop(data.draw(st.sampled_from(gone)).name)
            self.feed(StreamEnded(agent.name, agent.session))

    # ------------------------------------------------------------------ the workers
    def report(self, agent: Agent, replayed: bool = False, **kind) -> None:
        if agent.mute:
            return
        self.feed(Report(agent.name, agent.session, 0, pb.WorkerReport(**kind), replayed))

    def generation_workers(self) -> list[tuple[Agent, pb.Assignment]] | None:
        """The current generation's workers if every one of them is alive and was told: it can train."""
        current = self.state.current_view()
        if current is None or self.state.phase not in (JobPhase.RUNNING, JobPhase.ADOPTING):
            return None
        out = []
        for (node, _), _rank in current.ranks.items():
            agent = self.world.agents.get(node)
            a = agent.assignment if agent is not None else None
            if agent is None or agent.hung or a is None or a.generation != current.number:
                return None
            out.append((agent, a))
        for agent, a in out:  # the workers open the checkpoint they were told to load: it must be there
            if a.resume_dir.startswith("/run/") and self.state.progress() < 0:
                assert a.resume_dir in self.world.disk, (
                    f"generation {a.generation} loads {a.resume_dir}, which is gone (on disk: {sorted(self.world.disk)})"
                )
        return out

    @rule(phases=st.booleans())
    def train_a_step(self, phases: bool) -> None:
        workers = self.generation_workers()
        if workers is None:
            return
        step = self.state.next_step
        if step >= self.settings.steps:  # a generation with no step left: its rendezvous, the final save, done
            for agent, a in workers:
                self.report(agent, phase=pb.PhaseDone(generation=a.generation, phase="rendezvous", step=step))
                self.world.done_by.add((a.generation, agent.name))
                self.report(agent, done=pb.WorkerDone(step=self.settings.steps - 1))
                if self.state.finish is None:
                    self.feed(Tick(detect=True))  # the control loop may look between two workers' reports
            return
        for agent, a in workers:
            if phases:
                self.report(agent, phase=pb.PhaseDone(generation=a.generation, phase="rendezvous", step=step))
                if a.previous_generation:
                    self.report(agent, phase=pb.PhaseDone(generation=a.generation, phase="states_copied", step=step))
            m = pb.StepMetrics(generation=a.generation, step=step, rank=a.rank, loss=1.0, step_time_s=0.1)
            agent.last_metrics = m
            self.report(agent, metrics=m)
            self.report(agent, phase=pb.PhaseDone(generation=a.generation, phase="resumed", step=step))

    @rule(data=st.data())
    def copy_states(self, data) -> None:
        """Some workers of a new generation finished copying (not all: a copy cut short)."""
        workers = self.generation_workers()
        if workers:
            for agent, a in data.draw(st.lists(st.sampled_from(workers), max_size=len(workers), unique_by=id)):
                self.report(agent, phase=pb.PhaseDone(generation=a.generation, phase="states_copied"))

    @rule(data=st.data())
    def abort(self, data) -> None:
        workers = self.generation_workers()
        if workers:
            agent, a = data.draw(st.sampled_from(workers))
            self.report(agent, phase=pb.PhaseDone(generation=a.generation, phase="aborted", message="timed out"))

    @rule(data=st.data(), back=st.integers(0, 3))
    def stale_report(self, data, back: int) -> None:
        """A report of an older generation, or one delivered twice."""
        agents = [a for a in self.world.agents.values() if a.last_metrics is not None and not a.hung]
        if agents:
            agent = data.draw(st.sampled_from(agents))
            m = pb.StepMetrics()
            m.CopyFrom(agent.last_metrics)
            m.generation = max(0, m.generation - back)
            self.report(agent, metrics=m)

    @rule()
    def periodic_checkpoint(self) -> None:
        workers = self.generation_workers()
        if workers:
            step = self.state.next_step
            for agent, a in workers:
                done = pb.CheckpointDone(
                    dir=f"/run/checkpoints/step{step:08d}", generation=a.generation, step=step, layers=1
                )
                self.report(agent, checkpoint_done=done)

    @rule(data=st.data(), ahead=st.integers(0, 12))
    def late_checkpoint(self, data, ahead: int) -> None:
        """A checkpoint an older generation wrote before it stopped, reported after the plan that replaced it
        (its agent forwarded it late, or replayed it to a restarted master): issue 56."""
        s = self.state
        agents = [a for a in self.world.agents.values() if not a.hung]
        if agents and s.generation > 1 and self.settings.options.checkpoint_interval:
            agent = data.draw(st.sampled_from(agents))
            step = min(s.next_step + ahead, self.settings.steps - 1)
            done = pb.CheckpointDone(
                dir=f"/run/checkpoints/step{step:08d}", generation=s.generation - 1, step=step, layers=1
            )
            self.report(agent, checkpoint_done=done)

    @rule(ahead=st.integers(1, 12))
    def checkpoint_on_disk_unreported(self, ahead: int) -> None:
        """Restart mode: a checkpoint complete on disk (its rank 0 wrote meta.json) whose report has not reached
        the master (its workers trained on while no master ran): pruning sees it, the master does not. The
        workers wrote every one up to it, each interval, and a report of those may still come."""
        s = self.state
        interval = self.settings.options.checkpoint_interval
        if self.settings.options.recovery == "restart" and interval:
            last = min(s.next_step + ahead, self.settings.steps - 1)
            for step in range(last, s.next_step, -interval):
                self.world.disk.add(f"/run/checkpoints/step{step:08d}")

    @rule(data=st.data(), fails=st.booleans())
    def write_round_share(self, data, fails: bool) -> None:
        told = [a for a in self.world.agents.values() if a.checkpoint is not None and not a.hung]
        if told:
            agent = data.draw(st.sampled_from(told))
            c, agent.checkpoint = agent.checkpoint, None
            done = pb.CheckpointDone(
                dir=c.dir,
                generation=c.generation,
                step=self.state.next_step,
                layers=1,
                error="disk full" if fails and data.draw(st.integers(0, 9)) == 0 else "",
            )
            self.report(agent, checkpoint_done=done)

    # ------------------------------------------------------------------ the planner, the clock, the operator
    @rule(data=st.data())
    def planner_answers(self, data) -> None:
        if self.world.asked:
            plan_id = data.draw(st.sampled_from(sorted(self.world.asked)))
            self.feed(PlanAnswered(plan_id, answer(self.world.asked.pop(plan_id))))

    @rule(seconds=st.sampled_from([0.01, 0.05, 0.1, 0.3, 1.0, 2.0, 4.0]))
    def time_passes(self, seconds: float) -> None:
        """The control loop ticks every 0.1 s; every agent that is not hung heartbeats meanwhile."""
        end = self.now + seconds
        while self.now < end and self.state.finish is None:
            self.now = min(end, self.now + 0.1)
            for agent in list(self.world.agents.values()):
                if not agent.hung and agent.name in self.world.agents:
                    self.feed(Heartbeat(agent.name, agent.session, self.now))
            self.feed(Tick())  # the machine's own cadence decides whether it detects (``Tick.detect``)

    @rule(seconds=st.sampled_from([1.0, 5.0]))
    def master_frozen(self, seconds: float) -> None:
        """The master itself was descheduled: nobody's heartbeats were read meanwhile."""
        self.now += seconds
        self.feed(Tick(detect=True))

    @rule(now=st.integers(0, 4))
    def stop(self, now: int) -> None:
        if now:  # one draw in five: most sequences are about the nodes, not the operator
            return
        self.world.stop_requested = True
        self.feed(StopRequested("SIGTERM"))

    @rule(now=st.integers(0, 2))
    def master_restarts(self, now: int) -> None:
        """The master dies and a new one re-adopts its journal; the agents come back as they are."""
        if now or self.world.journal is None or self.state.finish is not None:
            return
        w = self.world
        self.state = JobState(last_progress=self.now)
        w.asked.clear()
        self.feed(Adopt(w.journal, 5.0))
        for agent in list(w.agents.values()):
            if agent.hung:
                del w.agents[agent.name]  # a stopped agent never comes back on its own
                continue
            w.sessions += 1
            agent.session, agent.stream = w.sessions, False
            adopt = agent.assignment.generation if agent.assignment is not None else 0
            if self.feed(Register(agent.name, agent.session, 0, adopt_generation=adopt)).refused is not None:
                del w.agents[agent.name]
                continue
            # The agent replays each worker's latest report of every kind (``oobleck_mm.agent.reports``).
            if agent.ready:
                self.report(agent, replayed=True, ready=pb.WorkerReady(startup_s=1.0))
            if agent.last_metrics is not None:
                self.report(agent, replayed=True, metrics=agent.last_metrics)
            if self.feed(OpenStream(agent.name, agent.session)).refused is None:
                agent.stream = True

    # ------------------------------------------------------------------ invariants
    @invariant()
    def generations_only_grow(self) -> None:
        if self.state is None:
            return
        assert self.state.generation >= self.world.max_generation
        self.world.max_generation = self.state.generation

    @invariant()
    def a_finish_is_stated(self) -> None:
        s = self.state
        if s is None:
            return
        assert (s.phase is JobPhase.FINISHED) == (s.finish is not None)
        if s.finish is None:
            return
        code, message = s.finish.exit_code, s.finish.message
        assert message, "a finish without a message"
        if code == ExitCode.OK:
            assert s.next_step >= self.settings.steps, f"exit 0 at step {s.next_step} of {self.settings.steps}"
        elif code == ExitCode.NO_REPLICAS:
            assert "resume with:" in message or "No checkpoint to resume from" in message, message
        elif code == ExitCode.ERROR and not self.world.stop_requested:
            # Exit 1 only when the state is gone with no checkpoint, a round failed, or re-forms ran out.
            assert "gone" in message or "checkpoint" in message or "abandoned" in message or "came back" in message, (
                message
            )

    @invariant()
    def a_lost_node_is_told(self) -> None:
        """An agent whose registration the master dropped has had its stream ended (it stops, or registers
        again): none keeps an open stream to a master that no longer knows it."""
        if self.state is None or self.state.finish is not None:
            return
        for agent in self.world.agents.values():
            entry = self.state.registry.nodes.get(agent.name)
            assert not agent.stream or (entry is not None and entry.session == agent.session), (
                f"{agent.name}'s stream is open, but the master dropped its registration without ending it"
            )

    @invariant()
    def running_has_a_generation(self) -> None:
        s = self.state
        if s is not None and s.phase in (JobPhase.RUNNING, JobPhase.ADOPTING):
            view = s.current_view()
            assert view is not None
            assert sorted(view.ranks.values()) == list(range(view.layout.world_size))

    def settle(self) -> None:
        """No more chaos: the planner answers, the workers do as told, the clock runs."""
        for _ in range(400):
            if self.state.finish is not None:
                return
            self.settle_once()

    def settle_once(self) -> None:
        """A quarter second of the world doing as told."""
        w = self.world
        for plan_id in sorted(w.asked):
            self.feed(PlanAnswered(plan_id, answer(w.asked.pop(plan_id))))
        for agent in list(w.agents.values()):
            if agent.name not in w.agents:
                continue
            if agent.dismissed:
                w.agents.pop(agent.name)
                self.feed(StreamEnded(agent.name, agent.session))
            elif not agent.stream:
                if self.feed(OpenStream(agent.name, agent.session)).refused is None:
                    agent.stream = True
            elif not agent.ready and not agent.hung:
                agent.ready = True
                self.report(agent, ready=pb.WorkerReady(startup_s=1.0))
            elif agent.checkpoint is not None and not agent.hung:
                c, agent.checkpoint = agent.checkpoint, None
                self.report(
                    agent,
                    checkpoint_done=pb.CheckpointDone(
                        dir=c.dir, generation=c.generation, step=self.state.next_step, layers=1
                    ),
                )
        self.train_a_step(phases=True)
        self.time_passes(0.25)

    def teardown(self) -> None:
        if self.state is None:
            return
        self.settle()
        s = self.state
        event(f"generations: {min(s.generation, 5)}{'+' if s.generation >= 5 else ''}")
        event(f"benched: {max((b.times for b in s.benched.values()), default=0)}")
        event(f"end: {s.phase.value}" + (f" exit {s.finish.exit_code}: {s.finish.message[:40]}" if s.finish else ""))
        if s.finish is not None:
            return
        live = set(s.registry.names()) - s.out_on_bench(self.now)
        if s.phase is JobPhase.WAITING:
            assert len(live) < self.settings.num_nodes, f"{len(live)} live nodes and still waiting"
            return
        current = s.current_view()
        assert s.phase is JobPhase.RUNNING, f"not settled: {s.phase.value}"
        planned = set(current.nodes) if current is not None else set()
        mute = sorted(n for n in planned if self.world.agents[n].mute)
        if mute and set(mute) == planned:
            return  # every node of the generation mute: no evidence against any; stall_timeout ends the job
        assert not mute, (
            f"{mute} of generation {s.generation} report nothing while the others trained on: the job waits for them"
        )
        # A mute node outside the plan is never seen ready, so never admitted: it idles, harming nothing.
        live -= {a.name for a in self.world.agents.values() if a.mute}
        # Restart mode admits joins only at its next restart (restarting for them would redo steps).
        admitted = planned <= live if self.settings.options.recovery == "restart" else planned == live
        assert current is not None and admitted, (
            f"settled on generation {s.generation} with nodes {sorted(planned)}; live {sorted(live)}"
        )
        if len(live) < NEEDED:
            raise AssertionError(f"running on {len(live)} nodes, {NEEDED} needed for f+1 replicas")
        if self.settings.options.recovery == "live" and s.next_step < self.settings.steps:
            # The batch split follows the nodes' speeds: the settled generation was split for the slow
            # nodes it runs, with the factors last measured.
            slow = tuple(sorted((n, f) for n, f in s.slow.items() if n in planned))
            assert s.gens[s.generation].slow == slow or s.gens[s.generation].plan is None, (
                f"generation {s.generation} split for {s.gens[s.generation].slow}, nodes slow now {slow}"
            )
