"""Compiled core of ``ours``: construct a placement, split pipelines into microbatches, time them exactly,
and move samples off the slowest pipeline.

Every refinement of a placement needs the exact 1F1B time of the pipelines it
touches after re-splitting them into microbatches (lumpy microbatches cost a
deep pipeline far more than a shallow one: see ``schedule_time``). In numpy
each such evaluation is a few hundred small calls; compiled by numba it is a
few microseconds, so a decision for 4096 samples on 64 pipelines takes a few
milliseconds.

1. ``split``: a pipeline's members, heaviest first, are dealt in rounds of
   ``M``: the ``j``-th largest of a round goes to the ``j``-th least-filled
   microbatch, fill = the largest ratio over stages of the microbatch's time
   to its share of the pipeline's stage load (Entrain's stratified
   assignment, §4.5.1); then microbatches run light - heavy - light by
   bottleneck time (MMScale's inter-microbatch reordering, simplified).
2. ``pipeline_time``: DeepSpeed's ``TrainSchedule`` recurrence with
   per-microbatch stage times (the recurrence of
   ``schedule_time.iteration_times``, one pipeline at a time; tested equal).
3. ``construct``: the heaviest ``2P`` samples by LPT to the least-filled
   pipeline (load / target share), the rest dealt at evenly spaced ranks of
   the size order, each pipeline receiving a count proportional to its
   remaining capacity: every pipeline gets every size stratum.
4. Polish, always on the slowest pipeline ``h``, escalating only when a level
   finds nothing: level 0 moves one of h's members (the heaviest, or the one
   whose first-order value evens h with the fastest pipeline) to one of the 3
   fastest pipelines; level L (1, 2) tries, with the ``3 L`` fastest,
   first-order moves and swaps, the swap of each of h's ``L`` heaviest
   members that evens the pair, and that member for two lighter ones (a
   two-for-one evens lumpiness where a swap cannot). First-order values come from the
   proxy ``((M - 1) max_k L_k + sum_k L_k) / M`` scaled by each pipeline's
   exact / proxy ratio: a sample is worth more to a pipeline whose
   bottleneck stage it loads (the multimodal part). Every candidate is
   re-split and timed exactly; the best that lowers h's time is applied.
   It stops when the slowest pipeline is within ``good_enough`` of the mean
   or no level improves it.

Determinism: costs are integral ticks held in float64, ties break by index
or sample id, sorts are stable, and numba runs without fastmath (no
reassociation, no contraction), so every rank computes the same bits.
Without numba the same functions run as plain Python (correct, ~100x slower).
"""

from __future__ import annotations

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from oobleck_mm.balance.search_kernels import (  # noqa: F401 - split, pipeline_time, njit: read from here too
    CACHE,
    MAX_LEVEL,
    POLISH_PARTNERS,
    _bottleneck,
    _edit,
    _fastest,
    _loads_after,
    _proxy,
    _time_row,
    construct,
    njit,
    pipeline_time,
    split,
)
from oobleck_mm.balance.search_steps import _move_step, _polish_step
from oobleck_mm.balance.split import descending, ensure_min_counts


