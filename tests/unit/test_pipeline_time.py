"""The closed 1F1B recurrence against DeepSpeed's real TrainSchedule, executed event by event."""

from __future__ import annotations

import math
import time

import pytest
from deepspeed.runtime.pipe import schedule as ds
from hypothesis import given, settings
from hypothesis import strategies as st

from oobleck_mm.planning.pipeline_time import iteration_time_1f1b, iteration_times
from oobleck_mm.planning.simulate import execute_streams, simulate_train_schedule

seconds = st.floats(min_value=0.0, max_value=10.0, allow_nan=False, allow_infinity=False)
positive = st.floats(min_value=1e-3, max_value=10.0, allow_nan=False, allow_infinity=False)
# Transfers are often free (same node), so zeros must be common, not a 1-in-2^64 draw.
comm = st.one_of(st.just(0.0), seconds)


@st.composite
def pipelines(draw, max_stages=6):
    num_stages = draw(st.integers(1, max_stages))
    return (
        draw(st.lists(positive, min_size=num_stages, max_size=num_stages)),
        draw(st.lists(positive, min_size=num_stages, max_size=num_stages)),
        draw(st.lists(comm, min_size=num_stages - 1, max_size=num_stages - 1)),
        draw(st.lists(comm, min_size=num_stages - 1, max_size=num_stages - 1)),
    )


def seed_formula(forward, backward, num_microbatches):
    """Eq. 2.1-2.4 of the seed, flattened: T1 + T2 + T3 with k* the slowest stage (0-based)."""
    work = [f + b for f, b in zip(forward, backward)]
    num_stages = len(work)
    slowest = max(range(num_stages), key=work.__getitem__)
    t1 = sum(work)
    t2 = (num_microbatches - num_stages + slowest - 1) * work[slowest]
    t3 = sum(work[slowest:])
    return t1 + t2 + t3


@settings(max_examples=60, deadline=None)
@given(pipeline=pipelines(), num_microbatches=st.integers(1, 12))
def test_recurrence_equals_event_simulation_of_deepspeed_schedule(pipeline, num_microbatches):
    exact = iteration_time_1f1b(*pipeline, num_microbatches)
    simulated = simulate_train_schedule(*pipeline, num_microbatches)
    assert exact == pytest.approx(simulated.makespan_s, rel=1e-9, abs=1e-12)
    # Every stage computes every microbatch once each way, whatever the waits.
    forward, backward = pipeline[0], pipeline[1]
    for k, busy in enumerate(simulated.stage_busy_s):
        assert busy == pytest.approx(num_microbatches * (forward[k] + backward[k]))
    assert simulated.makespan_s == max(simulated.stage_finish_s)


@settings(max_examples=25, deadline=None)
@given(pipeline=pipelines(max_stages=8), max_microbatches=st.integers(1, 20))
def test_iteration_times_equals_one_run_per_microbatch_count(pipeline, max_microbatches):
    times = iteration_times(*pipeline, max_microbatches)
    expected = [iteration_time_1f1b(*pipeline, q) for q in range(1, max_microbatches + 1)]
    assert times == pytest.approx(expected, rel=1e-12)


def random_pipeline(num_stages: int, seed: int):
    import random

    rng = random.Random(seed)
    return (
        [rng.uniform(0.1, 2) for _ in range(num_stages)],
        [rng.uniform(0.1, 2) for _ in range(num_stages)],
        [rng.choice([0.0, rng.uniform(0, 0.3)]) for _ in range(num_stages - 1)],
        [rng.choice([0.0, rng.uniform(0, 0.3)]) for _ in range(num_stages - 1)],
    )


