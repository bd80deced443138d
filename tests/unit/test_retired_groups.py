"""``RetiredGroups`` never runs a group's destructor in its own thread, under its lock.

A gloo group's destructor waits for its pending operations (up to the group's timeout). When the
retiring thread held a group's last reference (its loop variable kept the last group it started a
destroyer for), that destructor ran in the retiring thread with its lock held, and every later
``add`` (``leave_group`` at a join's switch) waited for it: a survivor stalled ~9.5 s in 5 of 8
joins of a scaled cornstarch job. Stand-ins for groups with a slow destructor show the same
ownership; a real gloo group's destructor is tested in ``tests/integration/test_group_retirement.py``.
"""

from __future__ import annotations

import threading
import time

from oobleck_mm.runtime.group import RetiredGroups

SLOW_S = 0.6


class SlowGroup:
    """Whose destructor takes ``SLOW_S`` and records the thread it ran in."""

    ran_in: list[str] = []

    def __del__(self) -> None:
        SlowGroup.ran_in.append(threading.current_thread().name)
        time.sleep(SLOW_S)


def test_destructors_run_in_destroyer_threads_and_never_block_a_later_add():
    SlowGroup.ran_in = []
    retired = RetiredGroups()
    try:
        waits = []
        for _ in range(4):  # a generation's groups each time, as switches retire them
            started = time.perf_counter()
            retired.add([SlowGroup(), SlowGroup()])
            waits.append(time.perf_counter() - started)
            time.sleep(0.5)  # the retiring thread wakes, starts destroyers, wakes again on the next add
        deadline = time.monotonic() + 10
        while len(SlowGroup.ran_in) < 8 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        retired.close()
    assert max(waits) < SLOW_S / 2, f"an add waited for a destructor: {waits}"
    assert SlowGroup.ran_in == ["destroy-group"] * 8, SlowGroup.ran_in


class QuickGroup:
    """Whose destructor counts itself (a short one: the race is in starting and joining the destroyers)."""

    destroyed = 0

    def __del__(self) -> None:
        time.sleep(0.02)
        QuickGroup.destroyed += 1


def test_close_at_exit_waits_for_every_destroyer_and_never_joins_one_not_started():
    """``close`` (atexit) racing the retiring thread: it took the destroyers' list while a destroyer was
    registered but not started ("cannot join thread before it is started", at a CI run's exit), and one
    started after it took the list was never joined. Every group is destroyed by the time it returns."""
    for attempt in range(30):
        QuickGroup.destroyed = 0
        retired = RetiredGroups()
        retired.add([QuickGroup() for _ in range(6)])
        time.sleep(0.001 * (attempt % 10))  # close lands at different points of the retiring thread's pass
        retired.close()
        assert QuickGroup.destroyed == 6, f"attempt {attempt}: {QuickGroup.destroyed} of 6 destroyed at close"
