"""Your own model with ``model.builder``: a small attention-free language model (docs/models.md).

    model:
      name: conv_lm
      builder: ../examples/custom_model.py:build    # or my_package.my_module:build
      llm: {num_layers: 4, hidden: 64, num_heads: 1, vocab_size: 256}   # what the data pipeline makes

``build(model, data)`` returns the ordered layers as ``CustomLayer``s: each a
``LayerSpec`` (its name, kind and sizes: what the planner costs) and a function
making the module, called only where the layer is held. Every module is called
as ``layer(acts, batch) -> acts``: ``acts`` is the tuple of tensors crossing a
stage boundary (empty for the first layer), ``batch`` the microbatch's
``PackedBatch``; the last layer returns ``(logits,)`` of shape
``[batch.tokens.numel(), vocab]``. A microbatch packs several samples into one
sequence: ``batch.spans()`` gives each sample's ``(start, end)``, and nothing
may flow between samples.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from oobleck_mm.config.shape import CustomLayer, LayerSpec


class Embed(nn.Module):
    def __init__(self, vocab: int, hidden: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)

    def forward(self, acts, batch):
        return (self.embed(batch.tokens),)


class CausalConvBlock(nn.Module):
    """Token mixing by a causal depthwise convolution inside each sample, then a gated MLP."""

    def __init__(self, hidden: int, ffn: int, width: int = 4):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.conv = nn.Conv1d(hidden, hidden, width, groups=hidden)
        self.up, self.gate, self.down = nn.Linear(hidden, ffn), nn.Linear(hidden, ffn), nn.Linear(ffn, hidden)
        self.width = width

    def forward(self, acts, batch):
        x = acts[-1]
        y = self.norm1(x).t()  # [hidden, T]
        mixed = [self.conv(F.pad(y[:, s:e], (self.width - 1, 0))) for s, e in batch.spans()]
        x = x + torch.cat(mixed, dim=1).t()
        y = self.norm2(x)
        return (x + self.down(F.silu(self.gate(y)) * self.up(y)),)


class Head(nn.Module):
    def __init__(self, hidden: int, vocab: int):
        super().__init__()
        self.norm, self.out = nn.LayerNorm(hidden), nn.Linear(hidden, vocab, bias=False)

    def forward(self, acts, batch):
        return (self.out(self.norm(acts[-1])),)


def build(model, data) -> list[CustomLayer]:
    llm = model.llm
    h, vocab, ffn = llm.hidden, llm.vocab_size, llm.ffn_hidden
    tokens = data.mean_text_tokens
    common = dict(modality="text", hidden=h, tokens_per_sample=tokens)
    layers = [
        CustomLayer(
            LayerSpec(name="llm.embed", kind="token_embed", in_features=vocab, vocab_size=vocab, **common),
            lambda: Embed(vocab, h),
        )
    ]
    for i in range(llm.num_layers):
        layers.append(
            CustomLayer(
                LayerSpec(name=f"llm.block{i}", kind="block", in_features=h, ffn_hidden=ffn, gated_ffn=True, **common),
                lambda: CausalConvBlock(h, ffn),
            )
        )
    layers.append(
        CustomLayer(
            LayerSpec(name="llm.head", kind="lm_head", in_features=h, vocab_size=vocab, **common),
            lambda: Head(h, vocab),
        )
    )
    return layers
