"""Batch distribution: exact min-max splits against brute force, errors, solvers agreeing."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oobleck_mm.planning.batch import (
    BatchSplitError,
    TimeTable,
    min_max_split,
    nearest_global_batches,
    split_batch,
)
from oobleck_mm.planning.template import PipelineTemplate, StageSpec

# Binary fractions: sums stay exact, so equal predicted times really tie.
SECONDS = st.sampled_from([0.125, 0.25, 0.375, 0.5, 0.75, 1.0, 1.5])


def make_template(num_nodes: int, forward, backward, comm: float = 0.0) -> PipelineTemplate:
    """A hand-built template with one stage per entry of ``forward``."""
    num_stages = len(forward)
    stages = tuple(
        StageSpec(
            layer_start=i,
            layer_end=i + 1,
            node=min(i * num_nodes // num_stages, num_nodes - 1),
            gpus=(0,),
            forward_s=forward[i],
            backward_s=backward[i],
            memory_bytes=0.0,
            grad_bytes=1e6,
        )
        for i in range(num_stages)
    )
    return PipelineTemplate(
        num_nodes=num_nodes,
        gpus_per_node=1,
        stages=stages,
        send_activation_s=(comm,) * (num_stages - 1),
        send_grad_s=(comm,) * (num_stages - 1),
    )


@st.composite
def templates(draw, num_nodes: int = 1):
    num_stages = draw(st.integers(1, 3))
    forward = draw(st.lists(SECONDS, min_size=num_stages, max_size=num_stages))
    backward = draw(st.lists(SECONDS, min_size=num_stages, max_size=num_stages))
    comm = draw(st.sampled_from([0.0, 0.125]))
    return make_template(num_nodes, forward, backward, comm)


@st.composite
def split_instances(draw, max_pipelines: int = 4, max_extra: int = 6):
    """(one template per pipeline, total microbatches): 1-3 distinct templates, repeats allowed."""
    distinct = draw(st.lists(templates(), min_size=1, max_size=3))
    pipelines = draw(st.lists(st.sampled_from(distinct), min_size=1, max_size=max_pipelines))
    total = len(pipelines) + draw(st.integers(0, max_extra))
    return pipelines, total


def compositions(total: int, parts: int):
    """Every tuple of ``parts`` integers >= 1 summing to ``total``."""
    for cuts in itertools.combinations(range(1, total), parts - 1):
        bounds = (0, *cuts, total)
        yield tuple(b - a for a, b in zip(bounds, bounds[1:]))


def max_time(pipelines, microbatches) -> float:
    return max(t.iteration_time(q) for t, q in zip(pipelines, microbatches))


def brute_force_time(pipelines, total: int) -> float:
    return min(max_time(pipelines, c) for c in compositions(total, len(pipelines)))


def idle(pipelines, microbatches) -> float:
    """The MILP's secondary objective: per template, pipelines x time at its per-pipeline ceiling."""
    per_template: dict[PipelineTemplate, list[int]] = {}
    for t, q in zip(pipelines, microbatches):
        per_template.setdefault(t, []).append(q)
    return sum(len(qs) * t.iteration_time(max(qs)) for t, qs in per_template.items())


def check_split(pipelines, microbatches, total: int) -> None:
    assert len(microbatches) == len(pipelines)
    assert sum(microbatches) == total
    assert min(microbatches) >= 1
    # Identical pipelines are balanced to floor/ceil of their share.
    for t in set(pipelines):
        qs = [q for p, q in zip(pipelines, microbatches) if p == t]
        assert max(qs) - min(qs) <= 1, (qs, microbatches)


@settings(max_examples=60, deadline=None)
@given(split_instances())
def test_min_max_split_is_optimal(instance):
    pipelines, total = instance
    split = min_max_split(pipelines, total)
    check_split(pipelines, split, total)
    assert max_time(pipelines, split) == brute_force_time(pipelines, total)


@settings(max_examples=15, deadline=None)
@given(split_instances(), st.sampled_from([1, 2, 3]))
def test_highs_split_is_optimal_and_idles_least(instance, microbatch_size):
    pipelines, total = instance
    result = split_batch(pipelines, total * microbatch_size, microbatch_size, solver="highs")
    check_split(pipelines, result.microbatches, total)
    assert sum(result.microbatches) * microbatch_size == total * microbatch_size
    assert result.iteration_time_s == max_time(pipelines, result.microbatches)
    assert result.iteration_time_s == brute_force_time(pipelines, total)
    # Among optimal splits the MILP minimises idle time; the pure search is one of them.
    python = min_max_split(pipelines, total)
    assert idle(pipelines, result.microbatches) <= idle(pipelines, python) + 1e-9
    assert "optimal" in result.reason


