"""Iteration time of 1F1B pipelines whose microbatches differ: the balancer's exact time model.

``planning.pipeline_time`` owns the closed recurrence for DeepSpeed's
``TrainSchedule`` (read its docstring for the derivation): at step ``t``
boundary ``k`` is active when ``t + k`` is odd, carries the gradient of
microbatch ``b = (t + k + 1) / 2 - S`` and the activation of ``j = (t - k -
1) / 2``, both stages meet (a blocking rendezvous) and then the lower stage
runs backward ``b`` and the upper stage forward ``j``. Which microbatch each
step touches does not depend on the times, so the same recurrence holds with
per-microbatch times: ``F_k`` becomes ``F[k, j]`` and ``B_k`` becomes
``B[k, b]``. That is all this module changes; with equal microbatches it
returns exactly what ``planning.pipeline_time.iteration_time_1f1b`` does
(tested), and ``tests/unit/test_balance_schedule.py`` holds it to DeepSpeed's
instruction streams executed event by event.

Transfers are not charged (the balancer's stage times come from measurements
of compute; transfers scale with the same tokens and only shift every
pipeline alike). Many pipelines, of any depths and microbatch counts, are
swept together: one vectorised step updates every pipeline's active
boundaries, so a batch of pipelines costs ``O(max(M + S))`` numpy calls.
Only elementwise max and + are used, so every CPU gets the same bits.
"""

from __future__ import annotations

import functools

import numpy as np


def iteration_time(forward: np.ndarray, backward: np.ndarray) -> float:
    """Seconds of one 1F1B iteration; ``forward[k, m]``/``backward[k, m]``: stage k, microbatch m."""
    forward = np.asarray(forward, dtype=float)
    backward = np.asarray(backward, dtype=float)
    if forward.ndim != 2 or forward.shape != backward.shape or forward.size == 0:
        raise ValueError(
            f"forward and backward must be equal (stages, microbatches) arrays, got {forward.shape} and {backward.shape}"
        )
    s, m = forward.shape
    return float(iteration_times(forward[None], backward[None], np.array([s]), np.array([m]))[0])


