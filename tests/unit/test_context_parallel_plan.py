"""Context parallelism in the config, the cost model, the planner and the plans it ships (issue 50 items 2, 4)."""

from __future__ import annotations

import copy

import pytest
import yaml

from oobleck_mm.config import ConfigError, config_from_dict
from oobleck_mm.errors import UserError
from oobleck_mm.planning.costs import ClusterSpec, LayerCost, LayerPrefix, ModelProfile, effective_layers, stage_cost
from oobleck_mm.planning.layout import ExecutionPlan, rank_table
from oobleck_mm.planning.plan import plan_from_dict, plan_to_dict
from oobleck_mm.planning.planner import plan_job
from oobleck_mm.planning.stage_mapping import min_nodes
from oobleck_mm.profiling.analytical import profile_from_config
from oobleck_mm.protocol.convert import plan_from_proto, plan_to_proto


def text_job(**cluster):
    with open("configs/tiny_mm.yaml") as f:
        d = yaml.safe_load(f)
    for part in ("vision", "projector"):
        d["model"].pop(part)
    d["data"].update(mean_text_tokens=200, max_seq_len=512, mean_images_per_sample=0, max_images_per_sample=0)
    d["training"].update(dtype="float64")
    d["cluster"].update(cluster)
    return d


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"cluster": {"context_parallel": 3, "gpus_per_node": 4}},
            "cluster.context_parallel: must be 1, 2, 4, 8 or auto, got 3",
        ),
        (
            {"cluster": {"context_parallel": 2, "gpus_per_node": 1}},
            r"cluster.context_parallel \(2\) exceeds cluster.gpus_per_node \(1\)",
        ),
        ({"cluster": {"context_parallel": 4, "gpus_per_node": 6}}, r"must divide cluster.gpus_per_node \(6\)"),
        (
            {"cluster": {"context_parallel": 2, "gpus_per_node": 2, "max_gpus_per_stage": 2}},
            r"a stage either shards its layers or splits its tokens.*max_gpus_per_stage: 1",
        ),
        (
            {
                "cluster": {"context_parallel": 2, "gpus_per_node": 2},
                "model": {"builder": "examples/custom_model.py:build"},
            },
            r"cluster.context_parallel \(2\): a model.builder model attends with its own attention.*valid: the "
            r"built-in model \(model.llm\) or a model.huggingface one",
        ),
    ],
)
def test_bad_context_parallel_settings_name_the_field_and_what_would_do(change, message):
    d = text_job()
    for section, values in change.items():
        d[section].update(copy.deepcopy(values))
    with pytest.raises(ConfigError, match=message):
        config_from_dict(d)


def fsdp_s(cluster, layer, d=4):
    """(forward, backward) seconds of FSDP2's collectives for ``layer`` sharded over ``d`` GPUs: its parameters
    gathered before the forward and again before the backward, its gradients reduce-scattered after."""
    gather = cluster.allgather_s(layer.param_bytes, d, cross_node=False)
    return gather, gather + cluster.allgather_s(layer.grad_bytes, d, cross_node=False)


def test_a_context_parallel_stage_divides_the_work_the_activations_and_the_state():
    """The lanes split the tokens (work and activations / 4, plus the keys' and values' gathers) and shard
    the layers' state over them (FSDP2 over the lanes: state / 4, plus its parameter gathers and gradient
    reduce-scatters)."""
    layer = LayerCost("llm.block0", "text", 4.0, 2.0, 2.0, 100, 100, 200, 800, 10, kv_bytes=64)
    prefix = LayerPrefix(effective_layers(ModelProfile("m", "test", 1, (layer, layer))))
    one = stage_cost(prefix, ClusterSpec(gpus_per_node=4, device_memory_bytes=10**9), 0, 2, 1)
    cluster = ClusterSpec(gpus_per_node=4, device_memory_bytes=10**9, context_parallel=4)
    four = stage_cost(prefix, cluster, 0, 2, 4)
    gather = cluster.allgather_s(64, 4, cross_node=False)
    fsdp_forward, fsdp_backward = fsdp_s(cluster, prefix.layers[0])
    assert four.forward_s == pytest.approx(one.forward_s / 4 + 2 * gather + 2 * fsdp_forward)
    assert four.backward_s == pytest.approx(
        one.backward_s / 4 + 2 * cluster.allreduce_s(64, 4, cross_node=False) + 2 * fsdp_backward
    )
    assert four.activation_bytes == one.activation_bytes / 4
    assert four.resident_bytes == one.resident_bytes / 4 and four.grad_bytes == one.grad_bytes / 4
    assert cluster.stage_gpu_options == (4,)


