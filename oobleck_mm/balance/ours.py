"""The default placement ("ours"): speed-weighted targets, LPT + proportional dealing, exchanges, exact polish.

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
3. Exchanges on the proxy (``exchange.exchange_rounds``): slowest paired with
   fastest, best move or swap per pair, all pairs at once.
4. Microbatches (``microbatch.split``): stratified dealing, light - heavy -
   light order; then every pipeline is timed exactly.
5. Calibration. The proxy assumes equal microbatches; real ones are lumpy (a
   few heavy samples), which costs each pipeline 0-25 % more depending on its
   exact samples, not only on its shape. Each pipeline's exact / proxy ratio
   rescales its proxy and steps 3-4 run again; the better result is kept.
6. Exact polish. The slowest pipelines, each paired with several of the
   fastest, try a few exchanges (first-order ones, the best swap of the
   slow pipeline's heaviest sample, and that sample for two lighter ones);
   candidates are re-split and timed exactly, all at once, and each pipeline
   takes part in at most one applied exchange per round.

Scales (exact seconds / proxy ticks per pipeline) make every comparison in
seconds; only ratios between pipelines matter to the exchanges.
"""

from __future__ import annotations

import heapq

import numpy as np

from oobleck_mm.balance.exchange import candidates, exchange_rounds, proxy_rows, slots, two_for_one
from oobleck_mm.balance.microbatch import placement_arrays, sort_members, split
from oobleck_mm.balance.problem import BalanceProblem, Placement
from oobleck_mm.balance.split import descending, ensure_min_counts, proportional_counts

HEAD_PER_PIPELINE = 2
EXCHANGE_ROUNDS = 8
CALIBRATIONS = 2
POLISH_ROUNDS = 6
GOOD_ENOUGH = 0.005
"""Stop refining once predicted max/mean is within this: below the cost model's own accuracy."""
POLISH_PAIRS = 8
POLISH_PARTNERS = 3
POLISH_CANDIDATES = 2
POLISH_FORCED = 1
POLISH_VERIFIED = 2


def ours(problem: BalanceProblem, *, calibrations: int | None = None, polish_rounds: int | None = None) -> Placement:
    """The default placement; ``ours_fast`` is this with one calibration and no exact polish."""
    calibrations = CALIBRATIONS if calibrations is None else calibrations
    polish_rounds = POLISH_ROUNDS if polish_rounds is None else polish_rounds
    weight = problem.total_cost()
    order = descending(weight, problem.sample_ids)
    pipeline = _construct(problem, weight, order, target_shares(problem))
    pipeline = ensure_min_counts(problem, pipeline, weight)
    scale = np.ones(problem.num_pipelines)
    best = None
    for _ in range(max(calibrations, 1)):
        pipeline = exchange_rounds(problem, pipeline, weight, scale, EXCHANGE_ROUNDS)
        state = _evaluate(problem, pipeline, weight, polish_rounds)
        if best is None or state[3].max() < best[3].max():
            best = state
        if _good_enough(best[3]):
            break
        # Each pipeline's exact / proxy ratio rescales its proxy for the next exchanges.
        scale = state[3] / problem.proxy_times(problem.stage_loads(pipeline))
    members, micro, ticks, exact = best
    members, micro = _polish(problem, weight, members, micro, ticks, exact, polish_rounds)
    return Placement(*placement_arrays(problem, members, micro))


def ours_fast(problem: BalanceProblem) -> Placement:
    """``ours`` without the exact polish and with a single calibration: several times cheaper."""
    return ours(problem, calibrations=1, polish_rounds=0)


def _evaluate(problem: BalanceProblem, pipeline: np.ndarray, weight: np.ndarray, spare: int):
    """Split every pipeline into microbatches and time it exactly: (members, micro, ticks, seconds).

    Member rows keep ``spare`` empty slots for samples the polish may add.
    """
    pipes = np.arange(problem.num_pipelines)
    members = sort_members(problem, slots(pipeline, problem.num_pipelines, spare=spare), weight)
    micro, ticks = split(problem, pipes, members)
    return members, micro, ticks, problem.iteration_seconds(pipes, ticks)


