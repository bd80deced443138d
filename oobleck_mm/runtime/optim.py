"""Per-layer optimizers, the DeepSpeed learning-rate schedules as pure functions, gradient clipping.

The engine keeps one optimizer per pipeline layer, so a layer moves between ranks as a unit: its
parameters, both Adam moments and its step counter. The learning rate is never scheduler state: it is
``lr_at(training, step)``, a pure function of the 0-based global iteration, so a reconfigured or
restored worker cannot restart the warm-up (a defect of the original Oobleck). The single-process
reference trainer calls these same functions, which is what lets the two agree to 1e-10 in float64.

Frozen layers get no optimizer at all: the caller does not call ``build_layer_optimizer`` for them
(it raises on an empty parameter list to catch a caller that forgot).
"""

from __future__ import annotations

import math

import torch

from oobleck_mm.config import SCHEDULER_DEFAULT_WARMUP_STEPS, WARMUP_DECAY_DEFAULT_MAX_LR, TrainingConfig

# DeepSpeed's runtime/lr_schedules.py defaults for the parameters config.py leaves unset.
_DEFAULT_WARMUP_MIN_LR = 0.0
_DEFAULT_WARMUP_TYPE = "log"
_DEFAULT_WARMUP_MIN_RATIO = 0.0
_DEFAULT_COS_MIN_RATIO = 0.0001

# torch's Adam/AdamW per-parameter state, in the order optimizer_state emits it (build_layer_optimizer
# never enables amsgrad, which would add max_exp_avg_sq).
_ADAM_STATE_KEYS = ("exp_avg", "exp_avg_sq", "step")


# --------------------------------------------------------------------------- learning rate


def lr_at(training: TrainingConfig, step: int) -> float:
    """The lr DeepSpeed applies in the optimizer step of 0-based global iteration ``step``.

    DeepSpeed builds its scheduler with ``last_batch_iteration=-1``, whose constructor writes the lr
    for iteration -1 into the optimizer, and calls ``lr_scheduler.step()`` only *after*
    ``optimizer.step()`` (engine._take_model_step). So optimizer step ``s`` runs with the schedule's
    value at iteration ``s - 1``: WarmupLR/WarmupDecayLR start at warmup_min_lr for two steps, and
    WarmupCosineLR's first step uses lr 0 (its value before it "has started"). We match that exactly.
    Steps DeepSpeed skips on fp16 overflow are not modelled: our step counts applied iterations.
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step: expected a non-negative integer, got {step!r}")
    base_lr = training.optimizer.params.lr
    scheduler = training.scheduler
    if scheduler is None:
        return base_lr
    iteration = step - 1
    p = scheduler.params
    warmup_steps = max(2, p.get("warmup_num_steps", SCHEDULER_DEFAULT_WARMUP_STEPS))  # DeepSpeed's max(2, n)
    warmup_type = p.get("warmup_type", _DEFAULT_WARMUP_TYPE)
    total_steps = scheduler.total_steps(training.steps)
    if scheduler.type == "OneCycle":
        return _one_cycle(training, step)[0]
    if scheduler.type == "WarmupCosineLR":
        return _warmup_cosine_lr(base_lr, iteration, warmup_steps, warmup_type, total_steps, p)
    min_lr = p.get("warmup_min_lr", _DEFAULT_WARMUP_MIN_LR)
    if iteration < 0:
        return min_lr  # WarmupLR/WarmupDecayLR before they have started
    if scheduler.type == "WarmupLR":
        # WarmupLR peaks at the optimizer's lr when warmup_max_lr is absent; WarmupDecayLR at 0.001.
        max_lr = p.get("warmup_max_lr", base_lr)
        gamma = _warmup_gamma(iteration, warmup_steps, warmup_type) if iteration < warmup_steps else 1.0
    elif scheduler.type == "WarmupDecayLR":
        max_lr = p.get("warmup_max_lr", WARMUP_DECAY_DEFAULT_MAX_LR)
        if iteration < warmup_steps:
            gamma = _warmup_gamma(iteration, warmup_steps, warmup_type)
        else:
            gamma = max(0.0, float(total_steps - iteration) / float(max(1.0, total_steps - warmup_steps)))
    else:
        raise ValueError(
            f"training.scheduler.type: unsupported {scheduler.type!r}; valid: WarmupLR, WarmupDecayLR, WarmupCosineLR"
        )
    # Same operation order as DeepSpeed (min + (max - min) * gamma) so the floats agree exactly.
    return min_lr + (max_lr - min_lr) * gamma


def _warmup_gamma(iteration: int, warmup_steps: int, warmup_type: str) -> float:
    """Warm-up progress in [0, 1) at ``iteration`` (>= 0), in DeepSpeed's _get_gamma operation order."""
    if warmup_type == "log":
        return 1.0 / math.log(warmup_steps) * math.log(iteration + 1)
    return iteration / warmup_steps


