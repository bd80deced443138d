"""The master's state machine without gRPC: registration, planning, detection, reconfiguration, checkpoints, the end.

The planner runs for real on the tiny model; the clock is a number the test
moves; the test plays the agents (reading their outboxes) and the workers
(sending their reports).
"""

from __future__ import annotations

import dataclasses
import json
import queue
import time
from datetime import timedelta
from pathlib import Path

import pytest

from oobleck_mm.master.coordinator import Coordinator, JobPhase, RunOptions
from oobleck_mm.master.coordinator import END_OF_STREAM
from oobleck_mm.master.registry import Refused
from oobleck_mm.config import apply_overrides
from oobleck_mm.config import load_config
from oobleck_mm.events import EventLog, read_events
from oobleck_mm.model.layers import model_layer_specs
from oobleck_mm.protocol import oobleck_pb2 as pb
from oobleck_mm.protocol.convert import plan_from_proto

TINY = str(Path(__file__).resolve().parents[2] / "configs" / "tiny_mm.yaml")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Job:
    """A coordinator and the agents the test plays."""

    def __init__(self, c: Coordinator, clock: Clock, lines: list[str], events: Path) -> None:
        self.c, self.clock, self.lines, self.events = c, clock, lines, events
        self.sessions: dict[str, int] = {}
        self.boxes: dict[str, queue.Queue] = {}
        self.assigned: dict[tuple[str, int], pb.Assignment] = {}  # latest per worker

    def join(self, name: str, stream: bool = True, ready: bool = True) -> None:
        self.sessions[name], gpus, _ = self.c.register(name, 0, 1 << 30, 123, "ipv4:127.0.0.1:1")
        if stream:
            self.boxes[name] = self.c.open_stream(name, self.sessions[name])
        if stream and ready:  # its workers started, imported and warmed up
            self.ready(name, gpus)

    def ready(self, name: str, gpus: int = 1) -> None:
        for local_rank in range(gpus):
            self.report((name, local_rank), ready=pb.WorkerReady(startup_s=2.5))

    def drain(self, name: str) -> list:
        out, box = [], self.boxes[name]
        while not box.empty():
            item = box.get_nowait()
            if item is not END_OF_STREAM:  # as the agent reads it: parsed from the wire form
                item = pb.AgentEvent.FromString(item.SerializeToString())
            out.append(item)
            if item is not END_OF_STREAM and item.WhichOneof("event") == "assignment":
                self.assigned[(name, item.assignment.local_rank)] = item.assignment.assignment
        return out

    def drain_all(self) -> dict[str, list]:
        return {name: self.drain(name) for name in list(self.boxes)}

    def report(self, gpu: tuple[str, int], **kind) -> None:
        done = kind.get("checkpoint_done")
        if done is not None and done.dir and not done.error:
            # What a worker's share leaves on disk before it reports: the master writes meta.json only over
            # layer files that are there (``save_meta``). Empty files: nothing here reads them.
            layers = Path(done.dir) / "layers"
            layers.mkdir(parents=True, exist_ok=True)
            for spec in model_layer_specs(self.c.job):
                (layers / f"{spec.name}.pt").touch()
        self.c.worker_report(gpu[0], self.sessions[gpu[0]], gpu[1], pb.WorkerReport(**kind))

    def train(self, generation: int, step: int) -> None:
        """Every worker of ``generation`` reports ``step`` done (and ``resumed`` on its first)."""
        for gpu, a in self.assigned.items():
            if a.generation == generation:
                self.report(
                    gpu,
                    metrics=pb.StepMetrics(
                        generation=generation, step=step, rank=a.rank, loss=1.0, samples_per_s=10.0, step_time_s=0.1
                    ),
                )
                self.report(gpu, phase=pb.PhaseDone(generation=generation, phase="resumed", step=step))

    def heartbeat_all(self) -> None:
        for name in self.boxes:
            if name in self.sessions:
                try:
                    self.c.heartbeat(name, self.sessions[name])
                except Refused:
                    pass

    def advance(self, seconds: float):
        result = None
        for _ in range(round(seconds / 0.05)):
            self.clock.now += 0.05
            result = self.c.tick()
        return result


@pytest.fixture
def make(tmp_path):
    made = []

    def build(
        nodes: int = 2,
        gpus: int = 1,
        steps: int = 3,
        options: RunOptions | None = None,
        memory=None,
        recovery: str | None = None,
        checkpoint_interval: int | None = None,
        f: int | None = None,
        stall_s: float | None = None,
        max_nodes: int | None = None,
        confirmed_silence: float | None = None,
        disk_thread: bool = False,
    ) -> Job:
        job = apply_overrides(
            load_config(TINY),
            nodes=nodes,
            gpus_per_node=gpus,
            steps=steps,
            recovery=recovery,
            checkpoint_interval=checkpoint_interval,
            max_nodes=max_nodes,
        )
        if memory is not None:  # a smaller GPU: the model needs n0 = 2 nodes, so pipelines span nodes
            job = dataclasses.replace(job, cluster=dataclasses.replace(job.cluster, device_memory=memory))
        if f is not None:
            job = dataclasses.replace(job, fault_tolerance=dataclasses.replace(job.fault_tolerance, f=f))
        if stall_s is not None:
            ft = dataclasses.replace(job.fault_tolerance, stall_timeout=timedelta(seconds=stall_s))
            job = dataclasses.replace(job, fault_tolerance=ft)
        if confirmed_silence is not None:
            ft = dataclasses.replace(job.fault_tolerance, confirmed_silence=timedelta(seconds=confirmed_silence))
            job = dataclasses.replace(job, fault_tolerance=ft)
        options = options or RunOptions(
            checkpoint_root=str(tmp_path),
            recovery=job.fault_tolerance.recovery,
            checkpoint_interval=job.fault_tolerance.checkpoint_interval,
        )
        clock, lines = Clock(), []
        events_path = tmp_path / f"events{len(made)}.jsonl"
        c = Coordinator(
            job,
            num_nodes=nodes,
            steps=steps,
            store_host="10.0.0.1",
            store_port=4321,
            events=EventLog(events_path),
            clock=clock,
            progress=lines.append,
            options=options,
            disk_thread=disk_thread,
        )
        made.append(c)
        return Job(c, clock, lines, events_path)

    yield build
    for c in made:
        c.events.close()


def start(j: Job, *names: str) -> None:
    for name in names:
        j.join(name)
    j.c.tick()
    j.drain_all()
    assert j.c.phase == JobPhase.RUNNING


def _alive_for(j: Job, seconds: float, tick: float = 0.05):
    """Every node heartbeats while the clock moves by ``tick``: nobody is lost, whatever the workers do."""
    result = None
    for _ in range(round(seconds / tick)):
        j.clock.now += tick
        j.heartbeat_all()
        result = j.c.tick()
    return result


def test_plans_when_enough_streams_are_open_and_assigns_every_gpu_a_distinct_rank(make):
    j = make(nodes=2, gpus=2)
    j.join("a")
    j.join("b", stream=False)
    assert j.c.tick() is None and j.c.phase == JobPhase.WAITING  # b registered but cannot be told anything yet
    j.boxes["b"] = j.c.open_stream("b", j.sessions["b"])
    j.c.tick()
    assert j.c.phase == JobPhase.RUNNING and j.c.generation == 1
    j.drain_all()
    sent = j.assigned
    assert set(sent) == {("a", 0), ("a", 1), ("b", 0), ("b", 1)}  # one worker per GPU of each node
    plan = plan_from_proto(next(iter(sent.values())).plan)
    assert sorted(a.rank for a in sent.values()) == list(range(plan.world_size)) == list(range(4))
    for a in sent.values():
        assert (a.generation, a.world_size, a.store_host, a.store_port, a.steps) == (1, 4, "10.0.0.1", 4321, 3)
        assert plan_from_proto(a.plan) == plan and a.previous_generation == 0 and not a.resume_dir
    # every worker knows each rank's node (the same-node preference of the state copy)
    for (node, _), a in sent.items():
        assert len(a.rank_nodes) == 4 and a.rank_nodes[a.rank] == node
        assert sorted(a.rank_nodes) == ["a", "a", "b", "b"]
    decided = read_events(j.events, "plan_decided")
    assert decided[0]["nodes"] == ["a", "b"] and decided[0]["layout"] == plan.to_dict()
    assert len(read_events(j.events, "assignment_sent")) == 4 and any(
        line.startswith("generation 1: ") for line in j.lines
    )
    assert j.lines[:2] == ["agent a registered (1/2)", "agent b registered (2/2)"]  # start-up progress


def test_a_slow_run_dir_holds_no_handler_and_no_assignment_goes_out_before_its_journal(make):
    """On the shared storage a run dir lives on, a journal write can take seconds (NFS: a close waits for
    the server). Written from the master's disk thread (``oobleck_mm.master.disk``), it holds neither the lock (a
    report, a heartbeat, a registration and a tick are applied at once meanwhile) nor the order: the
    generation's assignments, and the lines logged after its plan, go out only once its journal is on disk."""
    import threading

    j = make(nodes=2, steps=10, disk_thread=True)
    release, written = threading.Event(), []

    def slow_journal(journal) -> None:
        assert release.wait(10)
        written.append(journal.generation)

    j.c.journal_to = slow_journal
    j.join("a")
    j.join("b")
    j.c.tick()  # plans generation 1; its journal is being written
    assert j.c.phase == JobPhase.RUNNING and j.c.generation == 1
    assert j.drain_all() == {"a": [], "b": []} and not read_events(j.events, "assignment_sent")
    started = time.monotonic()
    j.heartbeat_all()
    j.report(("a", 0), stalled=pb.Stalled(generation=1, what="rendezvous", waited_s=0.5))
    j.join("c")  # a joiner registers meanwhile
    j.clock.now += 0.05
    j.c.tick()
    assert time.monotonic() - started < 1.0  # none of them waited for the disk (10 s if they had)
    assert not written and j.drain_all()["a"] == []
    release.set()
    assert j.c.flush_disk(timeout=10)
    assert written[0] == 1
    assert {gpu for gpu, a in j.assigned.items() if a.generation == 1} == set()  # drained above: nothing yet
    j.drain_all()
    assert {gpu for gpu, a in j.assigned.items() if a.generation == 1} == {("a", 0), ("b", 0)}
    assert len([e for e in read_events(j.events, "assignment_sent") if e["generation"] == 1]) == 2


