"""GPU-stage mapping of pipeline templates and the node specification (§2.4.1).

This module owns two decisions of the seed's template generator:

* **GPU-stage mapping** (§2.4.1.2): for ``n`` nodes of ``M`` GPUs, cut the
  model's ``L`` layers into contiguous stages and give each stage ``d`` GPUs of
  one node (``d`` in ``cluster.stage_gpu_options``) so that every GPU is used.
  Pipeline order is node order; inside a node the GPUs are taken in index order.
* **Node specification** (§2.4.1.1): ``n0`` (the fewest nodes that hold the
  model) and the consecutive node counts ``n0 .. min(N - f n0, largest
  mappable)`` that satisfy the Frobenius coverage condition.

Objective
---------
The exact 1F1B iteration time (``pipeline_time``) couples neighbouring stages
and is not decomposable over stages, so the DP solves the lexicographic
objective that governs it: (1) minimise the bottleneck stage cost
``c_k = F_k + B_k + (a_{k-1} + g_{k-1}) + (a_k + g_k)`` where ``a``/``g`` are
the activation/gradient transfers of a boundary, then (2) among the mappings
with that bottleneck, minimise ``sum_k c_k`` (the fill/drain part).

Why both boundaries: DeepSpeed's p2p is a blocking rendezvous, so a transfer
occupies *both* of its stages. In steady state the meeting times of boundary
``k`` obey ``E_k(t+1) = max(E_{k-1}(t) + a_{k-1} + g_{k-1} + F_k, E_{k+1}(t) +
a_{k+1} + g_{k+1} + B_{k+1})``; every cycle of that max-plus system is a union
of single-stage cycles, so the per-microbatch period is exactly ``max_k c_k``.
Charging a boundary to one side only (the first version did) left 3% mean and
25% worst-case gaps to the exact optimum on small instances.

Two exact passes: a min-max DP, then a min-sum DP in which every stage
costlier than the bottleneck is masked out.

Tuning for a microbatch count
-----------------------------
With few microbatches per stage (M < 8 S) fill and drain weigh as much as the
period, and the objective above is position-blind. When the caller knows M
(``microbatches_hint``, or ``build_templates``' share of the global batch) and
the pipeline has at most 32 stages (longer ones keep the lexicographic optimum),
the template is the best in *exact* 1F1B time among the lexicographic optimum,
min-sum mappings under a few looser bottleneck caps, and a budgeted hill-climb
that moves one layer across one boundary at a time. Measured against brute
force (scripts/stage_mapping_gap.py): at M = S the mean gap to the exact
optimum drops from 4.4% to 0.9%, at M = 2 S from 1.1% to 0.15%.

The DP
------
It runs over *suffixes* of the pipeline's GPU sequence: ``V_g[w]`` is the best
value for layers ``[w, L)`` on the last ``g`` GPUs, starting at a stage
boundary. The first stage of that suffix takes ``d`` GPUs and layers
``[w, w')``; it is legal when it stays inside one node, and its outgoing
boundary is intra-node, cross-node or absent (last stage) depending on where
the remaining ``g - d`` GPUs start. Because ``V_g`` is indexed from the end of
the pipeline, the node-local offset of a suffix start does not depend on the
template's size, so one chain ``V_0, V_1, ...`` serves every template at once
(``V_{nM}[0]`` is template ``n``'s optimum): this is the seed's memoisation,
templates share sub-results. Each transition is one numpy min over an
``(L+1) x (L+1)`` matrix, so a chain costs ``O(n M |options| L^2)``.
(The brief suggested per-node ``G[u, v]`` tables built by ``L^3`` matrix
products; the GPU-level chain computes the same optimum with ``L^2`` per step.)

Memory
------
Under 1F1B stage ``k`` of ``S`` keeps ``S - k`` microbatches of activations in
flight (assuming at least ``S`` microbatches). Building from the back, the DP
knows how many GPUs follow a stage but not how many stages, so it uses
``in_flight = min(1 + gpus_after // w_min, 1 + L - w')`` (each later stage has at
least the narrowest option's ``w_min`` GPUs and one layer). This is exact when
every stage is as wide (``max_gpus_per_stage == 1``: every GPU is one stage;
``context_parallel: d``: every stage is ``d`` lanes) and never an underestimate
otherwise, so a mapping the DP accepts always fits; with stages of mixed widths
it may reject a few mappings that would fit. The reported ``StageSpec.memory_bytes`` uses the exact ``S - k``.

Recomputation (``profile.recompute``, from ``training.activation_checkpointing``) is a per-stage
variant: under ``auto`` every stage ``[w, w')`` costs its keep-everything time where that fits
memory and its recomputing time (one more forward in the backward, only inputs kept) where only
that fits, so the DP picks cuts and recomputation together, exactly (a stage's variant changes
nothing outside it). The template's ``StageSpec.recompute`` is re-decided with the exact in-flight
count, so a stage the conservative count made recompute may keep its activations after all.

Pure: numpy only; no torch, no torch.distributed, no grpc.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import numpy as np

from oobleck_mm.planning.errors import InfeasiblePlan, TooFewNodes
from oobleck_mm.errors import UserError
from oobleck_mm.planning.costs import AUTO_CONTEXT_PARALLEL, ClusterSpec, ModelProfile
from oobleck_mm.planning.stage_tables import _CROSS, _INTRA, _LAST, _CostTables, _shift_boundary, _SuffixChain
from oobleck_mm.planning.template import PipelineTemplate, StageSpec, TemplateSet

# Relative slack when pass 2 masks stages above the bottleneck. Pass 1's
# bottleneck is one of the very matrix entries pass 2 compares, so equality
# already holds; the slack keeps it so should the passes ever round differently.
_BOTTLENECK_SLACK = 1e-12

_GiB = float(2**30)
# Bottleneck caps tried above the optimum when a microbatch count is known
# (relative). A handful of caps recovers most of the gap between the
# lexicographic optimum and the exact 1F1B optimum at small microbatch counts
# (docs/planning.md has the measurement); each costs one min-sum pass.
_CAP_RELAXATIONS = (0.05, 0.2, 0.5)
# ... tried only when microbatches < _TRANSIENT_RATIO x stages, and only for
# pipelines of at most _TUNE_MAX_STAGES stages: exact evaluations of long
# pipelines are costly and the planner rarely instantiates them.
_TRANSIENT_RATIO = 8
_TUNE_MAX_STAGES = 32
# Exact-time evaluations the boundary hill-climb may spend per template, and
# the schedule steps (2 (M + S) per evaluation, ~20 us each) it may spend.
_POLISH_EVALUATIONS = 200
_POLISH_MIN_EVALUATIONS = 4
_POLISH_STEPS = 4_000


def map_stages(
    profile: ModelProfile, cluster: ClusterSpec, num_nodes: int, microbatches_hint: int | None = None
) -> PipelineTemplate | None:
    """The best mapping of ``profile`` onto ``num_nodes`` nodes, or None if none fits.

    Without ``microbatches_hint``: the lexicographic optimum (module docstring).
    With it: tuned on the exact 1F1B time for that many microbatches when they
    are few per stage (module docstring, "Tuning for a microbatch count").
    Memory assumes at least ``S`` microbatches.
    """
    _check_positive("num_nodes", num_nodes)
    _check_hint(microbatches_hint)
    planner = _Planner(profile, cluster)
    if num_nodes > planner.max_nodes_by_layers:
        return None
    return planner.template(num_nodes, microbatches_hint)


def recut_for_speeds(
    profile: ModelProfile, cluster: ClusterSpec, template: PipelineTemplate, factors: Sequence[float], microbatches: int
) -> PipelineTemplate:
    """``template``'s stages on the same nodes and GPUs, their layer boundaries moved for the stages' speeds
    (``factors[k]``: stage k runs that many times slower than the cost model says): fewer layers on a slow
    node's stage, more on the others. The min-max of each stage's slowed time (its memory with 1F1B's
    in-flight activations still fitting), then a hill-climb on the exact slowed 1F1B time of
    ``microbatches``. The template returned prices its stages at the cost model's speed, as every template
    does (``planning.speed.slowed_template`` applies the factors). Where no other cut fits or is faster,
    ``template`` itself."""
    if len(factors) != template.num_stages:
        raise ValueError(f"{len(factors)} factors for a template of {template.num_stages} stages")
    planner = _Planner(profile, cluster)
    tables = planner.tables
    L, S = tables.num_layers, template.num_stages
    stages = template.stages
    shape = [(st.node, st.gpus[0], len(st.gpus)) for st in stages]
    best_next = np.full(L + 1, np.inf)
    best_next[L] = 0.0
    choices: list[np.ndarray] = []
    for k in range(S - 1, -1, -1):
        node, _, d = shape[k]
        after = sum(g for _, _, g in shape[k + 1 :])
        kind = _LAST if k == S - 1 else (_CROSS if shape[k + 1][0] != node else _INTRA)
        incoming = tables.incoming[_CROSS if k > 0 and shape[k - 1][0] != node else _INTRA]
        cost = (tables.masked_time(d, kind, after) + incoming[:, None]) * factors[k]
        candidates = np.maximum(cost, best_next[None, :])
        ends = np.argmin(candidates, axis=1)
        best_next = candidates[np.arange(L + 1), ends]
        choices.append(ends)
    choices.reverse()
    if not math.isfinite(best_next[0]):
        return template
    cuts, w = [], 0
    for k, (node, first_gpu, d) in enumerate(shape):
        end = int(choices[k][w])
        cuts.append((w, end, node, first_gpu, d))
        w = end
    assert w == L, (w, cuts)

    def slowed_time(candidate: PipelineTemplate) -> float:
        slowed = tuple(
            dataclasses.replace(st, forward_s=st.forward_s * f, backward_s=st.backward_s * f)
            for st, f in zip(candidate.stages, factors)
        )
        return dataclasses.replace(candidate, stages=slowed).iteration_time(microbatches)

    candidate = planner._assemble(template.num_nodes, cuts)
    time = slowed_time(candidate)
    improved, budget = True, _POLISH_EVALUATIONS
    while improved and budget > 0:  # the min-max is position-blind; the exact time is not (``_polish``)
        improved = False
        for k in range(S - 1):
            for shift in (-1, 1):
                moved = _shift_boundary(cuts, k, shift)
                if moved is None or budget <= 0:
                    continue
                other = planner._assemble(template.num_nodes, moved)
                if any(st.memory_bytes > tables.usable for st in other.stages):
                    continue
                budget -= 1
                other_time = slowed_time(other)
                if other_time < time * (1 - 1e-9):
                    cuts, candidate, time, improved = moved, other, other_time, True
    return candidate if time < slowed_time(template) * (1 - 1e-9) else template


def min_nodes(profile: ModelProfile, cluster: ClusterSpec) -> int:
    """n0: the fewest nodes on which a memory-feasible mapping exists (ValueError when none does)."""
    return _Planner(profile, cluster).min_nodes()


def resolve_context_parallel(profile: ModelProfile, cluster: ClusterSpec, num_nodes: int, f: int) -> ClusterSpec:
    """``cluster`` with ``context_parallel: auto`` (``AUTO_CONTEXT_PARALLEL``) made a degree: the smallest of
    1, 2, 4, 8 (dividing a node's GPUs) for which templates can be built on ``num_nodes`` nodes with ``f``
    (``build_templates``' own conditions: a mapping fits memory, ``f + 1`` replicas fit, the node counts
    covered); a ``UserError`` naming the field when none does. A function of the config and the profile
    alone (the job's declared ``cluster.nodes``, not the live count), so every planning call of a job
    resolves it alike. Any other ``cluster`` as it is."""
    if cluster.context_parallel != AUTO_CONTEXT_PARALLEL:
        return cluster
    tried = []
    for d in (1, 2, 4, 8):
        if d > cluster.gpus_per_node or cluster.gpus_per_node % d:
            continue
        candidate = dataclasses.replace(cluster, context_parallel=d)
        try:
            _node_counts(_Planner(profile, candidate), profile, candidate, num_nodes, f)
        except UserError as exc:
            tried.append(f"{d}: {exc}")
            continue
        return candidate
    raise UserError(
        f"cluster.context_parallel: auto found no degree at which the model fits {num_nodes} nodes with f = {f}; "
        + "; ".join(tried)
    )


def planning_cluster(job, profile: ModelProfile) -> ClusterSpec:
    """The job's ``ClusterSpec`` for planning, ``context_parallel: auto`` resolved (``resolve_context_parallel``)
    and ``planning.placement`` carried."""
    resolved = resolve_context_parallel(
        profile, ClusterSpec.from_config(job.cluster), job.cluster.nodes, job.fault_tolerance.f
    )
    return dataclasses.replace(resolved, placement=job.planning.placement)


def build_templates(
    profile: ModelProfile,
    cluster: ClusterSpec,
    num_nodes: int,
    fault_tolerance: int,
    microbatches_hint: int | None = None,
    progress: Callable[[str], None] | None = None,
    total_microbatches: int | None = None,
) -> TemplateSet:
    """Templates for every node count ``n0 .. min(N - f n0, largest mappable)`` (§2.4.1.1).

    "Largest mappable" is the last count of the consecutive run from ``n0`` for
    which a memory-feasible mapping exists (a pipeline needs at least one layer
    per stage; memory is not always monotone in the node count because more
    stages keep more microbatches in flight on the first ones).

    Each template is tuned (see ``map_stages``) for ``microbatches_hint``
    microbatches when given, else, when ``total_microbatches`` (global batch /
    microbatch size) is given, for the share an ``n``-node pipeline gets when
    all ``num_nodes`` nodes train: ``round(total * n / num_nodes)``.
    """
    _check_positive("num_nodes", num_nodes)
    if fault_tolerance < 0:
        raise ValueError(f"fault_tolerance must be >= 0, got {fault_tolerance}")
    _check_hint(microbatches_hint)
    planner = _Planner(profile, cluster)
    n0, n_max = _node_counts(planner, profile, cluster, num_nodes, fault_tolerance)
    templates = []
    for n in range(n0, n_max + 1):
        hint = microbatches_hint
        if hint is None and total_microbatches is not None:
            hint = max(1, round(total_microbatches * n / num_nodes))
        template = planner.template(n, hint)
        assert template is not None, n  # last_feasible_from checked pass 1
        templates.append(template)
        if progress is not None:
            progress(_describe(template))
    return TemplateSet(min_nodes=n0, templates=tuple(templates))


def _node_counts(planner: _Planner, profile, cluster, num_nodes: int, f: int) -> tuple[int, int]:
    """The node counts ``n0 .. n_max`` templates are built for, or the ``UserError`` that says why none can."""
    n0 = planner.min_nodes()
    if num_nodes < (f + 1) * n0:
        raise TooFewNodes(
            f"num_nodes ({num_nodes}) < (fault_tolerance ({f}) + 1) x min_nodes ({n0}) = {(f + 1) * n0}: "
            f"{f + 1} replica(s) of model {profile.model_name!r} need at least {(f + 1) * n0} nodes; "
            f"use cluster.nodes >= {(f + 1) * n0}" + _or_fault_tolerance(num_nodes // n0 - 1),
            live_nodes=num_nodes,
            needed=(f + 1) * n0,
        )
    budget_max = num_nodes - f * n0
    n_max = planner.last_feasible_from(n0, budget_max)
    _check_coverage(profile, cluster, num_nodes, f, n0, budget_max, n_max, planner.max_nodes_by_layers)
    return n0, n_max


def _check_positive(name: str, value: int) -> None:
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")


def _check_hint(microbatches_hint: int | None) -> None:
    if microbatches_hint is not None and microbatches_hint < 1:
        raise ValueError(f"microbatches_hint must be >= 1 or None, got {microbatches_hint}")


def _check_coverage(profile, cluster, num_nodes, f, n0, budget_max, n_max, layer_max) -> None:
    """Frobenius condition (§2.4.1.1, appendix A.1): p > n0 - 1 consecutive node counts."""
    p = n_max - n0 + 1
    if p >= n0:
        return
    if n_max == budget_max:
        fix = (
            f"N - f n0 must reach 2 n0 - 1 = {2 * n0 - 1}: use cluster.nodes >= {(f + 2) * n0 - 1}"
            + _or_fault_tolerance((num_nodes - 2 * n0 + 1) // n0)
        )
    elif n_max == layer_max:
        fix = (
            f"the model's {profile.num_layers} layers fill at most {layer_max} nodes of "
            f"{cluster.gpus_per_node} GPUs with max_gpus_per_stage={cluster.max_gpus_per_stage}; "
            f"raise max_gpus_per_stage so fewer stages fill a node"
        )
    else:
        fix = f"no memory-feasible mapping exists on {n_max + 1} nodes; more device memory would help"
    raise InfeasiblePlan(
        f"templates for {n0}..{n_max} nodes give p = {p} node counts, but covering every node count "
        f">= (f + 1) n0 = {(f + 1) * n0} needs p > n0 - 1, i.e. at least n0 = {n0} consecutive counts: {fix}"
    )


def _or_fault_tolerance(largest: int) -> str:
    return f" or fault_tolerance.f <= {largest}" if largest >= 0 else ""


def _describe(template: PipelineTemplate) -> str:
    costs = _stage_objective(template)
    recomputing = sum(s.recompute for s in template.stages)
    return (
        f"template {template.num_nodes} nodes: {template.num_stages} stages, "
        f"bottleneck {max(costs):.4g} s, sum {sum(costs):.4g} s"
        + (f", {recomputing} recomputing activations" if recomputing else "")
    )


def _stage_objective(template: PipelineTemplate) -> list[float]:
    """c_k = F_k + B_k + the transfers of both of stage k's boundaries (module docstring)."""
    sends = [a + g for a, g in zip(template.send_activation_s, template.send_grad_s)]
    incoming, outgoing = [0.0] + sends, sends + [0.0]
    return [s.forward_s + s.backward_s + i + o for s, i, o in zip(template.stages, incoming, outgoing)]


def _min_stages_per_node(gpus_per_node: int, options: tuple[int, ...]) -> int:
    """Fewest stages whose GPU counts (from ``options``) add up to one node."""
    best = [0] + [math.inf] * gpus_per_node
    for x in range(1, gpus_per_node + 1):
        best[x] = 1 + min((best[x - d] for d in options if d <= x), default=math.inf)
    return int(best[gpus_per_node])


class _Planner:
    """Cost tables and the shared pass-1 (min-max) chain of one (profile, cluster)."""

    def __init__(self, profile: ModelProfile, cluster: ClusterSpec):
        self.profile = profile
        self.cluster = cluster
        self.tables = _CostTables(profile, cluster)
        stages_per_node = _min_stages_per_node(cluster.gpus_per_node, self.tables.options)
        self.max_nodes_by_layers = profile.num_layers // stages_per_node
        self.bottleneck_chain = _SuffixChain(self.tables, self._feasible_time, np.maximum, keep_argmin=False)

    def _feasible_time(self, d: int, kind: int, gpus_after: int) -> np.ndarray:
        return self.tables.masked_time(d, kind, gpus_after)

    def bottleneck(self, num_nodes: int) -> float:
        return self.bottleneck_chain.best(num_nodes)

    def min_nodes(self) -> int:
        if self.max_nodes_by_layers == 0:  # not a memory question: a node's GPUs need more stages than layers
            c = self.cluster
            stages = _min_stages_per_node(c.gpus_per_node, self.tables.options)
            raise InfeasiblePlan(
                f"model {self.profile.model_name!r} has {self.profile.num_layers} layers, but a node of "
                f"cluster.gpus_per_node={c.gpus_per_node} GPUs needs at least {stages} stages of at least one layer "
                f"each (cluster.max_gpus_per_stage={c.max_gpus_per_stage}); use fewer GPUs per node or raise "
                "cluster.max_gpus_per_stage"
            )
        for n in range(1, self.max_nodes_by_layers + 1):
            if math.isfinite(self.bottleneck(n)):
                return n
        raise InfeasiblePlan(self._does_not_fit_message())

    def last_feasible_from(self, first: int, limit: int) -> int:
        n = first
        while n < min(limit, self.max_nodes_by_layers) and math.isfinite(self.bottleneck(n + 1)):
            n += 1
        return n

    def template(self, num_nodes: int, microbatches: int | None = None) -> PipelineTemplate | None:
        bound = self.bottleneck(num_nodes)
        if not math.isfinite(bound):
            return None
        cuts = self._min_sum_cuts(num_nodes, bound)
        template = self._assemble(num_nodes, cuts)
        if microbatches is None:
            return template
        if microbatches >= _TRANSIENT_RATIO * template.num_stages or template.num_stages > _TUNE_MAX_STAGES:
            # Many microbatches per stage: the period (the bottleneck) dominates;
            # the lexicographic optimum is within 0.1% of the exact optimum on
            # average (scripts/stage_mapping_gap.py, docs/planning.md).
            return template
        # Few: fill and drain matter, so a looser bottleneck with a shorter
        # fill may win, and so may moving a layer off the first or last stage.
        time = template.iteration_time(microbatches)
        for relax in _CAP_RELAXATIONS:
            other = self._min_sum_cuts(num_nodes, bound * (1 + relax))
            if other == cuts:
                continue
            candidate = self._assemble(num_nodes, other)
            candidate_time = candidate.iteration_time(microbatches)
            if candidate_time < time * (1 - 1e-12):  # ties keep the tighter bottleneck
                cuts, template, time = other, candidate, candidate_time
        return self._polish(num_nodes, cuts, template, time, microbatches)

    def _min_sum_cuts(self, num_nodes: int, cap: float) -> list[tuple[int, int, int, int, int]]:
        """Pass 2: the min-sum mapping among those whose every stage costs <= ``cap``."""
        threshold = cap * (1 + _BOTTLENECK_SLACK)
        chain = _SuffixChain(self.tables, self._feasible_time, np.add, keep_argmin=True, cap=threshold)
        chain.extend_to(num_nodes * self.cluster.gpus_per_node)
        return chain.stages(num_nodes)

    def _polish(self, num_nodes, cuts, template, time, microbatches) -> PipelineTemplate:
        """Hill-climbs on the exact 1F1B time by moving one layer across one stage boundary.

        The DP's objective is position-blind, but with few microbatches the
        exact time is not (a heavy first stage delays every forward, a heavy
        last stage every backward). Moves keep each stage's GPUs and >= 1
        layer, and the exact in-flight memory; the evaluation budget keeps
        this a small fraction of planning time on big templates.
        """
        # An evaluation sweeps 2 (M + S) schedule steps; cap the steps, not just the count.
        steps = 2 * (microbatches + template.num_stages)
        budget = min(_POLISH_EVALUATIONS, max(_POLISH_MIN_EVALUATIONS, _POLISH_STEPS // steps))
        improved = True
        while improved and budget > 0:
            improved = False
            for k in range(len(cuts) - 1):
                for shift in (-1, 1):
                    moved = _shift_boundary(cuts, k, shift)
                    if moved is None or budget <= 0:
                        continue
                    candidate = self._assemble(num_nodes, moved)
                    if any(s.memory_bytes > self.tables.usable for s in candidate.stages):
                        continue
                    budget -= 1
                    candidate_time = candidate.iteration_time(microbatches)
                    if candidate_time < time * (1 - 1e-9):
                        cuts, template, time, improved = moved, candidate, candidate_time, True
        return template

    def _assemble(self, num_nodes: int, cuts: list[tuple[int, int, int, int, int]]) -> PipelineTemplate:
        """Turns DP cuts into StageSpecs with costs straight from ``stage_cost``, each stage recomputing only
        when its activations would not fit otherwise (``_CostTables.stage``)."""
        num_stages = len(cuts)
        stages, sends = [], []
        for k, (start, end, node, first_gpu, d) in enumerate(cuts):
            in_flight = num_stages - k  # exact 1F1B in-flight count
            cost, recompute = self.tables.stage(start, end, d, in_flight)
            stages.append(
                StageSpec(
                    layer_start=start,
                    layer_end=end,
                    node=node,
                    gpus=tuple(range(first_gpu, first_gpu + d)),
                    forward_s=cost.forward_s,
                    backward_s=cost.backward_s,
                    memory_bytes=cost.memory_bytes(in_flight),
                    grad_bytes=cost.grad_bytes,
                    recompute=recompute,
                    context_parallel=d > 1 and self.cluster.context_parallel > 1,
                )
            )
            if k + 1 < num_stages:
                sends.append(self.cluster.transfer_s(cost.output_bytes, cross_node=cuts[k + 1][2] != node))
        return PipelineTemplate(
            num_nodes=num_nodes,
            gpus_per_node=self.cluster.gpus_per_node,
            stages=tuple(stages),
            send_activation_s=tuple(sends),
            send_grad_s=tuple(sends),  # the activation's gradient has the activation's size
        )

    def _does_not_fit_message(self) -> str:
        """Why no node count fits: the smallest worst-stage memory any mapping reaches."""
        tables = self.tables
        chain = _SuffixChain(
            tables, lambda d, kind, after: tables.memory(d, after), np.maximum, keep_argmin=False, add_incoming=False
        )
        n_max = self.max_nodes_by_layers
        worst = min((chain.best(n) for n in range(1, n_max + 1)), default=math.inf)
        c = self.cluster
        return (
            f"model {self.profile.model_name!r} does not fit: even the best mapping on 1..{n_max} nodes "
            f"of {c.gpus_per_node} GPUs (cluster.max_gpus_per_stage={c.max_gpus_per_stage}, 1F1B in-flight "
            f"activations counted) needs {worst / _GiB:.3f} GiB ({worst:.0f} bytes) on its worst stage, "
            f"but a GPU offers {c.usable_memory_bytes / _GiB:.3f} GiB (cluster.device_memory "
            f"{c.device_memory_bytes} bytes x cluster.memory_headroom {c.memory_headroom})"
        )
