"""A DeepSpeed JSON config (``--deepspeed FILE`` or ``deepspeed: FILE`` in the job YAML) mapped onto the job.

Users coming from DeepSpeed keep their ``ds_config.json``. Each key either maps
onto a job field (DeepSpeed's meaning kept), is accepted with a note saying it
has no effect here (logging and profiling switches), or is refused naming the
key and why (what the engine cannot honour: ZeRO sharding, OneCycle, unknown
keys). ``apply_deepspeed`` edits the job's raw dict before it is validated, so
every value then goes through the same checks as YAML values; a field set in
the YAML to another value than the DeepSpeed file's is a conflict, named.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from oobleck_mm.config.values import ConfigError

FP16_KEYS = {
    "loss_scale": "loss_scale",
    "initial_scale_power": "initial_scale_power",
    "loss_scale_window": "loss_scale_window",
    "hysteresis": "hysteresis",
    "consecutive_hysteresis": "consecutive_hysteresis",
    "min_loss_scale": "min_loss_scale",
}
NO_EFFECT = (
    "wall_clock_breakdown",
    "steps_per_print",
    "tensorboard",
    "wandb",
    "csv_monitor",
    "comet",
    "flops_profiler",
    "comms_logger",
    "memory_breakdown",
    "dump_state",
    "zero_allow_untested_optimizer",
    "gradient_predivide_factor",
    "prescale_gradients",
    "sparse_gradients",
)
"""Keys that change how DeepSpeed logs or profiles, not what is trained."""
SCHEDULERS = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle")


def read_deepspeed(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as fh:
            raw = json.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"deepspeed: config file {path!r} does not exist") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"deepspeed: {path} is not readable JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"deepspeed: {path} must hold a JSON object, got {type(raw).__name__}")
    return raw


def _drop_auto(ds: dict[str, Any], prefix: str = "") -> list[str]:
    """Removes every ``"auto"`` value (in place), nested ones too; the dotted keys removed. A key left out
    is one the job's own settings decide, which is what ``"auto"`` means in configs written for HF."""
    dropped = []
    for key in list(ds):
        value = ds[key]
        if isinstance(value, str) and value.strip().lower() == "auto":
            del ds[key]
            dropped.append(f"{prefix}{key}")
        elif isinstance(value, dict):
            dropped += _drop_auto(value, f"{prefix}{key}.")
    return dropped


