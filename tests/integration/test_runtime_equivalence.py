"""The engine equals the single-process reference trainer, whatever the pipelines (real gloo processes).

Each case trains the tiny multimodal model for 5 steps with one OS process per
rank and compares every layer of every replica with the reference trainer, in
float64 so reduction-order noise (1e-15) cannot hide a logic error.
"""

from __future__ import annotations

import pytest
import torch
import yaml

from oobleck_mm.config import config_from_dict
from oobleck_mm.model.layers import build_layer, model_layer_specs
from oobleck_mm.runtime.reference import ReferenceTrainer
from oobleck_mm.planning.layout import ExecutionPlan
from oobleck_mm.runtime.worker import run_local

pytestmark = pytest.mark.integration
STEPS = 5


def tiny_job(dtype: str = "float64", frozen: tuple[str, ...] = ()):
    with open("configs/tiny_mm.yaml") as f:
        d = yaml.safe_load(f)
    d["training"]["dtype"] = dtype
    d["training"]["steps"] = STEPS
    d["model"]["frozen"] = list(frozen)
    return config_from_dict(d)


def reference(job):
    trainer = ReferenceTrainer(job)
    losses = [loss for _, loss in trainer.train(STEPS)]
    return trainer, losses


def max_param_diff(outs, trainer) -> float:
    names = [s.name for s in trainer.specs]
    worst = 0.0
    for out in outs:
        for name, state in out["states"].items():
            ref = trainer.layer_state(names.index(name))
            for key, value in state.items():
                worst = max(worst, (value - ref[key]).abs().max().item())
    return worst


def every_layer_held(outs, plan: ExecutionPlan, trainer) -> None:
    held = [name for out in outs for name in out["states"]]
    for layer in range(plan.num_layers):
        assert held.count(trainer.specs[layer].name) == len(plan.pipelines)


@pytest.fixture(scope="module")
def ref64():
    return reference(tiny_job())


PLANS = {
    "1 pipeline x 4 stages": ([4], [8], None),
    # The planner's per-stage recomputation: each pipeline recomputes on some stages and keeps on others.
    "2-stage + 3-stage, recomputing on some stages": ([2, 3], [4, 4], [[True, False], [False, True, True]]),
    "1 + 1 + 2 stages": ([1, 1, 2], [3, 3, 2], None),
}


@pytest.mark.parametrize("name", list(PLANS))
def test_float64_equals_reference(name, ref64, tmp_path):
    job = tiny_job()
    trainer, ref_losses = ref64
    stages, microbatches, recompute = PLANS[name]
    plan = ExecutionPlan.even(
        len(trainer.specs), stages, microbatches, job.training.microbatch_size, recompute=recompute
    )
    outs = run_local(job, plan, STEPS, tmp_path)
    every_layer_held(outs, plan, trainer)
    # Recomputation ran exactly on the stages the plan said, once per layer forward, and nowhere else.
    for rank, out in enumerate(outs):
        stage, microbatches = plan.stage(rank), plan.pipelines[plan.position(rank)[0]].num_microbatches
        expected = len(stage.layers) * microbatches if stage.recompute else 0
        assert [r.recomputed for r in out["results"]] == [expected] * STEPS, (rank, stage)
    assert max_param_diff(outs, trainer) < 1e-10
    for out in outs:  # the all-reduced loss is the global batch's, on every rank
        assert out["losses"] == pytest.approx(ref_losses, abs=1e-12)
    assert ref_losses[-1] < ref_losses[0]


def test_float32_within_1e_5(tmp_path):
    job = tiny_job("float32")
    trainer, ref_losses = reference(job)
    plan = ExecutionPlan.even(len(trainer.specs), [2, 3], [4, 4], job.training.microbatch_size)
    outs = run_local(job, plan, STEPS, tmp_path)
    assert max_param_diff(outs, trainer) < 1e-5
    assert outs[0]["losses"] == pytest.approx(ref_losses, abs=1e-5)


def test_frozen_vision_encoder(tmp_path):
    job = tiny_job(frozen=("vision",))
    trainer, ref_losses = reference(job)
    specs = model_layer_specs(job)
    vision = [i for i, s in enumerate(specs) if s.name.startswith(("vision.embed", "vision.block"))]
    assert vision, "tiny_mm must have a vision encoder"
    # 2-stage pipeline: its first stage is entirely frozen vision layers
    plan = ExecutionPlan.even(len(specs), [3, 2], [4, 4], job.training.microbatch_size)
    outs = run_local(job, plan, STEPS, tmp_path)
    assert max_param_diff(outs, trainer) < 1e-10
    initial = {specs[i].name: build_layer(job, i, specs).state_dict() for i in vision}
    for out in outs:
        for name, state in out["states"].items():
            if name in initial:  # never changed
                assert all(torch.equal(state[k], initial[name][k]) for k in state)
        assert not set(out["optimizer_state_sizes"]) & set(initial), "a frozen layer got optimizer state"
    trained = [n for out in outs for n in out["optimizer_state_sizes"]]
    assert "vision.projector" in trained and "llm.head" in trained


