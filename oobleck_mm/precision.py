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
