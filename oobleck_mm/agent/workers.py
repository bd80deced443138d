"""The agent's worker processes: start, talk to (protobuf over a pipe), supervise, kill.

One worker per GPU, each its own OS process. By default (``--worker-start
forkserver``) a worker is a fork of the node's *worker template*: a process the
agent starts once, before it registers, that imports torch, torch._dynamo, the
engine and (with a CPU build of torch) DeepSpeed's schedules
(``oobleck_mm.runtime.worker_preload``) and then only forks. A node with 8 GPUs
pays those imports once instead of 8 times side by side, and a worker started later (restart-mode
recovery) is ready in a fraction of a second. The template is the standard
library's ``forkserver``: an interpreter of its own (never a fork of the agent,
which would inherit gRPC's threads), single-threaded, that never touches CUDA
nor asks whether there is a GPU (``runtime.template.TEMPLATE_ENV``,
``template.gpu_build``: the driver is not fork-safe once initialised); if it
dies, the next start restarts it. Under ``oobleck-launch local`` the simulated
nodes share one template, the launcher's (``SHARED_TEMPLATE_ENV``; a fork of it
ties itself to its agent in ``worker_entry``). ``--worker-start spawn`` starts each worker as
a fresh interpreter instead. Workers are started once and then only receive
commands: their in-memory model states are what makes checkpoint-free recovery
possible, so they are never restarted.

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
import sys
import time
from dataclasses import dataclass
from multiprocessing import forkserver, reduction
from multiprocessing.connection import Connection
from typing import Callable

import psutil

from oobleck_mm.lifetime import die_with, die_with_parent
from oobleck_mm.protocol import oobleck_pb2 as pb
from oobleck_mm.runtime.template import (
    SHARED_TEMPLATE_ENV,
    leave_shared_template,
    target_preload,
    use_shared_template,
    warm_context,
)

log = logging.getLogger(__name__)

DEFAULT_WORKER_TARGET = "oobleck_mm.runtime.agent_worker:worker_main"
WORKER_START_METHODS = ("forkserver", "spawn")
"""How an agent starts its workers: forks of the warm worker template, or fresh interpreters."""
DEFAULT_WORKER_START = "forkserver"


# ---------------------------------------------------------------------- inside the worker process
def worker_entry(
    target: str,
    conn: Connection,
    config_path: str,
    node: str,
    local_rank: int,
    agent_pid: int,
    shared: SharedTemplateStart | None = None,
) -> None:
    """First code a worker runs: tie its life to the agent, then run ``target`` ("module:function").

    Its parent is the agent (``spawn``) or the agent's worker template (``forkserver``), which
    exits when the agent dies (its end of the template's "alive" pipe closes, SIGKILL included):
    either way the parent-death signal ends the worker with the agent. A fork of the template a
    local run's nodes share (``shared``) is not the agent's: it watches the agent's pid, joins the
    agent's process group (a node's processes are one group: the fault injector stops or kills
    them together), and takes the agent's environment and log.
    """
    # A scheduler's SIGTERM reaches every process of the node at once (SLURM signals a step's whole
    # process tree, Kubernetes a container's, a terminal's Ctrl-C its process group): it is the agent's
    # notice to act on, and the agent tells its workers when to stop (a command, or SIGKILL). A worker
    # that died of it lost the node's state mid-step (seen under SLURM: exit 255, the node lost).
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = os.getppid()
    if shared is not None:
        die_with_parent(parent)  # the shared template: it ends with the launcher
        die_with(agent_pid)
        shared.enter(agent_pid)
    else:
        if parent != agent_pid and _parent_of(parent) != agent_pid:  # the agent died before we got here
            os._exit(1)
        die_with_parent(parent)
    module, _, name = target.partition(":")
    fn: Callable = getattr(importlib.import_module(module), name)
    fn(conn, config_path, node, local_rank)


class SharedTemplateStart:
    """What a fork of a shared template takes from its agent: the agent's environment, its log
    (stdout and stderr), its process group. Pickled with the ``Process``: the log's fd travels
    as the connection's do (``reduction.DupFd``)."""

    def __init__(self, environ: dict[str, str], log_fd: int) -> None:
        self.environ = environ
        self.log_fd = log_fd

    def __reduce__(self):
        return _rebuild_shared_start, (self.environ, reduction.DupFd(self.log_fd))

    def enter(self, agent_pid: int) -> None:
        os.environ.clear()
        os.environ.update(self.environ)
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os.dup2(self.log_fd, 1)
        os.dup2(self.log_fd, 2)
        os.close(self.log_fd)
        try:
            os.setpgid(0, os.getpgid(agent_pid))
        except (PermissionError, ProcessLookupError):  # another session, or the agent is gone: die_with acts
            pass


