"""The balancing decision: valid and deterministic placements, speed weighting, trigger, heavy samples, metrics."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from oobleck_mm.balance.assignment import contiguous_assignment
from oobleck_mm.balance.balancer import ALGORITHMS, balance, balance_batch, step_metrics
from oobleck_mm.balance.cost_model import CostCoefficients, CostModel
from oobleck_mm.balance.metrics import dist_ratio, imbalance, modality_dist_ratios
from oobleck_mm.balance.problem import BalanceProblem, PipelineShape, pipeline_shapes
from oobleck_mm.balance.work import sample_features
from oobleck_mm.config import load_config
from oobleck_mm.data.dataset import ModelInputs
from oobleck_mm.data.loader import build_dataset
from oobleck_mm.data.sample import SampleMeta
from oobleck_mm.config.shape import layer_specs
from oobleck_mm.profiling.analytical import profile_from_config
from oobleck_mm.planning.layout import ExecutionPlan

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.fixture(scope="module")
def mllm():
    job = load_config(CONFIGS / "mllm_10b.yaml")
    model = CostModel.from_profile(profile_from_config(job), layer_specs(job.model, job.data))
    return model, CostCoefficients.initial(3e-5), ModelInputs.from_model(job.model)


def skewed_metas(rng, num, dims, start=0):
    """0-4 images of 224-896 px, heavy-tailed text, a fifth with a clip."""
    unit, step = dims.patch_size, dims.audio_downsample * dims.audio_merge
    metas = []
    for i in range(num):
        images = int(rng.choice(5, p=[0.35, 0.35, 0.15, 0.1, 0.05]))
        sides = rng.integers(224 // unit, 896 // unit + 1, size=(images, 2)) * unit
        clips = (int(rng.integers(100, 3000)) // step * step,) if rng.random() < 0.2 else ()
        text = int(np.clip(rng.lognormal(np.log(250), 1.1), 16, 4096))
        metas.append(SampleMeta(start + i, text + images + len(clips), tuple(map(tuple, sides.tolist())), clips))
    return metas


def make_problem(mllm, depths, micro, microbatch_size=2, seed=0, metas=None, extra=0):
    model, coefficients, dims = mllm
    plan = ExecutionPlan.even(model.num_layers, depths, micro, microbatch_size)
    num = plan.global_batch + extra
    metas = skewed_metas(np.random.default_rng(seed), num, dims) if metas is None else metas
    ids = [1000 + 7 * m.index for m in metas]
    features = sample_features(metas, dims)
    return BalanceProblem.build(ids, features, pipeline_shapes(plan), model, coefficients, microbatch_size, seed)


def check_valid(problem, result):
    counts = problem.num_microbatches.tolist()
    result.assignment.check_covers(problem.sample_ids.tolist(), counts)
    assert all(len(mb) >= 1 for p in result.assignment.pipelines for mb in p)


# ---------------------------------------------------------------------- placements


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
@pytest.mark.parametrize("case", ["mixed", "one_sample_per_microbatch", "uneven_batch"])
def test_every_algorithm_places_each_sample_once_and_fills_every_microbatch(mllm, algorithm, case):
    if case == "mixed":
        problem = make_problem(mllm, [2, 4, 8], [6, 12, 20], seed=1)
    elif case == "one_sample_per_microbatch":
        problem = make_problem(mllm, [3, 5], [7, 9], microbatch_size=1, seed=2)
    else:  # a batch the fixed-size split cannot fill: no contiguous fallback exists
        problem = make_problem(mllm, [2, 6], [5, 9], seed=3, extra=5)
    result = balance(problem, algorithm, threshold=0.0)
    check_valid(problem, result)
    assert len(result.predicted_s) == problem.num_pipelines and result.assignment.reason


def test_decisions_are_identical_for_identical_inputs(mllm):
    """Every rank builds its own problem from the same metadata and must reach the same assignment."""
    metas = skewed_metas(np.random.default_rng(5), 120, mllm[2])
    # Ties everywhere: ten copies of one sample shape must still be broken by id, not by chance.
    metas += [SampleMeta(120 + i, 300, ((448, 448),), ()) for i in range(10)]
    first = balance(make_problem(mllm, [2, 4], [20, 45], metas=metas), "ours")
    second = balance(make_problem(mllm, [2, 4], [20, 45], metas=metas), "ours")
    assert first.assignment == second.assignment
    assert first.predicted_s == second.predicted_s


def test_ours_beats_the_unbalanced_split_and_every_baseline(mllm):
    problem = make_problem(mllm, [2, 4, 8, 3, 6], [10, 20, 40, 15, 30], seed=7)
    results = {name: balance(problem, name, threshold=0.0) for name in ALGORITHMS if name != "ours_fast"}
    ours = results.pop("ours")
    assert ours.algorithm == "ours"
    assert ours.predicted_max_s < max(ours.unbalanced_s)
    for name, other in results.items():
        assert ours.predicted_max_s < other.predicted_max_s, name
    assert ours.imbalance < 1.03
    metrics = step_metrics(problem, ours)
    assert metrics["predicted_imbalance"] == ours.imbalance
    # Tokens follow speed: each modality's share per pipeline is close to the pipeline's share.
    assert metrics["dist_text"] < step_metrics(problem, results["random"])["dist_text"]
    assert all(isinstance(v, float) for v in metrics.values())


def test_faster_pipelines_get_more_of_the_work(mllm):
    """Same microbatch count, 2 vs 8 stages (cut by layer count, so unevenly): the deep one is faster."""
    problem = make_problem(mllm, [2, 8], [24, 24], seed=8)
    result = balance(problem, "ours", threshold=0.0)
    shallow, deep = (sum(len(mb) for mb in p) for p in result.assignment.pipelines)
    assert deep > 1.5 * shallow
    assert result.imbalance < 1.05


def test_an_already_balanced_batch_keeps_the_contiguous_split(mllm):
    metas = [SampleMeta(i, 200, ((448, 448),), ()) for i in range(64)]  # all alike
    problem = make_problem(mllm, [4, 4], [16, 16], metas=metas)
    result = balance(problem, "ours", threshold=0.02)
    plain = contiguous_assignment(problem.sample_ids.tolist(), [16, 16], 2)
    assert result.algorithm == "contiguous"
    assert result.assignment.pipelines == plain.pipelines
    assert result.assignment.reason.startswith("kept contiguous: predicted imbalance 1.000")


def test_a_sample_heavier_than_a_pipeline_share_is_placed_not_refused(mllm):
    dims = mllm[2]
    metas = skewed_metas(np.random.default_rng(9), 47, dims)
    giant = SampleMeta(47, 4000 + 8, tuple((896, 896) for _ in range(8)), ())
    problem = make_problem(mllm, [4, 4, 4, 4], [6, 6, 6, 6], metas=[*metas, giant])
    result = balance(problem, "ours", threshold=0.0)
    check_valid(problem, result)
    giant_id = int(problem.sample_ids[-1])
    assert f"[{giant_id}]" in result.assignment.reason
    home = next(p for p, mbs in enumerate(result.assignment.pipelines) if any(giant_id in mb for mb in mbs))
    sizes = [sum(len(mb) for mb in mbs) for mbs in result.assignment.pipelines]
    assert sizes[home] == min(sizes)  # it shares its pipeline with as little as possible


def test_too_few_samples_for_the_microbatches_is_an_error_naming_the_numbers(mllm):
    metas = skewed_metas(np.random.default_rng(10), 9, mllm[2])
    problem = make_problem(mllm, [2, 2], [5, 5], metas=metas)
    with pytest.raises(
        ValueError, match=r"9 samples cannot give each of the 10 microbatches \(per pipeline: \[5, 5\]\)"
    ):
        balance(problem, "ours")


def test_unknown_algorithm_and_bad_threshold_are_rejected(mllm):
    problem = make_problem(mllm, [2], [4])
    with pytest.raises(ValueError, match="valid: ours, ours_fast, random, orchmllm_lpt"):
        balance(problem, "magic")
    with pytest.raises(ValueError, match="threshold must be >= 0"):
        balance(problem, "ours", threshold=-0.1)


def test_balance_batch_runs_from_dataset_metadata_and_an_execution_plan():
    job = load_config(CONFIGS / "tiny_mm.yaml")
    model = CostModel.from_profile(profile_from_config(job), layer_specs(job.model, job.data))
    dataset = build_dataset(job)
    plan = ExecutionPlan.even(model.num_layers, [2, 3], [3, 5], 2)
    ids = list(range(100, 100 + plan.global_batch))
    result = balance_batch(
        ids,
        [dataset.meta(i) for i in ids],
        ModelInputs.from_model(job.model),
        pipeline_shapes(plan),
        model,
        CostCoefficients.initial(),
        plan.microbatch_size,
    )
    result.assignment.check_covers(ids, [3, 5])


# ---------------------------------------------------------------------- microbatches


def test_microbatches_run_light_heavy_light(mllm):
    problem = make_problem(mllm, [4], [12], microbatch_size=3, seed=11)
    placement = ALGORITHMS["ours"](problem)  # one pipeline: balance() would keep the contiguous split
    ticks = problem.microbatch_ticks(placement)[0]  # (stages, microbatches)
    assert np.bincount(placement.microbatch, minlength=12).min() >= 1
    bottleneck = ticks.max(axis=0)
    peak = int(np.argmax(bottleneck))
    assert (np.diff(bottleneck[: peak + 1]) >= 0).all() and (np.diff(bottleneck[peak:]) <= 0).all()


# ---------------------------------------------------------------------- metrics


def test_imbalance_and_omnibal_dist_ratio():
    assert imbalance([2.0, 2.0]) == 1.0
    assert imbalance([3.0, 1.0]) == 1.5
    # OmniBal eq. 2: sum(T_max - T_i) / (T_max * N) = (0 + 2 + 4) / (4 * 3).
    assert dist_ratio([4.0, 2.0, 0.0]) == pytest.approx(0.5)
    assert dist_ratio([0.0, 0.0]) == 0.0
    with pytest.raises(ValueError):
        imbalance([])


def test_modality_dist_ratios_per_pipeline_and_weighted(mllm):
    dims = mllm[2]
    image, text = SampleMeta(0, 100, ((448, 448),), ()), SampleMeta(1, 300, (), ())
    features = sample_features([image, text, image, image], dims)
    ratios = modality_dist_ratios(features, [0, 1, 0, 1], 2)
    assert ratios["vision"] == pytest.approx(0.25)  # 2048 vs 1024 patches: (2048 - 1024) / (2048 * 2)
    assert ratios["audio"] == 0.0
    # Pipeline 0 is twice as fast: twice the patches is exactly its share.
    assert modality_dist_ratios(features, [0, 1, 0, 1], 2, weights=[2.0, 1.0])["vision"] == pytest.approx(0.0)


def test_one_sample_per_microbatch_never_leaves_one_empty():
    """As many samples as microbatches: every algorithm's placement is repaired to fill each one."""
    from oobleck_mm.balance.balancer import fill_empty_microbatches
    from oobleck_mm.balance.problem import Placement

    pipe = np.array([0, 0, 0, 1])
    micro = np.array([0, 0, 1, 0])  # pipeline 0 has microbatches 0..2: microbatch 2 is empty

    class Shape:
        num_pipelines = 2
        num_microbatches = np.array([3, 1])

    fixed = fill_empty_microbatches(Shape(), Placement(pipe, micro))
    assert sorted(zip(fixed.pipeline.tolist(), fixed.microbatch.tolist())) == [(0, 0), (0, 1), (0, 2), (1, 0)]


