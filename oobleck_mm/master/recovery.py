"""The master's recovery decisions as pure functions of its state: which generation to plan from, what changed.

Vocabulary:

- A *generation* is one plan sent to the workers: an ``ExecutionPlan`` and a rank
  per (node, GPU). Workers of generation g rendezvous under the store prefix ``gen{g}``.
- A worker *holds* a generation when its in-memory layer states follow that
  generation's layout. The worker keeps two: the generation it last adopted
  (``current``: it reported ``states_copied``) and the last one in which it
  completed a step (``committed``: it reported ``resumed``/metrics); a
  committed step drops the older ones. The master mirrors both from the reports.
- The *base* of a new plan is the generation the survivors' states are taken
  from (``Assignment.previous_generation``): the newest generation that every
  worker of the nodes counted as survivors holds, such that every layer still
  has a holder among them. Usually that is the current generation; after a
  failure *during* a recovery (the new generation's copy was interrupted) it is
  the generation the workers came from, which they still hold. Nodes of the
  base that do not hold it (a joiner whose copy failed) are treated as lost and
  joined again: their workers start from nothing (``previous_ranks`` -1).

Why the reports are enough (no handshake before planning): no step of a
generation can complete once one of its workers is gone (every step ends with a
collective over all ranks), so a worker's ``committed`` cannot move after the
failure; and ``current`` only adds a generation, which never invalidates a base
chosen without it. Reports travel in order per worker, and the plan is checked
against the latest reports again when it is applied.

Decisions return ``(result, reason)`` like torchft's quorum: the reason is what
the event log and the console print.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

from oobleck_mm.planning.layout import ExecutionPlan, Gpu
from oobleck_mm.planning.report import format_ranges


@dataclass(frozen=True, slots=True)
class GenerationView:
    """What the decisions need to know about one generation the master sent."""

    number: int
    layout: ExecutionPlan
    ranks: Mapping[Gpu, int]
    """(node, gpu) -> rank in this generation."""
    nodes: tuple[str, ...] = field(init=False, compare=False, repr=False)
    """Nodes in rank order (first appearance). Computed once: the decisions ask for it per node and per
    event, and recomputing it made every heartbeat tick O(nodes^2) (22 s at 1,000 nodes)."""

    def __post_init__(self) -> None:
        ordered = dict.fromkeys(node for (node, _), _rank in sorted(self.ranks.items(), key=lambda kv: kv[1]))
        object.__setattr__(self, "nodes", tuple(ordered))

    def gpus_of(self, node: str) -> list[Gpu]:
        return sorted(gpu for gpu in self.ranks if gpu[0] == node)

    @property
    def rank_nodes(self) -> tuple[str, ...]:
        """The node of each rank, in rank order (``Assignment.rank_nodes``)."""
        out = [""] * len(self.ranks)
        for (node, _), rank in self.ranks.items():
            out[rank] = node
        return tuple(out)


@dataclass(frozen=True, slots=True)
class Holdings:
    """The generations one worker's states follow, as its reports say (0: none)."""

    current: int = 0
    committed: int = 0

    def held(self) -> frozenset[int]:
        return frozenset(g for g in (self.current, self.committed) if g > 0)

    def adopted(self, generation: int) -> Holdings:
        """After ``states_copied`` of ``generation``: the committed one is kept until a step completes."""
        return Holdings(current=max(self.current, generation), committed=self.committed)

    def completed_step(self, generation: int) -> Holdings:
        """After a step (metrics, ``resumed``) of ``generation``: older generations are dropped."""
        if generation < self.committed:
            return self  # a late report of an older generation
        return Holdings(current=generation, committed=generation)


@dataclass(frozen=True, slots=True)
class Base:
    generation: int
    """0: nobody holds trained state yet; the next generation starts afresh."""
    holding_nodes: tuple[str, ...]
    """Live nodes of the base whose every worker holds it: the survivors."""
    stale_nodes: tuple[str, ...]
    """Live nodes of the base that do not hold it: their states are dropped."""


