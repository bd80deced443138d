"""``scripts/bench_modality.py frozen`` (Cornstarch Table 3.2 with our planner) runs and reports what it claims."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import bench_modality  # noqa: E402

pytestmark = pytest.mark.integration


def test_the_frozen_aware_plans_are_never_slower_under_the_true_costs(tmp_path, capsys):
    out = tmp_path / "frozen.json"
    assert bench_modality.main(["frozen", "--models", "sss,mmm", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["frozen"]
    assert set(rows) == {"sss", "mmm"}
    for name, row in rows.items():
        # Each plan is the planner's best under its own costs. The aware one is chosen under the true costs; an
        # unaware plan beating it under them would mean the planner's search missed a better plan.
        assert row["improvement"] >= 1.0 and row["one_pipeline"]["improvement"] >= 1.0, (name, row)
        assert row["paper"]["improvement"] == bench_modality.PAPER_TABLE_3_2[name][2]
    assert "MLLM-MMM frozen-aware vs unaware" in capsys.readouterr().out


def test_an_unknown_model_is_named_with_what_is_valid(capsys):
    with pytest.raises(SystemExit) as stop:
        bench_modality.main(["frozen", "--models", "sss,xl"])
    assert stop.value.code == 2
    assert "['xl'] unknown; valid: sss, mmm, lll" in capsys.readouterr().err


def test_the_lookahead_what_if_is_the_planners_time_without_a_prefix_and_never_slower_with_one(tmp_path):
    """``lookahead``'s lock-step period is the planner's exact 1F1B time of the same template (its streams,
    barrier and waits are the what-if's whole machinery: off by anything, the ratios it prints mean
    nothing); with the frozen prefix running ahead no iteration is slower, and SSS's encoders below their
    projectors are such a prefix."""
    from oobleck_mm.planning.branches import place

    job, cluster, profile, microbatches = bench_modality.placement_model("sss")
    chosen = place(profile, cluster, job.cluster.nodes, microbatches)
    for template in (chosen.chain, chosen.branched.to_template()):
        prefix = bench_modality.frozen_prefix(template, profile)
        assert any(prefix) and not all(prefix)
        lock = bench_modality.steady_period(template, [False] * len(prefix), microbatches)
        assert lock == pytest.approx(template.iteration_time(microbatches), rel=1e-9)
        assert bench_modality.steady_period(template, prefix, microbatches) < lock


def test_the_planners_plan_with_placement_auto_is_never_slower_than_the_chained_one(tmp_path, capsys):
    """``plans``: the planner's whole plan with branches allowed (``planning.placement: auto``) against the same
    with the chain only. Auto picks per template by the exact time, so its plan can only tie or win."""
    out = tmp_path / "plans.json"
    assert bench_modality.main(["plans", "--models", "sss", "--json", str(out)]) == 0
    row = json.loads(out.read_text())["plans"]["sss"]
    assert row["auto_vs_chain"] >= 1.0 - 1e-12, row
    for placement in ("chain", "auto"):
        assert row[placement]["iteration_s"] > 0 and row[placement]["pipelines"], row
        assert row[placement]["lookahead_s"] <= row[placement]["iteration_s"] * (1 + 1e-9), row
    assert row["chain"]["branched_pipelines"] == 0
    assert "MLLM-SSS on 6 x 4 GPUs, the planner's plan: chain" in capsys.readouterr().out
