"""Hold points: named moments where a worker can be made to pause, so a fault lands exactly there.

Some failures matter only at one moment (a peer dying inside a checkpoint's
barrier, or between a generation's rendezvous and its state copy), and a test
that waits for that moment by timing alone passes or fails by luck. With
``OOBLECK_HOLD_AT=checkpoint@node1:2`` in its environment the worker of node1
sleeps 2 s in a checkpoint, its layer files written, so its peers wait for it in
the checkpoint's barrier, and the fault injector's kill of node1, fired by the
step that precedes the checkpoint, lands while they wait. Entries are
``point[@node]:seconds``, comma-separated; without ``@node`` every worker holds.
Points:

- ``checkpoint``: in a checkpoint, after this rank's layer files, before the barrier (a live run's
  periodic checkpoint: in its background writer, before it reports its share to the master);
- ``rendezvous``: before joining a re-formed generation (generation > 1), so its peers wait for it
  at the arrival;
- ``connect``: every worker of a re-formed generation arrived, before this one publishes its address
  and connects to its peers (gloo's full mesh, through the master's store): its peers wait for it
  inside the group's construction;
- ``copy``: a new generation joined, before its layer states are copied;
- ``forming``: in the background thread that forms a join's (or a leave's) groups ahead
  (``runtime.group.PreparedGroup``), before its arrival: the old generation trains on meanwhile;
- ``reduce``: before the step's last collective (the gradient norm, the loss, the switch flag),
  once per worker process (its first step): its peers wait for it inside that collective, and a
  peer interrupted there meanwhile abandons a collective that the others then complete;
- ``stepN``: before this worker's step N, once per worker process (a rerun of step N in a later
  generation does not hold again): a worker silent past ``collective_timeout`` while its agent
  heartbeats, so every peer's collective times out with no node lost.

One entry is a pace, not a pause: ``pace:SECONDS`` starts this worker's steps at least SECONDS apart
(it sleeps what its step left of them). A test whose job must still be training when something slow
happens (a joiner's start-up, a heartbeat timeout, a held journal) then needs steps for that wall time
at the pace on any host, not for the fastest host's steps: the tiny model trained 120 steps at ~0.05 s
each for a 6 s wait, and the suite, CPU-bound on 2 cores, paid every one of them. Below the pace a
step costs no CPU; a host slower than the pace trains as it would without it.

A worker that holds says so first (``set_announcer``: the agent's worker reports it to the master,
which logs ``holding``): ``--inject kill:NODE@phase:copy`` fires on that report, so the kill lands
while the worker is inside the phase.

Unset (every real run), a hold point costs one dictionary lookup.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

ENV = "OOBLECK_HOLD_AT"
POINTS = ("checkpoint", "copy", "rendezvous", "connect", "forming", "reduce", "pace", "stepN")
_held_once: set[str] = set()
"""Points this process already held at (``stepN`` and ``reduce`` hold once)."""
_announce: Callable[[str, float], None] | None = None
_last_step_start: float | None = None
"""When this process's last step began (monotonic), for the ``pace``."""


def set_announcer(announce: Callable[[str, float], None] | None) -> None:
    """``announce(point, seconds)`` is called before each hold (the worker reports it to the master)."""
    global _announce
    _announce = announce


def hold(point: str, node: str) -> None:
    """Sleep here if ``OOBLECK_HOLD_AT`` names ``point`` for every node or for ``node``."""
    assert point in POINTS or _is_step(point), point
    seconds = _seconds(point, node)
    if seconds:
        log.warning("holding %.1f s at %s (%s)", seconds, point, ENV)
        if _announce is not None:
            _announce(point, seconds)
        time.sleep(seconds)


def hold_step(step: int, node: str) -> None:
    """The ``stepN`` point: before step ``step``, the first time this process reaches it; then the ``pace``."""
    hold_once(f"step{step}", node)
    global _last_step_start
    pace = _seconds("pace", node)
    now = time.monotonic()
    if pace and _last_step_start is not None and now < _last_step_start + pace:
        time.sleep(_last_step_start + pace - now)
        now = time.monotonic()
    _last_step_start = now


def hold_once(point: str, node: str) -> None:
    """``hold``, the first time this process reaches ``point`` only."""
    if point not in _held_once:
        _held_once.add(point)
        hold(point, node)


def _seconds(point: str, node: str) -> float | None:
    """What ``OOBLECK_HOLD_AT`` says of ``point`` for ``node`` (its own entry, else the one for every node)."""
    table = holds()
    return table.get((point, node), table.get((point, None)))


def _is_step(point: str) -> bool:
    return point.startswith("step") and point[4:].isdigit()


def holds(value: str | None = None) -> dict[tuple[str, str | None], float]:
    """``OOBLECK_HOLD_AT`` parsed: (point, node or None) -> seconds; ``ValueError`` naming a bad entry."""
    value = os.environ.get(ENV, "") if value is None else value
    out: dict[tuple[str, str | None], float] = {}
    for entry in filter(None, (e.strip() for e in value.split(","))):
        where, _, seconds = entry.rpartition(":")
        point, _, node = where.partition("@")
        try:
            out[(point, node or None)] = float(seconds)
        except ValueError:
            raise ValueError(f"{ENV}: expected point[@node]:seconds, got {entry!r}") from None
        if not (point in POINTS[:-1] or _is_step(point)) or out[(point, node or None)] < 0:
            raise ValueError(f"{ENV}: {entry!r}: the point must be one of {', '.join(POINTS)} (N a step), seconds >= 0")
    return out