def test_a_pipeline_with_a_straggler_stage_gets_less_of_the_work(mllm):
    """``StageLayout.slowdown`` (a straggler's measured factor, sent with the plan): the balancer prices that
    stage's samples so, and of two pipelines that shared the work evenly the slow one now gets less of it."""
    import dataclasses

    model, coefficients, dims = mllm
    plan = ExecutionPlan.even(model.num_layers, [4, 4], [12, 12], 2)
    metas = skewed_metas(np.random.default_rng(3), plan.global_batch, dims)
    ids, features = [m.index for m in metas], sample_features(metas, dims)
    as_modelled = BalanceProblem.build(ids, features, pipeline_shapes(plan), model, coefficients, 2, 0)
    work = dict(zip(ids, as_modelled.cost[:, :-1].sum(axis=1)))  # each sample's modelled seconds, every stage

    def work_per_pipeline(layout):
        problem = BalanceProblem.build(ids, features, pipeline_shapes(layout), model, coefficients, 2, 0)
        result = balance(problem, "ours", threshold=0.0)
        return [sum(work[i] for mb in p for i in mb) for p in result.assignment.pipelines], result

    (even_a, even_b), _ = work_per_pipeline(plan)
    assert abs(even_a - even_b) < 0.02 * (even_a + even_b)
    # The last stage (the bottleneck of this model) of pipeline 1 on a node at half speed.
    slow_stage = dataclasses.replace(plan.pipelines[1].stages[3], slowdown=2.0)
    slowed = dataclasses.replace(
        plan,
        pipelines=(
            plan.pipelines[0],
            dataclasses.replace(plan.pipelines[1], stages=(*plan.pipelines[1].stages[:3], slow_stage)),
        ),
    )
    assert pipeline_shapes(slowed)[1].slowdowns == (1.0, 1.0, 1.0, 2.0) and pipeline_shapes(plan)[1].slowdowns == ()
    (fast, slow), result = work_per_pipeline(slowed)
    assert slow < 0.8 * fast, (even_a, even_b, fast, slow)
    assert result.assignment.pipelines and result.imbalance < 1.1


