"""The batch split with measured node speeds (``planning.speed``): fewer microbatches for a slow node's pipeline."""

from __future__ import annotations

import pytest

from oobleck_mm.planning.plan import PipelineInstance, Plan
from oobleck_mm.planning.speed import slowed_template, speed_aware_split
from tests.unit.test_batch import make_template

# Three identical two-stage pipelines on six nodes: stage 0 (node 0 of the template) is the light one.
TEMPLATE = make_template(2, forward=(0.25, 0.5), backward=(0.5, 1.0))
PLAN = Plan(tuple(PipelineInstance(TEMPLATE, (f"n{2 * i}", f"n{2 * i + 1}"), 4) for i in range(3)),
            global_batch=24, microbatch_size=2, allreduce_s=0.0)  # fmt: skip


@pytest.mark.parametrize("solver", ["python", "highs"])
def test_a_slow_nodes_pipeline_gets_fewer_microbatches_and_the_global_batch_is_kept(solver):
    plan, split = speed_aware_split(PLAN, {"n3": 2.0}, solver)
    counts = [p.num_microbatches for p in plan.pipelines]
    assert sum(counts) * plan.microbatch_size == PLAN.global_batch
    assert counts[1] < counts[0] == counts[2], counts
    assert [p.nodes for p in plan.pipelines] == [p.nodes for p in PLAN.pipelines]
    assert [p.template for p in plan.pipelines] == [TEMPLATE] * 3, "the plan keeps the real templates"
    # Predicted: better than keeping the even split with the slow pipeline at half speed.
    slowed = slowed_template(PLAN.pipelines[1], {"n3": 2.0})
    assert split.iteration_time_s < slowed.iteration_time(4)
    # Recovered: the split of the templates as they are, the even one.
    back, _ = speed_aware_split(plan, {}, solver)
    assert [p.num_microbatches for p in back.pipelines] == [4, 4, 4]


def test_a_node_slowed_in_the_light_stage_costs_its_pipeline_less_than_in_the_bottleneck():
    light = slowed_template(PLAN.pipelines[0], {"n0": 2.0})  # stage 0: 0.75 s -> 1.5 s, as the heavy one
    heavy = slowed_template(PLAN.pipelines[0], {"n1": 2.0})  # stage 1: 1.5 s -> 3 s
    assert light.stages[0].forward_s == 0.5 and light.stages[1] == TEMPLATE.stages[1]
    assert TEMPLATE.iteration_time(4) < light.iteration_time(4) < heavy.iteration_time(4)
    assert slowed_template(PLAN.pipelines[0], {"n5": 3.0}) is TEMPLATE, "another pipeline's node changes nothing"
