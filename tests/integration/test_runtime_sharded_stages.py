"""Stages of several GPUs (FSDP2 over the stage's ranks) train exactly as the reference trainer (issue 28).

One OS process per rank, real gloo groups, 5 steps of the tiny multimodal model in
float64 against the single-process reference: every layer of every replica (a
sharded one gathered whole) within 1e-10 and the same losses. Each plan puts a
sharded stage next to one-GPU stages of another pipeline, so the cross-pipeline
sum runs over the common refinement of different shard layouts
(``grad_sync.piece_sums``), and the norm counts every row once. The data has
samples without images (~30%), so some ranks of a sharded stage run pieces without
images while their peers have them: the FSDP2 collectives must still pair up
(``model/graph.py``).
"""

from __future__ import annotations

import dataclasses

import pytest

from oobleck_mm.planning.layout import ExecutionPlan
from oobleck_mm.runtime.worker import run_local
from test_runtime_equivalence import STEPS, max_param_diff, reference, tiny_job

pytestmark = pytest.mark.integration

PLANS = {
    # name: (stages per pipeline, microbatches per pipeline, GPUs of each stage, microbatch size, job change)
    "2-GPU first stage + three 1-GPU stages": ([2, 3], [4, 4], [[2, 1], [1, 1, 1]], 2, {}),
    "2-GPU LLM stage, frozen vision, each pipeline sharded elsewhere": (
        [2, 2],
        [4, 4],
        [[2, 1], [1, 2]],
        2,
        {"frozen": ("vision",)},
    ),
    "4-GPU stage next to 2-GPU stages": ([2, 2], [2, 2], [[4, 1], [2, 2]], 4, {}),
    "2-GPU stage with the balancer": ([2, 2], [4, 4], [[2, 1], [1, 1]], 2, {"balance": True}),
    "2-GPU stages at ZeRO stage 2 (parameters kept gathered to the backward)": (
        [2, 2],
        [4, 4],
        [[2, 1], [1, 2]],
        2,
        {"zero_stage": 2},
    ),
    # float32 reduces through another FSDP2 path (gloo refused its PREMUL_SUM: every float64 case passed)
    "2-GPU stage in float32": ([2, 2], [4, 4], [[2, 1], [1, 1]], 2, {"dtype": "float32"}),
}


def _job(microbatch_size: int, change: dict):
    job = tiny_job(change.get("dtype", "float64"), frozen=change.get("frozen", ()))
    job = dataclasses.replace(
        job,
        training=dataclasses.replace(
            job.training, microbatch_size=microbatch_size, zero_stage=change.get("zero_stage", 3)
        ),
    )
    if change.get("balance"):
        job = dataclasses.replace(job, balance=dataclasses.replace(job.balance, enabled=True))
    return job


@pytest.mark.parametrize("name", list(PLANS))
def test_a_sharded_stage_trains_as_the_reference_in_float64(name, tmp_path):
    stages, microbatches, widths, microbatch_size, change = PLANS[name]
    job = _job(microbatch_size, change)
    trainer, ref_losses = reference(job)
    plan = ExecutionPlan.even(len(trainer.specs), stages, microbatches, microbatch_size, widths=widths)
    assert plan.sharded and plan.global_batch == job.training.global_batch
    outs = run_local(job, plan, STEPS, tmp_path, timeout_s=240)
    assert len(outs) == plan.world_size
    for layer, spec in enumerate(trainer.specs):  # every rank of a stage holds the layer (its shard)
        holders = [r for r, out in enumerate(outs) if spec.name in out["states"]]
        assert holders == sorted(r for ranks in plan.shard_holders(layer) for r in ranks), spec.name
    float32 = change.get("dtype") == "float32"  # reduction order shows: the bound of the float32 equivalence tests
    assert max_param_diff(outs, trainer) < (1e-5 if float32 else 1e-10)
    for out in outs:
        assert out["losses"] == pytest.approx(ref_losses, abs=1e-5 if float32 else 1e-12)
    assert ref_losses[-1] < ref_losses[0]
    if change.get("balance"):  # the balancer made some of the sharded pipeline's microbatches of 1 sample:
        # a piece without samples ran a filler (loss weight 0) on one rank of the 2-GPU stage
        sharded = plan.pipelines[0]
        sizes = [len(mb) for r in outs[0]["results"] for mb in r.microbatches[: sharded.num_microbatches]]
        assert min(sizes) < sharded.pieces, sizes


