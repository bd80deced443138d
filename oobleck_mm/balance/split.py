"""Shared pieces of the placement algorithms: count repair, microbatch splits, deterministic order.

Every function here is pure and breaks ties by sample position (the caller's
canonical order: sample id), so identical inputs give identical placements on
every rank.
"""

from __future__ import annotations

import heapq

import numpy as np

from oobleck_mm.balance.problem import BalanceProblem


def descending(weight: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Positions sorted by weight, largest first; equal weights by ascending sample id.

    Weights are integral ticks, so one exact int64 key (weight, then the id's rank) sorts in a
    single pass, a few times faster than a two-key ``lexsort`` at thousands of samples.
    """
    n = len(weight)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    id_rank = np.empty(n, dtype=np.int64)
    id_rank[np.argsort(ids)] = np.arange(n)  # ids are distinct
    top = float(weight.max())
    if (top + 1.0) * n < 2.0**62:
        return np.argsort((top - weight).astype(np.int64) * n + id_rank)
    return np.lexsort((id_rank, -weight))


def ensure_min_counts(problem: BalanceProblem, pipeline: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """Move the lightest samples of the most over-supplied pipelines to those with fewer samples than microbatches."""
    pipeline = pipeline.copy()
    need = problem.num_microbatches
    counts = np.bincount(pipeline, minlength=problem.num_pipelines)
    short = np.nonzero(counts < need)[0]
    if not len(short):
        return pipeline
    order = np.lexsort((problem.sample_ids, weight))  # lightest first
    for p in short:
        while counts[p] < need[p]:
            surplus = counts - need
            donor = int(np.argmax(surplus))  # first index among equals: deterministic
            moved = order[pipeline[order] == donor][0]
            pipeline[moved] = p
            counts[donor] -= 1
            counts[p] += 1
    return pipeline


def proportional_counts(total: int, weights: np.ndarray, minimum: np.ndarray | None = None) -> np.ndarray:
    """Integer counts summing to ``total``, proportional to ``weights`` (largest remainder, ties by index)."""
    weights = np.asarray(weights, dtype=float)
    exact = total * weights / weights.sum() if weights.sum() > 0 else np.full(len(weights), total / len(weights))
    counts = np.floor(exact).astype(np.int64)
    rest = total - int(counts.sum())
    if rest:
        counts[np.lexsort((np.arange(len(weights)), -(exact - counts)))[:rest]] += 1
    if minimum is not None and (counts < minimum).any():
        counts = np.maximum(counts, minimum)
        while counts.sum() > total:  # take back from the largest surplus
            counts[int(np.argmax(counts - minimum))] -= 1
    return counts


def contiguous_split(problem: BalanceProblem, pipeline: np.ndarray, order: np.ndarray) -> np.ndarray:
    """Microbatch of each sample: each pipeline's samples, in ``order``, cut into near-equal runs."""
    micro = np.zeros(problem.num_samples, dtype=np.int64)
    ordered_pipe = pipeline[order]
    for p in range(problem.num_pipelines):
        members = order[ordered_pipe == p]
        m = int(problem.num_microbatches[p])
        sizes = np.full(m, len(members) // m)
        sizes[: len(members) % m] += 1
        micro[members] = np.repeat(np.arange(m), sizes)
    return micro


def lpt_split(problem: BalanceProblem, pipeline: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """Microbatch of each sample: greedy LPT on ``weight`` within each pipeline; no microbatch left empty.

    Bins are keyed (load, count, index), so zero-weight samples still spread over empty bins first.
    """
    micro = np.zeros(problem.num_samples, dtype=np.int64)
    order = descending(weight, problem.sample_ids)
    ordered_pipe = pipeline[order]
    for p in range(problem.num_pipelines):
        heap = [(0.0, 0, m) for m in range(int(problem.num_microbatches[p]))]
        for s in order[ordered_pipe == p]:
            load, count, m = heapq.heappop(heap)
            micro[s] = m
            heapq.heappush(heap, (load + float(weight[s]), count + 1, m))
    return micro


def lpt_pipelines(problem: BalanceProblem, weight: np.ndarray, capacity: np.ndarray | None = None) -> np.ndarray:
    """Pipeline of each sample: greedy LPT on ``weight`` to the least-filled pipeline (load / capacity)."""
    capacity = np.ones(problem.num_pipelines) if capacity is None else capacity
    heap = [(0.0, p) for p in range(problem.num_pipelines)]
    pipeline = np.zeros(problem.num_samples, dtype=np.int64)
    loads = np.zeros(problem.num_pipelines)
    for s in descending(weight, problem.sample_ids):
        _, p = heapq.heappop(heap)
        pipeline[s] = p
        loads[p] += weight[s]
        heapq.heappush(heap, (loads[p] / capacity[p], p))
    return pipeline