def test_refusals_name_the_problem_and_are_logged(make):
    j = make()
    j.join("a")
    session = j.sessions["a"]
    for call, code in [
        (lambda: j.c.register("a", 0, 0, 1, "peer"), "ALREADY_EXISTS"),
        (lambda: j.c.register("b", 3, 0, 1, "peer"), "INVALID_ARGUMENT"),
        (lambda: j.c.register("../etc", 0, 0, 1, "peer"), "INVALID_ARGUMENT"),
        (lambda: j.c.heartbeat("a", session + 1), "NOT_FOUND"),
        (lambda: j.c.open_stream("a", session), "FAILED_PRECONDITION"),
    ]:
        with pytest.raises(Refused) as err:
            call()
        assert err.value.code == code
    reasons = [e["reason"] for e in read_events(j.events, "refused")]
    assert any("already registered" in r for r in reasons) and any("cluster.gpus_per_node = 1" in r for r in reasons)


def test_a_peer_waiting_on_a_collective_confirms_a_silent_node_at_half_the_timeout(make):
    j = make(
        nodes=3, steps=10, confirmed_silence=load_config(TINY).fault_tolerance.heartbeat_timeout.total_seconds() / 2
    )
    start(j, "a", "b", "c")
    j.train(1, 0)
    timeout = j.c.timeouts.heartbeat_timeout.total_seconds()
    j.advance(timeout * 0.3)
    j.heartbeat_all()  # b's last heartbeat
    j.advance(timeout * 0.3)
    for name in ("a", "c"):
        j.c.heartbeat(name, j.sessions[name])
    j.report(("a", 0), stalled=pb.Stalled(generation=1, what="gradient all-reduce", waited_s=0.4))
    j.advance(timeout * 0.15)  # b silent 0.45 timeouts: not yet
    assert not read_events(j.events, "lost")
    for name in ("a", "c"):
        j.c.heartbeat(name, j.sessions[name])
    j.advance(timeout * 0.1)  # 0.55 timeouts, with a's stall since b's last heartbeat
    [lost] = read_events(j.events, "lost")
    assert (lost["node"], lost["reason"]) == ("b", "heartbeat_late_peers_stalled")
    j.heartbeat_all()
    j.advance(0.3)  # past the settle window
    assert j.c.generation == 2


def test_a_silent_node_is_lost_and_the_survivors_get_a_new_generation_from_their_states(make):
    j = make(nodes=3, steps=10)
    start(j, "a", "b", "c")
    old = {gpu: a.rank for gpu, a in j.assigned.items()}
    j.train(1, 0)
    timeout = j.c.timeouts.heartbeat_timeout.total_seconds()
    j.advance(timeout * 0.75)
    j.c.heartbeat("a", j.sessions["a"])
    j.c.heartbeat("c", j.sessions["c"])
    j.advance(timeout * 0.5)  # b silent for 1.25 timeouts
    [lost] = read_events(j.events, "lost")
    assert (lost["node"], lost["reason"], lost["in_plan"]) == ("b", "heartbeat_timeout", True)
    assert j.c.generation == 2 and j.c.finish_result is None
    boxes = j.drain_all()
    assert boxes["b"] == [END_OF_STREAM]  # a lost (maybe hung) node is told nothing; its stream just ends
    with pytest.raises(Refused):
        j.c.heartbeat("b", j.sessions["b"])  # a lost node stays lost
    new = {gpu: a for gpu, a in j.assigned.items() if a.generation == 2}
    assert set(new) == {("a", 0), ("c", 0)}
    for gpu, a in new.items():
        assert a.previous_generation == 1 and a.world_size == 2 and a.start_step == 1
        assert a.previous_ranks[a.rank] == old[gpu]  # every survivor keeps its states
        assert plan_from_proto(a.previous_plan).world_size == 3
    decided = read_events(j.events, "plan_decided")[-1]
    assert decided["cause"] == "lost" and decided["previous_generation"] == 1 and decided["lost"] == ["b"]
    assert decided["since_detected_s"] >= 0


def test_a_joining_node_waits_for_a_completed_step_then_gets_every_layer(make):
    j = make(nodes=2, steps=10)
    start(j, "a", "b")
    j.join("late")
    assert read_events(j.events, "registered")[-1]["spare"] is True
    j.c.tick()
    assert j.c.generation == 1 and j.drain("late") == []  # generation 1 has not completed a step yet
    j.train(1, 0)
    j.c.tick()
    assert j.c.generation == 2
    j.drain_all()
    new = {gpu: a for gpu, a in j.assigned.items() if a.generation == 2}
    assert set(new) == {("a", 0), ("b", 0), ("late", 0)}
    joiner = new[("late", 0)]
    assert joiner.previous_generation == 1 and joiner.previous_ranks[joiner.rank] == -1
    assert sorted(r for r in joiner.previous_ranks if r >= 0) == [0, 1]
    decided = read_events(j.events, "plan_decided")[-1]
    assert decided["cause"] == "joined" and decided["joined"] == ["late"] and decided["layer_states_moved"] == 10
    # the master logs the copies the workers derive: the joiner receives all ten layers from survivors
    assert sorted(t[0] for t in decided["transfers"]) == list(range(10))
    assert all(
        t[2] == joiner.rank and t[1] != joiner.rank and joiner.previous_ranks[t[1]] >= 0 for t in decided["transfers"]
    )


def test_a_joiner_lost_after_its_generation_was_planned_takes_the_survivors_back_to_their_own_plan(make):
    """The crash of issue 27 (``assert self._abandoned is not None``): ``join@step2,kill:node4@phase:forming``."""
    j = make(nodes=2, steps=10)
    start(j, "a", "b")
    j.train(1, 0)
    j.join("late")
    j.c.tick()
    assert j.c.generation == 2  # the joiner's generation went out...
    j.drain_all()
    j.c.stream_ended("late", j.sessions["late"])  # ...and it died before anyone copied a layer to it
    assert j.advance(0.3) is None  # no crash, no finish
    assert j.c.generation == 3 and j.c.phase == JobPhase.RUNNING
    j.drain_all()
    gen3 = {gpu: a for gpu, a in j.assigned.items() if a.generation == 3}
    assert set(gen3) == {("a", 0), ("b", 0)}
    assert all(a.previous_generation == 1 for a in gen3.values())  # from the states they hold
    decided = read_events(j.events, "plan_decided")[-1]
    assert decided["actions"] == ["re-form"] and decided["cause"] == "lost" and decided["layer_states_moved"] == 0
    assert not read_events(j.events, "reform")  # a loss, not an abandoned iteration: no re-form counted
    j.train(3, 1)
    assert j.c.tick() is None and j.c.generation == 3


def test_a_failure_during_recovery_plans_from_the_generation_the_survivors_still_hold(make):
    # n0 = 2 nodes: 5 nodes run pipelines of 3 + 2 nodes, so losing one moves layer states.
    j = make(nodes=5, steps=10, memory=4e6)
    names = ["n0", "n1", "n2", "n3", "n4"]
    start(j, *names)
    j.train(1, 0)
    gen1 = {gpu: a.rank for gpu, a in j.assigned.items()}
    j.c.stream_ended("n4", j.sessions["n4"])  # its agent died
    j.advance(0.3)  # past the settle window
    j.drain_all()
    assert j.c.generation == 2
    gen2 = {gpu: a for gpu, a in j.assigned.items() if a.generation == 2}
    assert len(gen2) == 4 and read_events(j.events, "plan_decided")[-1]["layer_states_moved"] > 0
    # The copy of generation 2 is interrupted: n0 finished it, the others did not; then n3 dies too.
    j.report(("n0", 0), phase=pb.PhaseDone(generation=2, phase="states_copied", step=1))
    j.c.stream_ended("n3", j.sessions["n3"])
    j.advance(0.3)  # past the settle window
    j.drain_all()
    # 3 nodes < (f+1) * n0 = 4: the survivors of generation 1 (what they all still hold) write a checkpoint.
    assert j.c.phase == JobPhase.CHECKPOINTING
    [request] = read_events(j.events, "checkpoint_requested")
    assert request["generation"] == 1 and sorted(request["writers"]) == ["n0", "n1", "n2"]
    assert request["surviving_ranks"] == sorted(gen1[(n, 0)] for n in ("n0", "n1", "n2"))


def test_below_threshold_the_survivors_checkpoint_and_the_job_exits_3_with_the_resume_command(make, tmp_path):
    j = make(nodes=2, steps=10)
    start(j, "a", "b")
    j.train(1, 0)
    j.train(1, 1)
    rank_a = j.assigned[("a", 0)].rank
    j.c.worker_failure("b", j.sessions["b"], 0, "worker_stopped", "pid 42 is stopped (status stopped)")
    assert j.advance(0.3) is None and j.c.phase == JobPhase.CHECKPOINTING
    [lost] = read_events(j.events, "lost")
    assert (lost["node"], lost["reason"]) == ("b", "worker_stopped") and "pid 42" in lost["detail"]
    [command] = [e for e in j.drain("a") if e is not END_OF_STREAM and e.WhichOneof("event") == "checkpoint"]
    c = command.checkpoint
    assert c.generation == 1 and list(c.surviving_ranks) == [rank_a] and c.dir.startswith(str(tmp_path))
    j.report(("a", 0), checkpoint_done=pb.CheckpointDone(dir=c.dir, step=2, layers=10))
    result = j.c.tick()
    assert result.exit_code == 3
    assert f"--resume {c.dir}" in result.message and "step 2" in result.message
    meta = json.loads((Path(c.dir) / "meta.json").read_text())
    assert meta["step"] == 2 and meta["sampler"]["steps_per_epoch"] == 4096 // 16
    written = read_events(j.events, "checkpoint_written")[0]
    assert (written["step"], written["layers"]) == (2, 10)


