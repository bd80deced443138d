"""The balancer's compiled kernels for one pipeline and one candidate: split into microbatches, time exactly,
edit a member list, first-order values, candidates, and the construction of a placement.

Parts of ``oobleck_mm.balance.search`` (its docstring says what each step does and why it is deterministic);
the polish steps that use them are in ``oobleck_mm.balance.search_steps``.
"""

from __future__ import annotations

import heapq

import numpy as np

from oobleck_mm.balance.split import proportional_counts

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
