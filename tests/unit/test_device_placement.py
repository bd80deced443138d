"""Every tensor the engine's layers and data path create lands on the configured device, tested without a GPU.

No CUDA here or in CI, so the stages run their forward and backward on the ``meta``
device: a tensor created on the CPU inside a layer (a rotary table, a position
grid, a mask) meets meta tensors and torch raises "Tensor on device cpu is not on
the expected device meta", exactly where it would mix CPU and CUDA tensors on a
GPU. Built-in and HuggingFace models, full and mixed precision.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from oobleck_mm.config import config_from_dict, load_config
from oobleck_mm.data.loader import TrainingData
from oobleck_mm.model.layers import build_layer, microbatch_loss, model_layer_specs
from oobleck_mm.runtime.mixed import ComputeCopies
from oobleck_mm.runtime.update import grad_sq

META = torch.device("meta")


def hf_job(tmp_path_factory, text, vision, tie):
    pytest.importorskip("transformers")
    from oobleck_mm.model.tiny_hf import make_tiny_model

    directory = make_tiny_model(tmp_path_factory.mktemp("hf") / "m", text, vision, tie=tie)
    data = {"mean_text_tokens": 16, "max_seq_len": 96}
    if vision:
        data.update(mean_images_per_sample=1, image_size=32)
    return config_from_dict({"model": {"huggingface": directory}, "data": data})


JOBS = {
    "tiny_mm": lambda f: load_config("configs/tiny_mm.yaml"),
    "tiny_mm_audio": lambda f: load_config("configs/tiny_mm_audio.yaml"),
    "hf_llava_clip_llama": lambda f: hf_job(f, "llama", "clip", False),
    "hf_llava_siglip_qwen2_tied": lambda f: hf_job(f, "qwen2", "siglip", True),
}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", list(JOBS))
def test_stages_run_forward_and_backward_on_the_configured_device(tmp_path_factory, name, dtype):
    job = JOBS[name](tmp_path_factory)
    job = dataclasses.replace(job, training=dataclasses.replace(job.training, dtype=dtype))
    specs = model_layer_specs(job)
    masters = {i: build_layer(job, i, specs).to(META) for i in range(len(specs))}
    compute = ComputeCopies(masters, torch.bfloat16).compute if dtype == "bfloat16" else masters
    data = TrainingData(job)
    batch = data.microbatch(data.global_batch(0)[:4]).to(META)
    acts = ()
    for i in range(len(specs)):
        acts = compute[i](acts, batch)
        assert all(a.device == META for a in acts), specs[i].name
    loss = microbatch_loss(acts[0], batch, data.loss_tokens(data.global_batch(0)))
    loss.backward()
    assert loss.device == META
    # mixed precision: every gradient reached its master, on the device, in the master dtype
    grads = [p.grad for m in masters.values() for p in m.parameters() if p.requires_grad]
    assert grads and all(g is not None and g.device == META and g.dtype == torch.float32 for g in grads)
    assert all(grad_sq(m).device == META for m in masters.values())


def test_a_packed_batch_moves_whole_with_its_spans_computed_on_the_host():
    job = load_config("configs/tiny_mm.yaml")
    data = TrainingData(job)
    batch = data.microbatch(data.global_batch(0)[:4])
    moved = batch.to(META)
    fields = [
        moved.tokens,
        moved.labels,
        moved.positions,
        moved.segments,
        moved.vision.features,
        moved.vision.grid,
        moved.vision.segments,
        moved.vision.llm_positions,
    ]
    assert all(t.device == META for t in fields)
    # spans are host tuples (a meta tensor has no values: computing them there would fail)
    assert moved.spans() == batch.spans() and moved.vision.spans() == batch.vision.spans()
    assert batch.to("cpu") is batch


def test_stopwatch_measures_work_and_reads_it_later():
    import time

    from oobleck_mm.runtime.timing import Stopwatch

    clock = Stopwatch(torch.device("cpu"))
    mark = clock.start()
    time.sleep(0.02)
    assert 0.015 < clock.seconds(clock.stop(mark)) < 1.0 and clock.seconds(None) == 0.0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA events need a GPU")
def test_stopwatch_times_kernels_with_cuda_events():
    from oobleck_mm.runtime.timing import Stopwatch

    clock = Stopwatch(torch.device("cuda"))
    x = torch.randn(2048, 2048, device="cuda")
    mark = clock.start()
    for _ in range(10):
        x = x @ x / 2048
    assert clock.seconds(clock.stop(mark)) > 0.0