def test_a_writer_lost_while_checkpointing_hands_its_layers_to_the_others(make):
    j = make(nodes=4, steps=10, f=2)  # f = 2: 4 one-node pipelines, 3 nodes needed
    start(j, "a", "b", "c", "d")
    j.train(1, 0)
    j.c.stream_ended("c", j.sessions["c"])
    j.c.stream_ended("d", j.sessions["d"])
    j.advance(0.3)  # past the settle window
    assert j.c.phase == JobPhase.CHECKPOINTING
    first = read_events(j.events, "checkpoint_requested")[0]
    assert first["writers"] == ["a", "b"] and len(first["surviving_ranks"]) == 2
    j.drain_all()
    j.c.stream_ended("b", j.sessions["b"])  # b held full copies: a now writes every layer
    j.advance(0.3)  # past the settle window
    again = read_events(j.events, "checkpoint_requested")[-1]
    assert again["writers"] == ["a"] and again["surviving_ranks"] == [j.assigned[("a", 0)].rank]
    [command] = [e.checkpoint for e in j.drain("a") if e is not END_OF_STREAM]
    assert list(command.surviving_ranks) == again["surviving_ranks"]
    j.c.stream_ended("a", j.sessions["a"])  # the last copy is gone
    result = j.advance(0.3)
    assert result.exit_code == 1 and "model state is gone" in result.message


def test_progress_waits_for_every_rank_and_all_done_ends_the_job(make):
    j = make(nodes=2, steps=2)
    start(j, "a", "b")
    ranks = {a.rank: gpu for gpu, a in j.assigned.items()}
    for step in range(2):
        for rank, gpu in sorted(ranks.items()):
            assert not any(f"step {step + 1}/2" in line for line in j.lines)  # not before the last rank
            metrics = pb.StepMetrics(
                generation=1, step=step, rank=rank, loss=3.0 - step, samples_per_s=50.0, step_time_s=0.1 * (rank + 1)
            )
            j.report(gpu, metrics=metrics)
        assert any(f"step {step + 1}/2  loss {3.0 - step:.4f}" in line for line in j.lines)
    steps = read_events(j.events, "step")
    assert [s["step"] for s in steps] == [0, 1] and steps[0]["step_time_s"] == pytest.approx(0.1 * len(ranks))
    for rank, gpu in ranks.items():
        assert j.c.tick() is None
        j.report(gpu, done=pb.WorkerDone(step=1))
    assert j.c.tick().exit_code == 0
    assert read_events(j.events, "done")[0]["steps"] == 2


def test_recovery_phases_become_one_event_each_when_the_last_rank_is_through(make):
    j = make(nodes=3, steps=10)
    start(j, "a", "b", "c")
    j.train(1, 0)
    j.c.stream_ended("c", j.sessions["c"])
    j.advance(0.3)  # past the settle window
    j.drain_all()
    survivors = {gpu: a for gpu, a in j.assigned.items() if a.generation == 2}
    for i, gpu in enumerate(survivors):
        j.report(gpu, phase=pb.PhaseDone(generation=1, phase="aborted", step=1, message="peer closed"))
        j.report(gpu, phase=pb.PhaseDone(generation=2, phase="rendezvous", seconds=0.1 * (i + 1)))
        j.report(gpu, phase=pb.PhaseDone(generation=2, phase="states_copied", bytes=100, seconds=0.2))
    assert len(read_events(j.events, "aborted")) == 2
    [rdv] = read_events(j.events, "rendezvous_done")
    [copied] = read_events(j.events, "states_copied")
    assert rdv["generation"] == 2 and rdv["seconds"] == pytest.approx(0.2) and rdv["cause"] == "lost"
    assert copied["bytes"] == 200
    j.train(2, 1)
    resumed = read_events(j.events, "resumed")[-1]  # generation 1 had its own
    assert resumed["generation"] == 2 and resumed["step"] == 1 and resumed["since_detected_s"] >= 0
    assert any("resumed at step 2" in line for line in j.lines)


def test_a_step_whose_last_reporter_died_is_logged_once_a_later_generation_resumes_past_it(make):
    j = make(nodes=3, steps=10)
    start(j, "a", "b", "c")
    j.train(1, 0)
    # Step 1 committed on every rank (its all-reduces finished), but c died before reporting it.
    for gpu, a in j.assigned.items():
        if gpu[0] != "c":
            j.report(gpu, metrics=pb.StepMetrics(generation=1, step=1, rank=a.rank, loss=2.0, step_time_s=0.1))
    # Step 2 was under way: the survivors never reported it, so it is not logged.
    j.c.stream_ended("c", j.sessions["c"])
    j.advance(0.3)
    j.drain_all()
    assert [e["step"] for e in read_events(j.events, "step")] == [0]  # not yet known to have committed
    j.train(2, 2)  # generation 2 resumes at step 2: step 1 committed
    steps = sorted(read_events(j.events, "step"), key=lambda e: e["step"])  # the late one is written last
    assert [(e["generation"], e["step"]) for e in steps] == [(1, 0), (1, 1), (2, 2)]
    assert steps[1]["partial"] and steps[1]["ranks_reported"] == 2 and "partial" not in steps[2]


def test_restart_mode_restarts_every_worker_from_the_last_checkpoint(make):
    j = make(nodes=3, steps=10, recovery="restart", checkpoint_interval=2)
    start(j, "a", "b", "c")
    first = j.assigned[("a", 0)]
    assert first.checkpoint_interval == 2 and first.checkpoint_dir.endswith("/checkpoints")
    j.train(1, 0)
    j.train(1, 1)
    j.report(("a", 0), checkpoint_done=pb.CheckpointDone(dir="/ckpt/step2", step=2, layers=10))
    j.train(1, 2)
    j.c.stream_ended("c", j.sessions["c"])
    j.advance(0.3)  # past the settle window
    boxes = j.drain_all()
    for name in ("a", "b"):
        kinds = [e.WhichOneof("event") for e in boxes[name]]
        assert kinds == ["restart", "assignment"]  # killed first, then fresh workers get their plan
    new = j.assigned[("a", 0)]
    assert (new.generation, new.previous_generation, new.resume_dir, new.start_step) == (2, 0, "/ckpt/step2", 2)
    assert [e["step"] for e in read_events(j.events, "checkpoint_saved")] == [2]


def test_resume_and_save_final_reach_every_assignment(make, tmp_path):
    options = RunOptions(
        resume_dir="/ckpt/x", resume_step=5, save_final_dir="/out/final", checkpoint_root=str(tmp_path)
    )
    j = make(nodes=2, steps=10, options=options)
    start(j, "a", "b")
    for a in j.assigned.values():
        assert (a.resume_dir, a.start_step, a.save_final_dir) == ("/ckpt/x", 5, "/out/final")


def test_a_resumed_run_says_the_steps_it_trained_and_the_step_the_job_reached(make, tmp_path):
    """Issue 54 item 8: a run resumed at step 5 of 10 said "done: 10 steps"; it trained 5."""
    options = RunOptions(resume_dir="/ckpt/x", resume_step=5, checkpoint_root=str(tmp_path))
    j = make(nodes=2, steps=10, options=options)
    start(j, "a", "b")
    for step in range(5, 10):
        j.train(1, step)
    for gpu in j.assigned:
        j.report(gpu, done=pb.WorkerDone(step=9))
    result = j.c.tick()
    assert result.exit_code == 0
    assert result.message.startswith("done: 5 steps trained in ") and "steps 6-10 (resumed at step 5)" in result.message
    assert "the job reached step 10 of 10" in result.message, result.message


def test_a_node_lost_while_waiting_only_leaves_the_waiting_set(make):
    j = make(nodes=2)
    j.join("a")
    j.join("b")
    j.c.stream_ended("b", j.sessions["b"])  # its agent died before the plan
    assert j.advance(0.3) is None and j.c.phase == JobPhase.WAITING
    assert read_events(j.events, "lost")[0]["reason"] == "stream_closed"
    j.join("b")  # the node comes back under the same name with a new session
    j.c.tick()
    assert j.c.phase == JobPhase.RUNNING and read_events(j.events, "plan_decided")[0]["nodes"] == ["a", "b"]


def test_time_the_master_itself_was_frozen_is_not_the_nodes_silence(make):
    j = make(nodes=3)
    start(j, "a", "b", "c")
    timeout = j.c.timeouts.heartbeat_timeout.total_seconds()
    j.clock.now += 3 * timeout  # the master was descheduled: nobody could be heard
    j.c.tick()
    assert read_events(j.events, "lost") == [] and read_events(j.events, "master_stalled")[0]["seconds"] == 3 * timeout
    for _ in range(int(timeout / 0.1) + 2):  # then it runs normally and only a and c beat
        j.c.heartbeat("a", j.sessions["a"])
        j.c.heartbeat("c", j.sessions["c"])
        j.advance(0.1)
    assert [(e["node"], e["reason"]) for e in read_events(j.events, "lost")] == [("b", "heartbeat_timeout")]


def test_restart_before_any_checkpoint_starts_over_from_the_first_step(make):
    j = make(nodes=3, steps=10, recovery="restart", checkpoint_interval=4)
    start(j, "a", "b", "c")
    j.train(1, 0)
    j.train(1, 1)  # no checkpoint yet
    j.c.stream_ended("c", j.sessions["c"])
    j.advance(0.3)  # past the settle window
    j.drain_all()
    new = j.assigned[("a", 0)]
    assert (new.generation, new.previous_generation, new.resume_dir, new.start_step) == (2, 0, "", 0)


def test_a_step_the_previous_generation_finishes_after_a_join_plan_is_still_logged(make):
    j = make(nodes=2, steps=10)
    start(j, "a", "b")
    j.train(1, 0)
    j.join("late")
    j.c.tick()  # generation 2 is sent; the workers of 1 are in step 1 and apply it at the boundary
    assert j.c.generation == 2
    j.train(1, 1)
    assert [(e["generation"], e["step"]) for e in read_events(j.events, "step")] == [(1, 0), (1, 1)]


