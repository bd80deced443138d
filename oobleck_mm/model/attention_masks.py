"""Attention masks as data: a 64-bit word per token (Cornstarch's bitfield, §3.4.2), and attention over it.

A packed multimodal sequence attends in three ways at once: text causally, each image's or clip's tokens
bidirectionally among themselves (and causally to what came before), and packed samples not at all
across each other. A ``[T, T]`` boolean mask says that in ``T^2`` bytes; here each token carries one word:

- bit ``CAUSAL_BIT`` (62): the token attends to every earlier token of its sample (and itself);
- bits 0..61: the bidirectional spans it belongs to (a medium's tokens share one bit), so two tokens that
  share a span bit attend to each other in both directions;

and the sample it belongs to (``segments``, as ``PackedBatch`` has them). Token ``q`` attends to token
``k`` iff ``segments[q] == segments[k]`` and (``q`` is causal and ``k <= q``, or ``bits[q] & bits[k]``
has a span bit). A sample has at most ``SPAN_BITS`` (62) media spans: one more is a ``ValueError``
naming the count (the bitfield's limit; Cornstarch's too).

``blocked_attention`` computes attention block by block, skipping every block pair whose tokens cannot
attend to each other (told from per-block summaries: the samples a block spans, its earliest and latest
positions, the OR of its span bits): each query block's computed key blocks in one masked softmax; ``block_workload`` counts the non-empty blocks of each query block, the work Cornstarch's
token distribution balances (Algorithm 1). ``dense_mask`` is the reference both are tested against in
float64 (``tests/unit/test_attention_masks.py``).

Written here because no maintained library takes a multimodal bitfield mask: PyTorch's flex attention
takes a ``mask_mod`` function (its block mask is built from the same predicate, on GPUs), and
``scaled_dot_product_attention`` a dense mask, which is what each block uses.
"""

from __future__ import annotations

import math

import torch

CAUSAL_BIT = 62
SPAN_BITS = 62
"""Span bits per sample: bits 0..61 (bit 62 is causal; bit 63, the sign, is left alone)."""
CAUSAL = 1 << CAUSAL_BIT
SPANS = (1 << SPAN_BITS) - 1


def token_bits(segments: torch.Tensor, spans: list[tuple[int, int]], causal: bool = True) -> torch.Tensor:
    """int64 ``[T]``: each token's word, for a packed sequence whose samples are ``segments`` and whose
    bidirectional spans (a medium's tokens) are ``spans`` (``[start, end)`` positions, inside one sample
    each). ``causal``: every token also attends to the earlier tokens of its sample (an LLM's sequence);
    without it only the spans attend (an encoder over its media)."""
    bits = torch.full(segments.shape, CAUSAL if causal else 0, dtype=torch.int64)
    used: dict[int, int] = {}
    for start, end in sorted(spans):
        if not 0 <= start < end <= segments.numel():
            raise ValueError(f"span [{start}, {end}) is not inside the sequence of {segments.numel()} tokens")
        sample = int(segments[start])
        if bool((segments[start:end] != sample).any()):
            raise ValueError(f"span [{start}, {end}) crosses from sample {sample} into another")
        bit = used.get(sample, 0)
        if bit >= SPAN_BITS:
            raise ValueError(
                f"sample {sample} has more than {SPAN_BITS} media spans: a token's word has {SPAN_BITS} span bits"
            )
        used[sample] = bit + 1
        bits[start:end] |= 1 << bit
    return bits


def batch_bits(batch) -> torch.Tensor:
    """The words of a ``PackedBatch``'s LLM sequence: causal, each image and each clip a span."""
    spans: list[tuple[int, int]] = []
    for enc in (batch.vision, batch.audio):
        if enc is None or enc.llm_positions.numel() == 0:
            continue
        merge = enc.segments.numel() // enc.llm_positions.numel()
        medium = enc.segments[::merge][: enc.llm_positions.numel()]
        for m in torch.unique(medium).tolist():
            where = enc.llm_positions[medium == m]
            spans.append((int(where.min()), int(where.max()) + 1))
    return token_bits(batch.segments.cpu(), spans)


def allowed(bits_q: torch.Tensor, seg_q: torch.Tensor, pos_q: torch.Tensor, bits_k, seg_k, pos_k) -> torch.Tensor:
    """bool ``[Q, K]``: which queries attend to which keys (``pos``: positions in the packed sequence)."""
    same = seg_q[:, None] == seg_k[None, :]
    causal = ((bits_q & CAUSAL) != 0)[:, None] & (pos_k[None, :] <= pos_q[:, None])
    shared = (bits_q[:, None] & bits_k[None, :] & SPANS) != 0
    return same & (causal | shared)


