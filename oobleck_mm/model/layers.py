"""The torch modules behind each ``LayerSpec``: the multimodal model as a list of cuttable layers.

Every layer has the same call shape, ``layer(acts, batch) -> acts``, where
``acts`` is the tuple of hidden states that crosses a stage boundary and
``batch`` is the microbatch's ``PackedBatch`` (built locally on every stage):

- an encoder's embedding appends its hidden states to ``acts``; its blocks and
  projector layers transform ``acts[-1]``;
- ``llm.embed`` consumes every encoder output (vision first, then audio),
  scatters them into the token embeddings at their ``llm_positions`` and
  leaves ``(hidden,)``; the blocks transform it, ``llm.head`` turns it into
  logits.

Parameter shapes follow ``spec.param_count`` exactly (no biases in attention or
FFN, weight-only norms), so the planner's byte counts are the runtime's.
Positions use no parameters: 2-D sinusoidal for image patches, 1-D sinusoidal
for audio frames, rotary embeddings in the LLM.

Each layer is initialised from a generator seeded by (seed, layer index), so
any rank builds any layer identically without communication.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn

from oobleck_mm.config.shape import LayerSpec, custom_layers, layer_specs, resolve_frozen
from oobleck_mm.data.packing import PackedBatch
from oobleck_mm.errors import UserError
from oobleck_mm.model.hf_weights import layer_has_weights, load_hf_weights
from oobleck_mm.model.huggingface import build_hf_layer, layer_components
from oobleck_mm.model.graph import zero_of
from oobleck_mm.model.skip_init import skipping_random_init
from oobleck_mm.precision import master_dtype

Acts = tuple[torch.Tensor, ...]


# --------------------------------------------------------------------------- attention


def _rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding over the last dim of [heads, T, d], by the angles' ``cos`` and ``sin``
    [T, d / 2] (``PackedBatch.rotary``)."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, flash: bool):
        super().__init__()
        if hidden % num_heads:
            raise ValueError(f"hidden ({hidden}) must be a multiple of num_heads ({num_heads})")
        self.num_heads, self.num_kv_heads, self.flash = num_heads, num_kv_heads, flash
        self.head_dim = hidden // num_heads
        kv = self.head_dim * num_kv_heads
        self.q = nn.Linear(hidden, hidden, bias=False)
        self.k = nn.Linear(hidden, kv, bias=False)
        self.v = nn.Linear(hidden, kv, bias=False)
        self.o = nn.Linear(hidden, hidden, bias=False)

    def forward(
        self, x: torch.Tensor, spans, causal: bool, rotary: tuple[torch.Tensor, torch.Tensor] | None, context=None
    ) -> torch.Tensor:
        """Attention within each ``(start, end)`` span of the packed tokens (causal inside it when
        ``causal``), nothing across spans: block-diagonal, so a microbatch costs the sum of its
        spans' squares, as the balancer's cost model says (a varlen flash kernel does the same);
        a dense mask over the packed sequence would cost the square of the sum. ``context``: under
        context parallelism (``PackedBatch.context``) ``x`` is this rank's tokens and ``context.attend``
        computes their attention against the whole sequence."""
        t = x.shape[0]
        q = self.q(x).view(t, self.num_heads, self.head_dim).transpose(0, 1)
        k = self.k(x).view(t, self.num_kv_heads, self.head_dim).transpose(0, 1)
        v = self.v(x).view(t, self.num_kv_heads, self.head_dim).transpose(0, 1)
        if rotary is not None:
            q, k = _rotary(q, *rotary), _rotary(k, *rotary)
        if self.num_kv_heads != self.num_heads:
            rep = self.num_heads // self.num_kv_heads
            k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
        if context is not None:
            out = context.attend(q, k, v)
        else:
            out = torch.cat([self._block(q[:, s:e], k[:, s:e], v[:, s:e], causal) for s, e in spans], dim=1)
        return self.o(out.transpose(0, 1).reshape(t, self.num_heads * self.head_dim))

    def _block(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
        if self.flash:
            # As [1, heads, T, d]: torch's CPU flash kernel takes 4-D inputs only, and 3-D ones fall back to
            # the unfused math path (~15 ops a call; the flash kernel halved attention's CPU time here).
            return F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=causal)[0]
        # eager: materialises the score matrix (what flash_attention: false models)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(self.head_dim)
        if causal:
            n = q.shape[1]
            scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool, device=q.device).tril_(), float("-inf"))
        return scores.softmax(-1) @ v


class Block(nn.Module):
    """Pre-norm transformer block over one token stream of the microbatch."""

    def __init__(self, spec: LayerSpec, stream: str, flash: bool):
        super().__init__()
        self.stream = stream
        h = spec.hidden
        self.norm1 = nn.LayerNorm(h, bias=False)
        self.attn = Attention(h, spec.num_heads, spec.num_kv_heads or spec.num_heads, flash)
        self.norm2 = nn.LayerNorm(h, bias=False)
        self.gated = spec.gated_ffn
        self.fc1 = nn.Linear(h, spec.ffn_hidden, bias=False)
        self.gate = nn.Linear(h, spec.ffn_hidden, bias=False) if spec.gated_ffn else None
        self.fc2 = nn.Linear(spec.ffn_hidden, h, bias=False)

    def forward(self, acts: Acts, batch: PackedBatch) -> Acts:
        x = acts[-1]
        # No image/clip in this microbatch: nothing to attend. (A context-parallel lane without tokens still
        # attends: its peers gather from it, and its gather must pair with theirs.)
        if x.shape[0] == 0 and (self.stream != "text" or batch.context is None):
            return (*acts[:-1], x + zero_of(self))
        context = None
        if self.stream == "text":
            spans, causal, context = batch.spans(), True, batch.context
            rotary = batch.rotary(self.attn.head_dim, x.dtype)
        else:
            spans, causal, rotary = batch.encoder(self.stream).spans(), False, None
        x = x + self.attn(self.norm1(x), spans, causal, rotary, context)
        y = self.norm2(x)
        y = F.silu(self.gate(y)) * self.fc1(y) if self.gated else F.gelu(self.fc1(y))
        return (*acts[:-1], x + self.fc2(y))


# --------------------------------------------------------------------------- embeddings, projector, head


def _sinusoid(pos: torch.Tensor, dim: int, dtype: torch.dtype) -> torch.Tensor:
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=dtype, device=pos.device) / dim))
    ang = pos.to(dtype)[:, None] * inv[None, :]
    return torch.cat([ang.sin(), ang.cos()], -1)[:, :dim]


class EncoderEmbed(nn.Module):
    """Patch (or folded-frame) embedding plus fixed sinusoidal positions; appends to ``acts``."""

    def __init__(self, spec: LayerSpec):
        super().__init__()
        self.modality = spec.modality
        self.proj = nn.Linear(spec.in_features, spec.hidden)

    def forward(self, acts: Acts, batch: PackedBatch) -> Acts:
        enc = batch.encoder(self.modality)
        x = self.proj(enc.features)
        h = x.shape[-1]
        if self.modality == "vision":  # 2-D: half the width for the row, half for the column
            pos = torch.cat(
                [_sinusoid(enc.grid[:, 0], h // 2, x.dtype), _sinusoid(enc.grid[:, 1], h - h // 2, x.dtype)], -1
            )
        else:
            pos = _sinusoid(enc.grid[:, 0], h, x.dtype)
        return (*acts, x + pos)


class Projector(nn.Module):
    """One Linear of an encoder's MLP projector; the first merges ``merge`` consecutive tokens."""

    def __init__(self, spec: LayerSpec, first: bool, merge: int):
        super().__init__()
        self.first, self.merge = first, merge
        self.proj = nn.Linear(spec.in_features, spec.hidden)

    def forward(self, acts: Acts, batch: PackedBatch) -> Acts:
        x = acts[-1]
        if self.first:
            x = x.reshape(x.shape[0] // self.merge, x.shape[1] * self.merge)
        else:
            x = F.gelu(x)
        return (*acts[:-1], self.proj(x))


class TokenEmbed(nn.Module):
    """Token embedding with every encoder's projected tokens scattered at their positions."""

    def __init__(self, spec: LayerSpec, encoders: Sequence[str]):
        super().__init__()
        self.encoders = tuple(encoders)
        self.embed = nn.Embedding(spec.vocab_size, spec.hidden)
        nn.init.normal_(self.embed.weight, std=0.02)

    @property
    def tied_weight(self) -> nn.Parameter:
        return self.embed.weight

    def forward(self, acts: Acts, batch: PackedBatch) -> Acts:
        x = self.embed(batch.tokens)
        for modality, feats in zip(self.encoders, acts, strict=True):
            enc = batch.encoder(modality)
            if feats.shape[0]:
                x = x.index_put((enc.llm_positions,), feats)
            else:  # an empty sum, 0: the encoder layers stay in the autograd graph (model/graph.py)
                x = x + feats.sum()
        return (x,)


class LMHead(nn.Module):
    def __init__(self, spec: LayerSpec):
        super().__init__()
        self.norm = nn.LayerNorm(spec.hidden, bias=False)
        self.out = nn.Linear(spec.hidden, spec.vocab_size, bias=False)

    @property
    def tied_weight(self) -> nn.Parameter:
        return self.out.weight

    def tie_to(self, weight: nn.Parameter) -> None:
        self.out.weight = weight

    def forward(self, acts: Acts, batch: PackedBatch) -> Acts:
        return (self.out(self.norm(acts[-1])),)


def microbatch_loss(logits: torch.Tensor, batch: PackedBatch, global_loss_tokens: int) -> torch.Tensor:
    """Sum of the microbatch's token losses over the *global* number of loss tokens.

    Summing these over every microbatch of every pipeline gives the mean token
    loss of the global batch, whatever the split: the normalisation the
    reference trainer and the engine share.
    """
    # Half-precision logits are scored in float32 (the softmax over a vocabulary needs the range).
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return F.cross_entropy(logits, batch.labels, ignore_index=-100, reduction="sum") / global_loss_tokens


# --------------------------------------------------------------------------- building


def model_layer_specs(job) -> tuple[LayerSpec, ...]:
    return layer_specs(job.model, job.data)


def import_layer_code(job, specs: Sequence[LayerSpec] | None = None) -> int:
    """Builds one layer of each kind of the job's model on the ``meta`` device (no memory, no weights read),
    so that the code its layers run is imported; returns how many it built.

    An HF model's modules (``transformers`` and the model's ``modeling_*``) load at the first layer a
    process builds: 0.7 s on this machine idle, seconds beside other work. A worker that paid it in the
    layers it builds to receive a state copy (``state_transfer.prepare_arrival``) made every survivor
    of a recovery that includes it wait at the rendezvous; a worker does it at start-up instead, before
    it reports ready (``runtime.agent_worker.worker_main``)."""
    specs = specs if specs is not None else model_layer_specs(job)
    first: dict[tuple[str, str], int] = {}
    for index, spec in enumerate(specs):
        first.setdefault((spec.modality, spec.kind), index)
    with torch.device("meta"):
        for index in first.values():
            build_layer(job, index, specs, initialize=False, weights=False)
    return len(first)


def build_layer(
    job, index: int, specs: Sequence[LayerSpec] | None = None, initialize: bool = True, weights: bool = True
) -> nn.Module:
    """Layer ``index`` of the job's model with its deterministic initial weights, in the master dtype
    (``training.master_dtype``: what the optimizer updates and checkpoints hold).

    ``initialize=False``: the caller writes every parameter and persistent buffer right after (a
    checkpoint load, a state copy), so their random initialisation is skipped (``skip_init``); their
    values are unspecified until then. An HF layer whose directory has weights skips it always, its
    load writing every value. A ``model.builder`` layer is always initialised: its constructor is
    the user's, and could fill a buffer no load restores. ``weights=False``: an HF layer's weights are
    not read from its directory (its shapes are all the caller wants: a layer on the ``meta`` device)."""
    specs = specs if specs is not None else model_layer_specs(job)
    spec = specs[index]
    flash = job.training.flash_attention
    encoders = [m for m in ("vision", "audio") if getattr(job.model, m) is not None]
    loaded = job.model.hf is not None and layer_has_weights(layer_components(spec.name), job.model.hf)
    skip = (loaded or not initialize) and job.model.builder is None
    # One generator per (seed, layer): any rank builds the same layer without talking to others.
    with torch.random.fork_rng(devices=[]), skipping_random_init() if skip else nullcontext():
        torch.manual_seed(job.training.seed * 1_000_003 + index)
        if job.model.hf is not None:
            layer = build_hf_layer(job.model.hf, specs, index, master_dtype(job.training), initialize=not skip)
            if weights:
                load_hf_weights(layer, job.model.hf)
        elif job.model.builder is not None:
            layer = custom_layers(job.model, job.data)[index].build()
            if not isinstance(layer, nn.Module):
                raise UserError(
                    f"model.builder: layer {spec.name!r}'s build() returned {type(layer).__name__}, "
                    "not a torch.nn.Module"
                )
        elif spec.kind in ("patch_embed", "frame_embed"):
            layer = EncoderEmbed(spec)
        elif spec.kind == "block":
            layer = Block(spec, spec.modality, flash)
        elif spec.kind == "projector":
            first = index == 0 or specs[index - 1].kind != "projector"
            merge = getattr(job.model, spec.modality).token_merge
            layer = Projector(spec, first, merge)
        elif spec.kind == "token_embed":
            layer = TokenEmbed(spec, encoders)
        elif spec.kind == "lm_head":
            layer = LMHead(spec)
        else:
            raise ValueError(f"layer {spec.name!r}: unknown kind {spec.kind!r}")
    layer = layer.to(master_dtype(job.training))  # what is trained; compute copies: oobleck_mm.runtime.mixed
    pair = tied_pair(specs)
    if pair is not None and index == pair[1]:
        # The head holds a copy of the token embedding (Megatron's pipeline-split tying): it starts
        # as the embedding's value, the engine sums the two gradients each step (GradientSync),
        # so both copies take the same updates and stay equal.
        if initialize and not loaded:  # loaded: the head read the embedding's tensor from the files itself
            with torch.no_grad():
                layer.tied_weight.copy_(build_layer(job, pair[0], specs).tied_weight)
        layer.tied_copy = True  # its copy is the embedding's parameter: the gradient norm counts it once
    if spec.name in frozen_layers(job, specs):
        layer.requires_grad_(False)
    return layer


def tied_pair(specs: Sequence[LayerSpec]) -> tuple[int, int] | None:
    """(token embedding, LM head) layer indices when the head's matrix is the embedding's."""
    heads = [i for i, s in enumerate(specs) if s.kind == "lm_head" and s.tied_embedding]
    if not heads:
        return None
    embeds = [i for i, s in enumerate(specs) if s.kind == "token_embed"]
    return embeds[0], heads[0]


def frozen_layers(job, specs: Sequence[LayerSpec] | None = None) -> frozenset[str]:
    specs = specs if specs is not None else model_layer_specs(job)
    return resolve_frozen(job.model.frozen, specs)


def trainable_mask(job, specs: Sequence[LayerSpec] | None = None) -> tuple[bool, ...]:
    """Per layer: does it have trainable parameters?"""
    specs = specs if specs is not None else model_layer_specs(job)
    frozen = frozen_layers(job, specs)
    return tuple(s.name not in frozen for s in specs)


def parameter_rows(job, layers: Iterable[int], specs: Sequence[LayerSpec] | None = None) -> dict[int, tuple[int, ...]]:
    """First-dimension sizes of each of ``layers``' trainable parameters, in ``parameters()`` order: what a
    stage of several GPUs cuts (FSDP2's ``Shard(0)``) and the cross-pipeline sum's pieces follow
    (``planning.shards``). Built on the ``meta`` device: no memory, no initialisation."""
    specs = specs if specs is not None else model_layer_specs(job)
    out = {}
    for index in layers:
        with torch.device("meta"):
            layer = build_layer(job, index, specs, initialize=False, weights=False)
        out[index] = tuple(p.shape[0] if p.dim() else 1 for p in layer.parameters() if p.requires_grad)
    return out


def tied_rows(job, specs: Sequence[LayerSpec] | None = None) -> int | None:
    """Rows of the tied embedding (the vocabulary), read on the ``meta`` device; None when nothing is tied."""
    specs = specs if specs is not None else model_layer_specs(job)
    tied = tied_pair(specs)
    if tied is None:
        return None
    with torch.device("meta"):
        return int(build_layer(job, tied[0], specs, initialize=False, weights=False).tied_weight.shape[0])
