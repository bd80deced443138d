"""The master's writes to the run dir, carried out in order by one thread, outside the coordinator's lock.

The coordinator applies every event under one lock, and carried out each effect there too. Three of
them write files of the run dir: the journal (before every generation's assignments), a periodic
checkpoint's ``meta.json`` and the pruning of old checkpoints. On a local disk they take milliseconds;
on the shared storage a run dir lives on in a cluster (NFS, a ReadWriteMany volume) a close waits for the
server, and pruning removes whole checkpoints (gigabytes a layer on a real model). Under the lock, that
time was time every gRPC handler waited: measured on this machine, the journal's fsync under the
periodic checkpoints' writes held the lock 1.9-2.1 s, and the reports, the stream ends and the
planner's answers queued behind it (``docs/benchmarks.md``, issue 27).

So those writes go to ``DiskQueue``, and the effects that must come after them (an assignment never
reaches a worker before the journal that names its generation; ``checkpoint_saved`` is logged once its
``meta.json`` is written) follow them through the same queue while it holds anything. A log line that
waited there carries the time it was written, when the outputs before it went out, not the time of the
decision (``tests/e2e/test_recovery.py``'s held journal: a re-plan decided at once, logged 3 s later). Decisions and
their bookkeeping (the planner's calls, the progress counters) stay under the lock: the queue only
carries out what the machine already decided.

Why not ``concurrent.futures.ThreadPoolExecutor(max_workers=1)``: the coordinator must know, under its
lock, whether anything is still queued (``busy``) to route a send behind it or deliver it at once, and
an executor does not say that without tracking every future.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)

HOLD_ENV = "OOBLECK_MASTER_HOLD_AT"
"""Tests: ``journalG:S`` (comma-separated) makes the disk thread hold ``S`` seconds before writing generation
``G``'s journal. Its assignments queue behind that write, while the master answers every report meanwhile:
the window between planning a generation and sending it, in which the workers may still switch to the
generation planned before (``tests/e2e/test_recovery.py``). The workers' hold points are
``runtime/hold.py``'s."""


def journal_hold(generation: int, value: str | None = None) -> float:
    """Seconds ``OOBLECK_MASTER_HOLD_AT`` holds ``generation``'s journal write (0: none); ``ValueError`` naming a
    bad entry."""
    value = os.environ.get(HOLD_ENV, "") if value is None else value
    for entry in filter(None, (e.strip() for e in value.split(","))):
        point, _, seconds = entry.partition(":")
        if not (point.startswith("journal") and point[7:].isdigit()):
            raise ValueError(f"{HOLD_ENV}: expected journalG:seconds (G a generation), got {entry!r}")
        if int(point[7:]) == generation:
            return float(seconds)
    return 0.0


class DiskQueue:
    """Callables carried out one at a time, in the order submitted, by one thread (``threaded``), or at once
    (not ``threaded``: a coordinator driven by hand, as in unit tests, sees its files written by the call)."""

    def __init__(self, threaded: bool = True) -> None:
        self.threaded = threaded
        self._queue: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._pending = 0
        self._thread: threading.Thread | None = None

    def submit(self, work: Callable[[], None]) -> None:
        if not self.threaded:
            work()
            return
        with self._lock:
            self._pending += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="master-disk", daemon=True)
                self._thread.start()
        self._queue.put(work)

    @property
    def busy(self) -> bool:
        """Something submitted is not done yet: what must follow it is submitted too."""
        return self._pending > 0

    def flush(self, timeout: float) -> bool:
        """Waits until everything submitted is done; False if ``timeout`` passed first."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout)

    def _run(self) -> None:
        while (work := self._queue.get()) is not None:
            try:
                work()
            except Exception:  # a bug in one write must not stop the ones behind it (the sends among them)
                log.exception("the master's disk thread: a write failed")
            finally:
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()
