"""float16 loss scaling: the engine's LossScaler follows DeepSpeed's DynamicLossScaler step for step."""

from __future__ import annotations

import pytest
import torch

from oobleck_mm.config import config_from_dict
from oobleck_mm.precision import LossScaler


@pytest.fixture
def deepspeed_rank_zero(monkeypatch):
    """DeepSpeed's scaler asks ``deepspeed.comm.get_rank()`` only to pick the rank that logs an overflow.
    A real ``deepspeed.init_distributed`` on the CPU compiles DeepSpeed's shared-memory C++ op first (33-70 s
    on a fresh machine, seen in CI), which this comparison of two scalers does not use: rank 0 it is."""
    import deepspeed.comm

    monkeypatch.setattr(deepspeed.comm, "get_rank", lambda group=None: 0)


@pytest.mark.parametrize("hysteresis,consecutive", [(1, False), (2, False), (3, True)])
def test_same_scales_as_deepspeeds_dynamic_loss_scaler(deepspeed_rank_zero, hysteresis, consecutive):
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    theirs = DynamicLossScaler(
        init_scale=2.0**8,
        scale_window=3,
        min_scale=4.0,
        delayed_shift=hysteresis,
        consecutive_hysteresis=consecutive,
        raise_error_at_min_scale=False,
    )
    ours = LossScaler(
        scale=2.0**8,
        window=3,
        min_scale=4.0,
        delayed_shift=hysteresis,
        consecutive_hysteresis=consecutive,
        hysteresis=hysteresis,
    )
    overflows = [0, 0, 0, 0, 1, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0]
    for step, overflow in enumerate(overflows):
        theirs.update_scale(bool(overflow))
        ours.update(bool(overflow))
        assert (ours.scale, ours.hysteresis, ours.iteration, ours.last_overflow) == (
            theirs.cur_scale,
            theirs.cur_hysteresis,
            theirs.cur_iter,
            theirs.last_overflow_iter,
        ), step


def test_scaler_from_the_config_and_its_state_round_trip():
    base = {"model": {"name": "m", "llm": {"num_layers": 1, "hidden": 8, "num_heads": 1, "vocab_size": 200}}}
    assert LossScaler.for_training(config_from_dict(base).training) is None  # float32: no scaling
    job = config_from_dict(
        {**base, "training": {"dtype": "float16", "fp16": {"initial_scale_power": 12, "loss_scale_window": 50}}}
    )
    scaler = LossScaler.for_training(job.training)
    assert (scaler.scale, scaler.window, scaler.hysteresis) == (4096.0, 50, 2)
    static = LossScaler.for_training(
        config_from_dict({**base, "training": {"dtype": "float16", "fp16": {"loss_scale": 128}}}).training
    )
    static.update(True)
    assert static.scale == 128.0 and not static.dynamic
    scaler.update(True)
    copy = LossScaler.for_training(job.training)
    copy.load_state_dict(scaler.state_dict())
    assert copy == scaler
    assert LossScaler.overflowed(float("inf")) and LossScaler.overflowed(float("nan"))
    assert not LossScaler.overflowed(torch.tensor(3.0).item())
