"""Packs samples into one microbatch without padding, with the indices attention and the LLM need.

A ``PackedBatch`` is built identically on every stage of a pipeline from the
sample ids alone (datasets are local and deterministic), so only hidden states
cross stage boundaries. Encoder inputs are flattened token lists:

- vision: each image becomes its patches, row-major, ``[patches, C*p*p]``; an
  image is one attention segment (bidirectional inside it);
- audio: each clip folds ``downsample`` consecutive mel frames into one token,
  ``[frames/downsample, mel*downsample]``; a clip is one segment;
- text: each sample is one causal segment of its LLM sequence, in which every
  media placeholder is expanded into the medium's projected tokens (their
  indices are ``EncoderInput.llm_positions``).

Targets are next-token text ids: position ``j-1`` predicts text token ``j`` of
the same sample; media slots and the leading BOS are never targets.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from oobleck_mm.data.sample import AUDIO, IMAGE, Sample

IGNORE = -100


@dataclass(slots=True)
class EncoderInput:
    features: torch.Tensor
    """[tokens, in_features] encoder input tokens of every medium of the microbatch."""
    grid: torch.Tensor
    """int64 [tokens, 2]: (row, col) of a patch in its image; (frame, 0) for audio."""
    segments: torch.Tensor
    """int64 [tokens]: which medium of the microbatch each token belongs to."""
    llm_positions: torch.Tensor
    """int64 [tokens // merge]: where each projected token goes in the packed LLM sequence."""
    _mask: torch.Tensor | None = field(default=None, repr=False)
    _spans: tuple[tuple[int, int], ...] | None = field(default=None, repr=False)
    context: Any = field(default=None, repr=False)
    """Under context parallelism: this rank's share of the sequence (``runtime.context_parallel.ContextShard``):
    the LLM fields above hold only its tokens, and its ``attend(q, k, v)`` computes their attention against the
    whole sequence. None: the whole microbatch is here."""

    def to(self, device: torch.device, non_blocking: bool = False) -> EncoderInput:
        spans = self.spans()  # on the host: no device sync for it later
        return EncoderInput(
            *(_move(t, device, non_blocking) for t in (self.features, self.grid, self.segments, self.llm_positions)),
            _spans=spans,
        )

    def attention_mask(self) -> torch.Tensor:
        """[tokens, tokens] bool: a token attends to every token of its own medium."""
        if self._mask is None:
            self._mask = self.segments[:, None] == self.segments[None, :]
        return self._mask

    def spans(self) -> tuple[tuple[int, int], ...]:
        """``(start, end)`` of each medium's tokens: the diagonal blocks of ``attention_mask``."""
        if self._spans is None:
            self._spans = segment_spans(self.segments)
        return self._spans


@dataclass(slots=True)
class PackedBatch:
    sample_ids: tuple[int, ...]
    tokens: torch.Tensor
    """int64 [T]: the packed LLM sequence; media slots hold their placeholder id."""
    labels: torch.Tensor
    """int64 [T]: the next text token, or IGNORE."""
    positions: torch.Tensor
    """int64 [T]: position inside the sample (rotary embeddings)."""
    segments: torch.Tensor
    """int64 [T]: which sample of the microbatch each position belongs to."""
    vision: EncoderInput | None = None
    audio: EncoderInput | None = None
    _mask: torch.Tensor | None = field(default=None, repr=False)
    _spans: tuple[tuple[int, int], ...] | None = field(default=None, repr=False)
    _rotary: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    """(head dim, dtype) -> rotary (cos, sin) at ``positions``: made once, read by every LLM block's q and k
    (not an init field: ``dataclasses.replace`` with other positions starts an empty one)."""
    context: Any = field(default=None, repr=False)
    """Under context parallelism: this rank's share of the sequence (``runtime.context_parallel.ContextShard``):
    the LLM fields above hold only its tokens, and its ``attend(q, k, v)`` computes their attention against the
    whole sequence. None: the whole microbatch is here."""

    @property
    def num_loss_tokens(self) -> int:
        return int((self.labels != IGNORE).sum())

    def attention_mask(self) -> torch.Tensor:
        """[T, T] bool: causal inside each sample, nothing across samples."""
        if self._mask is None:
            same = self.segments[:, None] == self.segments[None, :]
            self._mask = same & torch.ones_like(same).tril_()
        return self._mask

    def spans(self) -> tuple[tuple[int, int], ...]:
        """``(start, end)`` of each sample's positions: the (causal) diagonal blocks of ``attention_mask``."""
        if self._spans is None:
            self._spans = segment_spans(self.segments)
        return self._spans

    def rotary(self, dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, dim / 2] of the rotary embedding's angles at ``positions``. Made once per microbatch:
        each of the LLM's blocks rotates its q and k by the same angles, and remaking them (14 small ops a
        tensor) cost ~7% of a float64 tiny-model step on a CPU."""
        key = (dim, dtype)
        if key not in self._rotary:
            inv = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=dtype, device=self.positions.device) / dim))
            ang = self.positions.to(dtype)[:, None] * inv[None, :]
            self._rotary[key] = (ang.cos(), ang.sin())
        return self._rotary[key]

    def encoder(self, modality: str) -> EncoderInput | None:
        return self.vision if modality == "vision" else self.audio

    def to(self, device: torch.device | str, non_blocking: bool = False) -> PackedBatch:
        """The microbatch on ``device``. Spans are computed on the host first (they are Python
        tuples the layers loop over): on a GPU nothing in a layer then waits for the device.
        ``non_blocking`` copies from pinned host memory, so the copy overlaps running work."""
        device = torch.device(device)
        if device.type == "cpu":
            return self
        spans = self.spans()
        return PackedBatch(
            sample_ids=self.sample_ids,
            tokens=_move(self.tokens, device, non_blocking),
            labels=_move(self.labels, device, non_blocking),
            positions=_move(self.positions, device, non_blocking),
            segments=_move(self.segments, device, non_blocking),
            vision=self.vision.to(device, non_blocking) if self.vision is not None else None,
            audio=self.audio.to(device, non_blocking) if self.audio is not None else None,
            _spans=spans,
        )


def _move(t: torch.Tensor, device: torch.device, non_blocking: bool) -> torch.Tensor:
    if non_blocking and device.type == "cuda":
        t = t.pin_memory()
    return t.to(device, non_blocking=non_blocking)


def segment_spans(segments: torch.Tensor) -> tuple[tuple[int, int], ...]:
    """``(start, end)`` of each run of equal ids; packing writes every segment contiguously."""
    if segments.numel() == 0:
        return ()
    cuts = (torch.nonzero(segments[1:] != segments[:-1]).flatten() + 1).tolist()
    bounds = [0, *cuts, segments.numel()]
    return tuple(zip(bounds[:-1], bounds[1:]))


def patchify(image: torch.Tensor, patch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[C, H, W] -> ([H/p * W/p, C*p*p] patches row-major, [n, 2] (row, col))."""
    c, h, w = image.shape
    if h % patch or w % patch:
        raise ValueError(f"image of {h}x{w} px is not a multiple of the patch size {patch}")
    rows, cols = h // patch, w // patch
    x = image.reshape(c, rows, patch, cols, patch).permute(1, 3, 0, 2, 4).reshape(rows * cols, c * patch * patch)
    grid = torch.stack(torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij"), -1).reshape(-1, 2)
    return x, grid


def fold_frames(clip: torch.Tensor, downsample: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[F, mel] -> ([F/d, mel*d], [F/d, 2] (frame, 0))."""
    frames, mel = clip.shape
    if frames % downsample:
        raise ValueError(f"audio clip of {frames} frames is not a multiple of the downsample {downsample}")
    n = frames // downsample
    grid = torch.stack([torch.arange(n), torch.zeros(n, dtype=torch.long)], -1)
    return clip.reshape(n, mel * downsample), grid


@dataclass(frozen=True, slots=True)
class PackingSpec:
    """What packing needs from the model config."""

    patch_size: int = 1
    image_merge: int = 1
    audio_downsample: int = 1
    audio_merge: int = 1
    has_vision: bool = False
    has_audio: bool = False

    @classmethod
    def from_model(cls, model) -> PackingSpec:
        v, a = model.vision, model.audio
        return cls(
            patch_size=v.patch_size if v else 1,
            image_merge=v.token_merge if v else 1,
            audio_downsample=a.downsample if a else 1,
            audio_merge=a.token_merge if a else 1,
            has_vision=v is not None,
            has_audio=a is not None,
        )


class _EncoderParts:
    def __init__(self) -> None:
        self.features: list[torch.Tensor] = []
        self.grids: list[torch.Tensor] = []
        self.segments: list[torch.Tensor] = []
        self.llm_positions: list[torch.Tensor] = []

    def add(self, feats: torch.Tensor, grid: torch.Tensor, llm_start: int, merge: int) -> int:
        n = feats.shape[0]
        if n % merge:
            raise ValueError(f"a medium of {n} tokens is not a multiple of the projector's token merge {merge}")
        self.segments.append(torch.full((n,), len(self.features), dtype=torch.long))
        self.features.append(feats)
        self.grids.append(grid)
        self.llm_positions.append(torch.arange(llm_start, llm_start + n // merge))
        return n // merge

    def build(self, in_features: int, dtype: torch.dtype) -> EncoderInput:
        def cat(parts, empty):
            return torch.cat(parts) if parts else empty

        long0 = torch.zeros(0, dtype=torch.long)
        return EncoderInput(
            features=cat(self.features, torch.zeros(0, in_features)).to(dtype),
            grid=cat(self.grids, torch.zeros(0, 2, dtype=torch.long)),
            segments=cat(self.segments, long0),
            llm_positions=cat(self.llm_positions, long0),
        )


def pack(
    samples: Sequence[Sample],
    spec: PackingSpec,
    dtype: torch.dtype = torch.float32,
    vision_in: int = 0,
    audio_in: int = 0,
    media: bool = True,
) -> PackedBatch:
    """One microbatch of ``samples`` (in that order); ``*_in`` size empty encoder inputs.

    ``media=False``: the layout alone, for a stage that holds no encoder input layer (``patch_embed``,
    ``frame_embed``: the only layers that read pixels and frames). Every medium's tokens are counted from
    its sample's meta, the samples need no pixels or frames (``Dataset.layout``), and the encoder inputs'
    ``features`` are ``[tokens, 0]``; everything else is what ``media=True`` packs."""
    tokens, labels, positions, segments = [], [], [], []
    vision, audio = _EncoderParts(), _EncoderParts()
    offset = 0
    for seg, sample in enumerate(samples):
        if media:
            images, clips = iter(sample.images), iter(sample.audio)
        else:  # media of their sizes without pixels or frames: [0, H, W] and [F, 0], which patchify and
            # fold_frames make [tokens, 0] with a real medium's grid
            images = (torch.empty(0, h, w) for h, w in sample.meta.image_sizes)
            clips = (torch.empty(frames, 0) for frames in sample.meta.audio_frames)
        seq: list[torch.Tensor] = []
        is_target: list[torch.Tensor] = []
        for piece, is_medium, targets in _split_at_media(sample, spec):
            pos = offset + sum(len(s) for s in seq)
            if is_medium:
                # Without a media mask the ids say which medium; with one (a HuggingFace tokenizer's ids), a
                # LLaVA's slots are all images, whatever its image token's id, and a composition's records
                # (``hf_llava``) write ``AUDIO`` for a clip: a model with an audio encoder reads it so.
                if int(piece) == AUDIO and (sample.media is None or spec.has_audio):
                    feats, grid = fold_frames(next(clips), spec.audio_downsample)
                    n = audio.add(feats, grid, pos, spec.audio_merge)
                else:
                    feats, grid = patchify(next(images), spec.patch_size)
                    n = vision.add(feats, grid, pos, spec.image_merge)
                seq.append(torch.full((n,), int(piece), dtype=torch.long))
                is_target.append(torch.zeros(n, dtype=torch.bool))
            else:
                seq.append(piece)
                is_target.append(targets)
        toks, target = torch.cat(seq), torch.cat(is_target)
        # Position j-1 predicts token j when token j is a target (text; BOS and media slots never).
        lab = torch.full_like(toks, IGNORE)
        target[0] = False
        lab[:-1] = torch.where(target[1:], toks[1:], IGNORE)
        tokens.append(toks)
        labels.append(lab)
        positions.append(torch.arange(len(toks)))
        segments.append(torch.full((len(toks),), seg, dtype=torch.long))
        offset += len(toks)
    return PackedBatch(
        sample_ids=tuple(s.meta.index for s in samples),
        tokens=torch.cat(tokens),
        labels=torch.cat(labels),
        positions=torch.cat(positions),
        segments=torch.cat(segments),
        vision=vision.build(vision_in if media else 0, dtype) if spec.has_vision else None,
        audio=audio.build(audio_in if media else 0, dtype) if spec.has_audio else None,
    )


def _split_at_media(sample: Sample, spec: PackingSpec) -> list[tuple[torch.Tensor, bool, torch.Tensor | None]]:
    """(piece, is it a medium's placeholder, its tokens' target flags) in order: text runs and
    single placeholders. A sample's ``media`` mask says where its placeholders are; without one
    the ``IMAGE``/``AUDIO`` ids are (the byte-level tokenizer never produces them for text)."""
    tokens = sample.tokens
    if sample.media is not None:
        media = sample.media
    else:
        media = ((tokens == IMAGE) & spec.has_vision) | ((tokens == AUDIO) & spec.has_audio)
    targets = sample.targets if sample.targets is not None else torch.ones_like(tokens, dtype=torch.bool)
    pieces, start = [], 0
    for m in media.nonzero().flatten().tolist():
        if m > start:
            pieces.append((tokens[start:m], False, targets[start:m]))
        pieces.append((tokens[m : m + 1], True, None))
        start = m + 1
    if start < len(tokens):
        pieces.append((tokens[start:], False, targets[start:]))
    return pieces