def test_a_recomputing_stage_is_priced_with_its_second_forward(mllm):
    """``StageLayout.recompute`` (the planner's per-stage activation checkpointing): that stage's samples cost
    ``1 + forward share`` times as much (its forward runs again in the backward), and the forward's share of
    the stage falls accordingly; nothing else changes."""
    import dataclasses

    from oobleck_mm.balance.problem import recompute_factor

    model, coefficients, dims = mllm
    plan = ExecutionPlan.even(model.num_layers, [4, 4], [12, 12], 2)
    metas = skewed_metas(np.random.default_rng(3), plan.global_batch, dims)
    ids, features = [m.index for m in metas], sample_features(metas, dims)
    kept = dataclasses.replace(plan.pipelines[1].stages[0], recompute=True)
    recomputing = dataclasses.replace(
        plan,
        pipelines=(
            plan.pipelines[0],
            dataclasses.replace(plan.pipelines[1], stages=(kept, *plan.pipelines[1].stages[1:])),
        ),
    )
    assert pipeline_shapes(recomputing)[1].recompute == (True, False, False, False)
    assert pipeline_shapes(recomputing)[0].recompute == ()
    plain = BalanceProblem.build(ids, features, pipeline_shapes(plan), model, coefficients, 2, 0)
    again = BalanceProblem.build(ids, features, pipeline_shapes(recomputing), model, coefficients, 2, 0)
    share = model.forward_share(kept.layer_start, kept.layer_end)
    assert 0 < share < 1
    first = again.stage_index[1, 0]
    assert first != again.stage_index[0, 0]  # a distinct stage: same layers, recomputing
    plain_first = plain.stage_index[1, 0]
    np.testing.assert_allclose(again.cost[:, first], plain.cost[:, plain_first] * recompute_factor(share), rtol=1e-6)
    assert again.forward_share[first] == pytest.approx(share / (1 + share))
    with pytest.raises(ValueError, match="recompute has 2 entries for 4 stages"):
        PipelineShape(4, pipeline_shapes(plan)[0].stages, recompute=(True, False))