def test_highs_prefers_less_idle_among_equal_max():
    # The slow pipeline fixes T = T_slow(2); the fast template can take 2 or 3
    # per pipeline without exceeding it. Idle time is lower with fewer on the fast ones.
    slow = make_template(1, [1.0], [2.0])
    fast = make_template(1, [0.25], [0.5])
    pipelines = [slow, fast, fast]
    result = split_batch(pipelines, 6, 1, solver="highs")
    assert result.iteration_time_s == brute_force_time(pipelines, 6)
    best_idle = min(
        idle(pipelines, c)
        for c in compositions(6, 3)
        if max_time(pipelines, c) == result.iteration_time_s and c[1] - c[2] in (-1, 0, 1)
    )
    assert idle(pipelines, result.microbatches) == best_idle


def test_identical_pipelines_get_floor_and_ceil():
    t = make_template(2, [0.5, 0.5], [1.0, 1.0], comm=0.125)
    assert min_max_split([t, t, t], 10) == (4, 3, 3)
    for solver in ("python", "highs"):
        assert sorted(split_batch([t, t, t], 20, 2, solver=solver).microbatches) == [3, 3, 4]


def test_faster_pipeline_gets_more_microbatches():
    slow = make_template(1, [1.0, 1.0], [2.0, 2.0], comm=0.125)
    fast = make_template(2, [0.25, 0.25, 0.25, 0.25], [0.5, 0.5, 0.5, 0.5], comm=0.125)
    q_slow, q_fast = split_batch([slow, fast], 64, 2).microbatches
    assert q_fast > 2 * q_slow


def test_large_split_is_exact_and_fast():
    """256 nodes' worth of pipelines from 5 templates: the MILP stays tiny and agrees with the search."""
    import time

    distinct = [make_template(n, [0.5 / n] * (2 * n), [1.0 / n] * (2 * n), comm=0.01) for n in range(2, 7)]
    pipelines = [distinct[i % 5] for i in range(64)]
    split_batch(pipelines[:2], 2, 1, solver="highs")  # import Pyomo outside the timing
    start = time.perf_counter()
    result = split_batch(pipelines, 2048, 2, solver="highs")
    elapsed = time.perf_counter() - start
    print(f"\nsplit 1024 microbatches over 64 pipelines (5 templates): {elapsed * 1e3:.1f} ms, {result.reason}")
    check_split(pipelines, result.microbatches, 1024)
    assert result.iteration_time_s == max_time(pipelines, min_max_split(pipelines, 1024))


def test_a_huge_global_batch_is_split_at_once_never_handed_to_an_unbounded_milp():
    # A fuzzed config's global batch of 1,401,758 kept HiGHS busy for over ten minutes (its time limit
    # of 10 s notwithstanding): one template needs no solve, and an oversized model is not built.
    import time

    t = make_template(2, [0.5, 0.5], [1.0, 1.0], comm=0.125)
    fast = make_template(1, [0.25, 0.25], [0.5, 0.5], comm=0.125)
    for pipelines in ([t, t, t, t], [t, fast, t, fast]):
        start = time.perf_counter()
        result = split_batch(pipelines, 1_401_758, 2, solver="highs")
        assert time.perf_counter() - start < 30, result.reason
        check_split(pipelines, result.microbatches, 700_879)
        assert result.iteration_time_s == max_time(pipelines, min_max_split(pipelines, 700_879))


@pytest.mark.parametrize(
    ("global_batch", "microbatch_size", "pipelines", "nearest"),
    [
        (10, 4, 2, (8, 12)),  # not a multiple
        (4, 4, 3, (12,)),  # fewer microbatches than pipelines: nothing valid below
        (13, 4, 3, (12, 16)),
        (7, 1, 8, (8,)),
    ],
)
def test_impossible_batch_names_nearest_valid_batches(global_batch, microbatch_size, pipelines, nearest):
    t = make_template(1, [1.0], [1.0])
    with pytest.raises(BatchSplitError) as info:
        split_batch([t] * pipelines, global_batch, microbatch_size)
    error = info.value
    assert error.nearest_global_batches == nearest
    message = str(error)
    assert f"global batch {global_batch}" in message
    assert f"microbatch size {microbatch_size}" in message
    assert f"{pipelines} pipelines" in message
    assert " and ".join(map(str, nearest)) in message
    for valid in nearest:
        split_batch([t] * pipelines, valid, microbatch_size, solver="python")  # really valid


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 200), st.integers(1, 16), st.integers(1, 20))
def test_nearest_global_batches_are_the_nearest_valid(global_batch, microbatch_size, pipelines):
    def valid(batch):
        return batch % microbatch_size == 0 and batch >= pipelines * microbatch_size

    nearest = nearest_global_batches(global_batch, microbatch_size, pipelines)
    above = nearest[-1]
    assert valid(above) and above > global_batch
    assert not any(valid(b) for b in range(global_batch + 1, above))
    if len(nearest) == 2:
        below = nearest[0]
        assert valid(below) and below < global_batch
        assert not any(valid(b) for b in range(below + 1, global_batch))
    else:
        assert not any(valid(b) for b in range(1, global_batch))


def test_bad_arguments_are_value_errors():
    t = make_template(1, [1.0], [1.0])
    with pytest.raises(ValueError, match="solver"):
        split_batch([t], 4, 1, solver="cplex")
    with pytest.raises(ValueError, match="microbatch_size"):
        split_batch([t], 4, 0)
    with pytest.raises(ValueError, match="pipeline"):
        split_batch([], 4, 1)


