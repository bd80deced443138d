"""The agent's ends of its workers' pipes, read on one thread, which is also the only one that closes them.

Why one owner: the main thread replaces workers (restart-mode recovery, a bench,
the end of the job) while the reports thread waits on their pipes and reads them.
When the main thread closed a pipe itself, a close that landed between the
reader's ``wait`` and its ``recv_bytes`` failed the read with a ``TypeError``
(the handle already ``None``, not an ``OSError``), which ended the reports
thread: no later report of the node reached the master, and the job waited for
it until ``stall_timeout`` (issue 55, seen in ``scripts/bench_recovery.py``'s
restart half). Now the main thread only *retires* a worker it killed; the reader
drops it from the pipes it waits on and closes its pipe between two waits, where
nothing else touches it. No interleaving of retirements and reads can fail a
read, and if the reader fails anyway, ``run`` hands the error to the agent,
which stops the node as a fault (the master hears it), never goes silent.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from multiprocessing.connection import wait as wait_connections

from oobleck_mm.agent.workers import Worker

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.05
"""How long the reader sleeps when it watches no open pipe (before the first worker starts)."""
READ_WAIT_S = 0.1
"""Longest wait on the pipes before the reader looks again for retired pipes and new workers."""


class ReportPipes:
    """The pipes of the workers an agent runs; ``run`` reads them on the thread that calls it."""

    def __init__(self, on_report: Callable[[Worker, bytes], None], on_eof: Callable[[Worker], None]) -> None:
        self._on_report, self._on_eof = on_report, on_eof
        self._lock = threading.Lock()
        self._watched: list[Worker] = []
        self._retired: list[Worker] = []
        self._reader: threading.Thread | None = None

    def watch(self, worker: Worker) -> None:
        """Reads ``worker``'s reports from now on (any thread)."""
        with self._lock:
            self._watched.append(worker)

    def retire(self, workers: list[Worker]) -> None:
        """Stops reading ``workers`` (killed or being replaced; any thread): the reader closes their pipes at
        its next turn. What they wrote and was not read yet is dropped: they are no longer the node's."""
        with self._lock:
            for worker in workers:
                if worker in self._watched:
                    self._watched.remove(worker)
                    self._retired.append(worker)

    def run(self, stopping: threading.Event, on_failure: Callable[[BaseException], None]) -> None:
        """The reader's loop until ``stopping``; an error of its own goes to ``on_failure`` (it must not die
        silently: the node's reports would stop)."""
        self._reader = threading.current_thread()
        try:
            while not stopping.is_set():
                if not self.read_once(READ_WAIT_S):
                    stopping.wait(IDLE_WAIT_S)
        except BaseException as error:  # noqa: BLE001 - every failure of the reader is the node's fault
            log.exception("the reports thread failed")
            on_failure(error)

    def read_once(self, timeout: float) -> bool:
        """One wait on the open pipes and a read of every ready one; False when none was open."""
        with self._lock:
            retired, self._retired = self._retired, []
            readable = [w for w in self._watched if not w.eof]
        for worker in retired:  # only this thread reads them, so no read is under way
            worker.conn.close()
        if not readable:
            return False
        ready = wait_connections([w.conn for w in readable], timeout=timeout)
        by_conn = {id(w.conn): w for w in readable}
        for conn in ready:
            worker = by_conn[id(conn)]
            with self._lock:
                if worker not in self._watched:
                    continue  # retired meanwhile: closed at the next turn, unread
            try:
                data = conn.recv_bytes()
            except (EOFError, OSError):  # the worker's end closed: it exited or died
                worker.eof = True
                self._on_eof(worker)
                continue
            self._on_report(worker, data)
        return True

    def close_all(self) -> None:
        """Closes every pipe once the reader stopped (the agent's exit). A reader still running keeps them:
        the process's exit closes them without racing its read."""
        if self._reader is not None and self._reader.is_alive():
            return
        with self._lock:
            workers, self._watched, self._retired = self._watched + self._retired, [], []
        for worker in workers:
            worker.conn.close()