@pytest.mark.parametrize("recompute", [False, True])
def test_an_encoder_layer_on_a_context_parallel_stage_costs_its_whole_media_on_every_gpu(recompute):
    """Encoders run whole images on every lane (runtime.context_parallel): their time and activations are not
    divided, and their attention (over an image's patches) gathers nothing; the LLM layer beside them is split."""
    vision = LayerCost("vision.block0", "vision", 3.0, 1.0, 1.0, 100, 100, 200, 600, 10, kept_bytes=60, kv_bytes=48)
    text = LayerCost("llm.block0", "text", 4.0, 2.0, 2.0, 100, 100, 200, 800, 10, kept_bytes=80, kv_bytes=64)
    prefix = LayerPrefix(effective_layers(ModelProfile("m", "test", 1, (vision, text))))
    plain = ClusterSpec(gpus_per_node=4, device_memory_bytes=10**9)
    cluster = ClusterSpec(gpus_per_node=4, device_memory_bytes=10**9, context_parallel=4)
    enc, llm = (stage_cost(prefix, plain, k, k + 1, 1, recompute) for k in (0, 1))
    both = stage_cost(prefix, cluster, 0, 2, 4, recompute)
    gather, reduce = cluster.allgather_s(64, 4, cross_node=False), cluster.allreduce_s(64, 4, cross_node=False)
    fsdp = [fsdp_s(cluster, layer) for layer in prefix.layers]
    assert both.forward_s == pytest.approx(enc.forward_s + llm.forward_s / 4 + gather + sum(f for f, _ in fsdp))
    assert both.backward_s == pytest.approx(
        enc.backward_s + llm.backward_s / 4 + reduce + (gather if recompute else 0) + sum(b for _, b in fsdp)
    )
    assert both.activation_bytes == pytest.approx(enc.activation_bytes + llm.activation_bytes / 4)
    assert both.resident_bytes == pytest.approx((enc.resident_bytes + llm.resident_bytes) / 4)  # state sharded
    # additive over layers, as the DP's tables need
    parts = [stage_cost(prefix, cluster, k, k + 1, 4, recompute) for k in (0, 1)]
    assert both.forward_s == pytest.approx(sum(p.forward_s for p in parts))
    assert both.activation_bytes == pytest.approx(sum(p.activation_bytes for p in parts))


def test_a_sample_four_times_longer_than_a_stage_holds_fits_with_context_parallel_4():
    """At this memory no mapping of the model fits a 4x longer sample on one GPU per stage; on stages of four
    GPUs that split its tokens it does, every stage context-parallel, and the plan carries that to the ranks."""
    d = text_job(nodes=4, gpus_per_node=4, device_memory=6_000_000)
    d["data"].update(mean_text_tokens=200, max_seq_len=512)
    short = config_from_dict(copy.deepcopy(d))
    assert min_nodes(profile_from_config(short), ClusterSpec.from_config(short.cluster)) == 1
    d["data"].update(mean_text_tokens=800, max_seq_len=2048)
    long = config_from_dict(copy.deepcopy(d))
    with pytest.raises(UserError, match="does not fit"):
        min_nodes(profile_from_config(long), ClusterSpec.from_config(long.cluster))
    d["cluster"].update(context_parallel=4)
    d["fault_tolerance"]["f"] = 0
    job = config_from_dict(d)
    # (one node: its four lanes hold a quarter of every layer's state and of the long samples' activations)
    assert min_nodes(profile_from_config(job), ClusterSpec.from_config(job.cluster)) == 1
    planned = plan_job(job, profile_from_config(job), ["n0", "n1", "n2", "n3"]).plan
    stages = [s for p in planned.pipelines for s in p.template.stages]
    assert stages and all(s.context_parallel and s.gpus == (0, 1, 2, 3) for s in stages)
    assert plan_from_dict(plan_to_dict(planned)) == planned
    layout = ExecutionPlan.from_plan(planned, rank_table(planned))
    assert all(s.context_parallel and s.width == 4 for p in layout.pipelines for s in p.stages)
    assert "(cp)" in layout.describe() and layout.sharded
    assert ExecutionPlan.from_dict(layout.to_dict()) == layout
    assert plan_from_proto(plan_to_proto(layout)) == layout
    # the lanes shard the layers: one copy a pipeline, its four lanes in shard order
    assert len(layout.holders(0)) == len(layout.pipelines)
    assert all(len(ranks) == 4 for ranks in layout.shard_holders(0))


