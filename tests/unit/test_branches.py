"""Encoder branches on stages of their own (planning/branches.py): the exact time against independent ones,
its bound, the placement choice."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oobleck_mm.planning.branches import BranchedTemplate, lower_bound, parts_of, place, simulate_branched
from oobleck_mm.planning.costs import ClusterSpec, LayerCost, ModelProfile
from oobleck_mm.planning.pipeline_time import iteration_time_1f1b
from oobleck_mm.planning.template import PipelineTemplate, StageSpec


def chain(times, sends, start=0):
    stages = tuple(StageSpec(start + k, start + k + 1, k, (0,), f, b, 0.0) for k, (f, b) in enumerate(times))
    return PipelineTemplate(len(stages), 1, stages, tuple(sends), tuple(sends))


stage_times = st.tuples(st.floats(0.01, 5.0), st.floats(0.0, 10.0))


@settings(max_examples=60, deadline=None)
@given(
    branch=st.lists(stage_times, min_size=1, max_size=4),
    llm=st.lists(stage_times, min_size=1, max_size=4),
    sends=st.lists(st.floats(0.0, 1.0), min_size=8, max_size=8),
    microbatches=st.integers(1, 12),
)
def test_one_branch_is_a_chain_and_takes_the_closed_recurrences_time(branch, llm, sends, microbatches):
    """The instruction-level execution of a branched template with one branch, against the chain recurrence
    (pipeline_time), an independent algorithm held to DeepSpeed's schedule by its own tests."""
    k = len(branch)
    template = BranchedTemplate(
        ("vision",),
        (chain(branch, sends[: k - 1]),),
        chain(llm, sends[k : k + len(llm) - 1], start=k),
        (sends[k - 1],),
        num_nodes=k + len(llm),
    )
    forward = [f for f, _ in branch + llm]
    backward = [b for _, b in branch + llm]
    links = sends[: k - 1] + [sends[k - 1]] + sends[k : k + len(llm) - 1]
    expected = iteration_time_1f1b(forward, backward, links, links, microbatches)
    assert simulate_branched(template, microbatches) == pytest.approx(expected, rel=1e-12, abs=1e-12)


def test_two_branches_of_one_stage_each_overlap_and_the_llm_waits_for_the_slower():
    """One microbatch, no transfer costs: the branches run at once (vision 3 s, audio 1 s forward); the LLM
    starts after the slower (3 s), runs 2 + 4 s, then both branches their backwards (1 s and 0.5 s): 10 s,
    where the chain vision -> audio -> LLM takes 3 + 1 + 2 + 4 + 0.5 + 1 = 11.5 s."""
    template = BranchedTemplate(
        ("vision", "audio"),
        (chain([(3.0, 1.0)], []), chain([(1.0, 0.5)], [], start=1)),
        chain([(2.0, 4.0)], [], 2),
        (0.0, 0.0),
        num_nodes=3,
    )
    assert simulate_branched(template, 1) == pytest.approx(10.0)
    assert iteration_time_1f1b([3.0, 1.0, 2.0], [1.0, 0.5, 4.0], [0, 0], [0, 0], 1) == pytest.approx(11.5)
    # Many microbatches: the slowest stage (the LLM's 6 s a microbatch) sets the pace for both.
    assert simulate_branched(template, 20) == pytest.approx(3.0 + 20 * 6.0 + 1.0)


@settings(max_examples=40, deadline=None)
@given(
    vision=st.lists(stage_times, min_size=1, max_size=3),
    audio=st.lists(stage_times, min_size=1, max_size=3),
    llm=st.lists(stage_times, min_size=1, max_size=3),
    merge=st.tuples(st.floats(0.0, 1.0), st.floats(0.0, 1.0)),
    microbatches=st.integers(1, 10),
)
def test_the_bound_is_below_the_exact_time_and_each_path_alone_is_no_slower(vision, audio, llm, merge, microbatches):
    v, a = len(vision), len(audio)
    template = BranchedTemplate(
        ("vision", "audio"),
        (chain(vision, [0.1] * (v - 1)), chain(audio, [0.1] * (a - 1), start=v)),
        chain(llm, [0.1] * (len(llm) - 1), start=v + a),
        merge,
        num_nodes=v + a + len(llm),
    )
    exact = simulate_branched(template, microbatches)
    assert lower_bound(template, microbatches) <= exact * (1 + 1e-12)
    for path, hop in ((vision, merge[0]), (audio, merge[1])):
        links = [0.1] * (len(path) - 1) + [hop] + [0.1] * (len(llm) - 1)
        alone = iteration_time_1f1b([f for f, _ in path + llm], [b for _, b in path + llm], links, links, microbatches)
        assert exact >= alone * (1 - 1e-12), "a branch beside another can only wait more, never less"


