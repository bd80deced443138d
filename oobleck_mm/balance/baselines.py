"""The seed algorithms, kept as selectable baselines: random, OrchMLLM Algorithms 1/2/4, MMScale.

Each takes a ``BalanceProblem`` and returns a ``Placement``, like the default
(``ours``). The seeds balance one scalar per sample across identical data
parallel instances and say nothing of pipelines' microbatches; we apply each
seed's own algorithm a second time inside every pipeline to fill its
microbatches (OrchMLLM's "balance every phase" reading), and repair
pipelines that received fewer samples than microbatches by moving their
lightest samples (``split.ensure_min_counts``). Where a seed needs a choice
it does not make, the choice is noted at the function.

OrchMLLM balances sequence lengths; its global orchestrator balances the LLM
phase, so the length here is the sample's LLM sequence (text + projected
media tokens).
"""

from __future__ import annotations

import numpy as np

from oobleck_mm.balance.problem import BalanceProblem, Placement
from oobleck_mm.balance.split import (
    contiguous_split,
    descending,
    ensure_min_counts,
    lpt_pipelines,
    lpt_split,
    proportional_counts,
)
from oobleck_mm.balance.work import F


def random_placement(problem: BalanceProblem) -> Placement:
    """A seeded shuffle cut like the unbalanced split: ``microbatch_size`` samples per microbatch when
    that fills the batch, else counts proportional to the microbatch counts."""
    rng = np.random.default_rng([problem.seed, 0x7A11])
    order = rng.permutation(problem.num_samples)
    m = problem.num_microbatches
    b = problem.microbatch_size
    counts = (
        m * b if b and int((m * b).sum()) == problem.num_samples else proportional_counts(problem.num_samples, m, m)
    )
    pipeline = np.empty(problem.num_samples, dtype=np.int64)
    pipeline[order] = np.repeat(np.arange(problem.num_pipelines), counts)
    return Placement(pipeline, contiguous_split(problem, pipeline, order))


def _llm_length(problem: BalanceProblem) -> np.ndarray:
    return problem.features[:, F["llm_tokens"]]


def orchmllm_lpt(problem: BalanceProblem) -> Placement:
    """OrchMLLM Algorithm 1 (no padding): lengths in descending order, each to the instance with the
    smallest sum (a min-heap), ignoring pipeline speeds; then the same inside each pipeline."""
    length = _llm_length(problem)
    pipeline = ensure_min_counts(problem, lpt_pipelines(problem, length), length)
    return Placement(pipeline, lpt_split(problem, pipeline, length))


def orchmllm_padded(problem: BalanceProblem) -> Placement:
    """OrchMLLM Algorithm 2 (padding): binary search on the padded batch length bound ``b`` for the
    fewest ascending-order groups with ``count * longest <= b``; groups go to instances in order.

    The paper starts the search at ``right = sorted[0].length * (d/2 + 1)``, which for an
    ascending sort is not an upper bound; we use ``n * longest``, which always is.
    """
    length = _llm_length(problem)
    groups = _padded_groups(problem, np.arange(problem.num_samples), length, problem.num_pipelines)
    pipeline = ensure_min_counts(problem, groups, length)
    micro = np.zeros(problem.num_samples, dtype=np.int64)
    for p in range(problem.num_pipelines):
        members = np.nonzero(pipeline == p)[0]
        micro[members] = _fill_groups(
            _padded_groups(problem, members, length, int(problem.num_microbatches[p])), int(problem.num_microbatches[p])
        )
    return Placement(pipeline, micro)


def _padded_groups(problem: BalanceProblem, members: np.ndarray, length: np.ndarray, d: int) -> np.ndarray:
    """Group index (0..<= d-1) of each of ``members``: Algorithm 2's smallest feasible bound."""
    ascending = np.lexsort((problem.sample_ids[members], length[members]))
    lengths = length[members][ascending]

    def groups_for(bound: float) -> np.ndarray:
        out = np.zeros(len(lengths), dtype=np.int64)
        group, size = 0, 0
        for i, value in enumerate(lengths):
            if (size + 1) * value > bound and size:
                group, size = group + 1, 0
            out[i] = group
            size += 1
        return out

    left, right = float(lengths[0]) if len(lengths) else 0.0, float(len(lengths) * lengths.max(initial=0.0))
    while left < right:
        mid = (left + right) // 2
        if groups_for(mid)[-1] + 1 <= d:
            right = mid
        else:
            left = mid + 1
    result = np.zeros(len(members), dtype=np.int64)
    result[ascending] = groups_for(right)
    return result


