"""The Python API's example runs as a user would: records made in Python, a job as a dict, a node killed,
the result verified against the reference (``examples/python_api.py``)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from harness import ROOT

pytest.importorskip("datasets")
pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_the_python_api_example_trains_through_a_kill_and_verifies(tmp_path):
    run = tmp_path / "run"
    command = [sys.executable, "examples/python_api.py", "--run-dir", str(run), "--steps", "12"]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "nodes lost and recovered from: ['node2']" in proc.stdout
    assert "within tolerance" in proc.stdout
    assert (run / "dataset" / "dataset_info.json").exists(), "the records were written once, into the run folder"
    job = (run / "job.yaml").read_text()
    assert "kind: hf_datasets" in job and str(run / "dataset") in job
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    steps = sorted({e["step"] for e in events if e["event"] == "step"})
    assert steps == list(range(12)), steps
