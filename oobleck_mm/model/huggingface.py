"""HuggingFace models as the engine's layer list, made of ``transformers``' own modules.

The math is ``transformers``': each layer wraps the module classes the HF model
itself is made of (``LlamaDecoderLayer``, ``CLIPEncoderLayer``,
``SiglipVisionEmbeddings``, the LLaVA projector's two ``Linear`` layers...), built
from the directory's config. What is written here is only the plumbing between
layers, with the engine's call shape ``layer(acts, batch) -> acts``:

- vision: the packed patches of a microbatch are put back into images (a LLaVA
  tower takes square images of one size) and run as a batch ``[images, tokens,
  hidden]``; the first projector layer drops CLIP's CLS token and flattens the
  images into the packed token list;
- text: the packed sequence of every sample is one row ``[1, T, hidden]``; each
  decoder layer gets rotary tables from the model's own rotary class at each
  token's position *inside its sample*, and attention is restricted to each
  sample's span (``packed_attention``, registered in transformers'
  ``AttentionInterface``), so a packed microbatch computes exactly what the HF
  model computes on each sample alone; under context parallelism the row holds
  this rank's tokens and attends through ``PackedBatch.context``.

Every layer knows the names its tensors have in the HF checkpoint
(``HFLayer.hf_names``), so a worker reads only its own stage's tensors from the
safetensors files (``oobleck_mm.model.hf_weights``) and export writes them back.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from contextlib import nullcontext

import torch
from torch import nn

from oobleck_mm.config.huggingface import HFModelShape
from oobleck_mm.config.shape import LayerSpec
from oobleck_mm.data.packing import PackedBatch
from oobleck_mm.model.graph import zero_of
from oobleck_mm.model.skip_init import marked_as_loaded

Acts = tuple[torch.Tensor, ...]

PACKED_ATTENTION = "oobleck_packed"
"""The attention implementation the text layers run: SDPA inside each sample's span."""

# model_type -> (module of transformers.models, class-name prefix)
_MODELING = {
    "llama": ("llama.modeling_llama", "Llama"),
    "mistral": ("mistral.modeling_mistral", "Mistral"),
    "qwen2": ("qwen2.modeling_qwen2", "Qwen2"),
    "clip_vision_model": ("clip.modeling_clip", "CLIP"),
    "siglip_vision_model": ("siglip.modeling_siglip", "Siglip"),
    "whisper": ("whisper.modeling_whisper", "Whisper"),
}
_CONFIGS = {
    "llama": ("llama.configuration_llama", "LlamaConfig"),
    "mistral": ("mistral.configuration_mistral", "MistralConfig"),
    "qwen2": ("qwen2.configuration_qwen2", "Qwen2Config"),
    "clip_vision_model": ("clip.configuration_clip", "CLIPVisionConfig"),
    "siglip_vision_model": ("siglip.configuration_siglip", "SiglipVisionConfig"),
    "whisper": ("whisper.configuration_whisper", "WhisperConfig"),
}


def _hf_class(model_type: str, suffix: str):
    module, prefix = _MODELING[model_type]
    return getattr(importlib.import_module(f"transformers.models.{module}"), prefix + suffix)


def hf_config(model_type: str, values: dict, dtype: torch.dtype, attention: str):
    """The transformers config object of one part of the model (text or vision)."""
    module, name = _CONFIGS[model_type]
    cls = getattr(importlib.import_module(f"transformers.models.{module}"), name)
    cfg = cls.from_dict({k: v for k, v in values.items() if k not in ("architectures", "auto_map")})
    cfg._attn_implementation = attention
    cfg.dtype = dtype
    return cfg


# --------------------------------------------------------------------------- packed attention


