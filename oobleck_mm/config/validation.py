"""The rules that relate fields of several sections to each other, run when a ``JobConfig`` is made:
each raises ``ConfigError`` naming the fields and carrying the numbers. The derived data shape (an HF
model's image size, the synthetic defaults) is filled in here too, before the rules read it."""

from __future__ import annotations

import dataclasses
from typing import Protocol

from oobleck_mm.config.emulation import auto_shrink, shrunk_model, valid_coarsenings
from oobleck_mm.config.huggingface import HFModelShape
from oobleck_mm.config.shape import (
    layer_specs,
    resolve_frozen,
    sequence_tokens,
)
from oobleck_mm.config.values import (
    ConfigError,
)
from oobleck_mm.config.cluster import ClusterConfig, PlanningConfig
from oobleck_mm.config.data import (
    DEFAULT_IMAGE_SIZE,
    SYNTHETIC_AUDIO_PROBABILITY,
    SYNTHETIC_IMAGES_PER_SAMPLE,
    DataConfig,
)
from oobleck_mm.config.fault_tolerance import FaultToleranceConfig
from oobleck_mm.config.model import ModelConfig
from oobleck_mm.config.training import (
    SCHEDULER_DEFAULT_WARMUP_STEPS,
    WARMUP_DECAY_DEFAULT_MAX_LR,
    TrainingConfig,
)


class Sections(Protocol):
    """What the rules read: a ``JobConfig`` (declared after them, in ``config.job``, which runs them)."""

    model: ModelConfig
    data: DataConfig
    training: TrainingConfig
    fault_tolerance: FaultToleranceConfig
    cluster: ClusterConfig
    planning: PlanningConfig


def validate(job: Sections) -> None:
    """Every rule that relates fields to each other; raises ConfigError carrying the numbers."""
    t, c, ft, m, d = job.training, job.cluster, job.fault_tolerance, job.model, job.data
    if t.global_batch % t.microbatch_size:
        below = t.global_batch - t.global_batch % t.microbatch_size
        nearest = ([below] if below else []) + [below + t.microbatch_size]
        raise ConfigError(
            f"training.global_batch ({t.global_batch}) must be a multiple of "
            f"training.microbatch_size ({t.microbatch_size}); nearest valid global batches: "
            + " or ".join(map(str, nearest))
        )
    if job.planning.microbatches_hint is not None:
        most = t.global_batch // t.microbatch_size
        if job.planning.microbatches_hint > most:
            raise ConfigError(
                f"planning.microbatches_hint ({job.planning.microbatches_hint}) exceeds "
                f"training.global_batch / training.microbatch_size ({most})"
            )
    if c.nodes < ft.f + 1:
        raise ConfigError(f"fault_tolerance.f ({ft.f}) needs at least {ft.f + 1} nodes, cluster.nodes is {c.nodes}")
    if ft.heartbeat_interval >= ft.heartbeat_timeout:
        raise ConfigError(
            f"fault_tolerance.heartbeat_interval ({ft.heartbeat_interval.total_seconds()}s) must be shorter than "
            f"fault_tolerance.heartbeat_timeout ({ft.heartbeat_timeout.total_seconds()}s)"
        )
    if c.max_gpus_per_stage > c.gpus_per_node:
        raise ConfigError(
            f"cluster.max_gpus_per_stage ({c.max_gpus_per_stage}) exceeds cluster.gpus_per_node ({c.gpus_per_node})"
        )
    if c.context_parallel == "auto" or c.context_parallel > 1:
        _validate_context_parallel(m, c)
    if c.backend == "nccl" and c.device == "cpu":
        raise ConfigError("cluster.backend: 'nccl' needs a GPU device, cluster.device is 'cpu'")
    _validate_scheduler(t)
    _validate_model(m)
    _validate_workload(m, d)
    if c.emulate is not None:
        _validate_emulation(m, d, c)


def _validate_context_parallel(m: ModelConfig, c: ClusterConfig) -> None:
    """What context parallelism runs on (``runtime.context_parallel``): the built-in or a HuggingFace model's
    sequence (their encoders run on whole media on every lane)."""
    where = f"cluster.context_parallel ({c.context_parallel})"
    if c.context_parallel == "auto":
        where += " (it may choose a degree above 1)"
    elif c.context_parallel > c.gpus_per_node:
        raise ConfigError(f"{where} exceeds cluster.gpus_per_node ({c.gpus_per_node}): its GPUs share a node")
    if c.context_parallel != "auto" and c.gpus_per_node % c.context_parallel:
        raise ConfigError(
            f"{where} must divide cluster.gpus_per_node ({c.gpus_per_node}): every stage spans that many GPUs"
        )
    if c.max_gpus_per_stage > 1:
        raise ConfigError(
            f"{where} and cluster.max_gpus_per_stage ({c.max_gpus_per_stage}): a stage either shards its layers "
            "or splits its tokens, not both yet; set cluster.max_gpus_per_stage: 1"
        )
    if m.builder is not None:
        raise ConfigError(
            f"{where}: a model.builder model attends with its own attention, which the engine cannot replace; "
            "valid: the built-in model (model.llm) or a model.huggingface one"
        )
    if c.emulate is not None:
        raise ConfigError(f"{where}: emulation runs stages of one GPU; valid: 1")


