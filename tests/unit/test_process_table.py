"""``harness.process_table``: the one ``/proc`` pass the launches' watchers read each 0.1 s poll."""

import os
import subprocess
import sys

import psutil

from harness import descendants, process_table


def test_each_process_has_its_parent_and_its_start_time():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        table = process_table()
        ppid, started = table[child.pid]
        assert ppid == os.getpid()
        # The start in clock ticks since boot is psutil's create time (seconds since the epoch) less the boot time.
        ticks = os.sysconf("SC_CLK_TCK")
        assert abs(started / ticks - (psutil.Process(child.pid).create_time() - psutil.boot_time())) < 1.0
        assert table[os.getpid()][1] < started  # a later process has a later start: a reused pid is told apart
        assert child.pid in descendants([os.getpid()], {pid: parent for pid, (parent, _) in table.items()})
    finally:
        child.kill()
        child.wait()
