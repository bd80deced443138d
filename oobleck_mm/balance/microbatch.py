"""Inside a pipeline: which of its samples share a microbatch, and in what order microbatches run.

Works on *instances*: rows of ``(pipeline index, member samples)``, so the
balancer can split every pipeline at once, or many candidate member sets of
the same pipelines at once, in one vectorised pass.

Split (Entrain's stratified assignment, §4.5.1, vectorised). A pipeline's
samples, largest first, are dealt in rounds of ``M``: in each round the
``j``-th largest goes to the ``j``-th least-filled microbatch, the fill of a
microbatch being the largest ratio, over stages, of its time to its share of
the pipeline's stage load. The first round seeds every microbatch, so none is
empty; every later round is LPT on the bottleneck, so the largest samples of
a stratum meet the microbatches with most room in any stage.

Order (MMScale's inter-microbatch reordering, §5.2, simplified): light -
heavy - light by bottleneck time. Fill and drain pass the first and last
microbatches through every stage in turn, so those should be light, and in
the steady state neighbours of similar size stall each other least. On the
exact model this beats ascending, descending, random and MMScale's own rules
(docs/balancer.md has the measurements).
"""

from __future__ import annotations

import numpy as np

from oobleck_mm.balance.problem import BalanceProblem


def sort_members(problem: BalanceProblem, members: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """Each row of ``members`` by descending weight (ties: ascending id), holes (-1) last."""
    valid = members >= 0
    s = np.maximum(members, 0)
    key = np.where(valid, -weight[s], np.inf)
    ids = np.where(valid, problem.sample_ids[s], np.iinfo(np.int64).max)
    order = np.lexsort((ids, key), axis=-1)
    return np.take_along_axis(members, order, axis=1)


def split(problem: BalanceProblem, pipes: np.ndarray, members: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Microbatch of every member ``(I, W)`` (-1 at holes) and microbatch stage ticks ``(I, S_max, M_max)``.

    ``members`` rows must be sorted by ``sort_members``; every row needs at least as
    many members as its pipeline has microbatches.
    """
    num, width = members.shape
    valid = members >= 0
    # Stage-major (S, I, ...) inside: the max over stages is then a max of contiguous slabs.
    stages = problem.stage_index[pipes].T
    cost = problem.cost_at(np.maximum(members, 0)[None], stages[:, :, None]) * valid[None]
    m = problem.num_microbatches[pipes]
    m_max = int(problem.num_microbatches.max())
    counts = valid.sum(axis=1)
    fixed = problem.microbatch_cost[stages]
    exists = np.arange(m_max)[None, :] < m[:, None]
    loads = fixed[:, :, None] * exists[None]
    inverse_share = (1.0 / np.maximum((cost.sum(axis=2) + m * fixed) / m, 1.0))[:, :, None]
    micro = np.full((num, width), -1, dtype=np.int64)
    rows = np.arange(num)[:, None]
    for r in range(int(np.ceil(counts / m).max(initial=0))):
        rank = r * m[:, None] + np.arange(m_max)[None, :]
        take = exists & (rank < counts[:, None])
        fill = np.where(exists, (loads * inverse_share).max(axis=0), np.inf)
        target = np.argsort(fill, axis=1, kind="stable")  # least filled first; ties by number
        row, slot, mb = np.broadcast_to(rows, rank.shape)[take], rank[take], target[take]
        micro[row, slot] = mb
        loads[:, row, mb] += cost[:, row, slot]  # one sample per microbatch per round: no repeats
    return _pyramid(problem, pipes, micro, loads)


def _pyramid(problem: BalanceProblem, pipes: np.ndarray, micro: np.ndarray, loads: np.ndarray):
    """Renumber microbatches light - heavy - light by bottleneck ticks.

    ``loads`` is stage-major ``(S, I, M)``; returns ``(micro, ticks (I, S, M))`` renumbered.
    """
    _, num, m_max = loads.shape
    m = problem.num_microbatches[pipes][:, None]
    r = np.arange(m_max)[None, :]
    exists = r < m
    ascending = np.argsort(np.where(exists, loads.max(axis=0), np.inf), axis=1, kind="stable")
    # Rank r (ascending) runs at position r / 2 when r is even, M - 1 - (r - 1) / 2 when odd.
    position = np.where(exists, np.where(r % 2 == 0, r // 2, m - 1 - (r - 1) // 2), r)
    rows = np.arange(num)[:, None]
    new_number = np.empty_like(ascending)
    new_number[rows, ascending] = position
    ticks = np.empty((num, loads.shape[0], m_max))
    ticks[rows[:, :, None], np.arange(loads.shape[0])[None, :, None], new_number[:, None, :]] = loads.transpose(1, 0, 2)
    micro = np.where(micro >= 0, new_number[rows, np.maximum(micro, 0)], -1)
    return micro, ticks


def placement_arrays(problem: BalanceProblem, members: np.ndarray, micro: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(pipeline, microbatch)`` per sample from one instance per pipeline (row p is pipeline p)."""
    valid = members >= 0
    pipeline = np.empty(problem.num_samples, dtype=np.int64)
    microbatch = np.empty(problem.num_samples, dtype=np.int64)
    rows = np.broadcast_to(np.arange(len(members))[:, None], members.shape)
    pipeline[members[valid]] = rows[valid]
    microbatch[members[valid]] = micro[valid]
    return pipeline, microbatch