def _rebuild_shared_start(environ: dict[str, str], log_fd) -> SharedTemplateStart:
    return SharedTemplateStart(environ, log_fd.detach())


def _parent_of(pid: int) -> int | None:
    try:
        return psutil.Process(pid).ppid()
    except psutil.NoSuchProcess:
        return None


# ---------------------------------------------------------------------- inside the agent
def start_worker_template(method: str, target: str = DEFAULT_WORKER_TARGET) -> None:
    """Starts the worker template now, so that its imports overlap the agent's registration.

    ``method``: one of ``WORKER_START_METHODS``; ``spawn`` has no template. Idempotent; a
    template that died is started again (``forkserver.ensure_running``), here or at the next
    worker's start.
    """
    if method not in WORKER_START_METHODS:
        raise ValueError(f"worker start method {method!r}: expected one of {', '.join(WORKER_START_METHODS)}")
    if method == "spawn":
        return
    global _shared
    if _shared is None:
        _shared = bool(os.environ.get(SHARED_TEMPLATE_ENV))
        if _shared:
            try:
                use_shared_template(os.environ[SHARED_TEMPLATE_ENV])  # oobleck-launch local's, for all its nodes
            except (OSError, ValueError) as error:
                _leave_shared_template(error)
    if _shared:
        return
    # The default target's module is not preloaded: on a GPU machine it imports DeepSpeed, whose
    # accelerator probe initialises the CUDA driver (worker_preload's docstring).
    warm_context(target_preload(None if target == DEFAULT_WORKER_TARGET else target))
    forkserver.ensure_running()


_shared: bool | None = None
"""This agent forks its workers from its launcher's template (``SHARED_TEMPLATE_ENV``); None: not
decided yet; False after that template failed (then the agent starts one of its own)."""


def _leave_shared_template(error: BaseException) -> None:
    global _shared
    log.warning("the worker template of the launcher did not answer (%r); starting this node's own", error)
    leave_shared_template()
    _shared = False


TEMPLATE_RESTART_S = 10.0
"""How long a worker's start retries while the worker template it asked is dead and not yet replaced."""
TEMPLATE_RETRY_S = 0.05
"""Pause between those tries."""


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


EXIT_STATUS_WAIT_S = 2.0
"""How long the agent waits for a dead worker's exit status before it reports the worker by what it saw (a
zombie). A fork of the worker template is the template's child: the template reaps it and passes the status on,
which took over 0.5 s (the wait before) once in a clean-clone CI run on 2 busy cores, and the node was
reported ``worker_zombie`` instead of ``worker_exited`` by SIGKILL. Only the death path waits."""