def packed_attention(
    module, query, key, value, attention_mask, dropout=0.0, scaling=None, packed_spans=None, context=None, **kwargs
):
    """SDPA over each ``(start, end)`` span of the packed sequence separately (causal inside it).

    Per span, not one masked pass: a microbatch then costs the sum of its samples' squares, as the
    balancer's cost model says (a varlen flash kernel does the same), and each span computes what
    transformers' own SDPA path computes on that sample alone. ``query`` is ``[1, heads, T, d]``.

    ``context`` (a ``runtime.context_parallel.ContextShard``): the layer holds this rank's tokens of the
    sequence only; it attends through the shard (the whole sequence's keys and values gathered, the same
    per-sample causal mask), which returns this rank's rows.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if context is not None:
        head_dim = query.shape[-1]
        if scaling is not None and abs(scaling * head_dim**0.5 - 1) > 1e-12:
            raise ValueError(
                f"context-parallel attention scales scores by 1/sqrt(head_dim); this layer asks {scaling} "
                f"(head_dim {head_dim})"
            )
        if dropout:
            raise ValueError(f"context-parallel attention runs without attention dropout; this layer asks {dropout}")
        out = context.attend(query[0], key[0], value[0])  # [heads, n_rank, d]
        return out.transpose(0, 1).unsqueeze(0).contiguous(), None
    if packed_spans is None:
        raise RuntimeError(f"{PACKED_ATTENTION} attention needs packed_spans (the engine's text layers pass them)")
    kwargs.pop("sliding_window", None)  # validate() keeps samples within Mistral's window
    outs = [
        sdpa_attention_forward(
            module,
            query[:, :, s:e],
            key[:, :, s:e],
            value[:, :, s:e],
            None,
            dropout=dropout,
            scaling=scaling,
            is_causal=True,
            **kwargs,
        )[0]
        for s, e in packed_spans
    ]
    return torch.cat(outs, dim=1), None


def _register_packed_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(PACKED_ATTENTION, packed_attention)


# --------------------------------------------------------------------------- layers


class HFLayer(nn.Module):
    """A layer made of HF modules; ``hf_names`` maps its state-dict names to the checkpoint's."""

    hf_parts: tuple[tuple[str, str, str], ...] = ()
    """(local prefix, component, prefix inside the component) for each part; components are
    ``text``, ``head``, ``vision`` and ``projector`` (``oobleck_mm.model.hf_weights`` finds where
    each sits in a checkpoint)."""

    def hf_names(self) -> dict[str, tuple[str, str]]:
        """state-dict name -> (component, name inside the component)."""
        out = {}
        for name in self.state_dict():
            for local, component, inside in self.hf_parts:
                if name.startswith(local):
                    out[name] = (component, inside + name[len(local) :])
                    break
            else:
                raise KeyError(f"{type(self).__name__}: parameter {name!r} has no checkpoint name")
        return out


class VisionEmbed(HFLayer):
    def __init__(self, shape: HFModelShape, cfg):
        super().__init__()
        self.embeddings = _hf_class(shape.vision_type, "VisionEmbeddings")(cfg)
        self.side, self.patch, self.channels = cfg.image_size, cfg.patch_size, cfg.num_channels
        parts = [("embeddings.", "vision", "embeddings.")]
        if shape.vision_type == "clip_vision_model":  # CLIPVisionModel's own pre-encoder norm
            self.pre_layrnorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
            parts.append(("pre_layrnorm.", "vision", "pre_layrnorm."))
        else:
            self.pre_layrnorm = None
        self.hf_parts = tuple(parts)

    def forward(self, acts: Acts, batch: PackedBatch) -> Acts:
        feats = batch.vision.features  # [images * patches, C*p*p], row-major patches, (c, py, px) each
        n_side, p, c = self.side // self.patch, self.patch, self.channels
        images = feats.shape[0] // (n_side * n_side)
        pixels = (
            feats.reshape(images, n_side, n_side, c, p, p)
            .permute(0, 3, 1, 4, 2, 5)
            .reshape(images, c, self.side, self.side)
        )
        x = self.embeddings(pixels)
        if self.pre_layrnorm is not None:
            x = self.pre_layrnorm(x)
        return (*acts, x)


class EncoderBlock(HFLayer):
    """One encoder layer of a tower (CLIP/SigLIP's for images, Whisper's for clips) over every item of the
    microbatch at once: each image has the tower's size and each clip Whisper's length, so no mask."""

    def __init__(self, model_type: str, component: str, inside: str, cfg):
        super().__init__()
        self.layer = _hf_class(model_type, "EncoderLayer")(cfg)
        self.hf_parts = (("layer.", component, inside),)

    def forward(self, acts: Acts, batch: PackedBatch) -> Acts:
        x = acts[-1]
        if x.shape[0] == 0:  # no image (clip) in this microbatch: still a function of the layer (``zero_of``)
            return (*acts[:-1], x + zero_of(self))
        out = self.layer(x, None)
        return (*acts[:-1], out[0] if isinstance(out, tuple) else out)