def test_losing_every_holder_of_trained_state_is_an_error_not_a_silent_restart(make):
    j = make(nodes=2, steps=10)
    start(j, "a", "b")
    j.train(1, 0)
    j.join("c")
    j.c.tick()
    j.drain_all()
    assert j.c.generation == 2  # c joins; before its copy completes, a and b die
    j.c.stream_ended("a", j.sessions["a"])
    j.c.stream_ended("b", j.sessions["b"])
    result = j.advance(0.3)
    assert result.exit_code == 1 and "is gone" in result.message


def test_nodes_that_fail_together_get_one_plan(make):
    j = make(nodes=4, steps=10)
    start(j, "a", "b", "c", "d")
    j.train(1, 0)
    j.c.stream_ended("b", j.sessions["b"])
    j.advance(0.05)  # b is seen; c follows 50 ms later, inside the settle window
    j.c.stream_ended("c", j.sessions["c"])
    j.advance(0.3)
    decided = read_events(j.events, "plan_decided")
    assert [d["generation"] for d in decided] == [1, 2] and sorted(decided[-1]["lost"]) == ["b", "c"]
    assert read_events(j.events, "plan_discarded") == []


def test_the_control_loop_wakes_when_a_loss_has_settled_not_a_tick_later(make):
    """The master's loop sleeps up to a detector tick (100 ms) between looks; a loss's plan waits
    ``SETTLE_S`` for others of the same failure, then must start at once: a failure's plan is ~10 ms."""
    from oobleck_mm.master.coordinator import SETTLE_S

    j = make(nodes=4, steps=10)
    start(j, "a", "b", "c", "d")
    j.train(1, 0)
    j.c.stream_ended("b", j.sessions["b"])
    j.c.tick()  # b is seen lost: the settle window opens
    settle_left = j.c.state.settle_until - j.clock()
    assert settle_left == pytest.approx(SETTLE_S)
    j.clock.now += settle_left / 2  # the wait begins halfway through the settle window
    began = time.monotonic()
    j.c.wait_for_change(10.0)  # nothing else happens: only the settle deadline can end the wait
    assert time.monotonic() - began < 5.0, "the loop slept past the settle deadline"
    j.clock.now += settle_left / 2
    j.advance(0.3)
    assert [d["generation"] for d in read_events(j.events, "plan_decided")] == [1, 2]


def test_a_client_retrying_a_wrong_token_cannot_fill_the_disk(make):
    """The first refusals of a peer host are logged, then only the 10th, 100th...: bounded log growth."""
    j = make()
    for port in range(1000):  # a retrying client reconnects from a new port each time
        j.c.refused(f"ipv4:10.1.2.3:{40000 + port}", "Register", "wrong token")
    j.c.refused("ipv6:[::1]:5000", "Heartbeat", "missing token")
    logged = read_events(j.events, "refused")
    assert [e["count"] for e in logged if "10.1.2.3" in e["peer"]] == [1, 2, 3, 4, 5, 10, 100, 1000]
    assert [(e["peer"], e["count"]) for e in logged if "::1" in e["peer"]] == [("ipv6:[::1]:5000", 1)]


def test_a_full_disk_under_the_event_log_neither_stops_nor_hangs_the_master(tmp_path, caplog):
    """/dev/full answers every write with ENOSPC: the events are dropped (and said so), the job goes on."""
    job = apply_overrides(load_config(TINY), nodes=2, steps=3)
    full = EventLog("/dev/full")
    c = Coordinator(
        job,
        num_nodes=2,
        steps=3,
        store_host="h",
        store_port=1,
        events=full,
        clock=Clock(),
        progress=lambda line: None,
        options=RunOptions(checkpoint_root=str(tmp_path)),
    )
    for name in ("a", "b"):
        session, _, _ = c.register(name, 1, 0, 1, "peer")
        c.open_stream(name, session)
    c.tick()
    assert c.phase == JobPhase.RUNNING and full.dropped > 0
    assert "cannot write (No space left on device)" in caplog.text and "/dev/full" in caplog.text
    c.finish(1, "stopped")
    assert c.tick() == c.finish_result and c.finish_result.exit_code == 1
    full.close()


def test_a_checkpoint_that_cannot_resume_this_job_is_refused_before_any_worker_starts(tmp_path):
    """``--resume`` checks: every layer file present and of its recorded size, and the same model shape."""
    import dataclasses as dc
    import os
    import zipfile

    from oobleck_mm.master.checkpointing import resume_step
    from oobleck_mm.errors import UserError
    from oobleck_mm.model.layers import model_layer_specs
    from oobleck_mm.runtime.checkpoint_meta import save_meta

    job = load_config(TINY)
    specs = model_layer_specs(job)
    (tmp_path / "layers").mkdir()
    for spec in specs:  # zip archives like torch.save's (the check reads no tensor)
        with zipfile.ZipFile(tmp_path / "layers" / f"{spec.name}.pt", "w") as archive:
            archive.writestr("data.pkl", spec.name * 50)
    save_meta(tmp_path, job, 4, specs)
    assert resume_step(str(tmp_path), job) == 4
    llm = dc.replace(job.model.llm, ffn_hidden=2 * job.model.llm.ffn_hidden)
    with pytest.raises(UserError, match=r"another model shape: model.llm.ffn_hidden: \d+ in the checkpoint, \d+ in"):
        resume_step(str(tmp_path), dc.replace(job, model=dc.replace(job.model, llm=llm)))
    os.truncate(tmp_path / "layers" / "llm.head.pt", 5)
    with pytest.raises(UserError, match=r"llm.head.pt: 5 bytes, the checkpoint recorded \d+ \(truncated or replaced\)"):
        resume_step(str(tmp_path), job)
    meta = json.loads((tmp_path / "meta.json").read_text())
    del meta["layer_bytes"]  # a checkpoint of an older version: presence and readability still checked
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(UserError, match="llm.head.pt: not a readable layer shard"):
        resume_step(str(tmp_path), job)
    os.remove(tmp_path / "layers" / "llm.head.pt")
    with pytest.raises(UserError, match="--resume: .* has no layer file layers/llm.head.pt"):
        resume_step(str(tmp_path), job)


def test_a_job_that_stops_making_progress_is_ended_with_where_it_stopped(make):
    j = make(nodes=2, steps=10, stall_s=20.0)
    start(j, "a", "b")

    # Heartbeats keep coming: the nodes are alive, the job is not moving.
    j.train(1, 0)
    assert _alive_for(j, 19.5, tick=0.5) is None
    j.train(1, 1)  # a step: the clock of progress starts again
    assert _alive_for(j, 19.5, tick=0.5) is None
    result = _alive_for(j, 1.0, tick=0.5)
    assert result is not None and result.exit_code == 1
    assert "no progress for" in result.message and "stall_timeout 20 s" in result.message
    assert "next step 2" in result.message


def test_each_incident_is_timed_from_itself_not_from_the_first_loss(make):
    j = make(nodes=3, steps=50)
    start(j, "a", "b", "c")
    j.train(1, 0)
    j.c.stream_ended("c", j.sessions["c"])  # c's agent died
    j.advance(0.3)
    j.drain_all()
    assert j.c.generation == 2
    j.train(2, 1)
    j.clock.now += 100.0  # much later, a node joins
    j.heartbeat_all()
    j.join("d")
    j.c.tick()
    assert j.c.generation == 3
    lost_plan, join_plan = read_events(j.events, "plan_decided")[1:]
    assert lost_plan["cause"] == "lost" and lost_plan["since_detected_s"] < 1.0
    assert join_plan["cause"] == "joined" and join_plan["since_detected_s"] < 1.0, join_plan


def test_agents_beyond_max_nodes_are_refused_naming_the_limit(make):
    j = make(nodes=2, max_nodes=3)
    start(j, "a", "b")
    j.join("c")  # a join up to the maximum is welcome
    with pytest.raises(Refused) as err:
        j.c.register("d", 0, 0, 1, "peer")
    assert err.value.code == "RESOURCE_EXHAUSTED" and "already runs on 3 nodes, its maximum" in str(err.value)
    assert any("cluster.max_nodes" in e["reason"] for e in read_events(j.events, "refused"))


def test_live_mode_completes_periodic_checkpoints_and_stops_at_the_newest_when_every_copy_is_lost(make, tmp_path):
    # n0 = 2: 5 nodes run a 3-stage and a 2-stage pipeline; losing both first stages takes every copy
    # of the first layers.
    j = make(nodes=5, steps=10, memory=4e6, checkpoint_interval=2)
    start(j, "n0", "n1", "n2", "n3", "n4")
    assert all(a.checkpoint_async and a.checkpoint_interval == 2 for a in j.assigned.values())
    layout = read_events(j.events, "plan_decided")[0]["layout"]
    assert sorted(len(p["stages"]) for p in layout["pipelines"]) == [2, 3]
    j.train(1, 0)
    j.train(1, 1)
    directory = str(tmp_path / "checkpoints" / "step00000002")
    shares = sorted(j.assigned.items(), key=lambda kv: kv[1].rank)
    for gpu, a in shares[:-1]:  # every rank but one wrote its share: not a checkpoint yet
        j.report(gpu, checkpoint_done=pb.CheckpointDone(dir=directory, step=2, layers=1, generation=1))
    assert not read_events(j.events, "checkpoint_saved") and not (Path(directory) / "meta.json").exists()
    j.report(shares[-1][0], checkpoint_done=pb.CheckpointDone(dir=directory, step=2, layers=1, generation=1))
    [saved] = read_events(j.events, "checkpoint_saved")
    assert (saved["dir"], saved["step"]) == (directory, 2)
    assert json.loads((Path(directory) / "meta.json").read_text())["step"] == 2  # the master completed it
    j.train(1, 2)
    first_stages = {stage[0] for p in layout["pipelines"] for stage in p["stages"][:1]}
    for gpu, a in j.assigned.items():
        if a.rank in first_stages:
            j.c.stream_ended(gpu[0], j.sessions[gpu[0]])
    result = j.advance(0.3)
    assert result.exit_code == 3, result.message  # not 1: a checkpoint exists
    assert f"--resume {directory}" in result.message and "step 2" in result.message


