"""Synthetic multimodal samples whose text can only be predicted from their images (and audio).

Each image shows 1-3 filled shapes (square, circle, triangle) in named colours
on a dark background, one shape per vertical column, and the text after the
image's placeholder names them left to right: ``<image>red circle, blue
square.`` A clip holds one steady tone and its text names the note: ``<audio>tone
e.`` A sample without media counts from a random number (``count 37: 37 38``).
Text longer than the descriptions continues with structured, learnable
filler (each shape's place in the image, then counting); text shorter than them
cuts every description evenly, so each placeholder keeps the start of its own.

Realistic skew: 0..``max_images_per_sample`` images (binomial, mean
``mean_images_per_sample``, so some samples have none), image sides drawn
between ``min_image_size`` and ``image_size`` in whole patches (not square in
general), lognormal text lengths (mean ``mean_text_tokens``, log-sigma
``text_length_sigma``), 80% of samples with one clip when the model has audio.

Everything about sample ``i`` is a function of (data.seed, i): one block of
uniform draws from ``numpy.random.default_rng([seed, i])``. ``meta(i)`` reads
only those draws (no rendering); ``dataset[i]`` renders them.

Sequence limit: an image whose tokens do not fit what ``max_seq_len`` leaves
after BOS/EOS and the images before it is dropped, a clip is shortened to what
is left, and the text is cut to the rest, so no sample exceeds ``max_seq_len``
(the constructor refuses a limit that cannot hold one smallest image).
"""

from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import dataclass
from functools import lru_cache
from statistics import NormalDist
from typing import TYPE_CHECKING

import numpy as np

from oobleck_mm.errors import UserError
from oobleck_mm.config import DataConfig
from oobleck_mm.config.data import SYNTHETIC_AUDIO_PROBABILITY
from oobleck_mm.data.dataset import ModelInputs, check_index
from oobleck_mm.data.sample import AUDIO, BOS, EOS, IMAGE, Sample, SampleMeta
from oobleck_mm.data.tokenizer import encode

if TYPE_CHECKING:  # torch is imported where a sample is made: the master checks this data without it
    import torch

COLOURS: dict[str, tuple[float, float, float]] = {
    "red": (0.9, 0.1, 0.1),
    "green": (0.1, 0.8, 0.2),
    "blue": (0.15, 0.3, 0.95),
    "yellow": (0.95, 0.9, 0.1),
    "purple": (0.6, 0.2, 0.8),
    "white": (1.0, 1.0, 1.0),
}
SHAPES = ("square", "circle", "triangle")
NOTES = ("c", "d", "e", "f", "g", "a", "b")
BACKGROUND = 0.1
AUDIO_PROBABILITY = SYNTHETIC_AUDIO_PROBABILITY
"""Share of samples with a clip when the model has an audio encoder."""
MAX_SHAPES = 3
_COLOUR_NAMES = tuple(COLOURS)
_ROWS = ("top", "middle", "bottom")
_NORMAL = NormalDist()
# Uniform draws per sample: images count, text length, clip (presence, length, note), counting start,
# then per image (height, width, shape count) and per shape (kind, colour, size, left, top).
_FIXED_DRAWS, _IMAGE_DRAWS, _SHAPE_DRAWS = 6, 3, 5


@dataclass(frozen=True, slots=True)
class Shape:
    kind: int
    """Index into SHAPES."""
    colour: int
    """Index into COLOURS."""
    top: int
    left: int
    size: int


@dataclass(frozen=True, slots=True)
class ImagePlan:
    height: int
    width: int
    shapes: tuple[Shape, ...]
    """Left to right, as the caption names them."""


