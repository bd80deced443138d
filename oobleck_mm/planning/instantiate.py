"""Pipeline instantiation (§2.4.2): how many pipelines of each template, on which nodes.

``instantiate`` turns a template set and the live nodes into a ``Plan``: it
picks ``x_j``, the number of pipelines of template ``j`` (all nodes used, at
least ``f + 1`` pipelines), places them on the nodes, and splits the batch.

The seed enumerates every feasible ``X`` with a coin-change DP (eq. 2.5) and
scores each one with the batch solver; the number of ``X`` grows exponentially
with the node count. ``best_template_counts`` instead searches the optimal
iteration time directly: for a time ``T`` a pipeline of template ``j`` can run
at most ``cap_j(T)`` microbatches, so ``T`` is achievable iff some ``X`` covers
the nodes exactly with enough pipelines and ``sum_j x_j cap_j(T)`` reaches the
total microbatch count, which one knapsack DP over node counts decides. The
predicate is monotone in ``T``, so ``batch.min_feasible_time`` finds the
smallest achievable ``T`` in a logarithmic number of DPs.
``enumerate_template_counts`` keeps the seed's DP as the tests' brute force.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence

import numpy as np

from oobleck_mm.planning.batch import min_feasible_time, split_batch, time_table, total_microbatches
from oobleck_mm.planning.costs import ClusterSpec
from oobleck_mm.planning.errors import InfeasiblePlan, TooFewNodes
from oobleck_mm.planning.plan import Plan, PipelineInstance, gradient_allreduce_s
from oobleck_mm.planning.template import PipelineTemplate, TemplateSet

logger = logging.getLogger(__name__)

_NONE = -1
"""Capacity-table entry for "no combination reaches this state"; real entries are >= 0."""


def instantiate(
    template_set: TemplateSet,
    node_names: Sequence[str],
    fault_tolerance: int,
    global_batch: int,
    microbatch_size: int,
    cluster: ClusterSpec,
    solver: str = "highs",
) -> Plan:
    """The plan for ``node_names`` (all used, in the given order): pipelines, batch split, all-reduce time.

    Larger templates take the first nodes. Raises ``TooFewNodes`` when there are
    fewer than ``(f + 1) n0`` nodes and ``BatchSplitError`` when the global
    batch cannot give every pipeline of any feasible combination a microbatch.
    """
    num_nodes = len(node_names)
    f = fault_tolerance
    n0 = template_set.min_nodes
    if f < 0:
        raise ValueError(f"fault_tolerance must be >= 0, got {f}")
    if len(set(node_names)) != num_nodes:
        duplicates = sorted(n for n, c in Counter(node_names).items() if c > 1)
        raise ValueError(f"node_names must be distinct, got duplicates {duplicates}")
    if num_nodes < (f + 1) * n0:
        raise TooFewNodes(
            f"{num_nodes} nodes cannot hold fault_tolerance + 1 = {f + 1} pipelines of at least "
            f"min_nodes = {n0} nodes: need at least {(f + 1) * n0} nodes",
            live_nodes=num_nodes,
            needed=(f + 1) * n0,
        )
    # Every combination has at least this many pipelines; each needs a microbatch.
    fewest = max(f + 1, -(-num_nodes // template_set.max_nodes))
    total = total_microbatches(global_batch, microbatch_size, fewest)
    counts = best_template_counts(template_set, num_nodes, f, total)
    templates = pipeline_templates(template_set, counts)
    split = split_batch(templates, global_batch, microbatch_size, solver=solver)
    logger.info("batch split %s: %s", split.microbatches, split.reason)
    pipelines, start = [], 0
    for template, q in zip(templates, split.microbatches):
        pipelines.append(PipelineInstance(template, tuple(node_names[start : start + template.num_nodes]), q))
        start += template.num_nodes
    assert start == num_nodes, (start, num_nodes)
    return Plan(
        pipelines=tuple(pipelines),
        global_batch=global_batch,
        microbatch_size=microbatch_size,
        allreduce_s=gradient_allreduce_s(templates, cluster),
    )


def best_template_counts(
    template_set: TemplateSet, num_nodes: int, fault_tolerance: int, total_microbatches: int
) -> tuple[int, ...]:
    """``x_j`` per template minimising the min-max iteration time of the best batch split.

    Constraints: ``sum x_j n_j == num_nodes``, ``f + 1 <= sum x_j <= total_microbatches``.
    Among combinations with the optimal time it returns one with the fewest
    pipelines (the end-of-iteration all-reduce runs over fewer replicas), and
    among those one whose heaviest stage is lightest: ``gradient_allreduce_s`` is
    bounded by the slowest stage, so the templates used matter, not only their
    number (a property test found a plan 0.0075% slower than the best by picking
    4+5+5+9-node pipelines over 5+5+5+8). Not searched: more pipelines of still
    lighter stages, which could all-reduce faster in rare cases.
    """
    f, total = fault_tolerance, total_microbatches
    if f < 0:
        raise ValueError(f"fault_tolerance must be >= 0, got {f}")
    if total < 1:
        raise ValueError(f"total_microbatches must be >= 1, got {total}")
    sizes = np.array(template_set.node_counts, dtype=np.int64)
    most = min(total, num_nodes // template_set.min_nodes)  # more pipelines than this cannot all work
    widest = -(-num_nodes // most) if most else num_nodes + 1  # even split over `most` pipelines
    if most < f + 1 or widest > template_set.max_nodes:
        raise InfeasiblePlan(
            f"no combination of templates with {template_set.min_nodes}..{template_set.max_nodes} nodes "
            f"covers {num_nodes} nodes with between fault_tolerance + 1 = {f + 1} and "
            f"min(total_microbatches, {num_nodes} // {template_set.min_nodes}) = {most} pipelines"
        )
    tables = [time_table(t) for t in template_set.templates]
    limit = total - f  # with >= f + 1 pipelines of >= 1 microbatch, none runs more

    def caps_at(time_s: float) -> np.ndarray:
        return np.array([t.capacity(time_s, limit) for t in tables], dtype=np.int64)

    # When the batch cannot bound the pipeline count, counts >= f + 1 share one bucket.
    bounded = most < num_nodes // template_set.min_nodes
    num_counts, saturate = (most + 1, False) if bounded else (f + 2, True)

    def feasible(time_s: float) -> bool:
        table = _capacity_table(caps_at(time_s), sizes, num_nodes, num_counts, saturate)
        return int(table[num_nodes, f + 1 :].max()) >= total

    # `most` pipelines of floor/ceil(N / most) nodes with floor/ceil(total / most) microbatches each.
    even = -(-total // most)
    # From the tables themselves: min_feasible_time needs `upper` to be one of their values.
    upper = max(time_table(template_set.for_nodes(n))(even) for n in {num_nodes // most, widest})
    best = min_feasible_time(tables, limit, upper, feasible)

    caps = caps_at(best)
    table = _capacity_table(caps, sizes, num_nodes, most + 1, saturate=False)
    count = next(k for k in range(f + 1, most + 1) if table[num_nodes, k] >= total)
    light = _without_heavy_templates(template_set, caps, sizes, num_nodes, count, total)
    return _backtrack(
        _capacity_table(light, sizes, num_nodes, count + 1, saturate=False), light, sizes, num_nodes, count
    )


def _without_heavy_templates(
    template_set: TemplateSet, caps: np.ndarray, sizes: np.ndarray, num_nodes: int, count: int, total: int
) -> np.ndarray:
    """``caps`` with as many of the templates of heaviest stage left out (capacity 0) as ``count`` pipelines of
    the rest allow to still take ``total`` microbatches. Leaving out more only lowers capacity, so the deepest
    level that works is found by bisection: a few capacity tables, not one per template."""
    worst = [max(s.grad_bytes for s in t.stages) for t in template_set.templates]
    heavy_first = sorted((j for j in range(len(caps)) if caps[j] >= 1), key=lambda j: -worst[j])

    def without(level: int) -> np.ndarray:
        out = caps.copy()
        out[heavy_first[:level]] = 0
        return out

    def works(level: int) -> bool:
        return bool(
            _capacity_table(without(level), sizes, num_nodes, count + 1, saturate=False)[num_nodes, count] >= total
        )

    low, high = 0, len(heavy_first) - 1  # level 0 works (the caller checked); all left out cannot
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if works(mid) else (low, mid - 1)
    return without(low)


def _capacity_table(caps: np.ndarray, sizes: np.ndarray, num_nodes: int, num_counts: int, saturate: bool) -> np.ndarray:
    """``table[n, k]``: most microbatches ``k`` pipelines covering exactly ``n`` nodes can take.

    Unbounded knapsack over node counts; only templates with ``caps >= 1`` may
    be used (every pipeline must get a microbatch). With ``saturate`` the last
    column means "``num_counts - 1`` pipelines or more"; otherwise larger
    counts are dropped. ``_NONE`` marks unreachable states. ``sizes`` ascend.
    """
    usable = caps >= 1
    sizes, caps = sizes[usable], caps[usable]
    table = np.full((num_nodes + 1, num_counts), _NONE, dtype=np.int64)
    table[0, 0] = 0
    for n in range(1, num_nodes + 1):
        fit = int(np.searchsorted(sizes, n, side="right"))
        if fit == 0:
            continue
        before = table[n - sizes[:fit]]
        best = np.where(before >= 0, before + caps[:fit, None], _NONE).max(axis=0)
        table[n, 1:] = best[:-1]
        if saturate:
            table[n, -1] = max(best[-2], best[-1])
    return table


def _backtrack(table: np.ndarray, caps: np.ndarray, sizes: np.ndarray, num_nodes: int, count: int) -> tuple[int, ...]:
    """Template counts of one combination achieving ``table[num_nodes, count]`` (exact-count table)."""
    x = [0] * len(sizes)
    n, k = num_nodes, count
    while n > 0:
        for j in reversed(range(len(sizes))):
            rest = n - int(sizes[j])
            if caps[j] >= 1 and rest >= 0 and table[rest, k - 1] >= 0 and table[rest, k - 1] + caps[j] == table[n, k]:
                x[j] += 1
                n, k = rest, k - 1
                break
        else:
            raise AssertionError(f"capacity table has no predecessor for ({n}, {k})")
    assert k == 0, k
    return tuple(x)


def enumerate_template_counts(template_set: TemplateSet, num_nodes: int, fault_tolerance: int) -> list[tuple[int, ...]]:
    """Every feasible ``X`` (all nodes used, >= f + 1 pipelines) by the seed's coin-change DP, eq. 2.5.

    ``X(p', N') = X(p' - 1, N') ++ theta(X(p', N' - n_p'), p')``, kept as one
    row over ``N'`` that is updated template by template. Exponential output;
    the tests' brute force, not used by the planner.
    """
    sizes = template_set.node_counts
    rows: list[list[tuple[int, ...]]] = [[] for _ in range(num_nodes + 1)]
    rows[0] = [(0,) * len(sizes)]
    for j, size in enumerate(sizes):
        for n in range(size, num_nodes + 1):
            rows[n] = rows[n] + [x[:j] + (x[j] + 1,) + x[j + 1 :] for x in rows[n - size]]
    return [x for x in rows[num_nodes] if sum(x) >= fault_tolerance + 1]


def pipeline_templates(template_set: TemplateSet, counts: Sequence[int]) -> list[PipelineTemplate]:
    """One template per pipeline for template counts ``counts``, larger templates first."""
    return [t for t, x in reversed(list(zip(template_set.templates, counts))) for _ in range(x)]
