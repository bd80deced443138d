"""Exact iteration time of one pipeline running DeepSpeed's 1F1B ``TrainSchedule``.

This module owns the closed recurrence that every planner, the batch solver and
the benchmarks use for "how long does one iteration of this pipeline take".
``oobleck_mm.planning.simulate`` executes DeepSpeed's real instruction objects
instead and is the reference the tests hold this recurrence to.

Execution model (what "exact" means here)
-----------------------------------------
Each stage runs its ``TrainSchedule(micro_batches=M, stages=S, stage_id=k)``
instructions in order, one at a time. ``ForwardPass`` costs ``forward[k]``,
``BackwardPass`` costs ``backward[k]``; loads, gradient reductions and the
optimizer step cost 0 (the data-parallel all-reduce is accounted for in
``plan.gradient_allreduce_s``). Point-to-point transfers are blocking
rendezvous, as NCCL/gloo send/recv are: both ends of the n-th transfer on a
directed channel finish at ``max(arrival of both ends) + transfer seconds``.

What DeepSpeed's schedule looks like
------------------------------------
``TrainSchedule`` has ``2 (M + S - 1)`` steps. At step ``t`` stage ``k`` runs a
forward step if ``t + k`` is even, for microbatch ``j = (t - k) / 2``, and a
backward step otherwise, for microbatch ``b = (t + k + 1) / 2 - S``; an id
outside ``[0, M)`` means "nothing to compute". A forward step talks only to
``k - 1`` (``SendGrad`` of the previous step's backward, then ``RecvActivation``),
a backward step only to ``k + 1`` (``RecvGrad``, then ``SendActivation`` of the
previous step's forward). Hence at step ``t`` boundary ``k`` (stages k, k+1) is
active exactly when ``t + k`` is odd, the active boundaries are disjoint pairs
of stages, and on boundary ``k`` both ends see the same two transfers in the
same order: the gradient of microbatch ``b = (t + k + 1) / 2 - S`` (if valid),
then the activation of microbatch ``j = (t - k - 1) / 2`` (if valid). The lower
stage then runs backward ``b`` and the upper stage forward ``j``.

The closed recurrence
---------------------
With ``R_k(t)`` the time stage ``k`` finishes step ``t`` (``R_k(-1) = 0``) and
``[.]`` the indicator of a valid microbatch id, for every active boundary ``k``::

    c    = [b] g_k + [j] a_k
    X    = max(R_k(t-1), R_{k+1}(t-1)) + c        if [b] or [j], else no sync
    R_k(t)     = X + [b] B_k                      (X := R_k(t-1) without sync)
    R_{k+1}(t) = X + [j] F_{k+1}                  (X := R_{k+1}(t-1) without sync)

and the unpaired end stages just compute: stage 0 on forward steps
(``R_0(t) = R_0(t-1) + [t/2] F_0``) and stage ``S-1`` on backward steps
(``R_{S-1}(t) = R_{S-1}(t-1) + [(t+S)/2 - S] B_{S-1}``). The iteration time is
``max_k R_k(2 (M + S - 1) - 1)``. Each step is one vectorised update over the
active pairs, so the cost is ``O(S (M + S))`` with ``O(M + S)`` numpy calls.

Why the seed's T1 + T2 + T3 formula (eq. 2.1-2.4) is not this
--------------------------------------------------------------
The seed charges ``sum_k (F_k + B_k)`` (T1) plus ``N_b - S + k* - 1`` rounds of
the slowest stage ``k*`` (T2) plus ``sum_{k >= k*} (F_k + B_k)`` (T3). That is a
count of whole ``F + B`` terms. It is exact when every stage has the same
``F + B`` and transfers are free: then it gives ``(M + S - 1)(F + B)``, which is
also what DeepSpeed's schedule gives (the tests check this for ``F != B`` too).
Once stages differ the critical path contains partial terms no such count has:
the bottleneck stage ``k*`` gets microbatch 0's gradient back
``sum_{k > k*} (F_k + B_k)`` after its first forward but has only
``S - k* - 1`` further forwards to fill that wait with, leaving a warm-up
bubble of about ``max(0, sum_{k > k*} (F_k + B_k) - (S - k* - 1) F_{k*})``
that T2's round count does not reproduce. E.g. ``F = (1, 1, 1)``,
``B = (1, 3, 1)``, ``M = 12``: the schedule takes 51 s (stage 1 busy 48 s,
1 s waiting for stage 0's first forward, 1 s warm-up bubble, stage 0's last
backward 1 s) but the seed gives 50 s; already with two stages,
``F = (1, 1)``, ``B = (3, 1)``, ``M = 8`` takes 33 s against the seed's 32 s.
With transfers the gap grows further: the lock-step rendezvous puts
``a_k + g_k`` on the critical path of every steady step, and the seed has no
communication term at all. Both counterexamples are
in ``tests/unit/test_pipeline_time.py``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


def iteration_time_1f1b(
    forward: Sequence[float],
    backward: Sequence[float],
    send_activation: Sequence[float],
    send_grad: Sequence[float],
    num_microbatches: int,
) -> float:
    """Seconds of one ``TrainSchedule`` iteration of ``num_microbatches`` microbatches.

    ``forward[k]``/``backward[k]``: stage ``k``'s seconds for one microbatch.
    ``send_activation[k]``/``send_grad[k]``: seconds of one transfer across the
    boundary between stages ``k`` and ``k + 1`` (``S - 1`` entries each).
    """
    costs = _PaddedCosts.of(forward, backward, send_activation, send_grad)
    validate_count("num_microbatches", num_microbatches)
    ready = np.zeros((1, costs.num_stages + 2))
    _sweep_whole(ready, costs, num_microbatches, 2 * (num_microbatches + costs.num_stages - 1))
    return float(ready.max())


def iteration_times(
    forward: Sequence[float],
    backward: Sequence[float],
    send_activation: Sequence[float],
    send_grad: Sequence[float],
    max_microbatches: int,
    first_microbatches: int = 1,
) -> list[float]:
    """``[T(first), ..., T(max_microbatches)]`` for the same stages, at a cost that stops growing with M.

    Runs of ``q < S`` microbatches each need their own drain (``O(S^3)`` work for
    all of them); a caller that rarely needs them asks from ``first = S`` on.

    The batch solver needs ``T(q)`` for many ``q``. Runs with ``q`` and ``M > q``
    microbatches are identical up to step ``2q - 1``: the first event that
    involves microbatch ``q`` is stage 0's forward at step ``2q``. So one run
    provides every run's state ``R(q)`` after step ``2q - 1``, and the remaining
    ``2S - 2`` (drain) steps of all runs are swept together, one row each.

    Beyond that, the steady phase is one max-plus linear map applied again and
    again, so ``R(q)`` becomes periodic up to a shift: once
    ``R(q*) = R(q* - c) + delta`` (all stages, within float rounding) with
    ``q* - c > S``, every later state repeats that shift, and since the drain
    map is the same max-plus function for every run of ``>= S`` microbatches,
    ``T(q) = T(q - c) + delta`` for all ``q > q*``. The run is swept only until
    the period shows (usually a few ``S``), so a table of thousands of
    microbatches costs about as much as one of ``O(S)``. Max-plus maps are
    non-expansive, so a shift detected within a relative ``_PERIOD_RTOL`` keeps
    every extrapolated time within that error per period: ~1e-9 relative for
    thousands of microbatches, far below what any decision depends on.
    """
    costs = _PaddedCosts.of(forward, backward, send_activation, send_grad)
    validate_count("max_microbatches", max_microbatches)
    validate_count("first_microbatches", first_microbatches)
    if first_microbatches > max_microbatches:
        raise ValueError(f"first_microbatches ({first_microbatches}) must be <= max_microbatches ({max_microbatches})")
    states, period = _periodic_states(costs, max_microbatches)
    start = first_microbatches
    if period is not None:  # the last period's runs are drained too: they seed the extrapolation
        start = min(start, len(states) - period[0] + 1)
    times = _drain_times(costs, states[start - 1 :], start)
    if period is not None:
        c, delta = period
        while len(times) < max_microbatches - start + 1:
            times.append(times[-c] + delta)
    return times[first_microbatches - start :]


# Stop sweeping once the state repeats up to a shift (see iteration_times); the
# shift must agree on every stage within this relative tolerance. Periods up to
# _MAX_PERIOD microbatches are recognised (1 in every case seen so far).
_PERIOD_RTOL = 1e-12
_MAX_PERIOD = 4


def _periodic_states(costs: _PaddedCosts, max_microbatches: int) -> tuple[np.ndarray, tuple[int, float] | None]:
    """States ``R(q)`` for ``q = 1..Q`` (``Q <= max_microbatches``) and the period, if it showed.

    Sweeps the ``max_microbatches`` run in chunks and stops at the first ``q``
    with ``R(q) = R(q - c) + delta`` on every real stage and ``q - c > S``.
    """
    S, M = costs.num_stages, max_microbatches
    ready = np.zeros((1, S + 2))
    chunk = 2 * max(4 * S, 32)  # steps per chunk: a few S microbatches
    states: list[np.ndarray] = []
    step = 0
    while step < 2 * M:
        end = min(2 * M, step + chunk)
        states.append(_sweep_whole(ready, costs, M, end, first_step=step))
        step = end
        swept = np.concatenate(states)
        period = _find_period(swept, S)
        if period is not None:
            q_star, c, delta = period
            return swept[:q_star], (c, delta)
        states = [swept]
    return np.concatenate(states), None


def _find_period(states: np.ndarray, num_stages: int) -> tuple[int, int, float] | None:
    """(q*, c, delta) for the first ``q*`` whose state is ``c`` microbatches' state plus ``delta``."""
    real = states[:, 1:-1]  # the virtual end columns never change and never matter
    scale = np.abs(real).max(axis=1)
    best = None
    for c in range(1, _MAX_PERIOD + 1):
        first = num_stages + 1 + c  # q* - c > S: both states are in the time-invariant steady phase
        if len(real) < first:
            continue
        diff = real[first - 1 :] - real[first - 1 - c : len(real) - c]
        spread = diff.max(axis=1) - diff.min(axis=1)
        hits = np.nonzero(spread <= _PERIOD_RTOL * scale[first - 1 :])[0]
        if len(hits):
            q_star = first + int(hits[0])
            if best is None or q_star < best[0]:
                best = (q_star, c, float(diff[hits[0]].max()))
    return best