def _good_enough(exact: np.ndarray) -> bool:
    return bool(exact.max() <= (1 + GOOD_ENOUGH) * exact.mean())


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


# ---------------------------------------------------------------------- 2. construction


def _construct(problem: BalanceProblem, weight: np.ndarray, order: np.ndarray, share: np.ndarray) -> np.ndarray:
    num_pipes = problem.num_pipelines
    capacity = np.maximum(share * weight.sum(), 1e-300)
    pipeline = np.zeros(problem.num_samples, dtype=np.int64)
    loads = np.zeros(num_pipes)
    head = order[: HEAD_PER_PIPELINE * num_pipes]
    heap = [(0.0, p) for p in range(num_pipes)]
    for s in head:
        _, p = heapq.heappop(heap)
        pipeline[s] = p
        loads[p] += weight[s]
        heapq.heappush(heap, (loads[p] / capacity[p], p))
    tail = order[len(head) :]
    if len(tail):
        counts = proportional_counts(len(tail), np.maximum(capacity - loads, 0.0))
        owner = np.repeat(np.arange(num_pipes), counts)
        rank = np.arange(len(owner)) - np.repeat(np.cumsum(counts) - counts, counts)
        spot = (rank + 0.5) / np.repeat(np.maximum(counts, 1), counts)
        pipeline[tail] = owner[np.lexsort((owner, spot))]
    return pipeline


# ---------------------------------------------------------------------- 5. exact polish


def _polish(problem, weight, members, micro, ticks, exact, rounds: int):
    """Improvements judged by the exact 1F1B time of re-split candidates (see the module docstring)."""
    num_pipes = problem.num_pipelines
    for _ in range(rounds):
        if _good_enough(exact):
            break
        counts = (members >= 0).sum(axis=1)
        loads = ticks.sum(axis=2)
        proxy = proxy_rows(problem, np.arange(num_pipes), loads)
        scale = exact / np.maximum(proxy, 1e-300)
        high, low = _polish_pairs(exact)
        if not len(high):
            break
        values = scale * proxy
        a, b = candidates(problem, weight, loads, scale, values, members, counts, high, low,
                          POLISH_CANDIDATES, forced=POLISH_FORCED)  # fmt: skip
        a2, b1, b2 = two_for_one(problem, weight, loads, scale, values, members, high, low, POLISH_FORCED)
        a = np.concatenate([a, np.where(b1 >= 0, a2, -1)], axis=1)
        b2 = np.concatenate([np.full(b.shape, -1), b2], axis=1)
        b = np.concatenate([b, b1], axis=1)
        rows_h, rows_l = _candidate_rows(members, high, low, a, b, b2)
        q, k = a.shape
        # The slow side of every candidate exactly; the fast side first by its current
        # exact/proxy ratio, then exactly for the few most promising candidates of each pair.
        slow_side = _timed(problem, np.repeat(high, k), rows_h, weight)
        h_exact = np.where(a.ravel() >= 0, slow_side[3], np.inf).reshape(q, k)
        l_pipes = np.repeat(low, k)
        estimate = np.maximum(h_exact, (scale[l_pipes] * _row_proxy(problem, l_pipes, rows_l)).reshape(q, k))
        best = np.argsort(estimate, axis=1, kind="stable")[:, :POLISH_VERIFIED]
        promising = np.take_along_axis(estimate, best, axis=1) < exact[high][:, None]
        flat = (np.arange(q)[:, None] * k + best)[promising]
        if not len(flat):
            break
        fast_side = _timed(problem, l_pipes[flat], rows_l[flat], weight)
        after = np.full(q * k, np.inf)
        after[flat] = np.maximum(h_exact.ravel()[flat], fast_side[3])
        chosen = _choose(high, low, after.reshape(q, k), exact)
        if not chosen:
            break
        where_l = {int(f): i for i, f in enumerate(flat)}
        for pair, c in chosen:
            inst = pair * k + c
            for pipe, state, i in ((high[pair], slow_side, inst), (low[pair], fast_side, where_l[inst])):
                members[pipe], micro[pipe], ticks[pipe], exact[pipe] = (x[i] for x in state)
    return members, micro


