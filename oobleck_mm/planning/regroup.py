"""How ``oobleck_mm.planning.reconfigure`` rebuilds pipelines from what survived: the working state of a
pipeline being rebuilt (``_Group``) and of a reconfiguration (``_Context``); removing lost nodes, filling
short pipelines from joined nodes, borrowing, merging, and placing joined nodes, each priced by the
predicted iteration time and the layer states it would move.

Pure: no torch, no torch.distributed, no grpc.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable

from oobleck_mm.planning.batch import min_max_split
from oobleck_mm.planning.costs import ClusterSpec
from oobleck_mm.planning.instantiate import best_template_counts
from oobleck_mm.planning.layout import Gpu
from oobleck_mm.planning.plan import Plan, gradient_allreduce_s
from oobleck_mm.planning.template import PipelineTemplate, TemplateSet


@dataclass(slots=True)
class _Group:
    """A pipeline being rebuilt: mutable working state, private to this module."""

    origins: tuple[int, ...]
    """Old pipeline indices whose nodes it holds; () for a pipeline of joined nodes."""
    nodes: list[str]
    old_size: int
    """Nodes of the old pipelines in ``origins`` (0 for a new pipeline)."""
    changed: bool = False

    @property
    def label(self) -> str:
        if not self.origins:
            return "new pipeline"
        if len(self.origins) == 1:
            return f"pipeline {self.origins[0]}"
        return "pipelines " + "+".join(map(str, self.origins))


@dataclass(frozen=True, slots=True)
class _Context:
    """What every step needs to price a candidate layout."""

    templates: TemplateSet
    fault_tolerance: int
    cluster: ClusterSpec
    total_microbatches: int
    held: dict[Gpu, range]
    """Surviving GPU -> layers it held in the old plan (lost nodes excluded)."""
    time_cache: dict[tuple[int, ...], float] = field(default_factory=dict)
    best_sizes: dict[int, list[int]] = field(default_factory=dict)
    """Live node count -> pipeline sizes of the best fresh layout (see ``_best_sizes``)."""

    @property
    def n0(self) -> int:
        return self.templates.min_nodes


def _layers_without_holder(ctx: _Context, num_layers: int) -> list[int]:
    held = set()
    for layers in ctx.held.values():
        held.update(layers)
    return [layer for layer in range(num_layers) if layer not in held]


# --- pricing candidates -----------------------------------------------------------------------


def _layout_moves(ctx: _Context, nodes: list[str]) -> int | None:
    """Layer states ``nodes`` must receive to run their template; None if no template fits.

    Fewer than n0 nodes are priced as the first positions of the n0-node template,
    the positions still to be filled counting nothing: a partial pipeline is
    always completed to n0 nodes by later steps.
    """
    template = ctx.templates.for_nodes(max(len(nodes), ctx.n0))
    if template is None:
        return None
    moved = 0
    for (position, gpu), layers in template.layers_of_gpu().items():
        if position < len(nodes):
            moved += len(layers) - _overlap(layers, ctx.held.get((nodes[position], gpu)))
    return moved


def _signature(ctx: _Context, group: _Group) -> tuple:
    """Everything a candidate's price reads from ``group``: whether it changed and the layers each
    of its GPUs holds, position by position. Groups with equal signatures give candidates equal in
    all but their index, and the lowest index wins every tie, so the steps price one of each:
    at 1,000 nodes most pipelines are untouched copies of a few templates."""
    gpus = range(ctx.cluster.gpus_per_node)
    return group.changed, tuple(tuple(ctx.held.get((node, g)) for g in gpus) for node in group.nodes)


def _overlap(a: range, b: range | None) -> int:
    if b is None:
        return 0
    return max(0, min(a.stop, b.stop) - max(a.start, b.start))


def _current_moves(ctx: _Context, group: _Group) -> int:
    """What ``group`` costs as it stands: 0 if untouched, its layout's moves otherwise."""
    if not group.changed:
        return 0
    return _layout_moves(ctx, group.nodes) or 0


def _best_insertion(ctx: _Context, nodes: list[str], node: str) -> tuple[int, int] | None:
    """(moves, position) of the cheapest place for ``node`` in ``nodes``; survivors keep their order."""
    best = None
    for position in range(len(nodes) + 1):
        moves = _layout_moves(ctx, nodes[:position] + [node] + nodes[position:])
        if moves is not None and (best is None or moves < best[0]):
            best = (moves, position)
    return best