def _drain_times(costs: _PaddedCosts, states: np.ndarray, first: int = 1) -> list[float]:
    """``T(q)`` for ``q = first..first+len(states)-1``: each run's last ``2S - 2`` steps from ``R(q)``."""
    snapshots = states.copy()
    count = len(snapshots)
    counts = np.arange(first, first + count)[:, None]
    # A run of q >= S microbatches has every boundary's gradient and activation ids past
    # their validity thresholds (all <= S) in these last steps, so all such runs share one
    # row of increments; only the runs q < S need their own.
    split = min(max(costs.num_stages - first, 0), count)
    groups = [(snapshots[:split], counts[:split]), (snapshots[split:], counts[-1:])]
    groups = [(rows, c) for rows, c in groups if len(rows)]
    num_offsets = 2 * costs.num_stages - 2
    offsets = [np.arange(p, num_offsets, 2)[:, None, None] for p in (0, 1)]
    if split * num_offsets * costs.num_stages <= _BATCHED_TAIL_CELLS:
        # Every step's increments at once, (offsets, runs, boundaries): a few numpy calls
        # instead of a few per step.
        tables = [[_increments(costs, 2 * c + offsets[p], c, p) for p in (0, 1)] for _, c in groups]
        for offset in range(num_offsets):
            parity = offset % 2
            for (rows, _), table in zip(groups, tables):
                _apply_step(rows, parity, *(part[offset // 2] for part in table[parity]))
    else:
        for offset in range(num_offsets):
            parity = offset % 2
            for rows, c in groups:
                _apply_step(rows, parity, *_increments(costs, 2 * c + offset, c, parity))
    return [float(x) for x in snapshots.max(axis=1)]


@dataclass(frozen=True, slots=True)
class _PaddedCosts:
    """Latencies padded with a virtual stage -1 and a virtual stage S that cost nothing.

    With them, stage 0's forward steps and stage S-1's backward steps are steps
    of the boundaries (-1, 0) and (S-1, S), which never synchronise, so every
    step is one strided update over pairs ``(k, k + 1)`` of the padded columns.
    Boundary ``k`` (-1..S-1) is padded index ``k + 1``.
    """

    num_stages: int
    forward: np.ndarray
    backward: np.ndarray
    send_activation: np.ndarray
    send_grad: np.ndarray
    real_boundary: np.ndarray

    @classmethod
    def of(cls, forward, backward, send_activation, send_grad) -> _PaddedCosts:
        f, b, a, g = validate_latencies(forward, backward, send_activation, send_grad)
        num_stages = len(f)
        real = np.ones(num_stages + 1, dtype=bool)
        real[[0, -1]] = False
        return cls(
            num_stages=num_stages,
            forward=np.pad(f, 1),
            backward=np.pad(b, 1),
            send_activation=np.pad(a, 1),
            send_grad=np.pad(g, 1),
            real_boundary=real,
        )


def _increments(costs: _PaddedCosts, step: np.ndarray, counts, parity: int) -> tuple[np.ndarray, ...]:
    """What each boundary active at ``step`` (an ``(N, 1)`` array of one parity) does there.

    Returns ``(meets, transfer seconds, lower-stage compute, upper-stage compute)``,
    each ``(N, P)`` over the boundaries ``k`` with ``step + k`` odd.
    """
    boundary = np.arange(parity, costs.num_stages + 1, 2)  # padded index k + 1
    grad_mb = (step + boundary) // 2 - costs.num_stages
    act_mb = (step - boundary) // 2
    has_grad = (grad_mb >= 0) & (grad_mb < counts)
    has_act = (act_mb >= 0) & (act_mb < counts)
    # No valid transfer on a boundary means its two stages do not meet at this step.
    meets = (has_grad | has_act) & costs.real_boundary[boundary]
    transfer = np.where(has_grad, costs.send_grad[boundary], 0.0)
    transfer = transfer + np.where(has_act, costs.send_activation[boundary], 0.0)
    lower = np.where(has_grad, costs.backward[boundary], 0.0)
    upper = np.where(has_act, costs.forward[boundary + 1], 0.0)
    return meets, transfer, lower, upper


def _apply_step(ready: np.ndarray, parity: int, meets, transfer, lower, upper) -> None:
    """One schedule step on padded finish times ``ready`` (rows = independent runs)."""
    lo = ready[:, parity:-1:2]
    hi = ready[:, parity + 1 :: 2]
    met = np.maximum(lo, hi) + transfer
    new_lo = np.where(meets, met, lo) + lower
    ready[:, parity + 1 :: 2] = np.where(meets, met, hi) + upper
    ready[:, parity:-1:2] = new_lo


# Up to this many (runs x steps x stages) cells the tail of ``iteration_times`` precomputes
# the increments of all its steps at once (8 arrays of that size: ~100 MB at most).
_BATCHED_TAIL_CELLS = 1_500_000
# Below this many stages a plain Python loop over the active boundaries beats
# the numpy step (a fixed ~15 us of calls per step whatever S is).
_SCALAR_MAX_STAGES = 40


def _sweep_whole(
    ready: np.ndarray, costs: _PaddedCosts, num_microbatches: int, num_steps: int, first_step: int = 0
) -> np.ndarray:
    """Run steps ``first_step..num_steps-1`` of one run in place; return its state after each odd step.

    ``first_step`` is even. The per-step increments are computed for all steps
    of a parity at once, so the loop itself is a handful of numpy calls on
    ``S / 2``-long views.
    """
    if costs.num_stages <= _SCALAR_MAX_STAGES:
        return _sweep_scalar(ready, costs, num_microbatches, num_steps, first_step)
    snapshots = np.empty(((num_steps - first_step) // 2, ready.shape[1]))
    tables = [_increments(costs, np.arange(first_step + p, num_steps, 2)[:, None], num_microbatches, p) for p in (0, 1)]
    for i, step in enumerate(range(first_step, num_steps)):
        parity = step % 2
        _apply_step(ready, parity, *(table[i // 2] for table in tables[parity]))
        if parity:
            snapshots[i // 2] = ready[0]
    return snapshots


def _sweep_scalar(
    ready: np.ndarray, costs: _PaddedCosts, num_microbatches: int, num_steps: int, first_step: int = 0
) -> np.ndarray:
    """``_sweep_whole`` as a plain loop: the same recurrence, boundary by boundary.

    Boundary ``k`` (padded index ``k + 1``) is active at step ``t`` when ``t + k``
    is odd; it carries the gradient of ``b = (t + k + 1) // 2 - S`` and the
    activation of ``j = (t - k - 1) // 2`` when those are valid microbatches.
    The two virtual boundaries only add stage 0's forward / stage S-1's backward.
    """
    S, M = costs.num_stages, num_microbatches
    F, B = costs.forward.tolist(), costs.backward.tolist()
    A, G = costs.send_activation.tolist(), costs.send_grad.tolist()
    R = ready[0].tolist()  # padded: R[k + 1] is stage k
    snapshots = np.empty(((num_steps - first_step) // 2, len(R)))
    for t in range(first_step, num_steps):
        # Padded boundary p = k + 1 joins columns p and p + 1; active when t + p is even.
        for p in range(t % 2, S + 1, 2):
            grad = 0 <= (t + p) // 2 - S < M
            act = 0 <= (t - p) // 2 < M
            if not (grad or act):
                continue
            if 0 < p < S:  # a real boundary: the two stages meet
                # Same association as the numpy step, so both paths agree to the last bit.
                met = max(R[p], R[p + 1]) + ((G[p] if grad else 0.0) + (A[p] if act else 0.0))
                R[p] = met + (B[p] if grad else 0.0)
                R[p + 1] = met + (F[p + 1] if act else 0.0)
            else:
                if grad:
                    R[p] += B[p]
                if act:
                    R[p + 1] += F[p + 1]
        if t % 2:
            snapshots[(t - first_step) // 2] = R
    ready[0] = R
    return snapshots


def validate_latencies(forward, backward, send_activation, send_grad) -> tuple[np.ndarray, ...]:
    """Check the four latency sequences (lengths, finite, >= 0) and return them as float arrays."""
    num_stages = len(forward)
    if num_stages < 1:
        raise ValueError("forward must have one entry per stage (at least 1), got an empty sequence")
    arrays = []
    for name, seq, expected in (
        ("forward", forward, num_stages),
        ("backward", backward, num_stages),
        ("send_activation", send_activation, num_stages - 1),
        ("send_grad", send_grad, num_stages - 1),
    ):
        if len(seq) != expected:
            raise ValueError(f"{name} must have {expected} entries for {num_stages} stages, got {len(seq)}")
        arr = np.asarray(seq, dtype=float)
        bad = [float(x) for x in arr if not (math.isfinite(x) and x >= 0)]
        if bad:
            raise ValueError(f"{name} must hold finite seconds >= 0, got {bad[0]}")
        arrays.append(arr)
    return tuple(arrays)


def validate_count(name: str, value: int) -> None:
    """``value`` must be an integer >= 1 (a microbatch count)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
