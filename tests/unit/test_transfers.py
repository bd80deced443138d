"""The one decision of which layer state moves where (``planning.transfers``), on plans built by hand."""

from __future__ import annotations

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from oobleck_mm.planning.layout import ExecutionPlan, PipelineLayout, StageLayout
from oobleck_mm.planning.transfers import Transfer, missing_states, plan_transfers, rank_transfers

# gen 1: pipelines [r0 r1] and [r2 r3], layers 0-4 | 5-9 each
GEN1 = ExecutionPlan.even(10, [2, 2], [4, 4], 2)
# gen 2 after losing r3: [r0 r1] unchanged, r2 alone holds every layer (needs 5-9 copied)
GEN2 = ExecutionPlan(
    (PipelineLayout((StageLayout(0, 0, 5), StageLayout(1, 5, 10)), 5), PipelineLayout((StageLayout(2, 0, 10),), 3)),
    10,
    2,
)


def test_transfers_spread_over_surviving_holders():
    new = ExecutionPlan.even(4, [1, 2, 1], [1, 1, 1], 1)  # ranks 0 | 1,2 | 3
    held = {1: range(0, 2), 2: range(2, 4)}  # only pipeline 1 survived with its layers
    needed = {s.rank: s.layers for p in new.pipelines for s in p.stages}
    transfers = plan_transfers(held, needed)
    assert len(transfers) == 8  # ranks 0 and 3 need all 4 layers
    senders = [t.src for t in transfers]
    assert senders.count(1) == senders.count(2) == 4
    assert all(t.layer in held[t.src] for t in transfers)
    with pytest.raises(ValueError, match="layers 2-3 have no surviving holder"):
        plan_transfers({1: range(0, 2)}, needed)
    assert Transfer(0, 1, 2) < Transfer(1, 0, 2)


def test_a_holder_on_the_destinations_node_sends_before_a_less_busy_remote_one():
    held = {"a0": range(0, 4), "b0": range(0, 4)}
    needed = {"b1": range(0, 4)}
    node = {"a0": "A", "b0": "B", "b1": "B"}.__getitem__
    assert {t.src for t in plan_transfers(held, needed, node)} == {"b0"}
    # without node information the copies are spread instead
    assert sorted(t.src for t in plan_transfers(held, needed)) == ["a0", "a0", "b0", "b0"]


def test_rank_transfers_copy_what_a_survivor_lacks_from_a_survivor():
    transfers = rank_transfers(GEN1, GEN2, [0, 1, 2])
    assert [(t.layer, t.dst, t.src) for t in transfers] == [(layer, 2, 1) for layer in range(5, 10)]
    # r2 as a joiner (no state) receives all ten layers, from ranks 0 and 1
    joiner = rank_transfers(GEN1, GEN2, [0, 1, -1])
    assert sorted(t.layer for t in joiner) == list(range(10)) and {t.src for t in joiner} == {0, 1}
    with pytest.raises(ValueError, match="previous_ranks has 2 entries for 3 ranks"):
        rank_transfers(GEN1, GEN2, [0, 1])


def test_missing_states_counts_layers_a_rank_did_not_hold():
    # gen 1 -> gen 2: r2 (old rank 2, layers 0-4) now holds 0-9: 5 layers to receive
    assert missing_states(GEN1, GEN2, [0, 1, 2]) == 5
    assert missing_states(GEN1, GEN2, [0, 1, -1]) == 10  # r2 as a joiner
    assert missing_states(None, GEN2, [-1, -1, -1]) == 20  # a fresh start: every layer


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(1, 3), min_size=2, max_size=4),
    st.lists(st.integers(1, 3), min_size=1, max_size=4),
    st.data(),
)
def test_every_missing_state_is_copied_once_from_a_survivor_that_holds_it(old_sizes, new_sizes, data):
    layers = 9
    old = ExecutionPlan.even(layers, old_sizes, [1] * len(old_sizes), 1)
    new = ExecutionPlan.even(layers, new_sizes, [1] * len(new_sizes), 1)
    # each new rank is a survivor (a distinct old rank) or a joiner
    candidates = list(range(old.world_size)) + [-1] * new.world_size
    order = data.draw(st.permutations(candidates))
    previous, used = [], set()
    for value in order:
        if len(previous) == new.world_size:
            break
        if value >= 0 and value in used:
            continue
        used.add(value)
        previous.append(value)
    nodes = data.draw(st.lists(st.sampled_from("ABC"), min_size=new.world_size, max_size=new.world_size))
    holders = {layer for r, p in enumerate(previous) if p >= 0 for layer in old.stage(p).layers}
    if holders != set(range(layers)):
        with pytest.raises(ValueError, match="no surviving holder"):
            rank_transfers(old, new, previous, nodes)
        return
    transfers = rank_transfers(old, new, previous, nodes)
    assert len(transfers) == len({(t.layer, t.dst) for t in transfers}) == missing_states(old, new, previous)
    for t in transfers:
        assert previous[t.src] >= 0 and t.layer in old.stage(previous[t.src]).layers
        assert t.layer in new.stage(t.dst).layers
        assert previous[t.dst] < 0 or t.layer not in old.stage(previous[t.dst]).layers
        same_node = [
            r for r, p in enumerate(previous) if p >= 0 and nodes[r] == nodes[t.dst] and t.layer in old.stage(p).layers
        ]
        if same_node:
            assert nodes[t.src] == nodes[t.dst], (t, "a holder on the destination's node was passed over")