def _timed(problem: BalanceProblem, pipes: np.ndarray, rows: np.ndarray, weight: np.ndarray):
    """(members, micro, ticks, seconds) of candidate member rows of ``pipes``, split and timed exactly."""
    members = sort_members(problem, rows, weight)
    micro, ticks = split(problem, pipes, members)
    return members, micro, ticks, problem.iteration_seconds(pipes, ticks)


def _row_proxy(problem: BalanceProblem, pipes: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Proxy ticks of candidate member rows (``problem.proxy_times`` of their stage loads)."""
    cost = problem.sample_stage_cost(np.maximum(rows, 0), pipes[:, None]) * (rows >= 0)[:, :, None]
    loads = cost.sum(axis=1) + problem.num_microbatches[pipes][:, None] * problem.microbatch_cost[problem.stage_index[pipes]]
    return proxy_rows(problem, pipes, loads)


def _polish_pairs(exact: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The slowest pipelines (those not yet good enough), each paired with several of the fastest."""
    ranked = np.lexsort((np.arange(len(exact)), -exact))
    limit = max(POLISH_PAIRS, len(exact) // 8)
    num = min(int((exact > (1 + GOOD_ENOUGH) * exact.mean()).sum()), len(exact) // 2, limit)
    pool = ranked[::-1][: min(len(exact) - num, max(num, POLISH_PARTNERS))]
    if not num or not len(pool):
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    tries = min(POLISH_PARTNERS, len(pool))
    high = np.repeat(ranked[:num], tries)
    low = pool[(np.arange(num)[:, None] + np.arange(tries)[None, :]).ravel() % len(pool)]
    return high, low


def _choose(high: np.ndarray, low: np.ndarray, after: np.ndarray, exact: np.ndarray) -> list[tuple[int, int]]:
    """Improving (pair, candidate) picks, slowest high first, each pipeline in at most one pick."""
    best = np.argmin(after, axis=1)
    value = after[np.arange(len(high)), best]
    used: set[int] = set()
    chosen = []
    for pair in np.lexsort((value, -exact[high])):  # slowest high first, then its best pair
        slow, fast = int(high[pair]), int(low[pair])
        if slow in used or fast in used or not value[pair] < exact[slow]:
            continue
        used.update((slow, fast))  # membership only: never iterated, so no order dependence
        chosen.append((int(pair), int(best[pair])))
    return chosen


def _candidate_rows(members, high, low, a, b, b2):
    """Member rows ``(Q*k, W)`` of high and of low after each candidate exchange.

    Candidate: high gives slot ``a`` and takes low's slot ``b`` (-1: nothing) and ``b2``
    (-1: nothing). What a row gains beyond what it gives goes into its first hole
    (rows keep spare columns).
    """
    q, k = a.shape
    row_h = np.repeat(members[high], k, axis=0)
    row_l = np.repeat(members[low], k, axis=0)
    idx = np.arange(q * k)
    a, b, b2 = a.ravel(), b.ravel(), b2.ravel()
    use = a >= 0
    give = np.where(use, row_h[idx, np.maximum(a, 0)], -1)
    take = np.where(use & (b >= 0), row_l[idx, np.maximum(b, 0)], -1)
    take2 = np.where(use & (b2 >= 0), row_l[idx, np.maximum(b2, 0)], -1)
    hole_h = np.argmax(row_h < 0, axis=1)
    hole_l = np.argmax(row_l < 0, axis=1)
    # High: slot a <- take (or a hole), first hole <- take2.
    row_h[idx[use], a[use]] = take[use]
    two = use & (take2 >= 0)
    row_h[idx[two], hole_h[two]] = take2[two]
    # Low: slot b <- give (a move: its first hole), slot b2 <- hole.
    slot_l = np.where(b >= 0, b, hole_l)
    row_l[idx[use], slot_l[use]] = give[use]
    row_l[idx[two], b2[two]] = -1
    return row_h, row_l
