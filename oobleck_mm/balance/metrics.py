"""Balance metrics as plain numbers, for the progress line and the event log.

* ``imbalance``: max / mean of per-pipeline iteration times (1.0 is perfect).
  Predicted times come from ``BalanceResult``; the runtime applies the same
  function to measured ones.
* ``dist_ratio``: OmniBal's Dist Ratio (§4.1, eq. 2),
  ``sum_i (T_max - T_i) / (T_max * N)`` over devices: the mean idle share if
  every device's time were proportional to its tokens. 0 is perfect.
* ``modality_dist_ratios``: Dist Ratio of each modality's tokens per pipeline
  (vision patches, audio encoder tokens, LLM tokens). With pipelines of
  different speeds equal tokens are not the goal, so each pipeline's tokens
  may be divided by its expected share (``weights``) first.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from oobleck_mm.balance.work import modality_tokens


def imbalance(times: Sequence[float]) -> float:
    """max / mean of ``times`` (1.0 when all are equal or all are zero)."""
    t = np.asarray(times, dtype=float)
    if t.size == 0:
        raise ValueError("imbalance of no times")
    mean = float(t.mean())
    return float(t.max()) / mean if mean > 0 else 1.0


def dist_ratio(values: Sequence[float]) -> float:
    """OmniBal's Dist Ratio of per-device ``values`` (0 when all equal or all zero)."""
    v = np.asarray(values, dtype=float)
    if v.size == 0:
        raise ValueError("dist_ratio of no values")
    top = float(v.max())
    return float((top - v).sum() / (top * v.size)) if top > 0 else 0.0


def modality_dist_ratios(
    features: np.ndarray,
    pipeline_of_sample: Sequence[int],
    num_pipelines: int,
    weights: Sequence[float] | None = None,
) -> dict[str, float]:
    """Dist Ratio per modality of tokens per pipeline; ``weights`` (one per pipeline) normalise by share.

    A modality absent from the batch reports 0.0.
    """
    pipe = np.asarray(pipeline_of_sample, dtype=np.int64)
    w = np.ones(num_pipelines) if weights is None else np.asarray(weights, dtype=float)
    if w.shape != (num_pipelines,) or (w <= 0).any():
        raise ValueError(f"weights must be {num_pipelines} positive numbers, got {list(w)}")
    out = {}
    for name, tokens in modality_tokens(np.asarray(features, dtype=float)).items():
        per_pipe = np.bincount(pipe, weights=tokens, minlength=num_pipelines) / w
        out[name] = dist_ratio(per_pipe)
    return out
