"""Dynamic reconfiguration (§2.5): the new plan after nodes are lost or join.

``reconfigure`` owns the decision "which nodes run which pipeline next, and
which layer states must be copied where". It follows §2.5.1:

1. Lost nodes leave their pipelines; pipelines that lost nothing stay as they
   are (same nodes, same template, no state to copy). A pipeline whose nodes are
   all lost disappears.
2. An affected pipeline with ``k`` remaining nodes is *simply reinstantiated*
   from the ``k``-node template when one exists (``n0 <= k``).
3. Joined nodes first top up pipelines left with ``k < n0`` nodes: a fresh node
   costs no other pipeline a reinstantiation, a borrowed one does.
4. A pipeline still below ``n0`` *borrows* nodes, one at a time, from pipelines
   that can give one and keep a template (``k' - 1 >= n0``).
5. If no pipeline can give, it is *merged* with the smallest other pipeline
   until it has ``n0`` nodes. Appendix A.2: the merged size is below ``2 n0``
   and the template set built for ``N`` nodes covers it whenever ``f + 1``
   replicas can survive the merge.
6. Joined nodes left over form new ``n0``-node pipelines while they can (and
   while the global batch has a microbatch for each); the rest each join the
   smallest pipeline that has a template for one more node. Every joined node
   is used.
7. If these steps leave fewer than ``f + 1`` pipelines (too many merges) or a
   node they cannot place, the layout is recomputed from scratch with
   ``instantiate.best_template_counts`` and live nodes are assigned to it
   greedily by their old pipelines, so most nodes stay with their old peers.
8. The global batch is split again over the new pipelines (§2.5.2).

Tie-breaks, applied in this order wherever there is a choice (borrowing: which
donor and which of its nodes; merging: which partner and in which order;
where a node is inserted; which pipeline takes a leftover joined node):
structural preference first (merge: the smallest partner; leftover join: the
smallest pipeline), then the fewest layer states moved, then the better
predicted iteration time (``batch.min_max_split`` over the resulting
templates, plus the gradient all-reduce), then the lowest pipeline index and
node position. Inputs are sorted first, so the result never depends on the
iteration order of ``lost`` or ``joined``. No clock, no randomness.

Layer states are counted per (layer, destination GPU) whose GPU did not hold the
layer in the old plan. Which surviving holder sends each one is decided by
``transfers.plan_transfers``, the same function the workers run: a holder on
the destination's own node first, then the least-asked one.

Pure: no torch, no torch.distributed, no grpc.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable

from oobleck_mm.planning.batch import min_max_split, split_batch
from oobleck_mm.planning.costs import ClusterSpec
from oobleck_mm.planning.errors import InfeasiblePlan
from oobleck_mm.planning.instantiate import best_template_counts
from oobleck_mm.planning.layout import Gpu, rank_table
from oobleck_mm.planning.plan import PipelineInstance, Plan, gradient_allreduce_s
from oobleck_mm.planning.report import format_ranges
from oobleck_mm.planning.template import PipelineTemplate, TemplateSet
from oobleck_mm.planning.transfers import Transfer, plan_transfers

# Re-plan from scratch when that is predicted this much faster than the incremental layout.
DEFAULT_REPLAN_GAIN = 0.02


@dataclass(frozen=True, slots=True)
class Reconfiguration:
    plan: Plan
    actions: tuple[str, ...]
    """Human-readable steps in the order they were decided."""
    layer_states_moved: int
    """(layer, destination GPU) pairs whose GPU did not hold the layer in the old plan."""
    moves: tuple[Transfer, ...]
    """One per moved layer state (``Transfer`` over (node, GPU) holders), ordered by new pipeline,
    node position, GPU, layer: ``transfers.plan_transfers``, the rule the workers run."""
    reason: str


@dataclass(frozen=True, slots=True)
class CannotKeepReplicas:
    """The live nodes cannot hold ``f + 1`` replicas, or some layer has no surviving copy."""

    live_nodes: int
    needed: int
    """(f + 1) * n0: the fewest nodes that keep f + 1 replicas."""
    reason: str


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


def reconfigure(
    plan: Plan,
    lost: Iterable[str],
    joined: Iterable[str],
    template_set: TemplateSet,
    fault_tolerance: int,
    cluster: ClusterSpec,
    solver: str = "highs",
    replan_gain: float = DEFAULT_REPLAN_GAIN,
) -> Reconfiguration | CannotKeepReplicas:
    """The plan after ``lost`` nodes fail and ``joined`` nodes arrive (§2.5).

    A node named in both ``lost`` and ``joined`` restarted: its old states are
    gone and it comes back as a fresh node. Raises ``ValueError`` for inputs that
    do not fit ``plan`` and ``batch.BatchSplitError`` (a ``ValueError``) if the
    global batch cannot be split over the new pipelines.

    ``replan_gain``: the incremental steps of §2.5.1 keep nodes in place but
    drift from the best layout as events accumulate (measured: 3-7% below a
    fresh plan after 25 random events on GPT-3 6.7B). When the best layout for
    the live nodes is predicted to be more than ``replan_gain`` faster, it is
    taken instead: a one-off copy of more layer states against a per-iteration
    loss for the rest of the job. ``math.inf`` keeps the seed's behaviour.
    """
    if not replan_gain >= 0:
        raise ValueError(f"replan_gain must be >= 0 (math.inf: never re-plan), got {replan_gain}")
    lost_t, joined_t = _check_inputs(plan, lost, joined, template_set, fault_tolerance)
    lost_set = set(lost_t)
    survivors = [n for n in plan.nodes if n not in lost_set]
    live_count = len(survivors) + len(joined_t)
    needed = (fault_tolerance + 1) * template_set.min_nodes
    if live_count < needed:
        return CannotKeepReplicas(
            live_nodes=live_count,
            needed=needed,
            reason=f"{live_count} live nodes; keeping f+1 = {fault_tolerance + 1} replicas of a pipeline "
            f"that needs at least n0 = {template_set.min_nodes} nodes takes {needed}",
        )
    ctx = _Context(
        templates=template_set,
        fault_tolerance=fault_tolerance,
        cluster=cluster,
        total_microbatches=plan.global_batch // plan.microbatch_size,
        held={gpu: layers for p in plan.pipelines for gpu, layers in p.layers_on().items() if gpu[0] not in lost_set},
    )
    orphans = _layers_without_holder(ctx, template_set.templates[0].num_layers)
    if orphans:
        return CannotKeepReplicas(
            live_nodes=live_count,
            needed=needed,
            reason=f"layers {format_ranges(orphans)} lost every replica: the model state is gone",
        )

    actions: list[str] = []
    groups = _remove_lost(plan, lost_set, actions)
    num_loss_actions = len(actions)
    pool = list(joined_t)
    _fill_from_joined(groups, pool, ctx, actions)
    _borrow(groups, ctx, actions)
    placed = _merge(groups, ctx, actions) and _place_joined(groups, pool, ctx, actions)
    fresh = not placed or len(groups) < fault_tolerance + 1
    if fresh:
        del actions[num_loss_actions:]  # the incremental steps were discarded; do not report them
        why = (
            f"borrowing and merging left {len(groups)} pipeline(s) < f+1 = {fault_tolerance + 1}"
            if placed
            else "no pipeline fits the nodes left after borrowing and merging"
        )
        groups = _fresh_layout(plan, lost_set, joined_t, ctx, actions, why)
    elif replan_gain < math.inf:
        incremental = _predicted_time(ctx, [len(g.nodes) for g in groups])
        best = _best_layout_time(ctx, live_count)
        if incremental > best * (1 + replan_gain):
            fresh = True
            del actions[num_loss_actions:]
            why = (
                f"the incremental layout ({'+'.join(str(len(g.nodes)) for g in groups)} nodes, "
                f"{incremental:.4g} s/iteration) is {incremental / best - 1:.1%} slower than the best "
                f"(> replan_gain {replan_gain:.0%})"
            )
            groups = _fresh_layout(plan, lost_set, joined_t, ctx, actions, why)
    new_plan = _build_plan(groups, plan, ctx, solver)
    actions.extend(_instantiation_actions(groups))
    moves = _state_moves(new_plan, ctx)
    sizes = "+".join(str(len(p.nodes)) for p in new_plan.pipelines)
    reason = (
        f"{len(lost_t)} lost, {len(joined_t)} joined: {plan.num_pipelines} -> {new_plan.num_pipelines} "
        f"pipelines ({sizes} nodes){' by fresh instantiation' if fresh else ''}, "
        f"{len(moves)} layer states to copy, predicted {new_plan.iteration_time_s:.4g} s/iteration"
    )
    return Reconfiguration(
        plan=new_plan, actions=tuple(actions), layer_states_moved=len(moves), moves=moves, reason=reason
    )


# --- inputs -----------------------------------------------------------------------------------


def _check_inputs(
    plan: Plan, lost: Iterable[str], joined: Iterable[str], template_set: TemplateSet, fault_tolerance: int
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    if fault_tolerance < 0:
        raise ValueError(f"fault_tolerance must be >= 0, got {fault_tolerance}")
    names = {}
    for field_name, value in (("lost", lost), ("joined", joined)):
        if isinstance(value, str):
            raise ValueError(f"{field_name} must be an iterable of node names, got the string {value!r}")
        items = list(value)
        dupes = sorted(n for n, c in Counter(items).items() if c > 1)
        if dupes:
            raise ValueError(f"{field_name} names nodes more than once: {dupes}")
        names[field_name] = tuple(sorted(items))
    in_plan = set(plan.nodes)
    unknown = [n for n in names["lost"] if n not in in_plan]
    if unknown:
        raise ValueError(f"lost names nodes that are not in the plan: {unknown}; plan nodes: {sorted(in_plan)}")
    clash = [n for n in names["joined"] if n in in_plan and n not in names["lost"]]
    if clash:
        raise ValueError(f"joined names nodes that are already running in the plan: {clash}")
    for i, p in enumerate(plan.pipelines):
        if template_set.for_nodes(len(p.nodes)) != p.template:
            raise ValueError(
                f"template_set has no template equal to pipeline {i}'s ({len(p.nodes)} nodes); "
                f"pass the template set the plan was instantiated from (node counts {template_set.node_counts})"
            )
    return names["lost"], names["joined"]


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


def _fresh_layout(
    plan: Plan, lost: set[str], joined: tuple[str, ...], ctx: _Context, actions: list[str], why: str
) -> list[_Group]:
    """Fallback: the best template counts for the live nodes, filled greedily from old pipelines.

    Largest new pipeline first, each takes (in their old order) the nodes of the
    old pipeline with the most unassigned survivors, then the next, then joined
    nodes: nodes stay with as many of their old peers as the new sizes allow.
    """
    remaining = [[n for n in p.nodes if n not in lost] for p in plan.pipelines]
    pool = list(joined)
    live = sum(map(len, remaining)) + len(pool)
    try:
        sizes = _best_sizes(ctx, live)
    except ValueError as err:
        # Only reachable when joins push the cluster past the N the templates were built for.
        raise InfeasiblePlan(
            f"joined: {live} live nodes cannot be laid out with templates of {ctx.templates.min_nodes}.."
            f"{ctx.templates.max_nodes} nodes ({err}); rebuild the template set for {live} nodes "
            f"(stage_mapping.build_templates) and instantiate afresh"
        ) from err
    groups = []
    for nodes, origins in fill_greedily(sizes, remaining, pool):
        old_size = sum(len(plan.pipelines[i].nodes) for i in origins)
        unchanged = len(origins) == 1 and tuple(nodes) == plan.pipelines[origins[0]].nodes
        groups.append(_Group(origins=tuple(sorted(origins)), nodes=nodes, old_size=old_size, changed=not unchanged))
    groups.sort(key=lambda g: (g.origins[0] if g.origins else len(plan.pipelines), g.origins))
    actions.append(f"{why}: instantiated {'+'.join(map(str, sorted(sizes)))} nodes afresh over {live} live nodes")
    return groups


def fill_greedily(
    sizes: Iterable[int], remaining: list[list[str]], pool: list[str]
) -> list[tuple[list[str], list[int]]]:
    """For each size in turn: nodes taken, in their old order, from the old pipeline with the most
    unassigned nodes left (the first of equals), then the next, then from ``pool``; with the old
    pipelines each new one drew from. Consumes ``remaining`` and ``pool``; ``sizes`` must sum to
    what they hold.

    The pipeline with the most left is on top of a heap, not found by a scan of every old pipeline
    per pick: that was 16 million comparisons, 5.1 of the 6.3 s of a reconfiguration at 4,000 nodes.
    Only the pipeline just taken from changes, so it alone goes back."""
    most_left = [(-len(r), k) for k, r in enumerate(remaining) if r]
    heapq.heapify(most_left)
    out = []
    for size in sizes:
        nodes: list[str] = []
        origins: list[int] = []
        while len(nodes) < size:
            i = heapq.heappop(most_left)[1] if most_left else None
            source = pool if i is None else remaining[i]
            if i is not None:
                origins.append(i)
            if not source:
                raise ValueError("sizes: they sum past the nodes of remaining and pool")
            take = source[: size - len(nodes)]
            del source[: len(take)]
            nodes += take
            if i is not None and source:
                heapq.heappush(most_left, (-len(source), i))
        out.append((nodes, origins))
    return out


# --- the result -------------------------------------------------------------------------------


def _build_plan(groups: list[_Group], old: Plan, ctx: _Context, solver: str) -> Plan:
    templates = [ctx.templates.for_nodes(len(g.nodes)) for g in groups]
    assert all(t is not None for t in templates), [len(g.nodes) for g in groups]
    split = split_batch(templates, old.global_batch, old.microbatch_size, solver=solver)
    pipelines = tuple(
        PipelineInstance(template=t, nodes=tuple(g.nodes), num_microbatches=m)
        for t, g, m in zip(templates, groups, split.microbatches)
    )
    return Plan(
        pipelines=pipelines,
        global_batch=old.global_batch,
        microbatch_size=old.microbatch_size,
        allreduce_s=gradient_allreduce_s(templates, ctx.cluster),
    )


def _instantiation_actions(groups: list[_Group]) -> list[str]:
    out = []
    renumbered = [f"{g.origins[0]} -> {i}" for i, g in enumerate(groups) if not g.changed and g.origins != (i,)]
    if renumbered:
        out.append(f"unchanged pipelines renumbered: {', '.join(renumbered)}")
    for i, g in enumerate(groups):
        if not g.changed:
            continue
        if g.old_size:
            out.append(f"{g.label}: reinstantiated {g.old_size} -> {len(g.nodes)} nodes as pipeline {i}")
        else:
            out.append(f"new pipeline {i}: instantiated the {len(g.nodes)}-node template")
    return out


def _state_moves(plan: Plan, ctx: _Context) -> tuple[Transfer, ...]:
    """The copies the workers will run (the same rule), over (node, GPU) holders."""
    needed: dict[Gpu, range] = {}
    for pipeline in plan.pipelines:
        position = {node: i for i, node in enumerate(pipeline.nodes)}
        for gpu, layers in sorted(pipeline.layers_on().items(), key=lambda kv: (position[kv[0][0]], kv[0][1])):
            needed[gpu] = layers
    ranks = rank_table(plan)  # the workers' holders are these ranks: the same ties break the same way
    return plan_transfers(ctx.held, needed, node_of=lambda gpu: gpu[0], rank_of=ranks.__getitem__)