class AudioEmbed(HFLayer):
    """Whisper's encoder stem: both convolutions over each clip's mel frames, then its positions."""

    def __init__(self, shape: HFModelShape, cfg):
        super().__init__()
        from transformers.models.whisper.modeling_whisper import sinusoids

        self.conv1 = nn.Conv1d(cfg.num_mel_bins, cfg.d_model, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(cfg.d_model, cfg.d_model, kernel_size=3, stride=2, padding=1)
        self.mel, self.tokens = cfg.num_mel_bins, cfg.max_source_positions
        # Whisper's embed_positions: fixed sinusoids it never trains (requires_grad False there); a buffer
        # here, so the engine's optimizer and gradient sync never see a parameter without a gradient.
        self.register_buffer("positions", sinusoids(cfg.max_source_positions, cfg.d_model), persistent=True)
        self.hf_parts = (
            ("conv1.", "audio", "conv1."),
            ("conv2.", "audio", "conv2."),
            ("positions", "audio", "embed_positions.weight"),
        )

    def forward(self, acts: Acts, batch: PackedBatch) -> Acts:
        # [clips * tokens, mel * 2]: each token holds its two frames (packing.fold_frames); every clip has
        # Whisper's 2 x max_source_positions frames (the data pads or cuts it, as its feature extractor does).
        feats = batch.audio.features
        clips = feats.shape[0] // self.tokens
        mels = feats.reshape(clips, 2 * self.tokens, self.mel).transpose(1, 2)
        x = torch.nn.functional.gelu(self.conv1(mels))
        x = torch.nn.functional.gelu(self.conv2(x)).permute(0, 2, 1)
        return (*acts, x + self.positions.to(x.dtype))


class ProjectorIn(HFLayer):
    """LLaVA projector's ``linear_1`` on every image's tokens, flattened into the packed token list; for an
    audio tower (a composition's Whisper) first the encoder's final ``layer_norm``, as WhisperEncoder ends."""

    def __init__(self, shape: HFModelShape, encoder_hidden: int, text_hidden: int, modality: str = "vision"):
        super().__init__()
        self.drop_cls = shape.drop_cls and modality == "vision"
        self.norm = nn.LayerNorm(encoder_hidden) if modality == "audio" else None  # WhisperEncoder.layer_norm
        self.linear_1 = nn.Linear(encoder_hidden, text_hidden, bias=shape.projector_bias)
        component = "projector" if modality == "vision" else "audio_projector"
        parts = [("linear_1.", component, "linear_1.")]
        if self.norm is not None:
            parts.append(("norm.", "audio", "layer_norm."))
        self.hf_parts = tuple(parts)

    def forward(self, acts: Acts, batch: PackedBatch) -> Acts:
        x = acts[-1]
        if self.drop_cls:  # vision_feature_select_strategy "default"
            x = x[:, 1:]
        if self.norm is not None:
            x = self.norm(x)
        return (*acts[:-1], self.linear_1(x.reshape(-1, x.shape[-1])))


class ProjectorOut(HFLayer):
    """LLaVA projector's activation and ``linear_2``."""

    def __init__(self, shape: HFModelShape, text_hidden: int, modality: str = "vision"):
        super().__init__()
        from transformers.activations import ACT2FN

        self.act = ACT2FN[shape.projector_act]
        self.linear_2 = nn.Linear(text_hidden, text_hidden, bias=shape.projector_bias)
        self.hf_parts = (("linear_2.", "projector" if modality == "vision" else "audio_projector", "linear_2."),)

    def forward(self, acts: Acts, batch: PackedBatch) -> Acts:
        return (*acts[:-1], self.linear_2(self.act(acts[-1])))


class TokenEmbed(HFLayer):
    """The text model's ``embed_tokens`` with each encoder's projected tokens put at their positions."""

    hf_parts = (("embed_tokens.", "text", "embed_tokens."),)

    def __init__(self, cfg, encoders: Sequence[str]):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, cfg.pad_token_id)
        self.encoders = tuple(encoders)

    @property
    def tied_weight(self) -> nn.Parameter:
        return self.embed_tokens.weight

    def forward(self, acts: Acts, batch: PackedBatch) -> Acts:
        x = self.embed_tokens(batch.tokens)
        for modality, feats in zip(self.encoders, acts, strict=True):
            if feats.shape[0]:
                x = x.index_put((batch.encoder(modality).llm_positions,), feats.to(x.dtype))
            else:
                x = x + feats.sum().to(x.dtype)  # an empty sum, 0: see model.graph.zero_of
        return (x,)


