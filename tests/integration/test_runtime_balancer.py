"""The balancer moves samples between pipelines and microbatches but never changes the update.

Float64, real gloo processes: with the balancer on, heterogeneous pipelines end
equal to the reference trainer (and so to the balancer off); across a lost node
the balancer keeps its fitted cost model and plans for the new pipelines.
"""

from __future__ import annotations

import pytest
import yaml

from oobleck_mm.config import config_from_dict
from oobleck_mm.planning.layout import ExecutionPlan, PipelineLayout, StageLayout
from oobleck_mm.runtime.worker import Phase, run_local
from test_runtime_equivalence import max_param_diff, reference

pytestmark = pytest.mark.integration


def balanced_job(steps=5):
    with open("configs/tiny_mm.yaml") as f:
        d = yaml.safe_load(f)
    d["training"].update(dtype="float64", steps=steps)
    # threshold 0: always rebalance, so the test exercises non-contiguous assignments
    d["balance"] = {"enabled": True, "fit_every": 2, "threshold": 0.0}
    return config_from_dict(d)


def test_balancer_on_equals_reference(tmp_path):
    job = balanced_job()
    trainer, ref_losses = reference(job)  # the reference ignores placement: same as balancer off
    plan = ExecutionPlan.even(10, [2, 1], [4, 4], job.training.microbatch_size)
    outs = run_local(job, plan, 5, tmp_path)
    assert max_param_diff(outs, trainer) < 1e-10
    assert outs[0]["losses"] == pytest.approx(ref_losses, abs=1e-12)
    metrics = outs[0]["balancer"]["metrics"]
    assert metrics["predicted_imbalance"] >= 1.0 and "dist_text" in metrics
    fitted = {str(o["balancer"]["coefficients"]) for o in outs}
    assert len(fitted) == 1, "ranks disagree on the cost model"
    assert outs[0]["balancer"]["coefficients"]["num_observations"] > 0  # refitted online


def test_balancer_continues_across_a_lost_node(tmp_path):
    job = balanced_job()
    trainer, ref_losses = reference(job)
    before = ExecutionPlan.even(10, [2, 2], [4, 4], 2)
    after = ExecutionPlan(
        (PipelineLayout((StageLayout(0, 0, 5), StageLayout(1, 5, 10)), 5), PipelineLayout((StageLayout(2, 0, 10),), 3)),
        10,
        2,
    )
    outs = run_local(job, before, 3, tmp_path, phases=[Phase(after, 2, {0: 0, 1: 1, 2: 2})])
    assert max_param_diff(outs, trainer) < 1e-10
    assert outs[0]["losses"] == pytest.approx(ref_losses, abs=1e-12)
    coefficients = [o["balancer"]["coefficients"] for o in outs]
    assert all(c == coefficients[0] for c in coefficients)
    # fitted at step 2 in the old plan and again at step 4 in the new one: no fresh warm-up
    assert coefficients[0]["num_observations"] > 0
    assert len(outs[0]["results"][-1].pipeline_times) == 2  # measured for the new pipelines


def test_the_balancers_exchange_is_tensors_and_loses_nothing(tmp_path):
    """Timings and coefficients cross processes as float64 tensors (no pickle) and come back exactly."""
    from datetime import timedelta

    import torch.distributed as dist

    from oobleck_mm.balance.cost_model import CostCoefficients, StageTiming
    from oobleck_mm.balance.work import NUM_FEATURES
    from oobleck_mm.config.shape import layer_specs
    from oobleck_mm.data.loader import TrainingData
    from oobleck_mm.runtime.balancing import StepBalancer
    from oobleck_mm.runtime.group import join_generation, leave_group

    job = balanced_job()
    wait = timedelta(seconds=60)
    join_generation(
        dist.FileStore(str(tmp_path / "store"), 1), 0, 0, 1, "gloo", collective_timeout=wait, arrival_timeout=wait
    )
    try:
        balancer = StepBalancer(job, TrainingData(job), layer_specs(job.model, job.data))
        timings = [
            StageTiming(i, i + 3, tuple(0.1 * k + i / 7 for k in range(NUM_FEATURES)), 1 / (i + 3)) for i in range(5)
        ]
        assert balancer._all_gather_timings(timings) == [timings]
        assert balancer._all_gather_timings([]) == [[]]
        coefficients = CostCoefficients(tuple(0.5 + k / 3 for k in range(len(balancer.coefficients.scales))), 41)
        assert balancer._broadcast_coefficients(coefficients, src=0) == coefficients
        balancer.window.extend(timings)
        balancer.coefficients = coefficients
        balancer.share_from(0)
        assert list(balancer.window) == timings and balancer.coefficients == coefficients
    finally:
        leave_group()


def test_checkpoints_carry_the_fitted_cost_model_and_a_resume_goes_on_with_it(tmp_path):
    """Every shard holds the balancer's coefficients and timing window (``checkpoint.SHARED_KEYS``); an
    engine resumed from it starts from them instead of the profile's guess."""
    from oobleck_mm.data.loader import TrainingData
    from oobleck_mm.model.layers import model_layer_specs
    from oobleck_mm.runtime.balancing import StepBalancer
    from oobleck_mm.config.shape import layer_specs
    from oobleck_mm.runtime.checkpoint import read_shared_state

    job = balanced_job()
    plan = ExecutionPlan.even(10, [2, 1], [4, 4], job.training.microbatch_size)
    final = tmp_path / "final"
    outs = run_local(job, plan, 5, tmp_path / "out", save_final=str(final))
    fitted = outs[0]["balancer"]["coefficients"]
    assert fitted["num_observations"] > 0
    states = [read_shared_state(final, spec.name)["balancer"] for spec in model_layer_specs(job)]
    assert all(s is not None and s["coefficients"] == states[0]["coefficients"] for s in states)
    assert states[0]["coefficients"]["scales"] == fitted["scales"] and states[0]["window"]
    fresh = StepBalancer(job, TrainingData(job), layer_specs(job.model, job.data))
    assert fresh.coefficients.to_dict() != states[0]["coefficients"]  # a cold start: the profile's guess
    fresh.load_state_dict(states[0])
    assert fresh.state_dict() == states[0] and len(fresh.window) == len(states[0]["window"])
