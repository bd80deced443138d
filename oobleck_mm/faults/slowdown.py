"""A slow node for the harness: its worker processes run ``factor`` times slower, by a freeze/thaw duty cycle.

``slow:NODE@WHEN[xF][+Ts]`` (``faults/spec.py``) makes a straggler: a node that
is alive and answers its heartbeats (its agent is not touched) but whose GPU
work takes F times as long, like a throttled or shared GPU.

Why a duty cycle and not a CPU quota: a quota (cgroup ``cpu.max``, or v1's
``cpu.cfs_quota_us``) caps the CPU time a process may take per period, which
slows it only if it would have taken more. On a machine where the simulated
nodes share a few cores (six nodes on this project's two), a node already gets
far less than one core, so a quota of half a core slows it by nothing, and
the slowdown would depend on the load beside it. Freezing the workers for
``1 - 1/F`` of every ``PERIOD_S`` slows their progress by F in wall-clock time
whatever their share: their compute, as their own timers measure it, takes F
times as long, and their peers wait for them as for a slow GPU. The period is
short against a step (0.1 s on the built-in model), so every step sees the
average.

How they are frozen (``freezer_for``): the cgroup freezer, in a cgroup of the
node's own (``cgroup.freeze`` under cgroup v2, ``freezer.state`` under v1).
SIGSTOP would do the same, but the agent rightly reports a stopped worker as
a failed one (``worker_stopped``), while a frozen task looks like one in a
system call. Without a writable freezer (no root, no cgroup file system) the
slowdown falls back to SIGSTOP and says so: on such a machine the node is then
declared lost, which is a failure and not a straggler.

The node's workers are looked up again every ``RESCAN_S`` (a recovery may
start new ones), and every process is thawed and put back in its own cgroup
when the slowdown ends, when the injector stops, and if this thread fails.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import uuid
from typing import Callable, Protocol

import psutil

from oobleck_mm.emulation.speed import write_speed

log = logging.getLogger(__name__)

PERIOD_S = 0.02
"""One freeze-and-run cycle: short against a step, long against a freeze's cost (~0.1 ms)."""
RESCAN_S = 0.5
"""How often the node's worker processes are looked up again (recoveries and restarts start new ones)."""
CGROUP_ROOTS = ("/sys/fs/cgroup", "/sys/fs/cgroup/unified")
"""Where a cgroup v2 hierarchy is mounted (the second: systemd's hybrid layout)."""
CGROUP_V1_FREEZER = "/sys/fs/cgroup/freezer"

WorkerLookup = Callable[[], "list[psutil.Process]"]


class Freezer(Protocol):
    name: str

    def add(self, procs: list[psutil.Process]) -> None: ...
    def freeze(self) -> None: ...
    def thaw(self) -> None: ...
    def close(self) -> None: ...


class CgroupFreezer:
    """A cgroup of the slowed node's processes, frozen and thawed as one (v2 ``cgroup.freeze`` or v1
    ``freezer.state``)."""

    def __init__(self, parent: str, v2: bool) -> None:
        self.v2 = v2
        self.parent = parent
        self.name = f"cgroup {'v2' if v2 else 'v1'} freezer"
        self.path = os.path.join(parent, f"oobleck-slow-{uuid.uuid4().hex[:8]}")
        os.mkdir(self.path)
        self._members: set[int] = set()

    def add(self, procs: list[psutil.Process]) -> None:
        for proc in procs:
            if proc.pid not in self._members and _write(os.path.join(self.path, "cgroup.procs"), str(proc.pid)):
                self._members.add(proc.pid)

    def freeze(self) -> None:
        self._state(True)

    def thaw(self) -> None:
        self._state(False)

    def _state(self, frozen: bool) -> None:
        if self.v2:
            _write(os.path.join(self.path, "cgroup.freeze"), "1" if frozen else "0")
        else:
            _write(os.path.join(self.path, "freezer.state"), "FROZEN" if frozen else "THAWED")

    def close(self) -> None:
        self.thaw()
        for pid in self._members:  # back where every process of the machine is: the hierarchy's root
            _write(os.path.join(self.parent, "cgroup.procs"), str(pid))
        try:
            os.rmdir(self.path)
        except OSError:  # a member still exiting: the empty cgroup is harmless, and named as ours
            log.debug("cannot remove %s", self.path)


class SignalFreezer:
    """SIGSTOP / SIGCONT: the fallback without a writable cgroup freezer (see the module's docstring)."""

    name = "SIGSTOP (no writable cgroup freezer: the agent will report the node's workers as stopped)"

    def __init__(self) -> None:
        self._procs: list[psutil.Process] = []
        self._stopped: list[psutil.Process] = []

    def add(self, procs: list[psutil.Process]) -> None:
        self._procs = list(procs)

    def freeze(self) -> None:
        self._stopped = [p for p in self._procs if _signal(p, signal.SIGSTOP)]

    def thaw(self) -> None:
        stopped, self._stopped = self._stopped, []
        for proc in stopped:
            _signal(proc, signal.SIGCONT)

    def close(self) -> None:
        self.thaw()


