"""The master's planning helper outlives a scheduler's stop signal.

SLURM's ``scancel --signal=TERM`` (a preemption's notice) signals every process of the job step, the
master's spawned planning helper too. The master stops gracefully and still plans (the nodes leaving on
the notice), and a helper killed by the signal made that plan fail with ``BrokenProcessPool``: "master
control loop failed (a bug)", exit 1 instead of a checkpoint and exit 3 (seen once in
``tests/e2e/test_slurm.py``'s preemption test). A real helper process, a real signal.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from oobleck_mm.master.planning import PlannerPool

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_the_planning_helper_survives_a_stop_signal_and_still_plans(signum):
    pool = PlannerPool()
    try:
        pool._submitted[0].result(timeout=120)  # started, its imports paid
        [helper] = list(pool._pool._processes.values())
        os.kill(helper.pid, signum)
        time.sleep(0.5)
        assert helper.is_alive(), f"the helper died of signal {signum}"
        assert pool._submit(abs, -3).result(timeout=60) == 3
    finally:
        pool.close()