@dataclass(frozen=True, slots=True)
class Request:
    """The inputs of one planning call; compared again when its result arrives."""

    base: int
    """The generation whose states the survivors keep (``previous_generation``); 0: they start afresh."""
    plan_from: int
    """The generation whose plan the planner reconfigures (its templates are kept); 0: a fresh plan."""
    lost: tuple[str, ...]
    """Nodes of ``plan_from``'s plan that leave it (gone, or stale)."""
    joined: tuple[str, ...]
    """Live nodes that enter it (new, or stale ones coming back empty)."""
    live: tuple[str, ...]
    """Every node of the new plan, in registration order."""
    failure: bool
    """Some node of the current generation is gone, or its iteration was abandoned (not joins only)."""
    slow: tuple[tuple[str, float], ...] = ()
    """Slow nodes of ``live`` and their factors: the batch split prices their stages that much slower."""
    bench: tuple[str, ...] = ()
    """Slow nodes of ``live`` the planner may plan out, when the job is predicted faster without them."""

    @property
    def reform(self) -> bool:
        """The same nodes again as a new generation of ``plan_from``'s plan: nothing to plan."""
        return self.failure and not self.lost and not self.joined and self.plan_from > 0


@dataclass(frozen=True, slots=True)
class StateLost:
    """No generation the survivors hold covers every layer: nothing can continue, not even a checkpoint."""

    reason: str


def choose_base(
    generations: Mapping[int, GenerationView], holdings: Mapping[Gpu, Holdings], live: Collection[str]
) -> tuple[Base | None, str]:
    """The generation the next plan takes its states from, or None when the model state is gone.

    Candidates are the generations some live worker holds. A candidate is
    usable when every layer has a holder among the live nodes whose every
    worker holds it; among usable ones the base is the one held by the most
    live nodes (their states need not be copied again), the newest on a tie.
    All candidates are at the same training step: no step completes once a
    worker of the group is gone, so choosing an older one loses nothing.
    """
    live = set(live)
    candidates = sorted({g for gpu, h in holdings.items() if gpu[0] in live for g in h.held()}, reverse=True)
    if not candidates:
        return Base(0, (), ()), "no worker holds trained state yet: the next generation starts afresh"
    usable, reasons = [], []
    for number in candidates:
        gen = generations.get(number)
        if gen is None:
            continue
        held_by = {gpu[0]: True for gpu in gen.ranks}
        for gpu in gen.ranks:  # a node holds the generation when every one of its workers does
            held_by[gpu[0]] = held_by[gpu[0]] and number in holdings.get(gpu, Holdings()).held()
        holding = tuple(n for n in gen.nodes if n in live and held_by[n])
        orphans = orphan_layers(gen.layout, surviving_ranks(gen, holding))
        if orphans:
            reasons.append(f"generation {number} lost every holder of layers {format_ranges(orphans)}")
        else:
            kept = set(holding)
            stale = tuple(n for n in gen.nodes if n in live and n not in kept)
            usable.append(Base(number, holding, stale))
    if not usable:
        return None, "the model state is gone: " + "; ".join(reasons)
    base = max(usable, key=lambda b: (len(b.holding_nodes), b.generation))
    why = f"generation {base.generation} is held by {len(base.holding_nodes)} live node(s), covering every layer"
    return base, why + (f"; {', '.join(base.stale_nodes)} start empty" if base.stale_nodes else "")


def surviving_ranks(gen: GenerationView, holding_nodes: Collection[str]) -> list[int]:
    """Ranks of ``gen`` on ``holding_nodes``, sorted."""
    holding = set(holding_nodes)
    return sorted(rank for (node, _), rank in gen.ranks.items() if node in holding)


def orphan_layers(layout: ExecutionPlan, alive_ranks: Collection[int]) -> list[int]:
    """Layers none of ``alive_ranks`` holds in ``layout``."""
    alive = set(alive_ranks)
    return [layer for layer in range(layout.num_layers) if not alive.intersection(layout.holders(layer))]


def committed(gen: GenerationView, holdings: Mapping[Gpu, Holdings]) -> bool:
    """Every worker of ``gen`` completed a step in it: the generation is fully joined."""
    return all(holdings.get(gpu, Holdings()).committed == gen.number for gpu in gen.ranks)


