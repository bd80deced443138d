"""``--deepspeed ds_config.json``: DeepSpeed's keys mapped onto the job, refused or noted, each named."""

from __future__ import annotations

import json
import logging
import os

import pytest
import yaml

from oobleck_mm.config import ConfigError, load_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
JOB = {
    "model": {"name": "m", "llm": {"num_layers": 2, "hidden": 16, "num_heads": 2, "vocab_size": 200}},
    "cluster": {"nodes": 4},
}


def files(tmp_path, ds: dict, **job):
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    (tmp_path / "job.yaml").write_text(yaml.safe_dump({**JOB, **job}))
    return str(tmp_path / "job.yaml"), str(tmp_path / "ds.json")


def test_the_shipped_example_maps_onto_the_training_section(tmp_path, caplog):
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(JOB))
    with caplog.at_level(logging.WARNING):
        job = load_config(str(tmp_path / "job.yaml"), os.path.join(ROOT, "examples", "ds_config.json"))
    t = job.training
    assert (t.global_batch, t.microbatch_size, t.gradient_clipping, t.dtype) == (16, 2, 1.0, "bfloat16")
    assert (t.optimizer.type, t.optimizer.params.lr, t.optimizer.params.betas) == ("AdamW", 1e-3, (0.9, 0.95))
    assert t.scheduler.type == "WarmupLR" and t.scheduler.params["warmup_num_steps"] == 5
    assert "wall_clock_breakdown has no effect" in caplog.text and "steps_per_print" in caplog.text


def test_fp16_keys_adam_mode_reduction_dtype_and_deepspeeds_batch_rule(tmp_path):
    ds = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 3,
        "fp16": {
            "enabled": True,
            "loss_scale": 0,
            "initial_scale_power": 12,
            "loss_scale_window": 200,
            "hysteresis": 4,
            "min_loss_scale": 2,
        },
        "optimizer": {"type": "Adam", "params": {"lr": 3e-4, "adam_w_mode": False}},
        "communication_data_type": "bf16",
        "activation_checkpointing": {"partition_activations": False},
    }
    job = load_config(*files(tmp_path, ds))
    t = job.training
    assert t.global_batch == 2 * 3 * 4  # micro x accumulation x 4 nodes' GPUs, as DeepSpeed computes it
    assert t.dtype == "float16" and (
        t.fp16.initial_scale_power,
        t.fp16.loss_scale_window,
        t.fp16.hysteresis,
        t.fp16.min_loss_scale,
    ) == (12, 200, 4, 2.0)
    assert t.optimizer.type == "Adam"  # adam_w_mode false: L2, not decoupled decay
    assert t.grad_reduce_dtype == "bfloat16" and t.activation_checkpointing
    ds["optimizer"]["params"].pop("adam_w_mode")
    assert load_config(*files(tmp_path, ds)).training.optimizer.type == "AdamW"  # DeepSpeed's Adam default


@pytest.mark.parametrize(
    "ds,message",
    [
        ({"zero_optimization": {"stage": 4}}, r"zero_optimization.stage 4: expected 0, 1, 2 or 3"),
        (
            {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}},
            r"zero_optimization.offload_optimizer is not supported \(nothing is offloaded",
        ),
        ({"scheduler": {"type": "OneCycle", "params": {}}}, r"scheduler.params.cycle_min_lr: required by OneCycle"),
        ({"scheduler": {"type": "Noam", "params": {}}}, r"scheduler.type 'Noam' is not supported"),
        ({"amp": {"enabled": True}}, r"key 'amp' is not supported; supported keys:"),
        (
            {"train_batch_size": 10, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2},
            r"train_batch_size \(10\) is not train_micro_batch_size_per_gpu \(2\) x gradient_accumulation_steps \(2\)",
        ),
        ({"optimizer": {"type": "Lamb", "params": {}}}, r"optimizer.type 'Lamb' is not supported"),
        ({"bf16": {"enabled": True}, "fp16": {"enabled": True}}, "both true"),
    ],
)
def test_what_cannot_be_honoured_is_refused_naming_the_key(tmp_path, ds, message):
    with pytest.raises(ConfigError, match=message):
        load_config(*files(tmp_path, ds))