def layer(name, modality, fwd, trainable=True):
    return LayerCost(name, modality, fwd, fwd, fwd, 10**6, 10**6, 2 * 10**6, 10**6, 10**5, trainable)


def profile(vision: int, audio: int, text: int, enc_s: float, llm_s: float) -> ModelProfile:
    layers = (
        [layer(f"vision.block{i}", "vision", enc_s) for i in range(vision)]
        + [layer(f"audio.block{i}", "audio", enc_s) for i in range(audio)]
        + [layer("llm.embed", "text", llm_s)]
        + [layer(f"llm.block{i}", "text", llm_s) for i in range(text)]
    )
    return ModelProfile("m", "test", 1, tuple(layers))


def test_large_encoders_and_few_microbatches_go_to_branches_a_heavy_llm_stays_a_chain():
    cluster = ClusterSpec(gpus_per_node=1, device_memory_bytes=10**12)
    wide = place(profile(8, 8, 1, 1.0, 1.0), cluster, 6, 2)
    assert wide.faster == "branches" and wide.branched_s < wide.chain_s, wide.reason
    assert "vs chain: x" in wide.reason
    assert set(wide.branched.modalities) == {"vision", "audio"}
    # every node used, each GPU once
    gpus = [(s.node, s.gpus) for s in wide.branched.stages]
    assert len(set(gpus)) == len(gpus) and {n for n, _ in gpus} == set(range(6))
    heavy = place(profile(1, 1, 30, 0.1, 1.0), cluster, 6, 40)
    assert heavy.faster == "chain" and heavy.chain_s <= heavy.branched_s, heavy.reason


def test_a_model_without_encoders_or_with_too_few_nodes_has_no_branches_and_says_why():
    cluster = ClusterSpec(gpus_per_node=1, device_memory_bytes=10**12)
    text_only = dataclasses.replace(profile(0, 0, 4, 1.0, 1.0), layers=profile(0, 0, 4, 1.0, 1.0).layers)
    assert place(text_only, cluster, 4, 4).reason == "no branched template: the model has no encoder"
    few = place(profile(2, 2, 2, 1.0, 1.0), cluster, 2, 4)
    assert few.faster == "chain" and "no split of 2 node(s) between vision, audio, text" in few.reason


def test_parts_must_be_contiguous():
    p = profile(2, 2, 2, 1.0, 1.0)
    shuffled = dataclasses.replace(p, layers=(p.layers[0], p.layers[2], p.layers[1], *p.layers[3:]))
    with pytest.raises(ValueError, match="the vision layers are not contiguous"):
        parts_of(shuffled)
    assert parts_of(p) == {"vision": range(0, 2), "audio": range(2, 4), "text": range(4, 7)}


def test_a_part_may_be_planned_in_its_widest_stages_only():
    """``min_gpus_per_stage``: the branch search's shallow variant (and the chain's, for a fair comparison)."""
    roomy = ClusterSpec(gpus_per_node=4, device_memory_bytes=10**12, max_gpus_per_stage=2)
    assert roomy.stage_gpu_options == (1, 2)
    assert dataclasses.replace(roomy, min_gpus_per_stage=2).stage_gpu_options == (2,)
    # above the widest allowed, the widest
    assert dataclasses.replace(roomy, min_gpus_per_stage=8).stage_gpu_options == (2,)


