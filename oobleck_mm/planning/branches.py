"""Encoder branches on stages of their own (Cornstarch's modality parallelism, issue 49 item 2).

A multimodal model is an ordered layer list, vision -> audio -> LLM, and a *chain* template runs it
that way: a stage may hold layers of both encoders (colocated), and the encoders' stages come one after
another in the pipeline. A *branched* template gives each encoder (with its projector) a chain of stages
on nodes of its own; the branches run concurrently, and the LLM's first stage takes every branch's output
for a microbatch before its forward (and sends each branch its gradient back). ``place`` plans both
placements for a node count and keeps the faster by the exact 1F1B time, with the reason.

Exact time of a branched template (``simulate_branched``): every stage runs DeepSpeed's
``TrainSchedule`` for its distance to the pipeline's end (a branch stage ``k`` of ``K`` before ``S``
LLM stages runs stage ``k`` of ``K + S``, an LLM stage ``j`` runs stage ``1 + j`` of ``1 + S``: a
stage's instruction order depends only on that distance), executed instruction by instruction with
blocking rendezvous transfers matched in order on each directed channel, as
``planning.simulate`` executes a chain; the LLM's first stage receives from every branch in branch
order and sends each its gradient. With one branch this is a chain, and it equals
``pipeline_time.iteration_time_1f1b``'s closed recurrence (tests/unit/test_branches.py holds it there).

Planning a branched template: each part (a branch's layers, the LLM's) gets a run of whole nodes or of
units of fewer GPUs (a divisor of a node, so parts may share one); its stage
cuts and GPUs come from the chain planner (``stage_mapping.map_stages``) on that part alone, and every
stage is then priced on the whole model's costs (eq. 3.3 per branch: an encoder's input gradients
depend on its own branch only) at its true 1F1B in-flight count (a branch stage holds the LLM's stages'
microbatches too), recomputing where only that fits. A part that fits on no allocation leaves the chain.

``place`` reports both placements and which is faster (``plan --placements``). With ``planning.placement:
auto``, ``stage_mapping.build_templates`` keeps per node count the faster of the chain and the best branched
template (``runnable_branched``), as a ``PipelineTemplate`` with
``branches``/``merge`` (``BranchedTemplate.to_template``), which the runtime executes
(``planning.layout.PipelineLayout.branches``).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from oobleck_mm.planning import branch_time
from oobleck_mm.planning.costs import ClusterSpec, ModelProfile
from oobleck_mm.planning.stage_mapping import map_stages
from oobleck_mm.planning.stage_tables import _CostTables
from oobleck_mm.planning.template import PipelineTemplate, StageSpec, TemplateSet

ENCODERS = ("vision", "audio")
"""The modalities that may run as branches, in the layer list's order."""


