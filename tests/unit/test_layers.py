"""Model layers: deterministic init, parameter counts as the planner's, attention variants agree."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from oobleck_mm.config import load_config
from oobleck_mm.data.loader import TrainingData
from oobleck_mm.model.layers import build_layer, model_layer_specs
from oobleck_mm.config.shape import param_count


def job_with(path="configs/tiny_mm.yaml", **training):
    job = load_config(path)
    return dataclasses.replace(job, training=dataclasses.replace(job.training, dtype="float64", **training))


@pytest.mark.parametrize("path", ["configs/tiny_mm.yaml", "configs/tiny_mm_audio.yaml"])
def test_parameter_counts_equal_the_planners(path):
    job = job_with(path)
    for i, spec in enumerate(model_layer_specs(job)):
        layer = build_layer(job, i)
        assert sum(p.numel() for p in layer.parameters()) == param_count(spec), spec.name


def test_any_rank_builds_identical_layers():
    job = job_with()
    a, b = build_layer(job, 3), build_layer(job, 3)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    c = build_layer(dataclasses.replace(job, training=dataclasses.replace(job.training, seed=1)), 3)
    assert not all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), c.state_dict().values()))


def run_model(job, ids):
    data = TrainingData(job)
    batch = data.microbatch(ids)
    acts = ()
    for i in range(len(model_layer_specs(job))):
        acts = build_layer(job, i)(acts, batch)
    return acts[0], batch


@pytest.mark.parametrize("path", ["configs/tiny_mm.yaml", "configs/tiny_mm_audio.yaml"])
def test_eager_attention_equals_flash(path):
    ids = list(range(4))
    flash, _ = run_model(job_with(path, flash_attention=True), ids)
    eager, _ = run_model(job_with(path, flash_attention=False), ids)
    assert (flash - eager).abs().max() < 1e-12


def test_packed_samples_do_not_see_each_other():
    """A sample's logits are the same alone or packed with others (attention stays inside it)."""
    job = job_with()
    together, batch = run_model(job, [5, 6, 7])
    alone, _ = run_model(job, [6])
    rows = batch.segments == 1
    assert (together[rows] - alone).abs().max() < 1e-12