def dense_mask(bits: torch.Tensor, segments: torch.Tensor) -> torch.Tensor:
    """bool ``[T, T]``: the reference mask the words stand for."""
    pos = torch.arange(bits.numel(), device=bits.device)
    return allowed(bits, segments, pos, bits, segments, pos)


def _summaries(bits: torch.Tensor, segments: torch.Tensor, block: int) -> list[tuple[int, int, int, int, bool, int]]:
    """Per block: (first sample, last sample, start, end, any causal token, OR of span bits)."""
    import numpy as np

    words = bits.cpu().numpy()
    seg = segments.cpu().numpy()
    starts = np.arange(0, words.size, block)
    ends = np.minimum(starts + block, words.size)
    spans = np.bitwise_or.reduceat(words & SPANS, starts)
    causal = np.logical_or.reduceat((words & CAUSAL) != 0, starts)
    return [
        (int(seg[a]), int(seg[b - 1]), int(a), int(b), bool(c), int(w))
        for a, b, c, w in zip(starts, ends, causal, spans)
    ]


def _may_attend(q: tuple, k: tuple) -> bool:
    """Whether any query of block ``q`` may attend to any key of block ``k`` (samples are contiguous)."""
    q_first, q_last, q_start, _, q_causal, q_spans = q
    k_first, k_last, k_start, _, _, k_spans = k
    if q_last < k_first or k_last < q_first:
        return False  # no sample in common
    return (q_causal and k_start < q[3]) or bool(q_spans & k_spans)


def block_workload(bits: torch.Tensor, segments: torch.Tensor, block: int) -> list[int]:
    """For each query block, how many key blocks it computes (the others are skipped): the same predicate
    as ``_may_attend``, over every block pair at once (a 64k-token sequence has 512 blocks of 128)."""
    rows = block_matrix(bits, segments, block)
    return [int(x) for x in rows.sum(axis=1)]


def block_matrix(bits: torch.Tensor, segments: torch.Tensor, block: int):
    """numpy bool ``[blocks, blocks]``: which query block computes which key block."""
    import numpy as np

    blocks = _summaries(bits, segments, block)
    first, last, start, end = (np.array([b[i] for b in blocks], dtype=np.int64) for i in range(4))
    causal = np.array([b[4] for b in blocks], dtype=bool)
    spans = np.array([b[5] for b in blocks], dtype=np.int64)
    common = (last[:, None] >= first[None, :]) & (last[None, :] >= first[:, None])
    earlier = causal[:, None] & (start[None, :] < end[:, None])
    shared = (spans[:, None] & spans[None, :]) != 0
    return common & (earlier | shared)


def blocked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bits: torch.Tensor,
    segments: torch.Tensor,
    block: int = 128,
    rows=None,
) -> torch.Tensor:
    """Attention of ``q``, ``k``, ``v`` (``[heads, T, dim]``) under the words, block by block: block pairs that
    cannot attend are skipped, the rest in one masked softmax per query block. A query that attends to nothing (a
    padding token with no bit) gets zeros. ``rows``: only these query blocks (a context-parallel rank's share,
    every key visible, as all-gather context parallelism computes them); the other rows stay zero."""
    if block < 1:
        raise ValueError(f"block must be >= 1, got {block}")
    scale = 1.0 / math.sqrt(q.shape[-1])
    pos = torch.arange(bits.numel(), device=q.device)
    blocks = _summaries(bits, segments, block)
    out = torch.zeros_like(q)
    for qb in blocks if rows is None else [blocks[r] for r in rows]:
        qs, qe = qb[2], qb[3]
        keys = [kb for kb in blocks if _may_attend(qb, kb)]
        if not keys:
            continue
        # The key blocks this query block computes, as one index: one matmul and one masked softmax per query
        # block (a GPU kernel would merge them block by block with flash attention's online softmax; on the
        # CPU, one call over them all spends far less time in Python: the same values).
        idx = torch.cat([pos[kb[2] : kb[3]] for kb in keys])
        mask = allowed(bits[qs:qe], segments[qs:qe], pos[qs:qe], bits[idx], segments[idx], idx)
        scores = ((q[:, qs:qe] * scale) @ k[:, idx].transpose(-1, -2)).masked_fill(~mask, -math.inf)
        top = scores.amax(dim=-1, keepdim=True)
        weights = torch.exp(scores - torch.where(torch.isinf(top), torch.zeros_like(top), top))
        total = weights.sum(dim=-1, keepdim=True)
        out[:, qs:qe] = torch.where(total > 0, (weights @ v[:, idx]) / total.clamp_min(1e-300), 0.0)
    return out


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The reference: softmax over the allowed keys (``[T, T]`` bool), zeros for a row with none."""
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~mask, -math.inf)
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return weights @ v
