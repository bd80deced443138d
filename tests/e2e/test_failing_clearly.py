"""A mistake in the user's input stops the job once, within a bound, naming the culprit: never a hang or a cascade.

Real launcher, real workers: the failing worker reports a ``UserError`` (the same
on every replica, so not a node failure) and the master ends the job with exit 2
and the worker's message, instead of recovering from it node by node.
"""

from __future__ import annotations

import os

import pytest
from e2e_harness import Launch, write_config

pytestmark = [pytest.mark.integration, pytest.mark.slow]

BOUND_S = 90.0
"""Start-up (planning, workers importing torch) plus the failure; the old behaviour never ended."""


@pytest.fixture
def launches():
    started: list[Launch] = []
    yield started
    for run in started:  # a failed test must not leave its cluster running
        run.kill_all()


def test_a_resume_from_a_truncated_shard_exits_2_naming_the_file(launches, tmp_path):
    config = write_config(tmp_path, nodes=2, steps=3)
    final = tmp_path / "final"
    first = Launch(tmp_path, config, "--save-final", str(final), name="first")
    launches.append(first)
    assert first.wait() == 0, first.stderr[-3000:]
    shard = final / "layers" / "llm.block0.pt"
    os.truncate(shard, shard.stat().st_size // 2)

    resumed = Launch(tmp_path, config, "--steps", "6", "--resume", str(final), name="resumed")
    launches.append(resumed)
    code = resumed.wait(timeout=BOUND_S)
    assert code == 2, f"exit {code}\n{resumed.stderr[-3000:]}"
    error = [line for line in resumed.stderr.splitlines() if line.startswith("oobleck-launch: error:")]
    assert len(error) == 1 and str(shard) in error[0] and "unreadable checkpoint shard" in error[0], resumed.stderr
    failed = resumed.events("worker_failed")
    assert failed and all(e["user_error"] for e in failed)
    assert not resumed.events("plan_decided", generation=2), "a user error is not a node failure to recover from"
    [shutdown] = resumed.events("shutdown")
    assert shutdown["exit_code"] == 2
    resumed.assert_all_gone()
