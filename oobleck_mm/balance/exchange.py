"""Moving samples between paired pipelines: first-order candidates and proxy-checked exchange rounds.

Pipelines sorted by predicted time are paired slowest with fastest. For a
pair (high, low) a sample's *marginal* value on a pipeline is the first-order
change of that pipeline's (scaled) proxy time: with the proxy
``((M - 1) max_k L_k + sum_k L_k) / M``, adding a sample of stage costs
``c_k`` changes it by ``((M - 1) c_bottleneck + sum_k c_k) / M``, and
``sum_k c_k`` is the sample's whole-model cost on every pipeline. Different
pipelines have different bottleneck stages (vision-heavy, LLM-heavy), so the
same sample has different values on the two sides: this is where the
modality mix enters.

Candidates per pair: the best single move high -> low, and for every sample
``i`` of high the partner ``j`` of low whose value on high is nearest
``value_h(i) - (T_high - T_low) / 2`` (a sorted search, both neighbours),
i.e. the swap that brings the pair closest to even. ``exchange_rounds``
checks the best candidates of every pair on the exact stage loads and applies
the improving ones, all pairs at once, round after round.
"""

from __future__ import annotations

import numpy as np

from oobleck_mm.balance.problem import BalanceProblem


def slots(pipeline: np.ndarray, num_pipes: int, spare: int = 0, order: np.ndarray | None = None) -> np.ndarray:
    """``(P, n_max + spare)`` sample positions of each pipeline, in ``order`` (default: position); -1 pads."""
    order = np.arange(len(pipeline)) if order is None else order
    grouped = order[np.argsort(pipeline[order], kind="stable")]
    counts = np.bincount(pipeline, minlength=num_pipes)
    column = np.arange(len(grouped)) - np.repeat(np.cumsum(counts) - counts, counts)
    out = np.full((num_pipes, int(counts.max(initial=0)) + max(spare, 1)), -1, dtype=np.int64)
    out[pipeline[grouped], column] = grouped
    return out


def proxy_rows(problem: BalanceProblem, pipes: np.ndarray, loads: np.ndarray) -> np.ndarray:
    """``problem.proxy_times`` for chosen pipelines' stage loads ``(..., S_max)``."""
    m = problem.num_microbatches[pipes]
    return ((m - 1) * loads.max(axis=-1) + loads.sum(axis=-1)) / m


def marginal(problem: BalanceProblem, weight: np.ndarray, loads: np.ndarray, scale: np.ndarray,
             pipes: np.ndarray, samples: np.ndarray) -> np.ndarray:  # fmt: skip
    """First-order change of each pipeline's scaled proxy time per sample: ``(Q, n)``, +inf at holes."""
    m = problem.num_microbatches[pipes][:, None]
    bottleneck = problem.stage_index[pipes, np.argmax(loads[pipes], axis=1)][:, None]
    s = np.maximum(samples, 0)
    value = scale[pipes][:, None] * ((m - 1) * problem.cost_at(s, bottleneck) + np.take(weight, s)) / m
    return np.where(samples >= 0, value, np.inf)


def candidates(problem, weight, loads, scale, values, members, counts, high, low, per_pair: int, forced: int = 0):
    """Up to ``per_pair`` exchanges per pair, best first-order objective first.

    ``forced``: also include, whatever its first-order objective, the best swap of each
    of high's first ``forced`` slots (its heaviest samples when rows are sorted by
    ``microbatch.sort_members``): lumpiness is what first order misses.
    Returns slot indices ``a`` (into ``members[high]``) and ``b`` (into ``members[low]``,
    -1 for a move), each ``(Q, per_pair + forced)``; unusable entries have ``a = -1``.
    """
    mh, ml = members[high], members[low]
    both = np.concatenate([high, low, high, low])
    gh_i, gl_i, gh_j, gl_j = np.split(marginal(problem, weight, loads, scale, both, np.vstack([mh, mh, ml, ml])), 4)
    vh, vl = values[high][:, None], values[low][:, None]
    can_give = (counts[high] > problem.num_microbatches[high])[:, None]
    with np.errstate(invalid="ignore"):
        move = np.where(can_give & (mh >= 0), np.maximum(vh - gh_i, vl + gl_i), np.inf)
        partner, swap = _nearest_partners(vh, vl, gh_i, gl_i, gh_j, gl_j)
    # Pool: every move and every i's best swap; keep the per_pair lowest objectives (+ forced).
    width = mh.shape[1]
    slot = np.broadcast_to(np.arange(width), mh.shape)
    obj = np.concatenate([move, swap], axis=1)
    a_all = np.concatenate([slot, slot], axis=1)
    b_all = np.concatenate([np.full(mh.shape, -1), partner], axis=1)
    pick = np.argsort(obj, axis=1, kind="stable")[:, :per_pair]
    if forced:
        pick = np.concatenate([pick, np.tile(width + np.arange(forced), (len(high), 1))], axis=1)
    a = np.take_along_axis(a_all, pick, axis=1)
    b = np.take_along_axis(b_all, pick, axis=1)
    return np.where(np.isfinite(np.take_along_axis(obj, pick, axis=1)), a, -1), b


