"""Encoder branches in the runtime (issue 49 item 3, first part): a pipeline whose vision and audio encoders run
on stages of their own, concurrently, feeding the LLM's first stage, beside an ordinary chain pipeline; real
gloo processes, float64, equal to the reference trainer (one process, the whole model in layer order).

The merge stage receives every branch's outputs in branch order and sends each branch its gradients back
(only to a branch that trains); each stage walks DeepSpeed's ``TrainSchedule`` for its distance to the end
(``PipelineLayout.schedule_position``), as ``planning.branches.simulate_branched`` times it. The plans here
are written by hand (``ExecutionPlan``); the planner's branched templates run in tests/e2e/test_encoder_branches.py.
"""

from __future__ import annotations

import pytest
import torch
import yaml

from oobleck_mm.config import config_from_dict
from oobleck_mm.model.layers import model_layer_specs
from oobleck_mm.planning.layout import ExecutionPlan, PipelineLayout, StageLayout
from oobleck_mm.runtime.reference import ReferenceTrainer
from oobleck_mm.runtime.worker import run_local

pytestmark = pytest.mark.integration
STEPS = 3


def audio_job(training=None, balance=None, data=None, **model):
    with open("configs/tiny_mm_audio.yaml") as f:
        d = yaml.safe_load(f)
    d["model"].update(model)
    d["data"].update(data or {})
    if balance is not None:
        d["balance"] = balance
    d["training"].update(
        {"dtype": "float64", "steps": STEPS, "global_batch": 8, "microbatch_size": 2, **(training or {})}
    )
    return config_from_dict(d)


def branched_plan(job, vision_stages: int, widths: tuple[int, ...] = (), lanes: bool = False) -> ExecutionPlan:
    """Pipeline 0: the vision branch on ``vision_stages`` stages, the audio branch on one, the LLM on two, of
    ``widths`` GPUs each (default one; ``lanes``: context-parallel); pipeline 1: a chain of two stages. Two
    microbatches each."""
    specs = model_layer_specs(job)
    names = [s.name for s in specs]
    audio = names.index("audio.embed")
    llm = names.index("llm.embed")
    mid = (llm + len(specs)) // 2
    cuts = [round(k * audio / vision_stages) for k in range(vision_stages + 1)]
    bounds = [*zip(cuts, cuts[1:]), (audio, llm), (llm, mid), (mid, len(specs))]
    stages, r = [], 0
    for (start, end), width in zip(bounds, widths or (1,) * len(bounds), strict=True):
        stages.append(StageLayout(r, start, end, shards=tuple(range(r + 1, r + width)), context_parallel=lanes))
        r += width
    branched = PipelineLayout(tuple(stages), 2, branches=(0, vision_stages), merge=vision_stages + 1)
    half = len(specs) // 2
    chain = PipelineLayout((StageLayout(r, 0, half), StageLayout(r + 1, half, len(specs))), 2)
    return ExecutionPlan((branched, chain), len(specs), job.training.microbatch_size)


def equal_to_reference(job, plan, tmp_path):
    trainer = ReferenceTrainer(job)
    ref_losses = [loss for _, loss in trainer.train(STEPS)]
    names = [s.name for s in trainer.specs]
    outs = run_local(job, plan, STEPS, tmp_path)
    worst = 0.0
    for out in outs:
        assert out["losses"] == pytest.approx(ref_losses, abs=1e-12)
        for name, state in out["states"].items():
            ref = trainer.layer_state(names.index(name))
            worst = max(worst, max((v - ref[k]).abs().max().item() for k, v in state.items()))
    assert worst < 1e-10, worst
    assert ref_losses[-1] < ref_losses[0]
    return outs


@pytest.mark.parametrize(
    "vision_stages,widths,lanes",
    [(1, (2, 1, 2, 1), False), (2, (), False), (1, (2, 2, 2, 2), True)],
    ids=["branches-of-one-stage-some-of-two-GPUs", "a-deeper-vision-branch", "context-parallel-lanes"],
)
def test_branches_beside_a_chain_equal_the_reference(tmp_path, vision_stages, widths, lanes):
    """With stages of two GPUs (the vision branch's and the merge stage, FSDP2 over each, the audio branch on
    one GPU): each microbatch runs as two pieces of one sample, the merge stage's rank ``k`` takes piece ``k``
    from the vision rank ``k`` and from the audio rank, which sends its two pieces to two ranks, and sends
    each its gradients back. A piece delivered to the wrong rank, or its gradient to the wrong branch, would
    hang the step or train other samples than the reference. With two context-parallel lanes on every stage:
    each branch's lane runs its encoder on the whole media and sends it to the merge stage's lane of the same
    index, which keeps its own blocks of the sequence after the token embedding and sends back the gradient
    of its blocks' share; the lanes' sums make the encoders' update the reference's."""
    job = audio_job()
    plan = branched_plan(job, vision_stages, widths, lanes)
    assert plan.pipelines[0].neighbours(vision_stages + 1)[0] == (vision_stages - 1, vision_stages)
    assert " || " in plan.describe() and " => " in plan.describe()
    assert plan.sharded == bool(widths)
    outs = equal_to_reference(job, plan, tmp_path / "run")
    assert len(outs) == plan.world_size


