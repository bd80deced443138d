"""``oobleck-launch export``: engine checkpoints of HF models back as directories ``from_pretrained`` loads."""

from __future__ import annotations

import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

from safetensors import safe_open  # noqa: E402

from oobleck_mm.config import config_from_dict  # noqa: E402
from oobleck_mm.export import export_checkpoint  # noqa: E402
from oobleck_mm.model.layers import model_layer_specs  # noqa: E402
from oobleck_mm.model.tiny_hf import make_tiny_model  # noqa: E402
from oobleck_mm.runtime.checkpoint import save_layers, write_layer_file  # noqa: E402
from oobleck_mm.runtime.checkpoint_meta import save_meta  # noqa: E402
from oobleck_mm.runtime.engine import fresh_layer  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def job_of(directory, dtype="float32"):
    data = {"mean_text_tokens": 16, "max_seq_len": 96, "num_samples": 64}
    if "vision_config" in open(os.path.join(directory, "config.json")).read():
        data.update(mean_images_per_sample=1, image_size=32)
    return config_from_dict(
        {
            "model": {"huggingface": str(directory)},
            "data": data,
            "training": {"global_batch": 4, "microbatch_size": 2, "dtype": dtype},
        }
    )


def checkpoint_without_training(job, directory):
    """What ``--save-final`` writes after 0 steps: every layer as loaded from the source files."""
    specs = model_layer_specs(job)
    held = {i: fresh_layer(job, i, specs) for i in range(len(specs))}
    save_layers(directory, held, range(len(specs)), specs)
    save_meta(directory, job, 0, specs)
    return directory


def tensors(directory):
    out = {}
    for f in sorted(os.listdir(directory)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(directory, f), framework="pt") as fh:
                out.update({k: fh.get_tensor(k) for k in fh.keys()})
    return out


@pytest.mark.parametrize(
    "text,vision,dtype,tie",
    [
        ("llama", "clip", torch.float32, False),
        ("qwen2", "siglip", torch.bfloat16, False),
        ("mistral", None, torch.float32, False),
        ("qwen2", None, torch.float32, True),
    ],
)
def test_load_then_export_is_bit_equal_to_the_input_files(tmp_path, text, vision, dtype, tie):
    source = make_tiny_model(tmp_path / "src", text, vision, tie=tie, dtype=dtype, max_shard_size="150KB")
    ckpt = checkpoint_without_training(job_of(source), tmp_path / "ckpt")
    export_checkpoint(ckpt, tmp_path / "out", max_shard_size="150KB")
    mine, theirs = tensors(tmp_path / "out"), tensors(source)
    assert sorted(mine) == sorted(theirs)  # CLIP's unused tail is carried along; a tied head is not written
    for name, value in theirs.items():
        assert mine[name].dtype == value.dtype, name
        assert torch.equal(mine[name], value), name
    assert os.path.exists(tmp_path / "out" / "model.safetensors.index.json")  # sharded above max_shard_size


def test_export_loads_with_from_pretrained_and_holds_the_checkpoints_values(tmp_path):
    source = make_tiny_model(tmp_path / "src", "llama", "clip")
    job = job_of(source, dtype="float64")
    ckpt = checkpoint_without_training(job, tmp_path / "ckpt")
    # change every checkpointed value, as training would
    for f in sorted((ckpt / "layers").glob("*.pt")):
        payload = torch.load(f, weights_only=True)
        payload["params"] = {k: v + 0.25 for k, v in payload["params"].items()}
        write_layer_file(ckpt, f.stem, payload)
    save_meta(ckpt, job, 0, model_layer_specs(job))  # record the new sizes and digests
    export_checkpoint(ckpt, tmp_path / "out", dtype="float64")
    model = transformers.LlavaForConditionalGeneration.from_pretrained(tmp_path / "out")
    original = transformers.LlavaForConditionalGeneration.from_pretrained(source)
    assert model.dtype == torch.float64
    new, old = dict(model.named_parameters()), dict(original.named_parameters())
    changed = [n for n in new if not torch.equal(new[n], old[n].double())]
    shifted = [n for n in new if torch.equal(new[n], old[n].double() + 0.25)]
    # every tensor the engine trains moved by exactly the change; CLIP's unused last block did not
    assert changed == shifted and len(changed) > 0
    assert not any(".encoder.layers.2." in n for n in changed)


def test_export_refuses_a_missing_checkpoint_and_a_nonempty_target(tmp_path, capsys):
    """The CLI's own ``main`` (exit code and message; ``tests/integration/test_other_processes.py`` starts the
    CLI as a process elsewhere): exit 2 naming what is wrong, never an internal error."""
    from oobleck_mm.cli import main

    def export(checkpoint, to) -> tuple[int, str]:
        capsys.readouterr()
        code = main(["export", "--checkpoint", str(checkpoint), "--to", str(to)])
        return code, capsys.readouterr().err

    code, err = export(tmp_path / "nope", tmp_path / "o")
    assert code == 2 and "not a complete checkpoint" in err, err
    source = make_tiny_model(tmp_path / "src", "llama", None)
    ckpt = checkpoint_without_training(job_of(source), tmp_path / "ckpt")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    code, err = export(ckpt, tmp_path / "full")
    assert code == 2 and "exists and is not empty" in err, err
    code, err = export(ckpt, tmp_path / "full" / "x")  # a file (issue 30: exit 1, "internal error")
    assert code == 2 and "exists and is a file" in err, err
