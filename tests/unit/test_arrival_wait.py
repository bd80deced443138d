"""The arrival barrier's reads (``runtime.group._await_arrivals``): quick at first, sparse once a wait is long.

A joiner whose join generation a loss dropped waits in that generation's barrier until the next join
reaches it (seconds under churn), and at 100 reads a second of the master's store it took CPU from
everyone. No process group: a counter that never completes stands in for the store."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest

from oobleck_mm.runtime import group
from oobleck_mm.runtime.waiting import PeerFailure


class _Counter:
    """``add`` as c10d's stores do; the barrier never completes (one worker never arrives)."""

    def __init__(self) -> None:
        self.reads = 0

    def add(self, key: str, amount: int) -> int:
        self.reads += amount == 0
        return 1


def test_a_long_wait_for_arrivals_reads_the_counter_ever_less_often(monkeypatch):
    monkeypatch.setattr(group, "ARRIVAL_PATIENT_S", 0.2)
    store, polls = _Counter(), []
    began = time.monotonic()
    with pytest.raises(PeerFailure, match="not all 2 workers arrived"):
        group._await_arrivals(store, 7, 2, timedelta(seconds=1.2), lambda: polls.append(1))
    assert time.monotonic() - began >= 1.2
    # 0.2 s at pauses of at most 10 ms (~25 reads), then 1 s at pauses growing to 0.1 s (~12): ~120 reads
    # before, at 10 ms throughout.
    assert store.reads < 60, f"{store.reads} reads of the arrival counter in 1.2 s"
    assert len(polls) == store.reads  # a newer command is still looked for between two reads


def test_a_newer_command_ends_the_wait_at_once():
    store = _Counter()
    assert group._await_arrivals(store, 7, 2, timedelta(seconds=30), lambda: "newer") == "newer"
    assert store.reads == 1
