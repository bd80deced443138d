"""The master's state machine without gRPC: registration, planning, assignments, detection, progress, the end.

The planner runs for real on the tiny model; the clock is a number the test moves.
"""

from __future__ import annotations

import queue
from pathlib import Path

import pytest

from master.coordinator import END_OF_STREAM, RUNNING, WAITING, Coordinator, Refused
from master.server import apply_overrides
from oobleck_mm.config import load_config
from oobleck_mm.events import EventLog, read_events
from oobleck_mm.protocol import oobleck_pb2 as pb
from oobleck_mm.protocol.convert import plan_from_proto

TINY = str(Path(__file__).resolve().parents[2] / "configs" / "tiny_mm.yaml")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def make(tmp_path):
    made = []

    def build(nodes: int = 2, gpus: int = 1, steps: int = 3):
        job = apply_overrides(load_config(TINY), nodes=nodes, gpus_per_node=gpus, steps=steps)
        clock, lines = Clock(), []
        events_path = tmp_path / f"events{len(made)}.jsonl"
        c = Coordinator(job, num_nodes=nodes, steps=steps, store_host="10.0.0.1", store_port=4321,
                        events=EventLog(events_path), clock=clock, progress=lines.append)  # fmt: skip
        made.append(c)
        return c, clock, lines, events_path

    yield build
    for c in made:
        c.events.close()


def join(c: Coordinator, name: str, stream: bool = True) -> tuple[int, queue.Queue | None]:
    session, _ = c.register(name, 0, 1 << 30, 123, "ipv4:127.0.0.1:1")
    return session, (c.open_stream(name, session) if stream else None)


def advance(c: Coordinator, clock: Clock, seconds: float):
    """Moves the clock in the control thread's small steps, ticking after each; the last tick's result."""
    result = None
    for _ in range(round(seconds / 0.05)):
        clock.now += 0.05
        result = c.tick()
    return result


def drain(outbox: queue.Queue) -> list:
    out = []
    while not outbox.empty():
        out.append(outbox.get_nowait())
    return out


def test_plans_when_enough_streams_are_open_and_assigns_every_gpu_a_distinct_rank(make):
    c, _, lines, events = make(nodes=2, gpus=2)
    s0, box0 = join(c, "a")
    s1, _ = join(c, "b", stream=False)
    assert c.tick() is None and c.phase == WAITING  # b registered but cannot be told anything yet
    box1 = c.open_stream("b", s1)
    c.tick()
    assert c.phase == RUNNING and c.generation == 1
    sent = {("a", e.assignment.local_rank): e.assignment.assignment for e in drain(box0)}
    sent |= {("b", e.assignment.local_rank): e.assignment.assignment for e in drain(box1)}
    assert set(sent) == {("a", 0), ("a", 1), ("b", 0), ("b", 1)}  # one worker per GPU of each node
    plan = plan_from_proto(next(iter(sent.values())).plan)
    assert sorted(a.rank for a in sent.values()) == list(range(plan.world_size)) == list(range(4))
    for a in sent.values():
        assert (a.generation, a.world_size, a.store_host, a.store_port, a.steps) == (1, 4, "10.0.0.1", 4321, 3)
        assert plan_from_proto(a.plan) == plan
    decided = read_events(events, "plan_decided")
    assert decided[0]["nodes"] == ["a", "b"] and decided[0]["layout"] == plan.to_dict()
    assert len(read_events(events, "assignment_sent")) == 4 and "generation 1" in lines[0]

    _, box2 = join(c, "late")  # a join after the start waits as a spare
    assert read_events(events, "registered")[-1]["spare"] is True
    c.tick()
    assert drain(box2) == []


def test_refusals_name_the_problem_and_are_logged(make):
    c, _, _, events = make()
    session, _ = join(c, "a")
    for call, code in [
        (lambda: c.register("a", 0, 0, 1, "peer"), "ALREADY_EXISTS"),
        (lambda: c.register("b", 3, 0, 1, "peer"), "INVALID_ARGUMENT"),
        (lambda: c.register("../etc", 0, 0, 1, "peer"), "INVALID_ARGUMENT"),
        (lambda: c.heartbeat("a", session + 1), "NOT_FOUND"),
        (lambda: c.open_stream("a", session), "FAILED_PRECONDITION"),
    ]:
        with pytest.raises(Refused) as err:
            call()
        assert err.value.code == code
    reasons = [e["reason"] for e in read_events(events, "refused")]
    assert any("already registered" in r for r in reasons) and any("cluster.gpus_per_node = 1" in r for r in reasons)


