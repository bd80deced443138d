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

import heapq
from dataclasses import dataclass

import numpy as np

from oobleck_mm.balance.split import descending, ensure_min_counts, proportional_counts

try:
    from numba import njit
except ImportError:  # pragma: no cover - numba is a dependency; this keeps the code runnable without it

    def njit(*args, **kwargs):
        if args and callable(args[0]):
            return args[0]
        return lambda fn: fn


CACHE = True

HEAD_PER_PIPELINE = 2
POLISH_PARTNERS = 3
POLISH_CANDIDATES = 2
POLISH_VERIFIED = 2
MOVE_CANDIDATES = 1
MOVE_VERIFIED = 2
MAX_LEVEL = 2
"""Polish escalation: level 0 moves one sample; level L tries swaps and two-for-ones with 3 L partners
and h's L heaviest samples. A level 3 (9 partners) takes the 256 x 16-sample benchmark row from 1.027
to 1.016 but from 4.5 to 6.4 ms (it unsticks the polish, which then runs to its step cap); rows with
64+ samples per pipeline never need it."""


# ---------------------------------------------------------------------- one pipeline


@njit(cache=CACHE)
def _argsort_small(keys, m, out):
    """``out[:m]`` = argsort of ``keys[:m]``, stable (ties by index): an insertion sort, started
    from the reversed order because fills arrive roughly descending (members are heaviest first)."""
    for i in range(m):
        out[i] = m - 1 - i
    for i in range(1, m):
        x = out[i]
        key = keys[x]
        j = i
        while j > 0 and (keys[out[j - 1]] > key or (keys[out[j - 1]] == key and out[j - 1] > x)):
            out[j] = out[j - 1]
            j -= 1
        out[j] = x


@njit(cache=CACHE)
def split(row, n, load, cost, cols, fixed, m, ticks, fill, micro_of_slot):
    """Deal ``row[:n]`` (heaviest first) into ``m`` microbatches; ``ticks[k, b]``: stage k, microbatch b.

    ``load[k]``: the members' ticks on stage k plus ``m`` fixed costs (the caller keeps it);
    ``cols``: the pipeline's stage columns of ``cost``; ``fixed[k]``: ticks per microbatch.
    Writes each member's microbatch (execution order) into ``micro_of_slot[:n]``.
    """
    s = len(cols)
    inv = np.empty(s)
    target = np.empty(m, dtype=np.int64)
    for k in range(s):
        inv[k] = 1.0 / max(load[k] / m, 1.0)
        for b in range(m):
            ticks[k, b] = fixed[k]
    for j in range(min(m, n)):  # round 0: every microbatch equally empty, so in number order
        micro_of_slot[j] = j
        for k in range(s):
            ticks[k, j] += cost[row[j], cols[k]]
    for start in range(m, n, m):
        for b in range(m):
            f = 0.0
            for k in range(s):
                f = max(f, ticks[k, b] * inv[k])
            fill[b] = f
        _argsort_small(fill, m, target)  # least filled first; ties by number
        for j in range(min(m, n - start)):
            b = target[j]
            sample = row[start + j]
            micro_of_slot[start + j] = b
            for k in range(s):
                ticks[k, b] += cost[sample, cols[k]]
    # Light - heavy - light: ascending rank r runs at r / 2 (even r) or m - 1 - (r - 1) / 2 (odd r).
    for b in range(m):
        f = 0.0
        for k in range(s):
            f = max(f, ticks[k, b])
        fill[b] = f
    ascending = target
    _argsort_small(fill, m, ascending)
    position = np.empty(m, dtype=np.int64)
    for r in range(m):
        position[ascending[r]] = r // 2 if r % 2 == 0 else m - 1 - (r - 1) // 2
    for k in range(s):
        for b in range(m):
            fill[position[b]] = ticks[k, b]
        for b in range(m):
            ticks[k, b] = fill[b]
    for i in range(n):
        micro_of_slot[i] = position[micro_of_slot[i]]


