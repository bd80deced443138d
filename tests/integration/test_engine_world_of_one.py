"""The engine on a real gloo group of one rank (tests/unit forms no process group)."""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path

import pytest
from deepspeed.runtime.pipe import schedule as ds

from oobleck_mm.config import load_config
from oobleck_mm.model.layers import model_layer_specs

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from test_layers import job_with  # noqa: E402

WAIT = timedelta(seconds=60)


def test_activation_checkpointing_gives_the_same_gradients(tmp_path):
    import torch.distributed as dist

    from oobleck_mm.planning.layout import ExecutionPlan
    from oobleck_mm.runtime.engine import StageEngine
    from oobleck_mm.runtime.group import join_generation

    wait = timedelta(seconds=60)
    join_generation(
        dist.FileStore(str(tmp_path / "s"), 1), 0, 0, 1, "gloo", collective_timeout=wait, arrival_timeout=wait
    )
    try:
        states = []
        for ckpt in (False, True):
            job = job_with()
            plan = ExecutionPlan.even(len(model_layer_specs(job)), [1], [8], 2, recompute=[[ckpt]])
            engine = StageEngine(job, plan, 0)
            assert engine.train_step(0).recomputed == (8 * len(engine.layers) if ckpt else 0)
            states.append([engine.layer_state(i) for i in engine.layers])
        for a, b in zip(*states):
            assert all((a[k] - b[k]).abs().max() < 1e-12 for k in a)
    finally:
        dist.destroy_process_group()


def test_single_rank_engine_handles_every_instruction_and_equals_reference(tmp_path):
    """World of one (a real gloo group): every TrainSchedule instruction kind has a handler, same result."""
    import dataclasses

    import torch.distributed as dist

    from oobleck_mm.planning.layout import ExecutionPlan
    from oobleck_mm.runtime.engine import StageEngine
    from oobleck_mm.runtime.group import join_generation
    from oobleck_mm.runtime.reference import ReferenceTrainer

    job = load_config("configs/tiny_mm.yaml")
    job = dataclasses.replace(job, training=dataclasses.replace(job.training, dtype="float64"))
    kinds = set()
    for stages in (1, 2, 4):
        for stage in range(stages):
            for step in ds.TrainSchedule(micro_batches=5, stages=stages, stage_id=stage).steps():
                kinds |= {type(i) for i in step}
    store = dist.FileStore(str(tmp_path / "store"), 1)
    join_generation(store, 0, 0, 1, "gloo", collective_timeout=WAIT, arrival_timeout=WAIT)
    try:
        specs = model_layer_specs(job)
        engine = StageEngine(job, ExecutionPlan.even(len(specs), [1], [8], 2), 0)
        assert kinds <= set(engine._dispatch)
        ref = ReferenceTrainer(job)
        for step in range(2):
            assert engine.train_step(step).loss == pytest.approx(ref.train_step(step), abs=1e-12)
        for i in range(len(specs)):
            for k, v in engine.layer_state(i).items():
                assert (v - ref.layer_state(i)[k]).abs().max() < 1e-12
    finally:
        dist.destroy_process_group()