CHECKPOINT_CASES = {
    # name: (first plan's stages and GPUs, resumed plan's), microbatch size 2, 16 samples a step
    "written by a 2-GPU stage, resumed on one-GPU stages": (
        ([2, 2], [4, 4], [[2, 1], [1, 2]]),
        ([2, 3], [4, 4], [[1, 1], [1, 1, 1]]),
    ),
    "written by one-GPU stages, resumed on a 2-GPU stage": (
        ([2, 3], [4, 4], [[1, 1], [1, 1, 1]]),
        ([1, 2], [4, 4], [[2], [1, 2]]),
    ),
}


@pytest.mark.parametrize("name", list(CHECKPOINT_CASES))
def test_a_checkpoint_resumes_on_another_shard_layout_and_the_run_equals_the_reference(name, tmp_path):
    """3 steps, a checkpoint (parameters and AdamW moments, gathered whole from shards), then 2 more on another
    layout from it: equal to 5 uninterrupted reference steps (float64, 1e-10), so nothing of the state was
    lost or misplaced in either direction."""
    (first, second) = CHECKPOINT_CASES[name]
    job = tiny_job()
    trainer, ref_losses = reference(job)
    plans = [
        ExecutionPlan.even(len(trainer.specs), stages, mbs, 2, widths=widths) for stages, mbs, widths in (first, second)
    ]
    checkpoint = tmp_path / "ckpt"
    run_local(job, plans[0], 3, tmp_path / "a", save_final=str(checkpoint), timeout_s=240)
    assert (checkpoint / "meta.json").exists()
    outs = run_local(job, plans[1], 2, tmp_path / "b", resume=str(checkpoint), timeout_s=240)
    assert max_param_diff(outs, trainer) < 1e-10
    for out in outs:
        assert out["losses"] == pytest.approx(ref_losses[3:], abs=1e-12)


def _phase_case(kind: str):
    """(first plan, Phase) of a reconfiguration across shard layouts."""
    from oobleck_mm.runtime.worker import Phase

    first = ExecutionPlan.even(10, [2, 3], [4, 4], 2, widths=[[2, 1], [1, 1, 1]])  # ranks 0+1 | 2 ; 3 | 4 | 5
    if kind == "loss":
        # rank 5's node is lost; the 2-GPU stage's ranks split: rank 0 keeps layers 0-4 whole, rank 1 joins
        # old rank 2 in a 2-GPU stage over 5-9 (copied whole), pipeline 1 re-forms as two stages
        second = ExecutionPlan.even(10, [2, 2], [4, 4], 2, widths=[[1, 2], [1, 1]])
        return first, Phase(second, 2, {0: 0, 1: 1, 2: 2, 3: 3, 4: 4})
    # every rank survives into other layouts, the groups formed in the background as for a join or a notice:
    # rank 0 keeps 0-4 whole; ranks 1+2 and 3+4 become 2-GPU stages over 5-9 and 0-4; rank 5 takes 5-9
    second = ExecutionPlan.even(10, [2, 2], [4, 4], 2, widths=[[1, 2], [2, 1]])
    return first, Phase(second, 2, {r: r for r in range(6)}, prepared=True)


@pytest.mark.parametrize("kind", ["loss", "relayout"])
def test_a_reconfiguration_across_shard_layouts_keeps_every_state_exact(kind, tmp_path):
    """3 steps, then a new plan in the same processes (the survivors gather their shards whole in the new
    generation, the copies run, new 2-GPU stages shard what they hold), then 2 more: equal to 5 reference
    steps (float64, 1e-10) on every rank."""
    job = tiny_job()
    trainer, ref_losses = reference(job)
    first, phase = _phase_case(kind)
    outs = run_local(job, first, 3, tmp_path, phases=[phase], timeout_s=240)
    assert len(outs) == phase.plan.world_size
    assert outs[0]["transfers"][0], "the new plan needs copies"
    assert max_param_diff(outs, trainer) < 1e-10
    for out in outs:
        assert out["losses"][-2:] == pytest.approx(ref_losses[3:], abs=1e-12)


