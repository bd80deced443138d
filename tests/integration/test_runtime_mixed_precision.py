"""Mixed precision equals the reference trainer running the same mode (real gloo processes).

The machinery (compute copies, gradients accumulated into the masters, the
update on the masters, the copies refreshed) is tested tightly with float32
compute and float64 masters: pipelines of different depths with the balancer on
must equal the reference to 1e-9. The reference replays the engine's
microbatches (the balancer composes them from its online cost model) and runs
with the workers' one thread: float32 kernels round differently for other
shapes or thread counts, and AdamW turns such 1e-8 noise in near-zero
gradients into 1e-6 differences. bfloat16 compute with float32 masters is
checked at bf16's precision. Every layer a worker hands back (what state
transfer and checkpoints read) holds masters in the master dtype.
"""

from __future__ import annotations

import pytest
import torch
import yaml

from oobleck_mm.config import ConfigError, config_from_dict
from oobleck_mm.planning.layout import ExecutionPlan
from oobleck_mm.runtime.reference import ReferenceTrainer
from oobleck_mm.runtime.worker import run_local

pytestmark = pytest.mark.integration
STEPS = 4


def job(dtype: str, master: str | None = None, balance: bool = True, reduce: str = "float32"):
    with open("configs/tiny_mm.yaml") as f:
        d = yaml.safe_load(f)
    d["training"].update(dtype=dtype, steps=STEPS, grad_reduce_dtype=reduce)
    if master is not None:
        d["training"]["master_dtype"] = master
    d["balance"] = {"enabled": balance}
    return config_from_dict(d)


def run(j, tmp_path):
    """The engine on pipelines of 2 and 3 stages, then the reference replaying its microbatches."""
    trainer = ReferenceTrainer(j)
    plan = ExecutionPlan.even(len(trainer.specs), [2, 3], [4, 4], j.training.microbatch_size)
    outs = run_local(j, plan, STEPS, tmp_path)
    # With the balancer on, the engine's microbatches are its own composition; float32 compute rounds
    # per microbatch, so the oracle replays exactly those (the sum they make is the same either way).
    ref_losses = [trainer.train_step(r.step, r.microbatches) for r in outs[0]["results"]]
    worst, dtypes = compare_states(outs, trainer)
    return worst, dtypes, outs[0]["losses"], ref_losses, outs


def bucket_bytes(outs, field: str) -> int:
    """A ``StepResult`` byte count summed over every rank and step."""
    return sum(getattr(r, field) for out in outs for r in out["results"])


def compare_states(outs, trainer) -> tuple[float, set]:
    """The largest difference of any held state from the reference's (compared in float64), and the dtypes held."""
    names = [s.name for s in trainer.specs]
    worst, dtypes = 0.0, set()
    for out in outs:
        for name, state in out["states"].items():
            ref = trainer.layer_state(names.index(name))
            for key, value in state.items():
                dtypes.add(value.dtype)
                worst = max(worst, (value.double() - ref[key].double()).abs().max().item())
    return worst, dtypes


def test_float32_compute_with_float64_masters_equals_reference(tmp_path):
    worst, dtypes, losses, ref_losses, _ = run(job("float32", "float64"), tmp_path)  # balancer on
    assert dtypes == {torch.float64}  # the masters are what a worker holds and hands on
    assert worst <= 1e-9, worst
    assert losses == pytest.approx(ref_losses, abs=1e-9)
    assert ref_losses[-1] < ref_losses[0]


def test_mixed_precision_differs_from_plain_float32(tmp_path):
    """The copies really compute in float32 while the masters accumulate in float64."""
    mixed = ReferenceTrainer(job("float32", "float64", balance=False))
    plain = ReferenceTrainer(job("float64", balance=False))
    a = [loss for _, loss in mixed.train(2)]
    b = [loss for _, loss in plain.train(2)]
    assert a != b and a == pytest.approx(b, abs=1e-5)