def _validate_emulation(m: ModelConfig, d: DataConfig, c: ClusterConfig) -> None:
    if m.huggingface is not None or m.builder is not None:
        key = "model.huggingface" if m.huggingface is not None else "model.builder"
        raise ConfigError(
            f"cluster.emulate: not yet available for a {key} model (its compute copy cannot be "
            "shrunk); valid: the built-in model sections (model.llm, model.vision, model.audio)"
        )
    if c.max_gpus_per_stage > 1:
        raise ConfigError(
            f"cluster.max_gpus_per_stage ({c.max_gpus_per_stage}): emulation runs stages of one GPU; valid: 1"
        )
    shrunk_model(m, c.emulate_shrink or auto_shrink(m))  # a divisor that leaves no width is named here
    factors = valid_coarsenings(m, d)
    if c.emulate_coarsen is not None and c.emulate_coarsen not in factors:
        raise ConfigError(
            f"cluster.emulate_coarsen ({c.emulate_coarsen}): a patch of {c.emulate_coarsen} x "
            f"{m.vision.patch_size} px does not tile data.image_size ({d.image_size}) and "
            f"data.min_image_size ({d.min_image_size}) exactly; valid: "
            f"{', '.join(map(str, factors[:12]))}"
        )


def _validate_scheduler(t: TrainingConfig) -> None:
    if t.scheduler is None:
        return
    params = t.scheduler.params
    path = "training.scheduler.params"
    if t.scheduler.type == "OneCycle":
        missing = [k for k in ("cycle_min_lr", "cycle_max_lr") if k not in params]
        if missing:
            raise ConfigError(
                f"{path}.{missing[0]}: required by OneCycle (its lr cycles between cycle_min_lr and cycle_max_lr)"
            )
        return
    warmup = params.get("warmup_num_steps", SCHEDULER_DEFAULT_WARMUP_STEPS)
    total = t.scheduler.total_steps(t.steps)
    if t.scheduler.needs_total_steps and total < warmup:
        given = "" if "total_num_steps" in params else ", training.steps: its default"
        raise ConfigError(f"{path}.total_num_steps ({total}{given}) must be >= {path}.warmup_num_steps ({warmup})")
    if "warmup_min_lr" in params:
        # DeepSpeed's WarmupLR peaks at the optimizer's lr by default, WarmupDecayLR at 0.001.
        default_max = t.optimizer.params.lr if t.scheduler.type == "WarmupLR" else WARMUP_DECAY_DEFAULT_MAX_LR
        peak = params.get("warmup_max_lr", default_max)
        if params["warmup_min_lr"] > peak:
            raise ConfigError(f"{path}.warmup_min_lr ({params['warmup_min_lr']}) exceeds the warmup peak lr ({peak})")


def _validate_model(m: ModelConfig) -> None:
    for prefix, enc in (("model.llm", m.llm), ("model.vision", m.vision), ("model.audio", m.audio)):
        if enc is not None and enc.hidden % enc.num_heads:
            raise ConfigError(
                f"{prefix}.hidden ({enc.hidden}) must be divisible by {prefix}.num_heads ({enc.num_heads})"
            )
    if m.llm.num_heads % m.llm.num_kv_heads:
        raise ConfigError(
            f"model.llm.num_heads ({m.llm.num_heads}) must be divisible by "
            f"model.llm.num_kv_heads ({m.llm.num_kv_heads})"
        )


