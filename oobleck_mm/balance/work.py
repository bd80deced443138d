"""Per-sample work features: what a sample makes each modality's layers do, read from metadata alone.

A microbatch's time on a pipeline stage is modelled (``cost_model``) as a
linear function of the *sum* of its samples' feature vectors plus a fixed
cost, so everything the balancer needs from a sample is one row of
``FEATURES``. Quadratic attention terms are per attention span, never per
microbatch: packing is without padding and attention is block-diagonal
(per image in the vision encoder, per clip in the audio encoder, per sample
in the LLM), so ``sum(patches^2)`` over images is additive over samples.

Column 0 (``microbatch``) is 0 for every sample; a microbatch's feature
vector is the sum of its samples' rows with column 0 set to 1.

Pure: numpy only. The dimensions come from
``oobleck_mm.data.dataset.ModelInputs`` (patch size, token merges, audio
downsampling), the same object the datasets use to shape samples.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import numpy as np

if TYPE_CHECKING:
    from oobleck_mm.data.sample import SampleMeta

FEATURES = (
    "microbatch",  # 1 per microbatch (fixed cost: launches, small ops)
    "vision_patches",  # encoder tokens of all images
    "vision_patches_sq",  # sum over images of patches^2 (encoder attention)
    "vision_tokens",  # projected tokens (patches // token_merge per image): the projector's input
    "audio_tokens_enc",  # encoder tokens of all clips (frames // downsample)
    "audio_tokens_enc_sq",  # sum over clips of encoder tokens^2
    "audio_tokens",  # projected tokens (encoder tokens // token_merge per clip)
    "llm_tokens",  # the sample's LLM sequence: text without placeholders + projected media
    "llm_tokens_sq",  # its square (causal attention over the whole sample)
)
NUM_FEATURES = len(FEATURES)
F = {name: i for i, name in enumerate(FEATURES)}
LLM_FEATURES = frozenset((F["llm_tokens"], F["llm_tokens_sq"]))
"""The columns the LLM's layers read (every other column but ``microbatch`` is an encoder's)."""

# Per modality (as in planning.costs.MODALITIES): the feature driving its linear
# and quadratic cost, by layer kind. Projectors work on merged tokens; embeddings
# and projectors have no attention.
LINEAR_FEATURE = {
    ("vision", "patch_embed"): "vision_patches",
    ("vision", "block"): "vision_patches",
    ("vision", "projector"): "vision_tokens",
    ("audio", "frame_embed"): "audio_tokens_enc",
    ("audio", "block"): "audio_tokens_enc",
    ("audio", "projector"): "audio_tokens",
    ("text", "token_embed"): "llm_tokens",
    ("text", "block"): "llm_tokens",
    ("text", "lm_head"): "llm_tokens",
}
QUADRATIC_FEATURE = {"vision": "vision_patches_sq", "audio": "audio_tokens_enc_sq", "text": "llm_tokens_sq"}


class ModelDims(Protocol):
    """What ``oobleck_mm.data.dataset.ModelInputs`` provides (no torch import needed here)."""

    patch_size: int
    image_merge: int
    audio_downsample: int
    audio_merge: int


def sample_features(metas: Sequence[SampleMeta], dims: ModelDims) -> np.ndarray:
    """``(len(metas), NUM_FEATURES)`` float64 rows; every entry is an exact integer."""
    rows = np.zeros((len(metas), NUM_FEATURES))
    for i, meta in enumerate(metas):
        rows[i] = _row(meta, dims)
    return rows


def _row(meta: SampleMeta, dims: ModelDims) -> list[float]:
    patches = [(h // dims.patch_size) * (w // dims.patch_size) for h, w in meta.image_sizes]
    enc = [f // dims.audio_downsample for f in meta.audio_frames]
    vision_tokens = sum(p // dims.image_merge for p in patches)
    audio_tokens = sum(e // dims.audio_merge for e in enc)
    llm = meta.text_tokens - len(patches) - len(enc) + vision_tokens + audio_tokens
    return [
        0.0,
        sum(patches),
        sum(p * p for p in patches),
        vision_tokens,
        sum(enc),
        sum(e * e for e in enc),
        audio_tokens,
        llm,
        llm * llm,
    ]


def microbatch_features(features: np.ndarray) -> np.ndarray:
    """Feature vector of one microbatch holding the samples of ``features`` (rows)."""
    out = features.sum(axis=0) if len(features) else np.zeros(NUM_FEATURES)
    out = np.array(out, dtype=float)
    out[F["microbatch"]] = 1.0
    return out


def modality_tokens(features: np.ndarray) -> dict[str, np.ndarray]:
    """Per-sample tokens of each modality, as OmniBal counts them: encoder inputs and the LLM sequence."""
    return {
        "vision": features[:, F["vision_patches"]],
        "audio": features[:, F["audio_tokens_enc"]],
        "text": features[:, F["llm_tokens"]],
    }
