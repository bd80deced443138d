"""The default placement ("ours"): speed-weighted targets, LPT + proportional dealing, then the exact search.

1. Targets. Pipeline ``p`` given a fraction ``x`` of the batch, split into
   equal microbatches, would take ``T_p(x) = max_k (s_pk x + c_pk)`` (the
   ``problem.proxy_times`` formula is linear in ``x`` per bottleneck stage).
   The fractions that make every ``T_p`` equal solve ``sum_p T_p^-1(T) = 1``,
   a concave piecewise-linear equation: Newton from below converges in a few
   steps. This is where depth and microbatch count (speed) enter.
2. Construction. The heaviest ``2P`` samples go greedily (LPT) to the
   least-filled pipeline (load / target); the rest, sorted by size, are dealt
   to pipelines at evenly spaced ranks, each pipeline receiving a number
   proportional to its remaining capacity, so every pipeline gets a sample of
   every size stratum (and so of the batch's modality mix).
3. The compiled search (``search.place``): every pipeline split into
   microbatches and timed exactly, then a polish of the slowest pipeline,
   judged by exact times, until it is within ``GOOD_ENOUGH`` of the mean or
   cannot be improved. Its module docstring has the details.

An equal-microbatch proxy cannot finish the job: real microbatches are lumpy
(a few heavy samples), which costs each pipeline 0-25 % more depending on its
exact samples, not only on its shape. The exact polish is what takes the
construction's few per cent to within one.
"""

from __future__ import annotations

import numpy as np

from oobleck_mm.balance.problem import BalanceProblem, Placement

POLISH_STEPS_PER_PIPELINE = 1
POLISH_STEPS_EXTRA = 64
"""Most polish steps per decision: one per pipeline plus 64 (each step moves samples off the slowest
pipeline; a 64 x 64-sample batch needs ~55, a 256 x 16 one ~340 to reach 1 %)."""
GOOD_ENOUGH = 0.01
"""Stop refining once predicted max/mean is within this: below the cost model's own accuracy
(its fitted predictions are within ~1 % median, 5 % max of measured stage times)."""


def ours(problem: BalanceProblem, *, polish: bool = True) -> Placement:
    """The default placement; ``ours_fast`` is the construction alone."""
    # Imported on first use: the search's kernels bring numba (~0.4 s of a worker's 2.5 s start-up),
    # which a job without the balancer never needs; a worker with it loads them at start (warm_up).
    from oobleck_mm.balance.search import place

    steps = POLISH_STEPS_PER_PIPELINE * problem.num_pipelines + POLISH_STEPS_EXTRA if polish else 0
    result = place(problem, target_shares(problem), steps, GOOD_ENOUGH)
    return Placement(result.pipeline, result.microbatch)


def ours_fast(problem: BalanceProblem) -> Placement:
    """``ours`` without the polish: speed-weighted construction and the stratified microbatch split."""
    return ours(problem, polish=False)


# ---------------------------------------------------------------------- 1. targets


def target_shares(problem: BalanceProblem) -> np.ndarray:
    """Fraction of the batch's work each pipeline should get so all finish together."""
    slope, offset = _time_lines(problem)
    rows = np.arange(problem.num_pipelines)
    starts = np.sort(offset.max(axis=1))
    t = starts[0]  # below every solution: no pipeline has a positive share yet
    share = np.zeros(problem.num_pipelines)
    for _ in range(64):
        per_line = (t - offset) / slope
        k = np.argmin(per_line, axis=1)
        share = np.maximum(per_line[rows, k], 0.0)
        total = share.sum()
        if abs(total - 1.0) <= 1e-12:
            break
        rate = np.where(share > 0, 1.0 / slope[rows, k], 0.0).sum()
        if rate <= 0:  # nobody has a share yet: jump to the next pipeline's start
            t = starts[min(np.searchsorted(starts, t, side="right"), len(starts) - 1)]
            continue
        t += (1.0 - total) / rate
    return share / share.sum() if share.sum() > 0 else np.full(problem.num_pipelines, 1 / problem.num_pipelines)


def _time_lines(problem: BalanceProblem) -> tuple[np.ndarray, np.ndarray]:
    """``T_p(x) = max_k slope[p, k] * x + offset[p, k]`` for a fraction ``x`` of the whole batch."""
    a = problem.cost.sum(axis=0)[problem.stage_index]  # whole batch, per stage of each pipeline
    b = problem.num_microbatches[:, None] * problem.microbatch_cost[problem.stage_index]
    m = problem.num_microbatches[:, None]
    slope = ((m - 1) * a + a.sum(axis=1, keepdims=True)) / m
    offset = ((m - 1) * b + b.sum(axis=1, keepdims=True)) / m
    return np.maximum(slope, 1e-300), offset
