"""A local HuggingFace model directory (``model.huggingface: DIR``) read as the engine's model shape.

Only ``config.json`` is read here (plain JSON, no ``transformers`` import, so the
config package stays a leaf): it says which architecture the directory holds and
the sizes the planner needs. ``hf_model_shape`` turns it into the keyword
arguments of the built-in ``model.llm`` / ``model.vision`` / ``model.projector``
sections, so planning, packing, costs and the synthetic data see an HF model
exactly as they see a built-in one; ``oobleck_mm.model.huggingface`` builds the
layers from ``transformers``' own module classes.

Supported: ``LlavaForConditionalGeneration`` (a CLIP or SigLIP vision tower, a
Llama, Mistral or Qwen2 text model) and the text-only ``LlamaForCausalLM``,
``MistralForCausalLM``, ``Qwen2ForCausalLM``.

A *composition* (``model.huggingface: {vision: DIR, audio: DIR, llm: DIR, projector: DIR}``) builds the
same LLaVA-style model from separately pretrained parts, as LLaVA itself is first assembled: a vision
tower's directory (``CLIPVisionModel``/``SiglipVisionModel``, or a whole ``CLIPModel``/``SiglipModel``
whose vision half is used), a Whisper checkpoint's (its encoder is the audio tower), a causal LM's, and
optionally a projector directory holding each encoder's projector (``export`` writes one; without it
the projectors start from transformers' initialisation). Each part's tensors are read from, and
exported back to, its own directory (``HFModelShape.source``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from oobleck_mm.config.values import ConfigError

TEXT_MODELS = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2"}
TEXT_TYPES = ("llama", "mistral", "qwen2")
VISION_TYPES = ("clip_vision_model", "siglip_vision_model")
SUPPORTED_ARCHITECTURES = ("LlavaForConditionalGeneration", *TEXT_MODELS)
PARTS = ("vision", "audio", "llm", "projector")
"""The keys of a composition: ``llm`` and at least one encoder; ``projector`` may be left out."""
AUDIO_MODELS = {"WhisperForConditionalGeneration": "whisper", "WhisperModel": "whisper"}
"""Audio towers a composition takes: a Whisper checkpoint's encoder (its decoder is carried along untouched)."""
_AUDIO_DEFAULTS = {
    "whisper": dict(
        d_model=384, encoder_layers=4, encoder_attention_heads=6, encoder_ffn_dim=1536, num_mel_bins=80,
        max_source_positions=1500,
    ),
}  # fmt: skip
WHISPER_STRIDE = 2
"""Mel frames per Whisper token (its second convolution's stride): a clip of 2 x max_source_positions frames."""
VISION_TOWERS = {"CLIPVisionModel": "clip_vision_model", "SiglipVisionModel": "siglip_vision_model"}
WHOLE_VISION_MODELS = {"CLIPModel": "clip_vision_model", "SiglipModel": "siglip_vision_model"}
"""Dual-encoder models whose ``vision_config`` (and ``vision_model.*`` tensors) a composition uses."""
PROJECTOR_TYPE = "oobleck_mm_llava_projector"
"""``model_type`` of a projector directory (``export`` of a composition writes one)."""
LLAVA_FEATURE_LAYER = -2
"""LLaVA-1.5's ``vision_feature_layer``, which a composition uses: the second-to-last block's output."""

# Defaults of the transformers config classes for the keys a saved config.json may omit
# (save_pretrained writes only non-default values for nested configs of some versions).
_TEXT_DEFAULTS = {
    "llama": dict(
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        vocab_size=32000,
        tie_word_embeddings=False,
    ),
    "mistral": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=32000,
        tie_word_embeddings=False,
    ),
    "qwen2": dict(
        hidden_size=4096,
        intermediate_size=22016,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        vocab_size=151936,
        tie_word_embeddings=False,
    ),
}
_VISION_DEFAULTS = {
    "clip_vision_model": dict(
        hidden_size=768,
        intermediate_size=3072,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_channels=3,
        image_size=224,
        patch_size=32,
    ),
    "siglip_vision_model": dict(
        hidden_size=768,
        intermediate_size=3072,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_channels=3,
        image_size=224,
        patch_size=16,
    ),
}
# LlavaConfig's defaults when config.json leaves the sub-configs out.
_LLAVA_DEFAULT_TEXT, _LLAVA_DEFAULT_VISION = "llama", "clip_vision_model"


