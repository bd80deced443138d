"""The batch split with measured node speeds (``planning.speed``): fewer microbatches for a slow node's pipeline."""

from __future__ import annotations

import pytest

from oobleck_mm.planning.plan import PipelineInstance, Plan
from oobleck_mm.planning.speed import slowed_template, speed_aware_split
from tests.unit.test_batch import make_template

# Three identical two-stage pipelines on six nodes: stage 0 (node 0 of the template) is the light one.
TEMPLATE = make_template(2, forward=(0.25, 0.5), backward=(0.5, 1.0))
PLAN = Plan(
    tuple(PipelineInstance(TEMPLATE, (f"n{2 * i}", f"n{2 * i + 1}"), 4) for i in range(3)),
    global_batch=24,
    microbatch_size=2,
    allreduce_s=0.0,
)


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


def test_a_straggler_is_benched_only_when_the_plan_without_it_is_predicted_faster_than_its_re_split():
    """``planning.planner.weigh_bench`` through the master's planning call (``replan_nodes(..., bench=)``) on the
    real planner: six one-stage pipelines of four microbatches. A re-split gives a 4x node one microbatch (4
    units against the others' 5: a tie with five nodes), so it is kept; at 8x even one microbatch is the
    bottleneck, so the plan of the five others is chosen, the global batch whole on them."""
    from pathlib import Path

    import yaml

    from oobleck_mm.master.planning import plan_nodes, replan_nodes
    from oobleck_mm.config import load_config

    job = load_config(str(Path(__file__).resolve().parents[2] / "configs" / "tiny_mm.yaml"))
    raw = job.to_dict()
    raw["training"].update(dtype="float64", global_batch=48)
    config_yaml = yaml.safe_dump(raw)
    names = [f"node{i}" for i in range(6)]
    start = plan_nodes(config_yaml, names)
    assert [len(p.stages) for p in start.layout.pipelines] == [1] * 6
    kept = replan_nodes(config_yaml, start.template_nodes, start.plan, [], [], [("node2", 4.0)], ["node2"])
    assert kept.benched == () and sorted(n for n, _ in kept.ranks) == sorted(names)
    assert "node2 kept: predicted" in kept.reason and "a bench needs 5% more" in kept.reason
    out = replan_nodes(config_yaml, start.template_nodes, start.plan, [], [], [("node2", 8.0)], ["node2"])
    assert out.benched == ("node2",) and "node2" not in {n for n, _ in out.ranks} and len(out.ranks) == 5
    assert sum(p.num_microbatches for p in out.layout.pipelines) * out.layout.microbatch_size == 48
    assert out.reason.startswith("node2 benched (predicted")


# --------------------------------------------------------------------------- re-cut for the speeds
def _mllm_on_8(global_batch: int):
    from oobleck_mm.config import load_config
    from oobleck_mm.planning.planner import plan_job
    from oobleck_mm.profiling.load import load_profile

    sets = [
        "cluster.emulate=a100-80gb",
        "cluster.device=cpu",
        "cluster.backend=gloo",
        "cluster.gpus_per_node=1",
        "cluster.max_gpus_per_stage=1",
        "cluster.inter_node_bandwidth=200Gbps",
        "training.microbatch_size=4",
        f"training.global_batch={global_batch}",
    ]
    job = load_config("configs/mllm_10b.yaml", overrides=sets)
    profile = load_profile(job)
    result = plan_job(job, profile, [f"node{i}" for i in range(8)])
    return job, profile, result


