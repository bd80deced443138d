"""The balancing decision of one step: algorithm registry, trigger rule, result with its reason.

``balance(problem, algorithm, threshold)`` is what every rank calls with the
same inputs (global batch metadata, pipelines, shipped cost coefficients) and
so gets the same ``Assignment``:

1. Every microbatch must get a sample: fewer samples than microbatches is a
   ``ValueError`` naming both numbers.
2. Trigger (LoongForge): when the unbalanced split (``contiguous_assignment``)
   applies and its predicted max/mean pipeline time is within ``threshold``,
   keep it; rebalancing could only win noise.
3. Otherwise run the named algorithm and keep its placement unless it is
   predicted no faster than the unbalanced split.

A single sample heavier than a pipeline's fair share is not an error: it
lands alone (with the lightest samples to fill that pipeline's other
microbatches) and the reason says so, since no placement can hide it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from oobleck_mm.balance.assignment import Assignment, contiguous_assignment
from oobleck_mm.balance.baselines import mmscale, orchmllm_lpt, orchmllm_padded, orchmllm_quadratic, random_placement
from oobleck_mm.balance.cost_model import CostCoefficients, CostModel
from oobleck_mm.balance.deferral import (
    Deferral,
    adjacent_deferral,
    decoupled_ticks,
    lhl_pairs,
    pairwise_deferral,
    stratified_microbatches,
)
from oobleck_mm.balance.metrics import imbalance, modality_dist_ratios
from oobleck_mm.balance.ours import ours, ours_fast, target_shares
from oobleck_mm.balance.problem import BalanceProblem, PipelineShape, Placement, check_enough_samples
from oobleck_mm.balance.schedule_time import iteration_times
from oobleck_mm.balance.work import ModelDims, sample_features

ALGORITHMS: dict[str, Callable[[BalanceProblem], Placement]] = {
    "ours": ours,
    "ours_fast": ours_fast,
    "random": random_placement,
    "orchmllm_lpt": orchmllm_lpt,
    "orchmllm_padded": orchmllm_padded,
    "orchmllm_quadratic": orchmllm_quadratic,
    "mmscale": mmscale,
}
"""Every placement algorithm by name; all take a ``BalanceProblem`` and return a ``Placement``."""

DEFAULT_THRESHOLD = 0.02
IMPROVEMENT = 1e-6
DEFERRAL_REPLACE_GAIN = 0.005
"""Deferral sped some pipeline up by more than this (relative): the placement is worth redoing with it."""
"""Deferral is kept only when it is predicted this much faster (relative): a one-stage pipeline's time is the
sum of its work whatever the deferral, and float rounding alone must not reorder it."""


@dataclass(frozen=True, slots=True)
class BalanceResult:
    assignment: Assignment
    predicted_s: tuple[float, ...]
    """Predicted iteration seconds of each pipeline under ``assignment``."""
    unbalanced_s: tuple[float, ...] | None
    """The same for the unbalanced split, when the batch fills it (``None`` otherwise)."""
    algorithm: str
    """The algorithm whose placement was kept, or ``contiguous``."""

    @property
    def imbalance(self) -> float:
        return imbalance(self.predicted_s)

    @property
    def predicted_max_s(self) -> float:
        return max(self.predicted_s)

    @property
    def predicted_mean_s(self) -> float:
        return float(np.mean(self.predicted_s))


def get_algorithm(name: str) -> Callable[[BalanceProblem], Placement]:
    if name not in ALGORITHMS:
        raise ValueError(f"balance algorithm {name!r} is unknown; valid: {', '.join(ALGORITHMS)}")
    return ALGORITHMS[name]


def balance(
    problem: BalanceProblem, algorithm: str = "ours", threshold: float = DEFAULT_THRESHOLD, deferral: bool = False
) -> BalanceResult:
    """Assign the problem's samples to pipelines and microbatches (see the module docstring); with
    ``deferral``, then Entrain's pairwise deferral inside every pipeline where it is predicted faster."""
    result = _balance(problem, algorithm, threshold)
    if not deferral:
        return result
    deferred = with_deferral(problem, result)
    # One objective: a pipeline that deferral makes faster can take more samples. Place again on a problem
    # whose pipelines cost what they ran at after deferral, defer again, and keep the faster of the two.
    gains = [a / b if b > 0 else 1.0 for a, b in zip(result.predicted_s, deferred.predicted_s)]
    if max(gains) <= 1 + DEFERRAL_REPLACE_GAIN:
        return deferred
    again = _balance(problem.with_pipeline_speeds([1 / g for g in gains]), algorithm, threshold)
    placed = _placement(problem, again.assignment)
    times = tuple(map(float, problem.predicted_times(placed)))
    second = with_deferral(problem, replace(again, predicted_s=times, unbalanced_s=result.unbalanced_s))
    return second if max(second.predicted_s) < max(deferred.predicted_s) else deferred


