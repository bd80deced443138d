"""How a rank's gradient buckets are cut into the all-reduces the backward starts (pure, milliseconds)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from oobleck_mm.planning.layout import ExecutionPlan
from oobleck_mm.runtime.grad_sync import Bucket, Chunk, buckets, chunks


def test_chunks_close_at_the_cap_last_layer_first_and_a_big_layer_stands_alone():
    sizes = {0: 10, 1: 10, 2: 50, 3: 10, 4: 10, 5: 10}
    mine = [Bucket((0, 2), (0, 1, 2)), Bucket((0, 3), (3, 4, 5))]
    assert chunks(mine, sizes, 20) == [
        Chunk((0, 3), (5, 4)),
        Chunk((0, 3), (3,)),
        Chunk((0, 2), (2,)),
        Chunk((0, 2), (1, 0)),
    ]
    # a cap above everything: one all-reduce per bucket, as without chunks
    assert chunks(mine, sizes, float("inf")) == [Chunk((0, 3), (5, 4, 3)), Chunk((0, 2), (2, 1, 0))]


@given(
    stages=st.lists(st.integers(1, 4), min_size=2, max_size=4),
    cap=st.integers(1, 400),
    sizes=st.lists(st.integers(1, 100), min_size=10, max_size=10),
)
def test_every_holder_of_a_group_starts_the_same_chunks_in_the_same_order_and_every_layer_once(stages, cap, sizes):
    """What keeps the overlapped all-reduces from deadlocking or summing the wrong tensors: the chunks of a
    group are the same list on each of its ranks, and each rank's order is one global order (descending
    layers), so two ranks sharing two groups start them in the same relative order."""
    stages = [min(s, 10) for s in stages]
    plan = ExecutionPlan.even(10, stages, [2] * len(stages), 1)
    all_buckets = buckets(plan, (True,) * 10)
    per_rank = {
        r: chunks([b for b in all_buckets if r in b.holders], dict(enumerate(sizes)), cap)
        for r in range(plan.world_size)
    }
    for rank, mine in per_rank.items():
        layers = [layer for c in mine for layer in c.layers]
        assert sorted(layers) == sorted(plan.stage(rank).layers), "every held layer in one chunk"
        assert layers == sorted(layers, reverse=True), "started last layer first"
    for group in {c.holders for mine in per_rank.values() for c in mine}:
        seen = [[c for c in per_rank[r] if c.holders == group] for r in group]
        assert all(s == seen[0] for s in seen), group
