"""The balancer prices branched pipelines (issue 49): encoders on stages of their own, concurrently, feeding the
LLM's first stage (``planning.layout.PipelineLayout.branches``).

The search sees a branched pipeline as a chain whose branch stages, aligned at the merge, are one position
costing per sample the largest of the branches' costs; exact times run the branches as the engine does
(``planning.branch_time.simulate_microbatches``, DeepSpeed's instruction streams). Branches of one stage take
at most that chain with the position's per-microbatch time the slowest branch's (equal when one branch is the
slowest throughout): the search's stand-in never promises a branched pipeline more than it delivers.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oobleck_mm.balance.balancer import _placement, balance
from oobleck_mm.balance.cost_model import CostCoefficients, CostModel
from oobleck_mm.balance.metrics import imbalance
from oobleck_mm.balance.problem import BalanceProblem, Placement, PipelineShape
from oobleck_mm.balance.schedule_time import iteration_time
from oobleck_mm.balance.work import sample_features
from oobleck_mm.config import load_config
from oobleck_mm.config.shape import layer_specs
from oobleck_mm.data.dataset import ModelInputs
from oobleck_mm.planning.branch_time import simulate_microbatches
from oobleck_mm.profiling.analytical import profile_from_config
from test_balance import skewed_metas

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.fixture(scope="module")
def mllm():
    job = load_config(CONFIGS / "mllm_10b.yaml")
    specs = layer_specs(job.model, job.data)
    model = CostModel.from_profile(profile_from_config(job), specs)
    names = [s.name for s in specs]
    return model, CostCoefficients.initial(3e-5), ModelInputs.from_model(job.model), names


def seams(names):
    return names.index("audio.embed"), names.index("llm.embed"), len(names)


def branched_shape(names, micro, vision_stages=1, llm_stages=2):
    """The vision encoder on ``vision_stages`` stages, the audio encoder on one, the LLM on ``llm_stages``."""
    audio, llm, end = seams(names)
    vision = [round(k * audio / vision_stages) for k in range(vision_stages + 1)]
    lm = [llm + round(k * (end - llm) / llm_stages) for k in range(llm_stages + 1)]
    stages = (*zip(vision, vision[1:]), (audio, llm), *zip(lm, lm[1:]))
    return PipelineShape(micro, stages, branches=(0, vision_stages), merge=vision_stages + 1)


def chain_shape(names, micro, depth):
    end = len(names)
    cuts = [round(k * end / depth) for k in range(depth + 1)]
    return PipelineShape(micro, tuple(zip(cuts, cuts[1:])))


def problem_of(mllm, shapes, seed=0):
    model, coefficients, dims, _ = mllm
    num = 2 * sum(s.num_microbatches for s in shapes)
    metas = skewed_metas(np.random.default_rng(seed), num, dims)
    ids = [1000 + m.index for m in metas]
    return BalanceProblem.build(ids, sample_features(metas, dims), shapes, model, coefficients, 2, seed)


@settings(max_examples=60, deadline=None)
@given(
    st.integers(2, 3).flatmap(
        lambda branches: st.integers(1, 3).flatmap(
            lambda llm: st.integers(1, 6).flatmap(
                lambda m: st.tuples(
                    st.just((branches, llm, m)),
                    st.lists(
                        st.lists(st.floats(0.0, 5.0), min_size=2 * m, max_size=2 * m),
                        min_size=branches + llm,
                        max_size=branches + llm,
                    ),
                )
            )
        )
    )
)
def test_branches_of_one_stage_take_at_most_a_chain_whose_first_stage_is_the_slowest_branch(case):
    """The search's stand-in is an upper bound: raising every branch's times to the slowest branch's makes the
    branches one chain stage, and a schedule of blocking transfers never ends earlier when an operation takes
    longer. Equal when one branch is the slowest at every operation; below when branches are slow at different
    operations between two transfers (one's backward beside another's next forward)."""
    (branches, llm, m), rows = case
    forward = [row[:m] for row in rows]
    backward = [row[m:] for row in rows]
    exact = simulate_microbatches(tuple(range(branches)), branches, forward, backward)
    slowest_f = np.max(forward[:branches], axis=0)
    slowest_b = np.max(backward[:branches], axis=0)
    chain = iteration_time(np.vstack([slowest_f, forward[branches:]]), np.vstack([slowest_b, backward[branches:]]))
    assert exact <= chain * (1 + 1e-12) + 1e-12
    dominated = [slowest_f.tolist(), *forward[1:]], [slowest_b.tolist(), *backward[1:]]
    assert simulate_microbatches(tuple(range(branches)), branches, *dominated) == pytest.approx(chain, abs=1e-12)


def test_branches_slow_at_different_operations_overlap():
    # branch 0's backward of microbatch 0 runs beside branch 1's forward of microbatch 2 (no transfer between)
    forward = [[0.0, 0.0, 0.0], [0.0, 0.0, 1.0], [0.0, 0.0, 0.0]]
    backward = [[1.0, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    assert simulate_microbatches((0, 1), 2, forward, backward) == 1.0
    assert iteration_time(np.array([[0.0, 0.0, 1.0], [0.0] * 3]), np.array([[1.0, 0.0, 0.0], [0.0] * 3])) == 2.0


def test_a_branched_pipeline_is_one_concurrent_position_for_the_search_and_its_branches_for_exact_times(mllm):
    _, _, _, names = mllm
    shape = branched_shape(names, 4)
    problem = problem_of(mllm, [shape, chain_shape(names, 4, 3)])
    assert problem.num_stages.tolist() == [3, 3]  # [vision || audio], llm, llm; and the chain's 3
    (members,) = problem.concurrent
    column = int(problem.stage_index[0, 0])
    assert len(members) == 2 and column not in members
    assert (problem.cost[:, column] == problem.cost[:, list(members)].max(axis=1)).all()
    # Exact: the same stages as a chain problem give every stage's per-microbatch ticks; the branched time is
    # DeepSpeed's streams run on them.
    plain = problem_of(mllm, [PipelineShape(4, shape.stages), chain_shape(names, 4, 3)])
    rng = np.random.default_rng(3)
    order = rng.permutation(problem.num_samples)  # every microbatch of both pipelines gets two samples
    placement = Placement((order // 8).astype(np.int64), (order % 4).astype(np.int64))
    ticks = plain.microbatch_ticks(placement)[0, : len(shape.stages), :4] * plain.tick_s
    share = plain.forward_share[plain.stage_index[0, : len(shape.stages)]][:, None]
    expected = simulate_microbatches(
        shape.branches, shape.merge, (ticks * share).tolist(), (ticks * (1 - share)).tolist()
    )
    assert problem.predicted_times(placement)[0] == pytest.approx(expected, rel=1e-12)
    # ... and the chain beside it is timed as before
    assert problem.predicted_times(placement)[1] == pytest.approx(plain.predicted_times(placement)[1], rel=1e-12)


@pytest.mark.parametrize("vision_stages", [1, 2])
def test_the_balancer_evens_a_branched_pipeline_with_a_chain(mllm, vision_stages):
    _, _, _, names = mllm
    shapes = [branched_shape(names, 4, vision_stages), chain_shape(names, 4, 2)]
    problem = problem_of(mllm, shapes, seed=vision_stages)
    result = balance(problem, "ours", threshold=0.0)
    counts = problem.num_microbatches.tolist()
    result.assignment.check_covers(problem.sample_ids.tolist(), counts)
    assert result.algorithm == "ours", result.assignment.reason
    assert max(result.predicted_s) < max(result.unbalanced_s)
    assert imbalance(result.predicted_s) < imbalance(result.unbalanced_s)
    # what balance() reports is the exact time of its assignment
    placement = _placement(problem, result.assignment)
    assert list(problem.predicted_times(placement)) == pytest.approx(result.predicted_s, rel=1e-12)


def test_deferral_on_a_branched_pipeline_is_kept_only_where_its_branched_time_is_lower(mllm):
    """Entrain's deferral on a branched pipeline: timed with its branches run as the engine runs them (the
    branch stages' encoder groups, the merge stage's regrouped LLM microbatches); where it defers, the
    pipeline's time is below the undeferred one's, every sample still runs once, and the last slot defers
    nothing. Some of the skewed batches must defer, or the test exercises nothing."""
    _, _, _, names = mllm
    deferring = 0
    for seed in range(4):
        problem = problem_of(mllm, [branched_shape(names, 6), chain_shape(names, 6, 2)], seed=seed)
        plain = balance(problem, "ours", threshold=0.0)
        result = balance(problem, "ours", threshold=0.0, deferral=True)
        result.assignment.check_covers(problem.sample_ids.tolist(), problem.num_microbatches.tolist())
        gone = result.assignment.deferred[0] if result.assignment.deferred else ()
        if any(gone):
            deferring += 1
            assert not gone[-1]
            assert result.predicted_s[0] < plain.predicted_s[0]
            llm = result.assignment.llm_microbatches(0)
            assert sorted(i for mb in llm for i in mb) == sorted(i for mb in result.assignment.pipelines[0] for i in mb)
        assert max(result.predicted_s) <= max(plain.predicted_s) + 1e-12
    assert deferring, "no batch deferred on the branched pipeline"


def test_bad_branches_name_the_numbers():
    with pytest.raises(ValueError, match=r"branches \(0, 3\) must start at stage 0 and ascend below merge 2"):
        PipelineShape(2, ((0, 1), (1, 2), (2, 3), (3, 4)), branches=(0, 3), merge=2)


def test_pipeline_speeds_scale_a_branched_pipelines_exact_time(mllm):
    """``with_pipeline_speeds`` (what ``balance`` re-places on after deferral) copies a branched pipeline's own
    stage columns with its factor: any placement's exact time of each pipeline scales by its factor (up to the
    ticks' rounding). A branched pipeline left at its old columns would keep its old time."""
    _, _, _, names = mllm
    problem = problem_of(mllm, [branched_shape(names, 4, 2), chain_shape(names, 4, 2)])
    result = balance(problem, "ours", threshold=0.0)
    placement = _placement(problem, result.assignment)
    factors = [0.7, 1.3]
    scaled = problem.with_pipeline_speeds(factors)
    assert scaled.branched[0] is not None and scaled.branched[1] is None
    expected = [f * t for f, t in zip(factors, problem.predicted_times(placement))]
    assert list(scaled.predicted_times(placement)) == pytest.approx(expected, rel=1e-6)