def test_a_value_set_in_both_places_must_agree(tmp_path):
    with pytest.raises(ConfigError, match=r"training.global_batch: 32 in the job file but 16 from ds.json"):
        load_config(*files(tmp_path, {"train_batch_size": 16}, training={"global_batch": 32}))
    job = load_config(*files(tmp_path, {"train_batch_size": 16}, training={"global_batch": 16}))
    assert job.training.global_batch == 16


def test_deepspeed_key_in_the_yaml_is_relative_to_it(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "ds.json").write_text(json.dumps({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4}))
    (tmp_path / "job.yaml").write_text(yaml.safe_dump({**JOB, "deepspeed": "sub/ds.json"}))
    job = load_config(str(tmp_path / "job.yaml"))
    assert (job.training.global_batch, job.training.microbatch_size) == (8, 4)
    with pytest.raises(ConfigError, match="deepspeed: given twice"):
        load_config(str(tmp_path / "job.yaml"), str(tmp_path / "sub" / "ds.json"))
    with pytest.raises(ConfigError, match="deepspeed: config file .*nope.json' does not exist"):
        load_config(*files(tmp_path, {})[:1], str(tmp_path / "nope.json"))


def test_auto_values_of_a_config_written_for_hugging_face_take_the_jobs_own(tmp_path, caplog):
    """Issue 30: ``"auto"`` (what HF's Trainer fills in) failed as ``lr: expected a finite number, got 'auto'``.
    It now means "the job decides": the YAML's value, or the default, and a note names every such key."""
    ds = {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "bf16": {"enabled": "auto"},
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
        },
        "scheduler": {
            "type": "WarmupDecayLR",
            "params": {
                "warmup_min_lr": "auto",
                "warmup_max_lr": "auto",
                "warmup_num_steps": 3,
                "total_num_steps": "auto",
            },
        },
    }
    job_yaml, ds_json = files(
        tmp_path,
        ds,
        training={"global_batch": 32, "microbatch_size": 4, "steps": 40, "optimizer": {"params": {"lr": 5e-4}}},
    )
    with caplog.at_level(logging.WARNING):
        t = load_config(job_yaml, ds_json).training
    assert (t.global_batch, t.microbatch_size, t.optimizer.params.lr, t.dtype) == (32, 4, 5e-4, "float32")
    assert t.scheduler.params == {"warmup_num_steps": 3} and t.scheduler.total_steps(t.steps) == 40
    assert "optimizer.params.lr" in caplog.text and '"auto" takes the job\'s own value' in caplog.text


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_stages_shard_inside_wide_stages_and_say_that_replicas_stay_whole(tmp_path, caplog, stage):
    import logging

    ds = {"zero_optimization": {"stage": stage, "overlap_comm": False, "reduce_bucket_size": 5e8, "round_robin": 1}}
    with caplog.at_level(logging.INFO):
        job = load_config(*files(tmp_path, ds))
    assert job.training.zero_stage == stage
    # DeepSpeed's overlap and bucket are the engine's gradient sync's: 5e8 float32 elements = 1907.35 MB
    assert job.training.grad_overlap is False and job.training.grad_bucket_mb == pytest.approx(5e8 * 4 / 2**20)
    said = caplog.text
    assert f"zero_optimization.stage {stage}: shards inside each pipeline stage of several GPUs" in said
    assert "replicas in different pipelines stay whole, since recovery copies a lost layer" in said
    assert "zero_optimization.overlap_comm False: training.grad_overlap" in said
    assert "zero_optimization.round_robin: tuning knobs of DeepSpeed's own ZeRO" in said
    with pytest.raises(Exception, match=r"zero_optimization.reduce_bucket_size 0: expected a number of elements"):
        load_config(*files(tmp_path, {"zero_optimization": {"reduce_bucket_size": 0}}))
    assert load_config(*files(tmp_path, {"zero_optimization": {"stage": 0}})).training.zero_stage == 3  # the default
