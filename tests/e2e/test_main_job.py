"""``make run``'s job, exactly as the Makefile runs it: pipelines of different depths, a kill and a join."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys

import pytest
from e2e_harness import ROOT

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_make_run_shows_heterogeneous_pipelines_surviving_a_kill_and_taking_a_join(tmp_path):
    [args] = re.findall(r"^RUN_ARGS := (.+)$", (ROOT / "Makefile").read_text(), re.M)
    command = [sys.executable, "-m", "oobleck_mm.cli", *shlex.split(args), "--run-dir", str(tmp_path / "run")]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=240)
    out = proc.stdout
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "generation 1: 2 pipelines (stages 3,2;" in out, out[:2000]  # heterogeneous depths
    assert re.search(r"^1\s+kill\s+node4\s+20\s.*resumed at step", out, re.M), out[-2000:]
    assert re.search(r"^2\s+join\s+node5\s.*resumed at step", out, re.M), out[-2000:]
    assert "throughput plot:" in out and re.search(r"done: 60 steps in", out)
