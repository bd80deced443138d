"""The balancer's polish steps, compiled: move one sample off the slowest pipeline (level 0), or swap and
two-for-one with the fastest pipelines (levels 1-2). Parts of ``oobleck_mm.balance.search``.
"""

from __future__ import annotations

import numpy as np

from oobleck_mm.balance.search_kernels import (
    CACHE,
    MOVE_CANDIDATES,
    MOVE_VERIFIED,
    POLISH_CANDIDATES,
    POLISH_VERIFIED,
    _bottleneck,
    _candidates,
    _edit,
    _fastest,
    _keep,
    _loads_after,
    _proxy,
    _time_row,
    _two_for_one,
    _values,
    njit,
)


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