def test_a_frozen_branch_gets_no_gradient_and_the_other_trains(tmp_path):
    """The vision tower and its projector frozen (the whole branch): the merge stage sends gradients to the audio branch only (the
    vision branch waits for none; the audio branch waits for its own: a send missing would hang the step), and
    the update is the reference's. The merge stage sends exactly the vision outputs' gradients less than when
    every branch trains."""
    frozen, trained = audio_job(frozen=["vision", "vision.projector"]), audio_job()
    plan = branched_plan(frozen, 1)
    merge = plan.pipelines[0].stages[plan.pipelines[0].merge].rank
    sent = {}
    for name, job in (("frozen", frozen), ("trained", trained)):
        outs = equal_to_reference(job, plan, tmp_path / name)
        sent[name] = sum(r.bytes_sent for r in outs[merge]["results"])
    vision_tokens_bytes = sent["trained"] - sent["frozen"]
    assert vision_tokens_bytes > 0 and sent["frozen"] > 0, sent  # the audio branch still gets its gradients


@pytest.mark.parametrize(
    "dtype,master,tolerance",
    [("float32", "float64", 1e-9), ("bfloat16", "float32", 1e-3)],
    ids=["float32-compute-float64-masters", "bfloat16-compute-float32-masters"],
)
def test_mixed_precision_on_branches_equals_the_reference_in_the_same_mode(tmp_path, dtype, master, tolerance):
    """The branches send their outputs in the compute dtype, the merge stage sends their gradients back in it,
    and every stage accumulates into its masters: the update is the reference's running the same mode (float32
    compute with float64 masters to 1e-9, as tests/integration/test_runtime_mixed_precision.py holds chains;
    bfloat16 at its precision). A branch whose gradients came back in another dtype, or not accumulated into
    its masters, would be off by far more."""
    from test_runtime_mixed_precision import compare_states

    job = audio_job({"dtype": dtype, "master_dtype": master})
    plan = branched_plan(job, 2)
    trainer = ReferenceTrainer(job)
    outs = run_local(job, plan, STEPS, tmp_path)
    ref_losses = [trainer.train_step(r.step, r.microbatches) for r in outs[0]["results"]]
    worst, dtypes = compare_states(outs, trainer)
    assert dtypes == {getattr(torch, master)}, dtypes  # masters are what a stage holds and hands on
    assert worst <= tolerance, worst
    assert outs[0]["losses"] == pytest.approx(ref_losses, abs=1e-9 if dtype == "float32" else 2e-2)


def test_the_balancer_places_samples_on_branches_beside_a_chain_and_the_update_is_the_references(tmp_path):
    """With the balancer on (its threshold 0: it always places), a branched pipeline and a chain take the samples
    it assigns them (priced with the branches concurrent: ``balance.problem``), every rank the same, and the
    update is the reference's: the placement moves samples, never changes what is learnt. Some step's
    assignment must differ from the contiguous split, or the balancer was not exercised."""
    from oobleck_mm.balance.assignment import contiguous_assignment
    from oobleck_mm.data.loader import TrainingData

    job = audio_job(balance={"enabled": True, "threshold": 0.0, "fit_every": 2})
    plan = branched_plan(job, 1)
    outs = equal_to_reference(job, plan, tmp_path)
    data = TrainingData(job)
    counts = [p.num_microbatches for p in plan.pipelines]
    moved = 0
    for result in outs[0]["results"]:
        contiguous = contiguous_assignment(data.global_batch(result.step), counts, plan.microbatch_size)
        ran = result.microbatches
        assert all(o["results"][result.step].microbatches == ran for o in outs)  # every rank the same
        moved += tuple(tuple(sorted(mb)) for p in contiguous.pipelines for mb in p) != tuple(
            map(tuple, map(sorted, ran))
        )
    assert moved, "the balancer kept the contiguous split at every step"
    assert outs[0]["balancer"]["metrics"]["predicted_imbalance"] >= 1.0


def test_deferral_on_a_branched_pipeline_equals_the_reference(tmp_path):
    """Entrain's deferral with the encoders as branches: each branch runs slot k's kept and deferred samples as
    two groups, the merge stage splits every branch's message into them, holds the deferred group's outputs a
    slot, runs the LLM on ``kept_k + D_{k-1}``, and sends each branch the gradients of its own part of the
    groups the backward reached, group after group. Nearly every sample has images (and audio), so deferred
    samples carry encoder work: a gradient sent to the wrong branch or group would change the update (or hang
    the step). The one pipeline is branched, so a deferral counted is its own."""
    import dataclasses

    job = audio_job(
        {"global_batch": 16},
        balance={"enabled": True, "threshold": 0.0, "fit_every": 2, "deferral": True},
        data={"mean_images_per_sample": 2.7},
    )
    two = branched_plan(job, 1)
    plan = dataclasses.replace(two, pipelines=(dataclasses.replace(two.pipelines[0], num_microbatches=8),))
    outs = equal_to_reference(job, plan, tmp_path)
    assert sum(r.deferred for r in outs[0]["results"]) > 0, "no step deferred: the regrouping went unexercised"
