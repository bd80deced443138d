"""Deadline-paced waits that take no CPU, and the record that says whether the host kept them.

An emulated GPU op runs its real (shrunk) CPU math, then sleeps until
``start + duration``: the real work counts against the duration instead of
adding to it (``docs/emulation.md``, "Sleep accuracy"). A sleep is never
shorter than asked and may be longer, most of all when many processes share few
cores; every op's *lateness* (when it really ended minus its deadline) is kept,
and a run whose ops are late by more than ``LATE_FRACTION`` of their duration
more than 1% of the time is invalid (``Lateness.valid``): its figures measure
the host, not the engine.

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
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

LATE_FRACTION = 0.05
"""An op is late when it ends more than this fraction of its duration after its deadline."""
LATE_SHARE = 0.01
"""A run is invalid when more than this share of its judged ops are late (p99 lateness over the bound)."""
GUARDED_S = 0.01
"""Ops shorter than this are not judged (host scheduling noise is of that order under load)."""


@dataclass(slots=True)
class Lateness:
    """Counts of one worker's emulated ops since the last ``take`` (a step's, as ``StepMetrics`` carries)."""

    ops: int = 0
    """Judged ops (at least ``GUARDED_S`` long)."""
    late_ops: int = 0
    """Judged ops that ended more than ``LATE_FRACTION`` of their duration after their deadline."""
    worst: float = 0.0
    """The largest lateness of a judged op, as a fraction of its duration."""
    emulated_s: float = 0.0
    """Seconds of emulated work and transfer (every op, judged or not)."""
    late_s: float = 0.0
    """Seconds past deadlines, summed over every op."""
    short_ops: int = 0
    """Ops below ``GUARDED_S``: not judged."""

    def record(self, duration: float, late: float) -> None:
        self.emulated_s += duration
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

    @property
    def valid(self) -> bool:
        """At most ``LATE_SHARE`` of the judged ops late: p99 lateness within ``LATE_FRACTION`` of the op."""
        return self.late_ops <= LATE_SHARE * self.ops


@dataclass(slots=True)
class DeadlineClock:
    """Sleeps to deadlines and records how late each op ended."""

    lateness: Lateness = field(default_factory=Lateness)
    sleep = staticmethod(time.sleep)
    now = staticmethod(time.monotonic)

    def finish(self, start: float, duration: float, what: str = "op") -> float:
        """An op that began at ``start`` (``now()`` seconds) and takes ``duration`` on the emulated device:
        sleeps until its deadline (at once if the real work already passed it); returns the deadline."""
        deadline = start + duration
        self.until(deadline, duration, what)
        return deadline

    def until(self, deadline: float, duration: float, what: str = "op") -> None:
        """Sleeps until ``deadline``, and records the op of ``duration`` seconds that ends there."""
        remaining = deadline - self.now()
        if remaining > 0:
            self.sleep(remaining)
        late = self.now() - deadline
        self.lateness.record(duration, late)
        if duration >= GUARDED_S and late > LATE_FRACTION * duration:
            # Why the host missed it: the real work overran (nothing left to sleep) or the wake-up came late.
            log.debug("late %s: %.1f ms past a %.1f ms op (%s)", what, 1e3 * late, 1e3 * duration,
                      "work overran" if remaining <= 0 else "woke late")

    def take(self) -> Lateness:
        """The counts since the last call, and a fresh record."""
        taken, self.lateness = self.lateness, Lateness()
        return taken
