"""Gradient reduction across pipelines whose stages shard the same layer differently (issue 28 item 2).

A stage of ``d`` GPUs holds its layers sharded as FSDP2 (``fully_shard``) shards
them: every parameter cut on its first dimension into ``d`` chunks, ``torch.chunk``'s
cut (chunks of ``ceil(rows / d)`` rows; the last ones shorter, or empty when
``rows < d``). After its backward each rank holds the gradient of its rows, summed
over the stage's ranks (FSDP2's reduce-scatter, with its divide factor set to 1).

The same layer may be held by a 2-GPU stage in one pipeline and a 1-GPU stage in
another. The cross-pipeline, layer-wise sum (``runtime/grad_sync.py``) then cannot
all-reduce whole tensors: each holder has other rows. It runs over the *common
refinement* of the holders' cuts instead: ``[0, rows)`` cut at every holder's chunk
boundary, each piece all-reduced among the one rank per holder whose chunk holds
it. Pieces whose rank sets are equal share a process group (as layers with equal
holder sets share a bucket today), so a family of cuts forms few groups whatever
the number of parameters.

No library does this part: FSDP2 and DTensor redistribute between layouts of *one*
mesh (``DTensor.redistribute``), while here each pipeline has a mesh of its own and
the sum runs across meshes. Pure (no torch), tested in milliseconds; the runtime
slices each rank's local gradient by the pieces.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


def chunk_rows(rows: int, width: int) -> list[tuple[int, int]]:
    """[start, end) of the rows each of ``width`` shards holds, as ``torch.chunk`` (FSDP2's ``Shard(0)``)
    cuts a first dimension of ``rows``: ``ceil(rows / width)`` each, the last ones shorter or empty."""
    if rows < 0:
        raise ValueError(f"rows: expected >= 0, got {rows}")
    if width < 1:
        raise ValueError(f"width: a stage has at least 1 GPU, got {width}")
    size = -(-rows // width) if rows else 0
    return [(min(k * size, rows), min((k + 1) * size, rows)) for k in range(width)]


@dataclass(frozen=True, slots=True)
class Piece:
    """Rows ``[start, end)`` of one parameter, summed among ``ranks`` (one per holder of its layer)."""

    start: int
    end: int
    ranks: tuple[int, ...]
    """Sorted."""


def reduction_pieces(rows: int, holders: Sequence[Sequence[int]]) -> list[Piece]:
    """The common refinement of ``holders``' cuts of a first dimension of ``rows``, in row order.

    ``holders``: per pipeline holding the layer, its stage's ranks in shard order (rank ``k`` of
    the stage holds chunk ``k``). Each piece names the rank of every holder whose chunk contains
    it; adjacent pieces with the same ranks are one. Rows no rank holds cannot occur (every
    holder covers every row)."""
    if not holders:
        raise ValueError("holders: a layer has at least one holder")
    all_ranks = [r for h in holders for r in h]
    if len(set(all_ranks)) != len(all_ranks):
        raise ValueError(f"holders: a rank holds one shard of one pipeline's stage, got {list(map(list, holders))}")
    cuts_of = [chunk_rows(rows, len(h)) for h in holders]
    bounds = sorted({0, rows} | {b for cuts in cuts_of for cut in cuts for b in cut})
    pieces: list[Piece] = []
    for start, end in zip(bounds, bounds[1:]):
        ranks = tuple(sorted(h[_chunk_of(start, cuts)] for h, cuts in zip(holders, cuts_of)))
        if pieces and pieces[-1].ranks == ranks and pieces[-1].end == start:
            pieces[-1] = Piece(pieces[-1].start, end, ranks)
        else:
            pieces.append(Piece(start, end, ranks))
    return pieces


def _chunk_of(row: int, cuts: list[tuple[int, int]]) -> int:
    return next(k for k, (start, end) in enumerate(cuts) if start <= row < end)


def reduction_groups(shapes_rows: Sequence[int], holders: Sequence[Sequence[int]]) -> list[tuple[int, ...]]:
    """The rank sets of every piece of parameters with these first-dimension sizes, each once, in the
    order they first occur: the process groups the holders form (every rank in the same order)."""
    seen: dict[tuple[int, ...], None] = {}
    for rows in shapes_rows:
        for piece in reduction_pieces(rows, holders):
            if len(piece.ranks) > 1:
                seen.setdefault(piece.ranks)
    return list(seen)