def test_a_journal_stage_row_from_before_context_parallelism_still_reads():
    job = config_from_dict(text_job(nodes=2))
    planned = plan_job(job, profile_from_config(job), ["n0", "n1"]).plan
    d = plan_to_dict(planned)
    for p in d["pipelines"]:
        p["template"]["stages"] = [row[:8] for row in p["template"]["stages"]]
    assert plan_from_dict(d) == planned
    p = d["pipelines"][0]["template"]["stages"][0]
    d["pipelines"][0]["template"]["stages"][0] = [*p, False, "yes"]
    with pytest.raises(ValueError, match="context_parallel must be true or false, got 'yes'"):
        plan_from_dict(d)


def test_a_pipeline_cannot_mix_context_parallel_and_other_stages():
    with pytest.raises(ValueError, match="every stage of it must be context-parallel over as many GPUs"):
        ExecutionPlan.even(6, [2], [4], 2, widths=[[2, 1]], context_parallel=[True])


def test_auto_takes_the_smallest_degree_at_which_the_job_fits_and_says_so():
    """``cluster.context_parallel: auto``: 1 where the samples fit a GPU a stage; for samples 4x longer at the
    same memory, the smallest degree that fits the nodes, the same in every planning call of the job."""
    from oobleck_mm.planning.stage_mapping import planning_cluster

    d = text_job(nodes=3, gpus_per_node=4, device_memory=6_000_000, context_parallel="auto")
    d["fault_tolerance"]["f"] = 0
    d["training"].update(global_batch=4, microbatch_size=2)
    short = config_from_dict(copy.deepcopy(d))
    assert planning_cluster(short, profile_from_config(short)).context_parallel == 1
    d["data"].update(mean_text_tokens=800, max_seq_len=2048)
    long = config_from_dict(copy.deepcopy(d))
    chosen = planning_cluster(long, profile_from_config(long)).context_parallel
    assert chosen in (2, 4)
    # the degree below does not fit: that is why it was not taken
    below = config_from_dict({**copy.deepcopy(d), "cluster": {**d["cluster"], "context_parallel": chosen // 2}})
    with pytest.raises(UserError):
        plan_job(below, profile_from_config(below), ["n0", "n1", "n2"])
    lines = []
    planned = plan_job(long, profile_from_config(long), ["n0", "n1", "n2"], progress=lines.append).plan
    assert f"cluster.context_parallel: auto chose {chosen}" in lines
    assert all(s.context_parallel and len(s.gpus) == chosen for p in planned.pipelines for s in p.template.stages)


@pytest.mark.parametrize(
    ("cluster", "message"),
    [
        ({"context_parallel": "sometimes"}, "cluster.context_parallel: must be 1, 2, 4, 8 or auto"),
        (
            {"context_parallel": "auto", "gpus_per_node": 2, "max_gpus_per_stage": 2},
            r"cluster.context_parallel \(auto\) \(it may choose a degree above 1\) and cluster.max_gpus_per_stage",
        ),
    ],
)
def test_bad_auto_settings_name_the_field(cluster, message):
    d = text_job(**cluster)
    with pytest.raises(ConfigError, match=message):
        config_from_dict(d)


def test_the_mapping_counts_a_context_parallel_pipelines_stages_not_its_gpus():
    """Under 1F1B a stage keeps a microbatch in flight per stage from it to the end. Building from the back the
    DP knows the GPUs after a stage: on lanes of four, eight GPUs after are two stages (three microbatches in
    flight), where a pipeline of one-GPU stages could have eight (nine). Counting GPUs made a two-node pipeline
    of lanes keep five microbatches' activations on its first stage, and refused samples it holds."""
    from oobleck_mm.planning.stage_tables import _CostTables

    job = config_from_dict(text_job(gpus_per_node=4, context_parallel=4))
    profile = profile_from_config(job)
    lanes = _CostTables(profile, ClusterSpec.from_config(job.cluster))
    plain = _CostTables(profile, ClusterSpec(gpus_per_node=4, device_memory_bytes=10**9))
    assert lanes.in_flight(8)[0] == 3 and lanes.in_flight(4)[0] == 2 and lanes.in_flight(0)[0] == 1
    assert plain.in_flight(8)[0] == min(9, 1 + profile.num_layers)
    assert lanes.in_flight(8)[-1] == 1  # a stage ending at the last layer is the last stage