@settings(max_examples=25, deadline=None)
@given(templates(), st.floats(0.1, 30.0), st.integers(1, 40), st.integers(0, 10), st.booleans())
def test_capacity_matches_linear_scan(template, time_s, limit, known, strict):
    table = TimeTable(template)
    times = [template.iteration_time(q) for q in range(1, limit + 1)]
    fits = [q for q, t in zip(range(1, limit + 1), times) if (t < time_s if strict else t <= time_s)]
    expected = max(fits, default=0)
    known = min(known, expected)  # the caller's promise: q <= known qualify
    assert table.capacity(time_s, limit, known=known, strict=strict) == expected
    # The closed-form bound the table is sized by really is an upper bound.
    assert all(table._capacity_bound(t) >= q for q, t in zip(range(1, limit + 1), times))


def test_time_table_matches_iteration_time():
    t = make_template(3, [0.5, 0.25, 0.75], [1.0, 0.5, 1.5], comm=0.125)
    table = TimeTable(t)
    # Bit-identical: the searches and PipelineInstance.iteration_time_s must agree on ties.
    assert [table(q) for q in range(1, 30)] == [t.iteration_time(q) for q in range(1, 30)]


def _mindtpy_missing() -> str | None:
    try:
        import cyipopt  # noqa: F401
    except ImportError:
        return "cyipopt is not installed (scripts/install_minlp.sh)"
    from pyomo.contrib.pynumero.asl import AmplInterface

    if not AmplInterface.available():
        return "PyNumero's AMPL interface is not built (scripts/install_minlp.sh)"
    return None


@pytest.mark.skipif(_mindtpy_missing() is not None, reason=str(_mindtpy_missing()))
def test_mindtpy_and_highs_agree_on_feasibility():
    slow = make_template(1, [1.0, 1.0], [2.0, 2.0], comm=0.125)
    fast = make_template(2, [0.5, 0.5, 0.5], [1.0, 1.0, 1.0], comm=0.125)
    pipelines = [slow, fast, fast]
    for global_batch in (6, 14):
        highs = split_batch(pipelines, global_batch, 2, solver="highs")
        mindtpy = split_batch(pipelines, global_batch, 2, solver="mindtpy")
        check_split(pipelines, mindtpy.microbatches, global_batch // 2)
        # eq. 2.6 balances a linear estimate; its exact time can only be worse than the optimum.
        assert mindtpy.iteration_time_s >= highs.iteration_time_s
        assert mindtpy.iteration_time_s == max_time(pipelines, mindtpy.microbatches)
        assert "mindtpy" in mindtpy.reason
    for bad in (5, 4):  # odd / fewer microbatches than pipelines
        for solver in ("highs", "mindtpy"):
            with pytest.raises(BatchSplitError):
                split_batch(pipelines, bad, 2, solver=solver)


@pytest.mark.skipif(_mindtpy_missing() is not None, reason=str(_mindtpy_missing()))
def test_mindtpy_minimises_the_seed_variance_objective():
    """eq. 2.6 with T_i = T_i(1): a pipeline twice as fast per single microbatch gets twice the work."""
    slow = make_template(1, [2.0], [2.0])
    fast = make_template(1, [1.0], [1.0])
    result = split_batch([slow, fast], 9, 1, solver="mindtpy")
    assert result.microbatches == (3, 6)
    assert math.isclose(result.iteration_time_s, max(slow.iteration_time(3), fast.iteration_time(6)))


def test_time_table_is_seamless_between_short_and_long_runs():
    # TimeTable computes q < S one run at a time and q >= S as one extrapolated table: the two must
    # agree with the exact recurrence and keep T non-decreasing across the seam.
    from oobleck_mm.planning.pipeline_time import iteration_time_1f1b
    from oobleck_mm.planning.template import TimeTable

    stages = [(0.3 + 0.1 * (k % 3), 0.5 + 0.2 * (k % 2)) for k in range(12)]
    template = PipelineTemplate(
        num_nodes=12,
        gpus_per_node=1,
        stages=tuple(
            StageSpec(layer_start=k, layer_end=k + 1, node=k, gpus=(0,), forward_s=f, backward_s=b, memory_bytes=0.0)
            for k, (f, b) in enumerate(stages)
        ),
        send_activation_s=(0.05,) * 11,
        send_grad_s=(0.05,) * 11,
    )
    table = TimeTable(template)
    values = [table(q) for q in (40, 3, 12, 11, 13, 1, 200)]  # out of order: both parts grow on demand
    exact = [
        iteration_time_1f1b(
            [f for f, _ in stages], [b for _, b in stages], template.send_activation_s, template.send_grad_s, q
        )
        for q in (40, 3, 12, 11, 13, 1, 200)
    ]
    assert values == pytest.approx(exact, rel=1e-11)
    series = [table(q) for q in range(1, 60)]
    assert all(a <= b for a, b in zip(series, series[1:]))
