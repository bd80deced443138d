"""The dataset protocol every data source implements and the model facts datasets need.

A dataset answers ``meta(index)`` cheaply (no decoding, no rendering): the
balancer and the loss normaliser read the metadata of a whole global batch on
every rank before anything is loaded. ``dataset[index]`` then loads the sample;
its tensors always agree with its metadata.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from oobleck_mm.data.sample import Sample, SampleMeta
from oobleck_mm.data.tokenizer import check_vocab_size

if TYPE_CHECKING:
    from oobleck_mm.config import ModelConfig


@runtime_checkable
class Dataset(Protocol):
    def __len__(self) -> int: ...

    def meta(self, index: int) -> SampleMeta:
        """Metadata of sample ``index``, without loading it."""
        ...

    def __getitem__(self, index: int) -> Sample: ...

    # Optional: ``layout(index) -> Sample``, the sample without its media's pixels and frames (``images`` and
    # ``audio`` empty; text, media placeholders and targets as ``__getitem__`` gives them): what a stage that
    # holds no encoder input layer packs (``TrainingData.microbatch(media=False)``). A dataset without it is
    # read whole there, which is correct, only slower.


@dataclass(frozen=True, slots=True)
class ModelInputs:
    """What a dataset must know of the model to shape its samples."""

    vocab_size: int
    has_vision: bool = False
    patch_size: int = 1
    """Image sides are multiples of it."""
    in_channels: int = 3
    image_merge: int = 1
    has_audio: bool = False
    mel_bins: int = 0
    audio_downsample: int = 1
    """Clip frames are multiples of ``audio_downsample * audio_merge`` (whole LLM tokens)."""
    audio_merge: int = 1
    huggingface: str | None = None
    """The model's HuggingFace directory (a composition's: its LLM's): ``llava_json`` uses its tokenizer."""
    image_processor_dir: str | None = None
    """Where ``llava_json`` reads the image processor: the model's directory, a composition's vision part."""
    image_token_id: int | None = None
    image_side: int = 0
    """A HuggingFace tower's fixed square image side."""
    audio_clip_frames: int = 0
    """A HuggingFace audio tower's fixed clip length in mel frames (Whisper's 30 s); 0: clips vary."""

    @classmethod
    def from_model(cls, model: ModelConfig) -> ModelInputs:
        check_vocab_size(model.llm.vocab_size)
        kwargs: dict = {"vocab_size": model.llm.vocab_size}
        if model.vision is not None:
            v = model.vision
            kwargs.update(
                has_vision=True, patch_size=v.patch_size, in_channels=v.in_channels, image_merge=v.token_merge
            )
        if model.audio is not None:
            a = model.audio
            kwargs.update(has_audio=True, mel_bins=a.mel_bins, audio_downsample=a.downsample, audio_merge=a.token_merge)
        if model.huggingface is not None:
            hf = model.hf
            kwargs.update(
                huggingface=hf.directory,  # its tokenizer (a composition's: its LLM's, without an image token)
                image_processor_dir=hf.source("vision") if hf.vision is not None else None,
                image_token_id=hf.image_token_id,
                image_side=hf.vision["image_size"] if hf.vision else 0,
                audio_clip_frames=hf.audio_clip_frames,
            )
        return cls(**kwargs)

    @property
    def frames_unit(self) -> int:
        return self.audio_downsample * self.audio_merge

    def image_llm_tokens(self, height: int, width: int) -> int:
        return (height // self.patch_size) * (width // self.patch_size) // self.image_merge

    def clip_llm_tokens(self, frames: int) -> int:
        return frames // self.audio_downsample // self.audio_merge

    def llm_tokens(self, meta: SampleMeta) -> int:
        """Length of the sample's LLM sequence for this model."""
        return meta.llm_tokens(self.patch_size, self.image_merge, self.audio_downsample, self.audio_merge)


@dataclass(frozen=True, slots=True)
class BadSample:
    """A record left out under ``data.skip_bad_samples`` (``oobleck_mm.data.check``)."""

    position: int
    """The record's position in the JSON file (what ``data.excluded_samples`` lists)."""
    reason: str


def check_index(index: int, length: int) -> int:
    if isinstance(index, bool) or not hasattr(index, "__index__"):
        raise TypeError(f"sample index must be an integer, got {index!r}")
    index = index.__index__()
    if not 0 <= index < length:
        raise IndexError(f"sample index {index} out of range for a dataset of {length} samples")
    return index