@njit(cache=CACHE)
def pipeline_time(ticks, share, s, m, ready):
    """Exact 1F1B iteration ticks of one pipeline (``schedule_time`` explains the recurrence).

    Row ``k + 1`` of ``ready`` is stage ``k``; boundary ``p`` joins stages ``p - 1`` (it runs the
    backward of microbatch ``(t + p) / 2 - s``) and ``p`` (the forward of ``(t - p) / 2``).
    """
    for i in range(s + 2):
        ready[i] = 0.0
    for t in range(2 * (m + s - 1)):
        for p in range(t % 2, s + 1, 2):
            g = (t + p) // 2 - s
            a = (t - p) // 2
            has_g = p >= 1 and 0 <= g < m
            has_a = p < s and t >= p and 0 <= a < m
            if p >= 1 and p < s and (has_g or has_a):
                v = max(ready[p], ready[p + 1])
                ready[p] = v
                ready[p + 1] = v
            if has_g:
                c = ticks[p - 1, g]
                ready[p] += c - c * share[p - 1]
            if has_a:
                ready[p + 1] += ticks[p, a] * share[p]
    best = 0.0
    for k in range(1, s + 1):
        best = max(best, ready[k])
    return best


@njit(cache=CACHE)
def _time_row(row, n, load, cost, cols, fixed, share, m, ticks, fill, micro_of_slot, ready):
    split(row, n, load, cost, cols, fixed, m, ticks, fill, micro_of_slot)
    return pipeline_time(ticks, share, len(cols), m, ready)


# ---------------------------------------------------------------------- rows and loads


@njit(cache=CACHE)
def _edit(src, n, rm1, rm2, add1, add2, rank, out):
    """``src[:n]`` without slots ``rm1``/``rm2`` (-1: none), with samples ``add1``/``add2`` (-1: none)
    merged in rank order (heaviest first) into ``out``; returns the new length."""
    if add1 >= 0 and add2 >= 0 and rank[add2] < rank[add1]:
        add1, add2 = add2, add1
    if add1 < 0:
        add1, add2 = add2, -1
    k = 0
    for i in range(n):
        if i == rm1 or i == rm2:
            continue
        x = src[i]
        while add1 >= 0 and rank[add1] < rank[x]:
            out[k] = add1
            k += 1
            add1, add2 = add2, -1
        out[k] = x
        k += 1
    while add1 >= 0:
        out[k] = add1
        k += 1
        add1, add2 = add2, -1
    return k


@njit(cache=CACHE)
def _proxy(load, s, m):
    top = 0.0
    total = 0.0
    for k in range(s):
        top = max(top, load[k])
        total += load[k]
    return ((m - 1) * top + total) / m


@njit(cache=CACHE)
def _bottleneck(load, s):
    best = 0
    for k in range(1, s):
        if load[k] > load[best]:
            best = k
    return best


@njit(cache=CACHE)
def _values(row, n, cost, weight, col, m, scale, out):
    """First-order change of a pipeline's scaled proxy per member: ``scale ((M - 1) c_bottleneck + w) / M``."""
    for i in range(n):
        x = row[i]
        out[i] = scale * ((m - 1) * cost[x, col] + weight[x]) / m


@njit(cache=CACHE)
def _loads_after(load, cost, cols, s, out_samples, in_samples, out):
    for k in range(s):
        v = load[k]
        for x in out_samples:
            if x >= 0:
                v -= cost[x, cols[k]]
        for x in in_samples:
            if x >= 0:
                v += cost[x, cols[k]]
        out[k] = v


# ---------------------------------------------------------------------- candidates


@njit(cache=CACHE)
def _candidates(vh_h, vh_l, vl_h, vl_l, nh, nl, gap_h, gap_l, can_move, limit, out):
    """Best first-order exchanges between high and low: rows ``(objective, slot_h, slot_l)`` in ``out``.

    ``vh_h[i]``/``vl_h[i]``: value of high's member ``i`` on high / on low; ``vh_l[j]``/``vl_l[j]``: the
    same for low's member ``j``. ``gap_h``/``gap_l``: the pair's current (scaled) times. A move
    (slot_l = -1) is allowed when ``can_move``. Returns how many rows were written (at most ``limit``).
    """
    order = np.argsort(vh_l[:nl], kind="mergesort")
    keys = vh_l[:nl][order]
    count = 0
    for i in range(nh):
        # Move i: high loses vh_h[i], low gains vl_h[i].
        if can_move:
            obj = max(gap_h - vh_h[i], gap_l + vl_h[i])
            count = _keep(out, count, limit, obj, i, -1)
        # Swap i for the j whose value on high is nearest vh_h[i] - (gap_h - gap_l) / 2.
        want = vh_h[i] - (gap_h - gap_l) / 2
        pos = np.searchsorted(keys, want)
        for q in (pos - 1, pos):
            if 0 <= q < nl:
                j = order[q]
                obj = max(gap_h - vh_h[i] + vh_l[j], gap_l + vl_h[i] - vl_l[j])
                count = _keep(out, count, limit, obj, i, j)
    return count


