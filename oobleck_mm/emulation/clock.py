"""Deadline-paced waits that take no CPU, and the record that says whether the host kept them.

An emulated GPU is a stream (``DeviceClock``, ``docs/emulation.md``, "Overlap"):
the host runs its real (shrunk) CPU math and queues each op's emulated duration
on the device's timeline, and sleeps only where a GPU's host waits for its
device: before a collective and at the end of a step, until the device's
deadline. So the host's own work overlaps the device's time, as on a GPU, and
counts only where the host falls behind: an op the device could have started
but the host had not issued yet has a *lag*. A sleep is never shorter than asked
and may be longer, most of all when many processes share few cores: its
*lateness* is kept too. A run whose ops lag or wake late by more than
``LATE_FRACTION`` of their duration more than 1% of the time is invalid
(``Lateness.valid``): its figures measure the host, not the engine.

Only ops of at least ``GUARDED_S`` are judged: shorter ones (a 1 ms activation
transfer) are below the host's scheduling noise by design, and are counted
apart so a report can say how much of the emulated time they are.

Deadlines are ``time.monotonic()`` seconds: one clock for every process of the
machine (Linux ``CLOCK_MONOTONIC``), so a sender can tell its receiver when the
bytes arrive.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

LATE_FRACTION = 0.05
"""An op is late when it ends more than this fraction of its duration after its deadline."""
LATE_SHARE = 0.01
"""A run is invalid when more than this share of its judged ops are late (p99 lateness over the bound)."""
GUARDED_S = 0.01
"""Ops shorter than this are not judged (host scheduling noise is of that order under load)."""
INTERRUPT_POLL_S = 0.05
"""How often a sync's sleep looks whether it is to be abandoned (``DeviceClock.sync``)."""


class Interrupted(Exception):
    """A sync's wait was abandoned: the master re-planned."""


@dataclass(slots=True)
class Lateness:
    """Counts of one worker's emulated ops since the last ``take`` (a step's, as ``StepMetrics`` carries)."""

    ops: int = 0
    """Judged ops (at least ``GUARDED_S`` long): compute ops and the device time a sync waited out."""
    late_ops: int = 0
    """Judged ops the device started (a sync woke) more than ``LATE_FRACTION`` of their duration late."""
    worst: float = 0.0
    """The largest lateness of a judged op, as a fraction of its duration."""
    emulated_s: float = 0.0
    """Seconds of emulated device time recorded (every op, judged or not)."""
    late_s: float = 0.0
    """Seconds of lag and late wake-ups, summed over every op."""
    short_ops: int = 0
    """Ops below ``GUARDED_S``: not judged."""
    setup_s: float = 0.0
    """Seconds the device idled at a step's start for the host's set-up of the step (its assignment, packing
    its first microbatch): the step's own time, not judged, but not device time either; a report says how
    much of a step it was."""

    def record(self, duration: float, late: float, device_time: bool = True) -> None:
        """An op of ``duration`` that was ``late`` (``device_time``: its duration is device time of its own,
        not a sync's wait over ops already recorded)."""
        self.emulated_s += duration if device_time else 0.0
        self.late_s += max(0.0, late)
        if duration < GUARDED_S:
            self.short_ops += 1
            return
        self.ops += 1
        ratio = max(0.0, late) / duration
        self.worst = max(self.worst, ratio)
        if ratio > LATE_FRACTION:
            self.late_ops += 1

    def merge(self, other: Lateness) -> None:
        self.ops += other.ops
        self.late_ops += other.late_ops
        self.worst = max(self.worst, other.worst)
        self.emulated_s += other.emulated_s
        self.late_s += other.late_s
        self.short_ops += other.short_ops
        self.setup_s += other.setup_s

    @property
    def valid(self) -> bool:
        """At most ``LATE_SHARE`` of the judged ops late: p99 lateness within ``LATE_FRACTION`` of the op."""
        return self.late_ops <= LATE_SHARE * self.ops