def test_the_first_meta_json_uses_the_data_order_built_when_the_master_started(make, tmp_path, monkeypatch):
    """Building the data order ``meta.json`` records (its imports and the whole dataset) took 4.7-5.2 s, and the
    master did it under its lock at the first checkpoint: it answered nothing meanwhile ("the master did not run
    for 5.19s", on an H200). ``prepare_meta`` (the server calls it at start) builds it in the background."""
    import oobleck_mm.master.checkpointing as checkpointing

    j = make(nodes=2, steps=10, checkpoint_interval=2)
    j.c.prepare_meta()
    built = j.c._sampler_ready.result(timeout=120)
    monkeypatch.setattr(checkpointing, "meta_sampler", lambda job: pytest.fail("meta.json built the data order"))
    start(j, "n0", "n1")
    j.train(1, 0)
    j.train(1, 1)
    directory = str(tmp_path / "checkpoints" / "step00000002")
    for gpu in sorted(j.assigned):
        j.report(gpu, checkpoint_done=pb.CheckpointDone(dir=directory, step=2, layers=1, generation=1))
    assert json.loads((Path(directory) / "meta.json").read_text())["step"] == 2
    assert j.c._sampler is built


def test_a_periodic_checkpoint_cut_short_by_a_loss_is_taken_again_after_the_next_generations_first_step(make, tmp_path):
    """Issue 27 9(iii): a writer lost before its share was on disk leaves the checkpoint of step 2
    without meta.json; the next generation checkpoints after its first step (3), not at step 4."""
    j = make(nodes=4, steps=10, checkpoint_interval=2)
    start(j, "n0", "n1", "n2", "n3")
    j.train(1, 0)
    j.train(1, 1)
    directory = str(tmp_path / "checkpoints" / "step00000002")
    shares = sorted(j.assigned.items(), key=lambda kv: kv[1].rank)
    lost = shares[-1][0][0]
    for gpu, a in shares[:-1]:  # the lost node's writer never reported
        j.report(gpu, checkpoint_done=pb.CheckpointDone(dir=directory, step=2, layers=1, generation=1))
    j.c.stream_ended(lost, j.sessions[lost])
    j.advance(0.3)
    j.drain_all()
    second = {gpu: a for gpu, a in j.assigned.items() if a.generation == 2}
    assert second and all(a.checkpoint_after_first_step and a.start_step == 2 for a in second.values())
    [cut] = read_events(j.events, "checkpoint_cut_short")
    assert cut["step"] == 2 and cut["lost"] == [lost]
    assert any("checkpoint of step 2 lost a writer" in line for line in j.lines)
    j.train(2, 2)
    again = str(tmp_path / "checkpoints" / "step00000003")
    for gpu, a in second.items():
        j.report(gpu, checkpoint_done=pb.CheckpointDone(dir=again, step=3, layers=1, generation=2))
    [saved] = read_events(j.events, "checkpoint_saved")
    assert (saved["dir"], saved["step"]) == (again, 3)
    # A loss after the newest checkpoint completed cuts nothing short (step 4's is not taken yet).
    victim = next(gpu for gpu in second)[0]
    j.c.stream_ended(victim, j.sessions[victim])
    j.advance(0.3)
    j.drain_all()
    third = [a for a in j.assigned.values() if a.generation == 3]
    assert third and not any(a.checkpoint_after_first_step for a in third)
    assert len(read_events(j.events, "checkpoint_cut_short")) == 1


def _abandon(j: Job, generation: int, step: int, message: str = "Connection closed by peer [127.0.0.1]:1234") -> None:
    for gpu, a in j.assigned.items():
        if a.generation == generation:
            j.report(
                gpu,
                phase=pb.PhaseDone(
                    generation=generation,
                    phase="aborted",
                    step=step,
                    message=message,
                ),
            )


def test_an_iteration_abandoned_with_every_node_alive_reforms_the_same_nodes_after_reform_after(make):
    """Every worker gave up step 2 (a peer starved past the collective timeout) and no node is lost:
    without a re-form they would wait for a plan that never comes."""
    j = make(nodes=3, steps=10)
    start(j, "a", "b", "c")
    old = {gpu: a.rank for gpu, a in j.assigned.items()}
    j.train(1, 0)
    j.train(1, 1)
    _abandon(j, 1, 2)
    grace = j.c.timeouts.reform_after.total_seconds()
    assert _alive_for(j, grace - 0.2) is None and j.c.generation == 1  # a lost peer would be seen by now
    assert _alive_for(j, 0.4) is None and j.c.generation == 2
    j.drain_all()
    new = {gpu: a for gpu, a in j.assigned.items() if a.generation == 2}
    assert set(new) == set(old)
    for gpu, a in new.items():  # the same plan, every worker keeps its states, nothing moves
        assert a.previous_generation == 1 and a.start_step == 2 and a.rank == old[gpu]
        assert list(a.previous_ranks) == list(range(3))
    [decided] = read_events(j.events, "plan_decided")[1:]
    assert decided["cause"] == "abandoned" and decided["lost"] == [] and decided["joined"] == []
    assert decided["actions"] == ["re-form"] and decided["layer_states_moved"] == 0
    [reform] = read_events(j.events, "reform")
    assert reform["step"] == 2 and "Connection closed" in reform["message"]
    assert any("re-form" in line for line in j.lines)
    j.train(2, 2)  # the re-formed generation trains on
    assert j.c.finish_result is None


def test_a_loss_behind_the_abandoned_iteration_is_a_recovery_not_a_reform(make):
    j = make(nodes=3, steps=10)
    start(j, "a", "b", "c")
    j.train(1, 0)
    _abandon(j, 1, 1)
    j.c.stream_ended("b", j.sessions["b"])  # the peer the workers gave up on is dead
    _alive_for(j, j.c.timeouts.reform_after.total_seconds() + 0.5)
    decided = read_events(j.events, "plan_decided")
    assert [d["generation"] for d in decided] == [1, 2] and decided[1]["lost"] == ["b"]
    assert not read_events(j.events, "reform")


def test_an_iteration_abandoned_again_and_again_ends_the_job_naming_the_step(make):
    from oobleck_mm.master.coordinator import MAX_REFORMS

    j = make(nodes=2, steps=10)
    start(j, "a", "b")
    j.train(1, 0)
    grace = j.c.timeouts.reform_after.total_seconds()
    for generation in range(1, MAX_REFORMS + 2):
        _abandon(j, generation, 1)
        result = _alive_for(j, grace + 0.2)
        j.drain_all()
    assert j.c.generation == MAX_REFORMS + 1
    assert result is not None and result.exit_code == 1
    assert f"step 1 was abandoned in {MAX_REFORMS + 1} generations in a row" in result.message
    assert "Connection closed by peer" in result.message
    assert "heartbeat_timeout" not in result.message  # not a timeout: no advice about it


def test_steps_abandoned_on_timeouts_with_every_node_alive_name_the_bound_and_the_field_to_raise(make):
    """A live peer slower than collective_timeout between two transfers (long samples on four lanes of an
    overloaded host did it: scripts/check_context_parallel.py) is no failure the master can plan around."""
    from oobleck_mm.master.coordinator import MAX_REFORMS

    j = make(nodes=2, steps=10)
    start(j, "a", "b")
    j.train(1, 0)
    grace = j.c.timeouts.reform_after.total_seconds()
    for generation in range(1, MAX_REFORMS + 2):
        _abandon(j, generation, 1, "receive from rank 1: Timed out waiting 8000ms for recv operation to complete")
        result = _alive_for(j, grace + 0.2)
        j.drain_all()
    assert result is not None and result.exit_code == 1
    bound = j.c.timeouts.collective_timeout.total_seconds()
    assert f"ran past collective_timeout ({bound:g} s" in result.message
    assert "needs a larger fault_tolerance.heartbeat_timeout" in result.message


def test_a_completed_step_resets_the_reform_count(make):
    from oobleck_mm.master.coordinator import MAX_REFORMS

    j = make(nodes=2, steps=20)
    start(j, "a", "b")
    j.train(1, 0)
    grace = j.c.timeouts.reform_after.total_seconds()
    for generation in range(1, MAX_REFORMS + 3):  # each re-formed generation completes one step
        _abandon(j, generation, generation)
        assert _alive_for(j, grace + 0.2) is None
        j.drain_all()
        j.train(generation + 1, generation)
    assert j.c.generation == MAX_REFORMS + 3 and j.c.finish_result is None


def test_restart_mode_restarts_the_workers_of_an_abandoned_iteration(make):
    j = make(nodes=3, steps=10, recovery="restart", checkpoint_interval=2)
    start(j, "a", "b", "c")
    j.train(1, 0)
    j.train(1, 1)
    j.report(("a", 0), checkpoint_done=pb.CheckpointDone(dir="/ckpt/step2", step=2, layers=10))
    _abandon(j, 1, 2)
    _alive_for(j, j.c.timeouts.reform_after.total_seconds() + 0.2)
    boxes = j.drain_all()
    for name in ("a", "b", "c"):
        assert [e.WhichOneof("event") for e in boxes[name]] == ["restart", "assignment"]
    new = j.assigned[("a", 0)]
    assert (new.generation, new.previous_generation, new.resume_dir, new.start_step) == (2, 0, "/ckpt/step2", 2)


def test_a_node_on_notice_is_planned_out_at_a_boundary_and_dismissed_never_lost(make):
    j = make(nodes=5, steps=10, memory=4e6)  # pipelines of 3 + 2 nodes: leaving moves layer states
    names = ["n0", "n1", "n2", "n3", "n4"]
    start(j, *names)
    j.train(1, 0)
    j.c.leave("n1", j.sessions["n1"], "preemption notice")
    assert j.c.generation == 1  # the settle window: a zone's other notices may follow
    _alive_for(j, 0.3)
    boxes = j.drain_all()
    assert j.c.generation == 2
    new = {gpu: a for gpu, a in j.assigned.items() if a.generation == 2}
    assert ("n1", 0) not in new and len(new) == 4
    assert all(a.at_boundary and a.previous_generation == 1 for a in new.values())  # finish the iteration first
    [shutdown] = [e for e in boxes["n1"] if e is not END_OF_STREAM]
    assert shutdown.shutdown.at_boundary and "planned out" in shutdown.shutdown.reason
    assert END_OF_STREAM not in boxes["n1"]  # its workers' last reports still count
    decided = read_events(j.events, "plan_decided")[-1]
    assert decided["cause"] == "left" and decided["layer_states_moved"] > 0
    j.report(("n1", 0), metrics=pb.StepMetrics(generation=1, step=1, rank=1, loss=1.0))  # still accepted
    _alive_for(j, 2 * j.c.timeouts.heartbeat_timeout.total_seconds())  # and then silent: no loss
    j.c.stream_ended("n1", j.sessions["n1"])  # its agent hangs up
    _alive_for(j, 0.3)
    assert "n1" not in j.c.registry.nodes and not read_events(j.events, "lost") and j.c.generation == 2
    [left] = read_events(j.events, "left")
    assert left["node"] == "n1"


