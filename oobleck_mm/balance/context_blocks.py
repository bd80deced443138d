"""Which context-parallel rank computes which token blocks of a long sequence (Cornstarch §3.3.2, Algorithm 1).

Under all-gather context parallelism every rank of a stage holds the queries of some of a sequence's token
blocks, gathers every key and value, and computes its blocks' rows of attention. A row's work is the number
of key blocks its mask lets it compute (``model.attention_masks.block_workload``): a multimodal mask (image
and audio spans bidirectional, text causal, packed samples apart) makes that irregular, so splitting the
blocks evenly by count leaves some ranks with far more attention than others. Three distributions:

- ``lpt``: Cornstarch's: blocks in decreasing order of work, each to the rank with the least work so far
  (Graham's longest-processing-time-first; its makespan is within ``sum / d + max`` of the perfect one). With
  ``equal_counts`` (the default) a rank takes no more than its share of blocks, so every rank also holds as
  many tokens: the per-token work (the linear layers, the activations kept) stays even too; swaps between the
  busiest and the idlest rank then win back what the count constraint cost.
- ``zigzag``: Megatron's causal context parallelism: ``2d`` chunks, rank ``r`` the ``r``-th and the
  ``(2d-1-r)``-th, which evens a plain causal mask and nothing else.
- ``contiguous``: ``d`` consecutive chunks.

``subblocks`` is Cornstarch's intra-rank split: a row's key blocks cut into pieces of at most ``size`` blocks,
scheduled independently and merged (what keeps one long row from idling the others' compute units).

Pure: numpy in, numpy out; tested in milliseconds (``tests/unit/test_context_blocks.py``).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

DISTRIBUTIONS = ("lpt", "zigzag", "contiguous")


def _check(num_blocks: int, ranks: int) -> None:
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    if num_blocks < 0:
        raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")


def lpt(workloads: Sequence[int], ranks: int, equal_counts: bool = True) -> list[list[int]]:
    """Each rank's blocks (ascending), by longest-processing-time-first on ``workloads``. Ties go to the lower
    block and the lower rank, so every process computes the same split. ``equal_counts``: each rank takes
    ``len // ranks`` blocks, the first ``len % ranks`` ranks one more."""
    work = np.asarray(workloads, dtype=np.int64)
    _check(work.size, ranks)
    capacity = [work.size // ranks + (1 if r < work.size % ranks else 0) for r in range(ranks)]
    order = sorted(range(work.size), key=lambda b: (-int(work[b]), b))
    heap = [(0, r) for r in range(ranks)]
    out: list[list[int]] = [[] for _ in range(ranks)]
    for b in order:
        load, r = heapq.heappop(heap)
        if equal_counts:
            skipped = []
            while len(out[r]) >= capacity[r]:
                skipped.append((load, r))
                load, r = heapq.heappop(heap)
            for item in skipped:
                heapq.heappush(heap, item)
        out[r].append(b)
        heapq.heappush(heap, (load + int(work[b]), r))
    if equal_counts:
        _even_by_swaps(out, work)
    return [sorted(blocks) for blocks in out]


def _even_by_swaps(out: list[list[int]], work: np.ndarray, rounds: int = 1000) -> None:
    """Equal counts cost LPT its freedom near the end (the last blocks must go to the ranks with room): swap one
    block of the busiest rank for a lighter one of the idlest while that lowers the busier of the two."""
    for _ in range(rounds):
        loads = [int(work[blocks].sum()) if blocks else 0 for blocks in out]
        hi = max(range(len(out)), key=lambda r: (loads[r], -r))
        lo = min(range(len(out)), key=lambda r: (loads[r], r))
        gap = loads[hi] - loads[lo]
        best = None  # the swap whose moved work is closest to half the gap, strictly inside (0, gap)
        for i, a in enumerate(out[hi]):
            for j, b in enumerate(out[lo]):
                delta = int(work[a] - work[b])
                if 0 < delta < gap and (best is None or abs(2 * delta - gap) < abs(2 * best[0] - gap)):
                    best = (delta, i, j)
        if best is None:
            return
        _, i, j = best
        out[hi][i], out[lo][j] = out[lo][j], out[hi][i]


def zigzag(num_blocks: int, ranks: int) -> list[list[int]]:
    """Megatron's split for causal attention: ``2 * ranks`` chunks of consecutive blocks (as even as the
    count allows), rank ``r`` taking chunks ``r`` and ``2 * ranks - 1 - r``."""
    _check(num_blocks, ranks)
    chunks = np.array_split(np.arange(num_blocks), 2 * ranks)
    return [sorted(chunks[r].tolist() + chunks[2 * ranks - 1 - r].tolist()) for r in range(ranks)]


def contiguous(num_blocks: int, ranks: int) -> list[list[int]]:
    """``ranks`` runs of consecutive blocks, as even as the count allows."""
    _check(num_blocks, ranks)
    return [chunk.tolist() for chunk in np.array_split(np.arange(num_blocks), ranks)]


def distribute(kind: str, workloads: Sequence[int], ranks: int) -> list[list[int]]:
    """The blocks of each rank by distribution ``kind`` (one of ``DISTRIBUTIONS``)."""
    if kind == "lpt":
        return lpt(workloads, ranks)
    if kind == "zigzag":
        return zigzag(len(workloads), ranks)
    if kind == "contiguous":
        return contiguous(len(workloads), ranks)
    raise ValueError(f"distribution {kind!r}: choose one of {', '.join(DISTRIBUTIONS)}")


def rank_work(assignment: Sequence[Sequence[int]], workloads: Sequence[int]) -> list[int]:
    """The attention work (computed blocks) of each rank."""
    work = np.asarray(workloads, dtype=np.int64)
    return [int(work[list(blocks)].sum()) if len(blocks) else 0 for blocks in assignment]


def imbalance(assignment: Sequence[Sequence[int]], workloads: Sequence[int]) -> float:
    """max / mean of the ranks' attention work (1.0: perfectly even; 1.0 when there is no work)."""
    per_rank = rank_work(assignment, workloads)
    mean = sum(per_rank) / len(per_rank)
    return max(per_rank) / mean if mean > 0 else 1.0


def subblocks(workloads: Sequence[int], size: int) -> list[tuple[int, int]]:
    """Cornstarch's intra-rank split: each row's ``workloads[i]`` key blocks in pieces of at most ``size``,
    as ``(row, key blocks in the piece)``; the pieces of a row are merged with the online softmax's
    correction, as ``blocked_attention`` merges its key blocks."""
    if size < 1:
        raise ValueError(f"size must be >= 1, got {size}")
    out = []
    for row, work in enumerate(workloads):
        full, rest = divmod(int(work), size)
        out += [(row, size)] * full + ([(row, rest)] if rest else [])
    return out