def _balance(problem: BalanceProblem, algorithm: str, threshold: float) -> BalanceResult:
    run = get_algorithm(algorithm)
    if not threshold >= 0:
        raise ValueError(f"threshold must be >= 0, got {threshold}")
    check_enough_samples(problem.num_samples, problem.num_microbatches)
    unbalanced = _unbalanced(problem)
    if unbalanced is not None:
        base_times = tuple(map(float, problem.predicted_times(unbalanced)))
        if imbalance(base_times) <= 1 + threshold:
            reason = f"kept contiguous: predicted imbalance {imbalance(base_times):.3f} <= {1 + threshold:.3f}"
            return BalanceResult(_contiguous(problem, reason), base_times, base_times, "contiguous")
    placement = fill_empty_microbatches(problem, run(problem))
    problem.check(placement)
    times = tuple(map(float, problem.predicted_times(placement)))
    if unbalanced is not None and max(times) >= max(base_times):
        reason = f"kept contiguous: {algorithm} predicted {max(times):.4g} s, not below {max(base_times):.4g} s"
        return BalanceResult(_contiguous(problem, reason), base_times, base_times, "contiguous")
    reason = f"{algorithm}: predicted imbalance {imbalance(times):.3f}"
    if unbalanced is not None:
        reason += f" (contiguous {imbalance(base_times):.3f}, max {max(base_times):.4g} s -> {max(times):.4g} s)"
    reason += _heavy_note(problem, times)
    return BalanceResult(
        _assignment(problem, placement, reason), times, base_times if unbalanced is not None else None, algorithm
    )


