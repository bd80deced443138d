"""The balancer's 1F1B time with per-microbatch times, against the planner's recurrence and DeepSpeed's streams."""

from __future__ import annotations

import numpy as np
import pytest
from deepspeed.runtime.pipe import schedule as ds
from hypothesis import given, settings
from hypothesis import strategies as st

from oobleck_mm.balance.schedule_time import iteration_time, iteration_times
from oobleck_mm.planning.pipeline_time import iteration_time_1f1b


def deepspeed_time(forward: np.ndarray, backward: np.ndarray) -> float:
    """Execute ``TrainSchedule`` instruction streams event by event with per-microbatch compute.

    Each stage runs its forwards (and its backwards) in microbatch order 0..M-1, so the
    n-th ForwardPass of a stage is microbatch n. Sends and receives are blocking
    rendezvous of zero duration, paired in order on each directed channel.
    """
    num_stages, num_micro = forward.shape
    streams = [
        [c for step in ds.TrainSchedule(micro_batches=num_micro, stages=num_stages, stage_id=k) for c in step]
        for k in range(num_stages)
    ]
    pc, clock = [0] * num_stages, [0.0] * num_stages
    done_f, done_b = [0] * num_stages, [0] * num_stages
    waiting: dict[tuple[str, int, bool], int] = {}  # (channel, boundary, is_sender) -> blocked stage
    channel = {
        ds.SendActivation: ("act", 0, True),
        ds.RecvActivation: ("act", -1, False),
        ds.SendGrad: ("grad", -1, True),
        ds.RecvGrad: ("grad", 0, False),
    }
    while any(pc[k] < len(streams[k]) for k in range(num_stages)):
        progressed = False
        for k in range(num_stages):
            while pc[k] < len(streams[k]):
                inst = streams[k][pc[k]]
                if isinstance(inst, ds.ForwardPass):
                    clock[k] += forward[k, done_f[k]]
                    done_f[k] += 1
                elif isinstance(inst, ds.BackwardPass):
                    clock[k] += backward[k, done_b[k]]
                    done_b[k] += 1
                elif type(inst) in channel:
                    kind, shift, sender = channel[type(inst)]
                    peer = waiting.pop((kind, k + shift, not sender), None)
                    if peer is None:
                        waiting[(kind, k + shift, sender)] = k
                        break  # blocked until the peer arrives
                    waiting.pop((kind, k + shift, sender), None)
                    clock[k] = clock[peer] = max(clock[k], clock[peer])
                    pc[peer] += 1
                pc[k] += 1  # anything else (loads, reductions, optimizer step) is free
                progressed = True
        assert progressed, "deadlock"
    return max(clock)


positive = st.floats(min_value=0.01, max_value=5.0, allow_nan=False, allow_infinity=False)


@st.composite
def microbatch_times(draw, max_stages=5, max_micro=7):
    s = draw(st.integers(1, max_stages))
    m = draw(st.integers(1, max_micro))
    values = draw(st.lists(positive, min_size=2 * s * m, max_size=2 * s * m))
    arr = np.array(values).reshape(2, s, m)
    return arr[0], arr[1]


@settings(max_examples=60, deadline=None)
@given(microbatch_times())
def test_matches_deepspeed_streams_with_unequal_microbatches(times):
    forward, backward = times
    assert iteration_time(forward, backward) == pytest.approx(deepspeed_time(forward, backward), rel=1e-12)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 6), st.integers(1, 10), st.data())
def test_equal_microbatches_give_the_planners_time(num_stages, num_micro, data):
    f = data.draw(st.lists(positive, min_size=num_stages, max_size=num_stages))
    b = data.draw(st.lists(positive, min_size=num_stages, max_size=num_stages))
    forward = np.repeat(np.array(f)[:, None], num_micro, axis=1)
    backward = np.repeat(np.array(b)[:, None], num_micro, axis=1)
    zeros = [0.0] * (num_stages - 1)
    expected = iteration_time_1f1b(f, b, zeros, zeros, num_micro)
    assert iteration_time(forward, backward) == pytest.approx(expected, rel=1e-12)


def test_batched_pipelines_of_any_shape_equal_one_by_one_bit_for_bit():
    rng = np.random.default_rng(3)
    num, s_max, m_max = 12, 6, 9
    forward = rng.uniform(0, 1, (num, s_max, m_max))
    backward = rng.uniform(0, 2, (num, s_max, m_max))
    stages = rng.integers(1, s_max + 1, num)
    micro = rng.integers(1, m_max + 1, num)
    batched = iteration_times(forward, backward, stages, micro)
    single = [
        iteration_time(forward[i, : stages[i], : micro[i]], backward[i, : stages[i], : micro[i]]) for i in range(num)
    ]
    assert batched.tolist() == single


def test_a_heavy_microbatch_costs_relatively_more_in_a_deeper_pipeline():
    """Why the balancer times pipelines exactly: the same lumpy batch (one microbatch 4x
    the others) slows an 8-stage pipeline by far more than a 1-stage one, while the
    total work - all a sum-of-loads model sees - grows by the same 3/16 in both."""

    def slowdown(num_stages):
        even = np.ones((num_stages, 16)) / num_stages
        lumpy = even.copy()
        lumpy[:, 8] *= 4.0
        return iteration_time(lumpy, 2 * lumpy) / iteration_time(even, 2 * even)

    assert slowdown(1) == pytest.approx(1 + 3 / 16)
    assert slowdown(8) > 1.5


def test_rejects_bad_inputs():
    with pytest.raises(ValueError, match="forward and backward"):
        iteration_time(np.ones((2, 3)), np.ones((3, 2)))
    with pytest.raises(ValueError, match="finite seconds >= 0"):
        iteration_time(np.array([[1.0, -1.0]]), np.ones((1, 2)))
    with pytest.raises(ValueError, match="num_microbatches"):
        iteration_times(np.ones((1, 2, 3)), np.ones((1, 2, 3)), np.array([2]), np.array([4]))