@njit(cache=CACHE)
def _keep(out, count, limit, obj, a, b):
    """Insert (obj, a, b) into the ``limit`` best rows of ``out`` (sorted ascending; ties keep the first)."""
    if count == limit and obj >= out[count - 1, 0]:
        return count
    pos = count if count < limit else limit - 1
    while pos > 0 and out[pos - 1, 0] > obj:
        if pos < limit:
            out[pos, 0] = out[pos - 1, 0]
            out[pos, 1] = out[pos - 1, 1]
            out[pos, 2] = out[pos - 1, 2]
        pos -= 1
    out[pos, 0] = obj
    out[pos, 1] = a
    out[pos, 2] = b
    return min(count + 1, limit)


@njit(cache=CACHE)
def _two_for_one(vh_h_a, vh_l, nl, want):
    """Two members of low whose values on high sum nearest ``want``: (j1, j2), or (-1, -1)."""
    if nl < 2:
        return -1, -1
    order = np.argsort(vh_l[:nl], kind="mergesort")
    keys = vh_l[:nl][order]
    best = np.inf
    b1 = -1
    b2 = -1
    for q1 in range(nl):
        pos = np.searchsorted(keys, want - keys[q1])
        for q2 in (pos - 1, pos):
            if 0 <= q2 < nl and q2 != q1:
                err = abs(keys[q1] + keys[q2] - want)
                if err < best:
                    best = err
                    b1 = order[q1]
                    b2 = order[q2]
    return b1, b2


# ---------------------------------------------------------------------- construction


@njit(cache=CACHE)
def _lpt_head(weight, order, capacity, head):
    """Pipeline of each of the ``head`` heaviest samples by LPT (least filled first, ties by number),
    and every pipeline's load after them."""
    num_pipes = len(capacity)
    loads = np.zeros(num_pipes)
    pipeline = np.zeros(len(weight), dtype=np.int64)
    heap = [(0.0, p) for p in range(num_pipes)]  # (fill, pipeline)
    heapq.heapify(heap)
    for i in range(head):
        _, p = heapq.heappop(heap)
        pipeline[order[i]] = p
        loads[p] += weight[order[i]]
        heapq.heappush(heap, (loads[p] / capacity[p], p))
    return pipeline, loads


def construct(weight: np.ndarray, order: np.ndarray, share: np.ndarray, num_pipes: int) -> np.ndarray:
    """Pipeline of each sample (module docstring, 3): the LPT head, then the tail dealt at evenly
    spaced ranks, each pipeline getting a count proportional to its remaining capacity."""
    capacity = np.maximum(np.asarray(share, dtype=float) * weight.sum(), 1e-300)
    head = min(HEAD_PER_PIPELINE * num_pipes, len(order))
    pipeline, loads = _lpt_head(weight, order, capacity, head)
    counts = proportional_counts(len(order) - head, np.maximum(capacity - loads, 0.0))
    owner = np.repeat(np.arange(num_pipes), counts)
    rank = np.arange(len(owner)) - np.repeat(np.cumsum(counts) - counts, counts)
    spot = (rank + 0.5) / np.repeat(np.maximum(counts, 1), counts)
    pipeline[order[head:]] = owner[np.argsort(spot, kind="stable")]  # ties by pipeline number
    return pipeline


# ---------------------------------------------------------------------- polish steps


@njit(cache=CACHE)
def _fastest(exact, k, exclude):
    """Indices of the ``k`` smallest ``exact`` other than ``exclude``, ascending (ties by index)."""
    out = np.empty(min(k, len(exact) - 1), dtype=np.int64)
    n = 0
    for p in range(len(exact)):
        if p == exclude:
            continue
        if n == len(out) and not exact[p] < exact[out[n - 1]]:
            continue
        pos = n if n < len(out) else n - 1
        while pos > 0 and exact[out[pos - 1]] > exact[p]:
            if pos < len(out):
                out[pos] = out[pos - 1]
            pos -= 1
        out[pos] = p
        n = min(n + 1, len(out))
    return out


