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


def _barrier(port: int, generation: int, world: int, interrupt=None, poll=None):
    """One worker's arrival on the master's store (a real gRPC store server, a real client)."""
    import torch.distributed as dist

    from oobleck_mm.runtime.store import ControlPlaneStore

    client = ControlPlaneStore("127.0.0.1", port, "tok", timedelta(seconds=20), interrupt)
    prefixed = dist.PrefixStore(f"gen{generation}", client)
    began = time.monotonic()
    result = group._await_arrivals(
        prefixed, generation, world, timedelta(seconds=20), poll, group._arrival_reader(client, generation)
    )
    return {"result": result, "calls": client.calls, "returned_at": time.monotonic(), "began": began}


def test_on_the_masters_store_the_waiting_workers_hold_one_read_each_and_go_the_moment_the_last_arrives():
    """Before, each waiting worker read the counter up to 100 times a second (3,038 of a churn soak's
    10,500 store calls); now the last to arrive sets a key the others wait for in held reads."""
    from concurrent.futures import ThreadPoolExecutor

    from oobleck_mm.master.store import serve_store_only

    server, port = serve_store_only("tok")
    try:
        with ThreadPoolExecutor(4) as pool:
            early = [pool.submit(_barrier, port, 3, 4) for _ in range(3)]
            time.sleep(0.6)
            last = _barrier(port, 3, 4)
            waited = [f.result(timeout=10) for f in early]
    finally:
        server.stop(0)
    assert last["calls"] == 2  # its add, then the key the others wait for
    for w in waited:
        assert w["result"] is None
        # 0.6 s of waiting: the add, then held reads of 0.25 s (3 or 4); polling took ~60 reads.
        assert w["calls"] <= 6, f"{w['calls']} store calls for a 0.6 s wait"
        assert w["returned_at"] - last["returned_at"] < 0.1, "a waiting worker went late after the last arrived"


def test_a_newer_command_ends_a_held_read_at_once_and_is_returned():
    import threading

    from oobleck_mm.master.store import serve_store_only

    server, port = serve_store_only("tok")
    replanned = threading.Event()
    try:
        timer = threading.Timer(0.3, replanned.set)
        timer.start()
        out = _barrier(port, 5, 2, interrupt=replanned.is_set, poll=lambda: "newer" if replanned.is_set() else None)
    finally:
        server.stop(0)
    assert out["result"] == "newer"
    # The command came 0.3 s in, inside the second 0.25 s hold: looked at every 10 ms, not at the hold's end.
    assert out["returned_at"] - out["began"] < 0.3 + 0.1
    assert out["calls"] <= 3