@dataclass(frozen=True, slots=True)
class BranchedTemplate:
    """Each encoder branch a chain of stages on nodes of its own, then the LLM's chain."""

    modalities: tuple[str, ...]
    branches: tuple[PipelineTemplate, ...]
    """Per branch, its stages (layer indices of the whole model, nodes counted from 0 within the part)."""
    llm: PipelineTemplate
    merge_s: tuple[float, ...]
    """Per branch: seconds to send one microbatch's output from its last stage to the LLM's first stage (its
    gradient back costs the same)."""
    num_nodes: int = 0
    """Nodes the template spans (its parts may share one: a part holds whole GPUs, not whole nodes)."""

    def __post_init__(self) -> None:
        if not self.branches or len(self.branches) != len(self.modalities) or len(self.merge_s) != len(self.branches):
            raise ValueError(
                f"a branched template needs one chain and one merge time per branch: {len(self.modalities)} "
                f"modalities, {len(self.branches)} chains, {len(self.merge_s)} merge times"
            )

    @property
    def stages(self) -> tuple[StageSpec, ...]:
        """Every stage, branch by branch, then the LLM's: the numbering ``simulate_branched`` uses."""
        return tuple(s for b in self.branches for s in b.stages) + self.llm.stages

    def iteration_time(self, num_microbatches: int) -> float:
        """Exact seconds of one iteration (``planning.branch_time.iteration_time``: beyond a few microbatches
        per stage, from the schedule's steady state)."""
        return branch_time.iteration_time(self.to_template(), num_microbatches)

    def to_template(self) -> PipelineTemplate:
        """As one ``PipelineTemplate`` (``branches``/``merge``): the branches' stages, then the LLM's; boundary
        k is stage k's outgoing transfer, a branch's last stage's to the LLM's first (``merge_s``)."""
        stages, sends, grads, starts = [], [], [], []
        for branch, merge in zip(self.branches, self.merge_s):
            starts.append(len(stages))
            stages += branch.stages
            sends += (*branch.send_activation_s, merge)
            grads += (*branch.send_grad_s, merge)
        merge_at = len(stages)
        stages += self.llm.stages
        sends += self.llm.send_activation_s
        grads += self.llm.send_grad_s
        return PipelineTemplate(
            self.num_nodes,
            self.llm.gpus_per_node,
            tuple(stages),
            tuple(sends),
            tuple(grads),
            branches=tuple(starts),
            merge=merge_at,
        )

    def describe(self) -> str:
        def chain(template: PipelineTemplate) -> str:
            return " ".join(f"L{s.layer_start}-{s.layer_end - 1}@n{s.node}g{s.gpus[0]}" for s in template.stages)

        parts = [f"{m} [{chain(b)}]" for m, b in zip(self.modalities, self.branches)]
        return " | ".join(parts) + f" -> llm [{chain(self.llm)}]"


@functools.lru_cache(maxsize=1024)
def as_branched(template: PipelineTemplate) -> BranchedTemplate:
    """A branched ``PipelineTemplate`` (``BranchedTemplate.to_template``) back as its parts."""
    ends = (*template.branches[1:], template.merge)
    branches, merges = [], []
    for start, end in zip(template.branches, ends):
        part = template.stages[start:end]
        branches.append(
            PipelineTemplate(
                template.num_nodes,
                template.gpus_per_node,
                part,
                template.send_activation_s[start : end - 1],
                template.send_grad_s[start : end - 1],
            )
        )
        merges.append(template.send_activation_s[end - 1])
    llm = PipelineTemplate(
        template.num_nodes,
        template.gpus_per_node,
        template.stages[template.merge :],
        template.send_activation_s[template.merge :],
        template.send_grad_s[template.merge :],
    )
    modalities = ENCODERS[: len(branches)] if len(branches) == len(ENCODERS) else ("encoder",) * len(branches)
    return BranchedTemplate(modalities, tuple(branches), llm, tuple(merges), template.num_nodes)


# --------------------------------------------------------------------------- exact time


def simulate_branched(template: BranchedTemplate, num_microbatches: int) -> float:
    """Seconds of one iteration of ``template`` (``planning.branch_time.simulate``); raises ``RuntimeError`` on
    deadlock."""
    return branch_time.simulate(template.to_template(), num_microbatches)


# --------------------------------------------------------------------------- planning


@dataclass(frozen=True, slots=True)
class Placement:
    """What ``place`` decided for one node count, and why."""

    chain: PipelineTemplate | None
    chain_s: float | None
    branched: BranchedTemplate | None
    branched_s: float | None
    faster: str
    """``chain`` or ``branches``."""
    reason: str


def parts_of(profile: ModelProfile) -> dict[str, range]:
    """Each encoder branch's layers and the LLM's, by modality (the layer list's order: a branch is contiguous)."""
    out: dict[str, range] = {}
    for name in (*ENCODERS, "text"):
        index = [i for i, layer in enumerate(profile.layers) if layer.modality == name]
        if index:
            if index != list(range(index[0], index[-1] + 1)):
                raise ValueError(f"the {name} layers are not contiguous in the layer list: {index}")
            out[name] = range(index[0], index[-1] + 1)
    if "text" not in out:
        raise ValueError("the model has no text layers: nothing for the branches to feed")
    return out