def _warmup_cosine_lr(
    base_lr: float, iteration: int, warmup_steps: int, warmup_type: str, total_steps: int, p
) -> float:
    """DeepSpeed's WarmupCosineLR: ratios of the optimizer's lr, not absolute lrs."""
    if iteration < 0:
        return 0.0  # DeepSpeed returns lr 0 before the scheduler "has started".
    if iteration < warmup_steps:
        min_ratio = p.get("warmup_min_ratio", _DEFAULT_WARMUP_MIN_RATIO)
        ratio = min_ratio + _warmup_gamma(iteration, warmup_steps, warmup_type) * (1.0 - min_ratio)
    else:
        cos_min_ratio = p.get("cos_min_ratio", _DEFAULT_COS_MIN_RATIO)
        # Clamped at the end so the ratio stays at cos_min_ratio past total_num_steps.
        progress = min(1.0, (iteration - warmup_steps + 1) / max(1, total_steps - warmup_steps))
        ratio = max(0.0, cos_min_ratio + (1.0 - cos_min_ratio) * ((1 + math.cos(math.pi * progress)) / 2))
    return base_lr * ratio


def betas_at(training: TrainingConfig, step: int) -> tuple[float, float] | None:
    """Adam's betas in optimizer step ``step`` when the schedule sets them (OneCycle's momentum
    cycling, which DeepSpeed applies as ``(momentum, 0.99)``), else None: the configured betas stay."""
    if training.scheduler is None or training.scheduler.type != "OneCycle":
        return None
    return _one_cycle(training, step)[1]


def _one_cycle(training: TrainingConfig, step: int) -> tuple[float, tuple[float, float] | None]:
    """DeepSpeed's own OneCycle evaluated at the iteration optimizer step ``step`` runs with.

    The schedule is asked, not re-implemented: a OneCycle over a one-parameter optimizer built
    at ``last_batch_iteration = step - 1`` (step 0: the values its constructor writes), the same
    off-by-one as ``lr_at`` documents for the warm-up schedules.
    """
    from deepspeed.runtime.lr_schedules import OneCycle

    probe = torch.optim.AdamW(
        [torch.zeros(1, requires_grad=True)], lr=training.optimizer.params.lr, betas=training.optimizer.params.betas
    )
    schedule = OneCycle(
        probe, last_batch_iteration=-1 if step == 0 else step - 1, **training.scheduler.deepspeed_params(training.steps)
    )
    if step == 0:
        group = probe.param_groups[0]
        return group["lr"], (tuple(group["betas"]) if schedule.cycle_momentum else None)
    betas = tuple(schedule.get_mom()[0]) if schedule.cycle_momentum else None
    return schedule.get_lr()[0], betas


def set_betas(optimizer: torch.optim.Optimizer, betas: tuple[float, float]) -> None:
    for group in optimizer.param_groups:
        group["betas"] = betas


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set every parameter group's lr (the engine calls this before each step with ``lr_at``)."""
    if not math.isfinite(lr) or lr < 0:
        raise ValueError(f"lr: expected a finite number >= 0, got {lr!r}")
    for group in optimizer.param_groups:
        group["lr"] = lr


# --------------------------------------------------------------------------- optimizer


def build_layer_optimizer(params: list[torch.nn.Parameter], training: TrainingConfig) -> torch.optim.Optimizer:
    """One layer's optimizer, its lr already at step 0's value (as DeepSpeed's scheduler leaves it).

    Both "AdamW" and "Adam" build torch.optim.AdamW: DeepSpeed's engine reads ``adam_w_mode`` with
    default ADAM_W_MODE_DEFAULT = True (deepspeed/runtime/config.py) and for "Adam" uses
    ``effective_adam_w_mode = name == "adamw" or adam_w_mode``, i.e. decoupled weight decay unless a
    config says ``adam_w_mode: false``, which our config does not accept.

    ``fused=True`` runs torch's fused kernel (one kernel over the layer's tensors, on CPU and CUDA, as
    DeepSpeed's FusedAdam and torchtitan's default do): its math is elementwise, the same for one
    parameter or many, so it does not depend on which other layers share the rank. The per-tensor loop
    (``foreach=False``) launched ~10 ops per tensor: 26.9 ms a step on a 76-layer stage's 608 small tensors
    on this CPU against 8.2 ms fused (22.3 with ``foreach=True``); on a GPU each op is a kernel launch.
    """
    params = list(params)
    if not params:
        raise ValueError("params: a layer optimizer needs at least one parameter (frozen layers get no optimizer)")
    opt = training.optimizer
    if opt.type not in ("AdamW", "Adam"):
        raise ValueError(f"training.optimizer.type: unsupported {opt.type!r}; valid: AdamW, Adam")
    hp = opt.params
    return torch.optim.AdamW(
        params,
        lr=lr_at(training, 0),
        betas=tuple(hp.betas),
        eps=hp.eps,
        weight_decay=hp.weight_decay,
        fused=True,
    )