def derive_data_shape(m: ModelConfig, d: DataConfig) -> None:
    """The workload shape a user did not give, from what the engine can read: an HF vision tower's image
    side from its config, synthetic data's means from their defaults. A ``llava_json`` file's means are
    left None here and measured by the master's pass over the data (``data.check.measure_shape``)."""
    if d.image_size is None:
        d.image_size = m.hf.vision["image_size"] if m.hf is not None and m.hf.vision is not None else DEFAULT_IMAGE_SIZE
    if d.min_image_size is None:
        d.min_image_size = d.image_size
    if d.min_image_size > d.image_size:
        raise ConfigError(f"data.min_image_size ({d.min_image_size}) must be <= data.image_size ({d.image_size})")
    if d.kind == "synthetic" and d.mean_images_per_sample is None:
        d.mean_images_per_sample = SYNTHETIC_IMAGES_PER_SAMPLE if m.vision is not None else 0.0
    whisper = m.hf.audio_clip_frames if m.hf is not None and d.kind == "synthetic" else 0
    if whisper:  # every clip is the tower's length, in a fixed share of the samples: the mean follows
        mean = round(SYNTHETIC_AUDIO_PROBABILITY * whisper / d.audio_frames_per_second, 9)
        if d.mean_audio_seconds is not None and d.mean_audio_seconds != mean:
            raise ConfigError(
                f"data.mean_audio_seconds ({d.mean_audio_seconds}): the Whisper tower of model.huggingface.audio "
                f"takes clips of {whisper} mel frames ({whisper / d.audio_frames_per_second:g} s at "
                f"data.audio_frames_per_second {d.audio_frames_per_second:g}), as its feature extractor pads "
                f"them, in {SYNTHETIC_AUDIO_PROBABILITY:.0%} of synthetic samples: {mean:g} (or leave it out)"
            )
        d.mean_audio_seconds = mean
    if d.mean_audio_seconds is None and (m.audio is None or d.kind == "synthetic"):
        d.mean_audio_seconds = 0.0  # (synthetic with an audio encoder: the rule below asks for it)


def shape_measured(d: DataConfig) -> bool:
    """Whether the data's means are known (a ``llava_json`` file's once the master read it)."""
    return d.mean_text_tokens is not None and d.mean_images_per_sample is not None and d.mean_audio_seconds is not None


def _validate_workload(m: ModelConfig, d: DataConfig) -> None:
    if d.kind != "synthetic" and d.path is None:
        raise ConfigError(f"data.path: required when data.kind is {d.kind!r}")
    derive_data_shape(m, d)
    # An encoder with no input would be costed as idle, silently skewing the plan.
    if d.mean_images_per_sample is not None and (m.vision is None) != (d.mean_images_per_sample == 0):
        measured = "" if d.kind == "synthetic" else f", as measured over {d.path}"
        raise ConfigError(
            f"data.mean_images_per_sample ({d.mean_images_per_sample}{measured}) must be > 0 exactly when "
            f"model.vision is set (model.vision is {'set' if m.vision else 'not set'})"
        )
    if d.mean_audio_seconds is not None and (m.audio is None) != (d.mean_audio_seconds == 0):
        measured = "" if d.kind == "synthetic" else f", as measured over {d.path}"
        raise ConfigError(
            f"data.mean_audio_seconds ({d.mean_audio_seconds}{measured}) must be > 0 exactly when model.audio is "
            f"set (model.audio is {'set' if m.audio else 'not set'})"
        )
    if m.vision is not None and d.image_size % m.vision.patch_size:
        raise ConfigError(
            f"data.image_size ({d.image_size}) must be a multiple of model.vision.patch_size ({m.vision.patch_size})"
        )
    if m.hf is not None:
        _validate_hf_workload(m.hf, d)
    if shape_measured(d):
        tokens = sequence_tokens(m, d)
        if tokens.llm > d.max_seq_len:
            raise ConfigError(
                f"data.max_seq_len ({d.max_seq_len}) is below the mean LLM tokens per sample ({tokens.llm:g} = "
                f"{tokens.text:g} text + {tokens.vision_llm:g} image + {tokens.audio_llm:g} audio)"
            )
        specs = layer_specs(m, d)
    else:  # the layers' names and order do not depend on the means, still to be measured
        specs = layer_specs(
            m,
            dataclasses.replace(
                d,
                mean_text_tokens=1.0,
                mean_images_per_sample=1.0 if m.vision else 0.0,
                mean_audio_seconds=1.0 if m.audio else 0.0,
            ),
        )
    try:
        frozen = resolve_frozen(m.frozen, specs)
    except ValueError as exc:
        raise ConfigError(f"model.frozen: {exc}") from None
    if m.llm.tie_embeddings and ("llm.embed" in frozen) != ("llm.head" in frozen):
        which = "llm.embed" if "llm.embed" in frozen else "llm.head"
        raise ConfigError(
            f"model.frozen: freezes {which} but not its tied partner; the token embedding and the "
            "LM head are one matrix (tied embeddings): freeze both or neither"
        )


def _validate_hf_workload(hf: HFModelShape, d: DataConfig) -> None:
    if hf.vision is not None:
        side = hf.vision["image_size"]
        # The towers' position embeddings have one row per patch of this square image.
        if d.image_size != side or d.min_image_size != side:
            raise ConfigError(
                f"data.image_size ({d.image_size}) and data.min_image_size ({d.min_image_size}) must both be "
                f"{side}: the {hf.vision_type} tower of model.huggingface takes {side}x{side} images"
            )
    if hf.sliding_window is not None and d.max_seq_len > hf.sliding_window:
        raise ConfigError(
            f"data.max_seq_len ({d.max_seq_len}) exceeds the model's sliding_window ({hf.sliding_window}); "
            "sliding-window attention is not run by the engine yet, so keep samples within the window"
        )
