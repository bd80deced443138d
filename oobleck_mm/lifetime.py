"""Tying a helper process's life to its parent's: no orphans, even when the parent is SIGKILLed.

Used by the processes the control plane starts: an agent's workers and the
master's planning helper. A parent that dies uncleanly cannot kill its
children, so each child arranges its own end when it starts.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> None:
    """Call first thing in a child started by ``parent_pid``; the child is killed when the parent dies.

    Linux: the kernel SIGKILLs us when the *thread* that started us exits, so
    parents start such children from a thread that lives as long as they do
    (their main thread). Elsewhere a daemon thread polls for reparenting.
    """
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True, name="parent-watch").start()


def _watch_parent(parent_pid: int) -> None:
    # Backstop where PR_SET_PDEATHSIG does not exist (macOS): an orphan's getppid() changes.
    while os.getppid() == parent_pid:
        time.sleep(0.5)
    os._exit(1)