def apply_deepspeed(raw: dict[str, Any], path: str, world_size: int) -> list[str]:
    """Map the DeepSpeed config at ``path`` into the job's raw dict (in place); returns notes for the user.

    ``world_size``: GPUs of the cluster (nodes x GPUs per node), for DeepSpeed's rule
    ``train_batch_size = micro batch x gradient accumulation x data-parallel size`` when
    ``train_batch_size`` is left out.
    """
    ds = read_deepspeed(path)
    name = os.path.basename(path)
    autos = _drop_auto(ds)
    training = raw.setdefault("training", {})
    if not isinstance(training, dict):
        raise ConfigError("training: expected a mapping of settings")
    notes: list[str] = []
    if autos:
        notes.append(
            f'{name}: {", ".join(autos)}: "auto" takes the job\'s own value (its YAML, --set, or the '
            "default), as DeepSpeed's Hugging Face integration fills \"auto\" from the trainer's"
        )
    mapped: dict[tuple[str, ...], Any] = {}

    micro = ds.get("train_micro_batch_size_per_gpu")
    accumulation = ds.get("gradient_accumulation_steps")
    total = ds.get("train_batch_size")
    if micro is not None:
        mapped[("microbatch_size",)] = micro
    if total is not None:
        mapped[("global_batch",)] = total
        if (
            isinstance(micro, int)
            and isinstance(accumulation, int)
            and isinstance(total, int)
            and micro > 0
            and accumulation > 0
            and total % (micro * accumulation)
        ):
            raise ConfigError(
                f"deepspeed: {name}: train_batch_size ({total}) is not train_micro_batch_size_per_gpu ({micro}) x "
                f"gradient_accumulation_steps ({accumulation}) x a whole number of data-parallel replicas; "
                "DeepSpeed would refuse it too. The engine needs only train_batch_size and the micro batch: the "
                "planner splits the batch over its pipelines itself"
            )
    elif isinstance(micro, int) and isinstance(accumulation, int):
        mapped[("global_batch",)] = micro * accumulation * world_size
        notes.append(
            f"{name}: no train_batch_size; DeepSpeed's rule gives {micro} x {accumulation} x {world_size} "
            f"GPUs = {micro * accumulation * world_size}"
        )
    if accumulation is not None and total is not None:
        notes.append(
            f"{name}: gradient_accumulation_steps is not used as such: each pipeline runs as many "
            "microbatches as the planner gives it"
        )
    if "gradient_clipping" in ds:
        mapped[("gradient_clipping",)] = ds["gradient_clipping"]

    bf16, fp16 = _enabled(ds, "bf16") or _enabled(ds, "bfloat16"), _enabled(ds, "fp16")
    if bf16 and fp16:
        raise ConfigError(f"deepspeed: {name}: bf16.enabled and fp16.enabled are both true; choose one")
    if bf16:
        mapped[("dtype",)] = "bfloat16"
    if fp16:
        mapped[("dtype",)] = "float16"
        for key, field in FP16_KEYS.items():
            if key in ds["fp16"]:
                mapped[("fp16", field)] = ds["fp16"][key]
        extra = sorted(set(ds["fp16"]) - set(FP16_KEYS) - {"enabled", "auto_cast"})
        if extra:
            raise ConfigError(
                f"deepspeed: {name}: fp16.{extra[0]} is not supported; supported: " + ", ".join(sorted(FP16_KEYS))
            )
    if "communication_data_type" in ds:
        reduce = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp32": "float32", "float32": "float32"}
        if ds["communication_data_type"] not in reduce:
            raise ConfigError(
                f"deepspeed: {name}: communication_data_type {ds['communication_data_type']!r} is not "
                "supported; the gradient all-reduce runs in fp32 or bf16"
            )
        mapped[("grad_reduce_dtype",)] = reduce[ds["communication_data_type"]]

    if "optimizer" in ds:
        mapped.update(_optimizer(ds["optimizer"], name))
    if "scheduler" in ds:
        mapped.update(_scheduler(ds["scheduler"], name))
    if "activation_checkpointing" in ds:
        mapped[("activation_checkpointing",)] = True
        notes.append(
            f"{name}: activation_checkpointing: every layer recomputes its forward in backward "
            "(its partition/offload options have no effect here)"
        )
    zero = ds.get("zero_optimization") or {}
    stage = zero.get("stage", 0) if isinstance(zero, Mapping) else zero
    if stage not in (0, 1, 2, 3, None, False):
        raise ConfigError(f"deepspeed: {name}: zero_optimization.stage {stage!r}: expected 0, 1, 2 or 3")
    if stage in (1, 2, 3):
        mapped[("zero_stage",)] = stage
        notes.append(
            f"{name}: zero_optimization.stage {stage}: shards inside each pipeline stage of several GPUs "
            f"(training.zero_stage {stage}: {'parameters, gradients and optimizer state' if stage == 3 else 'gradients and optimizer state, parameters kept gathered from forward to backward'}); "
            "a layer's replicas in different pipelines stay whole, since recovery copies a lost layer from any of "
            "them (stages of one GPU shard nothing)"
        )
    if isinstance(zero, Mapping):
        # The gradient sums' overlap with the backward and their bucket size are the engine's too (its
        # cross-pipeline all-reduce, runtime/grad_sync.py): DeepSpeed's are taken, its bucket counted in
        # elements of the reduction's dtype.
        if "overlap_comm" in zero:
            mapped[("grad_overlap",)] = zero["overlap_comm"]
            notes.append(
                f"{name}: zero_optimization.overlap_comm {zero['overlap_comm']}: training.grad_overlap "
                "(the cross-pipeline gradient all-reduce during the last backward)"
            )
        if "reduce_bucket_size" in zero:
            size = zero["reduce_bucket_size"]
            if isinstance(size, bool) or not isinstance(size, (int, float)) or size <= 0:
                raise ConfigError(
                    f"deepspeed: {name}: zero_optimization.reduce_bucket_size {size!r}: expected a number of "
                    "elements > 0"
                )
            element = 2 if ds.get("communication_data_type") in ("bf16", "bfloat16", "fp16") else 4
            mapped[("grad_bucket_mb",)] = size * element / 2**20
            notes.append(
                f"{name}: zero_optimization.reduce_bucket_size {size:g} elements: training.grad_bucket_mb "
                f"{size * element / 2**20:g}"
            )
        ignored = sorted(set(zero) - {"stage", "overlap_comm", "reduce_bucket_size"})
        offloads = [k for k in ignored if k.startswith("offload")]
        if offloads:
            raise ConfigError(
                f"deepspeed: {name}: zero_optimization.{offloads[0]} is not supported (nothing is "
                "offloaded to the host or NVMe here); remove it"
            )
        if ignored:
            notes.append(
                f"{name}: zero_optimization.{', '.join(ignored)}: tuning knobs of DeepSpeed's own ZeRO "
                "with no effect here (accepted)"
            )
    for key in NO_EFFECT:
        if key in ds:
            notes.append(f"{name}: {key} has no effect on training here (accepted)")

    known = {
        "train_batch_size",
        "train_micro_batch_size_per_gpu",
        "gradient_accumulation_steps",
        "gradient_clipping",
        "bf16",
        "bfloat16",
        "fp16",
        "optimizer",
        "scheduler",
        "activation_checkpointing",
        "zero_optimization",
        "communication_data_type",
        *NO_EFFECT,
    }
    unknown = sorted(set(ds) - known)
    if unknown:
        raise ConfigError(
            f"deepspeed: {name}: key {unknown[0]!r} is not supported; supported keys: " + ", ".join(sorted(known))
        )
    for keys, value in mapped.items():
        _set(training, keys, value, name)
    return notes