def _predicted_time(ctx: _Context, sizes: Iterable[int]) -> float:
    """Predicted iteration seconds of pipelines of ``sizes`` nodes (those with a template)."""
    key = tuple(sorted(s for s in sizes if ctx.templates.for_nodes(s) is not None))
    if key not in ctx.time_cache:
        ctx.time_cache[key] = _time_of([ctx.templates.for_nodes(s) for s in key], ctx)
    return ctx.time_cache[key]


def _time_of(templates: list[PipelineTemplate], ctx: _Context) -> float:
    if not templates:
        return math.inf
    try:
        split = min_max_split(templates, ctx.total_microbatches)
    except ValueError:
        return math.inf
    slowest = max((t.iteration_time(m) for t, m in zip(templates, split) if m > 0), default=math.inf)
    return slowest + gradient_allreduce_s(templates, ctx.cluster)


def _best_sizes(ctx: _Context, live: int) -> list[int]:
    """Pipeline sizes (largest first) of the best template counts for ``live`` nodes, memoised.

    Raises ``ValueError`` like ``best_template_counts`` when no layout exists.
    """
    if live not in ctx.best_sizes:
        counts = best_template_counts(ctx.templates, live, ctx.fault_tolerance, ctx.total_microbatches)
        sizes = (t.num_nodes for t, c in zip(ctx.templates.templates, counts) for _ in range(c))
        ctx.best_sizes[live] = sorted(sizes, reverse=True)
    return ctx.best_sizes[live]


def _best_layout_time(ctx: _Context, live: int) -> float:
    """Predicted iteration seconds of the best template counts for ``live`` nodes (inf if none)."""
    try:
        return _predicted_time(ctx, _best_sizes(ctx, live))
    except ValueError:
        return math.inf


def _pick(candidates: list[tuple], ctx: _Context, sizes_after) -> tuple | None:
    """The candidate with the smallest (preference, moves) key; ties go to the faster layout, then order.

    Each candidate is ``(preference, moves, *order)``; ``sizes_after(candidate)``
    gives the pipeline sizes it leads to. Times are only computed for the tie.
    """
    if not candidates:
        return None
    best = min(c[:2] for c in candidates)
    tied = [c for c in candidates if c[:2] == best]
    return min(tied, key=lambda c: (_predicted_time(ctx, sizes_after(c)), c[2:]))


# --- the steps of §2.5.1 ----------------------------------------------------------------------


def _remove_lost(plan: Plan, lost: set[str], actions: list[str]) -> list[_Group]:
    groups = []
    for i, p in enumerate(plan.pipelines):
        gone = [n for n in p.nodes if n in lost]
        group = _Group(origins=(i,), nodes=[n for n in p.nodes if n not in lost], old_size=len(p.nodes))
        if gone:
            group.changed = True
            fate = "removed" if not group.nodes else f"{len(p.nodes)} -> {len(group.nodes)} nodes"
            actions.append(f"pipeline {i}: lost {', '.join(gone)} ({fate})")
        if group.nodes:
            groups.append(group)
    return groups


def _deficient(groups: list[_Group], n0: int) -> _Group | None:
    return next((g for g in groups if len(g.nodes) < n0), None)


def _fill_from_joined(groups: list[_Group], pool: list[str], ctx: _Context, actions: list[str]) -> None:
    for group in groups:
        while len(group.nodes) < ctx.n0 and pool:
            node = pool.pop(0)
            _, position = _best_insertion(ctx, group.nodes, node)
            group.nodes.insert(position, node)
            group.changed = True
            actions.append(f"{group.label}: took joined {node} ({len(group.nodes) - 1} -> {len(group.nodes)} nodes)")