def test_a_plan_whose_base_a_survivor_dropped_is_re_formed_at_once_from_what_the_workers_hold(make):
    """Generation 3 is planned for a notice from generation 1 while the join's generation 2 is on its way (no
    report of it yet); then the workers report a step of 2: they dropped 1, so 3 cannot start. The master
    re-forms at once from 2, the joiner a survivor of it, instead of waiting out ``reform_after``."""
    j = make(nodes=3, steps=20)
    start(j, "a", "b", "c")
    j.train(1, 0)
    j.join("d")
    _alive_for(j, 0.1)
    assert j.c.generation == 2  # the join
    j.drain_all()
    join = dict(j.assigned)
    j.c.leave("a", j.sessions["a"], "preemption notice")
    _alive_for(j, 0.1)
    assert j.c.generation == 3 and read_events(j.events, "plan_decided")[-1]["previous_generation"] == 1
    j.drain_all()
    for gpu, a in join.items():  # the workers had switched to 2 meanwhile: a step of it
        j.report(
            gpu,
            metrics=pb.StepMetrics(generation=2, step=1, rank=a.rank, loss=1.0, samples_per_s=10.0, step_time_s=0.1),
        )
        j.report(gpu, phase=pb.PhaseDone(generation=2, phase="resumed", step=1))
    j.c.tick()
    # Its switch is logged although generation 3 was planned after it (the recovery table's row of the join).
    [resumed] = read_events(j.events, "resumed")[-1:]
    assert (resumed["generation"], resumed["cause"], resumed["step"]) == (2, "joined", 1), resumed
    j.drain_all()
    [dropped] = read_events(j.events, "base_dropped")[:1]
    assert (dropped["generation"], dropped["base"], dropped["holds"]) == (3, 1, [2])
    assert j.c.generation == 4  # no clock moved: not after reform_after
    decided = read_events(j.events, "plan_decided")[-1]
    assert decided["previous_generation"] == 2 and sorted(decided["nodes"]) == ["b", "c", "d"], decided
    assert decided["joined"] == [] and decided["lost"] == ["a"]


def test_a_node_on_notice_planned_out_with_a_loss_stops_at_once_with_the_iteration_abandoned(make):
    # The survivors abandon the iteration in flight (a peer is lost): the leaving node has nothing to
    # finish, and its open sockets would hold the survivors' collectives pending with it (a join
    # switch's start-step agreement) until its kill at the notice's end.
    j = make(nodes=7, steps=10, memory=4e6)  # 5 nodes stay: (f + 1) * n0 = 4 keep training
    names = [f"n{i}" for i in range(7)]
    start(j, *names)
    j.train(1, 0)
    j.c.leave("n1", j.sessions["n1"], "preemption notice")
    j.c.stream_ended("n3", j.sessions["n3"])  # in the same settle window: lost
    _alive_for(j, 0.3)
    boxes = j.drain_all()
    assert j.c.generation == 2
    new = {gpu: a for gpu, a in j.assigned.items() if a.generation == 2}
    assert ("n1", 0) not in new and ("n3", 0) not in new and len(new) == 5
    assert not any(a.at_boundary for a in new.values())  # the survivors abandon the iteration in flight
    [shutdown] = [e for e in boxes["n1"] if e is not END_OF_STREAM]
    assert not shutdown.shutdown.at_boundary and "planned out" in shutdown.shutdown.reason  # so does n1, now
    assert read_events(j.events, "left")[0]["node"] == "n1"


def test_a_notice_to_a_node_outside_the_plan_dismisses_it_at_once(make):
    j = make(nodes=2, steps=10)
    start(j, "a", "b")
    j.join("spare")
    j.c.leave("spare", j.sessions["spare"], "preemption notice")
    [shutdown] = j.drain("spare")
    assert shutdown.shutdown.at_boundary and read_events(j.events, "left")[0]["why"] == "left before it was planned in"


def test_nodes_on_notice_with_the_last_copies_write_them_before_leaving(make):
    j = make(nodes=5, steps=10, memory=4e6)
    names = ["n0", "n1", "n2", "n3", "n4"]
    start(j, *names)
    j.train(1, 0)
    for name in names[1:]:  # a zone reclaimed: n0 alone cannot hold every layer
        j.c.leave(name, j.sessions[name], "preemption notice")
    _alive_for(j, 0.3)
    j.drain_all()
    assert j.c.phase == JobPhase.CHECKPOINTING
    [request] = read_events(j.events, "checkpoint_requested")
    assert request["generation"] == 1 and sorted(request["writers"]) == names  # the leaving ones too
    assert any("leave on notice holding the last copies" in line for line in j.lines)


def test_a_joining_node_is_admitted_only_once_its_workers_are_ready(make):
    j = make(nodes=2, steps=10, gpus=2)
    start(j, "a", "b")
    j.train(1, 0)
    j.join("late", ready=False)
    j.advance(1.0)
    j.heartbeat_all()
    assert j.c.generation == 1 and j.drain("late") == []  # its workers still import: the job trains on
    j.report(("late", 0), ready=pb.WorkerReady(startup_s=2.5))
    j.c.tick()
    assert j.c.generation == 1  # one of its two workers is not ready yet
    j.report(("late", 1), ready=pb.WorkerReady(startup_s=2.7))
    j.c.tick()
    assert j.c.generation == 2 and "late" in read_events(j.events, "plan_decided")[-1]["joined"]
    [ready] = read_events(j.events, "node_ready")[-1:]
    assert ready["node"] == "late" and ready["joining"] and ready["startup_s"] == 2.7
    assert any("node late ready" in line for line in j.lines)


def test_a_requested_stop_writes_the_current_step_and_exits_3_with_the_resume_command(make, tmp_path):
    j = make(nodes=2, steps=10)
    start(j, "a", "b")
    j.train(1, 0)
    j.train(1, 1)
    assert j.c._sampler_ready is None  # no periodic checkpoint by steps: nothing built at start
    j.c.request_stop("SIGTERM")
    assert j.c.phase == JobPhase.CHECKPOINTING
    # meta.json's data order starts building with the round, while the workers write: built when the round's
    # WriteMeta came, it outlasted the shutdown grace under load and the checkpoint was left without meta.json.
    assert j.c._sampler_ready is not None
    [request] = read_events(j.events, "checkpoint_requested")
    assert sorted(request["writers"]) == ["a", "b"]  # every node writes what it owns: one replica each
    boxes = j.drain_all()
    for name in ("a", "b"):
        [command] = [e for e in boxes[name] if e is not END_OF_STREAM and e.WhichOneof("event") == "checkpoint"]
        j.report((name, 0), checkpoint_done=pb.CheckpointDone(dir=command.checkpoint.dir, step=2, layers=5))
    result = j.c.tick()
    assert result.exit_code == 3 and result.message.startswith("stopped on request (SIGTERM).")
    assert "Checkpoint of step 2" in result.message and f"--resume {command.checkpoint.dir}" in result.message
    assert json.loads((Path(command.checkpoint.dir) / "meta.json").read_text())["step"] == 2


def test_a_stop_whose_iteration_in_flight_completes_names_its_checkpoint_by_the_step_written(make, tmp_path):
    """Issue 54 item 4: after SIGTERM the console said "checkpointing step 14's state" and then "Checkpoint of step
    15 written to ...step00000014": the workers completed the iteration in flight before they wrote. The folder is
    now renamed to the step its meta.json records, and the messages name that one."""
    j = make(nodes=2, steps=10)
    start(j, "a", "b")
    j.train(1, 0)
    j.train(1, 1)
    j.c.request_stop("SIGTERM")
    boxes = j.drain_all()
    for name in ("a", "b"):  # step 2 (0-based) completed in flight: the state written is the one after 3 steps
        [command] = [e for e in boxes[name] if e is not END_OF_STREAM and e.WhichOneof("event") == "checkpoint"]
        j.report((name, 0), checkpoint_done=pb.CheckpointDone(dir=command.checkpoint.dir, step=3, layers=5))
    assert command.checkpoint.dir.endswith("step00000002")
    result = j.c.tick()
    renamed = command.checkpoint.dir.replace("step00000002", "step00000003")
    assert result.exit_code == 3 and "Checkpoint of step 3 written to " + renamed in result.message, result.message
    assert f"--resume {renamed}" in result.message
    j.c.flush_disk(timeout=10)
    assert json.loads((Path(renamed) / "meta.json").read_text())["step"] == 3
    assert not Path(command.checkpoint.dir).exists()
    assert read_events(j.events, "checkpoint_written")[0]["dir"] == renamed


