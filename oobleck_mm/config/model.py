"""The ``model`` section: the built-in model's towers (LLM, vision, audio, projector), or a HuggingFace
directory or a builder, and what ``model.frozen`` names. Declarations: each field's docstring is its
reference, each ``__post_init__`` checks its own fields (cross-field rules: ``config.validation``)."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from typing import ClassVar

from oobleck_mm.config.huggingface import PARTS, HFModelShape, composed_model_shape, hf_model_shape
from oobleck_mm.config.values import (
    ConfigError,
    as_bool,
    as_int,
    as_str,
    as_str_tuple,
    check,
    check_optional,
)


MAX_TOWER_LAYERS = 1024
"""Most blocks one tower may have: the largest published models have under 200, and the planner's
tables grow with the square of the layer count (1024 plans in about a second, 4096 takes 1.2 GB)."""
_LAYERS_WHY = "the planner's tables grow with the square of the layer count"


@dataclass(kw_only=True, slots=True)
class LLMConfig:
    _PATH: ClassVar[str] = "model.llm"
    num_layers: int
    """Transformer blocks of the language model."""
    hidden: int
    """Model width."""
    num_heads: int
    """Attention heads (query heads)."""
    num_kv_heads: int | None = None
    """Key/value heads for grouped-query attention; default: ``num_heads`` (plain multi-head)."""
    ffn_hidden: int | None = None
    """FFN inner width; default ``4 * hidden``."""
    vocab_size: int
    """Vocabulary size (token embedding rows and LM-head outputs)."""
    gated_ffn: bool = False
    """SwiGLU-style FFN with three matrices (Llama, Qwen) instead of two (GPT)."""
    tie_embeddings: bool = False
    """LM head shares the token-embedding matrix (counted once in the model's parameters)."""

    def __post_init__(self) -> None:
        check(self, "num_layers", as_int, minimum=1, maximum=MAX_TOWER_LAYERS, why=_LAYERS_WHY)
        for name in ("hidden", "num_heads", "vocab_size"):
            check(self, name, as_int, minimum=1)
        check_optional(self, "num_kv_heads", as_int, minimum=1)
        check_optional(self, "ffn_hidden", as_int, minimum=1)
        check(self, "gated_ffn", as_bool)
        check(self, "tie_embeddings", as_bool)
        self.num_kv_heads = self.num_heads if self.num_kv_heads is None else self.num_kv_heads
        self.ffn_hidden = 4 * self.hidden if self.ffn_hidden is None else self.ffn_hidden


@dataclass(kw_only=True, slots=True)
class VisionConfig:
    _PATH: ClassVar[str] = "model.vision"
    num_layers: int
    """Transformer blocks of the ViT encoder."""
    hidden: int
    num_heads: int
    ffn_hidden: int | None = None
    """FFN inner width; default ``4 * hidden``."""
    patch_size: int = 14
    """Square patch side in pixels; one patch is one encoder token."""
    in_channels: int = 3
    token_merge: int = 1
    """Encoder tokens concatenated into one before the projector (Qwen2-VL's 2x2 merger is 4;
    OrchMLLM's "downsample before the connector"). The LLM sees patches / token_merge tokens."""

    def __post_init__(self) -> None:
        check(self, "num_layers", as_int, minimum=1, maximum=MAX_TOWER_LAYERS, why=_LAYERS_WHY)
        for name in ("hidden", "num_heads", "patch_size", "in_channels", "token_merge"):
            check(self, name, as_int, minimum=1)
        check_optional(self, "ffn_hidden", as_int, minimum=1)
        self.ffn_hidden = 4 * self.hidden if self.ffn_hidden is None else self.ffn_hidden


@dataclass(kw_only=True, slots=True)
class AudioConfig:
    _PATH: ClassVar[str] = "model.audio"
    num_layers: int
    """Transformer blocks of the audio encoder (Whisper-style)."""
    hidden: int
    num_heads: int
    ffn_hidden: int | None = None
    """FFN inner width; default ``4 * hidden``."""
    mel_bins: int = 80
    """Mel-spectrogram features per input frame."""
    downsample: int = 2
    """Input frames folded into one encoder token by the frame embedding (Whisper's stride-2 conv is 2)."""
    token_merge: int = 1
    """Encoder tokens concatenated into one before the projector (the LLM sees frames / token_merge)."""

    def __post_init__(self) -> None:
        check(self, "num_layers", as_int, minimum=1, maximum=MAX_TOWER_LAYERS, why=_LAYERS_WHY)
        for name in ("hidden", "num_heads", "mel_bins", "downsample", "token_merge"):
            check(self, name, as_int, minimum=1)
        check_optional(self, "ffn_hidden", as_int, minimum=1)
        self.ffn_hidden = 4 * self.hidden if self.ffn_hidden is None else self.ffn_hidden


@dataclass(kw_only=True, slots=True)
class ProjectorConfig:
    _PATH: ClassVar[str] = "model.projector"
    num_layers: int = 1
    """Linear layers of each encoder's MLP projector into the LLM width (1 or 2)."""

    def __post_init__(self) -> None:
        check(self, "num_layers", as_int, minimum=1)
        if self.num_layers > 2:
            raise ConfigError(f"model.projector.num_layers: must be 1 or 2, got {self.num_layers}")


# Module names `model.frozen` accepts besides exact layer names (see spec.resolve_frozen).
FROZEN_MODULES = ("vision", "audio", "projector", "llm")


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    _PATH: ClassVar[str] = "model"
    name: str = ""
    """Model name, used for profile caching and logs; default: the ``huggingface`` folder's name."""
    huggingface: str | dict[str, str] | None = None
    """A local ``transformers`` model directory (config.json, optionally safetensors weights and
    tokenizer files); its config.json gives the model's shape, so ``llm``, ``vision``, ``audio`` and
    ``projector`` are not set with it. Or a composition of separately pretrained parts, ``{vision: DIR,
    llm: DIR, projector: DIR}`` (``projector`` optional). See docs/models.md for the supported
    architectures."""
    builder: str | None = None
    """Your own model: ``package.module:function`` or ``path/to/file.py:function`` returning its
    layers (``oobleck_mm.config.shape.CustomLayer``, contract in docs/models.md). The ``llm`` (and
    ``vision``/``audio``) sections still describe the inputs the data pipeline makes."""
    llm: LLMConfig | None = None
    """The built-in language model; required unless ``huggingface`` is set."""
    vision: VisionConfig | None = None
    """Image encoder; absent for a text-only model."""
    audio: AudioConfig | None = None
    """Audio encoder; absent when the model takes no audio."""
    projector: ProjectorConfig = field(default_factory=ProjectorConfig)
    """Shape of the projector each encoder has."""
    frozen: tuple[str, ...] = ()
    """Modules whose weights are not trained: any of vision, audio, projector, llm, or exact
    layer names (``llm.block0``; ``vision.projector`` covers ``vision.projector0/1``)."""

    def __post_init__(self) -> None:
        if self.name != "":
            check(self, "name", as_str)
        check(self, "frozen", as_str_tuple)
        if isinstance(self.huggingface, dict):
            self.huggingface = _composition(self.huggingface)
        else:
            check_optional(self, "huggingface", as_str)
        check_optional(self, "builder", as_str)
        if self.builder is not None and self.huggingface is not None:
            raise ConfigError("model.builder: cannot be set together with model.huggingface; choose one")
        if self.huggingface is None:
            if self.llm is None:
                raise ConfigError(
                    "model.llm: required but missing (or set model.huggingface to a local transformers model directory)"
                )
            if not self.name:
                raise ConfigError("model.name: required but missing")
            return
        if isinstance(self.huggingface, str):
            self.huggingface = os.path.abspath(os.path.expanduser(self.huggingface))
        shape = self.hf
        derived = shape.sections()
        llm = LLMConfig(**derived["llm"])
        vision = VisionConfig(**derived["vision"]) if "vision" in derived else None
        projector = ProjectorConfig(**derived.get("projector", {}))
        # A section equal to the derived one is what to_dict/asdict round trips carry; any other is a conflict.
        audio = AudioConfig(**derived["audio"]) if "audio" in derived else None
        given = {"llm": (self.llm, llm), "vision": (self.vision, vision), "audio": (self.audio, audio)}
        for key, (mine, theirs) in given.items():
            if mine is not None and mine != theirs:
                raise ConfigError(
                    f"model.{key}: cannot be set together with model.huggingface (the directory's "
                    "config.json gives the model's shape); remove one of them"
                )
        self.llm, self.vision, self.audio, self.projector = llm, vision, audio, projector
        if not self.name:
            named = (
                [self.huggingface]
                if isinstance(self.huggingface, str)
                else [self.huggingface[p] for p in ("llm", "vision", "audio") if p in self.huggingface]
            )
            self.name = "+".join(os.path.basename(d.rstrip(os.sep)) for d in named)

    @property
    def hf(self) -> HFModelShape | None:
        """The ``huggingface`` model (a directory's, or a composition's), or None for a built-in model."""
        if self.huggingface is None:
            return None
        if isinstance(self.huggingface, str):
            return hf_shape(self.huggingface)
        return composed_shape(tuple(sorted(self.huggingface.items())))


def _composition(parts: dict) -> dict[str, str]:
    """``model.huggingface`` as a composition: its keys checked, each directory absolute."""
    unknown = sorted(str(k) for k in parts if k not in PARTS)
    if unknown:
        raise ConfigError(f"model.huggingface: unknown part(s) {unknown}; a composition has {', '.join(PARTS)}")
    if "llm" not in parts or not ({"vision", "audio"} & set(parts)):
        raise ConfigError(
            "model.huggingface: a composition needs llm and an encoder (vision, audio or both): a causal LM's and "
            f"the towers' directories, projector optional; got {', '.join(sorted(map(str, parts))) or 'nothing'}"
        )
    return {
        k: os.path.abspath(os.path.expanduser(as_str(f"model.huggingface.{k}", parts[k]))) for k in PARTS if k in parts
    }


@functools.lru_cache(maxsize=8)
def hf_shape(directory: str) -> HFModelShape:
    """config.json read once per process (every layer build asks for it)."""
    return hf_model_shape(directory)


@functools.lru_cache(maxsize=8)
def composed_shape(parts: tuple[tuple[str, str], ...]) -> HFModelShape:
    """A composition's config.json files read once per process."""
    return composed_model_shape(dict(parts))