def _borrow(groups: list[_Group], ctx: _Context, actions: list[str]) -> None:
    """Top up pipelines below n0 with nodes of pipelines that keep a template without them."""
    for group in groups:
        while len(group.nodes) < ctx.n0:
            candidates, priced = [], set()
            for d, donor in enumerate(groups):
                if donor is group or len(donor.nodes) - 1 < ctx.n0:
                    continue
                signature = _signature(ctx, donor)
                if signature in priced:
                    continue
                priced.add(signature)
                before = _current_moves(ctx, donor)
                for j, node in enumerate(donor.nodes):
                    after = _layout_moves(ctx, donor.nodes[:j] + donor.nodes[j + 1 :])
                    taken, position = _best_insertion(ctx, group.nodes, node)
                    candidates.append((0, after - before + taken, d, j, position))
            choice = _pick(candidates, ctx, lambda c: _sizes_after(groups, {c[2]: -1, groups.index(group): 1}))
            if choice is None:
                break  # nobody can give: merging handles it
            _, _, d, j, position = choice
            donor = groups[d]
            node = donor.nodes.pop(j)
            donor.changed = True
            group.nodes.insert(position, node)
            group.changed = True
            actions.append(
                f"{group.label}: borrowed {node} from {donor.label} "
                f"({donor.label} {len(donor.nodes) + 1} -> {len(donor.nodes)} nodes)"
            )


def _sizes_after(groups: list[_Group], delta: dict[int, int]) -> list[int]:
    return [len(g.nodes) + delta.get(i, 0) for i, g in enumerate(groups)]


def _merge(groups: list[_Group], ctx: _Context, actions: list[str]) -> bool:
    """Merge pipelines still below n0 with the smallest partner; False if none fits a template."""
    while (group := _deficient(groups, ctx.n0)) is not None:
        a = groups.index(group)
        candidates, priced = [], set()
        for b, partner in enumerate(groups):
            if b == a:
                continue
            signature = _signature(ctx, partner)
            if signature in priced:
                continue
            priced.add(signature)
            before = _current_moves(ctx, partner)
            for order, nodes in enumerate((group.nodes + partner.nodes, partner.nodes + group.nodes)):
                moves = _layout_moves(ctx, nodes)
                if moves is not None:
                    candidates.append((len(partner.nodes), moves - before, b, order))
        choice = _pick(candidates, ctx, lambda c: _merged_sizes(groups, a, c[2]))
        if choice is None:
            return False
        _, _, b, order = choice
        partner = groups[b]
        first, second = (group, partner) if order == 0 else (partner, group)
        merged = _Group(
            origins=tuple(sorted(group.origins + partner.origins)),
            nodes=first.nodes + second.nodes,
            old_size=group.old_size + partner.old_size,
            changed=True,
        )
        actions.append(
            f"merged {first.label} and {second.label} "
            f"({len(first.nodes)}+{len(second.nodes)} -> {len(merged.nodes)} nodes)"
        )
        groups[min(a, b)] = merged
        del groups[max(a, b)]
    return True


def _merged_sizes(groups: list[_Group], a: int, b: int) -> list[int]:
    sizes = [len(g.nodes) for i, g in enumerate(groups) if i not in (a, b)]
    return sizes + [len(groups[a].nodes) + len(groups[b].nodes)]


def _place_joined(groups: list[_Group], pool: list[str], ctx: _Context, actions: list[str]) -> bool:
    """New n0-node pipelines from joined nodes, leftovers one by one to the smallest pipeline.

    A new pipeline needs at least one microbatch, so no more pipelines are formed
    than the global batch has microbatches; the rest join existing pipelines.
    """
    while len(pool) >= ctx.n0 and len(groups) < ctx.total_microbatches:
        nodes, pool[:] = pool[: ctx.n0], pool[ctx.n0 :]
        groups.append(_Group(origins=(), nodes=nodes, old_size=0, changed=True))
        actions.append(f"joined {', '.join(nodes)} -> new pipeline ({ctx.n0} nodes)")
    for node in pool:
        candidates, priced = [], set()
        for i, group in enumerate(groups):
            if ctx.templates.for_nodes(len(group.nodes) + 1) is None:
                continue
            signature = _signature(ctx, group)
            if signature in priced:
                continue
            priced.add(signature)
            moves, position = _best_insertion(ctx, group.nodes, node)
            candidates.append((len(group.nodes), moves - _current_moves(ctx, group), i, position))
        choice = _pick(candidates, ctx, lambda c: _sizes_after(groups, {c[2]: 1}))
        if choice is None:
            return False
        _, _, i, position = choice
        group = groups[i]
        group.nodes.insert(position, node)
        group.changed = True
        actions.append(f"joined {node} -> {group.label} ({len(group.nodes) - 1} -> {len(group.nodes)} nodes)")
    pool.clear()
    return True