def two_for_one(problem, weight, loads, scale, values, members, high, low, forced: int):
    """For each of high's first ``forced`` slots ``i``: two samples ``j1, j2`` of low to take for it,
    with ``value_h(j1) + value_h(j2)`` nearest ``value_h(i) - (T_high - T_low) / 2``.

    A heavy sample makes its microbatch (and so the pipeline) lumpy; trading it for two
    lighter ones evens the pipeline in a way a one-for-one swap cannot. Returns slots
    ``(a, b1, b2)``, each ``(Q, forced)``; ``b1 = -1`` where low has no such pair.
    """
    mh, ml = members[high][:, :forced], members[low]
    both = np.concatenate([high, high])
    gh_i, gh_j = np.split(marginal(problem, weight, loads, scale, both, _pad_stack(mh, ml)), 2)
    gh_i = gh_i[:, :forced]
    want = gh_i - (values[high] - values[low])[:, None] / 2  # (Q, F): what j1 + j2 should be worth
    order = np.argsort(gh_j, axis=1, kind="stable")
    keys = np.take_along_axis(gh_j, order, axis=1)
    rows = np.arange(len(high))[:, None]
    best = (np.full(want.shape, np.inf), np.full(want.shape, -1), np.full(want.shape, -1))
    for f in range(forced):
        rest = want[:, f : f + 1] - keys  # (Q, W): ideal value of j2 for each j1 (in sorted order)
        pos = _row_searchsorted(keys, rest)
        for shift in (-1, 0):
            k2 = np.clip(pos + shift, 0, keys.shape[1] - 1)
            k1 = np.broadcast_to(np.arange(keys.shape[1]), k2.shape)
            with np.errstate(invalid="ignore"):
                err = np.abs(keys + np.take_along_axis(keys, k2, axis=1) - want[:, f : f + 1])
            err = np.where((k1 != k2) & np.isfinite(err), err, np.inf)
            pick = np.argmin(err, axis=1)
            e = err[rows[:, 0], pick]
            better = e < best[0][:, f]
            best[0][:, f] = np.where(better, e, best[0][:, f])
            best[1][:, f] = np.where(better, order[rows[:, 0], pick], best[1][:, f])
            best[2][:, f] = np.where(better, order[rows[:, 0], k2[rows[:, 0], pick]], best[2][:, f])
    a = np.where(mh >= 0, np.arange(forced)[None, :], -1)
    return a, np.where(np.isfinite(best[0]), best[1], -1), np.where(np.isfinite(best[0]), best[2], -1)