def _reference_transfers(held, needed, node_of, rank_of):
    # The rule as the docstring states it, by brute force: the min over every holder per copy.
    holders = {}
    for holder, layers in held.items():
        for layer in layers:
            holders.setdefault(layer, []).append(holder)
    sent, out = {}, []
    for dst, layers in needed.items():
        for layer in sorted(layers):
            if layer in held.get(dst, ()):
                continue
            src = min(holders[layer], key=lambda h: (node_of(h) != node_of(dst), sent.get(h, 0), rank_of(h)))
            sent[src] = sent.get(src, 0) + 1
            out.append(Transfer(layer, dst, src))
    return tuple(out)


@settings(max_examples=200, deadline=None)
@given(
    nodes=st.integers(1, 6),
    gpus=st.integers(1, 3),
    layers=st.integers(1, 8),
    data=st.data(),
)
def test_plan_transfers_equals_the_brute_force_rule(nodes, gpus, layers, data):
    everyone = [(n, g) for n in range(nodes) for g in range(gpus)]
    held = {
        gpu: data.draw(st.sets(st.integers(0, layers - 1), min_size=1)) for gpu in everyone if data.draw(st.booleans())
    }
    assume(set().union(*held.values()) == set(range(layers)) if held else False)
    needed = {gpu: data.draw(st.sets(st.integers(0, layers - 1))) for gpu in everyone}
    node_of = lambda gpu: gpu[0]  # noqa: E731
    assert plan_transfers(held, needed, node_of) == _reference_transfers(held, needed, node_of, lambda h: h)
    assert plan_transfers(held, needed) == _reference_transfers(held, needed, lambda h: h, lambda h: h)


def test_a_packed_layer_unpacks_to_the_same_tensors_whatever_their_dtypes_and_layouts():
    """A layer's state travels as one uint8 message; every tensor comes back bit-identical, aligned for its dtype."""
    import torch

    from oobleck_mm.runtime.state_transfer import ALIGN_BYTES, pack, unpack

    tensors = [
        torch.randn(3, 5, dtype=torch.bfloat16),
        torch.tensor(7.0),
        torch.arange(5, dtype=torch.int64),
        torch.randn(4, 4, dtype=torch.float64).t(),
        torch.randn(3, dtype=torch.float16),
    ]
    packed = pack(tensors, "cpu")
    assert packed.dtype == torch.uint8 and packed.numel() % ALIGN_BYTES == 0
    out = unpack(packed, tensors)
    for sent, got in zip(tensors, out):
        assert got.dtype == sent.dtype and got.shape == sent.shape and torch.equal(got, sent)
    with pytest.raises(ValueError, match="does not match its shapes"):
        unpack(packed[:-ALIGN_BYTES], tensors)


def test_subgroups_are_every_multi_holder_bucket_then_the_tied_pair_in_order():
    """What a background-formed generation prepares is what GradientSync forms, in the same order."""
    from oobleck_mm.runtime.grad_sync import subgroup_ranks

    plan = ExecutionPlan(
        (PipelineLayout((StageLayout(0, 0, 5), StageLayout(1, 5, 10)), 5), PipelineLayout((StageLayout(2, 0, 10),), 3)),
        10,
        2,
    )
    trainable = (True,) * 10
    everyone = (0, 1, 2)  # the step group, last
    assert subgroup_ranks(plan, trainable) == [(0, 2), (1, 2), everyone]
    assert subgroup_ranks(plan, trainable, tied=(1, 9)) == [(0, 2), (1, 2), (0, 1, 2), everyone]
    assert subgroup_ranks(plan, (False,) * 5 + (True,) * 5, tied=(1, 9)) == [(1, 2), everyone]  # a frozen side: no tie