def test_a_stop_during_a_switch_in_flight_asks_the_round_again_of_the_generation_the_writers_moved_to(make):
    """Seen end to end (a straggler re-split's switch sent, then SIGTERM): the round asked the generation
    everyone held, the workers had switched at the step's boundary before they read it and answered -1, and
    the job exited 1 ("the checkpoint ... is inconsistent") instead of 3 with the checkpoint. Either order of
    their -1 answers and their reports of the new generation ends with the checkpoint of the new one."""
    for reports_first in (False, True):
        j = make(nodes=2, steps=10)
        start(j, "a", "b")
        j.train(1, 0)
        j.join("late")
        j.c.tick()
        assert j.c.generation == 2  # the join's switch is sent: the workers switch at their next boundary
        j.drain_all()
        j.c.request_stop("SIGTERM")
        [first] = read_events(j.events, "checkpoint_requested")
        assert first["generation"] == 1 and sorted(first["writers"]) == ["a", "b"]

        def left_behind() -> None:
            for name in ("a", "b"):
                j.report((name, 0), checkpoint_done=pb.CheckpointDone(dir=first["dir"], step=-1, layers=0))

        def switched() -> None:
            for gpu in (("a", 0), ("b", 0), ("late", 0)):
                j.report(gpu, phase=pb.PhaseDone(generation=2, phase="states_copied", step=1))
                j.report(gpu, phase=pb.PhaseDone(generation=2, phase="resumed", step=1))

        for happen in (switched, left_behind) if reports_first else (left_behind, switched):
            happen()
            assert j.c.tick() is None or j.c.phase == JobPhase.CHECKPOINTING  # not failed in between
        [again] = read_events(j.events, "checkpoint_round_again")
        assert (again["generation"], again["previous_generation"]) == (2, 1)
        second = read_events(j.events, "checkpoint_requested")[-1]
        assert second["generation"] == 2 and sorted(second["writers"]) == ["a", "b", "late"]
        for name in ("a", "b", "late"):
            j.report((name, 0), checkpoint_done=pb.CheckpointDone(dir=second["dir"], step=2, layers=4))
        result = j.c.tick()
        assert result.exit_code == 3 and "Checkpoint of step 2" in result.message, result.message


def test_a_round_answered_minus_one_with_no_switch_in_flight_still_fails(make):
    j = make(nodes=2, steps=10)
    start(j, "a", "b")
    j.train(1, 0)
    j.c.request_stop("SIGTERM")
    [request] = read_events(j.events, "checkpoint_requested")
    for name in ("a", "b"):
        j.report((name, 0), checkpoint_done=pb.CheckpointDone(dir=request["dir"], step=-1, layers=0))
    result = j.c.tick()
    assert result.exit_code == 1 and "inconsistent" in result.message


def test_a_stop_requested_before_any_step_ends_the_job_at_once(make):
    j = make(nodes=2, steps=10)
    start(j, "a", "b")
    j.c.request_stop("SIGTERM")
    result = j.c.tick()
    assert result.exit_code == 1 and "before any step: nothing to save" in result.message


def test_a_checkpoint_the_disk_refused_is_reported_once_and_training_goes_on(make):
    j = make(nodes=2, steps=10)
    start(j, "a", "b")
    j.train(1, 0)
    for name in ("a", "b"):
        j.report(
            (name, 0),
            checkpoint_done=pb.CheckpointDone(
                dir="/ckpt/step00000002", step=2, generation=1, error="No space left on device: /ckpt/step00000002/a.pt"
            ),
        )
    failed = read_events(j.events, "checkpoint_failed")
    assert [e["node"] for e in failed] == ["a", "b"] and "No space left" in failed[0]["error"]
    said = [line for line in j.lines if "could not be written" in line]
    assert len(said) == 1 and "No space left on device" in said[0] and "training goes on" in said[0]
    assert not read_events(j.events, "lost") and not read_events(j.events, "checkpoint_saved")
    assert j.c.tick() is None and j.c.phase == JobPhase.RUNNING


def test_a_below_threshold_checkpoint_the_disk_refused_ends_the_job_naming_the_disk(make):
    j = make(nodes=2, steps=10)
    start(j, "a", "b")
    j.train(1, 0)
    j.c.stream_ended("b", j.sessions["b"])
    j.advance(0.3)
    assert j.c.phase == JobPhase.CHECKPOINTING
    [command] = [e for e in j.drain("a") if e is not END_OF_STREAM and e.WhichOneof("event") == "checkpoint"]
    j.report(
        ("a", 0),
        checkpoint_done=pb.CheckpointDone(
            dir=command.checkpoint.dir, step=1, error=f"No space left on device: {command.checkpoint.dir}"
        ),
    )
    result = j.c.tick()
    assert result.exit_code == 1 and "could not be written on a/gpu0: No space left on device" in result.message


def test_resume_finds_a_shard_corrupted_in_place_by_its_writers_sha256(tmp_path, monkeypatch):
    """Same size, a valid zip archive, one flipped byte in a tensor: only the digest its writer recorded
    (hashed as it wrote, layers/<name>.sha256, gathered into meta.json) tells."""
    import torch

    from oobleck_mm.master.checkpointing import resume_step
    from oobleck_mm.errors import UserError
    from oobleck_mm.model.layers import model_layer_specs
    from oobleck_mm.runtime import checkpoint_meta
    from oobleck_mm.runtime.checkpoint import write_layer_file
    from oobleck_mm.runtime.checkpoint_meta import save_meta

    job = load_config(TINY)
    specs = model_layer_specs(job)
    for spec in specs:
        digest = write_layer_file(
            tmp_path, spec.name, {"params": {"w": torch.arange(4096, dtype=torch.float32)}, "optimizer": None}
        )
        assert (tmp_path / "layers" / f"{spec.name}.sha256").read_text().strip() == digest
    save_meta(tmp_path, job, 4, specs)
    meta = json.loads((tmp_path / "meta.json").read_text())
    assert set(meta["layer_sha256"]) == {s.name for s in specs}
    lines = []
    monkeypatch.setattr(checkpoint_meta, "PROGRESS_EVERY_S", 0.0)  # a large checkpoint: progress while it is read
    assert resume_step(str(tmp_path), job, lines.append) == 4
    assert len(lines) == len(specs) and f"checked {len(specs)}/{len(specs)} shards" in lines[-1], lines
    shard = tmp_path / "layers" / "llm.head.pt"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(UserError, match=r"llm.head.pt: its sha256 is not the one the checkpoint recorded"):
        resume_step(str(tmp_path), job)


# ---------------------------------------------------------------------- a restarted master


def _lost_master(make, nodes: int, steps: int, trained: int = 1):
    """A job whose master journaled generation 1 and saw ``trained`` steps, then died: (journal, ranks)."""
    first = make(nodes=nodes, steps=steps)
    journals = []
    first.c.journal_to = journals.append
    start(first, *"abc"[:nodes])
    for step in range(trained):
        first.train(1, step)
    return journals[-1], {gpu: a.rank for gpu, a in first.assigned.items()}


def _come_back(j: Job, name: str, generation: int, step: int, rank: int) -> None:
    """An agent registering again with a restarted master: its worker's latest reports, then its stream."""
    j.sessions[name], _, _ = j.c.register(name, 0, 1 << 30, 123, "ipv4:127.0.0.1:1", adopt_generation=generation)
    metrics = pb.StepMetrics(generation=generation, step=step, rank=rank, loss=1.0, samples_per_s=10.0, step_time_s=0.1)
    j.c.worker_report(name, j.sessions[name], 0, pb.WorkerReport(metrics=metrics), replayed=True)
    j.boxes[name] = j.c.open_stream(name, j.sessions[name])


def test_a_restarted_master_re_adopts_the_journaled_generation_without_sending_anything(make, tmp_path):
    from oobleck_mm.master.journal import read_journal, write_journal

    first = make(nodes=2, steps=10)
    journals = []
    first.c.journal_to = journals.append
    start(first, "a", "b")
    assert [jn.generation for jn in journals] == [1]  # written before the assignments went out
    for step in range(6):
        first.train(1, step)
    ranks = {gpu: a.rank for gpu, a in first.assigned.items()}
    write_journal(str(tmp_path), dataclasses.replace(journals[-1], host="127.0.0.1", port=4321))
    journal = read_journal(str(tmp_path))
    assert (journal.generation, journal.port, journal.current.ranks) == (1, 4321, ranks)
    assert journal.current.layout == first.c.plan and journal.plan == journals[-1].plan

    j = make(nodes=2, steps=10)  # the restarted master, appending to the lost one's event log
    j.events.write_text(first.events.read_text())
    from oobleck_mm.master import planning

    planning._TEMPLATES.clear()  # a new master's helper holds no templates
    j.c.adopt(journal)
    assert j.c.phase == JobPhase.ADOPTING
    # ...and builds them while the agents come back, for the first failure after the restart
    assert (j.c.config_yaml, journal.template_nodes) in planning._TEMPLATES
    _come_back(j, "a", 1, 5, ranks[("a", 0)])
    j.advance(0.2)
    assert j.c.phase == JobPhase.ADOPTING  # b is not back yet
    _come_back(j, "b", 1, 5, ranks[("b", 0)])
    j.c.tick()
    assert j.c.phase == JobPhase.RUNNING and j.c.generation == 1 and j.c.next_step == 6
    assert all(not box for box in j.drain_all().values())  # nothing to send: they train on
    [adopted] = read_events(j.events, "adopted")
    assert adopted["nodes"] == ["a", "b"] and adopted["missing"] == [] and adopted["next_step"] == 6
    # The replayed step 5 was logged by the lost master: not twice.
    assert [e["step"] for e in read_events(j.events, "step")] == [0, 1, 2, 3, 4, 5]
    j.assigned = dict(first.assigned)
    for step in range(6, 10):  # reports as usual from here
        _alive_for(j, 0.1)
        j.train(1, step)
    for gpu in j.assigned:
        j.report(gpu, done=pb.WorkerDone(step=9))
    assert [e["step"] for e in read_events(j.events, "step")] == list(range(10))
    assert j.c.tick() is not None and j.c.finish_result.exit_code == 0


def test_a_step_the_lost_master_received_but_never_logged_is_logged_once_by_the_restarted_one(make, tmp_path):
    """Under load, a ``killmaster`` landed after the agents sent step N's reports and before the master
    logged it: the agents replay them flagged as seen, and the run's event log had no step N."""
    first = make(nodes=2, steps=10)
    journals = []
    first.c.journal_to = journals.append
    start(first, "a", "b")
    for step in range(5):  # steps 0..4 logged; step 5's reports reached the master as it died
        first.train(1, step)
    ranks = {gpu: a.rank for gpu, a in first.assigned.items()}
    j = make(nodes=2, steps=10)
    j.events.write_text(first.events.read_text() + '{"ts":1,"event":"step","gener')  # a line cut by the kill
    j.c.adopt(journals[-1])
    for name in ("a", "b"):
        _come_back(j, name, 1, 5, ranks[(name, 0)])
    j.c.tick()
    assert j.c.phase == JobPhase.RUNNING and j.c.next_step == 6
    assert [e["step"] for e in read_events(j.events, "step")] == [0, 1, 2, 3, 4, 5]