def test_parts_may_share_a_node_in_units_of_its_gpus(monkeypatch):
    """Two nodes of 4 GPUs cannot give three parts a node each; units of 2 GPUs (or 1) can. Every GPU is then
    used once, a stage stays inside its node, and the parts fill both nodes."""
    import oobleck_mm.planning.branches as branches

    cluster = ClusterSpec(gpus_per_node=4, device_memory_bytes=10**12, max_gpus_per_stage=2)
    shared = place(profile(4, 4, 4, 1.0, 1.0), cluster, 2, 2)
    assert shared.branched is not None, shared.reason
    used = [(s.node, g) for s in shared.branched.stages for g in s.gpus]
    assert len(set(used)) == len(used) == 8
    assert {n for n, _ in used} == {0, 1} and all(0 <= g < 4 for _, g in used)
    # two parts on one node: only units smaller than a node place them so
    part_nodes = [{s.node for s in part.stages} for part in (*shared.branched.branches, shared.branched.llm)]
    assert any(a & b for i, a in enumerate(part_nodes) for b in part_nodes[i + 1 :]), part_nodes
    monkeypatch.setattr(branches, "MAX_GPU_SPLIT", 0)  # whole nodes only
    assert "no split of 2 node(s)" in place(profile(4, 4, 4, 1.0, 1.0), cluster, 2, 2).reason


@pytest.mark.parametrize(
    "gpus_per_node,nodes,lanes",
    [(1, 4, 1), (2, 5, 1), (2, 5, 2)],
    ids=["one-GPU-nodes", "stages-of-two-GPUs", "context-parallel-lanes"],
)
def test_placement_auto_builds_branched_templates_where_faster_and_plans_run_them(gpus_per_node, nodes, lanes):
    """``planning.placement: auto``: ``with_branches`` keeps, per node count, ``build_templates``' chain or the
    runnable branched template, whichever is faster; the plan's layout carries the branches. With two GPUs a
    node and stages of up to two, the 3-node branched template's LLM stage spans both GPUs of its node (each
    taking one sample of a microbatch), and the 5-node plan runs it; with two context-parallel lanes every
    stage of a branched template is two lanes wide."""
    import yaml

    from oobleck_mm.config import config_from_dict
    from oobleck_mm.planning.branches import as_branched, with_branches
    from oobleck_mm.planning.layout import ExecutionPlan, rank_table
    from oobleck_mm.planning.planner import plan_job
    from oobleck_mm.planning.stage_mapping import build_templates, planning_cluster
    from oobleck_mm.profiling.analytical import profile_from_config

    with open("configs/tiny_mm_audio.yaml") as f:
        raw = yaml.safe_load(f)
    raw["model"]["vision"]["num_layers"] = raw["model"]["audio"]["num_layers"] = 4
    raw["model"]["llm"]["num_layers"] = 2
    raw["cluster"].update(nodes=nodes, device_memory="64MB", gpus_per_node=gpus_per_node)
    raw["cluster"].update(max_gpus_per_stage=gpus_per_node // lanes, context_parallel=lanes)
    raw["training"].update(global_batch=4, microbatch_size=2)
    raw["planning"] = {"placement": "auto", "microbatches_hint": 1}
    job = config_from_dict(raw)
    profile = profile_from_config(job)
    cluster = planning_cluster(job, profile)
    assert cluster.placement == "auto"
    chain = build_templates(profile, cluster, nodes, 1, microbatches_hint=1)
    auto = with_branches(chain, profile, cluster, nodes, microbatches_hint=1)
    assert not any(t.branched for t in chain.templates)
    branched = [t for t in auto.templates if t.branched]
    assert branched, [t.describe() for t in auto.templates]
    for t in branched:
        same = chain.for_nodes(t.num_nodes)
        assert t.iteration_time(1) < same.iteration_time(1)  # kept only where faster
        assert t.iteration_time(3) == pytest.approx(as_branched(t).iteration_time(3))
        assert "|| " in t.describe() and "=> " in t.describe()
    assert any(len(s.gpus) == 2 for t in branched for s in t.stages) == (gpus_per_node == 2)
    assert all(s.context_parallel == (lanes > 1) for t in branched for s in t.stages)
    outcome = plan_job(job, profile, [f"node{i}" for i in range(nodes)])
    layout = ExecutionPlan.from_plan(outcome.plan, rank_table(outcome.plan))
    [planned] = [p for p in layout.pipelines if p.branched]  # a 3-node (4-node with lanes) branched pipeline
    assert (planned.pieces == 2) == (gpus_per_node == 2), layout.describe()