def _fill_groups(groups: np.ndarray, d: int) -> np.ndarray:
    """Algorithm 2 may use fewer than ``d`` groups; split the largest groups until every one of ``d`` is used."""
    groups = groups.copy()
    while len(groups) >= d and len(np.unique(groups)) < d:
        counts = np.bincount(groups, minlength=d)
        donor = int(np.argmax(counts))
        empty = int(np.nonzero(counts == 0)[0][0])
        members = np.nonzero(groups == donor)[0]
        groups[members[len(members) // 2 :]] = empty
    return groups


def orchmllm_quadratic(problem: BalanceProblem) -> Placement:
    """OrchMLLM Algorithm 4 (linear + quadratic): LPT where instances whose length sums are within the
    tolerance ``v`` of the smallest compare by sum of squared lengths. ``v`` is "set manually" in the
    paper; we use the mean length."""
    length = _llm_length(problem)
    tolerance = float(length.mean()) if len(length) else 0.0
    pipeline = ensure_min_counts(
        problem,
        _tolerant_lpt(problem, np.arange(problem.num_samples), length, problem.num_pipelines, tolerance),
        length,
    )
    micro = np.zeros(problem.num_samples, dtype=np.int64)
    for p in range(problem.num_pipelines):
        members = np.nonzero(pipeline == p)[0]
        micro[members] = _tolerant_lpt(
            problem, members, length, int(problem.num_microbatches[p]), tolerance, fill_empty=True
        )
    return Placement(pipeline, micro)


def _tolerant_lpt(problem, members, length, d, tolerance, fill_empty=False) -> np.ndarray:
    sums = np.zeros(d)
    squares = np.zeros(d)
    counts = np.zeros(d, dtype=np.int64)
    out = np.zeros(len(members), dtype=np.int64)
    position = {int(s): i for i, s in enumerate(members)}
    for s in members[descending(length[members], problem.sample_ids[members])]:
        if fill_empty and (counts == 0).any():
            target = int(np.argmax(counts == 0))  # every microbatch needs a sample
        else:
            near = sums < sums.min() + tolerance
            target = int(np.argmin(np.where(near, squares, np.inf)))
        out[position[int(s)]] = target
        sums[target] += length[s]
        squares[target] += length[s] ** 2
        counts[target] += 1
    return out


def mmscale(problem: BalanceProblem) -> Placement:
    """MMScale: intra-microbatch reordering (Algorithm 2) then inter-microbatch reordering (Algorithm 3).

    Algorithm 2 sorts samples in *ascending* size and gives each to the least loaded
    data-parallel group; the size is the cost model's whole-model time of the sample
    (the paper's "sample size"). Microbatches are consecutive runs of a group, as in
    the paper, whose Algorithm 3 then orders them; we keep its two rules (the smallest
    microbatch first, the ``S - 1`` smallest last) and order the rest largest first
    to fill the early intervals, instead of its interval-matching search.
    """
    size = problem.total_cost()
    pipeline = np.zeros(problem.num_samples, dtype=np.int64)
    loads = np.zeros(problem.num_pipelines)
    for s in np.lexsort((problem.sample_ids, size)):
        p = int(np.argmin(loads))
        pipeline[s] = p
        loads[p] += size[s]
    pipeline = ensure_min_counts(problem, pipeline, size)
    micro = contiguous_split(problem, pipeline, np.arange(problem.num_samples))
    return Placement(pipeline, _interleave_order(problem, pipeline, micro, size))


def _interleave_order(problem, pipeline, micro, size) -> np.ndarray:
    out = micro.copy()
    for p in range(problem.num_pipelines):
        m, s = int(problem.num_microbatches[p]), int(problem.num_stages[p])
        members = pipeline == p
        loads = np.bincount(micro[members], weights=size[members], minlength=m)
        ascending = list(np.lexsort((np.arange(m), loads)))
        first = ascending.pop(0)
        tail = ascending[: max(0, min(s - 1, len(ascending)))]
        middle = sorted(ascending[len(tail) :], key=lambda i: (-loads[i], i))
        new_position = {
            old: new for new, old in enumerate([first, *middle, *sorted(tail, key=lambda i: (-loads[i], i))])
        }
        out[members] = [new_position[int(i)] for i in micro[members]]
    return out
