"""The common refinement of stage shard layouts (``planning/shards.py``, issue 28 item 2), pure."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from oobleck_mm.planning.shards import Piece, chunk_rows, reduction_groups, reduction_pieces


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 40), st.integers(1, 8))
def test_chunk_rows_cuts_as_torch_chunk_cuts_the_first_dimension(rows, width):
    """FSDP2 shards a parameter on dim 0 with ``torch.chunk``; fewer chunks than ranks leave the rest empty."""
    chunks = torch.arange(rows).chunk(width) if rows else ()
    expected = [(int(c[0]), int(c[-1]) + 1) for c in chunks if len(c)]
    got = chunk_rows(rows, width)
    assert len(got) == width
    assert [c for c in got if c[1] > c[0]] == expected
    assert all(start == end for start, end in got[len(expected) :])


def _holders(widths: list[int]) -> list[tuple[int, ...]]:
    out, next_rank = [], 0
    for w in widths:
        out.append(tuple(range(next_rank, next_rank + w)))
        next_rank += w
    return out


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 50), st.lists(st.sampled_from([1, 2, 4, 8]), min_size=1, max_size=4))
def test_the_pieces_cover_every_row_once_each_summed_by_exactly_one_rank_of_every_holder(rows, widths):
    holders = _holders(widths)
    pieces = reduction_pieces(rows, holders)
    # a partition of [0, rows) in order
    assert [p.start for p in pieces] == ([0] + [p.end for p in pieces[:-1]] if rows else [])
    assert (pieces[-1].end if pieces else 0) == rows and all(p.end > p.start for p in pieces)
    for p in pieces:
        assert len(p.ranks) == len(holders) and list(p.ranks) == sorted(p.ranks)
        for h in holders:
            [rank] = set(p.ranks) & set(h)  # one rank of each holder...
            start, end = chunk_rows(rows, len(h))[h.index(rank)]
            assert start <= p.start and p.end <= end  # ...whose chunk holds the piece
    # every rank's chunk is exactly the pieces it takes part in
    for h in holders:
        for k, rank in enumerate(h):
            start, end = chunk_rows(rows, len(h))[k]
            mine = [(p.start, p.end) for p in pieces if rank in p.ranks]
            assert sum(e - s for s, e in mine) == end - start
    # adjacent pieces differ in ranks (else they would be one)
    assert all(a.ranks != b.ranks for a, b in zip(pieces, pieces[1:]))


def test_a_two_gpu_stage_beside_a_one_gpu_stage():
    # rows 7: the 2-GPU stage (ranks 0, 1) holds [0, 4) and [4, 7); rank 2 holds all
    assert reduction_pieces(7, [(0, 1), (2,)]) == [Piece(0, 4, (0, 2)), Piece(4, 7, (1, 2))]
    # widths 2 and 4 over 8 rows: the 4-GPU cut refines the 2-GPU one
    assert reduction_pieces(8, [(0, 1), (2, 3, 4, 5)]) == [
        Piece(0, 2, (0, 2)),
        Piece(2, 4, (0, 3)),
        Piece(4, 6, (1, 4)),
        Piece(6, 8, (1, 5)),
    ]
    # equal layouts: one piece per chunk, as a plain all-reduce of the shards
    assert reduction_pieces(6, [(0, 1), (2, 3)]) == [Piece(0, 3, (0, 2)), Piece(3, 6, (1, 3))]
    # a single row: the second chunk of the 2-GPU stage is empty and takes part in nothing
    assert reduction_pieces(1, [(0, 1), (2,)]) == [Piece(0, 1, (0, 2))]


def test_pieces_with_equal_ranks_share_a_group_whatever_the_parameters():
    holders = [(0, 1), (2,)]
    assert reduction_groups([7, 7, 3, 1, 4], holders) == [(0, 2), (1, 2)]
    assert reduction_groups([5], [(0,)]) == []  # one holder: nothing to sum across pipelines


def test_bad_holders_are_refused_naming_them():
    with pytest.raises(ValueError, match="at least one holder"):
        reduction_pieces(4, [])
    with pytest.raises(ValueError, match=r"holders: .*\[\[0, 1\], \[1\]\]"):
        reduction_pieces(4, [(0, 1), (1,)])
    with pytest.raises(ValueError, match="width"):
        chunk_rows(4, 0)