@pytest.mark.parametrize("dtype,master,bound", [("float32", "float64", 1e-9), ("bfloat16", None, 2e-2)])
def test_mixed_precision_on_sharded_stages_equals_the_reference(dtype, master, bound, tmp_path):
    """FSDP2's mixed precision on 2-GPU stages (float64 or float32 master shards, compute in the half type),
    the balancer on: float32 compute with float64 masters equals the reference replaying the groups the
    forwards ran (``StepResult.pieces``: float32 rounds per group) to 1e-9, as one-GPU stages do; bfloat16 to
    bf16's precision. Every state handed back is in the master dtype."""
    import torch

    from oobleck_mm.runtime.reference import ReferenceTrainer
    from test_runtime_mixed_precision import compare_states
    from test_runtime_mixed_precision import job as mixed_job

    job = mixed_job(dtype, master)
    trainer = ReferenceTrainer(job)
    plan = ExecutionPlan.even(len(trainer.specs), [2, 2], [4, 4], 2, widths=[[2, 1], [1, 2]])
    outs = run_local(job, plan, 4, tmp_path, timeout_s=240)
    ref_losses = [trainer.train_step(r.step, r.pieces) for r in outs[0]["results"]]
    assert any(len(p) < 2 for r in outs[0]["results"] for p in r.pieces), "some microbatches ran as pieces"
    worst, dtypes = compare_states(outs, trainer)
    assert dtypes == {torch.float64 if master == "float64" else torch.float32}
    assert worst <= bound, worst
    assert outs[0]["losses"] == pytest.approx(ref_losses, abs=bound)


@pytest.mark.parametrize("text,vision", [("llama", "clip"), ("mistral", "siglip")])
def test_a_hugging_face_llava_on_sharded_stages_equals_the_reference(text, vision, tmp_path):
    """``transformers``' own modules (CLIP/SigLIP towers, Llama/Mistral decoder layers) sharded by FSDP2 on 2-GPU
    stages next to one-GPU stages, float64, 4 steps: equal to the reference (1e-10)."""
    pytest.importorskip("transformers")
    from oobleck_mm.model.tiny_hf import make_tiny_model
    from oobleck_mm.runtime.reference import ReferenceTrainer
    from test_runtime_huggingface import STEPS as HF_STEPS
    from test_runtime_huggingface import hf_job

    job = hf_job(make_tiny_model(tmp_path / "model", text, vision, tie=False), True)
    trainer = ReferenceTrainer(job)
    ref_losses = [loss for _, loss in trainer.train(HF_STEPS)]
    layers = len(trainer.specs)
    plan = ExecutionPlan.even(layers, [2, 2], [2, 2], 2, widths=[[2, 1], [1, 2]])
    outs = run_local(job, plan, HF_STEPS, tmp_path / "run", timeout_s=240)
    assert max_param_diff(outs, trainer) < 1e-10
    for out in outs:
        assert out["losses"] == pytest.approx(ref_losses, abs=1e-12)


@pytest.mark.parametrize(
    "widths",
    [[[2, 1], [1, 2]], [[2, 2], [1, 1]]],
    ids=["embed 2-GPU, head 1/2-GPU", "both sides of one pipeline 2-GPU"],
)
def test_tied_embeddings_on_sharded_stages_equal_the_reference(widths, tmp_path):
    """A Qwen2 LLaVA (SigLIP tower) whose LM head is tied to its token embedding: the two gradients are summed
    over the common refinement of every holding stage's rows (``grad_sync.tied_pieces``), the embedding's
    first holder and the head's contributing; float64 equal to the reference, whose tie is one parameter."""
    pytest.importorskip("transformers")
    from oobleck_mm.model.tiny_hf import make_tiny_model
    from oobleck_mm.runtime.reference import ReferenceTrainer
    from test_runtime_huggingface import STEPS as HF_STEPS
    from test_runtime_huggingface import hf_job

    job = hf_job(make_tiny_model(tmp_path / "model", "qwen2", "siglip", tie=True), True, balance=True)
    trainer = ReferenceTrainer(job)
    ref_losses = [loss for _, loss in trainer.train(HF_STEPS)]
    plan = ExecutionPlan.even(len(trainer.specs), [2, 2], [2, 2], 2, widths=widths)
    outs = run_local(job, plan, HF_STEPS, tmp_path / "run", timeout_s=240)
    assert max_param_diff(outs, trainer) < 1e-10
    for out in outs:
        assert out["losses"] == pytest.approx(ref_losses, abs=1e-12)


