"""Fixtures of the end-to-end tests."""

from __future__ import annotations

import pytest
from e2e_harness import Launch


@pytest.fixture
def launches():
    started: list[Launch] = []
    yield started
    for run in started:  # a failed test must not leave its cluster running
        run.kill_all()
