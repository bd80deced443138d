"""``oobleck-launch verify`` on float32 runs: the tolerance it derives passes a recovered and resumed
run, catches a run that is one update off, and ``--from`` checks a window of the run."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
from harness import ROOT, Launch

pytestmark = [pytest.mark.integration, pytest.mark.slow]
TINY = str(ROOT / "configs" / "tiny_mm.yaml")  # float32


@pytest.fixture
def verify(capsys):
    """``oobleck-launch verify --config TINY ARGS`` run by the CLI's own ``main`` in this process (its
    reversed-order reference: a fork of the warm template), with what it printed and its exit code."""
    from oobleck_mm.cli import main

    def run(*args: str) -> SimpleNamespace:
        capsys.readouterr()
        code = main(["verify", "--config", TINY, *args])
        out = capsys.readouterr()
        return SimpleNamespace(returncode=code, stdout=out.out, stderr=out.err)

    return run


def test_float32_tolerance_passes_a_recovered_run_and_fails_one_update_off(tmp_path, launches, verify):
    first, final = tmp_path / "at8", tmp_path / "at12"
    run = Launch(tmp_path, TINY, "--steps", "8", "--inject", "kill:node3@step4", "--save-final", str(first), name="a")
    launches.append(run)
    assert run.wait(timeout=180) == 0, run.stderr[-3000:]
    assert run.events("lost"), "the kill was recovered from"
    run = Launch(tmp_path, TINY, "--steps", "12", "--resume", str(first), "--save-final", str(final), name="b")
    launches.append(run)
    assert run.wait(timeout=180) == 0, run.stderr[-3000:]

    whole = verify("--steps", "12", "--against", str(final))
    assert whole.returncode == 0, whole.stdout + whole.stderr
    lines = whole.stdout.splitlines()
    assert lines[0].split() == ["layer", "max", "|diff|", "max", "|ref|", "relative", "noise"]
    assert len(lines) == 1 + 10 + 1  # a row per layer, then the verdict
    verdict = re.search(r"within tolerance (\S+) \(float32: 10 x the reference's own drift", lines[-1])
    assert verdict, lines[-1]
    tolerance = float(verdict.group(1))
    assert 1e-7 < tolerance < 1e-4  # measured for this run, not 1e-9 (every float32 run fails that)
    assert "note: the tolerance is wider than one update" not in whole.stdout  # lr 1e-3: one step would show

    window = verify("--steps", "12", "--against", str(final), "--from", str(first))
    assert window.returncode == 0, window.stdout + window.stderr
    assert "reference step 9/12" in window.stderr and "reference step 1/12" not in window.stderr

    # One update too few or too many is far outside the drift of correct arithmetic.
    for steps in ("11", "13"):
        off = verify("--steps", steps, "--against", str(final))
        assert off.returncode == 1 and "OUTSIDE tolerance" in off.stdout, off.stdout + off.stderr
    backwards = verify("--steps", "6", "--against", str(final), "--from", str(first))
    assert backwards.returncode == 2 and "--from: " in backwards.stderr and "after --steps 6" in backwards.stderr
