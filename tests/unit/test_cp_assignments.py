"""A generation's assignments as the agents parse them, and the master's warning on its heartbeat load.

The master serializes the part every worker shares once and appends each worker's own
(``oobleck_mm.protocol.encoded``); these tests parse what goes on the wire and compare it with
the message built whole, field by field, so a field set in both parts (a repeated one would be
appended twice) or missing from both fails here.
"""

from __future__ import annotations

from oobleck_mm.master.assignments import Sending, build_assignments
from oobleck_mm.master.recovery import GenerationView
from oobleck_mm.master.server import HEARTBEATS_PER_S_BUDGET, heartbeat_load_warning
from oobleck_mm.planning.layout import ExecutionPlan, PipelineLayout, StageLayout
from oobleck_mm.protocol import oobleck_pb2 as pb
from oobleck_mm.protocol.convert import plan_to_proto

SENDING = Sending(
    store_host="10.0.0.1",
    store_port=29400,
    steps=500,
    save_final_dir="/final",
    checkpoint_interval=50,
    checkpoint_dir="/ckpt",
    checkpoint_async=True,
)
# gen 1: [a b] and [c d]; gen 2 after losing d: [a b] and c alone, two GPUs on node a
BASE = GenerationView(
    1, ExecutionPlan.even(10, [2, 2], [4, 4], 2), {("a", 0): 0, ("b", 0): 1, ("c", 0): 2, ("d", 0): 3}
)
GEN = GenerationView(
    2,
    ExecutionPlan(
        (PipelineLayout((StageLayout(0, 0, 5), StageLayout(1, 5, 10)), 5), PipelineLayout((StageLayout(2, 0, 10),), 3)),
        10,
        2,
    ),
    {("a", 1): 0, ("b", 0): 1, ("c", 0): 2},
)


def whole(rank: int, local_rank: int, previous: list[int] | None) -> pb.AgentEvent:
    """The message as it was built before the shared part was encoded once: every field, one object."""
    a = pb.Assignment(
        generation=2,
        rank=rank,
        world_size=3,
        store_host="10.0.0.1",
        store_port=29400,
        start_step=7,
        steps=500,
        plan=plan_to_proto(GEN.layout),
        resume_dir="",
        save_final_dir="/final",
        checkpoint_interval=50,
        checkpoint_dir="/ckpt",
        checkpoint_async=True,
        rank_nodes=GEN.rank_nodes,
        checkpoint_after_first_step=True,
    )
    if previous is not None:
        a.previous_generation = 1
        a.previous_plan.CopyFrom(plan_to_proto(BASE.layout))
        a.previous_ranks.extend(previous)
        a.at_boundary = True
    return pb.AgentEvent(assignment=pb.WorkerAssignment(local_rank=local_rank, assignment=a))


def test_every_worker_parses_the_message_built_whole_with_its_own_rank_and_local_rank():
    previous = [0, 1, 2]
    out = build_assignments(
        GEN,
        SENDING,
        start_step=7,
        base=BASE,
        previous_ranks=previous,
        at_boundary=True,
        checkpoint_after_first_step=True,
    )
    assert [(gpu, rank) for gpu, rank, _ in out] == [(("a", 1), 0), (("b", 0), 1), (("c", 0), 2)]
    for (node, local_rank), rank, event in out:
        parsed = pb.AgentEvent.FromString(event.SerializeToString())
        assert parsed == whole(rank, local_rank, previous)
        assert len(parsed.assignment.assignment.previous_ranks) == 3  # not appended once per part
        assert list(parsed.assignment.assignment.rank_nodes) == ["a", "b", "c"]


def test_a_fresh_generation_carries_no_previous_plan():
    for (node, local_rank), rank, event in build_assignments(
        GEN, SENDING, start_step=7, checkpoint_after_first_step=True
    ):
        parsed = event.decoded()
        assert parsed == whole(rank, local_rank, None)
        assert not parsed.assignment.assignment.HasField("previous_plan")


def test_the_shared_part_is_one_object_for_every_worker():
    out = build_assignments(GEN, SENDING, start_step=0)
    shared = {id(event.parts[0]) for _, _, event in out}
    assert len(shared) == 1 and all(len(event.parts[1]) < 32 for _, _, event in out)


def test_the_master_warns_past_its_measured_heartbeat_rate_and_names_an_interval_that_fits():
    assert heartbeat_load_warning(1000, 0.5) is None  # 2,000 a second: measured to hold
    message = heartbeat_load_warning(4000, 0.5)
    assert message is not None and "8,000 heartbeats a second" in message
    assert "fault_tolerance.heartbeat_interval to at least 2s" in message
    assert heartbeat_load_warning(int(HEARTBEATS_PER_S_BUDGET * 2), 2.0) is None