class DeviceClock:
    """One emulated GPU as a stream: ops queue on it, the host runs ahead and waits only where a real GPU's
    host would (``sync``: before a collective, at the end of a step).

    ``free_at`` is when the device finishes what was queued. A compute op issued by the host at ``issued``
    starts at ``max(free_at, issued)``: in order after the previous op and after any message it waits for
    (``arrive``); its *lag* is how long the device idled for the host (the host's real CPU work behind the
    emulated device: what a measurement must not have). A ``sync`` sleeps until ``free_at``; how late it woke
    is its lateness, judged against the device time since the previous sync.
    """

    sleep = staticmethod(time.sleep)
    now = staticmethod(time.monotonic)

    def __init__(self) -> None:
        self.lateness = Lateness()
        self.free_at = 0.0
        self._synced_at = 0.0
        self._idle = False
        """The device has nothing queued since a step began: the host's set-up of the step (its assignment,
        packing its first microbatch) before the first op is the step's own time, not the host falling behind
        a busy device, and is not judged (it is in the step's time all the same)."""

    def run(self, issued: float, duration: float, what: str = "op", judged: bool = True) -> tuple[float, float]:
        """Queues an op of ``duration`` the host issued at ``issued``; returns its (start, end) on the device.
        ``judged=False``: an op issued after a real collective, whose wait for the slowest peer is not lag."""
        lag = issued - self.free_at if judged and not self._idle else 0.0
        if self._idle:
            self.lateness.setup_s += max(0.0, issued - self.free_at)
        self._idle = False
        start = max(self.free_at, issued)
        self.free_at = start + duration
        self.lateness.record(duration, lag)
        if duration >= GUARDED_S and lag > LATE_FRACTION * duration:
            log.debug(
                "late %s: the device idled %.1f ms for the host before a %.1f ms op", what, 1e3 * lag, 1e3 * duration
            )
        return start, self.free_at

    def begin_step(self, interrupt: Callable[[], bool] | None = None) -> None:
        """A step begins: the host waits for the device, which then idles until the step's first op."""
        self.sync("step start", interrupt)
        self._idle = True

    def arrive(self, arrival: float) -> None:
        """A message the next op needs arrives at ``arrival``: the in-order stream waits for it."""
        self.free_at = max(self.free_at, arrival)

    def sync(self, what: str = "sync", interrupt: Callable[[], bool] | None = None) -> float:
        """The host waits for the device to finish (sleeps until ``free_at``); returns the host's time after.
        ``interrupt``: polled every ``INTERRUPT_POLL_S`` of the wait; True ends it with ``Interrupted`` (the
        master re-planned: a GPU's host would abandon its wait too, and a survivor must not sleep through a
        recovery)."""
        deadline = self.free_at
        covered = deadline - self._synced_at if self._synced_at else 0.0
        slept = False
        while (remaining := deadline - self.now()) > 0:
            if interrupt is not None and interrupt():
                raise Interrupted(f"{what}: abandoned, the master re-planned")
            self.sleep(remaining if interrupt is None else min(remaining, INTERRUPT_POLL_S))
            slept = True
        now = self.now()
        if covered > 0 and (slept or now > deadline):
            # A wake-up, how late; or a host that reached the sync only after its device had finished (its own
            # work, a real collective's, outlasted the device time since the last sync): either way the host,
            # not the device, set the time from here, judged against the device time it should have covered.
            self.lateness.record(covered, now - deadline, device_time=False)
            if covered >= GUARDED_S and now - deadline > LATE_FRACTION * covered:
                log.debug(
                    "late %s: the host came %.1f ms after %.1f ms of device time",
                    what,
                    1e3 * (now - deadline),
                    1e3 * covered,
                )
        self.free_at = max(self.free_at, now)
        self._synced_at = self.free_at
        return now

    def take(self) -> Lateness:
        """The counts since the last call, and a fresh record."""
        taken, self.lateness = self.lateness, Lateness()
        return taken