@pytest.mark.parametrize("num_stages, max_microbatches", [(3, 40), (30, 200), (45, 30), (60, 90)])
def test_every_code_path_of_one_run_gives_bit_identical_times(monkeypatch, num_stages, max_microbatches):
    # The scalar and numpy sweeps must agree to the last bit: which one runs depends only on S.
    import oobleck_mm.planning.pipeline_time as pt

    pipeline = random_pipeline(num_stages, num_stages)
    probes = sorted({1, 2, max_microbatches // 3, max_microbatches})
    results = []
    for scalar_max in (0, 10**9):
        monkeypatch.setattr(pt, "_SCALAR_MAX_STAGES", scalar_max)
        results.append([pt.iteration_time_1f1b(*pipeline, q) for q in probes])
    assert results[0] == results[1]


@pytest.mark.parametrize(
    "num_stages, max_microbatches, periodic",
    # (50, 250): a slow front still travels through the stages after 250 microbatches, so the
    # table must come from the full sweep instead.
    [(1, 300, True), (3, 400, True), (8, 1000, True), (30, 600, True), (50, 250, False)],
)
def test_tables_extrapolate_the_period_exactly(monkeypatch, num_stages, max_microbatches, periodic):
    # Long tables stop sweeping once the state repeats up to a shift and extrapolate; every
    # value must still equal an independent full run, with and without the batched drain.
    import oobleck_mm.planning.pipeline_time as pt

    pipeline = random_pipeline(num_stages, 7 * num_stages)
    costs = pt._PaddedCosts.of(*pipeline)
    states, period = pt._periodic_states(costs, max_microbatches)
    if periodic:
        assert period is not None and len(states) < max_microbatches // 2  # the shortcut really ran
    else:
        assert period is None and len(states) == max_microbatches
    probes = sorted(
        {1, num_stages, len(states), min(len(states) + 1, max_microbatches), max_microbatches // 2, max_microbatches}
    )
    for batched in (0, 10**9):
        monkeypatch.setattr(pt, "_BATCHED_TAIL_CELLS", batched)
        table = pt.iteration_times(*pipeline, max_microbatches)
        assert len(table) == max_microbatches
        for q in probes:
            assert table[q - 1] == pytest.approx(pt.iteration_time_1f1b(*pipeline, q), rel=1e-11)
        # Starting the table later (what TimeTable does for q >= S) gives the same values.
        first = min(num_stages, max_microbatches)
        assert pt.iteration_times(*pipeline, max_microbatches, first) == table[first - 1 :]


def test_hand_computed_two_stage_single_microbatch():
    # F0, then the activation, F1, B1, the gradient, B0: nothing overlaps with one microbatch.
    args = ([1.0, 2.0], [3.0, 4.0], [0.5], [0.25])
    assert iteration_time_1f1b(*args, 1) == pytest.approx(1 + 0.5 + 2 + 4 + 0.25 + 3)
    assert simulate_train_schedule(*args, 1).makespan_s == pytest.approx(10.75)


@settings(max_examples=30, deadline=None)
@given(forward=positive, backward=positive, num_microbatches=st.integers(1, 50))
def test_single_stage_is_gradient_accumulation(forward, backward, num_microbatches):
    assert iteration_time_1f1b([forward], [backward], [], [], num_microbatches) == pytest.approx(
        num_microbatches * (forward + backward)
    )


@settings(max_examples=50, deadline=None)
@given(forward=positive, backward=positive, num_stages=st.integers(1, 10), num_microbatches=st.integers(1, 40))
def test_identical_stages_without_transfers_give_the_textbook_time(forward, backward, num_stages, num_microbatches):
    # DeepSpeed's lock-step pairing costs nothing extra here, even with forward != backward.
    zeros = [0.0] * (num_stages - 1)
    time_s = iteration_time_1f1b([forward] * num_stages, [backward] * num_stages, zeros, zeros, num_microbatches)
    assert time_s == pytest.approx((num_microbatches + num_stages - 1) * (forward + backward), rel=1e-9)


def test_identical_stages_textbook_time_confirmed_by_simulation():
    args = ([1.0] * 4, [2.0] * 4, [0.0] * 3, [0.0] * 3)
    assert simulate_train_schedule(*args, 8).makespan_s == pytest.approx((8 + 4 - 1) * 3.0)


@pytest.mark.parametrize(
    "forward, backward, num_microbatches, exact, seed",
    [
        # Two stages, the first one slow: its warm-up bubble (F1 + B1 - F0 = 1 s) is missed.
        ([1.0, 1.0], [3.0, 1.0], 8, 33.0, 32.0),
        # Three stages, the middle one slow, at the seed's planning default N_b = 4 S.
        ([1.0, 1.0, 1.0], [1.0, 3.0, 1.0], 12, 51.0, 50.0),
    ],
)
def test_seed_formula_counterexamples(forward, backward, num_microbatches, exact, seed):
    zeros = [0.0] * (len(forward) - 1)
    assert seed_formula(forward, backward, num_microbatches) == pytest.approx(seed)
    assert iteration_time_1f1b(forward, backward, zeros, zeros, num_microbatches) == pytest.approx(exact)
    assert simulate_train_schedule(forward, backward, zeros, zeros, num_microbatches).makespan_s == pytest.approx(exact)


@settings(max_examples=40, deadline=None)
@given(
    pipeline=pipelines(),
    num_microbatches=st.integers(1, 12),
    which=st.integers(0, 3),
    index=st.integers(0, 5),
    extra=st.floats(min_value=1e-3, max_value=5.0),
)
def test_slower_anything_never_makes_the_iteration_faster(pipeline, num_microbatches, which, index, extra):
    slower = [list(seq) for seq in pipeline]
    if not slower[which]:
        which = 0  # one stage has no boundaries: slow a compute cost instead
    slower[which][index % len(slower[which])] += extra
    before = iteration_time_1f1b(*pipeline, num_microbatches)
    after = iteration_time_1f1b(*slower, num_microbatches)
    assert after >= before - 1e-9 * before


@settings(max_examples=30, deadline=None)
@given(pipeline=pipelines(max_stages=8), max_microbatches=st.integers(2, 30))
def test_more_microbatches_take_longer_within_work_bounds(pipeline, max_microbatches):
    forward, backward, send_activation, send_grad = pipeline
    times = iteration_times(*pipeline, max_microbatches)
    assert all(later > earlier for earlier, later in zip(times, times[1:]))
    # Not by a full F0 + B0 per microbatch: an extra microbatch can fill a warm-up bubble.
    busiest = max(f + b for f, b in zip(forward, backward))
    serial = sum(forward) + sum(backward) + sum(send_activation) + sum(send_grad)
    for q, time_s in enumerate(times, start=1):
        assert q * busiest * (1 - 1e-9) <= time_s <= q * serial * (1 + 1e-9)


def test_dispatch_table_rejects_unknown_instruction():
    with pytest.raises(ValueError, match="CommitP2P"):
        execute_streams([[ds.ForwardPass(0), ds.CommitP2P()]], [1.0], [1.0], [], [])


def test_send_send_deadlock_is_detected():
    # Both stages send first: blocking send/recv cannot complete, so this must not hang.
    streams = [[ds.SendActivation(0), ds.RecvGrad(0)], [ds.SendGrad(0), ds.RecvActivation(0)]]
    with pytest.raises(RuntimeError, match="deadlock"):
        execute_streams(streams, [1.0, 1.0], [1.0, 1.0], [0.1], [0.1])


def test_simple_exchange_waits_for_both_ends():
    # Stage 1 reaches its receive at 0 s but the activation exists only at 2 s; the grad follows it.
    streams = [[ds.ForwardPass(0), ds.SendActivation(0), ds.RecvGrad(0)], [ds.RecvActivation(0), ds.SendGrad(0)]]
    result = execute_streams(streams, [2.0, 1.0], [1.0, 1.0], [0.5], [0.25])
    assert result.stage_finish_s == pytest.approx((2.75, 2.75))


@pytest.mark.parametrize(
    "args, field",
    [
        (([], [], [], [], 1), "forward"),
        (([1.0], [1.0, 2.0], [], [], 1), "backward"),
        (([1.0, 1.0], [1.0, 1.0], [], [0.0], 1), "send_activation"),
        (([1.0, 1.0], [1.0, 1.0], [0.0], [-1.0], 1), "send_grad"),
        (([math.nan], [1.0], [], [], 1), "forward"),
        (([1.0], [math.inf], [], [], 1), "backward"),
        (([1.0], [1.0], [], [], 0), "num_microbatches"),
        (([1.0], [1.0], [], [], 2.5), "num_microbatches"),
    ],
)
def test_bad_inputs_name_the_argument(args, field):
    with pytest.raises(ValueError, match=field):
        iteration_time_1f1b(*args)
    with pytest.raises(ValueError, match=field):
        simulate_train_schedule(*args)


def test_large_pipeline_is_fast():
    forward = [0.01 * (1 + k % 7) for k in range(64)]
    backward = [0.02 * (1 + k % 5) for k in range(64)]
    pipeline = (forward, backward, [0.001] * 63, [0.002] * 63)
    best = min(_timed(lambda: iteration_time_1f1b(*pipeline, 256)) for _ in range(3))
    # ~15 ms when the machine is idle; the bound only catches a per-instruction or O(M^2) regression.
    assert best < 0.2
    best_all = min(_timed(lambda: iteration_times(*pipeline, 256)) for _ in range(2))
    assert best_all < 0.5


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start
