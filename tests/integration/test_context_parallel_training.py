"""A context-parallel pipeline trains the built-in LLM equal to the reference trainer (float64, real gloo processes).

Pipeline 0 splits every microbatch's tokens over two lanes (two stages of two GPUs each, context-parallel:
rank k of each stage holds lane k's 128-token blocks, chosen by Cornstarch's LPT, and gathers the other
lane's keys and values in every attention); pipeline 1 is one ordinary stage. Every layer's copies (two per
context-parallel stage, one in pipeline 1) are summed by the layer-wise all-reduce, so after 3 steps every
rank's layers must equal the single-process reference, and the losses too.
"""

from __future__ import annotations

import copy

import pytest
import yaml

from oobleck_mm.config import config_from_dict
from oobleck_mm.planning.layout import ExecutionPlan
from oobleck_mm.runtime.reference import ReferenceTrainer
from oobleck_mm.runtime.worker import run_local
from test_runtime_equivalence import max_param_diff

pytestmark = pytest.mark.integration
STEPS = 3


def text_job(**training):
    with open("configs/tiny_mm.yaml") as f:
        d = yaml.safe_load(f)
    for part in ("vision", "projector"):
        d["model"].pop(part)
    # ~200-token samples: a microbatch of two spans several 128-token blocks, so both lanes get some.
    d["data"].update(mean_text_tokens=200, max_seq_len=512, mean_images_per_sample=0, max_images_per_sample=0)
    d["training"].update({"dtype": "float64", "steps": STEPS, **training})
    return config_from_dict(d)


def test_a_context_parallel_pipeline_beside_an_ordinary_one_equals_the_reference(tmp_path):
    job = text_job()
    trainer = ReferenceTrainer(job)
    ref_losses = [loss for _, loss in trainer.train(STEPS)]
    layers = len(trainer.specs)
    plan = ExecutionPlan.even(layers, [2, 1], [4, 4], 2, widths=[[2, 2], [1]], context_parallel=[True, False])
    # the lanes shard their layers (FSDP2 over the stage): one copy a pipeline
    assert plan.sharded and plan.holders(0) == (0, 4) and plan.shard_holders(0) == ((0, 1), (4,))
    outs = run_local(job, plan, STEPS, tmp_path, timeout_s=240)
    names = [s.name for s in trainer.specs]
    held = [name for out in outs for name in out["states"]]
    assert sorted(held.count(n) for n in names) == [3] * layers  # each lane gathers its copy whole, pipeline 1's
    for out in outs:
        assert out["losses"] == pytest.approx(ref_losses, abs=1e-12)
    assert max_param_diff(outs, trainer) < 1e-10
    assert ref_losses[-1] < ref_losses[0]
    # Each lane holds its share of its stage's parameters, gradients and moments: the four lanes (ranks 0-3)
    # hold together what pipeline 1's one rank holds whole, each lane about half its stage's.
    held = [out["results"][-1].state_bytes for out in outs]
    assert sum(held[:4]) == held[4]
    for stage in ((0, 1), (2, 3)):
        assert all(held[r] < 0.6 * sum(held[k] for k in stage) for r in stage)


def test_samples_four_times_longer_than_a_stage_holds_train_on_four_lanes_equal_to_the_reference(tmp_path):
    """800-token samples at a memory where no mapping fits them on one GPU a stage (the same as
    tests/unit/test_context_parallel_plan.py's): the planner's template for two nodes of four lanes each,
    run as planned (8 ranks), equal to the reference in float64."""
    from oobleck_mm.errors import UserError
    from oobleck_mm.planning.costs import ClusterSpec
    from oobleck_mm.planning.layout import rank_table
    from oobleck_mm.planning.plan import Plan, PipelineInstance
    from oobleck_mm.planning.stage_mapping import map_stages, min_nodes
    from oobleck_mm.profiling.analytical import profile_from_config

    with open("configs/tiny_mm.yaml") as f:
        d = yaml.safe_load(f)
    for part in ("vision", "projector"):
        d["model"].pop(part)
    d["data"].update(mean_text_tokens=800, max_seq_len=2048, mean_images_per_sample=0, max_images_per_sample=0)
    d["training"].update(dtype="float64", steps=2, global_batch=4, microbatch_size=2)
    d["cluster"].update(nodes=2, gpus_per_node=4, device_memory=6_000_000)
    d["fault_tolerance"]["f"] = 0
    plain = config_from_dict(copy.deepcopy(d))
    with pytest.raises(UserError, match="does not fit"):
        min_nodes(profile_from_config(plain), ClusterSpec.from_config(plain.cluster))
    d["cluster"]["context_parallel"] = 4
    job = config_from_dict(d)
    profile, cluster = profile_from_config(job), ClusterSpec.from_config(job.cluster)
    template = map_stages(profile, cluster, 2, 2)
    planned = Plan((PipelineInstance(template, ("n0", "n1"), 2),), 4, 2, 0.0)
    plan = ExecutionPlan.from_plan(planned, rank_table(planned))
    assert plan.world_size == 8 and all(s.context_parallel and s.width == 4 for s in plan.pipelines[0].stages)
    trainer = ReferenceTrainer(job)
    ref_losses = [loss for _, loss in trainer.train(2)]
    outs = run_local(job, plan, 2, tmp_path / "run", timeout_s=240)
    for out in outs:
        assert out["losses"] == pytest.approx(ref_losses, abs=1e-12)
    assert max_param_diff(outs, trainer) < 1e-10


def test_float32_compute_on_lanes_with_float64_masters_equals_the_reference_in_the_same_mode(tmp_path):
    """The lanes hold their layers' masters sharded and compute in float32 (FSDP2's mixed precision, as a sharded
    stage does: each lane gathers the shards cast to float32, and its gradients are summed over the lanes into
    the float64 master shards). Not to 1e-9 as a chain is (tests/integration/test_runtime_mixed_precision.py):
    the lanes' blocked attention sums in another order, and float32 rounding then differs (1.1e-6 measured;
    the reference's own float32 and float64 runs differ by 2.5e-6). A lane that missed an update, or summed
    only part of the lanes' gradients, is off by the learning rate's order (1e-3)."""
    import torch
    from test_runtime_mixed_precision import compare_states

    job = text_job(dtype="float32", master_dtype="float64")
    trainer = ReferenceTrainer(job)
    plan = ExecutionPlan.even(
        len(trainer.specs), [2, 1], [4, 4], 2, widths=[[2, 2], [1]], context_parallel=[True, False]
    )
    outs = run_local(job, plan, STEPS, tmp_path, timeout_s=240)
    ref_losses = [trainer.train_step(r.step, r.microbatches) for r in outs[0]["results"]]
    worst, dtypes = compare_states(outs, trainer)
    assert dtypes == {torch.float64}, dtypes  # masters are what a lane holds and hands on
    assert worst <= 1e-5, worst
    for out in outs:
        assert out["losses"] == pytest.approx(ref_losses, abs=1e-6)