@dataclass(frozen=True, slots=True)
class HFModelShape:
    """What the engine needs to know of an HF model directory, from its ``config.json``."""

    directory: str
    architecture: str
    text_type: str
    """``llama``, ``mistral`` or ``qwen2``."""
    text: dict[str, Any]
    """The text model's config (the whole config.json for a text-only model)."""
    vision_type: str | None = None
    vision: dict[str, Any] | None = None
    vision_layers_used: int = 0
    """Vision blocks whose output reaches the projector (``vision_feature_layer``); later ones are
    kept untouched for export but never run."""
    drop_cls: bool = False
    """``vision_feature_select_strategy: default`` on a CLIP tower drops its CLS token."""
    image_token_id: int | None = None
    projector_bias: bool = True
    projector_act: str = "gelu"
    tie_word_embeddings: bool = False
    audio_type: str | None = None
    audio: dict[str, Any] | None = None
    """A composition's Whisper config (its encoder is the audio tower)."""
    sources: tuple[tuple[str, str | None], ...] = ()
    """A composition's directory per component (``text``, ``head``, ``vision``, ``projector``; None: a
    projector with no directory); empty for one directory, which holds every component."""

    @property
    def composed(self) -> bool:
        return bool(self.sources)

    def source(self, component: str) -> str | None:
        """The directory holding ``component``'s tensors (None: nowhere, it starts from its initialisation)."""
        return dict(self.sources)[component] if self.sources else self.directory

    @property
    def sliding_window(self) -> int | None:
        """Mistral's attention window: the engine's packed attention is full within a sample, which
        is the same only for samples no longer than it (``validate`` checks ``data.max_seq_len``)."""
        window = self.text.get("sliding_window")
        return window if self.text_type == "mistral" and isinstance(window, int) else None

    @property
    def is_multimodal(self) -> bool:
        return self.vision is not None or self.audio is not None

    @property
    def audio_clip_frames(self) -> int:
        """Mel frames of every audio clip (Whisper's 30 s: its feature extractor pads or cuts each clip)."""
        return WHISPER_STRIDE * self.audio["max_source_positions"] if self.audio is not None else 0

    @property
    def encoders(self) -> tuple[str, ...]:
        return tuple(m for m, cfg in (("vision", self.vision), ("audio", self.audio)) if cfg is not None)

    def sections(self) -> dict[str, dict[str, Any]]:
        """Keyword arguments of the built-in ``llm``, ``vision`` and ``projector`` sections."""
        t = self.text
        heads = t["num_attention_heads"]
        out: dict[str, dict[str, Any]] = {
            "llm": dict(
                num_layers=t["num_hidden_layers"],
                hidden=t["hidden_size"],
                num_heads=heads,
                num_kv_heads=t.get("num_key_value_heads") or heads,
                ffn_hidden=t["intermediate_size"],
                vocab_size=t["vocab_size"],
                gated_ffn=True,
                tie_embeddings=self.tie_word_embeddings,
            ),
        }
        if self.vision is not None:
            v = self.vision
            out["vision"] = dict(
                num_layers=self.vision_layers_used,
                hidden=v["hidden_size"],
                num_heads=v["num_attention_heads"],
                ffn_hidden=v["intermediate_size"],
                patch_size=v["patch_size"],
                in_channels=v["num_channels"],
                token_merge=1,
            )
        if self.audio is not None:
            a = self.audio
            out["audio"] = dict(
                num_layers=a["encoder_layers"],
                hidden=a["d_model"],
                num_heads=a["encoder_attention_heads"],
                ffn_hidden=a["encoder_ffn_dim"],
                mel_bins=a["num_mel_bins"],
                downsample=WHISPER_STRIDE,
                token_merge=1,
            )
        if self.is_multimodal:
            out["projector"] = dict(num_layers=2)  # LLaVA's linear_1, act, linear_2 (each encoder its own)
        return out


def read_config_json(directory: str, key: str = "model.huggingface") -> dict[str, Any]:
    path = os.path.join(directory, "config.json")
    if not os.path.isdir(directory):
        raise ConfigError(
            f"{key}: {directory!r} is not a directory (a transformers model directory "
            "on disk; `python examples/make_tiny_llava.py DIR` writes a small random one)"
        )
    try:
        with open(path, encoding="utf-8") as fh:
            raw = json.load(fh)
    except FileNotFoundError:
        raise ConfigError(
            f"{key}: {directory!r} has no config.json (a transformers model directory "
            "written by save_pretrained has one)"
        ) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{key}: {path} is not readable JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{key}: {path} must hold a JSON object, got {type(raw).__name__}")
    return raw


