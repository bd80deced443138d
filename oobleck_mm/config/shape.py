"""Multimodal models as ordered layer lists: the shape the planner and profilers consume.

``LayerSpec`` describes one pipeline-cuttable layer by its dimensions and the
work it does per sample; the analytical cost model turns it into a
``LayerCost``, and ``oobleck_mm.model.layers`` builds the torch module with the
same name. Order: vision encoder (+ projector), audio encoder (+ projector),
then the LLM (token embedding, blocks, head).

It lives in the config package because it is a pure function of the config's
sections and the config's own checks need it (``model.frozen`` names layers, a
sample's mean LLM tokens must fit ``data.max_seq_len``). No torch.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from oobleck_mm.config.data import DEFAULT_IMAGE_SIZE, SYNTHETIC_IMAGES_PER_SAMPLE, DataConfig
from oobleck_mm.config.model import ModelConfig
from oobleck_mm.errors import UserError


@dataclass(frozen=True, slots=True)
class LayerSpec:
    name: str
    """``vision.embed``, ``vision.block0``, ``vision.projector``, ``llm.block3``, ``llm.head`` ..."""
    modality: str
    """``vision``, ``audio`` or ``text`` (see ``oobleck_mm.planning.costs.MODALITIES``)."""
    kind: str
    """``patch_embed``, ``frame_embed``, ``block``, ``projector``, ``token_embed`` or ``lm_head``."""
    hidden: int
    """Width of the layer's output (for the projector: the LLM hidden size)."""
    in_features: int
    """Input width: pixels per patch, mel bins x frames folded into one audio token, the encoder
    hidden size (x its token merge) for a first projector layer, the vocabulary size for the token
    embedding, the hidden size for blocks and the head."""
    ffn_hidden: int = 0
    num_heads: int = 0
    vocab_size: int = 0
    """Only for ``token_embed`` and ``lm_head``."""
    gated_ffn: bool = False
    """SwiGLU-style FFN (3 matrices) instead of 2."""
    tokens_per_sample: float = 0.0
    """Mean tokens this layer processes per sample (patches for vision, frames for audio)."""
    attention_len: float = 0.0
    """Mean length of the sequences its attention spans (quadratic term), 0 for no attention."""
    num_kv_heads: int = 0
    """Key/value heads (grouped-query attention); 0 means ``num_heads``."""
    causal: bool = False
    """Causal attention (each token sees only earlier ones): half the quadratic work."""
    tied_embedding: bool = False
    """Only for ``lm_head``: its matrix is the token embedding's. The head's stage still holds
    a copy, so per-layer costs keep it; ``model_param_count`` counts it once."""

    @property
    def kv_hidden(self) -> int:
        """Width of the key (and of the value) projection."""
        if self.num_heads == 0 or self.num_kv_heads == 0:
            return self.hidden
        return self.hidden * self.num_kv_heads // self.num_heads


# --------------------------------------------------------------------------- parameter counts
# Formulas (biases only where the layer is a plain Linear; norms as one weight vector):
#   patch/frame embed, projector: in*h + h                (Linear)
#   block:  q,o: 2h^2, k,v: 2*h*kv, ffn: (2 or 3)*h*ffn, two norms: 2h
#   token embed: vocab*h;  lm_head: final norm h + h*vocab


def matmul_param_count(spec: LayerSpec) -> int:
    """Weights that take part in matrix multiplies (2 FLOPs each per token); lookups excluded."""
    h = spec.hidden
    if spec.kind in ("patch_embed", "frame_embed", "projector"):
        return spec.in_features * h
    if spec.kind == "block":
        ffn_mats = 3 if spec.gated_ffn else 2
        return 2 * h * h + 2 * h * spec.kv_hidden + ffn_mats * h * spec.ffn_hidden
    if spec.kind == "token_embed":
        return 0
    if spec.kind == "lm_head":
        return h * spec.vocab_size
    raise ValueError(f"layer {spec.name!r}: unknown kind {spec.kind!r}; valid: {LAYER_KINDS}")


