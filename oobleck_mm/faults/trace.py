"""Spot-instance availability traces (``data/traces/``) turned into a timeline of injections.

Pure: a trace file and a time scale in, ``FaultEvent`` values with ``seconds``
out. Trace format (its README): no header, one event per line,
``delta_ms,add|remove,nodeName``, several events may share a timestamp; and
``delta_ms,slow,nodeName,F[,T]``, a node running F times slower for T seconds
of trace time (for good without T), which the public traces do not have.

Replay rules:

- The trace's nodes present at its start (every ``add`` at or before
  ``start_s``; by default the first timestamp) are the cluster the launcher
  starts with, whatever their number: the local cluster has its own
  ``--nodes``. Time 0 of the replay is that start.
- Each later ``remove`` kills one live local node, each later ``add`` starts one
  new agent: the trace's changes are replayed one for one, not its node count.
- Which node a removal kills is deterministic: the highest-numbered live one
  (the newest; trace node names do not exist locally). Joins are named
  ``node<K>`` with K one past the highest number used so far. A removal with
  no live node left is dropped (the job will have ended below its threshold).
- A ``slow`` line slows the highest-numbered live node, like a removal (a
  ``slow`` fault, ``faults/slowdown.py``); its T is scaled like trace time.
- ``time_scale`` multiplies trace time: 0.01 replays ten minutes in six seconds.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Iterable, Sequence

from oobleck_mm.errors import UserError
from oobleck_mm.faults.spec import FaultEvent, node_number

ACTIONS = ("add", "remove", "slow")


@dataclass(frozen=True, slots=True)
class TraceEvent:
    ms: int
    """Milliseconds since the start of the trace."""
    action: str
    """``add`` | ``remove``."""
    node: str
    """The trace's node name (not a local node)."""
    line: int
    """1-based line number, for messages."""
    factor: float = 0.0
    """``slow`` only: how many times slower."""
    duration_s: float | None = None
    """``slow`` only: seconds of trace time it lasts (None: for good)."""


def read_trace(path: str | os.PathLike) -> list[TraceEvent]:
    """The events of a trace file, in time order (ties keep file order); ValueError names a bad line."""
    with open(path, encoding="utf-8") as fh:
        return parse_trace(fh.read().splitlines(), name=os.fspath(path))


def parse_trace(lines: Iterable[str], name: str = "trace") -> list[TraceEvent]:
    events = []
    for number, raw in enumerate(lines, start=1):
        line = raw.strip()
        if not line:
            continue
        events.append(_parse_line(line, number, name))
    if not events:
        raise UserError(f"{name}: no events (expected lines of delta_ms,add|remove,nodeName)")
    return sorted(events, key=lambda e: e.ms)  # stable: simultaneous events keep file order


def _parse_line(line: str, number: int, name: str) -> TraceEvent:
    parts = [p.strip() for p in line.split(",")]
    where = f"{name}:{number}: {line!r}"
    if len(parts) >= 2 and parts[1] == "slow":
        return _parse_slow(parts, number, where)
    if len(parts) != 3:
        raise UserError(f"{where}: expected delta_ms,add|remove,nodeName (or delta_ms,slow,nodeName,F[,T])")
    ms, action, node = parts
    if not ms.isdigit():
        raise UserError(f"{where}: delta_ms must be a non-negative integer of milliseconds, got {ms!r}")
    if action not in ACTIONS:
        raise UserError(f"{where}: action must be add or remove, got {action!r}")
    if not node:
        raise UserError(f"{where}: empty node name")
    return TraceEvent(int(ms), action, node, number)


def _parse_slow(parts: list[str], number: int, where: str) -> TraceEvent:
    if len(parts) not in (4, 5):
        raise UserError(f"{where}: expected delta_ms,slow,nodeName,F[,T] (F > 1 times slower, for T seconds)")
    ms, _, node, factor, *duration = parts
    if not ms.isdigit():
        raise UserError(f"{where}: delta_ms must be a non-negative integer of milliseconds, got {ms!r}")
    try:
        f = float(factor)
        t = float(duration[0]) if duration else None
    except ValueError:
        raise UserError(
            f"{where}: F and T must be numbers, got {factor!r}" + (f", {duration[0]!r}" if duration else "")
        ) from None
    if not f > 1 or (t is not None and not t >= 0) or not node:
        raise UserError(f"{where}: need a node, F > 1 and T >= 0 (got {node!r}, {f:g}, {t})")
    return TraceEvent(int(ms), "slow", node, number, f, t)


def trace_timeline(
    events: Sequence[TraceEvent],
    nodes: Sequence[str],
    time_scale: float = 1.0,
    start_s: float | None = None,
    end_s: float | None = None,
    name: str = "trace",
) -> list[FaultEvent]:
    """Kills and joins for a local cluster that starts as ``nodes``, in firing order.

    ``start_s``/``end_s`` (trace seconds) cut a window; events at or before
    ``start_s`` form the starting population and are not replayed.
    """
    if not time_scale > 0:
        raise UserError(f"--time-scale: must be > 0, got {time_scale}")
    if not events:
        return []
    start_ms = events[0].ms if start_s is None else round(start_s * 1000)
    end_ms = None if end_s is None else round(end_s * 1000)
    if end_ms is not None and end_ms <= start_ms:
        raise UserError(f"trace window: end ({end_s} s) must come after start ({start_ms / 1000} s)")
    live = list(nodes)
    next_index = 1 + max((node_number(n) for n in nodes), default=-1)
    out: list[FaultEvent] = []
    for event in events:
        if event.ms <= start_ms or (end_ms is not None and event.ms > end_ms):
            continue
        seconds = (event.ms - start_ms) / 1000 * time_scale
        source = f"{name}:{event.line} {event.action} {event.node}"
        if event.action == "slow":
            if live:
                duration = event.duration_s * time_scale if event.duration_s is not None else None
                out.append(
                    FaultEvent(
                        kind="slow",
                        node=max(live, key=_order_key),
                        seconds=seconds,
                        factor=event.factor,
                        duration_s=duration,
                        source=source,
                    )
                )
        elif event.action == "remove":
            if not live:
                continue
            victim = max(live, key=_order_key)
            live.remove(victim)
            out.append(FaultEvent(kind="kill", node=victim, seconds=seconds, source=source))
        else:
            joined = f"node{next_index}"
            next_index += 1
            live.append(joined)
            out.append(FaultEvent(kind="join", node=joined, seconds=seconds, source=source))
    return out


def load_timeline(
    path: str | os.PathLike,
    nodes: Sequence[str],
    time_scale: float = 1.0,
    start_s: float | None = None,
    end_s: float | None = None,
) -> list[FaultEvent]:
    """``read_trace`` + ``trace_timeline``: what ``--trace FILE --time-scale X`` replays."""
    name = os.path.basename(os.fspath(path))
    return trace_timeline(read_trace(path), nodes, time_scale, start_s, end_s, name=name)


def starting_nodes(events: Sequence[TraceEvent], start_s: float | None = None) -> list[str]:
    """The trace's nodes present at its start (every add at or before ``start_s``, default its first
    timestamp, less the removes): the population the replay maps onto the local ``--nodes``."""
    if not events:
        return []
    start_ms = events[0].ms if start_s is None else round(start_s * 1000)
    live: list[str] = []
    for event in events:
        if event.ms > start_ms:
            break
        if event.action == "add" and event.node not in live:
            live.append(event.node)
        elif event.action == "remove" and event.node in live:
            live.remove(event.node)
    return live


def _order_key(node: str) -> tuple[int, str]:
    # node10 after node9: by the trailing number, then by name for names without one.
    return node_number(node), node
