"""The structured event log: one JSON object per line, ``{"ts": unix seconds, "event": name, ...fields}``.

Failure timelines (registered, lost, plan decided, assignment sent, rendezvous
done, resumed, ...) are written here so recovery time can be broken down after
the fact (``read_events`` + differences of ``ts``). Several threads of one
process may write; each line is written and flushed whole under a lock.
Processes other than the master (workers) open their own file.

The log records the job; it is not the job's state. A write that fails (a full
disk, a vanished mount) is reported once on the process's log, with the path
and the system's words, and the job goes on; the next writes keep trying, and
the first that succeeds says how many events were dropped.

Subscribers (``subscribe``) see every record as it is written: the master's
``metrics.csv`` and TensorBoard files are views of this log made that way.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Any, Callable

log = logging.getLogger(__name__)


class EventLog:
    """Appends events to ``path`` (created with its folder); ``path=None`` discards them."""

    def __init__(self, path: str | os.PathLike | None) -> None:
        self.path = None if path is None else os.fspath(path)
        self._lock = threading.Lock()
        self._fh = None
        self.dropped = 0
        """Events lost to failed writes since the last one that succeeded."""
        self._subscribers: list[Callable[[dict[str, Any]], None]] = []
        if self.path is not None:
            folder = os.path.dirname(os.path.abspath(self.path))
            os.makedirs(folder, exist_ok=True)
            # Line-buffered so a crash (or SIGKILL) loses at most the line being written.
            self._fh = open(self.path, "a", encoding="utf-8", buffering=1)

    def write(self, event: str, **fields: Any) -> dict[str, Any]:
        """Writes one event and returns it; ``fields`` must be JSON-able (``ts``/``event`` are reserved)."""
        if "ts" in fields or "event" in fields:
            raise ValueError(f"event {event!r}: fields 'ts' and 'event' are reserved, got {sorted(fields)}")
        record = {"ts": time.time(), "event": event, **fields}
        line = json.dumps(record, separators=(",", ":"), default=_jsonable)
        with self._lock:
            if self._fh is not None:
                self._append(line)
        for subscriber in self._subscribers:
            subscriber(record)
        return record

    def subscribe(self, subscriber: Callable[[dict[str, Any]], None]) -> None:
        """Calls ``subscriber(record)`` after each write, in the writing thread (it must not raise)."""
        self._subscribers.append(subscriber)

    def _append(self, line: str) -> None:
        try:
            if self.dropped:
                self._fh.write(json.dumps({"ts": time.time(), "event": "events_dropped", "count": self.dropped}) + "\n")
            self._fh.write(line + "\n")
            self._fh.flush()
        except OSError as exc:
            if not self.dropped:
                log.error("event log %s: cannot write (%s); events are dropped until it can", self.path, exc.strerror)
            self.dropped += 1
            return
        if self.dropped:
            log.warning("event log %s: writing again; %d events were dropped", self.path, self.dropped)
            self.dropped = 0

    def close(self) -> None:
        with self._lock:
            if self._fh is not None:
                try:
                    self._fh.close()
                except OSError:  # the last buffered bytes could not be written: already reported
                    pass
                self._fh = None

    def __enter__(self) -> EventLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _jsonable(value: Any) -> Any:
    # Tuples, sets and dataclass-like values show up in fields; anything else is a bug worth seeing as text.
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    if hasattr(value, "to_dict"):
        return value.to_dict()
    return repr(value)


def read_events(path: str | os.PathLike, event: str | None = None) -> list[dict[str, Any]]:
    """The events in ``path`` (optionally only those named ``event``), skipping a torn last line."""
    out = []
    try:
        with open(path, encoding="utf-8") as fh:
            lines = fh.readlines()
    except FileNotFoundError:
        return []
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a writer killed mid-line
        if event is None or record.get("event") == event:
            out.append(record)
    return out