@njit(cache=CACHE)
def _move_step(
    h,
    partners,
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
):
    """The cheap polish step: slowest pipeline ``h`` gives one member to one of its ``partners`` fastest.

    Which member: the few whose first-order move to the fastest pipeline evens the pair best, and
    the heaviest (lumpiness); h without each is timed exactly (that does not depend on the
    receiver). Removals are tried best first, receivers in the order of their scaled-proxy
    estimate; the first pair timed exactly below ``exact[h]`` is taken. Returns ``(l, slot_h,
    -1, -1, t_h, t_l)``, ``l = -1`` when no move lowers ``exact[h]``.
    """
    num_pipes, width = members.shape
    result = (-1, -1, -1, -1, 0.0, 0.0)
    nh, sh, mh = counts[h], num_stages[h], num_micro[h]
    if nh <= mh:
        return result  # every microbatch needs a sample: h has none to spare
    fast = _fastest(exact, partners, h)
    l0 = fast[0]
    sl0, ml0 = num_stages[l0], num_micro[l0]
    vh = np.empty(nh)
    vl = np.empty(nh)
    _values(
        members[h],
        nh,
        cost,
        weight,
        stage_cols[h, _bottleneck(loads[h], sh)],
        mh,
        exact[h] / max(_proxy(loads[h], sh, mh), 1e-300),
        vh,
    )
    _values(
        members[h],
        nh,
        cost,
        weight,
        stage_cols[l0, _bottleneck(loads[l0], sl0)],
        ml0,
        exact[l0] / max(_proxy(loads[l0], sl0, ml0), 1e-300),
        vl,
    )
    pick = np.empty((MOVE_CANDIDATES, 3))
    found = 0
    for i in range(1, nh):  # slot 0 (the heaviest) is always tried
        found = _keep(pick, found, MOVE_CANDIDATES, max(exact[h] - vh[i], exact[l0] + vl[i]), i, -1)
    slots = np.empty(found + 1, dtype=np.int64)
    slots[0] = 0
    for c in range(found):
        slots[c + 1] = int(pick[c, 1])
    row = np.empty(width, dtype=np.int64)
    t_high = np.empty(found + 1)
    gone = np.full(1, -1, dtype=np.int64)
    new_h = np.empty(stage_cols.shape[1])
    for c in range(found + 1):
        gone[0] = members[h, slots[c]]
        _loads_after(loads[h], cost, stage_cols[h], sh, gone, gone[:0], new_h)
        n1 = _edit(members[h], nh, slots[c], -1, -1, -1, rank, row)
        t_high[c] = _time_row(
            row, n1, new_h, cost, stage_cols[h, :sh], fixed[h, :sh], share[h, :sh], mh, ticks, fill, micro_buf, ready
        )
    order = np.argsort(t_high)
    estimate = np.empty(len(fast))
    new_l = np.empty(stage_cols.shape[1])
    for r in range(min(MOVE_VERIFIED, found + 1)):
        c = order[r]
        if not t_high[c] < exact[h]:
            break
        gone[0] = members[h, slots[c]]
        for q in range(len(fast)):
            l = fast[q]
            sl, ml = num_stages[l], num_micro[l]
            _loads_after(loads[l], cost, stage_cols[l], sl, gone[:0], gone, new_l)
            scale_l = exact[l] / max(_proxy(loads[l], sl, ml), 1e-300)
            estimate[q] = scale_l * _proxy(new_l, sl, ml)
        for q in np.argsort(estimate):
            l = fast[q]
            nl, sl, ml = counts[l], num_stages[l], num_micro[l]
            if nl >= width:
                continue
            _loads_after(loads[l], cost, stage_cols[l], sl, gone[:0], gone, new_l)
            n2 = _edit(members[l], nl, -1, -1, gone[0], -1, rank, row)
            t_low = _time_row(
                row,
                n2,
                new_l,
                cost,
                stage_cols[l, :sl],
                fixed[l, :sl],
                share[l, :sl],
                ml,
                ticks,
                fill,
                micro_buf,
                ready,
            )
            if max(t_high[c], t_low) < exact[h]:
                return (l, slots[c], -1, -1, t_high[c], t_low)
    return result