def test_a_slow_stage_is_re_cut_to_fewer_layers_on_the_same_nodes_and_its_pipeline_runs_faster():
    from oobleck_mm.planning.costs import ClusterSpec
    from oobleck_mm.planning.stage_mapping import recut_for_speeds

    job, profile, result = _mllm_on_8(64)
    cluster = ClusterSpec.from_config(job.cluster)
    pipeline = next(p for p in result.plan.pipelines if "node5" in p.nodes)
    slow_stage = next(st for st in pipeline.template.stages if pipeline.nodes[st.node] == "node5")
    factors = [2.0 if st is slow_stage else 1.0 for st in pipeline.template.stages]
    cut = recut_for_speeds(profile, cluster, pipeline.template, factors, pipeline.num_microbatches)
    k = pipeline.template.stages.index(slow_stage)
    assert cut.stages[k].num_layers < slow_stage.num_layers, "the slow node's stage gives layers away"
    assert [(st.node, st.gpus) for st in cut.stages] == [(st.node, st.gpus) for st in pipeline.template.stages]
    assert [st.layer_start for st in cut.stages[1:]] == [st.layer_end for st in cut.stages[:-1]]
    assert cut.stages[0].layer_start == 0 and cut.stages[-1].layer_end == pipeline.template.num_layers
    assert all(st.memory_bytes <= cluster.usable_memory_bytes for st in cut.stages)

    def slowed(t):
        instance = PipelineInstance(t, pipeline.nodes, pipeline.num_microbatches)
        return slowed_template(instance, {"node5": 2.0}).iteration_time(pipeline.num_microbatches)

    assert slowed(cut) < 0.95 * slowed(pipeline.template)
    # At its templates' speed the job's own cut is kept: nothing is faster.
    same = recut_for_speeds(profile, cluster, pipeline.template, [1.0] * len(factors), pipeline.num_microbatches)
    assert same.iteration_time(pipeline.num_microbatches) >= pipeline.template.iteration_time(
        pipeline.num_microbatches
    ) * (1 - 1e-9)


@pytest.mark.parametrize("global_batch, cut_taken", [(32, False), (64, True)])
def test_the_re_cut_is_taken_only_where_it_beats_the_re_split_and_a_recovered_node_gets_its_template_back(
    global_batch, cut_taken
):
    """MLLM-10B on 8 emulated A100s (2 pipelines of 4 stages), node5 2x slow. At 8 microbatches the split's
    whole microbatches bound both to the same prediction (89% of unslowed): the layers stay. At 16 the re-cut
    pipeline is predicted 92% against the re-split's 82%."""
    from oobleck_mm.planning.planner import plan_fresh, split_for_speeds
    from oobleck_mm.planning.speed import RECUT_GAIN, predicted_samples_per_s

    job, profile, _ = _mllm_on_8(global_batch)
    outcome, templates = plan_fresh(job, profile, [f"node{i}" for i in range(8)])
    split_only = split_for_speeds(job, outcome, {"node5": 2.0})
    both = split_for_speeds(job, outcome, {"node5": 2.0}, profile, templates)
    gain = predicted_samples_per_s(both.plan, {"node5": 2.0}) / predicted_samples_per_s(split_only.plan, {"node5": 2.0})
    assert ("speed cut" in both.actions) == cut_taken, both.reason
    assert sum(p.num_microbatches for p in both.plan.pipelines) * 4 == global_batch
    if cut_taken:
        assert gain > 1 + RECUT_GAIN and "re-cut for their speeds" in both.reason
        untouched = next(p for p in both.plan.pipelines if "node5" not in p.nodes)
        assert untouched.template == templates.for_nodes(untouched.template.num_nodes)
        # A loss after the re-cut is planned from the job's templates (an emulated run stopped with "template_set
        # has no template equal to pipeline 0's" when node1 was weighed for a bench after node5's re-cut).
        from oobleck_mm.planning.planner import Planned, plan_reconfiguration, plan_without_stragglers

        after, _ = plan_reconfiguration(job, profile, templates, 8, both.plan, ["node1"], [])
        assert isinstance(after, Planned) and "node1" not in after.plan.nodes
        weighed, _ = plan_without_stragglers(job, profile, templates, 8, both.plan, {"node5": 2.0}, ["node5"])
        assert isinstance(weighed, Planned)
        recovered = split_for_speeds(job, both, {}, profile, templates)  # node5 back to speed: the layers return
        assert all(p.template == templates.for_nodes(p.template.num_nodes) for p in recovered.plan.pipelines)
        assert "speed cut" not in recovered.actions[len(both.actions) :]
    else:
        assert both.plan == split_only.plan and gain == pytest.approx(1.0)
