"""Batch distribution: how many microbatches each pipeline runs (§2.4.2.2, §2.5.2).

Given the pipelines of a plan, the global batch ``B`` and the microbatch size
``b``, choose ``q_i >= 1`` microbatches per pipeline with ``sum q_i * b == B``
so that the predicted iteration time ``T = max_i T_i(q_i)`` is as small as
possible, where ``T_i`` is the pipeline's exact 1F1B time
(``PipelineTemplate.iteration_time``, non-decreasing in ``q``).

Three solvers produce the same kind of answer (a ``BatchSplit``):

* ``min_max_split`` (pure Python, ``solver="python"``): exact threshold search.
  For a candidate time ``T``, template ``j`` can take at most
  ``cap_j(T) = max{q : T_j(q) <= T}`` microbatches per pipeline, and ``T`` is
  achievable iff every pipeline can take one and the capacities add up to the
  total. That predicate is monotone in ``T`` and the optimum is one of the
  values ``T_j(q)``, so ``min_feasible_time`` searches those values (without
  listing them) with a weighted-median bisection.
* ``"highs"`` (default): an exact MILP in Pyomo solved by HiGHS, which adds a
  secondary objective (less idle time) among splits with the optimal ``T``.
* ``"mindtpy"``: the seed's eq. 2.6 (minimise the variance of the linear
  estimate ``N_i T_i(1)``) solved by MindtPy OA; reported with the exact time
  of what it found, which may be worse than the optimum.

Pipelines built from the same template are interchangeable, so every solver
works per distinct template: ``M_j`` microbatches for the ``x_j`` pipelines of
template ``j``, split floor/ceil among them. Balancing identical pipelines
never raises their maximum, so this loses nothing for the min-max objective.
"""

from __future__ import annotations

import heapq
import io
import logging
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from oobleck_mm.errors import UserError
from oobleck_mm.planning.template import PipelineTemplate, TimeTable, time_table  # noqa: F401 (re-exported)

logger = logging.getLogger(__name__)

SOLVERS = ("highs", "mindtpy", "python")


class BatchSplitError(UserError):
    """The global batch cannot be split: not a multiple of ``b``, or fewer microbatches than pipelines."""

    def __init__(self, message: str, nearest_global_batches: tuple[int, ...]):
        super().__init__(message)
        self.nearest_global_batches = nearest_global_batches
        """Valid global batches nearest to the requested one: the one below (if any), then the one above."""


@dataclass(frozen=True, slots=True)
class BatchSplit:
    microbatches: tuple[int, ...]
    """Microbatches per pipeline, in the order the pipelines were given."""
    iteration_time_s: float
    """Exact predicted iteration time: max over pipelines of ``iteration_time(q_i)`` (no all-reduce)."""
    solver: str
    reason: str
    """One line on how the split was found (solver status, objective)."""


# ---------------------------------------------------------------------------
# Exact threshold search