def test_a_float16_overflow_on_a_rank_of_a_sharded_stage_skips_the_step_everywhere(tmp_path, monkeypatch):
    """fp16 loss scaling over FSDP2's shards: an inf in rank 1's shard (the second GPU of a 2-GPU stage) at
    step 2 shows in the all-reduced norm, every rank skips that step and halves the scale, as the reference."""
    from oobleck_mm.runtime.mixed import OVERFLOW_ENV
    from oobleck_mm.runtime.reference import ReferenceTrainer
    from test_runtime_mixed_precision import fp16_job

    monkeypatch.setenv(OVERFLOW_ENV, "2@1")
    job = fp16_job()
    plan = ExecutionPlan.even(10, [2, 2], [4, 4], 2, widths=[[2, 1], [1, 2]])
    outs = run_local(job, plan, 4, tmp_path, timeout_s=240)
    trainer = ReferenceTrainer(job)
    ref_losses = [trainer.train_step(r.step, r.pieces) for r in outs[0]["results"]]
    for out in outs:
        assert [r.skipped for r in out["results"]] == [False, False, True, False]
        assert [r.loss_scale for r in out["results"]] == [64.0, 64.0, 64.0, 32.0]
        assert out["losses"] == pytest.approx(ref_losses, abs=2e-2)
    assert max_param_diff(outs, trainer) <= 1e-3


def test_a_scaled_cornstarch_config_trains_on_the_planners_wide_stages_as_the_reference(tmp_path):
    """``configs/cornstarch_mllm_sss.yaml`` scaled to CPU sizes with its structure (vision and audio towers,
    a GQA Llama with tied embeddings, encoders and LLM frozen, only the projectors trained, activation
    checkpointing, microbatches of 4, stages of up to 2 GPUs): the planner's plan for 6 nodes of 2 GPUs has
    2-GPU stages, and 4 steps on it equal the reference in float64."""
    import yaml

    from oobleck_mm.config import config_from_dict
    from oobleck_mm.planning.layout import rank_table
    from oobleck_mm.planning.planner import plan_job
    from oobleck_mm.profiling.load import load_profile
    from oobleck_mm.runtime.reference import ReferenceTrainer

    raw = yaml.safe_load(open("configs/cornstarch_mllm_sss.yaml"))
    raw["model"]["vision"].update(num_layers=2, hidden=32, ffn_hidden=64, num_heads=2)
    raw["model"]["audio"].update(num_layers=2, hidden=32, ffn_hidden=64, num_heads=2)
    raw["model"]["llm"].update(num_layers=4, hidden=64, ffn_hidden=128, num_heads=4, num_kv_heads=2, vocab_size=256)
    raw["data"].update(image_size=56, mean_text_tokens=16, mean_audio_seconds=0.5, max_seq_len=256)
    raw["training"].update(global_batch=16, dtype="float64", steps=4)
    raw["cluster"].update(device="cpu", backend="gloo", gpus_per_node=2, nodes=6, device_memory=3_000_000)
    job = config_from_dict(raw)
    assert job.training.activation_checkpointing and job.cluster.max_gpus_per_stage == 2
    planned = plan_job(job, load_profile(job), [f"node{i}" for i in range(6)]).plan
    plan = ExecutionPlan.from_plan(planned, rank_table(planned))
    assert plan.sharded, plan.describe()
    assert all(s.recompute for p in plan.pipelines for s in p.stages)  # activation_checkpointing: true
    trainer = ReferenceTrainer(job)
    ref_losses = [loss for _, loss in trainer.train(4)]
    outs = run_local(job, plan, 4, tmp_path, timeout_s=240)
    assert max_param_diff(outs, trainer) < 1e-10
    assert all(r.recomputed > 0 for out in outs for r in out["results"])  # on FSDP2 stages too
    for out in outs:
        assert out["losses"] == pytest.approx(ref_losses, abs=1e-12)


def test_a_model_builder_model_on_sharded_stages_equals_the_reference(tmp_path):
    """``examples/custom_model.py`` (the user's own layers: an attention-free conv LM from ``model.builder``) on
    2-GPU stages: FSDP2 shards any ``nn.Module``, float64 equal to the reference."""
    from oobleck_mm.runtime.reference import ReferenceTrainer
    from test_runtime_huggingface import STEPS as HF_STEPS
    from test_runtime_huggingface import builder_job

    job = builder_job()
    trainer = ReferenceTrainer(job)
    ref_losses = [loss for _, loss in trainer.train(HF_STEPS)]
    plan = ExecutionPlan.even(len(trainer.specs), [2, 2], [2, 2], 2, widths=[[2, 1], [1, 2]])
    outs = run_local(job, plan, HF_STEPS, tmp_path, timeout_s=240)
    assert max_param_diff(outs, trainer) < 1e-10
    for out in outs:
        assert out["losses"] == pytest.approx(ref_losses, abs=1e-12)