def with_deferral(problem: BalanceProblem, result: BalanceResult) -> BalanceResult:
    """``result`` with each pipeline's microbatches reordered and deferred by ``deferral.pairwise_deferral``
    where the exact 1F1B model predicts that pipeline faster (else left as it was)."""
    if problem.llm_cost is None:
        raise ValueError("deferral needs the problem's LLM costs (BalanceProblem.build fills them)")
    index = {int(s): n for n, s in enumerate(problem.sample_ids)}
    encoder_cost = problem.cost - problem.llm_cost
    pipelines, deferred, times, changed = [], [], list(result.predicted_s), 0
    for p, microbatches in enumerate(result.assignment.pipelines):
        # A branched pipeline's own stages (its branches' and the LLM's), timed as the engine runs them: its
        # branch stages run the encoder groups, the merge stage regroups them into the LLM's microbatches.
        branched = problem.branched[p] if problem.branched else None
        columns = np.asarray(branched[0]) if branched is not None else problem.stage_index[p, : problem.num_stages[p]]
        llm, enc = problem.llm_cost[:, columns], encoder_cost[:, columns]
        positions = [[index[i] for i in mb] for mb in microbatches]
        best = None
        # Entrain §4.5: the balancer's own microbatches, and the stratified split on encoder work; each
        # with the paper's pairing, its pairs in light-heavy-light order, and deferral in the given order.
        members = [n for pos in positions for n in pos]
        stratified = stratified_microbatches(enc[members].sum(axis=1), llm[members].sum(axis=1), len(positions))
        for base in (positions, [[members[x] for x in mb] for mb in stratified]):
            work = [llm[pos].sum(axis=1) for pos in base]
            paired = pairwise_deferral(work)
            plans = [paired, lhl_pairs(paired, work), adjacent_deferral(work)]
            if base is not positions:
                plans.append(Deferral(tuple(range(len(base))), ((),) * len(base), 0.0))
            for plan in plans:
                order = [base[k] for k in plan.order]
                gone = [tuple(order[slot][x] for x in plan.deferred[slot]) for slot in range(len(order))]
                fwd, bwd = decoupled_ticks(enc, llm, problem.microbatch_cost[columns], [tuple(o) for o in order], gone)
                share = problem.forward_share[columns][:, None]
                forward, backward = fwd * share * problem.tick_s, bwd * (1 - share) * problem.tick_s
                if branched is not None:
                    from oobleck_mm.planning.branch_time import simulate_microbatches

                    seconds = simulate_microbatches(branched[1], branched[2], forward.tolist(), backward.tolist())
                else:
                    seconds = float(iteration_times(forward[None], backward[None], [len(columns)], [len(order)])[0])
                if seconds < (best[0] if best else times[p] * (1 - IMPROVEMENT)):
                    best = (seconds, order, gone)
        if best is not None:
            ids = problem.sample_ids
            pipelines.append(tuple(tuple(int(ids[n]) for n in mb) for mb in best[1]))
            deferred.append(tuple(tuple(int(ids[n]) for n in g) for g in best[2]))
            times[p], changed = best[0], changed + 1
            continue
        pipelines.append(microbatches)
        deferred.append(((),) * len(microbatches))
    if not changed:
        return result
    reason = (
        f"{result.assignment.reason}; deferral in {changed} of {len(pipelines)} pipeline(s), predicted max "
        f"{max(result.predicted_s):.4g} s -> {max(times):.4g} s"
    )
    assignment = Assignment(tuple(pipelines), reason=reason, deferred=tuple(deferred))
    return replace(result, assignment=assignment, predicted_s=tuple(times))


def fill_empty_microbatches(problem: BalanceProblem, placement: Placement) -> Placement:
    """Give every empty microbatch one sample from the fullest microbatch (its own pipeline's first).

    The schedule runs each pipeline's microbatch count, so none may be empty; an algorithm
    that packs tightly (few samples per microbatch, one heavy sample alone) can leave one so.
    Deterministic: donors by (most samples, pipeline, microbatch), the donor's last sample moves.
    """
    pipe, micro = placement.pipeline.copy(), placement.microbatch.copy()
    counts = {(p, m): 0 for p in range(problem.num_pipelines) for m in range(int(problem.num_microbatches[p]))}
    for p, m in zip(pipe.tolist(), micro.tolist()):
        counts[(p, m)] += 1
    for (p, m), n in sorted(counts.items()):
        if n:
            continue
        donors = [k for k, c in counts.items() if c >= 2]
        if not donors:
            break  # check() reports it: fewer samples than microbatches
        same = [k for k in donors if k[0] == p]
        donor = max(same or donors, key=lambda k: (counts[k], -k[0], -k[1]))
        moved = int(np.flatnonzero((pipe == donor[0]) & (micro == donor[1]))[-1])
        pipe[moved], micro[moved] = p, m
        counts[donor] -= 1
        counts[(p, m)] = 1
    return Placement(pipe, micro)


def balance_batch(
    global_batch: Sequence[int],
    metas: Sequence,
    dims: ModelDims,
    pipelines: Sequence[PipelineShape],
    model: CostModel,
    coefficients: CostCoefficients,
    microbatch_size: int | None = None,
    algorithm: str = "ours",
    threshold: float = DEFAULT_THRESHOLD,
    seed: int = 0,
    deferral: bool = False,
) -> BalanceResult:
    """``balance`` from the sampler's ids and their ``SampleMeta``s (same order)."""
    if len(metas) != len(global_batch):
        raise ValueError(f"got {len(metas)} sample metadata for a global batch of {len(global_batch)}")
    features = sample_features(metas, dims)
    problem = BalanceProblem.build(global_batch, features, pipelines, model, coefficients, microbatch_size, seed)
    return balance(problem, algorithm, threshold, deferral)