def _enabled(ds: Mapping, key: str) -> bool:
    section = ds.get(key)
    return isinstance(section, Mapping) and bool(section.get("enabled", False))


def _optimizer(section: Any, name: str) -> dict[tuple[str, ...], Any]:
    if not isinstance(section, Mapping) or "type" not in section:
        raise ConfigError(f"deepspeed: {name}: optimizer must be an object with a type")
    kind = str(section["type"]).lower()
    params = dict(section.get("params") or {})
    if kind not in ("adam", "adamw"):
        raise ConfigError(
            f"deepspeed: {name}: optimizer.type {section['type']!r} is not supported; supported: Adam, AdamW"
        )
    # DeepSpeed's Adam is AdamW unless adam_w_mode is false (its FusedAdam default).
    decoupled = kind == "adamw" or params.pop("adam_w_mode", True)
    params.pop("torch_adam", None)
    out: dict[tuple[str, ...], Any] = {("optimizer", "type"): "AdamW" if decoupled else "Adam"}
    for key in ("lr", "betas", "eps", "weight_decay"):
        if key in params:
            out[("optimizer", "params", key)] = params.pop(key)
    if params:
        raise ConfigError(
            f"deepspeed: {name}: optimizer.params.{sorted(params)[0]} is not supported; supported: "
            "lr, betas, eps, weight_decay, adam_w_mode"
        )
    return out


def _scheduler(section: Any, name: str) -> dict[tuple[str, ...], Any]:
    if not isinstance(section, Mapping) or "type" not in section:
        raise ConfigError(f"deepspeed: {name}: scheduler must be an object with a type")
    if section["type"] not in SCHEDULERS:
        raise ConfigError(
            f"deepspeed: {name}: scheduler.type {section['type']!r} is not supported; supported: "
            + ", ".join(SCHEDULERS)
        )
    params = dict(section.get("params") or {})
    params.pop("last_batch_iteration", None)  # -1: where DeepSpeed starts, which lr_at models
    return {("scheduler",): {"type": section["type"], "params": params}}


def _set(training: dict, keys: tuple[str, ...], value: Any, name: str) -> None:
    target = training
    for key in keys[:-1]:
        target = target.setdefault(key, {})
        if not isinstance(target, dict):
            raise ConfigError(f"training.{'.'.join(keys[:-1])}: expected a mapping of settings")
    last = keys[-1]
    if last in target and target[last] != value:
        raise ConfigError(
            f"training.{'.'.join(keys)}: {target[last]!r} in the job file but {value!r} from {name}; "
            "set it in one place"
        )
    target[last] = value