def test_the_steps_a_lost_master_logged_are_read_from_the_end_of_its_event_log(tmp_path):
    from oobleck_mm.master.progress import logged_steps

    path = tmp_path / "events.jsonl"
    assert logged_steps(str(path)) == {}  # no log yet: a master that never logged anything
    log = EventLog(path)
    for generation, step in [(1, 0), (1, 1), (2, 2), (2, 3)]:
        log.write("step", generation=generation, step=step, padding="x" * 500)
        log.write("heartbeat_late", node="a", generation=generation, step=step + 100)  # not a step line
    assert logged_steps(str(path)) == {1: 1, 2: 3}
    # Only the tail is read: a log of weeks of steps is not parsed whole, and a cut first line is skipped.
    assert logged_steps(str(path), tail_bytes=700) == {2: 3}


def test_a_node_that_does_not_come_back_to_a_restarted_master_is_recovered_from_like_a_loss(make, tmp_path):
    journal, ranks = _lost_master(make, nodes=3, steps=20)

    j = make(nodes=3, steps=20)
    j.c.adopt(journal)
    for name in ("a", "b"):
        _come_back(j, name, 1, 2, ranks[(name, 0)])
    window = j.c.timeouts.adopt_window.total_seconds()
    _alive_for(j, window - 0.2)
    assert j.c.phase == JobPhase.ADOPTING
    _alive_for(j, 0.5)  # c went down with the master: past the window it is lost
    [adopted] = read_events(j.events, "adopted")
    assert adopted["missing"] == ["c"] and sorted(adopted["nodes"]) == ["a", "b"]
    _alive_for(j, 0.5)
    assert j.c.generation == 2
    j.drain_all()
    for name in ("a", "b"):  # the survivors keep their states: generation 2 takes them from generation 1
        a = j.assigned[(name, 0)]
        assert a.generation == 2 and a.previous_generation == 1 and a.start_step == 3
    [decided] = read_events(j.events, "plan_decided")
    assert decided["lost"] == ["c"] and decided["cause"] == "lost"


def test_agents_back_with_another_generation_than_the_journal_make_the_nodes_re_form(make):
    journal, ranks = _lost_master(make, nodes=2, steps=20)
    j = make(nodes=2, steps=20)
    j.c.adopt(journal)
    _come_back(j, "a", 1, 0, ranks[("a", 0)])
    _come_back(j, "b", 0, 0, ranks[("b", 0)])  # b's agent never passed generation 1 on
    _alive_for(j, 0.3)
    assert read_events(j.events, "adopted")[0]["other_generation"] == ["b"]
    assert j.c.generation == 2  # a new generation at once, not a hang at the next collective


def test_a_notice_while_a_restarted_master_adopts_plans_the_node_out_like_in_a_running_job(make):
    journal, ranks = _lost_master(make, nodes=3, steps=20)
    j = make(nodes=3, steps=20)
    j.c.adopt(journal)
    for name in ("a", "b", "c"):
        _come_back(j, name, 1, 1, ranks[(name, 0)])
    j.c.leave("c", j.sessions["c"], "preemption notice")  # before the control thread saw them all back
    [leaving] = read_events(j.events, "leaving")
    assert leaving["in_plan"] and not read_events(j.events, "left")  # not dismissed as a spare
    _alive_for(j, 0.5)
    [decided] = read_events(j.events, "plan_decided")
    assert decided["generation"] == 2 and decided["cause"] == "left" and "c" not in decided["nodes"]
    assert decided["previous_generation"] == 1


def test_a_restarted_master_that_finds_no_node_back_says_so_instead_of_planning_nobody(make):
    journal, _ = _lost_master(make, nodes=2, steps=20, trained=0)
    j = make(nodes=2, steps=20)
    j.c.adopt(journal)
    result = j.advance(j.c.timeouts.adopt_window.total_seconds() + 0.2)
    assert result is not None and result.exit_code == 1 and "none of generation 1's nodes came back" in result.message
    assert not read_events(j.events, "plan_decided")


def test_a_journal_of_an_ended_job_is_never_re_adopted_and_the_same_command_starts_a_new_job(make, tmp_path):
    from oobleck_mm.master.journal import end_journal, read_journal, write_journal
    from oobleck_mm.master.run_dir import running_job
    from oobleck_mm.errors import UserError

    journal, _ = _lost_master(make, nodes=2, steps=10, trained=0)
    assert running_job(str(tmp_path)) is None  # nothing journaled here yet
    write_journal(str(tmp_path), journal)
    assert running_job(str(tmp_path)) == 1  # a master that died: the same command re-adopts it
    end_journal(str(tmp_path), 0)
    assert running_job(str(tmp_path)) is None
    with pytest.raises(UserError, match=r"finished \(exit 0\): no master is to be resumed") as caught:
        read_journal(str(tmp_path))
    # Said as it is: it was re-wrapped as an unreadable journal (issue 54 item 6)
    assert "cannot read the journal" not in str(caught.value) and "--resume DIR" in str(caught.value)
    end_journal(str(tmp_path), 3)
    with pytest.raises(UserError, match=r"ended \(exit 3\): nothing runs to re-adopt; a checkpoint it wrote"):
        read_journal(str(tmp_path))


def test_the_journal_is_owner_only_json_and_a_planted_or_broken_file_is_refused_never_run(make, tmp_path):
    """Issue 27 item 6: run dirs live on shared storage; the journal must hold data, not code."""
    import os
    import pickle
    import stat

    from oobleck_mm.master.journal import read_journal, write_journal
    from oobleck_mm.master.run_dir import JOURNAL_FILE
    from oobleck_mm.errors import UserError

    journal, _ = _lost_master(make, nodes=2, steps=10)
    run = tmp_path / "run"
    run.mkdir()
    write_journal(str(run), journal)
    path = run / JOURNAL_FILE
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert [p.name for p in run.iterdir()] == [JOURNAL_FILE]  # no pickle beside it
    back = read_journal(str(run))
    assert back.plan == journal.plan and back.current == journal.current  # the planning Plan, exactly, from JSON

    class Planted:  # what a crafted pickle does: run code when loaded
        def __reduce__(self):
            return (os.mkdir, (str(tmp_path / "pwned"),))

    record = json.loads(path.read_text())
    (run / "master-plan-g1.pickle").write_bytes(pickle.dumps(Planted()))
    path.write_text(json.dumps({**record, "version": 1, "plan_file": "master-plan-g1.pickle"}))
    with pytest.raises(UserError, match=rf"cannot read the journal {path}: version 1.*never loads"):
        read_journal(str(run))
    assert not (tmp_path / "pwned").exists()
    path.write_text(json.dumps({**record, "plan": {"pipelines": [{"nodes": ["a"]}]}}))
    with pytest.raises(UserError, match=rf"cannot read the journal {path}"):
        read_journal(str(run))
    path.write_text("{not json")
    with pytest.raises(UserError, match=rf"cannot read the journal {path}"):
        read_journal(str(run))


def test_cut_short_names_a_checkpoint_only_when_a_lost_writer_had_not_reported():
    from oobleck_mm.master.checkpointing import CheckpointBook, cut_short
    from oobleck_mm.master.recovery import GenerationView

    gen = GenerationView(1, None, {("a", 0): 0, ("b", 0): 1, ("c", 0): 2})
    book = CheckpointBook(last=("/c/step00000004", 4))
    gens = {1: gen}
    assert cut_short(book, gens, 4, 7, ["a"]) is None  # the newest taken (4) is complete
    assert cut_short(book, gens, 4, 8, ["a"]) == 8  # step 8's snapshot was taken, nobody reported
    book.shares["/c/step00000008"] = {("a", 0): pb.CheckpointDone(dir="/c/step00000008", step=8, generation=1)}
    assert cut_short(book, gens, 4, 9, ["a"]) is None  # a's files are on disk: b and c complete it
    assert cut_short(book, gens, 4, 9, ["a", "b"]) == 8
    assert cut_short(CheckpointBook(), gens, 0, 9, ["a"]) is None  # no periodic checkpoints at all


def test_a_tick_woken_by_a_change_does_not_look_at_every_nodes_health_again(make, monkeypatch):
    """At 4,000 nodes each registration woke the control loop, whose tick looked at every node's health:
    26 s to register them all, heartbeats unread meanwhile, every node lost (bench_control_plane.py). A
    tick detects only once ``detector_tick`` passed since the last detection, or when a node's health
    changed (its stream ended, a worker failed: seen at once, as before)."""
    from oobleck_mm.master.registry import Registry

    looks = []
    health = Registry.health
    monkeypatch.setattr(Registry, "health", lambda self: looks.append(1) or health(self))
    j = make(nodes=40, steps=10)
    for k in range(40):  # registrations within one detector tick (the clock does not move)
        j.join(f"n{k}")
        j.c.tick()
    assert len(looks) == 1, f"{len(looks)} detections for 40 registrations in one tick"
    j.clock.now += j.c.timeouts.detector_tick.total_seconds()
    j.c.tick()
    assert len(looks) == 2, "a detector tick later it looks again"
    j.c.stream_ended("n3", j.sessions["n3"])
    j.c.tick()
    assert len(looks) == 3 and "n3" not in j.c.state.registry.nodes, "a closed stream is seen at the next tick"


def test_the_masters_hold_point_names_a_generation_and_a_bad_entry_by_its_text():
    from oobleck_mm.master.disk import journal_hold

    assert journal_hold(3, "journal3:4") == 4.0 and journal_hold(2, "journal3:4") == 0.0
    assert journal_hold(12, "journal1:1, journal12:0.5") == 0.5 and journal_hold(1, "") == 0.0
    with pytest.raises(ValueError, match=r"OOBLECK_MASTER_HOLD_AT: expected journalG:seconds .*'copy:3'"):
        journal_hold(1, "copy:3")
