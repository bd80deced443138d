"""Waiting on communication without trusting the backend's timeout.

Every collective of the engine is issued asynchronously and waited on here:
the wait polls the request with a short back-off, and gives up with
``PeerFailure`` when the deadline passes or when ``interrupt()`` says the master
has already re-planned (a peer is lost). Gloo errors fast when a peer's process
dies, but a hung peer (SIGSTOP, a wedged host) keeps its sockets open; the
interrupt turns the master's heartbeat verdict into an immediate, clean abort.

A wait that polls for longer than ``stall_after`` calls ``on_stall``, and again
every ``stall_after`` after: the worker tells the master, which then needs only
half the heartbeat timeout of silence to call a peer hung (``oobleck_mm/master/detector.py``).

Point-to-point requests cannot be polled on gloo (their ``is_completed`` only
turns true inside ``wait``, and a ``wait`` that times out closes the
connection), so they are waited on whole, bounded by the process group's own
timeout, which the worker sets to heartbeat timeout + 5 s (every group it
creates gets the same). A receive from a peer that gave up the step ends at once
all the same: that peer sends an abandon header (``p2p.send_abandoned``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta


class PeerFailure(RuntimeError):
    """A peer did not take part in time (or the job was re-planned): the iteration is over."""


@dataclass(slots=True)
class Waiter:
    timeout: timedelta | None = None
    """Longest wait for one request; None waits as long as the backend does."""
    interrupt: Callable[[], bool] | None = None
    """Polled while waiting; True abandons the wait."""
    on_stall: Callable[[str, float], None] | None = None
    """Called with what is awaited and for how long, every ``stall_after`` seconds of one wait."""
    stall_after: float = float("inf")
    """Seconds of polling before ``on_stall``."""

    def wait(self, work, what: str, pollable: bool = True) -> None:
        if not pollable or (self.timeout is None and self.interrupt is None):
            try:
                work.wait()
            except RuntimeError as error:
                raise PeerFailure(f"{what}: {str(error).splitlines()[0]}") from error
            return
        start = time.monotonic()
        deadline = start + self.timeout.total_seconds() if self.timeout is not None else float("inf")
        pause = 20e-6
        next_stall = start + self.stall_after
        while not work.is_completed():
            now = time.monotonic()
            if self.on_stall is not None and now > next_stall:
                next_stall = now + self.stall_after  # again every stall_after: the peer may hang mid-wait
                self.on_stall(what, now - start)
            if now > deadline:
                raise PeerFailure(f"{what}: no answer after {now - start:.1f} s (timeout {self.timeout})")
            if self.interrupt is not None and self.interrupt():
                raise PeerFailure(f"{what}: abandoned, the master re-planned")
            time.sleep(pause)
            pause = min(pause * 2, 2e-3)
        try:
            work.wait()  # raises the backend's error, if any
        except RuntimeError as error:
            raise PeerFailure(f"{what}: {str(error).splitlines()[0]}") from error