def param_count(spec: LayerSpec) -> int:
    """Parameters the layer holds (a tied LM head counts its copy)."""
    h = spec.hidden
    extra = {
        "patch_embed": h,
        "frame_embed": h,
        "projector": h,
        "block": 2 * h,
        "token_embed": spec.vocab_size * h,
        "lm_head": h,
    }
    return matmul_param_count(spec) + extra[spec.kind]


def model_param_count(specs: Sequence[LayerSpec]) -> int:
    """Unique parameters of the model: a tied LM head's matrix is the embedding's."""
    shared = sum(s.hidden * s.vocab_size for s in specs if s.kind == "lm_head" and s.tied_embedding)
    return sum(param_count(s) for s in specs) - shared


LAYER_KINDS = ("patch_embed", "frame_embed", "block", "projector", "token_embed", "lm_head")
MEDIA_INPUT_KINDS = ("patch_embed", "frame_embed")
"""The kinds of layer that read a microbatch's pixels and frames (``PackedBatch.vision/audio.features``)."""


# --------------------------------------------------------------------------- model -> layers


@dataclass(frozen=True, slots=True)
class SequenceTokens:
    """Mean tokens per sample at each point of the model (planning workload shape)."""

    vision_encoder: float
    """Patches the vision encoder processes (all images of the sample)."""
    vision_per_image: float
    """Patches of one image: the span of the vision encoder's attention."""
    vision_llm: float
    """Image tokens the LLM sees (after the projector's token merge)."""
    audio_encoder: float
    """Frames the audio encoder processes (after the frame embedding's downsampling)."""
    audio_llm: float
    text: float

    @property
    def llm(self) -> float:
        """LLM sequence: text plus every projected encoder token."""
        return self.text + self.vision_llm + self.audio_llm