@njit(cache=CACHE)
def _polish_step(
    h,
    partners,
    forced,
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
):
    """The best exchange between slowest pipeline ``h`` and one of its ``partners`` fastest, judged by
    exact times: ``(l, slot_h, slot_l1, slot_l2, t_h, t_l)``, ``l = -1`` when none lowers ``exact[h]``.

    Candidates per partner: the first-order best few, for each of h's ``forced`` heaviest members
    the swap that first-order says evens the pair, and that member for two of low's.
    """
    num_pipes, width = members.shape
    s_max = stage_cols.shape[1]
    row_h = np.empty(width, dtype=np.int64)
    row_l = np.empty(width, dtype=np.int64)
    vh_h = np.empty(width)
    vl_h = np.empty(width)
    vh_l = np.empty(width)
    vl_l = np.empty(width)
    new_l = np.empty(s_max)
    new_h = np.empty(s_max)
    pick = np.empty((POLISH_CANDIDATES, 3))
    gone = np.full(1, -1, dtype=np.int64)
    came = np.full(2, -1, dtype=np.int64)
    sh = num_stages[h]
    mh = num_micro[h]
    col_h = stage_cols[h, _bottleneck(loads[h], sh)]
    scale_h = exact[h] / max(_proxy(loads[h], sh, mh), 1e-300)
    best = exact[h]
    result = (-1, -1, -1, -1, 0.0, 0.0)
    for l in _fastest(exact, partners, h):
        nh, nl = counts[h], counts[l]
        sl, ml = num_stages[l], num_micro[l]
        col_l = stage_cols[l, _bottleneck(loads[l], sl)]
        scale_l = exact[l] / max(_proxy(loads[l], sl, ml), 1e-300)
        _values(members[h], nh, cost, weight, col_h, mh, scale_h, vh_h)
        _values(members[l], nl, cost, weight, col_h, mh, scale_h, vh_l)
        _values(members[h], nh, cost, weight, col_l, ml, scale_l, vl_h)
        _values(members[l], nl, cost, weight, col_l, ml, scale_l, vl_l)
        can_move = nh > mh and nl < width
        found = _candidates(vh_h, vh_l, vl_h, vl_l, nh, nl, exact[h], exact[l], can_move, POLISH_CANDIDATES, pick)
        cand = np.full((found + 2 * forced, 3), -1, dtype=np.int64)
        for c in range(found):
            cand[c, 0] = int(pick[c, 1])
            cand[c, 1] = int(pick[c, 2])
        num_c = found
        for a in range(min(forced, nh)):
            want = vh_h[a] - (exact[h] - exact[l]) / 2
            best_j = -1
            best_err = np.inf
            for j in range(nl):
                err = abs(vh_l[j] - want)
                if err < best_err:
                    best_err = err
                    best_j = j
            if best_j >= 0:
                cand[num_c, 0] = a
                cand[num_c, 1] = best_j
                num_c += 1
            if nh + 1 <= width and nl - 1 >= ml:
                j1, j2 = _two_for_one(vh_h[a], vh_l, nl, want)
                if j1 >= 0:
                    cand[num_c, 0] = a
                    cand[num_c, 1] = j1
                    cand[num_c, 2] = j2
                    num_c += 1
        # High side exactly; low side first by its scaled proxy, then the most promising exactly.
        t_high = np.full(num_c, np.inf)
        estimate = np.full(num_c, np.inf)
        for c in range(num_c):
            a, b1, b2 = cand[c, 0], cand[c, 1], cand[c, 2]
            if b1 < 0 and not can_move:
                continue
            gone[0] = members[h, a]
            came[0] = members[l, b1] if b1 >= 0 else -1
            came[1] = members[l, b2] if b2 >= 0 else -1
            n1 = _edit(members[h], nh, a, -1, came[0], came[1], rank, row_h)
            _loads_after(loads[h], cost, stage_cols[h], sh, gone, came, new_h)
            t_high[c] = _time_row(
                row_h,
                n1,
                new_h,
                cost,
                stage_cols[h, :sh],
                fixed[h, :sh],
                share[h, :sh],
                mh,
                ticks,
                fill,
                micro_buf,
                ready,
            )
            _loads_after(loads[l], cost, stage_cols[l], sl, came, gone, new_l)
            estimate[c] = max(t_high[c], scale_l * _proxy(new_l, sl, ml))
        order = np.argsort(estimate, kind="mergesort")
        for r in range(min(POLISH_VERIFIED, num_c)):
            c = order[r]
            if not estimate[c] < best:
                break
            a, b1, b2 = cand[c, 0], cand[c, 1], cand[c, 2]
            gone[0] = members[h, a]
            came[0] = members[l, b1] if b1 >= 0 else -1
            came[1] = members[l, b2] if b2 >= 0 else -1
            _loads_after(loads[l], cost, stage_cols[l], sl, came, gone, new_l)
            n2 = _edit(members[l], nl, b1, b2, gone[0], -1, rank, row_l)
            t_low = _time_row(
                row_l,
                n2,
                new_l,
                cost,
                stage_cols[l, :sl],
                fixed[l, :sl],
                share[l, :sl],
                ml,
                ticks,
                fill,
                micro_buf,
                ready,
            )
            if max(t_high[c], t_low) < best:
                best = max(t_high[c], t_low)
                result = (l, a, b1, b2, t_high[c], t_low)
    return result


# ---------------------------------------------------------------------- the search


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
