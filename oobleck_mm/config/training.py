"""The ``training`` section: batch, steps, precision, the optimizer and its schedule, loss scaling,
gradient sync and sharding inside a stage. Declarations (cross-field rules: ``config.validation``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from oobleck_mm.config.values import (
    ConfigError,
    as_bool,
    as_bool_or_auto,
    as_choice,
    as_float,
    as_int,
    check,
    check_optional,
    describe,
    reject_unknown,
)


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
    activation_checkpointing: bool | str = "auto"
    """Recompute activations in backward (each layer keeps only its input from forward): ``auto`` (the
    planner decides per stage: a stage whose activations fit keeps them, a tight one recomputes, and the
    template's time counts it), ``true`` (every stage recomputes), ``false`` (none does)."""
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
        check(self, "activation_checkpointing", as_bool_or_auto)
        check(self, "flash_attention", as_bool)
        check(self, "zero_stage", as_int, minimum=1, maximum=3)
        # No derived default is written into the scheduler's params: ``total_num_steps`` left unset follows
        # ``steps`` wherever it is read (``SchedulerConfig.total_steps``), so ``--steps`` and ``--set
        # training.steps`` applied after the file move it too (a default filled in here stayed at the file's).