@dataclass(frozen=True, slots=True)
class SamplePlan:
    """Every random choice of one sample; rendering it needs no randomness."""

    index: int
    images: tuple[ImagePlan, ...]
    clip_frames: tuple[int, ...]
    clip_notes: tuple[int, ...]
    text_bytes: int
    """Text tokens besides BOS, EOS and placeholders."""
    count_from: int
    """Start of the counting filler."""

    @property
    def meta(self) -> SampleMeta:
        return SampleMeta(
            index=self.index,
            text_tokens=2 + len(self.images) + len(self.clip_frames) + self.text_bytes,
            image_sizes=tuple((im.height, im.width) for im in self.images),
            audio_frames=self.clip_frames,
        )


class SyntheticDataset:
    """``data.num_samples`` generated samples shaped for the model in ``inputs``."""

    def __init__(self, data: DataConfig, inputs: ModelInputs) -> None:
        self.data, self.inputs = data, inputs
        self._max_images = data.max_images_per_sample if inputs.has_vision else 0
        self._image_cdf = _binomial_cdf(self._max_images, data.mean_images_per_sample)
        p = inputs.patch_size
        low = max(p, math.ceil(data.min_image_size / p) * p)
        self._sides = tuple(range(low, max(low, data.image_size // p * p) + 1, p))
        # Heights in whole multiples of the projector's token merge, so every image's patch count divides by
        # it (the projector merges consecutive patches of one image); with no merge, the same as the widths.
        step = p * inputs.image_merge
        low_h = max(step, math.ceil(data.min_image_size / step) * step)
        self._heights = tuple(range(low_h, max(low_h, data.image_size // step * step) + 1, step))
        self._clip_mean = data.mean_audio_seconds * data.audio_frames_per_second / AUDIO_PROBABILITY
        sigma = data.text_length_sigma
        self._log_mu = math.log(data.mean_text_tokens) - sigma * sigma / 2  # lognormal mean = mean_text_tokens
        self._num_draws = _FIXED_DRAWS + self._max_images * (_IMAGE_DRAWS + MAX_SHAPES * _SHAPE_DRAWS)
        self._palette = _palette(inputs.in_channels)
        self._check_fits()
        # meta(i) of a global batch is read just before dataset[i]: keep recent plans.
        self.plan = lru_cache(maxsize=8192)(self._plan)

    def _check_fits(self) -> None:
        smallest = 2 + (self.inputs.image_llm_tokens(self._heights[0], self._sides[0]) if self._max_images else 0)
        if smallest > self.data.max_seq_len:
            raise UserError(
                f"data.max_seq_len ({self.data.max_seq_len}) cannot hold even one image of the smallest size "
                f"{self._heights[0]}x{self._sides[0]} ({smallest - 2} tokens) plus BOS/EOS; raise it to at least "
                f"{smallest} or lower data.min_image_size"
            )

    def __len__(self) -> int:
        return self.data.num_samples

    def meta(self, index: int) -> SampleMeta:
        return self.plan(index).meta

    def __getitem__(self, index: int) -> Sample:
        plan = self.plan(index)
        sample = self.layout(index)
        sample.images = [self._render_image(im) for im in plan.images]
        sample.audio = [_render_clip(f, n, self.inputs.mel_bins) for f, n in zip(plan.clip_frames, plan.clip_notes)]
        return sample

    def layout(self, index: int) -> Sample:
        """Sample ``index`` without pixels or frames (``data.dataset.Dataset``): rendering them is most of what
        a sample costs."""
        plan = self.plan(index)
        return Sample(meta=plan.meta, tokens=self._tokens(plan))

    # ------------------------------------------------------------------ drawing (cheap, no pixels)

    def _plan(self, index: int) -> SamplePlan:
        """Every random choice of sample ``index`` (``self.plan`` is this, cached)."""
        index = check_index(index, len(self))
        draws = iter(np.random.default_rng([self.data.seed, index]).random(self._num_draws).tolist())
        num_images = bisect.bisect_right(self._image_cdf, next(draws))
        length_draw = next(draws)
        has_clip, clip_draw, note_draw = next(draws) < AUDIO_PROBABILITY, next(draws), next(draws)
        count_from = int(next(draws) * 100)
        budget = self.data.max_seq_len - 2  # BOS and EOS
        images = []
        for _ in range(num_images):
            image = self._draw_image(draws)
            tokens = self.inputs.image_llm_tokens(image.height, image.width)
            if tokens <= budget:  # else dropped: the sample would not fit max_seq_len
                images.append(image)
                budget -= tokens
        clips, notes = (), ()
        if self.inputs.has_audio and has_clip:
            unit = self.inputs.frames_unit
            if self.inputs.audio_clip_frames:  # a tower of one clip length (Whisper's 30 s): dropped if too long
                frames = self.inputs.audio_clip_frames if self.inputs.audio_clip_frames <= unit * budget else 0
            else:
                frames = unit * max(1, round(self._clip_mean * (0.5 + clip_draw) / unit))
                frames = min(frames, unit * budget)  # one LLM token per unit of frames
            if frames > 0:
                clips, notes = (frames,), (int(note_draw * len(NOTES)),)
                budget -= frames // unit
        text = self._text_length(length_draw)
        return SamplePlan(
            index=index,
            images=tuple(images),
            clip_frames=clips,
            clip_notes=notes,
            text_bytes=max(0, min(text, budget + 2) - 2),
            count_from=count_from,
        )

    def _text_length(self, u: float) -> int:
        """BOS + text + EOS tokens: lognormal with mean data.mean_text_tokens."""
        z = _NORMAL.inv_cdf(min(max(u, 1e-12), 1 - 1e-12))
        return max(2, round(math.exp(self._log_mu + self.data.text_length_sigma * z)))

    def _draw_image(self, draws) -> ImagePlan:
        height = self._heights[int(next(draws) * len(self._heights))]
        width = self._sides[int(next(draws) * len(self._sides))]
        num_shapes = 1 + int(next(draws) * MAX_SHAPES)
        column = width // num_shapes
        shapes = []
        for c in range(num_shapes):
            kind, colour = int(next(draws) * len(SHAPES)), int(next(draws) * len(COLOURS))
            largest = max(1, min(column, height))
            size = largest - int(next(draws) * (largest // 2 + 1)) if largest > 1 else 1
            left = c * column + int(next(draws) * (column - size + 1))
            top = int(next(draws) * (height - size + 1))
            shapes.append(Shape(kind=kind, colour=colour, top=top, left=left, size=size))
        for _ in range(num_shapes, MAX_SHAPES):  # keep the next image's draws at fixed offsets
            for _ in range(_SHAPE_DRAWS):
                next(draws)
        return ImagePlan(height=height, width=width, shapes=tuple(shapes))

    # ------------------------------------------------------------------ text

    def _tokens(self, plan: SamplePlan) -> torch.Tensor:
        import torch

        placeholders = [IMAGE] * len(plan.images) + [AUDIO] * len(plan.clip_frames)
        descriptions = [describe_image(im) for im in plan.images]
        descriptions += [f"tone {NOTES[n]}." for n in plan.clip_notes]
        if not descriptions:  # text only: counting, predictable once its start is seen
            placeholders, descriptions = [None], [f"count {plan.count_from}:"]
        cuts = _allocate([len(d) for d in descriptions], plan.text_bytes)
        texts = [d[:cut] for d, cut in zip(descriptions, cuts)]
        texts[-1] += _filler(plan, plan.text_bytes - sum(cuts))  # > 0 only when nothing was cut
        ids = [BOS]
        for placeholder, text in zip(placeholders, texts):
            if placeholder is not None:
                ids.append(placeholder)
            ids += encode(text, self.inputs.vocab_size)
        ids.append(EOS)
        return torch.tensor(ids, dtype=torch.int64)

    # ------------------------------------------------------------------ pixels

    def _render_image(self, image: ImagePlan) -> torch.Tensor:
        import torch

        channels = self._palette.shape[1]
        canvas = np.full((image.height, image.width, channels), BACKGROUND, dtype=np.float32)
        for s in image.shapes:
            region = canvas[s.top : s.top + s.size, s.left : s.left + s.size]
            region[_mask(s.kind, s.size)] = self._palette[s.colour]
        return torch.from_numpy(np.ascontiguousarray(canvas.transpose(2, 0, 1)))


def describe_image(image: ImagePlan) -> str:
    """The caption of an image: its shapes left to right, e.g. ``red circle, blue square.``"""
    return ", ".join(f"{_COLOUR_NAMES[s.colour]} {SHAPES[s.kind]}" for s in image.shapes) + "."


def _filler(plan: SamplePlan, length: int) -> str:
    """``length`` characters that continue a sample's text predictably: details, then counting."""
    if length <= 0:
        return ""
    parts = []
    for image in plan.images:
        for s in image.shapes:
            row = _ROWS[min(2, 3 * (s.top + s.size // 2) // image.height)]
            parts.append(f" the {_COLOUR_NAMES[s.colour]} {SHAPES[s.kind]} is at the {row}, {s.size} px.")
    for note in plan.clip_notes:
        parts.append(f" the tone is {NOTES[note]}.")
    text, n = "".join(parts), plan.count_from
    chunks = [text]
    size = len(text)
    while size < length:
        chunk = f" {n}"
        chunks.append(chunk)
        size += len(chunk)
        n += 1
    return "".join(chunks)[:length]


def _allocate(lengths: list[int], budget: int) -> list[int]:
    """Characters kept of each description: all of them if they fit, else ``budget`` shared evenly."""
    keep = [0] * len(lengths)
    active = [i for i, n in enumerate(lengths) if n > 0]
    while budget > 0 and active:
        share = max(1, budget // len(active))
        for i in list(active):
            take = min(share, lengths[i] - keep[i], budget)
            keep[i] += take
            budget -= take
            if keep[i] == lengths[i]:
                active.remove(i)
            if budget == 0:
                break
    return keep


def _binomial_cdf(n: int, mean: float) -> tuple[float, ...]:
    """P(count <= k) for k < n; the count of a uniform draw u is the number of entries <= u."""
    if n == 0 or mean <= 0:
        return (1.0,)
    p = min(1.0, mean / n)
    pmf = [math.comb(n, k) * p**k * (1 - p) ** (n - k) for k in range(n)]
    return tuple(itertools.accumulate(pmf))


def _palette(channels: int) -> np.ndarray:
    rgb = np.array(list(COLOURS.values()), dtype=np.float32)
    if channels == 3:
        return rgb
    # Grey (or other) channel counts: distinct levels per colour, the same in every channel.
    levels = np.linspace(0.3, 1.0, len(COLOURS), dtype=np.float32)
    return np.repeat(levels[:, None], channels, axis=1)


@lru_cache(maxsize=512)
def _mask(kind: int, size: int) -> np.ndarray:
    y, x = np.mgrid[0:size, 0:size].astype(np.float32) + 0.5
    if SHAPES[kind] == "square":
        return np.ones((size, size), dtype=bool)
    if SHAPES[kind] == "circle":
        r = size / 2
        return (y - r) ** 2 + (x - r) ** 2 <= r * r
    return np.abs(x - size / 2) <= y / 2  # triangle, apex at the top


def _render_clip(frames: int, note: int, mel_bins: int) -> torch.Tensor:
    """A steady tone: a bright band at the note's mel bin, a weaker harmonic, a faint floor."""
    import torch

    spectrum = np.full(mel_bins, 0.05, dtype=np.float32)
    band = min(mel_bins - 1, int((note + 0.5) * mel_bins / len(NOTES)))
    spectrum[band] = 1.0
    for neighbour in (band - 1, band + 1):
        if 0 <= neighbour < mel_bins:
            spectrum[neighbour] = 0.4
    if 2 * band + 1 < mel_bins:
        spectrum[2 * band + 1] = 0.3
    envelope = np.minimum(1.0, np.linspace(0.2, 3.0, frames, dtype=np.float32))
    return torch.from_numpy(envelope[:, None] * spectrum[None, :])