def step_metrics(problem: BalanceProblem, result: BalanceResult) -> dict[str, float]:
    """Plain numbers for the progress line and the event log.

    ``dist_<modality>``: OmniBal's Dist Ratio of that modality's tokens per pipeline,
    each pipeline's tokens divided by its fair share of the batch's work (pipelines of
    different speeds should not get equal tokens); 0 is perfect.
    """
    position = {int(i): k for k, i in enumerate(problem.sample_ids.tolist())}
    pipeline = np.empty(problem.num_samples, dtype=np.int64)
    for p, microbatches in enumerate(result.assignment.pipelines):
        for mb in microbatches:
            pipeline[[position[i] for i in mb]] = p
    shares = np.maximum(target_shares(problem), 1e-12)
    out = {
        "predicted_max_s": result.predicted_max_s,
        "predicted_mean_s": result.predicted_mean_s,
        "predicted_imbalance": result.imbalance,
    }
    for name, value in modality_dist_ratios(problem.features, pipeline, problem.num_pipelines, shares).items():
        out[f"dist_{name}"] = value
    return out


def _unbalanced(problem: BalanceProblem) -> Placement | None:
    """The contiguous split as a placement, when the batch exactly fills it."""
    b = problem.microbatch_size
    if not b or int(problem.num_microbatches.sum()) * b != problem.num_samples:
        return None
    mb_global = np.arange(problem.num_samples) // b
    offsets = np.cumsum(problem.num_microbatches) - problem.num_microbatches
    pipeline = np.searchsorted(offsets, mb_global, side="right") - 1
    return Placement(pipeline.astype(np.int64), mb_global - offsets[pipeline])


def _contiguous(problem: BalanceProblem, reason: str) -> Assignment:
    """Exactly what the balancer-off path runs (sampler order inside each microbatch), with the reason."""
    plain = contiguous_assignment(
        problem.sample_ids.tolist(), problem.num_microbatches.tolist(), problem.microbatch_size
    )
    return replace(plain, reason=reason)


def _assignment(problem: BalanceProblem, placement: Placement, reason: str) -> Assignment:
    """Sample ids per (pipeline, microbatch), each microbatch in ascending id order (packing order)."""
    order = np.lexsort((problem.sample_ids, placement.microbatch, placement.pipeline))
    ids = problem.sample_ids[order].tolist()
    key = (placement.pipeline * int(problem.num_microbatches.max()) + placement.microbatch)[order]
    cuts = np.nonzero(np.diff(key))[0] + 1
    groups = iter(np.split(np.arange(len(ids)), cuts))
    pipelines = []
    for count in problem.num_microbatches:
        pipelines.append(tuple(tuple(ids[i] for i in next(groups)) for _ in range(int(count))))
    return Assignment(tuple(pipelines), reason=reason)


def _placement(problem: BalanceProblem, assignment: Assignment) -> Placement:
    """``assignment`` (sample ids) as positions in ``problem``."""
    index = {int(s): n for n, s in enumerate(problem.sample_ids)}
    pipe = np.zeros(problem.num_samples, dtype=np.int64)
    micro = np.zeros(problem.num_samples, dtype=np.int64)
    for p, microbatches in enumerate(assignment.pipelines):
        for m, mb in enumerate(microbatches):
            for i in mb:
                pipe[index[i]], micro[index[i]] = p, m
    return Placement(pipe, micro)


def _heavy_note(problem: BalanceProblem, times: tuple[float, ...]) -> str:
    """Name the samples that alone exceed a pipeline's fair share of the batch's work."""
    weight = problem.total_cost()
    fair = weight.sum() / problem.num_pipelines
    heavy = problem.sample_ids[weight > fair]
    if not len(heavy):
        return ""
    return f"; sample(s) {sorted(heavy.tolist())[:4]} each exceed a pipeline's fair share alone"