def _architecture(raw: dict[str, Any]) -> str:
    archs = raw.get("architectures") or []
    return archs[0] if isinstance(archs, list) and archs else raw.get("model_type", "<none>")


def composed_model_shape(parts: dict[str, str]) -> HFModelShape:
    """A composition's model (module docstring) as an ``HFModelShape``; ``ConfigError`` naming the part."""
    llm_dir, vision_dir, audio_dir = parts["llm"], parts.get("vision"), parts.get("audio")
    projector_dir = parts.get("projector")
    llm = read_config_json(llm_dir, "model.huggingface.llm")
    arch = _architecture(llm)
    if arch not in TEXT_MODELS:
        raise ConfigError(
            f"model.huggingface.llm: {os.path.join(llm_dir, 'config.json')} is a {arch!r}; a causal LM: "
            + ", ".join(TEXT_MODELS)
        )
    text_type = TEXT_MODELS[arch]
    text = {**_TEXT_DEFAULTS[text_type], **llm}
    _check_text(text, text_type, "model.huggingface.llm config.json")
    vision_type = vision = None
    if vision_dir is not None:
        raw = read_config_json(vision_dir, "model.huggingface.vision")
        tower = _architecture(raw)
        if tower in VISION_TOWERS:
            vision_type, vision_raw = VISION_TOWERS[tower], raw
        elif tower in WHOLE_VISION_MODELS:
            vision_type, vision_raw = WHOLE_VISION_MODELS[tower], raw.get("vision_config") or {}
        else:
            raise ConfigError(
                f"model.huggingface.vision: {os.path.join(vision_dir, 'config.json')} is a {tower!r}; a vision "
                f"tower: {', '.join((*VISION_TOWERS, *WHOLE_VISION_MODELS))}"
            )
        vision = {**_VISION_DEFAULTS[vision_type], **vision_raw}
    audio_type = audio = None
    if audio_dir is not None:
        raw = read_config_json(audio_dir, "model.huggingface.audio")
        tower = _architecture(raw)
        if tower not in AUDIO_MODELS:
            raise ConfigError(
                f"model.huggingface.audio: {os.path.join(audio_dir, 'config.json')} is a {tower!r}; an audio "
                f"tower: {', '.join(AUDIO_MODELS)}"
            )
        audio_type = AUDIO_MODELS[tower]
        audio = {**_AUDIO_DEFAULTS[audio_type], **raw}
        if audio.get("scale_embedding") or audio.get("encoder_layerdrop"):
            raise ConfigError(
                f"model.huggingface.audio: {os.path.join(audio_dir, 'config.json')} sets scale_embedding or "
                "encoder_layerdrop, which only Whisper's decoder / its training-time layer dropping use; the "
                "engine runs the encoder without them (set them to false / 0.0)"
            )
    act, bias = "gelu", True
    if projector_dir is not None:
        projector = read_config_json(projector_dir, "model.huggingface.projector")
        if projector.get("model_type") != PROJECTOR_TYPE:
            raise ConfigError(
                f"model.huggingface.projector: {os.path.join(projector_dir, 'config.json')} has model_type "
                f"{projector.get('model_type')!r}; a projector directory has {PROJECTOR_TYPE!r} (export of a "
                "composed model writes one; leave the key out to start the projectors afresh)"
            )
        sizes = {"text_hidden_size": text["hidden_size"]}
        sizes.update({"vision_hidden_size": vision["hidden_size"]} if vision is not None else {})
        sizes.update({"audio_hidden_size": audio["d_model"]} if audio is not None else {})
        for key, want in sizes.items():
            if projector.get(key) != want:
                raise ConfigError(
                    f"model.huggingface.projector: its {key} is {projector.get(key)!r}, the parts make it {want}"
                )
        act, bias = projector.get("projector_hidden_act", act), bool(projector.get("multimodal_projector_bias", bias))
    clip = vision_type == "clip_vision_model"
    return HFModelShape(
        directory=llm_dir,
        architecture="composition",
        text_type=text_type,
        text=text,
        vision_type=vision_type,
        vision=vision,
        vision_layers_used=vision["num_hidden_layers"] + 1 + LLAVA_FEATURE_LAYER if vision is not None else 0,
        drop_cls=clip,  # LLaVA's "default" strategy on a CLIP tower, "full" on SigLIP: an image is its patches
        image_token_id=None,
        projector_bias=bias,
        projector_act=act,
        tie_word_embeddings=bool(text.get("tie_word_embeddings")),
        audio_type=audio_type,
        audio=audio,
        sources=(
            ("text", llm_dir),
            ("head", llm_dir),
            ("vision", vision_dir),
            ("audio", audio_dir),
            ("projector", projector_dir),
            ("audio_projector", projector_dir),
        ),
    )


