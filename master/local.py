"""``oobleck-launch local``: the master in this process, N agent subprocesses, their workers on this machine.

The same code as a real cluster, only on loopback: each agent is a separate
process with its own workers (one CPU process per simulated GPU), so killing
an agent here is killing a node. Faults are injected with real signals by
``oobleck_mm.faults`` (``--inject``, ``--trace``), which finds processes and
starts joining nodes through ``agent_pids`` and ``start_agent``. Every child is
killed on the way out, including on Ctrl-C or when the launcher itself fails,
and at the end the run's recovery table is printed and its figure drawn (``run.png``).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Sequence

import psutil

from master.coordinator import JobPhase
from master.server import MasterOptions, MasterServer
from oobleck_mm.faults.spec import hold_points
from oobleck_mm.runtime.hold import ENV as HOLD_ENV

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LocalOptions:
    run_dir: str = ""
    event_log: str | None = None
    worker_target: str | None = None
    """Overrides the agents' worker entry point ("module:function"); for development."""
    resume_dir: str = ""
    save_final_dir: str = ""
    resume_command: str = "oobleck-launch local --config CONFIG"
    faults: Sequence = ()
    """``oobleck_mm.faults.FaultEvent`` values to inject (``--inject``, ``--trace``)."""
    report: bool = True
    """Print the recovery table and write ``run.png`` in the run dir at the end."""
    log_every: int = 1
    tensorboard: bool = True
    log_level: str = "info"
    """The agents' (and their workers') log level."""


