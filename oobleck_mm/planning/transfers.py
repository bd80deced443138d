"""Which layer states move where after a reconfiguration (§2.5): one decision, made in one place.

A layer state is a layer's parameters and optimizer state, and it moves as one
unit. After a reconfiguration every holder (a worker, a GPU) must hold the
layers its stage runs in the new plan; whatever it did not hold before is
copied from a surviving holder. ``plan_transfers`` is the only function that
decides those copies, and every party calls it on the same inputs:

- each worker (``runtime.state_transfer``), over ranks, to post its sends and
  receives: every rank derives the same list, so no message has to agree on it;
- the master (``oobleck_mm.master.coordinator``), to log and count the copies of a generation;
- the planner (``planning.reconfigure``), over (node, GPU) pairs, for its report.

The rule: destinations are served in the new plan's order (pipeline by
pipeline, stage by stage, layers ascending); each missing (layer, destination)
takes, among the holders of the layer, one on the destination's own node
first (an NVLink copy instead of a network one), then the one that has been
asked to send the fewest layers so far (so copies run in parallel from many
survivors), then the lowest rank in the new generation. Survivors keep their old states until the
copy phase ends, so any of them may send, whatever it runs next.

Pure: no torch, no torch.distributed, no grpc.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Callable, Collection, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from oobleck_mm.planning.layout import ExecutionPlan
from oobleck_mm.planning.report import format_ranges


@dataclass(frozen=True, slots=True, order=True)
class Transfer:
    """Copy the state of ``layer`` from holder ``src`` to holder ``dst``.

    Holders are ranks of the new generation for the runtime and the master, and
    (node, local GPU) pairs for the planner.
    """

    layer: int
    dst: Any
    src: Any


def plan_transfers(
    held: Mapping[Any, Collection[int]],
    needed: Mapping[Any, Iterable[int]],
    node_of: Callable[[Any], Hashable] | None = None,
    rank_of: Callable[[Any], int] | None = None,
) -> tuple[Transfer, ...]:
    """The copies that give every holder of ``needed`` its layers; see the module docstring for the rule.

    ``held``: surviving holder -> layers whose state it holds now. ``needed``: holder ->
    layers it must hold next, in the order destinations are served. ``node_of``: a holder's
    node (default: every holder on a node of its own). ``rank_of``: a holder's rank in the
    new generation, the last tie-break (default: the holder itself, when holders are ranks),
    so the planner's (node, GPU) answer is the workers' answer over ranks. Raises
    ``ValueError`` naming the layers no survivor holds: the model state is gone.
    """
    node_of = node_of or (lambda holder: holder)
    rank_of = rank_of or (lambda holder: holder)
    holders: dict[int, list[Any]] = {}
    for holder, layers in held.items():
        for layer in layers:
            holders.setdefault(layer, []).append(holder)
    orphans = sorted({layer for dst, layers in needed.items() for layer in layers if layer not in holders})
    if orphans:
        raise ValueError(f"layers {format_ranges(orphans)} have no surviving holder to copy from")
    # The rule is min over a layer's holders of (other node, sent, rank). At 1,000 nodes a
    # layer has hundreds of holders and a plain min per copy dominated the simulator's
    # time, so: the few holders on the destination's node are scanned; the rest come
    # from a per-layer heap on (sent, rank, position) whose stale entries (a holder
    # asked since) are refreshed when they reach the top. Same answer, same tie-breaks.
    sent: Counter = Counter()
    local: dict[tuple[int, Hashable], list[Any]] = {}
    heaps: dict[int, list[tuple[int, Any, int, Any]]] = {}
    for layer, layer_holders in holders.items():
        for position, holder in enumerate(layer_holders):
            local.setdefault((layer, node_of(holder)), []).append(holder)
        heaps[layer] = [(0, rank_of(h), i, h) for i, h in enumerate(layer_holders)]
        heapq.heapify(heaps[layer])

    def source(layer: int, dst: Any) -> Any:
        same_node = local.get((layer, node_of(dst)))
        if same_node:
            return min(same_node, key=lambda h: (sent[h], rank_of(h)))
        heap = heaps[layer]
        while True:
            count, rank, position, holder = heap[0]
            if count == sent[holder]:
                return holder
            heapq.heapreplace(heap, (sent[holder], rank, position, holder))

    out = []
    for dst, layers in needed.items():
        kept = held.get(dst, ())
        for layer in sorted(layers):
            if layer in kept:
                continue
            src = source(layer, dst)
            sent[src] += 1
            out.append(Transfer(layer, dst, src))
    return tuple(out)


def rank_transfers(
    old: ExecutionPlan | None,
    new: ExecutionPlan,
    previous_ranks: Sequence[int],
    rank_nodes: Sequence[str] = (),
) -> tuple[Transfer, ...]:
    """``plan_transfers`` between two execution plans, over the new generation's ranks.

    ``previous_ranks[r]``: new rank ``r``'s rank in ``old``, or -1 for a worker without
    state (a joiner, or every worker when ``old`` is None). ``rank_nodes[r]``: the node
    of new rank ``r`` (empty: the same-node preference is off).
    """
    if len(previous_ranks) != new.world_size:
        raise ValueError(f"previous_ranks has {len(previous_ranks)} entries for {new.world_size} ranks")
    complete = _complete_stages(old, previous_ranks)
    held = {
        rank: old.stage(previous).layers
        for rank, previous in enumerate(previous_ranks)
        if previous >= 0 and old is not None and old.stage(previous).ranks in complete
    }
    needed = {rank: stage.layers for p in new.pipelines for stage in p.stages for rank in stage.ranks}
    node_of = (lambda rank: rank_nodes[rank]) if rank_nodes else None
    return plan_transfers(held, needed, node_of)


def _complete_stages(old: ExecutionPlan | None, previous_ranks: Sequence[int]) -> set[tuple[int, ...]]:
    """The old stages every rank of which survives: a stage of several GPUs that lost one holds no whole layer."""
    if old is None:
        return set()
    alive = {previous for previous in previous_ranks if previous >= 0}
    return {s.ranks for p in old.pipelines for s in p.stages if alive.issuperset(s.ranks)}


def gather_groups(old: ExecutionPlan | None, previous_ranks: Sequence[int]) -> list[tuple[int, ...]]:
    """For every surviving stage of several GPUs of ``old``, its ranks in the new generation, in shard order:
    the group over which they gather their layers whole (``StageEngine.held``) before the state copy, since
    their own stage's groups ended with the old generation. In ``old``'s stage order, the same on every rank."""
    if old is None:
        return []
    new_of = {previous: rank for rank, previous in enumerate(previous_ranks) if previous >= 0}
    complete = _complete_stages(old, previous_ranks)
    return [
        tuple(new_of[r] for r in s.ranks) for p in old.pipelines for s in p.stages if s.sharded and s.ranks in complete
    ]


def missing_states(old: ExecutionPlan | None, new: ExecutionPlan, previous_ranks: Sequence[int]) -> int:
    """(layer, new rank) pairs whose worker does not hold the layer yet: states to copy, load or create."""
    count = 0
    complete = _complete_stages(old, previous_ranks)
    for stage in (s for p in new.pipelines for s in p.stages):
        for rank in stage.ranks:  # every GPU of a stage holds (its shard of) every layer of it
            previous = previous_ranks[rank]
            held = (
                old.stage(previous).layers
                if old is not None and previous >= 0 and old.stage(previous).ranks in complete
                else range(0)
            )
            count += sum(1 for layer in stage.layers if layer not in held)
    return count
