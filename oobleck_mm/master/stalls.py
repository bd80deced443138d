"""The master's control-loop watch: a pass that does not come back writes every thread's stack to a file.

Why not ``faulthandler.dump_traceback_later`` (what this replaced): its watchdog
thread walks the other threads' frames without the GIL while they run. After
the master was SIGSTOPped past the timer (a test of the agents' patience, with
3 test processes on 2 cores), the dump printed on SIGCONT and the master died
of SIGSEGV (exit -11), the run lost. And it printed 57-75 lines of stacks on
the console of runs that then finished normally (issue 54 item 3), which read
as a crash. Here a Python thread takes the stacks with the GIL held
(``sys._current_frames``: safe), writes them to ``RUN_DIR/master-stalls.log``,
and the console gets one line saying where. What it gives up: a stall that
holds the GIL (a long C call under the lock) is dumped only once the GIL is
free, showing where the control thread went next, not where it sat.

Two things are not stalls and dump nothing: a pass shorter than the threshold
(two cores shared with the workers make 1-3 s passes now and then, logged as
``master_stalled`` by the machine), and a pause of the whole process (SIGSTOP,
a suspended VM): the watch itself then woke late by as much, and the control
loop did nothing wrong.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Callable

log = logging.getLogger(__name__)

STALL_DUMP_MIN_S = 1.0
"""The shortest threshold: below it ordinary passes on a shared host would be dumped."""
WATCH_EVERY_FRACTION = 0.25
"""The watch looks this often, as a fraction of the threshold."""
PAUSED_FRACTION = 0.5
"""The watch woke later than planned by at least this fraction of the threshold: the whole process was
paused (or the host starved it), so a long pass meanwhile is not the control loop's stall."""


@dataclass(slots=True)
class StallRule:
    """When a control-loop pass has stalled: pure, so every order of passes and wake-ups is tested."""

    threshold_s: float
    last_pass: float = 0.0
    dumped: bool = False
    """This stall's stacks were written: once per stall."""

    def passed(self, now: float) -> None:
        self.last_pass, self.dumped = now, False

    def check(self, now: float, woke_late_s: float) -> bool:
        """True when the stacks should be written now. ``woke_late_s``: how much later than planned the watch
        itself woke (a paused process); such a gap restarts the count instead."""
        if woke_late_s >= PAUSED_FRACTION * self.threshold_s:
            self.last_pass = now  # the whole process stood still: not a stall of the control loop
            return False
        if self.dumped or now - self.last_pass < self.threshold_s:
            return False
        self.dumped = True
        return True


class StallWatch:
    """A daemon thread: ``passed()`` from the control loop each pass; past ``threshold_s`` without one, every
    thread's stack goes to ``path`` (appended) and ``say`` gets one line."""

    def __init__(self, path: str, threshold_s: float, say: Callable[[str], None] | None = None) -> None:
        self.path = path
        self.rule = StallRule(max(STALL_DUMP_MIN_S, threshold_s), time.monotonic())
        self.say = say or log.warning
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="stall-watch", daemon=True)

    def start(self) -> StallWatch:
        self._thread.start()
        return self

    def passed(self) -> None:
        with self._lock:
            self.rule.passed(time.monotonic())

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=1.0)

    def _run(self) -> None:
        every = WATCH_EVERY_FRACTION * self.rule.threshold_s
        planned = time.monotonic() + every
        while not self._stop.wait(max(0.0, planned - time.monotonic())):
            now = time.monotonic()
            with self._lock:
                due = self.rule.check(now, now - planned)
                stalled = now - self.rule.last_pass
            planned = now + every
            if due:
                self._dump(stalled)

    def _dump(self, stalled_s: float) -> None:
        names = {t.ident: t.name for t in threading.enumerate()}
        lines = [
            f"--- {time.strftime('%Y-%m-%d %H:%M:%S')}: the control loop's pass has not come back for "
            f"{stalled_s:.1f} s; every thread's stack:\n"
        ]
        for ident, frame in sys._current_frames().items():
            lines.append(f"\nthread {names.get(ident, '?')} ({ident}):\n")
            lines.extend(traceback.format_stack(frame))
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            with os.fdopen(fd, "a", encoding="utf-8") as fh:
                fh.write("".join(lines) + "\n")
            where = self.path
        except OSError as exc:
            where = f"not written ({exc})"
        self.say(f"the master's control loop has not come back for {stalled_s:.1f} s (every thread's stack: {where})")