def test_audio_and_vision_model_equals_reference(tmp_path):
    """Both encoders' states cross stage boundaries (the activation tuple carries two tensors)."""
    with open("configs/tiny_mm_audio.yaml") as f:
        d = yaml.safe_load(f)
    d["training"].update(dtype="float64", steps=3)
    job = config_from_dict(d)
    trainer = ReferenceTrainer(job)
    ref_losses = [loss for _, loss in trainer.train(3)]
    mbs = job.training.global_batch // job.training.microbatch_size
    plan = ExecutionPlan.even(len(trainer.specs), [3, 2], [mbs // 2, mbs - mbs // 2], job.training.microbatch_size)
    outs = run_local(job, plan, 3, tmp_path)
    assert max_param_diff(outs, trainer) < 1e-10
    assert outs[0]["losses"] == pytest.approx(ref_losses, abs=1e-12)


def test_saved_run_verifies_against_the_reference(tmp_path, capsys):
    """--save-final writes each layer once; `python -m oobleck_mm.verify` replays and compares."""
    from oobleck_mm import verify
    from oobleck_mm.runtime.checkpoint_meta import read_meta

    job = tiny_job()
    plan = ExecutionPlan.even(10, [2, 3], [4, 4], job.training.microbatch_size)
    config = tmp_path / "job.yaml"
    with open("configs/tiny_mm.yaml") as f:
        d = yaml.safe_load(f)
    d["training"].update(dtype="float64", steps=3)
    config.write_text(yaml.safe_dump(d))
    run_local(config_from_dict(d), plan, 3, tmp_path / "out", save_final=str(tmp_path / "final"))
    meta = read_meta(tmp_path / "final")
    assert meta["step"] == 3 and len(list((tmp_path / "final" / "layers").glob("*.pt"))) == 10
    assert verify.main(["--config", str(config), "--steps", "3", "--against", str(tmp_path / "final")]) == 0
    assert "within tolerance" in capsys.readouterr().out
    # a different number of steps is a different model: verification must fail
    assert verify.main(["--config", str(config), "--steps", "2", "--against", str(tmp_path / "final")]) == 1
    assert verify.main(["--config", str(tmp_path / "nope.yaml"), "--steps", "2", "--against", "x"]) == 2


def test_one_cycle_schedule_with_momentum_cycling_equals_reference(tmp_path):
    """OneCycle sets lr and Adam's betas every step (DeepSpeed's class): the engine's layers on every
    rank take the same ones as the reference."""
    with open("configs/tiny_mm.yaml") as f:
        d = yaml.safe_load(f)
    d["training"].update(
        dtype="float64",
        steps=STEPS,
        scheduler={
            "type": "OneCycle",
            "params": {
                "cycle_min_lr": 1e-4,
                "cycle_max_lr": 3e-3,
                "cycle_first_step_size": 2,
                "cycle_min_mom": 0.8,
                "cycle_max_mom": 0.95,
            },
        },
    )
    job = config_from_dict(d)
    trainer, ref_losses = reference(job)
    plan = ExecutionPlan.even(len(trainer.specs), [2, 3], [4, 4], job.training.microbatch_size)
    outs = run_local(job, plan, STEPS, tmp_path)
    assert max_param_diff(outs, trainer) < 1e-10
    assert [r.lr for r in outs[0]["results"]] == pytest.approx(
        [1e-4, 1e-4 + 0.5 * 2.9e-3, 3e-3, 1e-4 + 0.5 * 2.9e-3, 1e-4], rel=1e-9
    )


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied_embeddings"])
def test_reference_continues_from_an_engine_checkpoint_as_if_never_stopped(tmp_path, tied):
    """verify --from: the reference loads a run's checkpoint (parameters and Adam moments, a tied head's
    weight held once) and two more steps equal five from the start."""
    with open("configs/tiny_mm.yaml") as f:
        d = yaml.safe_load(f)
    d["training"].update(dtype="float64", steps=3)
    d["model"]["llm"]["tie_embeddings"] = tied
    job = config_from_dict(d)
    plan = ExecutionPlan.even(10, [2, 3], [4, 4], job.training.microbatch_size)
    run_local(job, plan, 3, tmp_path / "out", save_final=str(tmp_path / "at3"))
    resumed = ReferenceTrainer(job)
    assert resumed.load_checkpoint(str(tmp_path / "at3")) == 3
    for step in (3, 4):
        resumed.train_step(step)
    straight = ReferenceTrainer(job)
    for step in range(5):
        straight.train_step(step)
    for i in range(len(straight.specs)):
        for key, value in straight.layer_state(i).items():
            assert torch.allclose(resumed.layer_state(i)[key], value, rtol=0, atol=1e-12), (straight.specs[i].name, key)


def test_a_planned_template_that_recomputes_on_some_stages_equals_the_reference(ref64, tmp_path):
    """``training.activation_checkpointing: auto`` at 4 MB a GPU: the planner's 3-stage template recomputes on
    its first two stages (3 and 2 microbatches in flight) and keeps its activations on the last; the engine
    runs that template as planned, equal to the reference in float64."""
    import dataclasses

    from oobleck_mm.planning.costs import ClusterSpec
    from oobleck_mm.planning.layout import PipelineLayout, StageLayout
    from oobleck_mm.planning.stage_mapping import map_stages
    from oobleck_mm.profiling.analytical import profile_from_config

    trainer, ref_losses = ref64
    job = tiny_job()
    job = dataclasses.replace(job, cluster=dataclasses.replace(job.cluster, device_memory=4_000_000))
    assert job.training.activation_checkpointing == "auto"
    count = job.training.global_batch // job.training.microbatch_size
    template = map_stages(profile_from_config(job), ClusterSpec.from_config(job.cluster), 3, microbatches_hint=count)
    assert [s.recompute for s in template.stages] == [True, True, False]
    stages = tuple(
        StageLayout(k, s.layer_start, s.layer_end, recompute=s.recompute) for k, s in enumerate(template.stages)
    )
    plan = ExecutionPlan((PipelineLayout(stages, count),), template.num_layers, job.training.microbatch_size)
    outs = run_local(job, plan, STEPS, tmp_path)
    assert max_param_diff(outs, trainer) < 1e-10
    assert outs[0]["losses"] == pytest.approx(ref_losses, abs=1e-12)
    assert [out["results"][0].recomputed > 0 for out in outs] == [True, True, False]
