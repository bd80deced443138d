"""The ``data`` section: the dataset, or the synthetic workload's shape, and the defaults the workload
takes when a field is left out. Declarations (cross-field rules: ``config.validation``)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import ClassVar

from oobleck_mm.config.values import (
    ConfigError,
    as_bool,
    as_choice,
    as_float,
    as_int,
    as_str,
    check,
    check_optional,
)


DEFAULT_IMAGE_SIZE = 224
"""``data.image_size`` of a model whose vision tower does not name one (the built-in model)."""
SYNTHETIC_TEXT_TOKENS = 32.0
"""``data.mean_text_tokens`` of synthetic data when not given."""
SYNTHETIC_IMAGES_PER_SAMPLE = 1.0
SYNTHETIC_AUDIO_PROBABILITY = 0.8
"""Share of synthetic samples with an audio clip when the model has an audio encoder."""
"""``data.mean_images_per_sample`` of synthetic data for a model with a vision encoder, when not given."""


DATA_KINDS = ("synthetic", "llava_json", "hf_datasets", "webdataset")
COLUMN_ROLES = ("id", "conversations", "text", "image", "audio")
"""What ``data.columns`` may map (``oobleck_mm.data.hf_datasets``)."""


@dataclass(kw_only=True, slots=True)
class DataConfig:
    _PATH: ClassVar[str] = "data"
    kind: str = "synthetic"
    """``synthetic`` (generated from the shape below), ``llava_json`` (a LLaVA-style JSON file) or
    ``hf_datasets`` (a HuggingFace ``datasets`` folder or Parquet files, ``oobleck_mm.data.hf_datasets``) or
    ``webdataset`` (tar shards, ``oobleck_mm.data.webdataset``). What this section says of ``llava_json``
    holds for the last two too."""
    path: str | None = None
    """Dataset file (``llava_json``), or ``save_to_disk`` folder, Parquet file or folder of them
    (``hf_datasets``), or the shards: a brace pattern, a glob, a tar or a folder of them (``webdataset``);
    required for all three."""
    columns: dict[str, str] = field(default_factory=dict)
    """``hf_datasets``: which column holds what, ``{role: column}`` for the roles ``id``, ``conversations``
    (LLaVA turns or chat messages), ``text`` (a caption, instead of ``conversations``) and ``image``
    (``datasets`` Images or paths, one or a list). Default: the columns named like the roles.
    ``webdataset``: the member extension of each role (defaults: ``txt``, ``json``, an image's)."""
    split: str = "train"
    """``hf_datasets``: the split of a ``DatasetDict`` folder."""
    image_dir: str | None = None
    """Folder the ``llava_json`` image paths are relative to; a relative folder is taken relative
    to the JSON file's folder (``hf_datasets``: the dataset folder). Default: that folder."""
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
    mean_audio_seconds: float | None = None
    """Mean audio seconds per sample; > 0 exactly when the model has an audio encoder. Synthetic data: 0
    without an audio encoder, required with one. A dataset's (``llava_json``, ``hf_datasets``,
    ``webdataset``): measured over its clips by the master when not given."""
    audio_frames_per_second: float = 100.0
    """Mel frames per second of audio (10 ms hop)."""
    max_audio_seconds: float = 30.0
    """Records' audio clips (``llava_json``, ``hf_datasets``, ``webdataset``): a longer clip is cut to its
    first this many seconds (Whisper's 30 s window by default)."""
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
        check(self, "kind", as_choice, DATA_KINDS)
        if not isinstance(self.columns, dict) or not all(isinstance(v, str) and v for v in self.columns.values()):
            raise ConfigError(f"data.columns: expected a mapping of role to column name, got {self.columns!r}")
        if unknown := sorted(set(self.columns) - set(COLUMN_ROLES)):
            raise ConfigError(
                f"data.columns: unknown role {unknown[0]!r}; valid: {', '.join(COLUMN_ROLES)} (each naming a column)"
            )
        if "conversations" in self.columns and "text" in self.columns:
            raise ConfigError("data.columns: name either 'conversations' or 'text' (a caption), not both")
        check(self, "split", as_str)
        check_optional(self, "path", as_str)
        if self.path is not None:
            self.path = os.path.expanduser(self.path)
            # (WebDataset shards are a pattern: its reader names a pattern that matches nothing, or a missing shard)
            if not os.path.exists(self.path) and self.kind != "webdataset":
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
        check_optional(self, "mean_audio_seconds", as_float, minimum=0.0)
        check(self, "audio_frames_per_second", as_float, positive=True)
        check(self, "max_audio_seconds", as_float, positive=True)
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
        if self.path is None or self.kind == "webdataset":  # (shards hold their images)
            return
        base = self.path if os.path.isdir(self.path) else os.path.dirname(os.path.abspath(self.path))
        folder = os.path.join(base, self.image_dir)
        if not os.path.isdir(folder):
            raise ConfigError(f"data.image_dir: folder {folder!r} does not exist")
