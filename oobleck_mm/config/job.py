"""The job's sections as validated dataclasses, the cross-field rules, and YAML/dict parsing.

A job file has seven sections (``model``, ``data``, ``training``,
``fault_tolerance``, ``cluster``, ``planning``, ``balance``); only ``model`` is
required. Each section is a ``@dataclass(kw_only=True, slots=True)`` whose
``__post_init__`` checks (and normalises) its own fields; rules that relate
fields to each other live in one function, ``validate(job)``, which
``JobConfig`` runs on construction. Every mistake raises ``ConfigError`` whose
message starts with the dotted path of the field and carries the bad value and
what would be valid, so the CLI can print it as one line.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import types
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field
from datetime import timedelta
from typing import Any, ClassVar, Union, get_args, get_origin, get_type_hints

from oobleck_mm.config.devices import DEVICES
from oobleck_mm.config.emulation import auto_shrink, shrunk_model, valid_coarsenings
from oobleck_mm.config.fault_tolerance import FaultToleranceConfig
from oobleck_mm.config.huggingface import HFModelShape, hf_model_shape
from oobleck_mm.config.shape import (
    DEFAULT_IMAGE_SIZE,
    SYNTHETIC_IMAGES_PER_SAMPLE,
    SYNTHETIC_TEXT_TOKENS,
    layer_specs,
    resolve_frozen,
    sequence_tokens,
)
from oobleck_mm.config.values import (
    ConfigError,
    as_bandwidth,
    as_bool,
    as_choice,
    as_float,
    as_int,
    as_size,
    as_str,
    as_str_tuple,
    check,
    check_optional,
    describe,
    reject_unknown,
)


# --------------------------------------------------------------------------- model


MAX_GPUS_PER_NODE = 256
MAX_NODES = 4096
_NODES_WHY = "the planner makes a template for every node count up to it"
MAX_TOWER_LAYERS = 1024
"""Most blocks one tower may have: the largest published models have under 200, and the planner's
tables grow with the square of the layer count (1024 plans in about a second, 4096 takes 1.2 GB)."""
_LAYERS_WHY = "the planner's tables grow with the square of the layer count"


@dataclass(kw_only=True, slots=True)
class LLMConfig:
    _PATH: ClassVar[str] = "model.llm"
    num_layers: int
    """Transformer blocks of the language model."""
    hidden: int
    """Model width."""
    num_heads: int
    """Attention heads (query heads)."""
    num_kv_heads: int | None = None
    """Key/value heads for grouped-query attention; default: ``num_heads`` (plain multi-head)."""
    ffn_hidden: int | None = None
    """FFN inner width; default ``4 * hidden``."""
    vocab_size: int
    """Vocabulary size (token embedding rows and LM-head outputs)."""
    gated_ffn: bool = False
    """SwiGLU-style FFN with three matrices (Llama, Qwen) instead of two (GPT)."""
    tie_embeddings: bool = False
    """LM head shares the token-embedding matrix (counted once in the model's parameters)."""

    def __post_init__(self) -> None:
        check(self, "num_layers", as_int, minimum=1, maximum=MAX_TOWER_LAYERS, why=_LAYERS_WHY)
        for name in ("hidden", "num_heads", "vocab_size"):
            check(self, name, as_int, minimum=1)
        check_optional(self, "num_kv_heads", as_int, minimum=1)
        check_optional(self, "ffn_hidden", as_int, minimum=1)
        check(self, "gated_ffn", as_bool)
        check(self, "tie_embeddings", as_bool)
        self.num_kv_heads = self.num_heads if self.num_kv_heads is None else self.num_kv_heads
        self.ffn_hidden = 4 * self.hidden if self.ffn_hidden is None else self.ffn_hidden


@dataclass(kw_only=True, slots=True)
class VisionConfig:
    _PATH: ClassVar[str] = "model.vision"
    num_layers: int
    """Transformer blocks of the ViT encoder."""
    hidden: int
    num_heads: int
    ffn_hidden: int | None = None
    """FFN inner width; default ``4 * hidden``."""
    patch_size: int = 14
    """Square patch side in pixels; one patch is one encoder token."""
    in_channels: int = 3
    token_merge: int = 1
    """Encoder tokens concatenated into one before the projector (Qwen2-VL's 2x2 merger is 4;
    OrchMLLM's "downsample before the connector"). The LLM sees patches / token_merge tokens."""

    def __post_init__(self) -> None:
        check(self, "num_layers", as_int, minimum=1, maximum=MAX_TOWER_LAYERS, why=_LAYERS_WHY)
        for name in ("hidden", "num_heads", "patch_size", "in_channels", "token_merge"):
            check(self, name, as_int, minimum=1)
        check_optional(self, "ffn_hidden", as_int, minimum=1)
        self.ffn_hidden = 4 * self.hidden if self.ffn_hidden is None else self.ffn_hidden


@dataclass(kw_only=True, slots=True)
class AudioConfig:
    _PATH: ClassVar[str] = "model.audio"
    num_layers: int
    """Transformer blocks of the audio encoder (Whisper-style)."""
    hidden: int
    num_heads: int
    ffn_hidden: int | None = None
    """FFN inner width; default ``4 * hidden``."""
    mel_bins: int = 80
    """Mel-spectrogram features per input frame."""
    downsample: int = 2
    """Input frames folded into one encoder token by the frame embedding (Whisper's stride-2 conv is 2)."""
    token_merge: int = 1
    """Encoder tokens concatenated into one before the projector (the LLM sees frames / token_merge)."""

    def __post_init__(self) -> None:
        check(self, "num_layers", as_int, minimum=1, maximum=MAX_TOWER_LAYERS, why=_LAYERS_WHY)
        for name in ("hidden", "num_heads", "mel_bins", "downsample", "token_merge"):
            check(self, name, as_int, minimum=1)
        check_optional(self, "ffn_hidden", as_int, minimum=1)
        self.ffn_hidden = 4 * self.hidden if self.ffn_hidden is None else self.ffn_hidden


@dataclass(kw_only=True, slots=True)
class ProjectorConfig:
    _PATH: ClassVar[str] = "model.projector"
    num_layers: int = 1
    """Linear layers of each encoder's MLP projector into the LLM width (1 or 2)."""

    def __post_init__(self) -> None:
        check(self, "num_layers", as_int, minimum=1)
        if self.num_layers > 2:
            raise ConfigError(f"model.projector.num_layers: must be 1 or 2, got {self.num_layers}")


# Module names `model.frozen` accepts besides exact layer names (see spec.resolve_frozen).
FROZEN_MODULES = ("vision", "audio", "projector", "llm")


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    _PATH: ClassVar[str] = "model"
    name: str = ""
    """Model name, used for profile caching and logs; default: the ``huggingface`` folder's name."""
    huggingface: str | None = None
    """A local ``transformers`` model directory (config.json, optionally safetensors weights and
    tokenizer files); its config.json gives the model's shape, so ``llm``, ``vision``, ``audio`` and
    ``projector`` are not set with it. See docs/models.md for the supported architectures."""
    builder: str | None = None
    """Your own model: ``package.module:function`` or ``path/to/file.py:function`` returning its
    layers (``oobleck_mm.config.shape.CustomLayer``, contract in docs/models.md). The ``llm`` (and
    ``vision``/``audio``) sections still describe the inputs the data pipeline makes."""
    llm: LLMConfig | None = None
    """The built-in language model; required unless ``huggingface`` is set."""
    vision: VisionConfig | None = None
    """Image encoder; absent for a text-only model."""
    audio: AudioConfig | None = None
    """Audio encoder; absent when the model takes no audio."""
    projector: ProjectorConfig = field(default_factory=ProjectorConfig)
    """Shape of the projector each encoder has."""
    frozen: tuple[str, ...] = ()
    """Modules whose weights are not trained: any of vision, audio, projector, llm, or exact
    layer names (``llm.block0``; ``vision.projector`` covers ``vision.projector0/1``)."""

    def __post_init__(self) -> None:
        if self.name != "":
            check(self, "name", as_str)
        check(self, "frozen", as_str_tuple)
        check_optional(self, "huggingface", as_str)
        check_optional(self, "builder", as_str)
        if self.builder is not None and self.huggingface is not None:
            raise ConfigError("model.builder: cannot be set together with model.huggingface; choose one")
        if self.huggingface is None:
            if self.llm is None:
                raise ConfigError(
                    "model.llm: required but missing (or set model.huggingface to a local transformers model directory)"
                )
            if not self.name:
                raise ConfigError("model.name: required but missing")
            return
        self.huggingface = os.path.abspath(os.path.expanduser(self.huggingface))
        shape = hf_shape(self.huggingface)
        derived = shape.sections()
        llm = LLMConfig(**derived["llm"])
        vision = VisionConfig(**derived["vision"]) if "vision" in derived else None
        projector = ProjectorConfig(**derived.get("projector", {}))
        # A section equal to the derived one is what to_dict/asdict round trips carry; any other is a conflict.
        given = {"llm": (self.llm, llm), "vision": (self.vision, vision), "audio": (self.audio, None)}
        for key, (mine, theirs) in given.items():
            if mine is not None and mine != theirs:
                raise ConfigError(
                    f"model.{key}: cannot be set together with model.huggingface (the directory's "
                    "config.json gives the model's shape); remove one of them"
                )
        self.llm, self.vision, self.projector = llm, vision, projector
        self.name = self.name or os.path.basename(self.huggingface.rstrip(os.sep))

    @property
    def hf(self) -> HFModelShape | None:
        """The ``huggingface`` directory's model, or None for a built-in model."""
        return hf_shape(self.huggingface) if self.huggingface is not None else None


@functools.lru_cache(maxsize=8)
def hf_shape(directory: str) -> HFModelShape:
    """config.json read once per process (every layer build asks for it)."""
    return hf_model_shape(directory)


# --------------------------------------------------------------------------- data


@dataclass(kw_only=True, slots=True)
class DataConfig:
    _PATH: ClassVar[str] = "data"
    kind: str = "synthetic"
    """``synthetic`` (generated from the shape below) or ``llava_json`` (a LLaVA-style JSON file)."""
    path: str | None = None
    """Dataset file; required for ``llava_json``."""
    image_dir: str | None = None
    """Folder the ``llava_json`` image paths are relative to; a relative folder is taken relative
    to the JSON file's folder. Default: the JSON file's folder."""
    seed: int = 0
    """Seed of the synthetic samples (each sample is a function of (seed, index) only)."""
    num_samples: int = 100000
    """Samples of the synthetic dataset (one epoch)."""
    mean_text_tokens: float | None = None
    """Mean text tokens per sample (planning workload shape; the synthetic text lengths' mean).
    Default: ``SYNTHETIC_TEXT_TOKENS`` for synthetic data; for ``llava_json``, measured by the master's
    pass over the data (``data.check.measure_shape``) before anything is planned."""
    text_length_sigma: float = 0.8
    """Synthetic text lengths are lognormal with mean ``mean_text_tokens`` and this sigma of the
    log (0: every sample has the mean length); larger values give a heavier tail."""
    mean_images_per_sample: float | None = None
    """Mean images per sample; must be > 0 exactly when the model has a vision encoder. Default: for
    synthetic data ``SYNTHETIC_IMAGES_PER_SAMPLE`` with a vision encoder (0 without); for ``llava_json``,
    measured by the master's pass over the data."""
    max_images_per_sample: int = 4
    """Most images of one synthetic sample (their count is binomial, 0..this, with the mean above)."""
    image_size: int | None = None
    """Largest image side in pixels after preprocessing (the planner's image is this square). Default:
    the side an HF model's vision tower takes (its config's ``image_size``), else ``DEFAULT_IMAGE_SIZE``."""
    min_image_size: int | None = None
    """Smallest side of a synthetic image (rounded up to the patch size); sides are drawn between it
    and ``image_size``, so images need not be square. Default: ``image_size`` (fixed size)."""
    mean_audio_seconds: float = 0.0
    """Mean audio seconds per sample; must be > 0 exactly when the model has an audio encoder."""
    audio_frames_per_second: float = 100.0
    """Mel frames per second of audio (10 ms hop)."""
    max_seq_len: int = 2048
    """Longest LLM sequence (text + projected image/audio tokens) a sample may have."""
    loss_on: str = "assistant"
    """``llava_json``: which text the loss covers: ``assistant`` (the answers, LLaVA's recipe) or
    ``all`` (every text token). Synthetic samples are trained on all their text."""
    check_images: str = "decode"
    """``llava_json``: how the master checks every image before the first step: ``decode`` (each
    image decoded once, a few ms each, with progress: a truncated file is found before training) or
    ``header`` (sizes only, for very large datasets; a body that does not decode then stops the job
    with exit 2 when its sample is first loaded)."""
    cache_dir: str | None = "~/.cache/oobleck_mm/datasets"
    """``llava_json`` on an HF model: where the tokenized records are kept, built by the first rank of a
    node and memory-mapped by the others and by joiners (``data/record_cache.py``); a local disk, not a
    shared one (each node builds its own). ``null``: every rank tokenizes the file itself."""
    skip_bad_samples: bool = False
    """``llava_json``: a sample whose record or files are bad is logged and left out instead of
    stopping the job (exit 2 naming it). The global batch keeps its size (``--skip-bad-samples``)."""
    excluded_samples: tuple[int, ...] = ()
    """``llava_json``: positions in the JSON file of the samples every rank leaves out. The master
    writes the bad ones it found here (with ``skip_bad_samples``) into the config its workers get, so
    every rank and every resume leaves out the same ones; may also be set by hand."""

    def __post_init__(self) -> None:
        check(self, "kind", as_choice, ("synthetic", "llava_json"))
        check_optional(self, "path", as_str)
        if self.path is not None:
            self.path = os.path.expanduser(self.path)
            if not os.path.exists(self.path):
                raise ConfigError(f"data.path: file {self.path!r} does not exist")
        check_optional(self, "image_dir", as_str)
        if self.image_dir is not None:
            self.image_dir = os.path.expanduser(self.image_dir)
            self._check_image_dir()
        check(self, "seed", as_int, minimum=0)
        check(self, "num_samples", as_int, minimum=1)
        if self.mean_text_tokens is None and self.kind == "synthetic":
            self.mean_text_tokens = SYNTHETIC_TEXT_TOKENS
        check_optional(self, "mean_text_tokens", as_float, positive=True)
        check(self, "text_length_sigma", as_float, minimum=0.0)
        check_optional(self, "mean_images_per_sample", as_float, minimum=0.0)
        check(self, "max_images_per_sample", as_int, minimum=0)
        if (
            self.kind == "synthetic"
            and (self.mean_images_per_sample or 0) > 0
            and self.max_images_per_sample < max(1.0, self.mean_images_per_sample)
        ):
            raise ConfigError(
                f"data.max_images_per_sample ({self.max_images_per_sample}) must be >= 1 and >= "
                f"data.mean_images_per_sample ({self.mean_images_per_sample})"
            )
        check_optional(self, "image_size", as_int, minimum=1)
        check_optional(self, "min_image_size", as_int, minimum=1)
        if self.image_size is not None and self.min_image_size is None:
            self.min_image_size = self.image_size
        if self.image_size is not None and self.min_image_size > self.image_size:
            raise ConfigError(
                f"data.min_image_size ({self.min_image_size}) must be <= data.image_size ({self.image_size})"
            )
        check(self, "mean_audio_seconds", as_float, minimum=0.0)
        check(self, "audio_frames_per_second", as_float, positive=True)
        check(self, "max_seq_len", as_int, minimum=1)
        check(self, "loss_on", as_choice, ("assistant", "all"))
        check(self, "check_images", as_choice, ("decode", "header"))
        check(self, "skip_bad_samples", as_bool)
        check_optional(self, "cache_dir", as_str)
        if self.cache_dir is not None:
            self.cache_dir = os.path.expanduser(self.cache_dir)
        if not isinstance(self.excluded_samples, (list, tuple)):
            raise ConfigError(
                f"data.excluded_samples: expected a list of sample positions, got {self.excluded_samples!r}"
            )
        self.excluded_samples = tuple(
            sorted({as_int(f"data.excluded_samples[{i}]", v, minimum=0) for i, v in enumerate(self.excluded_samples)})
        )

    def _check_image_dir(self) -> None:
        # Only checkable once the JSON file is known: a relative folder hangs off the JSON's folder.
        if self.path is None:
            return
        folder = os.path.join(os.path.dirname(os.path.abspath(self.path)), self.image_dir)
        if not os.path.isdir(folder):
            raise ConfigError(f"data.image_dir: folder {folder!r} does not exist")


# --------------------------------------------------------------------------- training


@dataclass(kw_only=True, slots=True)
class OptimizerParams:
    _PATH: ClassVar[str] = "training.optimizer.params"
    lr: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        check(self, "lr", as_float, positive=True)
        if not isinstance(self.betas, (list, tuple)) or len(self.betas) != 2:
            raise ConfigError(f"{self._PATH}.betas: expected two numbers [beta1, beta2], got {describe(self.betas)}")
        self.betas = tuple(
            as_float(f"{self._PATH}.betas[{i}]", b, minimum=0.0, below=1.0) for i, b in enumerate(self.betas)
        )
        check(self, "eps", as_float, positive=True)
        check(self, "weight_decay", as_float, minimum=0.0)


@dataclass(kw_only=True, slots=True)
class OptimizerConfig:
    _PATH: ClassVar[str] = "training.optimizer"
    type: str = "AdamW"
    """``AdamW`` (decoupled weight decay) or ``Adam``."""
    params: OptimizerParams = field(default_factory=OptimizerParams)

    def __post_init__(self) -> None:
        check(self, "type", as_choice, ("AdamW", "Adam"))


def _warmup_type(path: str, value: Any) -> str:
    return as_choice(path, value, ("log", "linear"))


# DeepSpeed's runtime/lr_schedules.py argument names and meanings, per scheduler.
_SCHEDULER_PARAMS: dict[str, dict[str, Any]] = {
    "WarmupLR": {
        "warmup_min_lr": lambda p, v: as_float(p, v, minimum=0.0),
        "warmup_max_lr": lambda p, v: as_float(p, v, positive=True),
        "warmup_num_steps": lambda p, v: as_int(p, v, minimum=1),
        "warmup_type": _warmup_type,
    },
    "WarmupDecayLR": {
        "total_num_steps": lambda p, v: as_int(p, v, minimum=1),
        "warmup_min_lr": lambda p, v: as_float(p, v, minimum=0.0),
        "warmup_max_lr": lambda p, v: as_float(p, v, positive=True),
        "warmup_num_steps": lambda p, v: as_int(p, v, minimum=1),
        "warmup_type": _warmup_type,
    },
    "WarmupCosineLR": {
        "total_num_steps": lambda p, v: as_int(p, v, minimum=1),
        "warmup_min_ratio": lambda p, v: as_float(p, v, minimum=0.0, maximum=1.0),
        "warmup_num_steps": lambda p, v: as_int(p, v, minimum=1),
        "cos_min_ratio": lambda p, v: as_float(p, v, minimum=0.0, maximum=1.0),
        "warmup_type": _warmup_type,
    },
    # DeepSpeed's OneCycle: lr up then down over two half cycles, then decay; Adam's beta1 cycled inversely.
    "OneCycle": {
        "cycle_min_lr": lambda p, v: as_float(p, v, minimum=0.0),
        "cycle_max_lr": lambda p, v: as_float(p, v, positive=True),
        "decay_lr_rate": lambda p, v: as_float(p, v, minimum=0.0),
        "cycle_first_step_size": lambda p, v: as_int(p, v, minimum=1),
        "cycle_second_step_size": lambda p, v: as_int(p, v, minimum=0),
        "cycle_first_stair_count": lambda p, v: as_int(p, v, minimum=0),
        "cycle_second_stair_count": lambda p, v: as_int(p, v, minimum=0),
        "decay_step_size": lambda p, v: as_int(p, v, minimum=0),
        "cycle_momentum": lambda p, v: as_bool(p, v),
        "cycle_min_mom": lambda p, v: as_float(p, v, minimum=0.0, below=1.0),
        "cycle_max_mom": lambda p, v: as_float(p, v, minimum=0.0, below=1.0),
        "decay_mom_rate": lambda p, v: as_float(p, v, minimum=0.0),
    },
}
# DeepSpeed's own defaults, used by the cross-field checks on what it will run.
SCHEDULER_DEFAULT_WARMUP_STEPS = 1000
WARMUP_DECAY_DEFAULT_MAX_LR = 0.001


@dataclass(kw_only=True, slots=True)
class SchedulerConfig:
    _PATH: ClassVar[str] = "training.scheduler"
    type: str = "WarmupLR"
    """``WarmupLR``, ``WarmupDecayLR``, ``WarmupCosineLR`` or ``OneCycle`` (DeepSpeed semantics)."""
    params: dict[str, Any] = field(default_factory=dict)
    """DeepSpeed's argument names: warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type
    (log|linear), total_num_steps (defaults to training.steps), warmup_min_ratio, cos_min_ratio."""

    def __post_init__(self) -> None:
        check(self, "type", as_choice, tuple(_SCHEDULER_PARAMS))
        if self.params is None:
            self.params = {}
        if not isinstance(self.params, Mapping):
            raise ConfigError(f"training.scheduler.params: expected a mapping, got {describe(self.params)}")
        allowed = _SCHEDULER_PARAMS[self.type]
        reject_unknown(self.params, tuple(allowed), "training.scheduler.params", f" for {self.type}")
        self.params = {k: allowed[k](f"training.scheduler.params.{k}", v) for k, v in self.params.items()}

    @property
    def needs_total_steps(self) -> bool:
        return "total_num_steps" in _SCHEDULER_PARAMS[self.type]

    def total_steps(self, training_steps: int) -> int:
        """``total_num_steps``, or the job's ``training.steps`` when it is not set."""
        return int(self.params.get("total_num_steps", training_steps))

    def deepspeed_params(self, training_steps: int) -> dict[str, Any]:
        """The arguments of DeepSpeed's scheduler of this type (``total_num_steps`` filled in where it takes it)."""
        params = dict(self.params)
        if self.needs_total_steps:
            params["total_num_steps"] = self.total_steps(training_steps)
        return params


@dataclass(kw_only=True, slots=True)
class LossScaleConfig:
    """float16's loss scaling, with DeepSpeed's ``fp16`` keys and meanings."""

    _PATH: ClassVar[str] = "training.fp16"
    loss_scale: float = 0.0
    """0: dynamic loss scaling; a positive value: that static scale."""
    initial_scale_power: int = 16
    """The dynamic scale starts at 2 ** this."""
    loss_scale_window: int = 1000
    """Steps without an overflow before the scale doubles."""
    hysteresis: int = 2
    """Overflows tolerated (each skipping its step) before the scale halves."""
    consecutive_hysteresis: bool = False
    """Restore the hysteresis after every step without an overflow (DeepSpeed's option)."""
    min_loss_scale: float = 1.0
    """The scale never drops below it (the step is still skipped on an overflow)."""

    def __post_init__(self) -> None:
        check(self, "loss_scale", as_float, minimum=0.0)
        check(self, "initial_scale_power", as_int, minimum=0)
        check(self, "loss_scale_window", as_int, minimum=1)
        check(self, "hysteresis", as_int, minimum=1)
        check(self, "consecutive_hysteresis", as_bool)
        check(self, "min_loss_scale", as_float, positive=True)


@dataclass(kw_only=True, slots=True)
class TrainingConfig:
    _PATH: ClassVar[str] = "training"
    global_batch: int = 16
    """Samples per iteration over all pipelines."""
    microbatch_size: int = 2
    """Samples per microbatch; global_batch must be a multiple of it."""
    steps: int = 10
    """Iterations to train."""
    seed: int = 0
    dtype: str = "float32"
    """Compute dtype of the layers: ``float32``, ``float64``, ``bfloat16`` or ``float16``. When it
    differs from ``master_dtype`` the run is mixed precision: layers compute in this type, every
    trainable layer keeps master weights and Adam moments in ``master_dtype``."""
    master_dtype: str | None = None
    """Dtype of the master weights, Adam moments and gradient accumulation: ``float32`` or
    ``float64``; default ``float32`` for the half types, else ``dtype`` itself. float32 compute
    with float64 masters is the mixed-precision path in a mode exact enough to test (1e-9)."""
    grad_reduce_dtype: str = "float32"
    """Dtype gradients are all-reduced in under mixed precision (``float32`` or ``bfloat16``,
    which halves the bytes); they are accumulated, clipped and applied in ``master_dtype``."""
    grad_overlap: bool = True
    """Start the cross-pipeline gradient all-reduce of each bucket (``grad_bucket_mb``) as soon as the step's
    last backward has made its gradients, while earlier layers still compute (DDP's reducer idea), instead of
    after the whole backward. The sums are the same values either way."""
    grad_bucket_mb: float = 25.0
    """Megabytes of gradients per all-reduce (whole layers, last layer first; DDP's ``bucket_cap_mb``): smaller
    starts sooner and overlaps more, larger costs fewer collectives."""
    tf32: bool = False
    """``dtype: float32`` only: matmuls and convolutions on a GPU's TF32 tensor cores (Ampere and
    later; 10-bit mantissa inputs, fp32 accumulation). The workers set torch's ``fp32_precision``
    (matmul and cuDNN) to ``tf32`` and the cost model prices float32 at the TF32 rate. false: full
    FP32 (``ieee``, torch's default for matmuls; an A100 does 19.5 TFLOP/s of them, 156 in TF32)."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig | None = None
    """Learning-rate schedule; absent keeps the optimizer's lr constant."""
    gradient_clipping: float = 0.0
    """Global gradient-norm clip; 0 turns clipping off."""
    activation_checkpointing: bool = False
    """Keep only each layer's input from forward and recompute the rest in backward."""
    flash_attention: bool = True
    """Attention that never materialises the score matrix (FlashAttention / torch SDPA): the
    cost model then keeps no quadratic activation memory. false models eager attention."""
    fp16: LossScaleConfig = field(default_factory=LossScaleConfig)
    """Loss scaling of ``dtype: float16`` (ignored otherwise): an overflow on any rank skips the
    step on every rank and lowers the scale."""
    zero_stage: int = 3
    """How a stage of several GPUs (``cluster.max_gpus_per_stage`` above 1) shards its layers over its GPUs,
    in DeepSpeed's ZeRO terms (``zero_optimization.stage`` of a ``--deepspeed`` file sets it). 3: parameters,
    gradients and optimizer state sharded (FSDP2), a layer's parameters gathered for each microbatch's forward
    and again for its backward. 1 or 2: the same shards, but a layer's parameters stay gathered from a
    microbatch's forward until its backward (one all-gather less per microbatch, whole parameters held
    meanwhile; ZeRO-1's whole gradients are not kept: they are sharded as in 2). Replicas of a layer in
    different pipelines stay whole copies of each other: recovery copies a lost layer from any of them."""

    def __post_init__(self) -> None:
        for name in ("global_batch", "microbatch_size", "steps"):
            check(
                self,
                name,
                as_int,
                minimum=1,
                maximum=MAX_COUNT,
                why="the steps and samples the control plane counts are 64-bit; no job comes near",
            )
        check(
            self,
            "global_batch",
            as_int,
            minimum=1,
            maximum=MAX_GLOBAL_BATCH,
            why="planning holds every microbatch of a step; the largest published batches are ~10^4 samples",
        )
        check(self, "seed", as_int, minimum=0, maximum=2**63 - 1, why="a 64-bit seed")
        check(self, "dtype", as_choice, ("float32", "float64", "bfloat16", "float16"))
        # Left None when unset (oobleck_mm.precision.master_dtype resolves it), so a job copied with
        # another dtype (dataclasses.replace) keeps a consistent default.
        check_optional(self, "master_dtype", as_choice, ("float32", "float64"))
        if self.dtype == "float64" and self.master_dtype == "float32":
            raise ConfigError(
                "training.master_dtype: must be float64 when training.dtype is float64 "
                f"(masters at least as precise as the compute), got {self.master_dtype!r}"
            )
        check(self, "grad_reduce_dtype", as_choice, ("float32", "bfloat16"))
        check(self, "tf32", as_bool)
        check(self, "grad_overlap", as_bool)
        check(self, "grad_bucket_mb", as_float, positive=True, maximum=MAX_BUCKET_MB)
        if self.tf32 and self.dtype != "float32":
            raise ConfigError(
                f"training.tf32: true applies to training.dtype float32 (its matmuls run in TF32), "
                f"got dtype {self.dtype!r}; remove tf32 or set dtype: float32"
            )
        check(self, "gradient_clipping", as_float, minimum=0.0)
        check(self, "activation_checkpointing", as_bool)
        check(self, "flash_attention", as_bool)
        check(self, "zero_stage", as_int, minimum=1, maximum=3)
        # No derived default is written into the scheduler's params: ``total_num_steps`` left unset follows
        # ``steps`` wherever it is read (``SchedulerConfig.total_steps``), so ``--steps`` and ``--set
        # training.steps`` applied after the file move it too (a default filled in here stayed at the file's).


# --------------------------------------------------------------------------- fault tolerance, cluster, planning


MAX_COUNT = 2**53
"""The most steps (or samples in a batch) a job may ask for: counts travel as 64-bit integers and as
JSON numbers (exact to 2**53); ``training.steps: 100000000000000000000000`` ended as an internal error."""

MAX_BUCKET_MB = 2.0**20
"""``training.grad_bucket_mb`` at most a terabyte: no stage's gradients come near. A bucket above a stage's
gradients is legal (the stage's gradients go as one all-reduce, which starts when its backward ends); the
default 25 MB is above every stage of the test models."""
MAX_GLOBAL_BATCH = 2**20
"""The most samples a step may have: the batch split and the balancer hold each microbatch of a step, and
``training.global_batch: 1073741824`` made ``plan`` run out of host memory (an OOM kill of 23.5 GB, found
by tests/unit/test_fuzz_inputs.py in CI). A million samples is ~100x the largest published batches."""

RUN_DEVICES = ("cpu", "cuda")
"""What ``cluster.device`` may be: where the workers run."""


@dataclass(kw_only=True, slots=True)
class ClusterConfig:
    _PATH: ClassVar[str] = "cluster"
    nodes: int = 2
    """Nodes the job starts with."""
    max_nodes: int | None = None
    """Most nodes the job runs on: an agent registering beyond it is refused (exit 2, the reason in
    its log). None: no limit. ``--nodes MIN:MAX`` sets both, as torchrun's ``--nnodes``."""
    gpus_per_node: int = 1
    device: str = "cpu"
    """What the workers run on: ``cpu`` (one process per simulated GPU, gloo) or ``cuda`` (one
    process per GPU, NCCL)."""
    accelerator: str | None = None
    """The accelerator the cost model assumes, a key of ``oobleck_mm.config.devices.DEVICES``
    (``a40``, ``a100-40gb``, ``a100-80gb``, ``h100``, ``cpu`` ...); default ``cpu`` on the cpu,
    required with ``device: cuda``."""
    device_memory: int | None = None
    """Bytes of memory per device; default: the accelerator's."""
    compute_efficiency: float | None = None
    """Fraction of the accelerator's peak FLOP/s real kernels reach, in (0, 1]; default: the
    catalogue's (0.45). Calibrate the analytical cost model to a measured cluster with it."""
    max_gpus_per_stage: int = 1
    """Largest GPU count of one pipeline stage: 1, 2, 4 or 8, at most gpus_per_node."""
    intra_node_bandwidth: float = 150e9
    """Bytes/s between GPUs of a node."""
    inter_node_bandwidth: float = 12.5e9
    """Bytes/s between nodes."""
    backend: str = "auto"
    """torch.distributed backend: ``auto`` (nccl on GPUs, gloo on cpu), ``gloo`` or ``nccl``."""
    emulate: str | None = None
    """Run the job on CPU workers as if on this accelerator (a key of the devices catalogue, not
    ``cpu``; docs/emulation.md): the master plans the real model on it, the workers compute a
    shrunk copy and every stage's forward and backward, every transfer and every state copy ends
    when the real model would have finished it there. Replaces ``accelerator`` (the planner sees the
    accelerator emulated); needs ``device: cpu``."""
    emulate_shrink: int | None = None
    """Emulation: the divisor of every width of the workers' compute copy (hidden sizes, FFN
    widths, heads, vocabulary); token counts and the layer list stay. None: automatic, the LLM's
    width down to about 32 (``config.emulation.auto_shrink``)."""
    emulate_coarsen: int | None = None
    """Emulation: the compute copy's encoders read tokens this many times coarser (patch sides and audio
    downsampling multiplied), so its CPU attention stays cheap; the emulated durations still follow every
    sample's real tokens. None: automatic, every encoder span down to at most 128 tokens
    (``config.emulation.auto_coarsen``); 1: the real token counts."""
    emulate_profile: str | None = None
    """Emulation: a JSON file of the *true* layer times the emulated accelerator runs at (per-kind
    factors on the analytical model, per-sample noise; format in docs/emulation.md). None: the
    built-in truth (``oobleck_mm.emulation.truth.DEFAULT_TRUTH``), which the run prints."""

    def __post_init__(self) -> None:
        self._check_emulation()
        check(self, "nodes", as_int, minimum=1, maximum=MAX_NODES, why=_NODES_WHY)
        check_optional(self, "max_nodes", as_int, minimum=1, maximum=MAX_NODES, why=_NODES_WHY)
        if self.max_nodes is not None and self.max_nodes < self.nodes:
            raise ConfigError(
                f"cluster.max_nodes ({self.max_nodes}) must be >= cluster.nodes ({self.nodes}), the nodes "
                "the job starts with"
            )
        check(
            self,
            "gpus_per_node",
            as_int,
            minimum=1,
            maximum=MAX_GPUS_PER_NODE,
            why="the most GPUs one machine or NVLink domain has, with room to spare",
        )
        if isinstance(self.device, str) and self.device in DEVICES and self.device != "cpu":  # before the split
            raise ConfigError(
                f"cluster.device: {self.device!r} is an accelerator kind, which is now cluster.accelerator (what the "
                f"cost model assumes); cluster.device says what runs: 'cpu' or 'cuda'. Write "
                f"`device: cuda` and `accelerator: {self.device}`"
            )
        check(self, "device", as_choice, RUN_DEVICES)
        if self.accelerator is None:
            if self.device == "cuda":
                raise ConfigError(
                    "cluster.accelerator: required with cluster.device 'cuda' (the cost model's GPU); "
                    f"one of {', '.join(repr(d) for d in DEVICES)}"
                )
            self.accelerator = "cpu"
        check(self, "accelerator", as_choice, tuple(DEVICES))
        if self.device_memory is None:
            self.device_memory = DEVICES[self.accelerator].memory_bytes
        check(self, "device_memory", as_size)
        check_optional(self, "compute_efficiency", as_float, minimum=0.0)
        if self.compute_efficiency is not None and not 0 < self.compute_efficiency <= 1:
            raise ConfigError(f"cluster.compute_efficiency: must be in (0, 1], got {self.compute_efficiency}")
        check(self, "max_gpus_per_stage", as_int, minimum=1)
        if self.max_gpus_per_stage not in (1, 2, 4, 8):
            raise ConfigError(f"cluster.max_gpus_per_stage: must be 1, 2, 4 or 8, got {self.max_gpus_per_stage}")
        check(self, "intra_node_bandwidth", as_bandwidth)
        check(self, "inter_node_bandwidth", as_bandwidth)
        check(self, "backend", as_choice, ("auto", "gloo", "nccl"))

    def _check_emulation(self) -> None:
        if self.emulate is None:
            check_optional(self, "emulate_shrink", as_int, minimum=1)
            check_optional(self, "emulate_coarsen", as_int, minimum=1)
            return
        emulable = tuple(d for d in DEVICES if d != "cpu")
        check(self, "emulate", as_choice, emulable)
        if self.device != "cpu":
            raise ConfigError(
                f"cluster.emulate: emulated accelerators run on CPU workers, cluster.device is "
                f"{self.device!r}; set device: cpu (or remove emulate to run on the real GPUs)"
            )
        if self.backend == "nccl":
            raise ConfigError("cluster.backend: 'nccl' cannot run emulated (CPU workers); use auto or gloo")
        self.accelerator = self.emulate
        check_optional(self, "emulate_shrink", as_int, minimum=1)
        check_optional(self, "emulate_coarsen", as_int, minimum=1, maximum=64, why="a patch 64 times wider")
        check_optional(self, "emulate_profile", as_str)
        if self.emulate_profile is not None:
            self.emulate_profile = os.path.abspath(os.path.expanduser(self.emulate_profile))

    @property
    def resolved_backend(self) -> str:
        if self.backend != "auto":
            return self.backend
        return "nccl" if self.device == "cuda" else "gloo"


@dataclass(kw_only=True, slots=True)
class PlanningConfig:
    _PATH: ClassVar[str] = "planning"
    profile: str = "analytical"
    """Layer costs from the ``analytical`` model or ``measured`` by running the layers."""
    solver: str = "highs"
    """Batch-distribution solver: ``highs`` (exact MILP of the predicted iteration time, default),
    ``mindtpy`` (the seed's eq. 2.6 MINLP via MindtPy; needs scripts/install_minlp.sh) or
    ``python`` (the same exact min-max optimum without Pyomo)."""
    profile_cache_dir: str = "~/.cache/oobleck_mm/profiles"
    """Where measured profiles are cached (``~`` is expanded)."""
    microbatches_hint: int | None = None
    """Microbatches per pipeline the templates are optimised for; default: derived from the batch."""
    replan_gain: float | None = 0.02
    """On reconfiguration, lay the live nodes out afresh (more layer states to copy) when that is
    predicted this much faster than the seed's incremental steps; ``null``: never."""

    def __post_init__(self) -> None:
        check_optional(self, "replan_gain", as_float, minimum=0.0)
        check(self, "profile", as_choice, ("analytical", "measured"))
        check(self, "solver", as_choice, ("highs", "mindtpy", "python"))
        check(self, "profile_cache_dir", as_str)
        self.profile_cache_dir = os.path.expanduser(self.profile_cache_dir)
        check_optional(self, "microbatches_hint", as_int, minimum=1)


@dataclass(kw_only=True, slots=True)
class BalanceConfig:
    _PATH: ClassVar[str] = "balance"
    enabled: bool = False
    """Assign each global batch's samples to pipelines and microbatches by predicted cost;
    false keeps the contiguous split (fixed-size microbatches in sampler order)."""
    algorithm: str = "ours"
    """One of ``oobleck_mm.balance.balancer.ALGORITHMS``: ours, ours_fast, random, orchmllm_lpt,
    orchmllm_padded, orchmllm_quadratic, mmscale."""
    threshold: float = 0.02
    """Keep the contiguous split when its predicted max/mean pipeline time is within 1 + threshold."""
    fixed_s_per_layer: float = 0.0
    """First guess of a layer's fixed seconds per microbatch, before the online fit."""
    fit_every: int = 10
    """Steps between refits of the cost model from measured stage times (0: never refit)."""
    fit_window: int = 512
    """Most recent stage timings a fit uses."""
    ridge: float = 1.0e-4
    """Pull of a fit toward the previous coefficients."""
    deferral: bool = False
    """Inside each pipeline, Entrain's pairwise deferral (``balance/deferral.py``): the LLM stages run
    microbatches of equal LLM work by deferring some samples' LLM work to the next microbatch, kept only
    when the exact 1F1B model predicts the pipeline faster. Needs a model with an encoder."""

    def __post_init__(self) -> None:
        check(self, "enabled", as_bool)
        check(self, "deferral", as_bool)
        check(
            self,
            "algorithm",
            as_choice,
            ("ours", "ours_fast", "random", "orchmllm_lpt", "orchmllm_padded", "orchmllm_quadratic", "mmscale"),
        )
        check(self, "threshold", as_float, minimum=0.0)
        check(self, "fixed_s_per_layer", as_float, minimum=0.0)
        check(self, "fit_every", as_int, minimum=0)
        check(self, "fit_window", as_int, minimum=1)
        check(self, "ridge", as_float, minimum=0.0)


# --------------------------------------------------------------------------- the job


@dataclass(kw_only=True, slots=True)
class JobConfig:
    model: ModelConfig
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    fault_tolerance: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    planning: PlanningConfig = field(default_factory=PlanningConfig)
    balance: BalanceConfig = field(default_factory=BalanceConfig)

    def __post_init__(self) -> None:
        validate(self)

    def to_dict(self) -> dict[str, Any]:
        """Plain YAML-able dict; ``config_from_dict(job.to_dict())`` gives an equal job."""
        return _to_plain(self)


def validate(job: JobConfig) -> None:
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
    if c.backend == "nccl" and c.device == "cpu":
        raise ConfigError("cluster.backend: 'nccl' needs a GPU device, cluster.device is 'cpu'")
    _validate_scheduler(t)
    _validate_model(m)
    _validate_workload(m, d)
    if c.emulate is not None:
        _validate_emulation(m, d, c)


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


def shape_measured(d: DataConfig) -> bool:
    """Whether the data's means are known (a ``llava_json`` file's once the master read it)."""
    return d.mean_text_tokens is not None and d.mean_images_per_sample is not None


def _validate_workload(m: ModelConfig, d: DataConfig) -> None:
    if d.kind == "llava_json" and d.path is None:
        raise ConfigError("data.path: required when data.kind is 'llava_json'")
    derive_data_shape(m, d)
    # An encoder with no input would be costed as idle, silently skewing the plan.
    if d.mean_images_per_sample is not None and (m.vision is None) != (d.mean_images_per_sample == 0):
        measured = "" if d.kind == "synthetic" else f", as measured over {d.path}"
        raise ConfigError(
            f"data.mean_images_per_sample ({d.mean_images_per_sample}{measured}) must be > 0 exactly when "
            f"model.vision is set (model.vision is {'set' if m.vision else 'not set'})"
        )
    if (m.audio is None) != (d.mean_audio_seconds == 0):
        raise ConfigError(
            f"data.mean_audio_seconds ({d.mean_audio_seconds}) must be > 0 exactly when model.audio is set "
            f"(model.audio is {'set' if m.audio else 'not set'})"
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
            m, dataclasses.replace(d, mean_text_tokens=1.0, mean_images_per_sample=1.0 if m.vision else 0.0)
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


# --------------------------------------------------------------------------- parsing


def _section_class(hint: Any) -> tuple[type | None, bool]:
    """(section dataclass, optional?) for a field annotation, or (None, False) for a plain value."""
    if dataclasses.is_dataclass(hint):
        return hint, False
    if get_origin(hint) in (Union, types.UnionType):
        args = [a for a in get_args(hint) if a is not type(None)]
        if len(args) == 1 and dataclasses.is_dataclass(args[0]):
            return args[0], True
    return None, False


def _build(cls: type, raw: Any, path: str) -> Any:
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{path or '<root>'}: expected a mapping of settings, got {describe(raw)}")
    fields = dataclasses.fields(cls)
    reject_unknown(raw, tuple(f.name for f in fields), path)
    hints = get_type_hints(cls)
    kwargs = {}
    for f in fields:
        key_path = f"{path}.{f.name}" if path else f.name
        if f.name not in raw:
            if f.default is MISSING and f.default_factory is MISSING:
                raise ConfigError(f"{key_path}: required but missing")
            continue
        value = raw[f.name]
        section, optional = _section_class(hints[f.name])
        if section is not None and not (optional and value is None):
            value = _build(section, value, key_path)
        kwargs[f.name] = value
    return cls(**kwargs)


def _to_plain(value: Any) -> Any:
    if isinstance(value, ModelConfig) and value.huggingface is not None:
        # The shape sections are derived from the directory; writing them back would conflict.
        return {
            f.name: _to_plain(getattr(value, f.name))
            for f in dataclasses.fields(value)
            if f.name not in ("llm", "vision", "audio", "projector")
        }
    if dataclasses.is_dataclass(value):
        return {f.name: _to_plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, timedelta):
        return value.total_seconds()
    if isinstance(value, (list, tuple)):
        return [_to_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _to_plain(v) for k, v in value.items()}
    return value


def config_from_dict(d: Any, source: str = "<dict>") -> JobConfig:
    """Builds and validates a job from a plain dict (e.g. parsed YAML)."""
    if not isinstance(d, Mapping):
        raise ConfigError(f"<root>: {source} must hold a mapping of sections, got {describe(d)}")
    return _build(JobConfig, d, "")


def section_from_dict(cls: type, raw: Any, path: str) -> Any:
    """One section (e.g. ``FaultToleranceConfig``) from its plain dict, checked like in a whole job."""
    return _build(cls, raw, path)