@njit(cache=CACHE)
def _search(
    pipeline,
    order,
    cost,
    weight,
    stage_cols,
    num_stages,
    num_micro,
    fixed_cost,
    fwd_share,
    polish_steps,
    good_enough,
    micro,
):
    """Polish ``pipeline`` (per sample) in place, write every sample's microbatch into ``micro``;
    returns every pipeline's exact ticks and stage loads as kept by the search, and the steps taken."""
    num_pipes, s_max = stage_cols.shape
    num = len(pipeline)
    rank = np.empty(num, dtype=np.int64)
    counts = np.zeros(num_pipes, dtype=np.int64)
    for i in range(num):
        rank[order[i]] = i
        counts[pipeline[i]] += 1
    width = counts.max() + max(64, counts.max())
    members = np.full((num_pipes, width), -1, dtype=np.int64)
    filled = np.zeros(num_pipes, dtype=np.int64)
    for i in range(num):  # heaviest first within each row
        x = order[i]
        p = pipeline[x]
        members[p, filled[p]] = x
        filled[p] += 1
    m_max = num_micro.max()
    ticks = np.empty((s_max, m_max))
    fill = np.empty(m_max)
    ready = np.empty(s_max + 2)
    micro_buf = np.empty(width, dtype=np.int64)
    fixed = np.zeros((num_pipes, s_max))
    share = np.zeros((num_pipes, s_max))
    loads = np.zeros((num_pipes, s_max))
    exact = np.empty(num_pipes)
    for p in range(num_pipes):
        s = num_stages[p]
        for k in range(s):
            c = stage_cols[p, k]
            fixed[p, k] = fixed_cost[c]
            share[p, k] = fwd_share[c]
            load = fixed_cost[c] * num_micro[p]
            for i in range(counts[p]):
                load += cost[members[p, i], c]
            loads[p, k] = load
        exact[p] = _time_row(
            members[p],
            counts[p],
            loads[p],
            cost,
            stage_cols[p, :s],
            fixed[p, :s],
            share[p, :s],
            num_micro[p],
            ticks,
            fill,
            micro_buf,
            ready,
        )

    row_h = np.empty(width, dtype=np.int64)
    row_l = np.empty(width, dtype=np.int64)
    gone = np.full(1, -1, dtype=np.int64)
    came = np.full(2, -1, dtype=np.int64)
    new = np.empty(s_max)
    level = 0
    steps = 0
    for _ in range(polish_steps):
        h = np.argmax(exact)
        if exact[h] <= (1 + good_enough) * exact.mean():
            break
        if level == 0:
            move = _move_step(
                h,
                POLISH_PARTNERS,
                members,
                counts,
                loads,
                exact,
                cost,
                weight,
                rank,
                stage_cols,
                num_stages,
                num_micro,
                fixed,
                share,
                ticks,
                fill,
                micro_buf,
                ready,
            )
        else:
            move = _polish_step(
                h,
                POLISH_PARTNERS * level,
                level,
                members,
                counts,
                loads,
                exact,
                cost,
                weight,
                rank,
                stage_cols,
                num_stages,
                num_micro,
                fixed,
                share,
                ticks,
                fill,
                micro_buf,
                ready,
            )
        steps += 1
        l, a, b1, b2, t_h, t_l = move
        if l < 0:
            if level == MAX_LEVEL:
                break  # no level improves the slowest pipeline
            level += 1
            continue
        level = 0
        # h gives slot a and takes low's slots b1/b2 (-1: none).
        gone[0] = members[h, a]
        came[0] = members[l, b1] if b1 >= 0 else -1
        came[1] = members[l, b2] if b2 >= 0 else -1
        for x in (gone[0], came[0], came[1]):
            if x >= 0:
                pipeline[x] = l if x == gone[0] else h
        _loads_after(loads[h], cost, stage_cols[h], num_stages[h], gone, came, new)
        loads[h, : num_stages[h]] = new[: num_stages[h]]
        _loads_after(loads[l], cost, stage_cols[l], num_stages[l], came, gone, new)
        loads[l, : num_stages[l]] = new[: num_stages[l]]
        n1 = _edit(members[h], counts[h], a, -1, came[0], came[1], rank, row_h)
        n2 = _edit(members[l], counts[l], b1, b2, gone[0], -1, rank, row_l)
        members[h, :n1] = row_h[:n1]
        members[l, :n2] = row_l[:n2]
        counts[h] = n1
        counts[l] = n2
        exact[h] = t_h
        exact[l] = t_l

    for p in range(num_pipes):  # the final split, as timed
        s = num_stages[p]
        split(
            members[p], counts[p], loads[p], cost, stage_cols[p, :s], fixed[p, :s], num_micro[p], ticks, fill, micro_buf
        )
        for i in range(counts[p]):
            micro[members[p, i]] = micro_buf[i]
    return exact, steps, loads


# ---------------------------------------------------------------------- entry points


@dataclass(frozen=True, slots=True)
class SearchResult:
    pipeline: np.ndarray
    """``(N,)`` pipeline of each sample."""
    microbatch: np.ndarray
    """``(N,)`` its microbatch, in execution order."""
    seconds: np.ndarray
    """``(P,)`` each pipeline's exact 1F1B seconds, as the search kept them."""
    steps: int
    """Polish steps taken."""
    stage_loads: np.ndarray
    """``(P, S_max)`` ticks per stage (fixed costs included), as the search kept them."""


def place(problem, share: np.ndarray, polish_steps: int, good_enough: float):
    """Construction, then up to ``polish_steps`` polish steps.

    ``share``: each pipeline's target fraction of the batch's work (``ours.target_shares``).
    """
    weight = np.ascontiguousarray(problem.total_cost())
    order = descending(weight, problem.sample_ids)
    pipeline = construct(weight, order, share, problem.num_pipelines)
    pipeline = ensure_min_counts(problem, pipeline, weight)
    micro = np.empty(problem.num_samples, dtype=np.int64)
    exact, steps, loads = _search(
        pipeline,
        order,
        np.ascontiguousarray(problem.cost),
        weight,
        np.ascontiguousarray(problem.stage_index),
        problem.num_stages.astype(np.int64),
        problem.num_microbatches.astype(np.int64),
        np.ascontiguousarray(problem.microbatch_cost, dtype=float),
        np.ascontiguousarray(problem.forward_share, dtype=float),
        polish_steps,
        good_enough,
        micro,
    )
    return SearchResult(pipeline, micro, exact * problem.tick_s, steps, loads)


def warm_up() -> float:
    """Compile (or load from numba's on-disk cache) every kernel with the argument types ``place`` uses;
    returns the seconds it took. ``make setup`` runs it once, so workers and tests start warm."""
    import time

    from oobleck_mm.balance.problem import BalanceProblem

    start = time.perf_counter()
    rng = np.random.default_rng(0)
    num, cols = 24, 4
    cost = np.zeros((num, cols + 1))
    cost[:, :cols] = np.rint(rng.lognormal(8, 1, size=(num, cols)))
    problem = BalanceProblem(
        sample_ids=np.arange(num, dtype=np.int64),
        features=np.zeros((num, 1)),
        num_microbatches=np.array([4, 6], dtype=np.int64),
        num_stages=np.array([1, 3], dtype=np.int64),
        stage_index=np.array([[3, 4, 4], [0, 1, 2]], dtype=np.int64),
        cost=cost,
        microbatch_cost=np.array([10.0, 10.0, 10.0, 30.0, 0.0]),
        forward_share=np.full(cols + 1, 1 / 3),
        microbatch_size=None,
        seed=0,
        tick_s=1e-9,
    )
    place(problem, np.array([0.4, 0.6]), 8, 0.0)
    return time.perf_counter() - start


if __name__ == "__main__":
    print(f"balance.search kernels ready in {warm_up():.1f} s")