# --------------------------------------------------------------------------- clipping


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """The factor clip_grad_norm_ (torch's and DeepSpeed's) multiplies every gradient by.

    ``max_norm == 0`` is DeepSpeed's "gradient_clipping: 0", i.e. no clipping. A NaN norm gives NaN,
    as in torch, so non-finite gradients are not silently hidden.
    """
    if not max_norm >= 0 or not math.isfinite(max_norm):
        raise ValueError(f"max_norm: expected a finite number >= 0, got {max_norm!r}")
    if max_norm == 0:
        return 1.0
    # torch evaluates `max_norm / tensor` as `tensor.reciprocal() * max_norm`; the same order here
    # keeps the factor bit-identical to torch's in float64 (DeepSpeed's float32 version rounds anyway).
    coef = max_norm * (1.0 / (total_norm + 1e-6))
    return 1.0 if coef >= 1.0 else coef  # NaN compares false and passes through, like torch.clamp.


# --------------------------------------------------------------------------- state transfer


def optimizer_state(optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """One layer's optimizer state as flat named tensors, ordered by parameter index then key.

    A parameter without state yet (before its first step, or never given a gradient) gets zero
    moments and step 0, which is exactly what torch would initialise it to. So the keys, shapes and
    dtypes depend only on the parameters: a receiver calls this on its own fresh optimizer to get
    the buffers to receive into. Existing state is returned as the live tensors (no copy): send or
    clone them before the next ``step()``.
    """
    out: dict[str, torch.Tensor] = {}
    for index, param in enumerate(_params(optimizer)):
        state = optimizer.state.get(param) or _fresh_state(optimizer, param)
        # Catches an optimizer (or a torch version) holding state this module would silently drop.
        assert tuple(sorted(state)) == _ADAM_STATE_KEYS, (
            f"optimizer state keys {sorted(state)}, expected {_ADAM_STATE_KEYS}"
        )
        for key in _ADAM_STATE_KEYS:
            out[f"{index}.{key}"] = state[key]
    return out


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict[str, torch.Tensor]) -> None:
    """Replace ``optimizer``'s state with ``state`` (from ``optimizer_state``); the tensors are copied."""
    params = _params(optimizer)
    keys = _ADAM_STATE_KEYS
    expected = [f"{i}.{k}" for i in range(len(params)) for k in keys]
    missing = [k for k in expected if k not in state]
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"optimizer state: missing keys {missing}, unexpected keys {unexpected} "
            f"(an optimizer over {len(params)} parameters holds {', '.join(keys)} per parameter)"
        )
    for index, param in enumerate(params):
        loaded = {}
        for key in keys:
            value = state[f"{index}.{key}"].detach()
            if key == "step":
                if value.numel() != 1:
                    raise ValueError(
                        f"optimizer state '{index}.step': expected a scalar, got shape {tuple(value.shape)}"
                    )
                device, dtype = _step_placement(optimizer, param)
                loaded[key] = value.reshape(()).to(device=device, dtype=dtype, copy=True)
            else:
                if value.shape != param.shape:
                    raise ValueError(
                        f"optimizer state '{index}.{key}': shape {tuple(value.shape)} does not match "
                        f"parameter {index} of shape {tuple(param.shape)}"
                    )
                loaded[key] = value.to(device=param.device, dtype=param.dtype, copy=True)
        optimizer.state[param] = loaded


def _params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Parameters in state_dict's index order (groups in order, then params within each)."""
    return [p for group in optimizer.param_groups for p in group["params"]]


def _step_placement(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> tuple[torch.device, torch.dtype]:
    """Where torch's AdamW keeps a parameter's step counter: a fused optimizer a float32 tensor on the
    parameter's device (its kernel reads it there), else a CPU scalar read with ``.item()`` in
    ``torch.optim.optimizer._get_scalar_dtype()``'s dtype."""
    if any(group.get("fused") for group in optimizer.param_groups):
        return param.device, torch.float32
    return torch.device("cpu"), torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def _fresh_state(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> dict[str, torch.Tensor]:
    zeros = lambda: torch.zeros_like(param, memory_format=torch.preserve_format)  # noqa: E731
    device, dtype = _step_placement(optimizer, param)
    return {"exp_avg": zeros(), "exp_avg_sq": zeros(), "step": torch.zeros((), dtype=dtype, device=device)}
