"""``oobleck-launch local``: the master in this process, N agent subprocesses, their workers on this machine.

The same code as a real cluster, only on loopback: each agent is a separate
process with its own workers (one CPU process per simulated GPU), so killing
an agent here is killing a node. Every child is killed on the way out,
including on Ctrl-C or when the launcher itself fails.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

import psutil

from master.coordinator import WAITING
from master.server import MasterOptions, MasterServer

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LocalOptions:
    run_dir: str = ""
    event_log: str | None = None
    worker_target: str | None = None
    """Overrides the agents' worker entry point ("module:function"); for development."""


class LocalCluster:
    def __init__(self, job, options: LocalOptions) -> None:
        self.job = job
        self.options = options
        self.server = MasterServer(
            job, MasterOptions(host="127.0.0.1", port=0, run_dir=options.run_dir, event_log=options.event_log)
        )
        self.agents: list[tuple[str, subprocess.Popen, str]] = []
        self._signal: int | None = None

    def run(self) -> int:
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            self.server.start()
            print(f"master on {self.server.address}; run dir {self.server.run_dir}; "
                  f"event log {self.server.event_log_path}", flush=True)  # fmt: skip
            for i in range(self.job.cluster.nodes):
                self._start_agent(f"node{i}")
            code = self._wait()
            self._wait_agents(self.job.fault_tolerance.heartbeat_timeout.total_seconds() + 2.0)
            return code
        finally:
            self._kill_agents()
            self.server.stop()
            for sig, handler in old.items():
                signal.signal(sig, handler)

    def _start_agent(self, node: str) -> None:
        env = dict(os.environ)
        # One torch thread per simulated GPU unless the user chose otherwise: N workers share this CPU.
        env.setdefault("OMP_NUM_THREADS", "1")
        cmd = [sys.executable, "-m", "oobleck_mm.cli", "agent", "--master", self.server.address, "--node", node,
               "--gpus", str(self.job.cluster.gpus_per_node), "--token-file", self.server.token_file]  # fmt: skip
        if self.options.worker_target:
            cmd += ["--worker-target", self.options.worker_target]
        log_path = os.path.join(self.server.run_dir, f"agent-{node}.log")
        with open(log_path, "ab") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
        self.agents.append((node, proc, log_path))

    def _wait(self) -> int:
        while (code := self.server.wait(0.2)) is None:
            if self._signal is not None:
                self.server.finish(1, f"interrupted by {signal.Signals(self._signal).name}")
                self._signal = None
            coordinator = self.server.coordinator
            for node, proc, log_path in self.agents:
                # Before the plan a dead agent is never missed by the master: it would wait forever.
                if proc.poll() is not None and coordinator is not None and coordinator.phase == WAITING:
                    self.server.finish(1, f"agent {node} exited with code {proc.returncode} before the job "
                                          f"started; see {log_path}")  # fmt: skip
        return code

    def _wait_agents(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for _, proc, _ in self.agents:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass

    def _kill_agents(self) -> None:
        for node, proc, _ in self.agents:
            if proc.poll() is None:
                log.warning("agent %s still running; stopping it", node)
                _stop_tree(proc)

    def log_paths(self) -> list[str]:
        return [path for _, _, path in self.agents]

    def _on_signal(self, signum: int, frame) -> None:
        self._signal = signum


def _stop_tree(proc: subprocess.Popen, grace_s: float = 2.0) -> None:
    """SIGTERM (the agent then kills its workers), SIGKILL after ``grace_s``, then any survivor below it."""
    try:
        tree = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        tree = []
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
