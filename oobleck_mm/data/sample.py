"""What a training sample is: its metadata (known without decoding) and its loaded tensors.

Every dataset returns ``SampleMeta`` for any index cheaply (the balancer and the
loss normaliser read it for the whole global batch before anything is loaded)
and ``Sample`` when the sample is actually needed by a stage.

Text is a sequence of token ids that starts with ``BOS`` and holds one
``IMAGE`` placeholder per image and one ``AUDIO`` placeholder per clip, in the
order the media appear. Packing expands each placeholder into the projected
encoder tokens of that medium. The loss is next-token prediction on text:
every text token except the leading ``BOS`` is a target, placeholders and
media tokens are not. So ``loss_tokens = text_tokens - 1 - num_images - num_audio``
where ``text_tokens`` counts every id in ``Sample.tokens``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: the master checks synthetic data without torch (data/build.py)
    import torch

# Special token ids; byte-level text uses the ids above them (see oobleck_mm.data.tokenizer).
PAD, BOS, EOS, IMAGE, AUDIO = 0, 1, 2, 3, 4
NUM_SPECIAL_TOKENS = 5


@dataclass(frozen=True, slots=True)
class SampleMeta:
    index: int
    """Position of the sample in its dataset."""
    text_tokens: int
    """Length of ``Sample.tokens``: text ids including BOS/EOS and one placeholder per medium."""
    image_sizes: tuple[tuple[int, int], ...] = ()
    """(height, width) in pixels of each image, after preprocessing (multiples of the patch size)."""
    audio_frames: tuple[int, ...] = ()
    """Mel frames of each audio clip, before the encoder's frame downsampling (a multiple of it)."""
    target_tokens: int | None = None
    """Loss targets when only some text is trained on (``data.loss_on: assistant``, see
    ``Sample.targets``); None: every text token but the leading BOS."""

    @property
    def num_images(self) -> int:
        return len(self.image_sizes)

    @property
    def num_audio(self) -> int:
        return len(self.audio_frames)

    @property
    def loss_tokens(self) -> int:
        """Text targets this sample contributes to the loss."""
        if self.target_tokens is not None:
            return self.target_tokens
        return self.text_tokens - 1 - self.num_images - self.num_audio

    def image_patches(self, patch_size: int) -> tuple[int, ...]:
        """Patches of each image for a vision encoder with this patch size."""
        return tuple((h // patch_size) * (w // patch_size) for h, w in self.image_sizes)

    def llm_tokens(
        self, patch_size: int = 1, image_merge: int = 1, audio_downsample: int = 1, audio_merge: int = 1
    ) -> int:
        """Length of the sample's LLM sequence: text without placeholders plus media tokens."""
        media = sum(p // image_merge for p in self.image_patches(patch_size)) if self.image_sizes else 0
        media += sum(f // audio_downsample // audio_merge for f in self.audio_frames)
        return self.text_tokens - self.num_images - self.num_audio + media


@dataclass(slots=True)
class Sample:
    meta: SampleMeta
    tokens: torch.Tensor
    """int64 [text_tokens]: BOS, text ids, IMAGE/AUDIO placeholders where the media go, EOS."""
    images: list[torch.Tensor] = field(default_factory=list)
    """float32 [channels, height, width] per image, values in [0, 1], sizes as in ``meta``."""
    audio: list[torch.Tensor] = field(default_factory=list)
    """float32 [frames, mel_bins] per clip, frames as in ``meta``."""
    media: torch.Tensor | None = None
    """bool [text_tokens]: where the image placeholders are, for tokenizers whose ids may equal
    ``IMAGE`` (a HuggingFace tokenizer); None: the ``IMAGE``/``AUDIO`` ids mark them."""
    targets: torch.Tensor | None = None
    """bool [text_tokens]: which text tokens are loss targets (``meta.target_tokens`` of them, the
    leading token never); None: every text token but the first."""
