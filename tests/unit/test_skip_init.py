"""A layer built to be loaded (a checkpoint, a state copy, HF weights) skips its random init, and only that.

Random draws are counted at the ATen level (``TorchDispatchMode``), below every
Python wrapper: a skipped fill draws nothing. After the load, every parameter
and buffer, the non-persistent ones (position ids, rotary frequencies) included,
equals a layer built the usual way.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import sys
import threading

import pytest
import torch
import torch.nn.init as init
from torch.utils._python_dispatch import TorchDispatchMode

from oobleck_mm.config import load_config
from oobleck_mm.model.hf_weights import hf_weights
from oobleck_mm.model.layers import build_layer, model_layer_specs
from oobleck_mm.model.skip_init import skipping_random_init
from oobleck_mm.model.tiny_hf import make_tiny_model

sys.path.insert(0, os.path.dirname(__file__))
from test_hf_model import hf_job  # noqa: E402  (the HF tests' job for a model directory)

aten = torch.ops.aten
RANDOM_FILLS = {aten.normal_, aten.uniform_, aten.random_, aten.bernoulli_, aten.exponential_}
RANDOM_FACTORIES = {aten.normal, aten.randn, aten.rand, aten.randint, aten.randperm}
"""As overload packets. A constructor's own factory (CLIP's ``torch.randn(hidden)`` class embedding)
still draws: skipping it would leave a buffer made that way uninitialised."""


class RandomDraws(TorchDispatchMode):
    """Random fills and the elements random factories make, seen at the ATen level."""

    def __init__(self):
        super().__init__()
        self.fills = self.factory_elements = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.fills += func.overloadpacket in RANDOM_FILLS
        if func.overloadpacket in RANDOM_FACTORIES:
            self.factory_elements += out.numel()
        return out


def build_counting(job, index, specs, **kwargs):
    with RandomDraws() as draws:
        layer = build_layer(job, index, specs, **kwargs)
    return layer, draws


def builtin_job(path):
    job = load_config(path)
    return dataclasses.replace(job, training=dataclasses.replace(job.training, dtype="float64"))


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """{(text, vision): (directory with weights, directory with config.json only)}"""
    out = {}
    for text, vision in (("llama", "clip"), ("qwen2", "siglip")):
        root = tmp_path_factory.mktemp(f"{text}-{vision}")
        weighted = make_tiny_model(root / "weights", text=text, vision=vision, tie=vision == "siglip")
        bare = make_tiny_model(root / "config-only", text=text, vision=vision, tie=vision == "siglip")
        for path in glob.glob(os.path.join(bare, "*.safetensors*")):
            os.remove(path)
        out[text, vision] = (weighted, bare)
    return out


def jobs(hf_dirs):
    yield "tiny_mm", builtin_job("configs/tiny_mm.yaml")
    yield "tiny_mm_audio", builtin_job("configs/tiny_mm_audio.yaml")
    for (text, vision), (_, bare) in hf_dirs.items():
        yield f"hf-{text}-{vision} (random init)", hf_job(bare)


def all_tensors(layer):
    """Parameters and every buffer, non-persistent ones included."""
    return {**dict(layer.named_parameters()), **dict(layer.named_buffers())}


def test_a_layer_built_to_be_loaded_draws_nothing_and_loads_to_the_usual_layer(hf_dirs):
    for name, job in jobs(hf_dirs):
        specs = model_layer_specs(job)
        for i, spec in enumerate(specs):
            usual, usual_draws = build_counting(job, i, specs)
            blank, blank_draws = build_counting(job, i, specs, initialize=False)
            where = f"{name}: {spec.name}"
            assert usual_draws.fills > 0, f"{where}: the usual build drew no random fill (the counter sees nothing?)"
            assert blank_draws.fills == 0, f"{where}: {blank_draws.fills} random fills building a layer to be loaded"
            elements = sum(p.numel() for p in usual.parameters())
            assert blank_draws.factory_elements <= elements / 100, where
            blank.load_state_dict(usual.state_dict())
            want, got = all_tensors(usual), all_tensors(blank)
            assert want.keys() == got.keys(), where
            for key in want:
                assert torch.equal(want[key], got[key]), f"{where}: {key} differs after the load"


def test_hf_weights_are_read_without_drawing_a_random_init(hf_dirs):
    from safetensors.torch import load_file

    for (text, vision), (weighted, _) in hf_dirs.items():
        job = hf_job(weighted)
        specs = model_layer_specs(job)
        stored = {}
        for path in glob.glob(os.path.join(weighted, "*.safetensors")):
            stored.update(load_file(path))
        for i, spec in enumerate(specs):
            layer, draws = build_counting(job, i, specs)
            assert draws.fills == 0, f"{text}-{vision}: {spec.name} drew {draws.fills} random fills before its load"
            names = layer.hf_names()
            weights = hf_weights(weighted)
            for local, value in layer.state_dict().items():
                key = weights.name(*names[local])
                assert torch.equal(value, stored[key].to(value.dtype)), f"{spec.name}: {local} is not {key}"


def test_a_fill_that_resamples_until_in_bounds_still_runs_in_full():
    """torch's trunc_normal_ redraws values outside [a, b] with Tensor.normal_ in a loop; only functions
    that dispatch as themselves are skipped, so it ends, with every value inside its bounds."""
    tensor = torch.full((4096,), 1e30)
    with skipping_random_init():
        init.trunc_normal_(tensor, std=0.02, a=-0.04, b=0.04)
        init.xavier_uniform_(weight := torch.full((64, 64), 1e30))
    assert tensor.abs().max() <= 0.04
    assert weight.abs().max() < 1


def test_skipping_is_this_threads_only():
    """A joiner builds its receive layers in the background; another thread's init must still draw."""
    inside, outside = torch.zeros(256), torch.zeros(256)
    entered, done = threading.Event(), threading.Event()

    def other_thread():
        entered.wait()
        init.normal_(outside)
        done.set()

    thread = threading.Thread(target=other_thread)
    thread.start()
    with skipping_random_init():
        init.normal_(inside)
        entered.set()
        assert done.wait(30)
    thread.join()
    assert torch.equal(inside, torch.zeros(256)), "a fill inside the mode ran"
    assert outside.std() > 0.5, "another thread's fill was skipped"


def file_mappings():
    """(start, end) of this process's mappings of safetensors files."""
    spans = []
    with open("/proc/self/maps") as fh:
        for line in fh:
            if line.rstrip().endswith(".safetensors"):
                start, end = line.split()[0].split("-")
                spans.append((int(start, 16), int(end, 16)))
    return spans


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads Linux's /proc/self/maps")
def test_loaded_weights_are_the_processs_own_memory_not_a_view_of_the_file(hf_dirs):
    """safetensors' get_tensor returns a view of the file's mapping: a parameter assigned from it would
    keep the user's file mapped for the whole run (a replaced file is a SIGBUS mid-training)."""
    weighted, _ = hf_dirs["llama", "clip"]
    job = hf_job(weighted, dtype="float32")  # the files' dtype: no conversion makes a copy anyway
    specs = model_layer_specs(job)
    layers = [build_layer(job, i, specs) for i in range(len(specs))]
    spans = file_mappings()
    for layer in layers:
        for name, value in layer.state_dict().items():
            ptr = value.untyped_storage().data_ptr()
            assert not any(start <= ptr < end for start, end in spans), f"{name} lives in a file's mapping"
