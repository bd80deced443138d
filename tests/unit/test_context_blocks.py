"""Context-parallel token distribution (Cornstarch Algorithm 1) against its definitions and its baselines."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from oobleck_mm.balance.context_blocks import (
    contiguous,
    distribute,
    imbalance,
    lpt,
    rank_work,
    subblocks,
    zigzag,
)
from oobleck_mm.model.attention_masks import block_workload, token_bits


def _partition(assignment, num_blocks):
    blocks = sorted(b for rank in assignment for b in rank)
    return blocks == list(range(num_blocks))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 50), max_size=40), st.integers(1, 8), st.booleans())
def test_lpt_partitions_the_blocks_within_grahams_bound(workloads, ranks, equal_counts):
    assignment = lpt(workloads, ranks, equal_counts)
    assert len(assignment) == ranks and _partition(assignment, len(workloads))
    per_rank = rank_work(assignment, workloads)
    assert sum(per_rank) == sum(workloads)
    if equal_counts:  # as many tokens on every rank (one block more on the first len % ranks)
        assert [len(a) for a in assignment] == [
            len(workloads) // ranks + (r < len(workloads) % ranks) for r in range(ranks)
        ]
    else:  # Graham: the makespan of LPT list scheduling is at most sum / d + max
        assert max(per_rank) <= sum(workloads) / ranks + max(workloads, default=0) + 1e-9
    assert lpt(workloads, ranks, equal_counts) == assignment  # every process computes the same split


def test_lpt_is_optimal_on_small_instances_where_counts_are_free():
    # Exhaustive check on tiny instances: LPT is within 4/3 of the optimal makespan (Graham 1969).
    for workloads in ([7, 5, 4, 3, 3, 2], [9, 8, 1, 1, 1, 1, 1], [3, 3, 2, 2, 2]):
        for ranks in (2, 3):
            best = min(
                max(sum(w for w, g in zip(workloads, split) if g == r) for r in range(ranks))
                for split in itertools.product(range(ranks), repeat=len(workloads))
            )
            assert max(rank_work(lpt(workloads, ranks, equal_counts=False), workloads)) <= best * 4 / 3


def test_the_baselines_are_megatrons_zigzag_and_plain_chunks():
    assert zigzag(8, 2) == [[0, 1, 6, 7], [2, 3, 4, 5]]
    assert contiguous(8, 2) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert _partition(zigzag(13, 3), 13) and _partition(contiguous(13, 3), 13)
    # Causal text alone: zigzag evens the triangle, contiguous does not.
    causal = list(range(1, 17))  # block i computes i key blocks
    assert imbalance(zigzag(16, 4), causal) == 1.0 < imbalance(contiguous(16, 4), causal)
    with pytest.raises(ValueError, match="distribution 'ring': choose one of lpt, zigzag, contiguous"):
        distribute("ring", causal, 2)
    with pytest.raises(ValueError, match="ranks must be >= 1, got 0"):
        contiguous(4, 0)


def test_lpt_beats_zigzag_on_an_embedded_image_mask():
    """A 2,048-token causal sequence with a 512-token image span in its middle (Cornstarch Figure 3.5b):
    the image's rows compute every block of the span, so zigzag's halves differ; LPT evens them."""
    tokens, block = 2048, 64
    segments = torch.zeros(tokens, dtype=torch.long)
    bits = token_bits(segments, [(640, 1152)])
    work = block_workload(bits, segments, block)
    for ranks in (2, 4, 8):
        balanced = imbalance(lpt(work, ranks), work)
        assert balanced <= 1.05 and balanced < imbalance(zigzag(len(work), ranks), work)


def test_subblocks_cut_every_row_into_pieces_no_larger_than_asked():
    assert subblocks([1, 5, 0, 4], 2) == [(0, 1), (1, 2), (1, 2), (1, 1), (3, 2), (3, 2)]
    pieces = subblocks([7, 3, 12], 4)
    assert max(p for _, p in pieces) <= 4 and sum(p for _, p in pieces) == 22
    with pytest.raises(ValueError, match="size must be >= 1, got 0"):
        subblocks([1], 0)


@pytest.mark.parametrize("lanes", [2, 4])
def test_a_microbatch_shorter_than_its_lanes_blocks_is_cut_finer_so_that_no_lane_idles(lanes):
    """Two short samples (well under one 128-token block): each lane still gets tokens, and together the lanes
    hold every token once."""
    import torch

    from oobleck_mm.config import load_config
    from oobleck_mm.data.loader import TrainingData
    from oobleck_mm.runtime.context_parallel import BLOCK, context_share

    data = TrainingData(load_config("configs/tiny_mm.yaml"))
    batch = data.microbatch(data.global_batch(0)[:2])
    tokens = batch.tokens.numel()
    assert lanes <= tokens < BLOCK
    shares = [context_share(batch, lane, lanes) for lane in range(lanes)]
    held = [s.context.positions for s in shares]
    assert all(len(h) for h in held), [len(h) for h in held]
    assert sorted(torch.cat(held).tolist()) == list(range(tokens))
    assert all(s.context.block == tokens // lanes for s in shares)
