"""The master's control-loop watch (``oobleck_mm/master/stalls.py``): when a pass counts as stalled, and what it writes."""

from __future__ import annotations

import threading
import time

from hypothesis import given
from hypothesis import strategies as st

from oobleck_mm.master.stalls import PAUSED_FRACTION, StallRule, StallWatch


def test_a_pass_under_the_threshold_is_no_stall_and_a_longer_one_is_dumped_once():
    rule = StallRule(3.0, last_pass=0.0)
    assert not rule.check(2.9, woke_late_s=0.0)
    assert rule.check(3.1, woke_late_s=0.0)
    assert not rule.check(6.5, woke_late_s=0.0), "one dump per stall"
    rule.passed(7.0)
    assert not rule.check(9.0, woke_late_s=0.0)
    assert rule.check(10.5, woke_late_s=0.0), "the next stall is dumped again"


def test_a_paused_process_is_not_a_stall_of_the_control_loop():
    """SIGSTOP for 30 s: the watch wakes 30 s late and the loop's last pass is 30 s old; nothing is dumped, and
    a real stall after the SIGCONT still is."""
    rule = StallRule(3.0, last_pass=0.0)
    assert not rule.check(30.0, woke_late_s=29.5)
    assert not rule.check(30.75, woke_late_s=0.0)
    assert rule.check(33.5, woke_late_s=0.0)


@given(st.lists(st.tuples(st.booleans(), st.floats(0.0, 10.0), st.floats(0.0, 5.0)), max_size=60))
def test_at_most_one_dump_between_two_passes_and_never_before_the_threshold(events):
    """Any order of passes, watch wake-ups and pauses: a dump only past the threshold since the last pass (or
    the last pause), and at most one between two passes."""
    rule, now, since = StallRule(3.0, last_pass=0.0), 0.0, 0.0
    dumps_since_pass = 0
    for is_pass, gap, late in events:
        now += gap
        if is_pass:
            rule.passed(now)
            since, dumps_since_pass = now, 0
            continue
        paused = late >= PAUSED_FRACTION * 3.0
        if rule.check(now, late):
            dumps_since_pass += 1
            assert now - since >= 3.0 and not paused
        if paused:
            since = now
        assert dumps_since_pass <= 1


def test_the_watch_writes_every_threads_stack_to_its_file_and_says_one_line(tmp_path):
    """A real thread: the control loop (here, this test) stops passing for longer than the threshold."""
    lines: list[str] = []
    path = tmp_path / "master-stalls.log"
    blocker = threading.Event()
    other = threading.Thread(target=blocker.wait, name="held-by-a-lock", daemon=True)
    other.start()
    watch = StallWatch(str(path), 1.0, lines.append).start()
    try:
        deadline = time.monotonic() + 10
        while not lines and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        watch.stop()
        blocker.set()
    assert len(lines) == 1 and str(path) in lines[0] and "has not come back for" in lines[0], lines
    text = path.read_text()
    assert "thread held-by-a-lock" in text and ", in wait" in text  # where the other thread waits
    assert "test_the_watch_writes_every_threads_stack_to_its_file" in text  # the stalled thread's own frame
    assert (path.stat().st_mode & 0o777) == 0o600