def iteration_times(
    forward: np.ndarray, backward: np.ndarray, num_stages: np.ndarray, num_microbatches: np.ndarray
) -> np.ndarray:
    """``(P,)`` iteration seconds of ``P`` pipelines padded to ``(P, S_max, M_max)``.

    Pipeline ``p`` uses ``forward[p, :num_stages[p], :num_microbatches[p]]``; padding is ignored.
    """
    forward = np.asarray(forward, dtype=float)
    backward = np.asarray(backward, dtype=float)
    stages = np.asarray(num_stages, dtype=np.int64)
    micro = np.asarray(num_microbatches, dtype=np.int64)
    _check(forward, backward, stages, micro)
    num_pipes, s_max, m_max = forward.shape
    # Stage rows: row k + 1 is stage k; row 0 and the rows after S_max are virtual stages that
    # cost nothing. The microbatch axis has a zero column m_max that invalid ids read.
    # Boundary p joins rows p and p + 1, so the boundaries active at a step (all of one parity)
    # are consecutive row pairs: a (boundaries, 2, pipelines) view of `ready`.
    pairs = (len(range(0, s_max + 1, 2)), len(range(1, s_max + 1, 2)))
    rows = max(2 * pairs[0], 1 + 2 * pairs[1])
    block = rows * (m_max + 1)
    f_pad = np.zeros((num_pipes, rows, m_max + 1))
    b_pad = np.zeros((num_pipes, rows, m_max + 1))
    f_pad[:, 1 : s_max + 1, :m_max] = forward
    b_pad[:, 1 : s_max + 1, :m_max] = backward
    ready = np.zeros((rows, num_pipes))
    views = [ready[parity : parity + 2 * n].reshape(n, 2, num_pipes) for parity, n in zip((0, 1), pairs)]
    num_steps = int((2 * (micro + stages - 1)).max())
    shapes, which = np.unique(stages * (m_max + 1) + micro, return_inverse=True)
    offset = (np.arange(num_pipes) * block)[None, None, :]
    steps = []
    for parity, n in zip((0, 1), pairs):
        local = [
            _shape_tables(int(u // (m_max + 1)), int(u % (m_max + 1)), parity, n, num_steps, m_max) for u in shapes
        ]
        gate, lower, upper = (np.stack([t[i] for t in local])[which].transpose(1, 2, 0) for i in range(3))
        add = np.stack([np.take(b_pad.reshape(-1), lower + offset), np.take(f_pad.reshape(-1), upper + offset)], axis=2)
        steps.append((list(gate[:, :, None, :]), list(add)))
    # Per-step operands as lists of views and preallocated scratch: each step is three ufunc calls.
    mirrored = [v[:, ::-1] for v in views]
    scratch = [np.empty_like(v) for v in views]
    for t in range(num_steps):
        parity, i = t % 2, t // 2
        pair, seen = views[parity], scratch[parity]
        # Where a boundary's stages meet, both continue from max(lower, upper) (gate 0, else
        # -inf); then the lower stage runs its backward and the upper one its forward.
        np.add(mirrored[parity], steps[parity][0][i], out=seen)
        np.maximum(pair, seen, out=pair)
        np.add(pair, steps[parity][1][i], out=pair)
    return ready[1 : s_max + 1].max(axis=0, initial=0.0)


@functools.lru_cache(maxsize=512)
def _shape_tables(num_stages: int, num_micro: int, parity: int, num_pairs: int, num_steps: int, m_max: int):
    """For one pipeline shape, every step of one parity: (gate, lower index, upper index), each (T, nb).

    Boundary ``p`` joins rows ``p`` and ``p + 1``, i.e. stages ``p - 1`` (runs the
    backward of the gradient's microbatch) and ``p`` (the forward of the activation's).
    Indices are flat into one pipeline's ``(rows, m_max + 1)`` block; an invalid
    microbatch id reads the zero column ``m_max``. Which microbatch a step touches
    depends only on the shape, so the tables are cached across calls.
    """
    t = np.arange(parity, num_steps, 2)[:, None]
    p = np.arange(parity, parity + 2 * num_pairs, 2)[None, :]
    grad_mb = (t + p) // 2 - num_stages
    act_mb = (t - p) // 2
    has_grad = (grad_mb >= 0) & (grad_mb < num_micro) & (p >= 1) & (p <= num_stages)
    has_act = (act_mb >= 0) & (act_mb < num_micro) & (p < num_stages)
    gate = np.where((has_grad | has_act) & (p >= 1) & (p < num_stages), 0.0, -np.inf)
    lower = p * (m_max + 1) + np.where(has_grad, grad_mb, m_max)
    upper = (p + 1) * (m_max + 1) + np.where(has_act, act_mb, m_max)
    for table in (gate, lower, upper):
        table.setflags(write=False)
    return gate, lower, upper


def _check(forward, backward, stages, micro) -> None:
    if forward.ndim != 3 or forward.shape != backward.shape:
        raise ValueError(
            f"forward and backward must be equal (P, S, M) arrays, got {forward.shape} and {backward.shape}"
        )
    num_pipes, s_max, m_max = forward.shape
    if stages.shape != (num_pipes,) or micro.shape != (num_pipes,):
        raise ValueError(f"num_stages and num_microbatches need {num_pipes} entries each")
    if (stages < 1).any() or (stages > s_max).any():
        raise ValueError(f"num_stages must be in 1..{s_max}, got {stages.tolist()}")
    if (micro < 1).any() or (micro > m_max).any():
        raise ValueError(f"num_microbatches must be in 1..{m_max}, got {micro.tolist()}")
    if not (np.isfinite(forward).all() and np.isfinite(backward).all()) or (forward < 0).any() or (backward < 0).any():
        raise ValueError("forward and backward must hold finite seconds >= 0")