def test_bfloat16_compute_is_within_bf16_precision_of_the_bf16_reference(tmp_path):
    worst, dtypes, losses, ref_losses, _ = run(job("bfloat16"), tmp_path)
    assert dtypes == {torch.float32}  # fp32 masters, never bf16 weights in a checkpoint
    assert worst <= 1e-3, worst
    assert losses == pytest.approx(ref_losses, abs=2e-2)
    assert losses[-1] < losses[0]


def test_bfloat16_gradient_reduction_rounds_the_all_reduce_only(tmp_path):
    """grad_reduce_dtype: bfloat16 sends half the bytes; its rounding of the summed gradients is the
    only difference from the reference (which reduces nothing), so it stays within bf16's 3 digits."""
    worst, dtypes, losses, ref_losses, outs = run(job("bfloat16", reduce="bfloat16"), tmp_path / "bf16")
    exact, _, _, _, outs_fp32 = run(job("bfloat16"), tmp_path / "fp32")
    assert dtypes == {torch.float32}
    # A bf16 sum of float32 gradients goes by a copy; a float32 one sums the buffers the compute copies' hooks
    # accumulated into (GradientSync.attach).
    assert bucket_bytes(outs, "grad_bytes_copied") == bucket_bytes(outs, "grad_bytes") > 0
    assert bucket_bytes(outs_fp32, "grad_bytes_copied") == 0 < bucket_bytes(outs_fp32, "grad_bytes")
    assert worst != exact and worst <= 1e-2, (worst, exact)
    assert losses == pytest.approx(ref_losses, abs=2e-2)


def test_master_dtype_below_the_compute_dtype_is_refused():
    with pytest.raises(ConfigError, match="training.master_dtype: must be float64 when training.dtype is float64"):
        job("float64", "float32")


# --------------------------------------------------------------------------- float16 loss scaling


def fp16_job(**fp16):
    with open("configs/tiny_mm.yaml") as f:
        d = yaml.safe_load(f)
    d["training"].update(dtype="float16", steps=STEPS, fp16={"initial_scale_power": 6, "hysteresis": 1, **fp16})
    return config_from_dict(d)


def test_an_overflow_on_one_rank_skips_that_step_on_every_rank(tmp_path, monkeypatch):
    from oobleck_mm.runtime.mixed import OVERFLOW_ENV

    monkeypatch.setenv(OVERFLOW_ENV, "2@1")  # an inf in a gradient of rank 1 at step 2
    j = fp16_job()
    worst, dtypes, losses, ref_losses, _ = run(j, tmp_path)
    outs = run_local(j, ExecutionPlan.even(10, [2, 3], [4, 4], 2), STEPS, tmp_path / "again")
    for out in outs:
        assert [r.skipped for r in out["results"]] == [False, False, True, False]
        assert [r.loss_scale for r in out["results"]] == [64.0, 64.0, 64.0, 32.0]  # halved after the overflow
        assert out["loss_scaler"]["scale"] == 32.0
    assert dtypes == {torch.float32}  # fp32 masters
    assert worst <= 1e-3, worst  # the fp16 reference skipped the same step
    assert losses == pytest.approx(ref_losses, abs=2e-2)


def test_loss_scaler_state_survives_a_reconfiguration(tmp_path, monkeypatch):
    from oobleck_mm.runtime.mixed import OVERFLOW_ENV
    from oobleck_mm.runtime.worker import Phase

    monkeypatch.setenv(OVERFLOW_ENV, "1")
    j = fp16_job()
    first = ExecutionPlan.even(10, [2, 3], [4, 4], 2)
    after = ExecutionPlan.even(10, [2, 2], [4, 4], 2)
    phase = Phase(plan=after, steps=2, survivors={0: 0, 1: 1, 2: 2, 3: 3})  # rank 4 is lost
    outs = run_local(j, first, 2, tmp_path, phases=[phase])
    trainer = ReferenceTrainer(j)
    for step in range(4):
        trainer.train_step(step)
    for out in outs:
        assert out["loss_scaler"] == trainer.scaler.state_dict()
        assert [r.skipped for r in out["results"]] == [False, True, False, False]