class DecoderBlock(HFLayer):
    def __init__(self, shape: HFModelShape, cfg, index: int):
        super().__init__()
        self.layer = _hf_class(shape.text_type, "DecoderLayer")(cfg, index)
        # Buffers only (inv_freq), not persistent: nothing to load, and the same on every rank.
        self.rotary = _hf_class(shape.text_type, "RotaryEmbedding")(config=cfg)
        self.hf_parts = (("layer.", "text", f"layers.{index}."),)

    def forward(self, acts: Acts, batch: PackedBatch) -> Acts:
        x = acts[-1].unsqueeze(0)
        if batch.context is not None and x.shape[1] == 0:
            return (self._attend_from_nowhere(x, batch.context),)
        positions = batch.positions.unsqueeze(0)
        cos_sin = self.rotary(x, positions)
        # Under context parallelism ``batch`` is this rank's tokens: its attention goes through the shard.
        extra = {"context": batch.context} if batch.context is not None else {"packed_spans": batch.spans()}
        out = self.layer(x, attention_mask=None, position_ids=positions, position_embeddings=cos_sin, **extra)
        out = out[0] if isinstance(out, tuple) else out
        return (out.squeeze(0),)

    def _attend_from_nowhere(self, x: torch.Tensor, shard) -> torch.Tensor:
        """A context-parallel lane without tokens (a microbatch shorter than its lanes): its peers gather keys and
        values from every lane and sum their gradients in the backward, so it takes part in both with none of
        its own. (transformers' attention cannot reshape 0 tokens; the empty projections here can.)"""
        attn = self.layer.self_attn
        h, d = x[0], attn.head_dim
        q = attn.q_proj(h).reshape(0, attn.config.num_attention_heads, d).transpose(0, 1)
        k = attn.k_proj(h).reshape(0, attn.config.num_key_value_heads, d).transpose(0, 1)
        v = attn.v_proj(h).reshape(0, attn.config.num_key_value_heads, d).transpose(0, 1)
        return x[0] + shard.attend(q, k, v).sum() + zero_of(self)


