"""Entrain's pairwise deferral (dissertation §4.5.2): the LLM stages get microbatches of equal LLM work.

Inside a pipeline the encoder stages and the LLM stages need not run the same
samples in a microbatch slot. The slot's *encoder microbatch* ``E_k`` is what
the balancer placed (balanced on encoder work by its stratified split, §4.5.1);
the slot's *LLM microbatch* is ``L_k = (E_k - D_k) + D_{k-1}``: the samples
``D_k`` of an overloaded slot have their LLM work deferred to the slot right
after it, whose LLM load is light. Only whole samples move, and only by one
slot, so a deferred sample's encoder output waits one slot on the stage that
holds the LLM's first layer (the bounded buffer Entrain's pairwise order is
for).

Pure: the ``BalanceProblem``'s integer tick costs in, an order and deferral
sets out; every rank computes the same.

The algorithm, as the paper gives it (Algorithm 4, lines 7-15):

1. slots sorted by LLM work (descending, ties by slot); the top ``K // 2``
   are *overloaded*, the bottom ``K // 2`` *underloaded* (an odd middle one
   stays alone);
2. for every (overloaded i, underloaded j): the subset of i's samples whose
   LLM work is closest to ``(W_i - W_j) / 2`` (subset-sum dynamic
   programming over work rounded to ``SUBSET_UNITS`` units of i's total),
   and the pair's bottleneck ``V_ij = max(W_i - d, W_j + d)`` (eq. 4.3);
3. the smallest threshold ``T`` such that every overloaded slot above ``T``
   gets a distinct underloaded partner with ``V_ij <= T`` (bipartite
   matching, binary search over the candidate values);
4. execution order ``ol_0, ul_0, ol_1, ul_1, ...``, each matched pair
   deferring its set; unmatched overloaded slots are paired with the
   remaining underloaded ones without deferral, as in the paper.

Decided here, where the paper leaves it open (also in ``docs/balancer.md``):

* **Which LLM work.** ``W`` is a slot's LLM ticks summed over the pipeline's
  stages (with several LLM stages, every one of them gets the same mix).
* **Order of the pairs.** Pairs run in the order of their overloaded slot's
  LLM work, the odd slot first. The paper fixes only the pairing.
* **Kept only when it is faster.** The deferred schedule is timed exactly
  (``decoupled_ticks`` and the 1F1B recurrence): an encoder stage's backward
  of slot k follows the LLM's samples of slot k (Entrain's split backward,
  §4.5.3), so deferral also moves encoder backward work. The caller keeps the
  original order without deferral unless the deferred one is predicted faster.
* **Eager forwards** (§4.5.3's second half) are not used: the pipelines keep
  DeepSpeed's 1F1B schedule, whose warm-up depth bounds activation memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import networkx as nx
import numpy as np

SUBSET_UNITS = 4096
"""The subset-sum table's resolution: an overloaded microbatch's LLM work in this many units (the
paper's discretized table); the pair's bottleneck is then computed from the exact ticks."""


@dataclass(frozen=True, slots=True)
class Deferral:
    """One pipeline's decoupled microbatches."""

    order: tuple[int, ...]
    """Execution order: ``order[k]`` is the index (in the input) of the encoder microbatch run in slot k."""
    deferred: tuple[tuple[int, ...], ...]
    """Per slot (execution order), the samples of its encoder microbatch whose LLM work runs in the next
    slot (positions as given; empty for most slots; always empty for the last)."""
    bottleneck: float
    """The largest slot LLM work after deferral (ticks), ``T*`` of the paper."""

    @property
    def any(self) -> bool:
        return any(self.deferred)


def stratified_microbatches(encoder_work: np.ndarray, llm_work: np.ndarray, count: int) -> list[list[int]]:
    """Entrain §4.5.1: ``count`` microbatches of equal encoder work, each with samples light in LLM work.

    Samples split at the median LLM work into a coarse set (the heavier half) and a fine set; each set,
    by encoder work descending, goes sample by sample to the microbatch with the least encoder work so far
    (min-max greedy; ties: fewest samples, then lowest index), coarse set first. Both passes together are
    one LPT list schedule, within ``2 - 1/count`` of the best encoder makespan (Graham), and every
    microbatch gets fine samples for the deferral to move. Needs ``len >= count``; every microbatch gets
    one (the first ``count`` picks land in empty ones). The paper leaves the coarse/fine cut open: the
    median is chosen here. Its ``K_eff`` (fewer microbatches when one sample dominates) is not used: the
    plan fixes each pipeline's microbatch count."""
    n = len(encoder_work)
    if n < count:
        raise ValueError(f"{n} samples cannot fill {count} microbatches")
    cut = float(np.median(llm_work)) if n else 0.0
    coarse = [i for i in range(n) if llm_work[i] > cut]
    fine = [i for i in range(n) if llm_work[i] <= cut]
    bins: list[list[int]] = [[] for _ in range(count)]
    loads = [0.0] * count
    for group in (coarse, fine):
        for i in sorted(group, key=lambda i: (-encoder_work[i], i)):
            k = min(range(count), key=lambda k: (loads[k], len(bins[k]), k))
            bins[k].append(i)
            loads[k] += float(encoder_work[i])
    return [sorted(b) for b in bins]


def closest_subset(weights: np.ndarray, target: float) -> tuple[int, ...]:
    """Indices of a subset of ``weights`` whose sum is closest to ``target`` (ties: the smaller sum), by
    subset-sum dynamic programming on weights rounded to ``SUBSET_UNITS`` units of their total.

    Hand-written: a few lines of bitset DP; no maintained library in this stack has subset sum.
    The reachable sums after each item are one Python integer (bit s set: sum s reachable), so the
    table costs ``len(weights)`` big-integer shifts.
    """
    total = float(np.sum(weights))
    if target <= 0 or total <= 0:
        return ()
    unit = total / SUBSET_UNITS
    units = [int(round(w / unit)) for w in weights]
    reach = [1]
    for u in units:
        reach.append(reach[-1] | (reach[-1] << u))
    goal = int(round(target / unit))
    # The reachable sums nearest the goal from below and from above, by bit arithmetic (no scan).
    below = (reach[-1] & ((1 << (goal + 1)) - 1)).bit_length() - 1  # sum 0 is always reachable
    upper = reach[-1] >> goal
    above = goal + (upper & -upper).bit_length() - 1 if upper else None
    best = above if above is not None and above - goal < goal - below else below
    chosen, s = [], best
    for i in range(len(units) - 1, -1, -1):  # back through the table: take item i iff s is not reachable without it
        if not reach[i] >> s & 1:
            chosen.append(i)
            s -= units[i]
    return tuple(sorted(chosen))


def pairwise_deferral(llm_work: list[np.ndarray]) -> Deferral:
    """Entrain's pairwise deferral over one pipeline's microbatches.

    ``llm_work[k]``: each sample's LLM ticks in microbatch k (positions within it). Returns the order and the
    deferred positions per slot; never defers a microbatch's every sample (its slot would run no LLM work)."""
    k_all = len(llm_work)
    loads = [float(np.sum(w)) for w in llm_work]
    ranked = sorted(range(k_all), key=lambda k: (-loads[k], k))
    half = k_all // 2
    over, under = ranked[:half], ranked[k_all - half :][::-1]  # under: lightest first
    middle = ranked[half : k_all - half]
    if not over:
        return Deferral(tuple(range(k_all)), ((),) * k_all, max(loads, default=0.0))
    sets: dict[tuple[int, int], tuple[int, ...]] = {}
    value: dict[tuple[int, int], float] = {}
    for i in over:
        for j in under:
            chosen = closest_subset(llm_work[i], (loads[i] - loads[j]) / 2) if loads[i] > loads[j] else ()
            if len(chosen) == len(llm_work[i]):
                chosen = ()  # unreachable for a target below the total (the empty set is closer), kept as a guard
            moved = float(np.sum(llm_work[i][list(chosen)])) if chosen else 0.0
            sets[i, j] = chosen
            value[i, j] = max(loads[i] - moved, loads[j] + moved)
    floor = max([loads[j] for j in under] + [loads[m] for m in middle])
    candidates = sorted(
        {v for v in value.values() if v >= floor} | {loads[i] for i in over if loads[i] >= floor} | {floor}
    )
    lo, hi = 0, len(candidates) - 1  # the largest candidate is always feasible: every overloaded slot alone
    best = _match(over, under, value, loads, candidates[hi])
    while lo < hi:
        mid = (lo + hi) // 2
        matching = _match(over, under, value, loads, candidates[mid])
        if matching is not None:
            best, hi = matching, mid
        else:
            lo = mid + 1
    threshold = candidates[lo]  # = candidates[hi]: ``best`` is its matching (the search keeps it)
    assert best is not None  # the largest candidate is always feasible
    free = [j for j in under if j not in best.values()]
    pairs = []
    for i in over:  # heaviest first
        if i in best:
            pairs.append((i, best[i], sets[i, best[i]]))
        else:
            pairs.append((i, free.pop(0), ()))
    order, deferred = list(middle), [()] * len(middle)
    for i, j, chosen in pairs:
        order += [i, j]
        deferred += [chosen, ()]
    return Deferral(tuple(order), tuple(deferred), threshold)


def adjacent_deferral(llm_work: list[np.ndarray]) -> Deferral:
    """Deferral that keeps the given order: each slot heavier (in LLM work) than the one after it defers the
    subset of its samples closest to half the difference (counting what it received) to that slot. For an
    order the balancer already chose (light-heavy-light), where re-pairing would undo that order."""
    k_all = len(llm_work)
    deferred, carried = [], 0.0
    loads = [float(np.sum(w)) for w in llm_work]
    for k in range(k_all):
        own = loads[k] + carried
        if k + 1 < k_all and own > loads[k + 1]:
            chosen = closest_subset(llm_work[k], (own - loads[k + 1]) / 2)
            if len(chosen) == len(llm_work[k]):
                chosen = ()
        else:
            chosen = ()
        moved = float(np.sum(llm_work[k][list(chosen)])) if chosen else 0.0
        deferred.append(chosen)
        loads[k] = own - moved
        carried = moved
    return Deferral(tuple(range(k_all)), tuple(deferred), max(loads, default=0.0))


def lhl_pairs(plan: Deferral, llm_work: list[np.ndarray]) -> Deferral:
    """``plan``'s pairs (an overloaded slot and its partner, kept adjacent) in light-heavy-light order of their
    heavier slot's LLM work after deferral; a lone middle slot stays first."""
    order, deferred = list(plan.order), list(plan.deferred)
    lone = len(order) % 2
    units = [(tuple(order[i : i + 2]), tuple(deferred[i : i + 2])) for i in range(lone, len(order), 2)]
    if len(units) < 3:
        return plan

    def weight(unit):
        (i, j), (d, _) = unit
        moved = float(np.sum(llm_work[i][list(d)])) if d else 0.0
        return max(float(np.sum(llm_work[i])) - moved, float(np.sum(llm_work[j])) + moved)

    ranked = sorted(units, key=weight)
    arranged = ranked[0::2] + ranked[1::2][::-1]  # ascending then descending: heavy in the middle
    out_order = order[:lone] + [x for u in arranged for x in u[0]]
    out_deferred = deferred[:lone] + [x for u in arranged for x in u[1]]
    return Deferral(tuple(out_order), tuple(out_deferred), plan.bottleneck)


def _match(over, under, value, loads, threshold) -> dict[int, int] | None:
    """A partner for every overloaded slot above ``threshold`` with a pair bottleneck within it (Hopcroft-Karp,
    networkx), or None.

    Nodes are plain ints (slot k, and ``offset + j`` for underloaded slot j): networkx keeps nodes in sets
    and dicts, and a ``("o", k)`` tuple hashes through its string, which Python seeds per process, so
    with several maximum matchings two ranks could pick different ones and run different microbatches."""
    offset = max([*over, *under], default=0) + 1
    critical = [i for i in over if loads[i] > threshold]
    graph = nx.Graph()
    graph.add_nodes_from(critical)
    graph.add_nodes_from(offset + j for j in under)
    graph.add_edges_from((i, offset + j) for i in critical for j in under if value[i, j] <= threshold)
    matching = nx.bipartite.hopcroft_karp_matching(graph, top_nodes=critical)
    pairs = {i: matching[i] - offset for i in critical if i in matching}
    return pairs if len(pairs) == len(critical) else None


def llm_microbatches(encoder: list[tuple[int, ...]], deferred: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
    """The LLM microbatch of every slot: ``(E_k - D_k) + D_{k-1}``, in that order (the packing order the
    stage holding the LLM's first layer concatenates encoder outputs in). ``deferred[k]`` holds items of
    ``encoder[k]`` (any hashable: sample ids or positions)."""
    out, carried = [], ()
    for mb, gone in zip(encoder, deferred, strict=True):
        leaving = set(gone)
        out.append(tuple(s for s in mb if s not in leaving) + tuple(carried))
        carried = tuple(gone)
    if carried:
        raise ValueError(f"the last slot defers {carried}: nothing runs after it")
    return out


def decoupled_ticks(
    enc: np.ndarray, llm: np.ndarray, fixed: np.ndarray, encoder: list[tuple[int, ...]], deferred: list[tuple[int, ...]]
) -> tuple[np.ndarray, np.ndarray]:
    """``(S, K)`` ticks of every stage and slot for its forward-side and backward-side samples.

    ``enc``, ``llm``: ``(N, S)`` per-sample ticks of the encoder and LLM layers of each stage; ``fixed``:
    ``(S,)`` per-slot ticks. Forward of slot k runs the encoder layers on ``E_k`` and the LLM layers on
    ``L_k``; backward runs both on ``L_k`` (an encoder's backward of slot k takes the gradients the LLM's
    backward of slot k produced: the kept samples of ``E_k`` and the deferred ones of ``E_{k-1}``)."""
    lm = llm_microbatches(encoder, deferred)
    fwd = np.stack([fixed + enc[list(e)].sum(axis=0) + llm[list(l_)].sum(axis=0) for e, l_ in zip(encoder, lm)], axis=1)
    bwd = np.stack([fixed + enc[list(l_)].sum(axis=0) + llm[list(l_)].sum(axis=0) for l_ in lm], axis=1)
    return fwd, bwd