class LocalCluster:
    def __init__(self, job, options: LocalOptions, progress=print) -> None:
        self.job = job
        self.options = options
        master = MasterOptions(
            host="127.0.0.1", port=0, run_dir=options.run_dir, event_log=options.event_log,
            resume_dir=options.resume_dir, save_final_dir=options.save_final_dir,
            resume_command=options.resume_command, log_every=options.log_every, tensorboard=options.tensorboard,
        )  # fmt: skip
        self.server = MasterServer(job, master, progress=progress)
        self.agents: dict[str, tuple[subprocess.Popen, str]] = {}
        self._agents_lock = threading.Lock()  # the injector thread starts joining nodes
        self._signal: int | None = None
        self._stop_requested = False
        self.injector = None
        self.summary = ""

    def run(self) -> int:
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            self.server.start()
            print(f"master on {self.server.address}; run dir {self.server.run_dir}; "
                  f"event log {self.server.event_log_path}", flush=True)  # fmt: skip
            for i in range(self.job.cluster.nodes):
                self.start_agent(f"node{i}")
            self._start_injector()
            code = self._wait()
            if self.injector is not None:
                self.injector.stop(kill_stopped=True)  # hung nodes never exit by themselves
            self._wait_agents(self.job.fault_tolerance.agent_exit_timeout.total_seconds())
            return code
        finally:
            if self.injector is not None:
                self.injector.stop(kill_stopped=True)
            self._kill_agents()
            self.server.stop()
            for sig, handler in old.items():
                signal.signal(sig, handler)
            self._report()

    # ------------------------------------------------------------------ what the fault injector uses
    def start_agent(self, node: str) -> None:
        """Starts ``oobleck-launch agent`` for ``node`` (a new name: a joining node)."""
        env = dict(os.environ)
        # One torch thread per simulated GPU unless the user chose otherwise: N workers share this CPU.
        env.setdefault("OMP_NUM_THREADS", "1")
        if holds := hold_points(self.options.faults):  # --inject kill:NODE@phase:copy: NODE's worker waits there
            env[HOLD_ENV] = ",".join(filter(None, (env.get(HOLD_ENV, ""), holds)))
        cmd = [sys.executable, "-m", "oobleck_mm.cli", "agent", "--master", self.server.address, "--node", node,
               "--gpus", str(self.job.cluster.gpus_per_node), "--token-file", self.server.token_file,
               "--log-level", self.options.log_level]  # fmt: skip
        if self.options.worker_target:
            cmd += ["--worker-target", self.options.worker_target]
        log_path = os.path.join(self.server.run_dir, f"agent-{node}.log")
        with self._agents_lock:
            if node in self.agents and self.agents[node][0].poll() is None:
                raise ValueError(f"node {node} is already running")
            with open(log_path, "ab") as out:
                proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
            self.agents[node] = (proc, log_path)

    def agent_pids(self) -> dict[str, int]:
        """node -> agent pid, for every agent started (dead ones included)."""
        with self._agents_lock:
            return {node: proc.pid for node, (proc, _) in self.agents.items()}

    def log_paths(self) -> list[str]:
        with self._agents_lock:
            return [path for _, path in self.agents.values()]

    # ------------------------------------------------------------------ internals
    def _start_injector(self) -> None:
        if not self.options.faults:
            return
        from oobleck_mm.faults.injector import Injector

        self.injector = Injector(
            list(self.options.faults), event_log_path=self.server.event_log_path, events=self.server.events,
            agents=self.agent_pids, start_agent=self.start_agent,
        )  # fmt: skip
        self.injector.start()

    def _wait(self) -> int:
        while (code := self.server.wait(0.2)) is None:
            if self._signal is not None:
                name = signal.Signals(self._signal).name
                if self._signal == signal.SIGTERM and not self._stop_requested:
                    # A scheduler's stop (Slurm, Kubernetes): write the step, exit 3 with the resume command.
                    self._stop_requested = True
                    print(f"{name}: stopping after a checkpoint of the current step ({name} again: at once)",
                          flush=True)  # fmt: skip
                    self.server.request_stop(name)
                else:
                    self.server.finish(1, f"interrupted by {name}")
                self._signal = None
            coordinator = self.server.coordinator
            with self._agents_lock:
                agents = list(self.agents.items())
            for node, (proc, log_path) in agents:
                # Before the plan a dead agent is never missed by the master: it would wait forever.
                if proc.poll() is not None and coordinator is not None and coordinator.phase is JobPhase.WAITING:
                    self.server.finish(1, f"agent {node} exited with code {proc.returncode} before the job "
                                          f"started; see {log_path}")  # fmt: skip
        return code

    def _wait_agents(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with self._agents_lock:
            procs = [proc for proc, _ in self.agents.values()]
        for proc in procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass

    def _kill_agents(self) -> None:
        with self._agents_lock:
            agents = list(self.agents.items())
        for node, (proc, _) in agents:
            if proc.poll() is None:
                log.warning("agent %s still running; stopping it", node)
                _stop_tree(proc)

    def _report(self) -> None:
        if not self.options.report or not os.path.exists(self.server.event_log_path):
            return
        try:
            from oobleck_mm.events import read_events
            from oobleck_mm.faults.report import format_table, plot_run, recovery_rows

            events = read_events(self.server.event_log_path)
            self.summary = format_table(recovery_rows(events))
            print(self.summary, flush=True)
            plot_run(events, os.path.join(self.server.run_dir, "run.png"), f"{self.job.model.name}: {self.server.run_dir}")
        except Exception as exc:  # the report is a courtesy: never turn a finished job into a failure
            log.warning("could not summarise %s: %r", self.server.event_log_path, exc)

    def _on_signal(self, signum: int, frame) -> None:
        self._signal = signum


def where_things_are(server: MasterServer) -> str:
    """The closing lines of a run: where its figure, metrics and logs are, and how to look at them."""
    figure = os.path.join(server.run_dir, "run.png")
    lines = [f"figure:      {figure}"] if os.path.exists(figure) else []
    lines.append(f"metrics:     {server.metrics.csv_path} (one row per step)")
    if server.metrics.tensorboard_dir is not None:
        lines.append(f"tensorboard: tensorboard --logdir {server.metrics.tensorboard_dir}")
    lines.append(f"event log:   {server.event_log_path}")
    if any(name.startswith("agent-") for name in os.listdir(server.run_dir)):
        lines.append(f"agent logs:  {os.path.join(server.run_dir, 'agent-*.log')}")
    return "\n".join(lines)


def _stop_tree(proc: subprocess.Popen, grace_s: float = 2.0) -> None:
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
