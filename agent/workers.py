"""The agent's worker processes: start, talk to (protobuf over a pipe), supervise, kill.

One worker per GPU, each its own OS process started with ``spawn`` (a forked
copy of the agent would inherit gRPC's threads). Workers are started once and
then only receive commands: their in-memory model states are what makes
checkpoint-free recovery possible, so they are never restarted.

No orphans: a worker dies with its agent even when the agent is SIGKILLed
(``oobleck_mm.lifetime``), and the agent kills each worker's whole process
tree when it stops.
"""

from __future__ import annotations

import importlib
import logging
import multiprocessing
import os
import signal
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Callable

import psutil

from oobleck_mm.lifetime import die_with_parent
from oobleck_mm.protocol import oobleck_pb2 as pb

log = logging.getLogger(__name__)

DEFAULT_WORKER_TARGET = "oobleck_mm.runtime.agent_worker:worker_main"


# ---------------------------------------------------------------------- inside the worker process
def worker_entry(target: str, conn: Connection, config_path: str, node: str, local_rank: int, agent_pid: int) -> None:
    """First code a worker runs: tie its life to the agent, then run ``target`` ("module:function")."""
    die_with_parent(agent_pid)
    module, _, name = target.partition(":")
    fn: Callable = getattr(importlib.import_module(module), name)
    fn(conn, config_path, node, local_rank)


# ---------------------------------------------------------------------- inside the agent
@dataclass(frozen=True, slots=True)
class WorkerFault:
    local_rank: int
    kind: int
    """A ``pb.WorkerFailure`` value."""
    message: str

    @property
    def reason(self) -> str:
        """``worker_exited`` | ``worker_zombie`` | ``worker_stopped``: the reason the master logs."""
        return pb.WorkerFailure.Name(self.kind).lower()


class Worker:
    """One worker process and the agent's end of its pipe."""

    def __init__(self, target: str, config_path: str, node: str, local_rank: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.local_rank = local_rank
        self.conn, child_conn = ctx.Pipe(duplex=True)
        self.process = ctx.Process(
            target=worker_entry,
            args=(target, child_conn, config_path, node, local_rank, os.getpid()),
            name=f"worker-{node}-{local_rank}",
        )
        self.process.start()
        # Our copy of the child's end must go, or a dead worker's pipe would never read EOF.
        child_conn.close()
        self.pid = self.process.pid
        self.eof = False
        """The worker's end of the pipe is closed (set by the agent's reports thread)."""
        self._ps = psutil.Process(self.pid)  # pins the pid to this process (create time), against reuse

    def send(self, command: pb.WorkerCommand) -> bool:
        """Sends a command; False when the worker's end is gone."""
        try:
            self.conn.send_bytes(command.SerializeToString())
            return True
        except (BrokenPipeError, ConnectionResetError, EOFError, OSError):
            return False

    def fault(self) -> WorkerFault | None:
        """Why this worker can no longer run, or None while it is healthy."""
        code = self.process.exitcode  # reaps a dead child (waitpid WNOHANG)
        if code is not None:
            how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
            return WorkerFault(self.local_rank, pb.WORKER_EXITED, f"pid {self.pid} exited ({how})")
        try:
            status = self._ps.status()
        except psutil.NoSuchProcess:
            return WorkerFault(self.local_rank, pb.WORKER_EXITED, f"pid {self.pid} is gone")
        if status == psutil.STATUS_ZOMBIE:
            # Our own child: it just died and is not reaped yet (the pipe closes before the exit
            # status is waitable). Reap it to report how it died; a zombie that stays is reported as one.
            self.process.join(0.5)
            if self.process.exitcode is not None:
                return self.fault()
            return WorkerFault(self.local_rank, pb.WORKER_ZOMBIE, f"pid {self.pid} is a zombie")
        if status in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP):
            return WorkerFault(self.local_rank, pb.WORKER_STOPPED, f"pid {self.pid} is stopped (status {status})")
        return None

    def descendants(self) -> list[psutil.Process]:
        try:
            return self._ps.children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def kill(self) -> None:
        """SIGKILLs the worker and every process under it, and reaps the worker."""
        tree = self.descendants()  # before the worker dies: orphans reparent and are lost to us
        for proc in [self._ps, *tree]:
            try:
                proc.kill()  # SIGKILL also ends a stopped (SIGSTOP) process
            except psutil.NoSuchProcess:
                pass
        self.process.join(2.0)
        _wait_dead(tree, 2.0)
        self.conn.close()


def stop_all(workers: list[Worker], grace_s: float, shutdown: pb.Shutdown) -> None:
    """Sends every worker ``shutdown``, gives them ``grace_s`` in all to exit, then kills what is left.

    A worker busy in a step reads its pipe at the next iteration boundary (at once when the
    Shutdown is not ``at_boundary``: its waits give up), so the grace is a courtesy; the kill is
    what guarantees the end.
    """
    command = pb.WorkerCommand(shutdown=shutdown)
    for worker in workers:
        worker.send(command)
    deadline = time.monotonic() + grace_s
    for worker in workers:
        worker.process.join(max(0.0, deadline - time.monotonic()))
    for worker in workers:
        worker.kill()


def _wait_dead(procs: list[psutil.Process], timeout: float) -> None:
    # Not psutil.wait_procs: an orphan killed here is reaped by whoever adopted it, and an
    # init that never reaps (some containers) would keep it a zombie for the whole timeout.
    deadline = time.monotonic() + timeout
    for proc in procs:
        while time.monotonic() < deadline:
            try:
                if proc.status() == psutil.STATUS_ZOMBIE:
                    break
            except psutil.NoSuchProcess:
                break
            time.sleep(0.01)