class Head(HFLayer):
    def __init__(self, shape: HFModelShape, cfg):
        super().__init__()
        self.norm = _hf_class(shape.text_type, "RMSNorm")(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # Tied checkpoints store the matrix once, as the embedding.
        head = (
            ("lm_head.weight", "text", "embed_tokens.weight") if shape.tie_word_embeddings else ("lm_head.", "head", "")
        )
        self.hf_parts = (("norm.", "text", "norm."), head)

    @property
    def tied_weight(self) -> nn.Parameter:
        return self.lm_head.weight

    def tie_to(self, weight: nn.Parameter) -> None:
        self.lm_head.weight = weight

    def forward(self, acts: Acts, batch: PackedBatch) -> Acts:
        return (self.lm_head(self.norm(acts[-1])),)


# --------------------------------------------------------------------------- building


def build_hf_layer(
    shape: HFModelShape, specs: Sequence[LayerSpec], index: int, dtype: torch.dtype, initialize: bool = True
) -> HFLayer:
    """Layer ``index`` of the HF model, initialised as transformers initialises that model.

    The caller seeds the generator per layer (any rank builds any layer identically);
    ``oobleck_mm.model.hf_weights`` overwrites the values when the directory has weights.
    ``initialize=False``: the caller writes every parameter and persistent buffer next, so
    ``_init_weights`` skips them (``skip_init.marked_as_loaded``); the caller also wraps the
    constructors in ``skip_init.skipping_random_init``.
    """
    _register_packed_attention()
    spec = specs[index]
    text_cfg = hf_config(shape.text_type, shape.text, dtype, PACKED_ATTENTION)
    vision_cfg = hf_config(shape.vision_type, shape.vision, dtype, "sdpa") if shape.vision is not None else None
    audio_cfg = hf_config(shape.audio_type, shape.audio, dtype, "sdpa") if shape.audio is not None else None
    number = _layer_number(spec.name)
    if spec.name == "vision.embed":
        layer, cfg, kind = VisionEmbed(shape, vision_cfg), vision_cfg, shape.vision_type
    elif spec.name.startswith("vision.block"):
        layer = EncoderBlock(shape.vision_type, "vision", f"encoder.layers.{number}.", vision_cfg)
        cfg, kind = vision_cfg, shape.vision_type
    elif spec.name == "vision.projector0":
        layer, cfg, kind = ProjectorIn(shape, vision_cfg.hidden_size, text_cfg.hidden_size), text_cfg, shape.text_type
    elif spec.name == "vision.projector1":
        layer, cfg, kind = ProjectorOut(shape, text_cfg.hidden_size), text_cfg, shape.text_type
    elif spec.name == "audio.embed":
        layer, cfg, kind = AudioEmbed(shape, audio_cfg), audio_cfg, shape.audio_type
    elif spec.name.startswith("audio.block"):
        layer = EncoderBlock(shape.audio_type, "audio", f"layers.{number}.", audio_cfg)
        cfg, kind = audio_cfg, shape.audio_type
    elif spec.name == "audio.projector0":
        layer = ProjectorIn(shape, audio_cfg.d_model, text_cfg.hidden_size, "audio")
        cfg, kind = text_cfg, shape.text_type
    elif spec.name == "audio.projector1":
        layer, cfg, kind = ProjectorOut(shape, text_cfg.hidden_size, "audio"), text_cfg, shape.text_type
    elif spec.name == "llm.embed":
        layer, cfg, kind = TokenEmbed(text_cfg, shape.encoders), text_cfg, shape.text_type
    elif spec.name.startswith("llm.block"):
        layer, cfg, kind = DecoderBlock(shape, text_cfg, number), text_cfg, shape.text_type
    elif spec.name == "llm.head":
        layer, cfg, kind = Head(shape, text_cfg), text_cfg, shape.text_type
    else:
        raise ValueError(f"layer {spec.name!r} is not a layer of an HF {shape.architecture}")
    with nullcontext() if initialize else marked_as_loaded(layer):
        _init_like_transformers(layer, kind, cfg)
    return layer.to(dtype)


def layer_components(name: str) -> frozenset[str]:
    """The checkpoint components layer ``name``'s tensors come from (``HFLayer.hf_parts``), known before
    the layer is built: whether to skip its random initialisation depends on them having weights."""
    if name.startswith("vision.projector"):
        return frozenset({"projector"})
    if name == "audio.projector0":
        return frozenset({"audio_projector", "audio"})  # the encoder's final layer_norm, then linear_1
    if name.startswith("audio.projector"):
        return frozenset({"audio_projector"})
    if name.startswith(("vision.", "audio.")):
        return frozenset({name.split(".")[0]})
    if name == "llm.head":
        return frozenset({"text", "head"})  # its norm is the text body's; a tied head reads embed_tokens
    return frozenset({"text"})


def _layer_number(name: str) -> int:
    digits = name[len(name.rstrip("0123456789")) :]
    return int(digits) if digits else 0


def _init_like_transformers(layer: nn.Module, model_type: str, cfg) -> None:
    """Applies the model's own ``PreTrainedModel._init_weights`` to every submodule.

    ``_init_weights`` is an instance method reading ``self.config``: an instance made without
    ``__init__`` (no weights allocated) carries the config, which is all it reads.
    """
    pretrained = _hf_class(model_type, "PreTrainedModel")
    owner = pretrained.__new__(pretrained)
    nn.Module.__init__(owner)
    owner.config = cfg
    with torch.no_grad():
        for module in layer.modules():
            owner._init_weights(module)
