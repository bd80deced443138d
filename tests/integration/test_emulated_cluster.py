"""An emulated cluster on real processes: its math is the compute copy's, its time the emulated GPU's.

The calibration guards of ``docs/emulation.md`` in short form (``scripts/bench_emulated.py calibrate``
runs them at 1-16 pipelines): a known delay of 10% costs 10% of the step, and two pipelines of two
stages step within 5% of the exact 1F1B time of the same true durations. The host's CPU share is
reported, not asserted: the suite runs next to other tests; what is asserted is that the hosts made
their devices wait for under 1% of the ranks' time, which bounds what the load can add to a step.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import yaml

from oobleck_mm.config import config_from_dict
from oobleck_mm.planning.layout import ExecutionPlan
from oobleck_mm.runtime.worker import run_local
from test_runtime_equivalence import STEPS, max_param_diff, reference

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_emulated", ROOT / "scripts" / "bench_emulated.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_emulated"] = module  # run_local's forks find it by name
    spec.loader.exec_module(module)
    return module


def test_an_emulated_run_trains_its_compute_copy_exactly_as_the_reference_does(tmp_path):
    with open("configs/tiny_mm.yaml") as f:
        raw = yaml.safe_load(f)
    raw["training"].update(dtype="float64", steps=STEPS)
    raw["cluster"].update(emulate="a100-80gb", emulate_shrink=2)
    job = config_from_dict(raw)
    trainer, losses = reference(job)  # the reference trains the compute copy too (config.emulation)
    assert trainer.job.model.llm.hidden == 32
    plan = ExecutionPlan.even(10, [2, 1], [4, 4], job.training.microbatch_size)
    outs = run_local(job, plan, STEPS, tmp_path)
    assert max_param_diff(outs, trainer) < 1e-10
    assert outs[0]["losses"] == pytest.approx(losses, abs=1e-12)
    assert all(r.lateness is not None and r.lateness.emulated_s > 0 for o in outs for r in o["results"])
    assert all(0 < r.host_cpu_s < 60 for o in outs for r in o["results"])  # what the step cost its host


def test_a_known_delay_and_the_pipeline_schedule_are_measured_as_they_are(bench, tmp_path):
    """(a) every duration of the odd steps x1.1: they take 10% longer than the even steps of the same run
    against their exact times (interleaved: two runs side by side read x1.1156 once, the host 79% busy
    during the second); (b) one and two pipelines step at the exact 1F1B time of the same durations.

    The issue's bounds (1.5 points, 5%) hold for a run the instrument calls valid. Next to the suite's other
    tests the host is often busier than a measurement allows (``validity.judge``: over 60% of the cores; 99%
    with three test processes on two cores read x1.108 and x1.123): such a run says INVALID and the bench
    prints no figure from it: what it must do then is say so (and still read the delay as one)."""
    delayed = bench.write_profile(tmp_path, 1.0, odd_steps_scale=1.1)
    one = bench.run(bench.calibration_job(1, delayed, 8), 8, tmp_path / "one")
    two = bench.run(bench.calibration_job(2, bench.write_profile(tmp_path, 1.0), 5), 5, tmp_path / "two")
    print(one, two, sep="\n")
    for run in (one, two):  # every verdict says what the workers asked of the host
        assert "CPU-s a step" in run["verdict"] and "for them alone" in run["verdict"], run
    # The known delay is a ratio within one run: a busy host slows its even and odd steps alike (98% busy,
    # its devices kept waiting 4% of the time, read 1.082). A host that made the devices wait past their
    # deadlines (6.5% of the ops late on a slow host beside the suite read 1.043) blurs even that: the run
    # must then call itself INVALID and say why, and the delay still reads as a delay. Its size is then no
    # measurement, in either direction: beside four busy loops (the host 100% busy, 1.9-2.8% of the ops
    # late) four runs read 1.081, 1.097, 1.114 and 1.135.
    known = one["odd_ratio"] / one["even_ratio"]
    if one["valid"]:
        assert known == pytest.approx(1.10, abs=0.015), one
    else:
        assert one["verdict"].startswith("INVALID: "), one
        assert "late" in one["verdict"] or "busy" in one["verdict"], one  # its reason named
        assert known > 1.0, one
    for run in (one, two):
        if run["lag_share"] < 0.01:
            # The hosts made their devices wait for under 1% of the ranks' time (next to other tests an op
            # may lag now and then: the verdict's 1% of a few dozen ops is one op): that bounds what the
            # load added to a step, and the step is the exact 1F1B time of its durations.
            ratio = run["even_ratio"] if run is one else run["ratio"]
            assert ratio == pytest.approx(1.0, abs=0.05 * (1 if run["valid"] else 2)), run
        else:
            # A host that could not keep its deadlines (a slow host with the suite's other tests beside:
            # 98% busy, 4% of the ranks' time waited, the undelayed steps read x1.14) must say so: a figure
            # from it is never printed as a measurement.
            assert not run["valid"] and "late" in run["verdict"], run