class Worker:
    """One worker process and the agent's end of its pipe."""

    def __init__(
        self,
        target: str,
        config_path: str,
        node: str,
        local_rank: int,
        method: str = DEFAULT_WORKER_START,
        since: float | None = None,
    ) -> None:
        self.since = time.monotonic() if since is None else since
        """Monotonic time this worker's start began: its template's start, when the template was
        started for it (the imports a fork skips were paid there), else now."""
        ctx = multiprocessing.get_context(method)
        self.local_rank = local_rank
        self.conn, child_conn = ctx.Pipe(duplex=True)
        deadline = time.monotonic() + TEMPLATE_RESTART_S
        while True:
            if method != "spawn":
                start_worker_template(method, target)  # a no-op while the template runs
            shared = SharedTemplateStart(dict(os.environ), sys.stdout.fileno()) if _shared else None
            self.process = ctx.Process(
                target=worker_entry,
                args=(target, child_conn, config_path, node, local_rank, os.getpid(), shared),
                name=f"worker-{node}-{local_rank}",
            )
            try:
                self.process.start()
                break
            except (EOFError, ConnectionError, FileNotFoundError) as error:
                if shared is not None:  # the launcher's template is gone: this node starts its own
                    _leave_shared_template(error)
                    continue
                # The template died as we asked it for a fork, and did not look dead yet: the kernel
                # shows it a zombie a moment before it can be reaped (seen on an H200: waitpid said
                # "running" for a zombie). Ask again until ensure_running sees it and starts another.
                if method == "spawn" or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"could not start worker {local_rank}: the worker template ({method}) keeps failing: {error!r}"
                    ) from error
                time.sleep(TEMPLATE_RETRY_S)
        # Our copy of the child's end must go, or a dead worker's pipe would never read EOF.
        child_conn.close()
        self.pid = self.process.pid
        self.eof = False
        """The worker's end of the pipe is closed (set by the agent's reports thread, ``oobleck_mm.agent.pipes``)."""
        self.ready = False
        """The worker said ``ready`` (set by the agent's reports thread): until then it is importing and
        reads no command, and holds nothing a shutdown could save."""
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
            # Reaped by its template, whose note of how it died comes down the status pipe a moment
            # later (a template shared by a local run's nodes serves them all).
            return self._dead_fault(pb.WORKER_EXITED, "is gone")
        if status == psutil.STATUS_ZOMBIE:
            # Our own child: it just died and is not reaped yet (the pipe closes before the exit
            # status is waitable). Reap it to report how it died; a zombie that stays is reported as one.
            return self._dead_fault(pb.WORKER_ZOMBIE, "is a zombie")
        if status in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP):
            return WorkerFault(self.local_rank, pb.WORKER_STOPPED, f"pid {self.pid} is stopped (status {status})")
        return None

    def _dead_fault(self, kind: int, what: str) -> WorkerFault:
        """A worker that died: how it died once its exit status arrives (up to ``EXIT_STATUS_WAIT_S``), else
        ``what``."""
        self.process.join(EXIT_STATUS_WAIT_S)
        if self.process.exitcode is not None:
            return self.fault()
        return WorkerFault(self.local_rank, kind, f"pid {self.pid} {what}")

    def descendants(self) -> list[psutil.Process]:
        try:
            return self._ps.children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def kill(self) -> None:
        """SIGKILLs the worker and every process under it, and reaps the worker. Its pipe stays open: the
        agent's reports thread closes it (``oobleck_mm.agent.pipes``), or ``close``."""
        tree = self.descendants()  # before the worker dies: orphans reparent and are lost to us
        for proc in [self._ps, *tree]:
            try:
                proc.kill()  # SIGKILL also ends a stopped (SIGSTOP) process
            except psutil.NoSuchProcess:
                pass
        self.process.join(2.0)
        _wait_dead(tree, 2.0)

    def close(self) -> None:
        """Closes the agent's end of the pipe (where no other thread reads it)."""
        self.conn.close()


REPORTS_DRAIN_S = 1.0
"""How long ``stop_all`` waits, once a worker exited by itself, for the agent's reports thread to read its
pipe to the end before the pipe is closed: a worker leaving at an iteration boundary writes its last
reports (the iteration's metrics, a background checkpoint's share) just before it exits, and closing
the pipe before the thread read them would lose them (a race, not seen lost in the leave's test, whose
reports thread read within its 0.1 s wait; a benched node's agent took its workers out of that
thread's sight before stopping them, so their last reports were never read)."""


def stop_all(workers: list[Worker], grace_s: float, shutdown: pb.Shutdown, drain_s: float = 0.0) -> None:
    """Sends every worker ``shutdown``, gives them ``grace_s`` in all to exit, then kills what is left.

    A worker busy in a step reads its pipe at the next iteration boundary (at once when the
    Shutdown is not ``at_boundary``: its waits give up), so the grace is a courtesy; the kill is
    what guarantees the end. A worker still starting (no ``ready`` yet) reads no command before
    its imports end, and has no step or checkpoint to finish: it is killed at once, so a Ctrl-C
    during start-up ends the node without waiting out the grace.
    """
    command = pb.WorkerCommand(shutdown=shutdown)
    for worker in [w for w in workers if not w.ready]:
        worker.kill()
    workers = [w for w in workers if w.ready]
    for worker in workers:
        worker.send(command)
    deadline = time.monotonic() + grace_s
    for worker in workers:
        worker.process.join(max(0.0, deadline - time.monotonic()))
    # ``drain_s``: the caller's reports thread still reads these workers' pipes (``Worker.eof``).
    drained_by = time.monotonic() + drain_s
    for worker in workers:
        while worker.process.exitcode is not None and not worker.eof and time.monotonic() < drained_by:
            time.sleep(0.01)
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
