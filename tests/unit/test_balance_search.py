"""The compiled core of ``ours``: its 1F1B time, its microbatch split, its bookkeeping, its quality and
its determinism, each against an independent computation (numpy's scorer, the pure-Python run)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oobleck_mm.balance import search
from oobleck_mm.balance.balancer import ALGORITHMS
from oobleck_mm.balance.metrics import imbalance
from oobleck_mm.balance.ours import target_shares
from oobleck_mm.balance.problem import Placement
from oobleck_mm.balance.schedule_time import iteration_times
from oobleck_mm.balance.split import descending

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).parent))
from test_balance import make_problem, mllm  # noqa: E402,F401  (the fixture is used by name)


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 8), st.integers(1, 24), st.integers(0, 2**31 - 1))
def test_pipeline_time_equals_the_vectorised_schedule_recurrence(num_stages, num_micro, seed):
    """``schedule_time.iteration_times`` is itself held to DeepSpeed's executed instruction streams."""
    rng = np.random.default_rng(seed)
    ticks = np.rint(rng.lognormal(10, 1.5, size=(num_stages, num_micro)))
    share = rng.uniform(0.2, 0.5, size=num_stages)
    tick_s = 1e-9
    ours = search.pipeline_time(ticks, share, num_stages, num_micro, np.empty(num_stages + 2)) * tick_s
    seconds = ticks * tick_s
    forward = seconds * share[:, None]
    reference = iteration_times(forward[None], (seconds - forward)[None], np.array([num_stages]), np.array([num_micro]))
    assert ours == pytest.approx(float(reference[0]), rel=1e-12)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 6), st.integers(1, 12), st.integers(0, 40), st.integers(0, 2**31 - 1))
def test_split_gives_every_member_one_microbatch_and_runs_them_light_heavy_light(num_stages, m, extra, seed):
    rng = np.random.default_rng(seed)
    n = m + extra
    cost = np.rint(rng.lognormal(8, 2, size=(n + 5, num_stages + 1)))
    cost[:, -1] = 0
    cols = np.arange(num_stages)
    fixed = np.rint(rng.uniform(0, 1e3, size=num_stages))
    weight = cost[:, :num_stages].sum(axis=1)
    row = np.argsort(-weight, kind="stable")[:n]  # heaviest first, as the search keeps rows
    load = cost[row][:, cols].sum(axis=0) + m * fixed
    ticks, micro = np.empty((num_stages, m)), np.empty(n, dtype=np.int64)
    search.split(row, n, load, cost, cols, fixed, m, ticks, np.empty(m), micro)
    assert ((micro >= 0) & (micro < m)).all()
    assert np.bincount(micro, minlength=m).min() >= 1  # n >= m: no microbatch is empty
    expected = np.tile(fixed[:, None], (1, m))
    for slot, b in enumerate(micro):
        expected[:, b] += cost[row[slot], cols]
    np.testing.assert_array_equal(ticks, expected)  # integral ticks: exact
    bottleneck = ticks.max(axis=0)
    peak = int(np.argmax(bottleneck))
    assert (np.diff(bottleneck[: peak + 1]) >= 0).all() and (np.diff(bottleneck[peak:]) <= 0).all()


def test_the_search_bookkeeping_matches_the_independent_scorer(mllm):
    """Rows, loads and times are updated incrementally by every applied exchange; numpy's scorer
    re-derives each pipeline's time from the final placement alone."""
    problem = make_problem(mllm, [2, 3, 4, 6, 8], [8, 12, 16, 24, 32], seed=21)
    result = search.place(problem, target_shares(problem), 200, 0.0)
    assert result.steps > 10  # the polish did move samples
    placement = Placement(result.pipeline, result.microbatch)
    problem.check(placement)
    np.testing.assert_array_equal(result.stage_loads, problem.stage_loads(result.pipeline))  # integral: exact
    np.testing.assert_allclose(result.seconds, problem.predicted_times(placement), rtol=1e-12)


def test_the_polish_only_ever_improves_the_slowest_pipeline(mllm):
    problem = make_problem(mllm, [2, 4, 8, 3], [10, 20, 40, 15], seed=4)
    shares = target_shares(problem)
    times = [search.place(problem, shares, steps, 0.0).seconds.max() for steps in (0, 1, 2, 4, 8, 16, 32)]
    assert all(b <= a for a, b in zip(times, times[1:]))
    assert times[-1] < times[0]


@pytest.mark.parametrize("depths,micro", [([2, 3, 4, 6, 8] * 3, [16, 24, 32, 48, 64] * 3), ([4, 8] * 8, [32, 64] * 8)])
def test_ours_is_within_two_percent_with_64_samples_per_pipeline(mllm, depths, micro):
    """The benchmark's quality target on skewed multimodal batches (two samples per microbatch)."""
    problem = make_problem(mllm, depths, micro, seed=3)
    assert problem.num_samples / problem.num_pipelines >= 64
    placement = ALGORITHMS["ours"](problem)
    assert imbalance(problem.predicted_times(placement)) <= 1.02


def test_descending_order_breaks_ties_by_sample_id_on_either_path():
    weight = np.array([5.0, 7.0, 5.0, 7.0, 1.0])
    ids = np.array([40, 30, 20, 10, 0])
    assert descending(weight, ids).tolist() == [3, 1, 2, 0, 4]
    huge = weight * 2.0**60  # past the packed int64 key: the lexsort path
    assert descending(huge, ids).tolist() == [3, 1, 2, 0, 4]