def min_feasible_time(
    tables: Sequence[TimeTable], limit: int, upper: float, feasible: Callable[[float], bool]
) -> float:
    """Smallest value ``T_j(q)`` (any table, ``1 <= q <= limit``) for which ``feasible`` holds.

    ``feasible`` must be monotone in the time and ``feasible(upper)`` must hold
    with ``upper`` one of those values. Keeps, per table, the interval of ``q``
    whose times lie strictly between the largest known-infeasible time and
    ``upper``, and tests the weighted median of the intervals' midpoints: each
    test removes at least a quarter of the remaining candidates, so it takes
    ``O(log(#candidates))`` calls of ``feasible`` and never lists the candidates.
    """
    below = [0] * len(tables)  # q <= below[j]: T_j(q) is infeasible (or q unused)
    under = [t.capacity(upper, limit, strict=True) for t in tables]  # q <= under[j]: T_j(q) < upper
    while True:
        open_ = [j for j in range(len(tables)) if under[j] > below[j]]
        if not open_:
            return upper
        mids = sorted((tables[j](below[j] + (under[j] - below[j] + 1) // 2), j) for j in open_)
        half = sum(under[j] - below[j] for j in open_) / 2
        weight = 0
        for probe, j in mids:
            weight += under[j] - below[j]
            if weight >= half:
                break
        if feasible(probe):
            upper = probe
            under = [t.capacity(probe, under[j], below[j], strict=True) for j, t in enumerate(tables)]
        else:
            below = [t.capacity(probe, under[j], below[j]) for j, t in enumerate(tables)]


def _groups(templates: Sequence[PipelineTemplate]) -> list[tuple[PipelineTemplate, list[int]]]:
    """Distinct templates in first-seen order, each with the indices of its pipelines."""
    index: dict[PipelineTemplate, list[int]] = {}
    for i, t in enumerate(templates):
        index.setdefault(t, []).append(i)
    return list(index.items())


def _expand(groups: list[tuple[PipelineTemplate, list[int]]], totals: Sequence[int]) -> tuple[int, ...]:
    """Per-pipeline microbatches: template j's ``totals[j]`` split floor/ceil, ceilings first."""
    out = [0] * sum(len(ids) for _, ids in groups)
    for (_, ids), total in zip(groups, totals):
        base, extra = divmod(total, len(ids))
        for k, i in enumerate(ids):
            out[i] = base + (1 if k < extra else 0)
    return tuple(out)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _optimal_time(tables: list[TimeTable], counts: list[int], total: int) -> float:
    """Min over splits of ``total`` (>= 1 each, ``counts[j]`` pipelines of table j) of the max time."""
    limit = total - sum(counts) + 1

    def feasible(time_s: float) -> bool:
        caps = [t.capacity(time_s, limit) for t in tables]
        return min(caps) >= 1 and sum(c * x for c, x in zip(caps, counts)) >= total

    # An even split (floor/ceil of total/P for every pipeline) is feasible; its max is a candidate.
    even = _ceil_div(total, sum(counts))
    upper = max(t(even) for t in tables)
    return min_feasible_time(tables, limit, upper, feasible)


def _trim_to_total(tables: list[TimeTable], counts: list[int], caps: list[int], total: int) -> list[int]:
    """Template totals ``M_j <= counts[j] * caps[j]`` summing to ``total``.

    Starts from full capacity and removes the excess from the template whose
    per-pipeline ceiling is slowest, one ceiling level at a time (reverse
    water-filling): the maximum stays optimal and fewer pipelines sit at it,
    so the others idle less while waiting for the all-reduce.
    """
    totals = [x * c for x, c in zip(counts, caps)]
    excess = sum(totals) - total
    heap = [(-t(c), j) for j, (t, c) in enumerate(zip(tables, caps)) if c > 1]
    heapq.heapify(heap)
    while excess > 0:
        _, j = heapq.heappop(heap)
        ceiling = _ceil_div(totals[j], counts[j])
        take = min(excess, totals[j] - counts[j] * (ceiling - 1))
        totals[j] -= take
        excess -= take
        if ceiling - 1 > 1:
            heapq.heappush(heap, (-tables[j](ceiling - 1), j))
    return totals


def min_max_split(templates: Sequence[PipelineTemplate], total_microbatches: int) -> tuple[int, ...]:
    """Microbatches per pipeline (>= 1, summing to ``total_microbatches``) minimising the max iteration time.

    Exact (threshold search, see the module docstring). Among optimal splits it
    returns the reverse water-filled one of ``_trim_to_total``.
    """
    if not templates:
        raise ValueError("templates must hold at least one pipeline, got none")
    if total_microbatches < len(templates):
        raise ValueError(
            f"total_microbatches ({total_microbatches}) must be >= the number of pipelines ({len(templates)})"
        )
    groups = _groups(templates)
    tables = [time_table(t) for t, _ in groups]
    counts = [len(ids) for _, ids in groups]
    best = _optimal_time(tables, counts, total_microbatches)
    limit = total_microbatches - len(templates) + 1
    caps = [t.capacity(best, limit) for t in tables]
    return _expand(groups, _trim_to_total(tables, counts, caps, total_microbatches))


# ---------------------------------------------------------------------------
# split_batch: validation and the solvers


def nearest_global_batches(global_batch: int, microbatch_size: int, num_pipelines: int) -> tuple[int, ...]:
    """Valid global batches (multiples of ``b``, >= ``num_pipelines * b``) just below and above ``global_batch``."""
    b = microbatch_size
    smallest = num_pipelines * b
    below = (_ceil_div(global_batch, b) - 1) * b  # largest multiple of b strictly below
    above = max(smallest, (global_batch // b + 1) * b)  # smallest valid strictly above
    return ((below,) if below >= smallest else ()) + (above,)


def total_microbatches(global_batch: int, microbatch_size: int, num_pipelines: int) -> int:
    """``global_batch / microbatch_size``; ``BatchSplitError`` when that is not an integer >= ``num_pipelines``."""
    if microbatch_size < 1:
        raise ValueError(f"microbatch_size must be >= 1, got {microbatch_size}")
    if global_batch < 1:
        raise ValueError(f"global_batch must be >= 1, got {global_batch}")
    if num_pipelines < 1:
        raise ValueError(f"need at least one pipeline to split a batch over, got {num_pipelines}")
    if global_batch % microbatch_size == 0 and global_batch // microbatch_size >= num_pipelines:
        return global_batch // microbatch_size
    nearest = nearest_global_batches(global_batch, microbatch_size, num_pipelines)
    raise BatchSplitError(
        f"global batch {global_batch} cannot be split over {num_pipelines} pipelines with microbatch size "
        f"{microbatch_size}: it must be a multiple of {microbatch_size} and at least "
        f"{num_pipelines} x {microbatch_size} = {num_pipelines * microbatch_size} so that every pipeline "
        f"gets a microbatch; nearest valid global batches: {' and '.join(map(str, nearest))}",
        nearest,
    )


def split_batch(
    templates: Sequence[PipelineTemplate],
    global_batch: int,
    microbatch_size: int,
    solver: str = "highs",
    time_limit_s: float = 10,
) -> BatchSplit:
    """Microbatches per pipeline (``templates[i]`` is pipeline i's template) for ``global_batch``.

    Guarantees ``sum(microbatches) * microbatch_size == global_batch`` and at
    least one microbatch per pipeline; raises ``BatchSplitError`` (naming the
    nearest valid global batches) when that is impossible.
    """
    if solver not in SOLVERS:
        raise ValueError(f"solver must be one of {SOLVERS}, got {solver!r}")
    total = total_microbatches(global_batch, microbatch_size, len(templates))
    if solver == "python":
        microbatches, reason = min_max_split(templates, total), "exact threshold search"
    elif solver == "highs":
        microbatches, reason = _split_highs(templates, total, time_limit_s)
    else:
        microbatches, reason = _split_mindtpy(templates, total, microbatch_size, time_limit_s)
    assert sum(microbatches) == total and min(microbatches) >= 1, (microbatches, total)
    time_s = max(t.iteration_time(q) for t, q in zip(templates, microbatches))
    return BatchSplit(microbatches=microbatches, iteration_time_s=time_s, solver=solver, reason=reason)


MILP_MAX_BINARIES = 20_000
"""Largest batch-split MILP handed to HiGHS (its selector binaries: each template's candidate per-pipeline
microbatch counts). 256 nodes of 5 templates need a few hundred; only absurd global batches exceed it."""


def _split_highs(templates: Sequence[PipelineTemplate], total: int, time_limit_s: float) -> tuple[tuple[int, ...], str]:
    """The exact MILP (HiGHS through Pyomo's appsi interface), per distinct template.

    Variables for template j (``x_j`` pipelines): ``M_j`` microbatches in all,
    a binary ``y_jq`` selecting its per-pipeline ceiling ``q_j = ceil(M_j/x_j)``
    from ``1..qmax_j``, and ``T >= T_j(q_j)`` read from the table through the
    selectors (exact, no linearisation error). ``qmax_j`` is template j's
    capacity at the optimum of ``min_max_split``: a ``q`` with a larger time
    cannot appear in a split that is at least as good, so the model stays
    small (a few hundred binaries for 256 nodes).

    Objective: ``T / T_up + w * sum_j x_j T_j(q_j) / (P T_up)``. The secondary
    term (less total pipeline time: among splits of the same makespan, the
    microbatches go to the pipelines that run them fastest, so a straggler's
    pipeline keeps the fewest its makespan allows) lies
    in (0, 1], so with ``w`` half the smallest gap between distinct candidate
    times (relative to ``T_up``) it can never buy a larger ``T``. (With
    ``T_up`` the exact optimum every feasible point has ``T = T_up`` anyway;
    the weight keeps the model a correct lexicographic min-max for any bound.)
    """
    import pyomo.environ as pyo

    groups = _groups(templates)
    if len(groups) == 1:  # the model's only point is M_0 = total, split floor/ceil: no solve needed
        return _expand(groups, (total,)), "one template: the even split is optimal"
    tables = [time_table(t) for t, _ in groups]
    counts = [len(ids) for _, ids in groups]
    upper = _optimal_time(tables, counts, total)
    qmax = [t.capacity(upper, total - len(templates) + 1) for t in tables]
    if sum(qmax) > MILP_MAX_BINARIES:
        # HiGHS does not keep to its time limit in a model this large (a fuzzed global batch of 1.4 M
        # ran for over ten minutes): the exact threshold search is min-max optimal without it.
        return min_max_split(templates, total), (
            f"{sum(qmax)} binaries exceed the MILP's {MILP_MAX_BINARIES}; used the exact threshold search"
        )
    times = [[t(q) for q in range(1, c + 1)] for t, c in zip(tables, qmax)]
    weight = 0.5 * _smallest_gap(sorted(v for row in times for v in row), 1e-9 * upper) / upper
    pairs = [(j, q) for j, c in enumerate(qmax) for q in range(1, c + 1)]

    m = pyo.ConcreteModel()
    m.J = pyo.Set(initialize=range(len(groups)))
    m.JQ = pyo.Set(initialize=pairs, dimen=2)
    m.M = pyo.Var(m.J, domain=pyo.Integers, bounds=lambda _, j: (counts[j], counts[j] * qmax[j]))
    m.y = pyo.Var(m.JQ, domain=pyo.Binary)
    m.T = pyo.Var(bounds=(0, upper))
    m.total = pyo.Constraint(expr=sum(m.M[j] for j in m.J) == total)
    m.one = pyo.Constraint(m.J, rule=lambda m, j: sum(m.y[j, q] for q in range(1, qmax[j] + 1)) == 1)

    def ceiling(m, j):
        return sum(q * m.y[j, q] for q in range(1, qmax[j] + 1))

    def time_of(m, j):
        return sum(times[j][q - 1] * m.y[j, q] for q in range(1, qmax[j] + 1))

    # x_j (q_j - 1) + 1 <= M_j <= x_j q_j  <=>  q_j == ceil(M_j / x_j)
    m.cap = pyo.Constraint(m.J, rule=lambda m, j: m.M[j] <= counts[j] * ceiling(m, j))
    m.floor = pyo.Constraint(m.J, rule=lambda m, j: m.M[j] >= counts[j] * (ceiling(m, j) - 1) + 1)
    m.slowest = pyo.Constraint(m.J, rule=lambda m, j: m.T >= time_of(m, j))
    idle = sum(counts[j] * time_of(m, j) for j in m.J) / (len(templates) * upper)
    m.obj = pyo.Objective(expr=m.T / upper + weight * idle, sense=pyo.minimize)

    # Zero gaps: HiGHS's default gaps (1e-4 relative, 1e-6 absolute) exceed the secondary term.
    results = pyo.SolverFactory("appsi_highs").solve(
        m, load_solutions=False, timelimit=time_limit_s, options={"mip_rel_gap": 0.0, "mip_abs_gap": 0.0}
    )
    status = results.solver.termination_condition
    if results.problem.upper_bound is None:
        fallback = min_max_split(templates, total)
        return fallback, f"highs found no solution ({status}); used the exact threshold search"
    m.solutions.load_from(results)
    totals = [round(pyo.value(m.M[j])) for j in m.J]
    optimal = "optimal" if status == pyo.TerminationCondition.optimal else f"best found ({status})"
    return _expand(groups, totals), (
        f"highs MILP {optimal}: {len(groups)} templates, {len(pairs)} binaries, T <= {upper:.6g}s"
    )


def _smallest_gap(values: list[float], tolerance: float) -> float:
    """Smallest difference between sorted ``values`` that differ by more than ``tolerance`` (float noise)."""
    gaps = [b - a for a, b in zip(values, values[1:]) if b - a > tolerance]
    return min(gaps, default=values[-1])


def _split_mindtpy(
    templates: Sequence[PipelineTemplate], total: int, microbatch_size: int, time_limit_s: float
) -> tuple[tuple[int, ...], str]:
    """The seed's eq. 2.6 per pipeline: min sum_i (N_i T_i - mean)^2, sum_i N_i b = B, N_i >= 1 integer.

    ``T_i`` is pipeline i's iteration time for a single microbatch, so
    ``N_i T_i`` is a linear estimate of its time that ignores the pipeline fill
    and drain; the caller reports the exact time of the result.
    """
    import pyomo.environ as pyo
    from pyomo.common.log import LoggingIntercept

    ones = [t.iteration_time(1) for t in templates]
    num = len(templates)
    m = pyo.ConcreteModel()
    m.I = pyo.Set(initialize=range(num))
    m.N = pyo.Var(m.I, domain=pyo.Integers, bounds=(1, total - num + 1))
    m.batch = pyo.Constraint(expr=sum(m.N[i] * microbatch_size for i in m.I) == total * microbatch_size)
    mean = sum(m.N[i] * ones[i] for i in m.I) / num
    m.obj = pyo.Objective(expr=sum((m.N[i] * ones[i] - mean) ** 2 for i in m.I), sense=pyo.minimize)
    # MindtPy logs deprecation notices and numpy warns on its first gap; keep them off the console.
    chatter = io.StringIO()
    with warnings.catch_warnings(), LoggingIntercept(chatter, "pyomo"):
        warnings.simplefilter("ignore", RuntimeWarning)
        results = pyo.SolverFactory("mindtpy").solve(
            m, strategy="OA", mip_solver="appsi_highs", nlp_solver="cyipopt", time_limit=time_limit_s
        )
    if chatter.getvalue():
        logger.debug("mindtpy: %s", chatter.getvalue().strip())
    status = results.solver.termination_condition
    values = [pyo.value(m.N[i], exception=False) for i in m.I]
    split = tuple(round(v) for v in values) if None not in values else ()
    if len(split) != num or sum(split) != total or min(split) < 1:
        fallback = min_max_split(templates, total)
        return fallback, f"mindtpy found no valid split ({status}); used the exact threshold search"
    return split, f"mindtpy OA (eq. 2.6 variance objective {pyo.value(m.obj):.6g}, {status})"
