"""HuggingFace models and tied embeddings in the engine equal the reference trainer (real gloo processes).

The reference trainer holds a tied embedding as *one* parameter (the unsplit
model's way: autograd sums both uses); the engine holds a copy on the head's
stage and sums the two gradients between holders each step. Float64, pipelines
of different depths with the embedding and the head on different stages.
"""

from __future__ import annotations

import pytest
import torch
import yaml

from oobleck_mm.config import config_from_dict
from oobleck_mm.model.layers import model_layer_specs
from oobleck_mm.planning.layout import ExecutionPlan
from oobleck_mm.runtime.reference import ReferenceTrainer
from oobleck_mm.runtime.worker import run_local

pytest.importorskip("transformers")
from oobleck_mm.model.tiny_hf import make_tiny_model, make_tiny_parts  # noqa: E402

pytestmark = pytest.mark.integration
STEPS = 4


def hf_job(directory, multimodal: bool, balance: bool = False):
    """``directory``: an HF model directory, or a composition's parts ``{vision, llm, projector}``."""
    data = {"mean_text_tokens": 16, "max_seq_len": 96, "num_samples": 256}
    if multimodal:
        data.update(mean_images_per_sample=1, max_images_per_sample=2, image_size=32)
    return config_from_dict(
        {
            "model": {"huggingface": directory if isinstance(directory, dict) else str(directory)},
            "data": data,
            "balance": {"enabled": balance},
            "training": {
                "global_batch": 8,
                "microbatch_size": 2,
                "dtype": "float64",
                "steps": STEPS,
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            },
        }
    )


def compare(job, stages, tmp_path):
    trainer = ReferenceTrainer(job)
    ref_losses = [loss for _, loss in trainer.train(STEPS)]
    specs = trainer.specs
    plan = ExecutionPlan.even(len(specs), stages, [2, 2], job.training.microbatch_size)
    outs = run_local(job, plan, STEPS, tmp_path)
    names = [s.name for s in specs]
    worst = 0.0
    for out in outs:
        for name, state in out["states"].items():
            ref = trainer.layer_state(names.index(name))
            worst = max(worst, max((v - ref[k]).abs().max().item() for k, v in state.items()))
        assert out["losses"] == pytest.approx(ref_losses, abs=1e-12)
    assert worst < 1e-10
    assert ref_losses[-1] < ref_losses[0]
    return outs


@pytest.mark.parametrize(
    "text,vision,tie,balance",
    [("llama", "clip", False, False), ("qwen2", "siglip", True, True), ("qwen2", None, True, False)],
    ids=["clip-llama", "siglip-whisper-qwen2-tied-balancer-composed-from-parts", "qwen2-tied"],
)
def test_hf_model_on_heterogeneous_pipelines_equals_reference(tmp_path, text, vision, tie, balance):
    """The second case's model is composed from separately saved parts (a SiglipVisionModel, a Whisper, a
    Qwen2 causal LM with tied embeddings, a projector directory: ``model.huggingface: {vision, audio, llm,
    projector}``)."""
    if balance:
        directory = make_tiny_parts(tmp_path / "parts", text, vision, tie=tie, audio=True)[1]
    else:
        directory = make_tiny_model(tmp_path / "model", text, vision, tie=tie)
    job = hf_job(directory, vision is not None, balance)
    outs = compare(job, [2, 3], tmp_path / "run")
    if balance:  # the Whisper encoder's layers trained on the pipelines too, equal to the reference
        assert {"audio.embed", "audio.block1", "audio.projector0"} <= {n for out in outs for n in out["states"]}
    if tie:  # every copy of the tied matrix, on every stage of every pipeline, is the same tensor
        copies = [
            state[key]
            for out in outs
            for name, state in out["states"].items()
            for key in state
            if (name, key) in {("llm.embed", "embed_tokens.weight"), ("llm.head", "lm_head.weight")}
        ]
        assert len(copies) == 4 and all(torch.equal(c, copies[0]) for c in copies)


def test_built_in_model_with_tied_embeddings_equals_reference(tmp_path):
    with open("configs/tiny_mm.yaml") as f:
        d = yaml.safe_load(f)
    d["model"]["llm"]["tie_embeddings"] = True
    d["training"].update(dtype="float64", steps=STEPS, global_batch=8)
    job = config_from_dict(d)
    specs = model_layer_specs(job)
    assert specs[-1].tied_embedding
    outs = compare(job, [1, 2], tmp_path / "run")  # the 1-stage pipeline holds both copies on one rank
    copies = [
        state[key]
        for out in outs
        for name, state in out["states"].items()
        for key in state
        if (name, key) in {("llm.embed", "embed.weight"), ("llm.head", "out.weight")}
    ]
    assert len(copies) == 4 and all(torch.equal(c, copies[0]) for c in copies)


# --------------------------------------------------------------------------- model.builder


def builder_job(builder="examples/custom_model.py:build"):
    return config_from_dict(
        {
            "model": {
                "name": "conv_lm",
                "builder": builder,
                "llm": {"num_layers": 4, "hidden": 32, "num_heads": 1, "vocab_size": 256},
            },
            "data": {"mean_text_tokens": 16, "max_seq_len": 96, "num_samples": 256},
            "training": {"global_batch": 8, "microbatch_size": 2, "dtype": "float64", "steps": STEPS},
        }
    )


def test_your_own_model_from_model_builder_equals_reference(tmp_path):
    """examples/custom_model.py (an attention-free conv LM) on pipelines of different depths."""
    job = builder_job()
    assert [s.name for s in model_layer_specs(job)][:2] == ["llm.embed", "llm.block0"]
    compare(job, [2, 3], tmp_path / "run")


@pytest.mark.parametrize(
    "builder,message",
    [
        ("examples/custom_model.py", "must be 'package.module:function'"),
        ("examples/nope.py:build", "file 'examples/nope.py' does not exist"),
        ("no_such_package.mod:build", "cannot import 'no_such_package.mod'"),
        ("examples/custom_model.py:missing", "has no function 'missing'"),
        ("json:dumps", r"is called as function\(model, data\) and failed"),
        ("operator:eq", "must return a non-empty list of CustomLayer.*got bool"),
    ],
)
def test_model_builder_mistakes_are_named(builder, message):
    from oobleck_mm.config import ConfigError

    with pytest.raises((ConfigError, ValueError, TypeError), match=message):
        builder_job(builder)