def _pad_stack(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Stack two member matrices of different widths, padding with holes."""
    width = max(a.shape[1], b.shape[1])
    pad = lambda x: np.pad(x, ((0, 0), (0, width - x.shape[1])), constant_values=-1)  # noqa: E731
    return np.vstack([pad(a), pad(b)])


def _nearest_partners(vh, vl, gh_i, gl_i, gh_j, gl_j) -> tuple[np.ndarray, np.ndarray]:
    """For each ``i`` of high: the slot ``j`` of low making the best swap, and its first-order objective."""
    want = gh_i - (vh - vl) / 2
    order = np.argsort(gh_j, axis=1, kind="stable")  # holes (+inf) last
    keys = np.take_along_axis(gh_j, order, axis=1)
    pos = _row_searchsorted(keys, want)
    rows = np.arange(len(vh))[:, None]
    best_obj = np.full(gh_i.shape, np.inf)
    best_j = np.zeros(gh_i.shape, dtype=np.int64)
    for shift in (-1, 0):
        j = order[rows, np.clip(pos + shift, 0, keys.shape[1] - 1)]
        obj = np.maximum(vh - gh_i + gh_j[rows, j], vl - gl_j[rows, j] + gl_i)
        obj = np.where(np.isfinite(gh_i) & np.isfinite(gh_j[rows, j]), obj, np.inf)
        better = obj < best_obj
        best_obj = np.where(better, obj, best_obj)
        best_j = np.where(better, j, best_j)
    return best_j, best_obj


def _row_searchsorted(keys: np.ndarray, queries: np.ndarray) -> np.ndarray:
    """``np.searchsorted`` of each row of ``queries`` in the same row of ``keys`` (ascending; inf allowed)."""
    finite = np.concatenate([keys[np.isfinite(keys)], queries[np.isfinite(queries)]])
    if not finite.size:
        return np.zeros(queries.shape, dtype=np.int64)
    lo, span = finite.min(), finite.max() - finite.min() + 1.0

    def banded(x):  # each row into its own band [row * 2 span, row * 2 span + span]
        x = np.clip(np.where(np.isfinite(x), x, lo + span), lo, lo + span) - lo
        return (x + (np.arange(len(keys)) * 2 * span)[:, None]).ravel()

    pos = np.searchsorted(banded(keys), banded(queries)).reshape(queries.shape)
    return pos - (np.arange(len(keys)) * keys.shape[1])[:, None]


def apply_loads(problem, loads, high, low, give, take):
    """Stage loads ``(Q, S)`` of high and low after high gives ``give`` and takes ``take`` (-1: none)."""
    g, t = np.maximum(give, 0), np.maximum(take, 0)
    swap = (take >= 0)[..., None]
    new_h = loads[high] - problem.sample_stage_cost(g, high) + np.where(swap, problem.sample_stage_cost(t, high), 0.0)
    new_l = loads[low] + problem.sample_stage_cost(g, low) - np.where(swap, problem.sample_stage_cost(t, low), 0.0)
    return new_h, new_l


def exchange_rounds(problem: BalanceProblem, pipeline: np.ndarray, weight: np.ndarray, scale: np.ndarray,
                    max_rounds: int, per_pair: int = 3) -> np.ndarray:  # fmt: skip
    """Rounds of the best proxy-checked move or swap per pair, all pairs at once, until none improves."""
    num_pipes = problem.num_pipelines
    pipeline = pipeline.copy()
    loads = problem.stage_loads(pipeline)
    counts = np.bincount(pipeline, minlength=num_pipes)
    members = slots(pipeline, num_pipes, spare=max_rounds)
    free = counts.copy()  # next free slot of each row (holes left by moves are not reused)
    for _ in range(max_rounds):
        values = scale * problem.proxy_times(loads)
        high, low = pairs(values)
        if not len(high):
            break
        a, b = candidates(problem, weight, loads, scale, values, members, counts, high, low, per_pair)
        rows = np.arange(len(high))[:, None]
        give = np.where(a >= 0, members[high[:, None], np.maximum(a, 0)], -1)
        take = np.where(b >= 0, members[low[:, None], np.maximum(b, 0)], -1)
        new_h, new_l = apply_loads(problem, loads, high[:, None], low[:, None], give, take)
        after = np.maximum(scale[high][:, None] * proxy_rows(problem, high[:, None], new_h),
                           scale[low][:, None] * proxy_rows(problem, low[:, None], new_l))  # fmt: skip
        after = np.where(give >= 0, after, np.inf)
        c = np.argmin(after, axis=1)
        gain = after[rows[:, 0], c] < values[high]
        if not gain.any():
            break
        q = np.nonzero(gain)[0]
        slow, fast, a, b, give, take = high[q], low[q], a[q, c[q]], b[q, c[q]], give[q, c[q]], take[q, c[q]]
        loads[slow], loads[fast] = new_h[q, c[q]], new_l[q, c[q]]
        pipeline[give] = fast
        swapped = take >= 0
        pipeline[take[swapped]] = slow[swapped]
        # A swap exchanges two entries; a move leaves a hole and appends to the receiver.
        members[slow, a] = take
        members[fast[swapped], b[swapped]] = give[swapped]
        moved = ~swapped
        members[fast[moved], free[fast[moved]]] = give[moved]
        free[fast[moved]] += 1
        counts[slow[moved]] -= 1
        counts[fast[moved]] += 1
    return pipeline


def pairs(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Slowest with fastest, second slowest with second fastest, ...: only pairs with a gap; ties by index."""
    ranked = np.lexsort((np.arange(len(values)), -values))
    half = len(values) // 2
    high, low = ranked[:half], ranked[::-1][:half]
    keep = values[high] > values[low]
    return high[keep], low[keep]
