"""Training dtypes: the config's names as torch dtypes, and which ones the engine runs.

One home for the question "what does ``training.dtype`` mean for tensors", shared
by the layers (their weights) and the data (packed image/audio features), so the
two can never disagree. The config accepts the half types for planning; the
engine runs full precision only until mixed precision lands.
"""

from __future__ import annotations

import torch

from oobleck_mm.errors import UserError


def torch_dtype(name: str) -> torch.dtype:
    if name not in ("float32", "float64"):
        raise UserError(
            f"training.dtype: {name!r} is not run by the engine yet; valid: float32, float64 "
            "(mixed precision for bfloat16/float16 is planned only)"
        )
    return getattr(torch, name)