def freezer_for() -> Freezer:
    """The best freezer this machine lets us create."""
    for root in CGROUP_ROOTS:
        if os.path.exists(os.path.join(root, "cgroup.procs")) and os.path.exists(
            os.path.join(root, "cgroup.subtree_control")
        ):
            try:
                return CgroupFreezer(root, v2=True)
            except OSError:
                pass
    if os.path.isdir(CGROUP_V1_FREEZER):
        try:
            return CgroupFreezer(CGROUP_V1_FREEZER, v2=False)
        except OSError:
            pass
    return SignalFreezer()


class Slowdown:
    """Runs the processes ``lookup`` returns at ``1/factor`` of their speed until ``end()``."""

    def __init__(
        self,
        node: str,
        factor: float,
        lookup: WorkerLookup,
        *,
        period_s: float = PERIOD_S,
        ends_at: float | None = None,
        freezer: Freezer | None = None,
    ) -> None:
        if not factor > 1:
            raise ValueError(f"slowdown factor must be > 1, got {factor}")
        self.node, self.factor, self.ends_at = node, factor, ends_at
        self.period_s = period_s
        self.freezer = freezer if freezer is not None else freezer_for()
        self._lookup = lookup
        self._halt = threading.Event()
        self._closed = threading.Lock()
        self._done = False
        self.cycles = 0
        self._thread = threading.Thread(target=self._run, name=f"slowdown-{node}", daemon=True)

    def start(self) -> Slowdown:
        if isinstance(self.freezer, SignalFreezer):
            log.warning("slowdown of %s by %s", self.node, self.freezer.name)
        self._thread.start()
        return self

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def end(self, timeout: float = 2.0) -> None:
        """Back to full speed: the thread ends, every process is thawed and leaves the node's cgroup."""
        self._halt.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        self._close()

    def _run(self) -> None:
        freeze_s = self.period_s * (1 - 1 / self.factor)
        looked = 0.0
        try:
            while not self._halt.is_set():
                if time.monotonic() - looked >= RESCAN_S:
                    self.freezer.add(self._safe_lookup())
                    looked = time.monotonic()
                began = time.monotonic()
                self.freezer.freeze()
                self._halt.wait(freeze_s)
                self.freezer.thaw()
                # Run for the freeze this cycle really had, over F - 1: a wake-up late under load then
                # lengthens the run as well, and the node still runs 1/F of the time.
                frozen = time.monotonic() - began
                self.cycles += 1
                self._halt.wait(frozen / (self.factor - 1))
        except Exception:  # never leave a process frozen: a frozen worker would hang its peers
            log.exception("slowdown of %s failed; its workers run at full speed", self.node)
        finally:
            self._close()

    def _close(self) -> None:
        with self._closed:
            if not self._done:
                self._done = True
                self.freezer.close()

    def _safe_lookup(self) -> list[psutil.Process]:
        try:
            return self._lookup()
        except Exception:  # psutil races with exiting processes: the next scan finds them
            return []


class EmulatedSlowdown:
    """The slowdown of an emulated node (``cluster.emulate``): its workers read ``factor`` from a file and
    stretch their emulated compute by it (``emulation.speed``). Nothing is frozen: its CPU math is not what
    is timed. Same interface as ``Slowdown``."""

    def __init__(self, node: str, factor: float, directory: str, *, ends_at: float | None = None) -> None:
        if not factor > 1:
            raise ValueError(f"slowdown factor must be > 1, got {factor}")
        self.node, self.factor, self.ends_at, self.directory = node, factor, ends_at, directory
        self.cycles = 0
        """Steps are what a speed file slows, not duty cycles: always 0."""
        self._running = False

    def start(self) -> EmulatedSlowdown:
        write_speed(self.directory, self.node, self.factor)
        self._running = True
        return self

    @property
    def running(self) -> bool:
        return self._running

    def end(self, timeout: float = 2.0) -> None:
        if self._running:
            write_speed(self.directory, self.node, 1.0)
            self._running = False


def _write(path: str, text: str) -> bool:
    try:
        with open(path, "w") as fh:
            fh.write(text)
        return True
    except OSError:  # a process that exited meanwhile (ESRCH), a cgroup being removed
        return False


def _signal(proc: psutil.Process, sig: int) -> bool:
    try:
        proc.send_signal(sig)  # psutil checks the pid still names the same process (create time)
        return True
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False
