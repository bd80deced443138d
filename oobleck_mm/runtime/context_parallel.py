"""All-gather context parallelism's attention (Cornstarch §3.4.3): each rank its query blocks, every key.

A sequence too long for one GPU is split over the ``d`` ranks of a context-parallel group by 128-token
blocks (``balance.context_blocks``: Cornstarch's LPT over the mask's per-row work, or the zigzag and
contiguous baselines). Every rank holds the queries, keys and values of its own blocks; ``context_attention``
all-gathers the keys and values of the whole sequence (``_GatherTokens``: its backward sums every rank's
gradient of them and keeps this rank's own), then computes the attention of its own rows under the
sequence's mask words (``model.attention_masks.blocked_attention``, skipping empty block pairs). Everything
else in a transformer block (projections, MLP, norms) is per token and runs on the local tokens as is.

Written here because torch's own context parallelism (``torch.distributed.tensor.experimental.context_parallel``)
is ring attention over causal or full masks with its own contiguous or round-robin layout; it takes no
multimodal mask and no chosen token layout.

``shard_batch`` gives a rank its share of a packed microbatch's LLM sequence with a ``ContextShard`` on it
(``PackedBatch.context``): the text blocks then attend through it (the built-in ``model.layers.Attention``,
and HuggingFace decoder layers through ``model.huggingface.packed_attention``), and everything per token runs
on the rank's tokens. Both attend causally inside each sample (images and clips too, as LLaVA does), so the
words carry no span bits.

A stage with ``StageLayout.context_parallel`` (``cluster.context_parallel: d``) runs its lanes this way:
``context_share`` cuts each microbatch by LPT, the embedding, head and loss run on a lane's tokens. The
stage's layers are sharded over its lanes as any stage of several GPUs is (FSDP2, ``runtime.sharding``):
a layer's parameters are gathered for each lane's forward and backward, and its gradients summed over the
lanes by FSDP2's reduce-scatter (each lane's gradient is its own tokens' share), then over the pipelines by
the layer-wise sums (docs/runtime.md, "Context parallelism"). Encoder layers (and the token embedding that merges their outputs into the sequence) run on
the whole microbatch on every lane (``ContextShard.whole``): an image's patches attend to each other, not
to the sequence, so there is nothing to gather; each lane's copy then receives gradients from its own tokens
only, and the lanes' sum is the whole gradient. Not yet: media spans as bidirectional, encoders split.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from oobleck_mm.data.packing import PackedBatch
from oobleck_mm.model.attention_masks import blocked_attention, token_bits

BLOCK = 128
"""Tokens per block of a context-parallel split (Cornstarch's N_B)."""


def block_tokens(blocks: Sequence[int], block: int, tokens: int) -> torch.Tensor:
    """The sequence positions of ``blocks`` (ascending), the last block cut at ``tokens``: a rank's tokens in the
    order it holds them."""
    parts = [torch.arange(b * block, min((b + 1) * block, tokens)) for b in sorted(blocks)]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


class _GatherTokens(torch.autograd.Function):
    """``[heads, n_r, dim]`` on every rank -> ``[heads, T, dim]`` in sequence order. Backward: the sum over
    ranks of the gradient of the whole, at this rank's positions (an all-reduce: gloo has no reduce-scatter)."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, positions: list[torch.Tensor], rank: int, tokens: int, group) -> torch.Tensor:
        ctx.positions, ctx.rank, ctx.group = positions, rank, group
        width = max(len(p) for p in positions)
        padded = local.new_zeros(local.shape[0], width, local.shape[2])
        padded[:, : local.shape[1]] = local
        gathered = [torch.empty_like(padded) for _ in positions]
        dist.all_gather(gathered, padded.contiguous(), group=group)
        whole = local.new_empty(local.shape[0], tokens, local.shape[2])
        for where, part in zip(positions, gathered):
            whole[:, where.to(local.device)] = part[:, : len(where)]
        return whole

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad[:, ctx.positions[ctx.rank].to(grad.device)], None, None, None, None


def context_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    assignment: Sequence[Sequence[int]],
    rank: int,
    bits: torch.Tensor,
    segments: torch.Tensor,
    block: int = BLOCK,
    group=None,
) -> torch.Tensor:
    """Attention of this rank's tokens (``q``, ``k``, ``v``: ``[heads, n_rank, dim]``, its blocks' tokens in
    order) against the whole sequence's keys and values, under its mask words ``bits`` and samples
    ``segments`` (``[T]`` each, every rank the same). ``assignment``: every rank's blocks. Returns
    ``[heads, n_rank, dim]``; differentiable in ``q``, ``k`` and ``v`` on every rank."""
    positions = [block_tokens(blocks, block, bits.numel()) for blocks in assignment]
    if q.shape[1] != len(positions[rank]):
        raise ValueError(
            f"rank {rank} holds {q.shape[1]} tokens, but its blocks {list(assignment[rank])} have "
            f"{len(positions[rank])}"
        )
    return _attend(q, k, v, positions, sorted(assignment[rank]), rank, bits, segments, block, group)


def _attend(q, k, v, positions: list[torch.Tensor], rows: list[int], rank: int, bits, segments, block, group):
    """``context_attention`` with every rank's token positions and this rank's rows already known."""
    tokens = bits.numel()
    mine = positions[rank].to(q.device)
    # Keys and values in one gather (one collective each way: every rank's backward then meets its peers'
    # in the same order, layer after layer).
    whole = _GatherTokens.apply(torch.cat([k, v], dim=-1), positions, rank, tokens, group)
    whole_k, whole_v = whole.split([k.shape[-1], v.shape[-1]], dim=-1)
    if whole_k.shape[0] != q.shape[0]:
        # Grouped-query attention (Llama, Mistral, Qwen2): the key-value heads are gathered, then repeated for
        # their query heads as transformers' ``repeat_kv`` does (head j reads key-value head j // groups).
        if q.shape[0] % whole_k.shape[0]:
            raise ValueError(f"{q.shape[0]} query heads cannot share {whole_k.shape[0]} key-value heads")
        groups = q.shape[0] // whole_k.shape[0]
        whole_k, whole_v = whole_k.repeat_interleave(groups, dim=0), whole_v.repeat_interleave(groups, dim=0)
    # Only this rank's rows are computed; the query tensor is laid out over the whole sequence for that.
    whole_q = q.new_zeros(q.shape[0], tokens, q.shape[2]).index_copy(1, mine, q)
    out = blocked_attention(whole_q, whole_k, whole_v, bits, segments, block, rows=rows)
    # A rank without rows computes nothing from the gathered keys and values; its backward must still take
    # part in the gather's all-reduce, so the output is tied to them.
    return _Tie.apply(out[:, mine], whole)


class _Tie(torch.autograd.Function):
    """``out`` as it is, with ``anchor`` in its graph (a zero gradient): the anchor's backward always runs."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
        ctx.anchor = (anchor.shape, anchor.dtype, anchor.device)  # not the tensor: nothing kept alive
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        shape, dtype, device = ctx.anchor
        return grad, torch.zeros(shape, dtype=dtype, device=device)