def test_a_silent_node_is_lost_after_the_timeout_and_stops_a_running_job(make):
    c, clock, _, events = make(nodes=2)
    sa, box_a = join(c, "a")
    sb, box_b = join(c, "b")
    c.tick()
    drain(box_a), drain(box_b)
    timeout = c.timeout.total_seconds()
    result = advance(c, clock, timeout * 0.75)
    c.heartbeat("a", sa)
    result = advance(c, clock, timeout * 0.5)  # b silent for 1.25 timeouts, a for 0.5
    [lost] = read_events(events, "lost")
    assert (lost["node"], lost["reason"], lost["in_plan"]) == ("b", "heartbeat_timeout", True)
    assert result is not None and result.exit_code == 1 and "issue 5" in result.message
    for box in (box_a, box_b):  # everyone is told to stop, and the streams end
        *_, shutdown, end = drain(box)
        assert shutdown.WhichOneof("event") == "shutdown" and end is END_OF_STREAM
    with pytest.raises(Refused):
        c.heartbeat("b", sb)  # a lost node stays lost


def test_a_node_lost_while_waiting_only_leaves_the_waiting_set(make):
    c, _, _, events = make(nodes=2)
    join(c, "a")
    sb, _ = join(c, "b", stream=False)
    c.open_stream("b", sb)
    c.stream_ended("b", sb)  # its agent died before the plan
    assert c.tick() is None and c.phase == WAITING
    assert read_events(events, "lost")[0]["reason"] == "stream_closed"
    join(c, "b")  # the node comes back under the same name with a new session
    c.tick()
    assert c.phase == RUNNING and read_events(events, "plan_decided")[0]["nodes"] == ["a", "b"]


def test_progress_waits_for_every_rank_and_all_done_ends_the_job(make):
    c, _, lines, events = make(nodes=2, steps=2)
    sessions = {name: join(c, name) for name in ("a", "b")}
    c.tick()
    ranks = {}
    for name, (session, box) in sessions.items():
        for e in drain(box):
            ranks[e.assignment.assignment.rank] = (name, session, e.assignment.local_rank)
    for step in range(2):
        for rank, (name, session, local) in sorted(ranks.items()):
            assert not any(f"step {step + 1}/2" in line for line in lines)  # not before the last rank
            metrics = pb.StepMetrics(generation=1, step=step, rank=rank, loss=3.0 - step, samples_per_s=50.0,
                                     step_time_s=0.1 * (rank + 1))  # fmt: skip
            c.worker_report(name, session, local, pb.WorkerReport(metrics=metrics))
        assert any(f"step {step + 1}/2  loss {3.0 - step:.4f}" in line for line in lines)
    steps = read_events(events, "step")
    assert [s["step"] for s in steps] == [0, 1] and steps[0]["step_time_s"] == pytest.approx(0.1 * len(ranks))
    for rank, (name, session, local) in ranks.items():
        assert c.tick() is None
        c.worker_report(name, session, local, pb.WorkerReport(done=pb.WorkerDone(step=1)))
    assert c.tick().exit_code == 0
    assert read_events(events, "done")[0]["steps"] == 2


def test_an_agents_worker_report_makes_its_node_lost(make):
    c, _, _, events = make(nodes=2)
    sa, _ = join(c, "a")
    join(c, "b")
    c.tick()
    c.worker_failure("a", sa, 0, "worker_stopped", "pid 42 is stopped (status stopped)")
    assert c.tick().exit_code == 1
    [lost] = read_events(events, "lost")
    assert (lost["node"], lost["reason"]) == ("a", "worker_stopped") and "pid 42" in lost["detail"]


def test_time_the_master_itself_was_frozen_is_not_the_nodes_silence(make):
    c, clock, _, events = make(nodes=3)
    sa, _ = join(c, "a")
    join(c, "b")
    c.tick()
    timeout = c.timeout.total_seconds()
    clock.now += 3 * timeout  # the master was descheduled: nobody could be heard
    c.tick()
    assert read_events(events, "lost") == [] and read_events(events, "master_stalled")[0]["seconds"] == 3 * timeout
    for _ in range(int(timeout / 0.1) + 2):  # then it runs normally and only a beats
        c.heartbeat("a", sa)
        advance(c, clock, 0.1)
    assert [(e["node"], e["reason"]) for e in read_events(events, "lost")] == [("b", "heartbeat_timeout")]