def hf_model_shape(directory: str) -> HFModelShape:
    """The directory's model as an ``HFModelShape``; ``ConfigError`` naming what is not supported."""
    raw = read_config_json(directory)
    archs = raw.get("architectures") or []
    arch = archs[0] if isinstance(archs, list) and archs else raw.get("model_type", "<none>")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ConfigError(
            f"model.huggingface: {os.path.join(directory, 'config.json')} is a {arch!r}; supported architectures: "
            + ", ".join(SUPPORTED_ARCHITECTURES)
        )
    if arch in TEXT_MODELS:
        text_type = TEXT_MODELS[arch]
        text = {**_TEXT_DEFAULTS[text_type], **raw}
        _check_text(text, text_type, "config.json")
        return HFModelShape(
            directory=directory,
            architecture=arch,
            text_type=text_type,
            text=text,
            tie_word_embeddings=bool(text.get("tie_word_embeddings")),
        )
    text_raw = raw.get("text_config") or {"model_type": _LLAVA_DEFAULT_TEXT}
    vision_raw = raw.get("vision_config") or {"model_type": _LLAVA_DEFAULT_VISION}
    text_type, vision_type = text_raw.get("model_type"), vision_raw.get("model_type")
    if text_type not in TEXT_TYPES:
        raise ConfigError(
            f"model.huggingface: text_config.model_type {text_type!r} is not supported; "
            f"supported: {', '.join(TEXT_TYPES)}"
        )
    if vision_type not in VISION_TYPES:
        raise ConfigError(
            f"model.huggingface: vision_config.model_type {vision_type!r} is not supported; "
            f"supported: {', '.join(VISION_TYPES)}"
        )
    text = {**_TEXT_DEFAULTS[text_type], **text_raw}
    vision = {**_VISION_DEFAULTS[vision_type], **vision_raw}
    _check_text(text, text_type, "text_config")
    layers = vision["num_hidden_layers"]
    feature = raw.get("vision_feature_layer", -2)
    if not isinstance(feature, int) or isinstance(feature, bool) or not -layers - 1 <= feature <= layers:
        raise ConfigError(
            f"model.huggingface: vision_feature_layer {feature!r} is not supported; one layer index "
            f"between {-layers - 1} and {layers} (a list of layers is not run by the engine yet)"
        )
    # hidden_states[0] is the embeddings' output and hidden_states[i] block i's: index k needs k blocks.
    used = feature if feature >= 0 else layers + 1 + feature
    strategy = raw.get("vision_feature_select_strategy", "default")
    cls_token = vision_type == "clip_vision_model"
    # Packing gives an image exactly its patches as LLM tokens: CLIP with its CLS dropped, SigLIP whole.
    if strategy != ("default" if cls_token else "full"):
        raise ConfigError(
            f"model.huggingface: vision_feature_select_strategy {strategy!r} with a {vision_type} tower is not "
            f"supported; the engine runs {'default' if cls_token else 'full'!r} (an image is exactly its patches)"
        )
    image_token = raw.get("image_token_id", raw.get("image_token_index", 32000))
    tie = bool(raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
    return HFModelShape(
        directory=directory,
        architecture=arch,
        text_type=text_type,
        text=text,
        vision_type=vision_type,
        vision=vision,
        vision_layers_used=used,
        drop_cls=cls_token,
        image_token_id=image_token,
        projector_bias=bool(raw.get("multimodal_projector_bias", True)),
        projector_act=raw.get("projector_hidden_act", "gelu"),
        tie_word_embeddings=tie,
    )


def _check_text(text: dict[str, Any], text_type: str, where: str) -> None:
    if text.get("use_sliding_window"):
        raise ConfigError(
            f"model.huggingface: {where}.use_sliding_window is true; sliding-window attention is not "
            "run by the engine yet (set it to false)"
        )