@dataclass(frozen=True)
class ContextShard:
    """One rank's share of a sequence under context parallelism, as the model's attention needs it."""

    assignment: tuple[tuple[int, ...], ...]
    """Every rank's blocks (``balance.context_blocks``)."""
    rank: int
    bits: torch.Tensor
    """The whole sequence's mask words (``model.attention_masks``)."""
    segments: torch.Tensor
    """The whole sequence's sample ids."""
    block: int = BLOCK
    group: object = None
    """The context-parallel process group (None: the default group)."""
    whole: PackedBatch | None = None
    """The microbatch this is a share of: the encoders and the token embedding of a stage before the sequence
    is split run on it (every lane alike), and the embedding's output is then cut to this rank's tokens."""
    lanes: tuple[torch.Tensor, ...] = field(init=False)
    """Every rank's tokens' places in the sequence: computed once, read by every attention of the microbatch."""

    def __post_init__(self) -> None:
        lanes = tuple(block_tokens(blocks, self.block, self.bits.numel()) for blocks in self.assignment)
        object.__setattr__(self, "lanes", lanes)

    @property
    def positions(self) -> torch.Tensor:
        """This rank's tokens' places in the sequence, in the order it holds them."""
        return self.lanes[self.rank]

    def narrow(self, acts: tuple) -> tuple:
        """The whole sequence's activations (the token embedding's output) cut to this rank's tokens."""
        mine = self.positions.to(acts[0].device)
        return tuple(a[mine] for a in acts)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """This rank's rows (``q``: ``[heads, n_rank, dim]``; ``k``, ``v``: the same or fewer key-value heads)."""
        rows = sorted(self.assignment[self.rank])
        return _attend(q, k, v, list(self.lanes), rows, self.rank, self.bits, self.segments, self.block, self.group)


def context_share(batch: PackedBatch, lane: int, ranks: int, group=None, block: int = BLOCK) -> PackedBatch:
    """Lane ``lane``'s share of ``batch`` on a context-parallel stage of ``ranks`` GPUs: blocks assigned by
    Cornstarch's LPT over the microbatch's attention work (``balance.context_blocks.lpt``), which every rank
    computes alike from the same microbatch. A microbatch shorter than ``ranks`` blocks is cut into ``ranks``
    smaller ones, so that no lane idles (LPT's equal counts give each at least one)."""
    from oobleck_mm.balance.context_blocks import lpt
    from oobleck_mm.model.attention_masks import block_workload

    block = max(1, min(block, batch.segments.numel() // ranks))
    bits = token_bits(batch.segments.cpu(), [])
    assignment = lpt(block_workload(bits, batch.segments.cpu(), block), ranks)
    return shard_batch(batch, assignment, lane, block, group, bits)


def check_context_parallel(job, specs, stage) -> None:
    """What a context-parallel stage cannot run: ``model.builder`` layers, whose attention the engine cannot
    replace (a ``UserError``). Built-in and HuggingFace layers can: their text attention goes through
    ``ContextShard.attend``, and encoders run on whole media before the sequence is split."""
    from oobleck_mm.errors import UserError

    if job.model.builder:
        raise UserError(
            "a context-parallel stage runs the built-in or a model.huggingface model's layers; model.builder "
            "layers attend with their own attention, which the engine cannot replace"
        )


def shard_batch(
    batch: PackedBatch,
    assignment: Sequence[Sequence[int]],
    rank: int,
    block: int = BLOCK,
    group=None,
    bits: torch.Tensor | None = None,
):
    """This rank's share of ``batch``'s LLM sequence: its blocks' tokens, labels, positions and sample ids, and
    the ``ContextShard`` its text blocks attend through (``bits``: the sequence's mask words, if made already).
    The encoders' inputs stay on the shard's ``whole`` batch: the encoders run on whole media (every lane the
    same), and the sequence is split after the token embedding merges them into it."""
    if bits is None:
        bits = token_bits(batch.segments.cpu(), [])  # causal inside each sample, as the built-in LLM attends
    shard = ContextShard(tuple(tuple(a) for a in assignment), rank, bits, batch.segments.cpu(), block, group, batch)
    mine = shard.positions.to(batch.tokens.device)
    return PackedBatch(
        sample_ids=batch.sample_ids,
        tokens=batch.tokens[mine],
        labels=batch.labels[mine],
        positions=batch.positions[mine],
        segments=batch.segments[mine],
        context=shard,
    )
