"""Tying a helper process's life to its parent's: no orphans, even when the parent is SIGKILLed; and ending a
process whose work is done without tearing torch down (``end_now``).

Used by the processes the control plane starts: an agent's workers and the
master's planning helper. A parent that dies uncleanly cannot kill its
children, so each child arranges its own end when it starts.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from typing import NoReturn

import psutil

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


def die_with(pid: int) -> None:
    """Call first thing in a process that must end with ``pid``, a process that is not its parent
    (a worker forked by a template that ``oobleck-launch local``'s simulated nodes share ends with
    its agent). Exits at once if ``pid`` is gone already.

    Linux: a pidfd becomes readable when the process exits, whoever its parent is; a thread
    waits on it. Elsewhere the thread polls.
    """
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):  # no pidfd here, or ``pid`` is gone (ESRCH)
        fd = None
        if not _exists(pid):
            os._exit(1)
    threading.Thread(target=_watch_pid, args=(pid, fd), daemon=True, name="agent-watch").start()


def _watch_pid(pid: int, fd: int | None) -> None:
    import select

    if fd is not None:
        select.select([fd], [], [])
    else:
        while _exists(pid):
            time.sleep(0.5)
    os._exit(1)


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def stop_tree(proc: subprocess.Popen, grace_s: float = 2.0) -> None:
    """SIGTERM (the agent then kills its workers), SIGKILL after ``grace_s``, then any survivor below it.

    A stopped (SIGSTOP) agent cannot act on SIGTERM: it and its tree get SIGKILL at once.
    """
    try:
        root = psutil.Process(proc.pid)
        tree = root.children(recursive=True)
        stopped = root.status() == psutil.STATUS_STOPPED
    except psutil.NoSuchProcess:
        tree, stopped = [], False
    if stopped:
        proc.kill()
    else:
        proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    for p in tree:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


def end_now(code: int = 0) -> NoReturn:
    """Ends this process at once with ``code``, what it printed and logged flushed first: no atexit handler
    and no module teardown run.

    For a process whose work is done and that holds nothing to release: a worker template
    (``runtime/template_exit.py``), a finished ``verify`` or ``export``. Python's ordinary exit of a process
    that loaded torch (torch's atexit handlers, then every module torn down) took 1.2-1.3 s of CPU on a 2-core
    machine after its last line, with its output pipes held open that long (whoever read them to their end,
    a shell's prompt or a test, waited)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):  # closed or replaced: nothing left to say
            pass
    logging.shutdown()
    os._exit(code)
