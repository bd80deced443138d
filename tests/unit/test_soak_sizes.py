"""``scripts/soak_churn.py``'s size control: the churned run's steps priced at the failure-free step time of
the node count each trained at (on one machine's shared cores, more simulated nodes make steps slower)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def soak():
    spec = importlib.util.spec_from_file_location("soak_churn", ROOT / "scripts" / "soak_churn.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_each_size_is_priced_at_its_own_step_time_else_the_nearest_measured(soak):
    step_s = {6: 0.10, 8: 0.12}
    # 7 is as near to 6 as to 8: the smaller (cheaper) one, so the control never flatters the churned run.
    assert soak.same_size_seconds({6: 100, 8: 50, 7: 10, 9: 2}, step_s) == pytest.approx(
        100 * 0.10 + 50 * 0.12 + 10 * 0.10 + 2 * 0.12
    )


def test_steps_are_counted_by_the_live_nodes_each_reported(soak, tmp_path):
    path = tmp_path / "events.jsonl"
    lines = [{"ts": float(i), "event": "step", "step": i, "live_nodes": 6 if i < 3 else 8} for i in range(5)]
    lines.insert(2, {"ts": 1.5, "event": "lost", "node": "node1"})
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert soak.steps_by_size(path) == {6: 3, 8: 2}


def test_the_default_churn_puts_60_events_inside_a_churned_runs_90_seconds(soak):
    from oobleck_mm.faults.churn import churn_timeline, parse_churn

    events = churn_timeline(parse_churn(soak.DEFAULT_CHURN), [f"node{i}" for i in range(6)])
    assert len([e for e in events if e.seconds <= 90]) >= 60
