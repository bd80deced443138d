"""The fault injector: fires ``FaultEvent`` values at a running local cluster with real signals.

A small thread that tails the master's JSONL event log for progress (``step``
events: completed steps; ``plan_decided``: training has a plan; ``shutdown``:
the job is over), and when an event is due:

- ``kill``: SIGKILL the node's agent, then every process under it (workers,
  their DataLoader children, multiprocessing's resource tracker): a crashed
  machine. The agent goes first so the node cannot report anything.
- ``killworker``: SIGKILL one worker (and its own children); the agent lives
  and is the one to notice.
- ``stop``: SIGSTOP the agent, then everything under it: a hung machine whose
  sockets stay open, so only the heartbeat timeout can tell.
- ``preempt``: SIGTERM to the agent (a spot provider's notice; the agent asks the
  master to plan its node out), then, ``notice_s`` later, SIGKILL of whatever of
  the node is still there (the provider reclaims it), logged as ``preempt_kill``.
- ``killmaster``: SIGKILL the master process and its planning helper; the
  launcher restarts it (``--resume-master``) and it re-adopts the running job.
- ``join``: ``start_agent(name)``, the launcher's own way to start a node.
- ``slow``: the node's workers run ``factor`` times slower (``faults/slowdown.py``: a
  stop/continue duty cycle) until ``duration_s`` passed or the job ends; recorded as
  ``slowed`` and ``slow_restored`` events, which are not incidents: nothing fails, and the
  recovery table stays about failures and joins.

Events due at the same moment are resolved first, recorded as ``injected``
events (kind, node, step, seconds, pids, batch, source) in the same event log,
then signalled together (simultaneous failures); the record goes first so the
failure precedes its detection in the log. One
that cannot be carried out (unknown or already dead node) is recorded as
``inject_skipped`` with the reason and never stops the job.

Workers are the agent's children started by multiprocessing's ``spawn``
(``spawn_main`` on their command line), ordered by start time: the agent starts
them in local-rank order, so the K-th is ``gpuK``.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import psutil

from oobleck_mm.events import EventLog
from oobleck_mm.faults.slowdown import EmulatedSlowdown, Slowdown
from oobleck_mm.faults.spec import FaultEvent, node_number

log = logging.getLogger(__name__)

AgentPids = Callable[[], Mapping[str, int]]
"""node name -> agent pid, for every agent the launcher started (dead ones included)."""
StartAgent = Callable[[str], None]
"""Starts an agent with this node name (the launcher's ``_start_agent``)."""
MasterPid = Callable[[], "int | None"]
"""The master process's pid now (the launcher restarts it when it dies)."""


class EventTail:
    """Reads the events appended to a JSONL file since the last call (complete lines only)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)
        self._offset = 0
        self._partial = b""

    def poll(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self._offset)
                chunk = fh.read()
        except FileNotFoundError:
            return []
        self._offset += len(chunk)
        data = self._partial + chunk
        lines = data.split(b"\n")
        self._partial = lines.pop()  # the line being written, if any
        out = []
        for line in lines:
            try:
                out.append(json.loads(line))
            except ValueError:
                continue  # a writer killed mid-line
        return out


@dataclass(slots=True)
class Progress:
    """What the event log says about training so far."""

    steps_done: int | None = None
    """Completed steps: 0 once a plan is decided, then 1 + the highest step logged."""
    first_step_ts: float | None = None
    """Wall time (``ts``) of the first step completed: time 0 of ``@tXs`` events."""
    finished: bool = False

    def update(self, event: Mapping[str, Any]) -> None:
        name = event.get("event")
        if name == "plan_decided" and self.steps_done is None:
            self.steps_done = 0
        elif name == "step" and isinstance(event.get("step"), int):
            self.steps_done = max(self.steps_done or 0, event["step"] + 1)
            if self.first_step_ts is None:
                self.first_step_ts = float(event["ts"])
        elif name == "shutdown":
            self.finished = True

    def elapsed(self, now: float) -> float | None:
        return None if self.first_step_ts is None else now - self.first_step_ts


@dataclass(slots=True)
class _Target:
    fault: FaultEvent
    procs: list[psutil.Process] = field(default_factory=list)
    error: str | None = None


class Injector:
    """Fires ``faults`` at the cluster as training reaches them; ``start()`` / ``stop()``, one thread."""

    def __init__(
        self,
        faults: Sequence[FaultEvent],
        *,
        event_log_path: str | os.PathLike,
        events: EventLog,
        agents: AgentPids,
        start_agent: StartAgent,
        master: MasterPid | None = None,
        poll_s: float = 0.05,
        emulate_dir: str | None = None,
    ) -> None:
        self.pending = list(faults)
        self.master = master
        self.emulate_dir = emulate_dir
        """An emulated run's speed-file folder: a ``slow`` fault stretches the node's emulated time instead of
        freezing its processes (``faults.slowdown.EmulatedSlowdown``)."""
        self.events = events
        self.agents = agents
        self.start_agent = start_agent
        self.poll_s = poll_s
        self.progress = Progress()
        self.injected: list[dict[str, Any]] = []
        """The ``injected`` / ``inject_skipped`` records written, in order."""
        self._tail = EventTail(event_log_path)
        self._stopped_pids: list[psutil.Process] = []
        self._reclaims: list[tuple[float, FaultEvent, list[psutil.Process]]] = []
        """(wall time, fault, processes) of preempted nodes still to be killed."""
        self._joined: list[str] = []
        self._slowdowns: dict[str, Slowdown] = {}
        """node -> its slowdown running now."""
        self._batch = 0
        self._halt = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("the injector is already started")
        self._thread = threading.Thread(target=self._run, name="fault-injector", daemon=True)
        self._thread.start()

    def stop(self, kill_stopped: bool = True, timeout: float = 5.0) -> None:
        """Ends the thread; with ``kill_stopped``, SIGKILLs the nodes it hung (the job gave them up)."""
        self._halt.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self._restore(float("inf"))  # never leave a node's workers stopped by a duty cycle
        if kill_stopped:
            for proc in self._stopped_pids:
                _signal(proc, signal.SIGKILL)  # SIGKILL ends a stopped process without SIGCONT
            self._stopped_pids.clear()
        self._reclaim(float("inf"))  # the job is over: the provider takes its preempted nodes now

    @property
    def done(self) -> bool:
        """Every event fired (or skipped) and every preempted node reclaimed, or the job is over."""
        timed = any(s.ends_at is not None for s in self._slowdowns.values())
        return (not self.pending and not self._reclaims and not timed) or self.progress.finished

    def _run(self) -> None:
        while not self._halt.is_set():
            try:
                self.poll(time.time())
            except Exception:  # never take the launcher down: record and go on
                log.exception("fault injector: unexpected error")
            if self.done:
                return
            self._halt.wait(self.poll_s)

    # ------------------------------------------------------------------ one poll (also called by tests)
    def poll(self, now: float) -> list[dict[str, Any]]:
        """Reads new progress and fires what is due at wall time ``now``; returns the records written."""
        reached: list[FaultEvent] = []
        for event in self._tail.poll():
            self.progress.update(event)
            reached += [f for f in self.pending if f.reached(event) and f not in reached]
        if self.progress.finished:
            return self._restore(float("inf"))
        records = self._reclaim(now) + self._restore(now)
        if reached:  # @phase:P: the node is there now (its worker holds until the fault lands)
            self.pending = [f for f in self.pending if f not in reached]
            records += self.fire(reached)
        elapsed = self.progress.elapsed(now)
        due = [f for f in self.pending if f.due(self.progress.steps_done, elapsed)]
        if not due:
            return records
        self.pending = [f for f in self.pending if f not in due]
        return records + self.fire(due)

    def _reclaim(self, now: float) -> list[dict[str, Any]]:
        """SIGKILLs preempted nodes whose notice ran out (what of them is still there)."""
        due = [r for r in self._reclaims if r[0] <= now]
        self._reclaims = [r for r in self._reclaims if r[0] > now]
        records = []
        for _, fault, procs in due:
            alive = [p for p in procs if _signal(p, signal.SIGKILL)]
            records.append(
                self._write(
                    "preempt_kill",
                    node=fault.node,
                    pids=[p.pid for p in alive],
                    after_s=fault.notice_s,
                    source=fault.source,
                )
            )
        return records

    def _restore(self, now: float) -> list[dict[str, Any]]:
        """Ends the slowdowns due at ``now`` (wall time): their nodes run at full speed again."""
        records = []
        for node, slowdown in list(self._slowdowns.items()):
            due = now == float("inf") or (slowdown.ends_at is not None and slowdown.ends_at <= now)
            if not due:  # ``inf``: the job is over, or the injector stops
                continue
            slowdown.end()
            del self._slowdowns[node]
            records.append(
                self._write(
                    "slow_restored",
                    node=node,
                    factor=slowdown.factor,
                    cycles=slowdown.cycles,
                    step=self.progress.steps_done,
                    seconds=self.progress.elapsed(time.time()),
                )
            )
        return records

    def fire(self, faults: Sequence[FaultEvent]) -> list[dict[str, Any]]:
        """Carries out ``faults`` together: every failure's processes are found first, then signalled."""
        self._batch += 1
        targets = [_Target(f) for f in faults]
        # A trace or a churn burst may join a node and take it away in the same moment: the join
        # comes first, so the failure hits the node the timeline means instead of "unknown node".
        hit = {t.fault.node for t in targets if t.fault.is_failure}
        first = [t for t in targets if t.fault.kind == "join" and t.fault.node in hit]
        records = [self._join(t) for t in first]
        for target in targets:
            if target.fault.is_failure:
                self._resolve(target)
        # Logged before the signals: the master may log the loss within a millisecond of them,
        # and the failure must come first in the log.
        records += [self._record(t) for t in targets if t.fault.is_failure]
        for target in targets:  # one tight loop: simultaneous failures really are
            if target.fault.is_failure and target.error is None:
                self._signal_target(target)
        for target in targets:
            if target.fault.kind == "join" and all(target is not f for f in first):
                records.append(self._join(target))
            elif target.fault.kind == "slow":
                records.append(self._slow(target.fault))
        return records

    # ------------------------------------------------------------------ internals
    def _resolve(self, target: _Target) -> None:
        fault = target.fault
        if fault.kind == "killmaster":
            pid = self.master() if self.master is not None else None
            master = _live_process(pid) if pid is not None else None
            if master is None:
                target.error = "no master process to kill (this launcher runs none, or it is gone)"
                return
            target.procs = [master, *_children(master)]
            return
        pids = dict(self.agents())
        if fault.node not in pids:
            target.error = f"unknown node {fault.node!r}; the launcher started {sorted(pids)}"
            return
        agent = _live_process(pids[fault.node])
        if agent is None:
            target.error = f"node {fault.node} is already gone (agent pid {pids[fault.node]})"
            return
        if fault.kind == "killworker":
            workers = worker_processes(agent)
            if fault.local_rank >= len(workers):
                target.error = f"node {fault.node} has {len(workers)} workers; no gpu{fault.local_rank}"
                return
            worker = workers[fault.local_rank]
            target.procs = [worker, *_children(worker)]
        else:
            target.procs = node_processes(agent)

    def _signal_target(self, target: _Target) -> None:
        if target.fault.kind == "preempt":  # the notice now, the kill once it ran out
            _signal(target.procs[0], signal.SIGTERM)
            self._reclaims.append((time.time() + target.fault.notice_s, target.fault, target.procs))
            return
        sig = signal.SIGSTOP if target.fault.kind == "stop" else signal.SIGKILL
        for proc in target.procs:
            if _signal(proc, sig) and sig == signal.SIGSTOP:
                self._stopped_pids.append(proc)

    def _record(self, target: _Target) -> dict[str, Any]:
        fault = target.fault
        common = dict(
            kind=fault.kind,
            node=fault.node,
            step=self.progress.steps_done,
            seconds=self.progress.elapsed(time.time()),
            batch=self._batch,
            source=fault.source,
        )
        if fault.phase is not None:
            common["phase"] = fault.phase
        if fault.kind == "killworker":
            common["local_rank"] = fault.local_rank
        if target.error is not None:
            log.warning("fault %s skipped: %s", fault.describe(), target.error)
            return self._write("inject_skipped", reason=target.error, **common)
        log.warning("injected %s (pids %s)", fault.describe(), [p.pid for p in target.procs])
        return self._write("injected", pids=[p.pid for p in target.procs], **common)

    def _join(self, target: _Target) -> dict[str, Any]:
        fault = target.fault
        name = fault.node or self._next_name()
        common = dict(
            kind="join",
            node=name,
            step=self.progress.steps_done,
            seconds=self.progress.elapsed(time.time()),
            batch=self._batch,
            source=fault.source,
        )
        if fault.phase is not None:
            common["phase"] = fault.phase
        if name in self.agents() and _live_process(self.agents()[name]) is not None:
            return self._write("inject_skipped", reason=f"node {name} is already running", **common)
        try:
            self.start_agent(name)
        except Exception as exc:  # the launcher could not start it: record, never crash the job
            return self._write("inject_skipped", reason=f"starting agent {name} failed: {exc!r}", **common)
        self._joined.append(name)
        pid = self.agents().get(name)
        log.warning("injected join of %s (agent pid %s)", name, pid)
        agent = _live_process(pid) if pid is not None else None
        # When the agent process began: long before the join for a launcher's standby (oobleck_mm/master/local.py).
        started = _safe(agent.create_time, None) if agent is not None else None
        return self._write("injected", pids=[] if pid is None else [pid], agent_started=started, **common)

    def _slow(self, fault: FaultEvent) -> dict[str, Any]:
        common = dict(
            kind="slow",
            node=fault.node,
            step=self.progress.steps_done,
            seconds=self.progress.elapsed(time.time()),
            batch=self._batch,
            source=fault.source,
        )
        pids = dict(self.agents())
        agent = _live_process(pids[fault.node]) if fault.node in pids else None
        if agent is None:
            why = (
                f"node {fault.node} is already gone"
                if fault.node in pids
                else f"unknown node {fault.node!r}; the launcher started {sorted(pids)}"
            )
            log.warning("fault %s skipped: %s", fault.describe(), why)
            return self._write("inject_skipped", reason=why, **common)
        previous = self._slowdowns.pop(fault.node, None)
        if previous is not None:  # a new slowdown of the same node replaces the one running
            previous.end()

        def lookup() -> list[psutil.Process]:
            return [p for w in worker_processes(agent) for p in (w, *_children(w))]

        ends_at = time.time() + fault.duration_s if fault.duration_s is not None else None
        if self.emulate_dir is not None:
            slowdown = EmulatedSlowdown(fault.node, fault.factor, self.emulate_dir, ends_at=ends_at).start()
        else:
            slowdown = Slowdown(fault.node, fault.factor, lookup, ends_at=ends_at).start()
        self._slowdowns[fault.node] = slowdown
        log.warning("injected %s", fault.describe())
        return self._write(
            "slowed",
            factor=fault.factor,
            duration_s=fault.duration_s,
            pids=[p.pid for p in worker_processes(agent)],
            **common,
        )

    def _next_name(self) -> str:
        used = [*self.agents(), *self._joined]
        return f"node{1 + max((node_number(n) for n in used), default=-1)}"

    def _write(self, event: str, **fields: Any) -> dict[str, Any]:
        record = self.events.write(event, **fields)
        self.injected.append(record)
        return record


# ---------------------------------------------------------------------- processes
EXEC_SETTLE_S = 1.0
"""How long a child with an empty command line is given to finish its exec. multiprocessing's
``Process.start()`` returns once it forked, before the child's exec (``util.spawnv_passfds``
does not wait for it): a worker started a moment ago can show no command line yet, and was
then not counted (a ``killworker`` right after a start found "1 workers" under load)."""


def worker_processes(agent: psutil.Process) -> list[psutil.Process]:
    """The agent's worker processes in local-rank order (the order it started them): its children
    (``--worker-start spawn``), its worker template's (``forkserver``, oobleck_mm/agent/workers.py), or those
    of the template this launcher shares between its nodes that joined the agent's process group."""
    workers = _shared_template_workers(agent)
    for child in _safe(agent.children, []):
        command = " ".join(_exec_cmdline(child))
        if "spawn_main" in command:  # a spawned worker (not the resource tracker, also a multiprocessing child)
            workers.append(child)
        elif "forkserver" in command:  # the agent's worker template: it forks workers and nothing else
            workers += _safe(child.children, [])
    return sorted(workers, key=lambda p: (_safe(p.create_time, 0.0), p.pid))


def node_processes(agent: psutil.Process) -> list[psutil.Process]:
    """Every process of the agent's simulated node: the agent, its descendants, and its workers forked
    by the shared template (with theirs)."""
    procs = [agent, *_children(agent)]
    for worker in _shared_template_workers(agent):
        procs += [worker, *_children(worker)]
    return procs


def _shared_template_workers(agent: psutil.Process) -> list[psutil.Process]:
    """The agent's workers forked by a template its launcher shares between nodes
    (``runtime.template.start_shared_template``): the members of the agent's process group whose
    parent is outside it (a per-agent template's forks and the workers' own children have a parent
    inside it)."""
    members = [p for p in psutil.process_iter() if _process_group(p.pid) == agent.pid and p.pid != agent.pid]
    return [p for p in members if _process_group(_safe(p.ppid, 0)) != agent.pid]


def _process_group(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except (ProcessLookupError, PermissionError):
        return None


def _exec_cmdline(proc: psutil.Process, settle_s: float = EXEC_SETTLE_S) -> list[str]:
    """``proc``'s command line once it is exec'd (waiting up to ``settle_s``); [] if it is gone."""
    deadline = time.monotonic() + settle_s
    while True:
        cmdline = _safe(proc.cmdline, None)
        if cmdline is None or cmdline or time.monotonic() >= deadline:
            return cmdline or []
        time.sleep(0.005)


def _live_process(pid: int) -> psutil.Process | None:
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return None  # dead, not yet reaped by the launcher
        return proc
    except psutil.NoSuchProcess:
        return None


def _children(proc: psutil.Process) -> list[psutil.Process]:
    return _safe(lambda: proc.children(recursive=True), [])


def _signal(proc: psutil.Process, sig: int) -> bool:
    try:
        proc.send_signal(sig)  # psutil checks the pid still names the same process (create time)
        return True
    except psutil.NoSuchProcess:
        return False


def _safe(fn: Callable, default):
    try:
        return fn()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return default