def plan_request(
    current: GenerationView,
    generations: Mapping[int, GenerationView],
    holdings: Mapping[Gpu, Holdings],
    live: Sequence[str],
    abandoned: bool = False,
    keeps_replicas_from: int = 0,
) -> tuple[Request | StateLost | None, str]:
    """What the next plan must account for, or None (nothing changed, or joins that must wait).

    ``live``: the nodes that can take part now (registered, stream open), in
    registration order. Joins wait until the current generation is committed:
    a join is applied at an iteration boundary, and planning it from a
    generation still being copied would abandon that copy. ``abandoned``: the
    current generation's workers gave up an iteration and no node was lost
    for ``fault_tolerance.reform_after``: it cannot go on, so even unchanged
    membership is planned again (a *re-form*: ``lost`` and ``joined`` empty,
    the same nodes as a new generation from the base they hold).

    A loss (or a re-form) leaves new nodes out when the survivors alone keep
    f + 1 replicas (``keeps_replicas_from`` nodes, (f + 1) * n0; 0: unknown):
    a joiner in a recovery's plan builds the layers it receives while every
    survivor waits at the rendezvous (seconds for an HF model on shared
    cores), whereas a join planned once that generation completed a step is
    built in the background while the survivors train (``PreparedGroup``,
    gated). The joiners follow one generation later; only the copy stalls. That holds as well for the
    joiners of a join generation planned but not switched to (the current one, holding nothing of the
    base a loss plans from).
    """
    live_set, planned = set(live), set(current.nodes)
    gone = [n for n in current.nodes if n not in live_set]
    new = [n for n in live if n not in planned]
    failure = bool(gone) or abandoned
    if not failure and not new:
        return None, "membership unchanged"
    if not failure and not committed(current, holdings):
        return None, f"joins of {', '.join(new)} wait until generation {current.number} completed a step"
    base, why = choose_base(generations, holdings, live)
    if base is None:
        return StateLost(why), why
    deferred = ""
    if base.generation == 0:
        # Nobody holds trained state: plan from the current layout all the same (the templates
        # built for the starting node count stay valid), only the workers start afresh.
        if failure and _survivors_suffice(live, new, keeps_replicas_from):
            live, deferred = _defer(live, new, ", ".join(new), keeps_replicas_from)
            new = []
        return Request(0, current.number, tuple(gone), tuple(new), tuple(live), failure=failure), why + deferred
    base_nodes = generations[base.generation].nodes
    # Who waits out a loss is judged against the base, not the current generation. A joiner of a join
    # generation planned but not switched to (its workers still preparing) is in the current generation,
    # yet holds nothing of the base: as new as one not planned, so it waits out the loss the same way.
    # Under bursty churn most losses came while a join was planned: 36 of 46 loss plans of an HF soak took
    # a joiner in, their rendezvous 0.565 s against 0.076 s without. Its workers wait in that generation's
    # rendezvous, polling for a newer command, until the join after the recovery comes. And a node the
    # current generation left out but which holds the base (a joiner the workers switched to while the
    # master planned the current one from the generation before: the re-form that follows is planned from
    # the join) is a survivor, not a joiner: leaving it out made it join again and receive every layer.
    holders, in_base, stale = set(base.holding_nodes), set(base_nodes), set(base.stale_nodes)
    fresh = [n for n in live if n not in in_base]
    if failure and _survivors_suffice(live, fresh, keeps_replicas_from):
        waiting = [n for n in fresh if n in planned]
        named = ", ".join(
            [n for n in fresh if n not in planned]
            + (
                [f"{', '.join(waiting)} (planned to join generation {current.number}, not switched to)"]
                if waiting
                else []
            )
        )
        live, deferred = _defer(live, fresh, named, keeps_replicas_from)
    lost = tuple(n for n in base_nodes if n not in holders)
    joined = tuple(n for n in live if n not in in_base or n in stale)
    request = Request(base.generation, base.generation, lost, joined, tuple(live), failure=failure)
    return request, why + deferred + (
        "; the iteration was abandoned with no node lost: the nodes re-form" if abandoned else ""
    )


def _survivors_suffice(live: Sequence[str], joiners: Sequence[str], keeps_replicas_from: int) -> bool:
    """The live nodes other than ``joiners`` keep f + 1 replicas by themselves (0: the threshold is unknown)."""
    return bool(joiners) and 0 < keeps_replicas_from <= len(live) - len(joiners)


def _defer(live: Sequence[str], joiners: Sequence[str], named: str, keeps_replicas_from: int) -> tuple[list[str], str]:
    """``live`` without ``joiners``, and the reason's words for leaving them to the next generation."""
    out = set(joiners)
    kept = [n for n in live if n not in out]
    return kept, (
        f"; {named} join once the recovery's generation completed a step: {len(kept)} survivors keep "
        f"f + 1 replicas (>= {keeps_replicas_from} nodes)"
    )


def previous_ranks(
    new_ranks: Mapping[Gpu, int], base: GenerationView | None, holding_nodes: Collection[str]
) -> list[int]:
    """``Assignment.previous_ranks``: per new rank, its rank in the base, or -1 for a worker without state."""
    out = [-1] * len(new_ranks)
    for gpu, rank in new_ranks.items():
        if base is not None and gpu[0] in holding_nodes and gpu in base.ranks:
            out[rank] = base.ranks[gpu]
    return out