def place(profile: ModelProfile, cluster: ClusterSpec, num_nodes: int, num_microbatches: int) -> Placement:
    """The chain and the best branched template on ``num_nodes`` nodes for ``num_microbatches``, each by its
    exact 1F1B time, and which is faster."""
    chain, chain_s = None, None
    # The chain as the planner maps it, and in its widest stages only (as each branch is also tried): the
    # planner's local search misses that shallower chain now and then, and branches must beat the better.
    for variant in _variants(cluster):
        candidate = map_stages(profile, variant, num_nodes, num_microbatches)
        seconds = candidate.iteration_time(num_microbatches) if candidate is not None else None
        if seconds is not None and (chain_s is None or seconds < chain_s):
            chain, chain_s = candidate, seconds
    branched, why_not = best_branched(profile, cluster, num_nodes, num_microbatches)
    branched_s = branched.iteration_time(num_microbatches) if branched is not None else None
    if branched_s is None:
        return Placement(chain, chain_s, None, None, "chain", f"no branched template: {why_not}")
    if chain_s is None or branched_s < chain_s:
        ratio = f"x{chain_s / branched_s:.2f}" if chain_s else "the chain does not fit"
        return Placement(
            chain, chain_s, branched, branched_s, "branches", f"branches {branched_s:.4g} s vs chain: {ratio}"
        )
    return Placement(
        chain, chain_s, branched, branched_s, "chain", f"chain {chain_s:.4g} s vs branches {branched_s:.4g} s"
    )


