"""Fixtures of every test that starts processes; ``tests/harness.py`` is their one harness.

(This file's folder is on ``sys.path`` for the whole suite, so ``from harness import ...`` works in
tests/e2e and tests/integration alike.)"""

from __future__ import annotations

import pytest


@pytest.fixture
def launches():
    """``harness.Launch`` runs a test started: a failed test must not leave its cluster running."""
    started = []
    yield started
    for run in started:
        run.kill_all()


@pytest.fixture
def procs(tmp_path):
    """Single agents and masters a test starts (``harness.Procs``): killed at teardown, and none may survive."""
    from harness import Procs

    started = Procs(tmp_path)
    yield started
    started.cleanup()
