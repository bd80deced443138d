"""A branched pipeline's topology (``PipelineLayout.branches``): who sends to whom, each stage's place in
DeepSpeed's schedule, which layers feed a stage, and the plan's checks and round trips."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from oobleck_mm.planning.layout import ExecutionPlan, PipelineLayout, StageLayout
from oobleck_mm.protocol.convert import plan_from_proto, plan_to_proto


def layout(vision: int, audio: int, llm: int, microbatches: int = 2) -> PipelineLayout:
    """One layer a stage: ``vision`` + ``audio`` branch stages, then ``llm`` stages."""
    n = vision + audio + llm
    stages = tuple(StageLayout(i, i, i + 1) for i in range(n))
    branches = (0, vision) if audio else (0,)
    return PipelineLayout(stages, microbatches, branches, vision + audio)


def test_two_branches_feed_the_merge_stage_and_each_runs_its_distance_in_the_schedule():
    p = layout(2, 1, 2)
    assert [p.neighbours(i) for i in range(5)] == [((), 1), ((0,), 3), ((), 3), ((1, 2), 4), ((3,), None)]
    # vision: 2 + 2 LLM stages, stage 0 and 1; audio: 1 + 2, stage 0; the LLM: stages 1 and 2 of 1 + 2
    assert [p.schedule_position(i) for i in range(5)] == [(4, 0), (4, 1), (3, 0), (3, 1), (3, 2)]
    assert [p.upstream_layers(i) for i in range(5)] == [(), (0,), (), (0, 1, 2), (0, 1, 2, 3)]
    assert (p.branch_layers(0), p.branch_layers(1)) == (range(0, 2), range(2, 3))


@given(st.integers(1, 4), st.integers(0, 4), st.integers(1, 4))
def test_every_stage_reaches_the_end_and_every_distance_counts_the_stages_after_it(vision, audio, llm):
    p = layout(vision, audio, llm)
    n = len(p.stages)
    for i in range(n):
        stages, stage_id = p.schedule_position(i)
        after, j = 0, i
        while (j := p.neighbours(j)[1]) is not None:
            after += 1
        assert stages - stage_id - 1 == after  # the schedule sees exactly the stages after it
        for sender in p.neighbours(i)[0]:
            assert p.neighbours(sender)[1] == i  # every sender sends here, and only here


def test_a_chain_is_unchanged():
    chain = PipelineLayout(tuple(StageLayout(i, i, i + 1) for i in range(3)), 2)
    assert [chain.neighbours(i) for i in range(3)] == [((), 1), ((0,), 2), ((1,), None)]
    assert [chain.schedule_position(i) for i in range(3)] == [(3, 0), (3, 1), (3, 2)]
    assert chain.upstream_layers(2) == (0, 1)


@pytest.mark.parametrize(
    "branches,merge,message",
    [((1,), 2, "branches start at 0"), ((0, 2), 2, "each before the merge"), ((0,), 4, "one of its 4 stages")],
)
def test_a_malformed_branched_pipeline_is_refused_naming_it(branches, merge, message):
    stages = tuple(StageLayout(i, i, i + 1) for i in range(4))
    with pytest.raises(ValueError, match=message):
        ExecutionPlan((PipelineLayout(stages, 1, branches, merge),), 4, 1)


def test_wide_stages_and_context_parallel_lanes_branch_piece_by_piece():
    """A merge stage of two GPUs runs piece ``k`` of each microbatch on its ``k``-th rank, which takes piece ``k``
    from the rank of each branch running it: a one-GPU branch sends its two pieces to two ranks. Lanes pair
    up by index the same way."""
    stages = (StageLayout(0, 0, 1, shards=(1,)), StageLayout(2, 1, 2), StageLayout(3, 2, 3, shards=(4,)))
    plan = ExecutionPlan((PipelineLayout(stages, 1, (0, 1), 2),), 3, 2)
    p = plan.pipelines[0]
    assert p.pieces == 2 and p.neighbours(2)[0] == (0, 1)
    assert [[p.piece_rank(j, k) for j in (0, 1)] for k in range(2)] == [[0, 2], [1, 2]]
    assert [p.piece_rank(2, k) for k in range(2)] == [3, 4]
    lanes = tuple(StageLayout(2 * i, i, i + 1, shards=(2 * i + 1,), context_parallel=True) for i in range(3))
    p = ExecutionPlan((PipelineLayout(lanes, 1, (0, 1), 2),), 3, 1).pipelines[0]
    assert [[p.piece_rank(j, k) for j in (0, 1)] for k in range(2)] == [[0, 2], [1, 3]]
    assert [p.piece_rank(2, k) for k in range(2)] == [4, 5]


def test_a_branched_plan_round_trips_through_json_and_protobuf():
    plan = ExecutionPlan((layout(2, 1, 2), PipelineLayout((StageLayout(5, 0, 5),), 2)), 5, 1)
    assert ExecutionPlan.from_dict(plan.to_dict()) == plan
    assert plan_from_proto(plan_to_proto(plan)) == plan
    assert plan.describe().startswith("[r0:0-0|r1:1-1 || r2:2-2 => r3:3-3|r4:4-4]x2mb")
