"""Training dtypes: the config's names as torch dtypes, and which dtype each kind of tensor has.

One home for the question "what does ``training.dtype`` mean for tensors",
shared by the layers, the optimizer and the data (packed image/audio features),
so they can never disagree:

- ``compute_dtype``: the layers' forward and backward, activations between
  stages, the data's features (``training.dtype``);
- ``master_dtype``: what the optimizer updates and what checkpoints, state
  transfer, ``verify`` and export read: the master weights, Adam moments and
  accumulated gradients (``training.master_dtype``);
- mixed precision is the two differing (``is_mixed``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from oobleck_mm.errors import UserError

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise UserError(f"training.dtype: {name!r} is not one of {', '.join(DTYPES)}")
    return DTYPES[name]


def compute_dtype(training) -> torch.dtype:
    return torch_dtype(training.dtype)


def master_dtype(training) -> torch.dtype:
    """``training.master_dtype``; unset: float32 for the half types, else the compute dtype."""
    if training.master_dtype is not None:
        return torch_dtype(training.master_dtype)
    return torch.float32 if training.dtype in ("bfloat16", "float16") else torch_dtype(training.dtype)


def is_mixed(training) -> bool:
    return compute_dtype(training) != master_dtype(training)


def reduce_dtype(training) -> torch.dtype:
    """Dtype of the gradient all-reduce: bfloat16 when ``training.grad_reduce_dtype`` asks for it under
    mixed precision, else the master dtype (float32 or, in the exact test mode, float64)."""
    if training.grad_reduce_dtype == "bfloat16" and is_mixed(training):
        return torch.bfloat16
    return master_dtype(training)


# --------------------------------------------------------------------------- float16 loss scaling


@dataclass(slots=True)
class LossScaler:
    """DeepSpeed's ``DynamicLossScaler`` semantics (``runtime/fp16/loss_scaler.py``) as plain state.

    Written here rather than reused because DeepSpeed's class logs through ``deepspeed.comm``
    (it needs an initialised process group, which the single-process reference trainer has
    not) and keeps its state in attributes with no state dict; a unit test runs both over the
    same overflow sequence and requires the same scales. One deviation: at ``min_loss_scale``
    an overflow skips the step and keeps the scale instead of raising. Every rank holds the
    same state (overflow is decided from the all-reduced gradient norm), and it travels with
    recovery and checkpoints (``state_dict``).
    """

    scale: float
    window: int = 1000
    min_scale: float = 1.0
    delayed_shift: int = 2
    consecutive_hysteresis: bool = False
    dynamic: bool = True
    iteration: int = 0
    last_overflow: int = -1
    hysteresis: int = 2

    @classmethod
    def for_training(cls, training) -> LossScaler | None:
        """The scaler ``training.dtype: float16`` needs, else None."""
        if training.dtype != "float16":
            return None
        c = training.fp16
        if c.loss_scale > 0:
            return cls(scale=c.loss_scale, dynamic=False)
        return cls(
            scale=2.0**c.initial_scale_power,
            window=c.loss_scale_window,
            min_scale=c.min_loss_scale,
            delayed_shift=c.hysteresis,
            consecutive_hysteresis=c.consecutive_hysteresis,
            hysteresis=c.hysteresis,
        )

    @staticmethod
    def overflowed(grad_norm_sq: float) -> bool:
        return not math.isfinite(grad_norm_sq)

    def update(self, overflow: bool) -> None:
        """After a step (skipped when ``overflow``): DeepSpeed's ``update_scale``."""
        if not self.dynamic:
            return
        if overflow:
            if self.delayed_shift == 1 or self.hysteresis == 1:
                self.scale = max(self.scale / 2.0, self.min_scale)
            else:
                self.hysteresis -= 1
            self.last_overflow = self.iteration
        else:
            if self.consecutive_hysteresis:
                self.hysteresis = self.delayed_shift
            stable = self.iteration - self.last_overflow - 1
            if stable > 0 and stable % self.window == 0:
                if not self.consecutive_hysteresis:
                    self.hysteresis = self.delayed_shift
                self.scale *= 2.0
        self.iteration += 1

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, value)