def sequence_tokens(model: ModelConfig, data: DataConfig) -> SequenceTokens:
    images = data.mean_images_per_sample
    if images is None and (data.kind == "synthetic" or model.vision is None):
        images = SYNTHETIC_IMAGES_PER_SAMPLE if model.vision is not None else 0.0  # as config.validation derives it
    seconds = data.mean_audio_seconds
    if seconds is None and model.audio is None:
        seconds = 0.0
    if data.mean_text_tokens is None or images is None or seconds is None:
        missing = (
            "mean_text_tokens"
            if data.mean_text_tokens is None
            else "mean_images_per_sample"
            if images is None
            else "mean_audio_seconds"
        )
        raise UserError(
            f"data.{missing}: not known yet: the master measures it over {data.path} before it "
            f"plans (data.check.measure_shape); to plan without reading the data, set it"
        )
    vision = audio = per_image = vision_llm = audio_llm = 0.0
    if model.vision is not None:
        p = model.vision.patch_size
        side = data.image_size or DEFAULT_IMAGE_SIZE
        # Sides are drawn uniformly in whole patches between min_image_size and image_size,
        # independently, so the mean patch count is the square of the mean side in patches.
        low = max(1, -(-(data.min_image_size or side) // p))
        high = max(low, side // p)
        per_image = ((low + high) / 2) ** 2
        vision = images * per_image
        vision_llm = vision / model.vision.token_merge
    if model.audio is not None:
        audio = seconds * data.audio_frames_per_second / model.audio.downsample
        audio_llm = audio / model.audio.token_merge
    return SequenceTokens(
        vision_encoder=vision,
        vision_per_image=per_image,
        vision_llm=vision_llm,
        audio_encoder=audio,
        audio_llm=audio_llm,
        text=data.mean_text_tokens,
    )


# --------------------------------------------------------------------------- your own model (model.builder)


@dataclass(frozen=True, slots=True)
class CustomLayer:
    """One layer of a ``model.builder`` model: what the planner costs, and how to make the module.

    ``build()`` is called only on the ranks that hold the layer (and in the reference trainer),
    under a generator seeded by (training.seed, layer index), so every rank makes the same
    initial weights; it returns an ``nn.Module`` called as ``layer(acts, batch) -> acts``
    (see docs/models.md). The builder function itself is called often: keep it cheap and
    create modules only in ``build``.
    """

    spec: LayerSpec
    build: Callable[[], Any]


@functools.lru_cache(maxsize=8)
def load_builder(reference: str) -> Callable:
    """The function ``model.builder`` names: ``package.module:function`` or ``path/to/file.py:function``."""
    module_name, sep, function = reference.rpartition(":")
    if not sep or not module_name or not function.isidentifier():
        raise UserError(f"model.builder: {reference!r} must be 'package.module:function' or 'file.py:function'")
    try:
        if module_name.endswith(".py"):
            spec = importlib.util.spec_from_file_location(f"oobleck_builder_{abs(hash(module_name))}", module_name)
            if spec is None or not os.path.isfile(module_name):
                raise UserError(f"model.builder: file {module_name!r} does not exist")
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except ImportError as exc:
        raise UserError(
            f"model.builder: cannot import {module_name!r} ({exc}); it must be importable by every "
            "worker (installed, on PYTHONPATH, or given as a .py file path)"
        ) from None
    builder = getattr(module, function, None)
    if not callable(builder):
        raise UserError(f"model.builder: {module_name!r} has no function {function!r}")
    return builder


def custom_layers(model: ModelConfig, data: DataConfig) -> tuple[CustomLayer, ...]:
    """The ``model.builder`` function's layers, checked against the contract."""
    builder = load_builder(model.builder)
    try:
        result = builder(model, data)
    except TypeError as exc:  # most often the signature: a bug in the builder gets its traceback below
        if "positional argument" not in str(exc) and "required" not in str(exc):
            raise
        raise UserError(
            f"model.builder: {model.builder} is called as function(model, data) and failed: {exc}"
        ) from None
    layers = tuple(result) if isinstance(result, (list, tuple)) else ()
    if not layers or not all(isinstance(x, CustomLayer) for x in layers):
        raise UserError(
            f"model.builder: {model.builder} must return a non-empty list of CustomLayer "
            f"(oobleck_mm.config.shape.CustomLayer), got {type(result).__name__}"
        )
    names = [x.spec.name for x in layers]
    if len(set(names)) != len(names):
        raise UserError(f"model.builder: {model.builder} returned layers with the same name: {names}")
    if layers[-1].spec.kind != "lm_head":
        raise UserError(f"model.builder: the last layer ({names[-1]!r}) must be kind 'lm_head' (it returns logits)")
    return layers


def layer_specs(model: ModelConfig, data: DataConfig) -> tuple[LayerSpec, ...]:
    """The model as pipeline-cuttable layers, in execution order, sized by the data's mean sample.

    Order: vision.embed, vision.block*, vision.projector[0/1], audio.embed, audio.block*,
    audio.projector[0/1], llm.embed, llm.block*, llm.head. The LLM's sequence holds the text
    and every projected image/audio token; its attention is causal over the whole sample.
    The quadratic terms use the mean length, i.e. mean(L)^2, not mean(L^2).
    A ``model.builder`` model's layers are what its function says.
    """
    if model.builder is not None:
        return tuple(x.spec for x in custom_layers(model, data))
    tokens = sequence_tokens(model, data)
    llm = model.llm
    num_proj = model.projector.num_layers
    specs: list[LayerSpec] = []
    if model.vision is not None:
        v = model.vision
        pixels = v.in_channels * v.patch_size**2
        specs += _encoder("vision", "patch_embed", v, pixels, tokens.vision_encoder, tokens.vision_per_image)
        specs += _projector("vision", v.hidden * v.token_merge, llm.hidden, num_proj, tokens.vision_llm)
    if model.audio is not None:
        a = model.audio
        # A clip attends to itself: the whole clip is one attention span.
        mels = a.mel_bins * a.downsample
        specs += _encoder("audio", "frame_embed", a, mels, tokens.audio_encoder, tokens.audio_encoder)
        specs += _projector("audio", a.hidden * a.token_merge, llm.hidden, num_proj, tokens.audio_llm)
    t = tokens.llm
    common = dict(modality="text", hidden=llm.hidden, vocab_size=llm.vocab_size, tokens_per_sample=t)
    specs.append(LayerSpec(name="llm.embed", kind="token_embed", in_features=llm.vocab_size, **common))
    specs += [
        LayerSpec(
            name=f"llm.block{i}",
            kind="block",
            in_features=llm.hidden,
            ffn_hidden=llm.ffn_hidden,
            num_heads=llm.num_heads,
            num_kv_heads=llm.num_kv_heads,
            gated_ffn=llm.gated_ffn,
            attention_len=t,
            causal=True,
            **common,
        )
        for i in range(llm.num_layers)
    ]
    specs.append(
        LayerSpec(name="llm.head", kind="lm_head", in_features=llm.hidden, tied_embedding=llm.tie_embeddings, **common)
    )
    return tuple(specs)


def _encoder(modality: str, embed_kind: str, enc, in_features: int, tokens: float, span: float) -> list[LayerSpec]:
    embed = LayerSpec(
        name=f"{modality}.embed",
        modality=modality,
        kind=embed_kind,
        hidden=enc.hidden,
        in_features=in_features,
        tokens_per_sample=tokens,
    )
    blocks = [
        LayerSpec(
            name=f"{modality}.block{i}",
            modality=modality,
            kind="block",
            hidden=enc.hidden,
            in_features=enc.hidden,
            ffn_hidden=enc.ffn_hidden,
            num_heads=enc.num_heads,
            tokens_per_sample=tokens,
            attention_len=span if tokens > 0 else 0.0,
        )
        for i in range(enc.num_layers)
    ]
    return [embed, *blocks]


def _projector(modality: str, in_features: int, llm_hidden: int, num_layers: int, tokens: float) -> list[LayerSpec]:
    """One MLP projector per encoder; with two layers each Linear is its own cuttable layer."""
    names = [f"{modality}.projector"] if num_layers == 1 else [f"{modality}.projector{i}" for i in range(num_layers)]
    widths = [in_features] + [llm_hidden] * (num_layers - 1)
    return [
        LayerSpec(
            name=name,
            modality=modality,
            kind="projector",
            hidden=llm_hidden,
            in_features=width,
            tokens_per_sample=tokens,
        )
        for name, width in zip(names, widths)
    ]


# --------------------------------------------------------------------------- frozen modules

# What each module name in `model.frozen` covers. An encoder's projector is named
# `vision.projector*` but is its own module, so "vision" must not match it.
MODULE_LAYER_PREFIXES = {
    "vision": ("vision.embed", "vision.block"),
    "audio": ("audio.embed", "audio.block"),
    "projector": ("vision.projector", "audio.projector"),
    "llm": ("llm.",),
}


def resolve_frozen(frozen: Sequence[str], specs: Sequence[LayerSpec]) -> frozenset[str]:
    """Names of the layers ``frozen`` covers; ValueError for an entry that covers none.

    An entry is a module name (vision, audio, projector, llm) or a layer name; a layer name
    not ending in a digit also covers its numbered layers (``vision.projector`` ->
    ``vision.projector0/1``, ``llm.block`` -> every LLM block), while ``llm.block1`` is
    exactly that block (not ``llm.block10``).
    """
    names = [s.name for s in specs]
    result: set[str] = set()
    for entry in frozen:
        if entry in MODULE_LAYER_PREFIXES:
            covered = [n for n in names if n.startswith(MODULE_LAYER_PREFIXES[entry])]
        else:
            covered = [n for n in names if n == entry or _numbered(n, entry)]
        if not covered:
            modules = ", ".join(MODULE_LAYER_PREFIXES)
            raise ValueError(
                f"{entry!r} names no layer of this model; valid: a module ({modules}) present in the model, "
                f"or a layer name such as {names[0]!r} or {names[-1]!r}"
            )
        result.update(covered)
    return frozenset(result)


def _numbered(name: str, entry: str) -> bool:
    return not entry[-1:].isdigit() and re.fullmatch(re.escape(entry) + r"\d+", name) is not None
