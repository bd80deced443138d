"""Two processes on two GPUs with NCCL: the engine on CUDA equals the reference (runs only where CUDA is).

    .venv/bin/python -m pytest tests/integration/test_cuda_smoke.py   # on a machine with >= 2 GPUs

Skipped without two CUDA devices (this repository's CI has none); the CPU-only
suite checks device placement on the meta device instead
(``tests/unit/test_device_placement.py``).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import yaml

from oobleck_mm.config import config_from_dict
from oobleck_mm.planning.layout import ExecutionPlan
from oobleck_mm.runtime.reference import ReferenceTrainer
from oobleck_mm.runtime.worker import run_local

pytestmark = [pytest.mark.integration, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_two_stage_pipeline_on_two_gpus_with_nccl(tmp_path, dtype):
    with open("configs/tiny_mm.yaml") as f:
        d = yaml.safe_load(f)
    d["training"].update(dtype=dtype, steps=3)
    d["cluster"].update(device="cuda", accelerator="a100-80gb", backend="auto")
    job = config_from_dict(d)
    assert job.cluster.resolved_backend == "nccl"
    trainer = ReferenceTrainer(
        dataclasses.replace(job, cluster=dataclasses.replace(job.cluster, device="cpu", backend="gloo"))
    )
    ref_losses = [loss for _, loss in trainer.train(3)]
    plan = ExecutionPlan.even(len(trainer.specs), [2], [8], job.training.microbatch_size)
    outs = run_local(job, plan, 3, tmp_path)
    assert outs[0]["losses"] == pytest.approx(ref_losses, abs=1e-3 if dtype == "bfloat16" else 1e-4)


def test_a_two_gpu_sharded_stage_with_nccl_equals_the_cpu_reference_in_float64(tmp_path):
    """One pipeline of one stage sharded over both GPUs by FSDP2 (issue 28): NCCL's all-gathers and
    reduce-scatters, the DTensor shards on CUDA, the gather for the final states."""
    with open("configs/tiny_mm.yaml") as f:
        d = yaml.safe_load(f)
    d["training"].update(dtype="float64", steps=3)
    d["cluster"].update(device="cuda", accelerator="a100-80gb", backend="auto", gpus_per_node=2, max_gpus_per_stage=2)
    job = config_from_dict(d)
    trainer = ReferenceTrainer(
        dataclasses.replace(job, cluster=dataclasses.replace(job.cluster, device="cpu", backend="gloo"))
    )
    ref_losses = [loss for _, loss in trainer.train(3)]
    plan = ExecutionPlan.even(len(trainer.specs), [1], [8], job.training.microbatch_size, widths=[[2]])
    outs = run_local(job, plan, 3, tmp_path)
    assert outs[0]["losses"] == pytest.approx(ref_losses, abs=1e-12)
    names = [s.name for s in trainer.specs]
    for out in outs:
        for name, state in out["states"].items():
            for key, value in state.items():
                assert (value.cpu() - trainer.layer_state(names.index(name))[key]).abs().max() < 1e-9, (name, key)