def best_branched(
    profile: ModelProfile, cluster: ClusterSpec, num_nodes: int, num_microbatches: int
) -> tuple[BranchedTemplate | None, str]:
    """The fastest branched template, or None and why. Parts get runs of units of ``u`` GPUs: whole nodes,
    and each smaller divisor of a node while there are at most ``MAX_GPU_SPLIT`` units (parts may then share
    a node, and a part gets exactly the GPUs its depth needs); a part's chain may use stages of up to ``u``
    GPUs (and ``cluster.max_gpus_per_stage``) and is also tried in its widest stages only. Candidates are timed
    exactly in the order of their ``estimate``, at most ``MAX_TIMED``, skipping those whose ``lower_bound``
    is past the best time found."""
    parts = parts_of(profile)
    encoders = [m for m in ENCODERS if m in parts]
    if not encoders:
        return None, "the model has no encoder"
    order = (*encoders, "text")
    tables = _CostTables(profile, cluster)  # every stage's cost in its cheapest variant that fits
    trains = any(profile.layers[i].trainable for m in encoders for i in parts[m])
    # Each part gets a run of u-GPU units (u dividing a node, so no unit straddles two nodes): whole nodes,
    # and smaller units that let parts share a node and give a part exactly the GPUs its depth needs. (Parts
    # of different units were tried: on Cornstarch's models at 24 GPUs they found nothing faster.)
    units = _unit_sizes(cluster, num_nodes)
    shaped = {
        u: _variants(
            dataclasses.replace(cluster, gpus_per_node=u, max_gpus_per_stage=min(cluster.max_gpus_per_stage, u))
        )
        for u in units
    }
    chains: dict[tuple[int, int, str, int], PipelineTemplate | None] = {}

    def chains_of(part: str, unit: int, count: int) -> list[PipelineTemplate]:
        out = []
        for v, variant in enumerate(shaped[unit]):
            key = (unit, v, part, count)
            if key not in chains:
                layers = profile.layers[parts[part].start : parts[part].stop]
                sub = dataclasses.replace(profile, layers=layers, upstream_trainable=part == "text" and trains)
                chains[key] = map_stages(sub, variant, count, num_microbatches)
            if chains[key] is not None:
                out.append(chains[key])
        return out

    candidates = []
    for unit in units:
        for split in _splits(num_nodes * cluster.gpus_per_node // unit, len(order)):
            options = [chains_of(part, unit, count) for part, count in zip(order, split)]
            for chosen in itertools.product(*options):
                local = dict(zip(order, chosen))
                template = _assemble(tables, parts, encoders, local, num_nodes, unit)
                if template is not None:
                    guess = estimate(template, num_microbatches)
                    candidates.append((guess, len(candidates), lower_bound(template, num_microbatches), template))
    if not candidates:
        return None, f"no split of {num_nodes} node(s) between {', '.join(order)} fits memory"
    candidates.sort(key=lambda c: c[:2])
    best, best_s, timed = None, float("inf"), 0
    for _, _, bound, template in candidates:
        if timed == MAX_TIMED:
            break
        if bound >= best_s:
            continue
        timed += 1
        seconds = template.iteration_time(num_microbatches)
        if seconds < best_s:
            best, best_s = template, seconds
    return best, f"the best of {len(candidates)} splits ({timed} timed exactly)"


def runnable_branched(
    profile: ModelProfile, cluster: ClusterSpec, num_nodes: int, num_microbatches: int
) -> BranchedTemplate | None:
    """The fastest branched template (the runtime runs any: stages of one GPU, of samples split over several,
    or of context-parallel lanes; ``planning.layout.PipelineLayout.branches``), or None (no encoder, no split
    fits)."""
    try:
        best, _ = best_branched(profile, dataclasses.replace(cluster, placement="chain"), num_nodes, num_microbatches)
    except ValueError:  # parts not contiguous, or no text layers: the chain only
        return None
    return best


def with_branches(
    template_set: TemplateSet,
    profile: ModelProfile,
    cluster: ClusterSpec,
    num_nodes: int,
    microbatches_hint: int | None = None,
    total_microbatches: int | None = None,
) -> TemplateSet:
    """``planning.placement: auto``: each template of ``template_set`` (``stage_mapping.build_templates``'
    chains), or the runnable branched template on as many nodes (``runnable_branched``) where its exact 1F1B
    time is lower, for the microbatches ``build_templates`` tuned that template for (``microbatches_hint``, or
    the share of ``total_microbatches`` an ``n``-node pipeline gets; default two per stage of the chain)."""
    out = []
    for chain in template_set.templates:
        n = chain.num_nodes
        m = microbatches_hint or (max(1, round(total_microbatches * n / num_nodes)) if total_microbatches else 0)
        m = m or 2 * chain.num_stages
        branched = runnable_branched(profile, cluster, n, m)
        template = branched.to_template() if branched is not None else None
        out.append(template if template is not None and template.iteration_time(m) < chain.iteration_time(m) else chain)
    return dataclasses.replace(template_set, templates=tuple(out))


MAX_GPU_SPLIT = 32
"""Up to this many units, parts are also tried on runs of units smaller than a node (splits grow with the
square of the units: 465 splits of 32 units between three parts, each assembled and bounded)."""
MAX_TIMED = 16
"""Candidates timed exactly per ``best_branched`` call, best ``estimate`` first."""


def lower_bound(template: BranchedTemplate, num_microbatches: int) -> float:
    """No iteration of ``template`` is shorter: on every path (a branch, then the LLM) every stage runs all its
    microbatches' forwards and backwards, after the stages before it passed it the first microbatch and
    before they take the last one's gradient back."""
    bound = 0.0
    for branch in template.branches:
        path = branch.stages + template.llm.stages
        before = 0.0
        for stage in path:
            bound = max(bound, before + num_microbatches * (stage.forward_s + stage.backward_s))
            before += stage.forward_s + stage.backward_s
    return bound


def estimate(template: BranchedTemplate, num_microbatches: int) -> float:
    """The order candidates are timed in: per path, one microbatch through every stage and back plus the
    others at the slowest stage's pace (the seed's formula, exact for equal stages: it counts the depth that
    ``lower_bound`` leaves out)."""
    return max(
        sum(s.forward_s + s.backward_s for s in path)
        + (num_microbatches - 1) * max(s.forward_s + s.backward_s for s in path)
        for path in (branch.stages + template.llm.stages for branch in template.branches)
    )


def _variants(cluster: ClusterSpec) -> tuple[ClusterSpec, ...]:
    """``cluster``, and where stages may span several GPUs, the same with its widest stages only."""
    widest = min(cluster.max_gpus_per_stage, cluster.gpus_per_node)
    if widest == 1 or cluster.context_parallel > 1:
        return (cluster,)
    return (cluster, dataclasses.replace(cluster, min_gpus_per_stage=widest))


def _unit_sizes(cluster: ClusterSpec, num_nodes: int) -> list[int]:
    """The unit sizes parts are given GPUs in: a whole node always, and every smaller divisor of a node while
    the template has at most ``MAX_GPU_SPLIT`` units of it (splits grow with the square of the units)."""
    g = cluster.gpus_per_node
    d = cluster.context_parallel  # a context-parallel stage is d GPUs wide: a unit holds whole stages
    return [g] + [u for u in range(g - 1, 0, -1) if g % u == 0 and u % d == 0 and num_nodes * g // u <= MAX_GPU_SPLIT]


def _splits(total: int, parts: int):
    """Every way to give ``parts`` parts at least one unit each, ``total`` in all."""
    if parts == 1:
        yield (total,)
        return
    for first in range(1, total - parts + 2):
        for rest in _splits(total - first, parts - 1):
            yield (first, *rest)


def _assemble(
    tables: _CostTables,
    parts: dict[str, range],
    encoders: Sequence[str],
    local: dict[str, PipelineTemplate],
    num_nodes: int,
    unit: int,
) -> BranchedTemplate | None:
    """The parts' chains placed one after another (the branches', then the LLM's), each on a run of units of
    ``unit`` GPUs (its chain was planned on nodes of that many GPUs: its node ``i`` is the run's ``i``-th
    unit), priced on the whole model's costs at their true in-flight counts and their transfers by
    whether the two ends share a node; None when a stage fits no variant."""
    llm_stages = local["text"].num_stages
    cluster, prefix = tables.cluster, tables.prefix
    g = cluster.gpus_per_node
    used = 0  # GPUs the parts placed so far hold

    def priced(template: PipelineTemplate, offset: int, after: int) -> PipelineTemplate | None:
        nonlocal used
        stages = []
        for k, s in enumerate(template.stages):
            in_flight = template.num_stages - k + after
            start, end = s.layer_start + offset, s.layer_end + offset
            cost, recompute = tables.stage(start, end, len(s.gpus), in_flight)
            if cost.memory_bytes(in_flight) > cluster.usable_memory_bytes:
                return None
            first = used + s.node * unit  # the run's unit s.node, as a GPU index of the whole template
            node, gpus = (first + s.gpus[0]) // g, tuple((first + i) % g for i in s.gpus)
            stages.append(
                dataclasses.replace(
                    s,
                    layer_start=start,
                    layer_end=end,
                    node=node,
                    gpus=gpus,
                    forward_s=cost.forward_s,
                    backward_s=cost.backward_s,
                    memory_bytes=cost.memory_bytes(in_flight),
                    grad_bytes=cost.grad_bytes,
                    recompute=recompute,
                )
            )
        used += template.num_nodes * unit
        sends = tuple(
            cluster.transfer_s(prefix.layers[a.layer_end - 1].output_bytes, cross_node=a.node != b.node)
            for a, b in zip(stages, stages[1:])
        )
        return dataclasses.replace(
            template, stages=tuple(stages), send_activation_s=sends, send_grad_s=sends, gpus_per_node=g
        )

    branches = []
    for m in encoders:
        chain = priced(local[m], parts[m].start, llm_stages)
        if chain is None:
            return None
        branches.append(chain)
    llm = priced(local["text"], parts["text"].start, 0)
    if llm is None:
        return None
    first = llm.stages[0]
    merges = tuple(
        cluster.transfer_s(
            prefix.layers[b.stages[-1].layer_end - 1].output_bytes, cross_node=b.stages[-1].node != first.node
        )
        for b in branches
    )
    return BranchedTemplate(tuple(encoders), tuple(branches), llm, merges, num_nodes)
