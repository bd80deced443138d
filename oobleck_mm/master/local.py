"""``oobleck-launch local``: a master process, N agent processes and their workers on this machine, supervised.

The same code as a real cluster, only on loopback: the master is
``oobleck-launch master`` in its own process and each agent a separate process
with its own workers (one CPU process per simulated GPU), so killing an agent
here is killing a node and killing the master is killing the master. When the
master dies (a signal, not an exit), this launcher restarts it with
``--resume-master``: it re-adopts the agents, whose workers trained on
meanwhile (``docs/recovery.md``). Faults are injected with real signals by
``oobleck_mm.faults`` (``--inject``, ``--trace``), which finds processes and
starts joining nodes through ``agent_pids``, ``master_pid`` and
``start_agent``. Every child is killed on the way out, including on Ctrl-C or
when the launcher itself fails, and at the end the run's recovery table is
printed and its figure drawn (``run.png``).

The agents fork their workers from one worker template this launcher starts
for all of them (``runtime.template.start_shared_template``): the simulated
nodes pay torch's imports once, not each on the cores the others train on. Each
agent leads a process group that its workers join, so a node's processes are
one group, as they are one machine on a cluster.

A run with joins to inject keeps one *standby* agent (``--node -``): started
ahead (its interpreter and imports done), it waits for a name on its stdin.
A join names it and it registers at once, as a node that had booted before it
joined would, instead of paying its start-up beside the survivors then; a new standby is started for the next join
while joins remain to be injected.
"""

from __future__ import annotations

import contextlib
import json
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

from oobleck_mm.lifetime import stop_tree
from oobleck_mm.master.run_dir import default_run_dir, make_run_dir, running_job
from oobleck_mm.config import dump_config
from oobleck_mm.errors import ExitCode
from oobleck_mm.events import EventLog, read_events
from oobleck_mm.emulation.speed import SPEED_DIR_ENV
from oobleck_mm.emulation.validity import HostCpu, judge
from oobleck_mm.faults.spec import hold_points
from oobleck_mm.runtime.hold import ENV as HOLD_ENV
from oobleck_mm.runtime.template import (
    SHARED_TEMPLATE,
    SHARED_TEMPLATE_ENV,
    TEMPLATE_JOB_ENV,
    start_shared_template,
    target_preload,
)

log = logging.getLogger(__name__)

MASTER_START_TIMEOUT_S = 120.0
"""Longest wait for the master process to listen (it checks every sample's files first: large
datasets take a while, and it says how far it got meanwhile)."""
MAX_MASTER_RESTARTS = 5
"""Master deaths in one run after which the launcher gives up (a master that keeps dying has a bug)."""
STANDBY_REARM_S = 5.0
"""Seconds after a join before the next standby agent starts: its imports then stay clear of the
join's switch (a standby of a 2-core machine takes ~3 s of CPU)."""


@dataclass(frozen=True, slots=True)
class LocalOptions:
    run_dir: str = ""
    event_log: str | None = None
    worker_target: str | None = None
    """Overrides the agents' worker entry point ("module:function"); for development."""
    worker_start: str = SHARED_TEMPLATE
    """``SHARED_TEMPLATE`` or one of the agents' ``--worker-start`` (agent.workers.WORKER_START_METHODS)."""
    resume_dir: str = ""
    save_final_dir: str = ""
    resume_command: str = "oobleck-launch local --config CONFIG"
    faults: Sequence = ()
    """``oobleck_mm.faults.FaultEvent`` values to inject (``--inject``, ``--trace``)."""
    report: bool = True
    """Print the recovery table at the end, and write ``run.png`` in the run dir if ``figure``."""
    figure: bool = True
    log_every: int = 1
    tensorboard: bool = True
    log_level: str = "info"
    """The agents' (and their workers') log level."""
    master_log_level: str = "warning"
    """The master's: the console shows its progress lines; details are in the event log."""


class LocalCluster:
    def __init__(self, job, options: LocalOptions, progress=print) -> None:
        self.job = job
        self.options = options
        self.run_dir = options.run_dir or default_run_dir(job.model.name)
        make_run_dir(self.run_dir)
        self.event_log_path = options.event_log or os.path.join(self.run_dir, "events.jsonl")
        self.token_file = os.path.join(self.run_dir, "token")
        # The job as resolved here (overrides applied, paths absolute): the master reads exactly it.
        self.job_file = os.path.join(self.run_dir, "job.yaml")
        # Owner-only, as the journal holding the same config is (issue 54 item 8): run dirs live on shared storage.
        with open(os.open(self.job_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w", encoding="utf-8") as fh:
            dump_config(job, fh)
        self.address = ""
        self.status_port: int | None = None
        """The master's live status page (``master/status.py``), once it listens."""
        self.master: subprocess.Popen | None = None
        self._master_lock = threading.Lock()  # the injector reads the master's pid
        self.master_restarts = 0
        self.agents: dict[str, tuple[subprocess.Popen, str]] = {}
        self._agents_lock = threading.Lock()  # the injector thread starts joining nodes
        self._standby: tuple[subprocess.Popen, str] | None = None
        """An agent started ahead for the next join (``--node -``), and its log; None: none now."""
        self._standbys = 0
        self._joins_left = sum(getattr(f, "kind", None) == "join" for f in options.faults)
        """Joins still to inject: a standby is kept only while one may come (each costs a template's imports)."""
        self._closing = False
        self._shared_template = ""
        """``SHARED_TEMPLATE_ENV``'s value for the agents; "" before it starts, or with ``spawn``."""
        self._signal: int | None = None
        self._stop_requested = False
        self.injector = None
        self.emulate_dir = os.path.join(self.run_dir, "emulate")
        """Where the injector writes an emulated node's speed factor (``runtime.emulated.SpeedFile``)."""
        self._host_cpu: HostCpu | None = None
        self.summary = ""
        self.message = ""
        """Why the launcher itself ended the run ("" when the master's exit says it)."""

    def run(self) -> int:
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            master_started = self._start_master_process(self._master_command())
            self._start_shared_template()  # its imports overlap the master's start-up
            code = self._wait_master_listening(master_started)
            if code is not None:
                return code
            print(
                f"master on {self.address} (pid {self.master.pid}); run dir {self.run_dir}; "
                f"event log {self.event_log_path}",
                flush=True,
            )
            if self.status_port:
                with open(self.token_file, encoding="utf-8") as fh:  # this console is the job owner's
                    print(f"status page: http://127.0.0.1:{self.status_port}/?token={fh.read().strip()}", flush=True)
            if self.job.cluster.emulate is not None:
                from oobleck_mm.emulation.truth import describe_emulation  # numpy: only an emulated run's

                self._host_cpu = HostCpu()
                print(describe_emulation(self.job), flush=True)
            for i in range(self.job.cluster.nodes):
                self.start_agent(f"node{i}")
            if self._joins_left:
                with self._agents_lock:
                    self._start_standby()
            self._start_injector()
            code = self._wait()
            if self.injector is not None:
                self.injector.stop(kill_stopped=True)  # hung nodes never exit by themselves
            self._wait_agents(self.job.fault_tolerance.agent_exit_timeout.total_seconds())
            return code
        finally:
            if self.injector is not None:
                self.injector.stop(kill_stopped=True)
            self._stop_standby()
            self._kill_agents()
            self._kill_master()
            for sig, handler in old.items():
                signal.signal(sig, handler)
            self._report()

    # ------------------------------------------------------------------ the master process
    def _master_command(self) -> list[str]:
        o = self.options
        cmd = [
            sys.executable,
            "-m",
            "oobleck_mm.cli",
            "master",
            "--config",
            self.job_file,
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--run-dir",
            self.run_dir,
            "--event-log",
            self.event_log_path,
            "--log-every",
            str(o.log_every),
            "--log-level",
            o.master_log_level,
            "--launched-by",
            o.resume_command,
        ]
        cmd += ["--resume", o.resume_dir] if o.resume_dir else []
        cmd += ["--save-final", o.save_final_dir] if o.save_final_dir else []
        return cmd + ([] if o.tensorboard else ["--no-tensorboard"])

    def _restart_command(self) -> list[str]:
        port = self.address.rpartition(":")[2]
        return [
            sys.executable,
            "-m",
            "oobleck_mm.cli",
            "master",
            "--resume-master",
            self.run_dir,
            "--port",
            port,
            "--event-log",
            self.event_log_path,
            "--log-every",
            str(self.options.log_every),
            "--log-level",
            self.options.master_log_level,
            "--launched-by",
            self.options.resume_command,
        ]

    def _start_master(self, cmd: list[str]) -> int | None:
        """Starts the master and waits until it listens (its ``master_started`` event); its exit code if
        it exits first (a bad input it names on stderr)."""
        return self._wait_master_listening(self._start_master_process(cmd))

    def _start_master_process(self, cmd: list[str]) -> int:
        """Starts the master; returns how many ``master_started`` events the log held before."""
        seen = len(read_events(self.event_log_path, "master_started")) if os.path.exists(self.event_log_path) else 0
        # Its stdout and stderr are this launcher's: the step lines and the final message are its.
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL)
        with self._master_lock:
            self.master = proc
        return seen

    def _wait_master_listening(self, seen: int) -> int | None:
        proc = self.master
        assert proc is not None  # (_start_master_process set it)
        deadline = time.monotonic() + MASTER_START_TIMEOUT_S
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                return proc.returncode if proc.returncode > 0 else ExitCode.ERROR
            if self._signal is not None:
                return self._interrupted_before_start()
            started = read_events(self.event_log_path, "master_started") if os.path.exists(self.event_log_path) else []
            if len(started) > seen:
                self.address = started[-1]["address"]
                self.status_port = started[-1].get("status_port")
                return None
            time.sleep(0.05)
        self.message = f"the master did not start listening within {MASTER_START_TIMEOUT_S:.0f} s"
        return ExitCode.ERROR

    def _interrupted_before_start(self) -> int:
        name = signal.Signals(self._signal).name
        self.message = f"interrupted by {name} before the job started"
        return ExitCode.ERROR

    def master_pid(self) -> int | None:
        with self._master_lock:
            return None if self.master is None else self.master.pid

    def _master_died(self, returncode: int) -> int | None:
        """The master was killed (a signal): restart it to re-adopt the running job; None once it runs."""
        name = signal.Signals(-returncode).name if -returncode in signal.Signals._value2member_map_ else str(returncode)
        if running_job(self.run_dir) is None:
            self.message = f"the master died ({name}) before it planned the job: nothing runs to re-adopt"
            return ExitCode.ERROR
        if self.master_restarts >= MAX_MASTER_RESTARTS:
            self.message = f"the master died ({name}) for the {self.master_restarts + 1}th time; giving up"
            return ExitCode.ERROR
        self.master_restarts += 1
        print(
            f"the master died ({name}); restarting it: it re-adopts the running agents, whose workers train on",
            flush=True,
        )
        return self._start_master(self._restart_command())

    def _kill_master(self) -> None:
        proc = self.master
        if proc is not None and proc.poll() is None:
            log.warning("master still running; stopping it")
            stop_tree(proc, grace_s=self.job.fault_tolerance.shutdown_grace.total_seconds() + 2.0)

    # ------------------------------------------------------------------ what the fault injector uses
    def start_agent(self, node: str) -> None:
        """Starts ``oobleck-launch agent`` for ``node`` (a new name: a joining node), the standby if one waits."""
        with self._agents_lock:
            if node in self.agents and self.agents[node][0].poll() is None:
                raise ValueError(f"node {node} is already running")
            log_path = os.path.join(self.run_dir, f"agent-{node}.log")
            standby, self._standby = self._standby, None
            proc = self._name_standby(standby, node, log_path) if standby is not None else None
            if proc is None:
                with open(log_path, "ab") as out:
                    proc = subprocess.Popen(
                        self._agent_command(node),
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                        env=self._agent_env(),
                        process_group=0,
                    )
            self.agents[node] = (proc, log_path)
            if self.injector is not None:  # a join
                self._joins_left -= 1
            if self._joins_left > 0 and self.injector is not None:
                # The next standby's imports would take CPU from this join's switch: start it later.
                rearm = threading.Timer(STANDBY_REARM_S, self._rearm_standby)
                rearm.daemon = True
                rearm.start()

    def _rearm_standby(self) -> None:
        with self._agents_lock:
            if self._standby is None and self._joins_left > 0 and not self._closing:
                self._start_standby()

    @staticmethod
    def _name_standby(standby: tuple[subprocess.Popen, str], node: str, log_path: str) -> subprocess.Popen | None:
        """Tells the standby its name; None if it is gone (a fresh agent is started instead)."""
        proc, standby_log = standby
        try:
            if proc.poll() is not None:
                return None
            proc.stdin.write(f"{node}\n".encode())
            proc.stdin.close()
        except OSError:  # it died meanwhile
            stop_tree(proc)
            return None
        os.rename(standby_log, log_path)  # it keeps writing to the same file
        return proc

    def _agent_command(self, node: str) -> list[str]:
        cmd = [
            sys.executable,
            "-m",
            "oobleck_mm.cli",
            "agent",
            "--master",
            self.address,
            "--node",
            node,
            "--gpus",
            str(self.job.cluster.gpus_per_node),
            "--token-file",
            self.token_file,
            "--log-level",
            self.options.log_level,
        ]
        if self.options.worker_target:
            cmd += ["--worker-target", self.options.worker_target]
        method = self.options.worker_start
        return cmd + ["--worker-start", "forkserver" if method == SHARED_TEMPLATE else method]

    def _agent_env(self) -> dict[str, str]:
        env = dict(os.environ)
        # One torch thread per simulated GPU unless the user chose otherwise: N workers share this CPU.
        env.setdefault("OMP_NUM_THREADS", "1")
        if holds := hold_points(self.options.faults):  # --inject kill:NODE@phase:copy: NODE's worker waits there
            env[HOLD_ENV] = ",".join(filter(None, (env.get(HOLD_ENV, ""), holds)))
        if self._shared_template:
            env[SHARED_TEMPLATE_ENV] = self._shared_template
        if self.job.cluster.emulate is not None:  # where a slowed node's speed factor is written (faults.slowdown)
            env[SPEED_DIR_ENV] = self.emulate_dir
        return env

    def _start_shared_template(self) -> None:
        """One warm worker template for every simulated node of this run (``template.start_shared_template``
        says why), with ``--worker-start shared``. The agents find it through their environment."""
        if self.options.worker_start != SHARED_TEMPLATE:
            return
        if offered := os.environ.get(SHARED_TEMPLATE_ENV):
            # A caller that starts many runs (a test suite, a notebook) keeps one template for all of them and
            # names it here: each run then skips the template's imports (~4.5 s of CPU on 2 cores). A worker
            # takes its agent's environment when it starts (agent.workers), not the template's.
            log.info("the agents fork their workers from the template in %s", SHARED_TEMPLATE_ENV)
            self._shared_template = offered
            return
        environ = {**self._agent_env(), TEMPLATE_JOB_ENV: self.job_file}  # the template's alone: not the agents'
        self._shared_template = start_shared_template(environ, target_preload(self.options.worker_target))

    def _start_standby(self) -> None:
        """An agent for the next join, started now (with ``_agents_lock`` held): ``--node -``."""
        self._standbys += 1
        log_path = os.path.join(self.run_dir, f"agent-standby{self._standbys}.log")
        with open(log_path, "ab") as out:
            proc = subprocess.Popen(
                self._agent_command("-"),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.PIPE,
                env=self._agent_env(),
                process_group=0,
            )
        self._standby = (proc, log_path)

    def _stop_standby(self) -> None:
        """An unused standby ends at the end of its input; its log goes with it."""
        with self._agents_lock:
            self._closing = True  # no standby is started after this
            standby, self._standby = self._standby, None
        if standby is None:
            return
        proc, log_path = standby
        try:
            proc.stdin.close()
            proc.wait(5.0)
        except (OSError, subprocess.TimeoutExpired):
            stop_tree(proc)
        if proc.returncode == 0:
            os.remove(log_path)

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

        # Its own writer on the master's event log: each record is one line appended in one write.
        self._injector_events = EventLog(self.event_log_path)
        self.injector = Injector(
            list(self.options.faults),
            event_log_path=self.event_log_path,
            events=self._injector_events,
            agents=self.agent_pids,
            start_agent=self.start_agent,
            master=self.master_pid,
            emulate_dir=self.emulate_dir if self.job.cluster.emulate is not None else None,
        )
        self.injector.start()

    def _wait(self) -> int:
        """The master's exit code (restarting it each time it is killed)."""
        planned = False
        while True:
            assert self.master is not None
            try:
                code = self.master.wait(0.2)
            except subprocess.TimeoutExpired:
                code = None
            if code is not None:
                if code >= 0:
                    return code
                restarted = self._master_died(code)
                if restarted is not None:
                    return restarted
                continue
            if self._signal is not None:
                self._forward_signal()
            if not planned:
                planned = bool(read_events(self.event_log_path, "plan_decided"))
            if not planned:
                with self._agents_lock:
                    agents = list(self.agents.items())
                for node, (proc, log_path) in agents:
                    # Before the plan a dead agent is never missed by the master: it would wait forever.
                    if proc.poll() is not None:
                        self.message = (
                            f"agent {node} exited with code {proc.returncode} before the job started; see {log_path}"
                        )
                        self.master.send_signal(signal.SIGINT)
                        self.master.wait()
                        return ExitCode.ERROR

    def _forward_signal(self) -> None:
        """SIGTERM (a scheduler's stop): the master writes the step and exits 3; again, or SIGINT: at once."""
        signum, self._signal = self._signal, None
        name = signal.Signals(signum).name
        if signum == signal.SIGTERM and not self._stop_requested:
            self._stop_requested = True
            print(f"{name}: stopping after a checkpoint of the current step ({name} again: at once)", flush=True)
        self.master.send_signal(signum)

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
                stop_tree(proc)
        # What is left of a node once its agent is gone is a leak: a hung node's workers (stopped by a fault,
        # they cannot see their agent die) or ones a test stopped. They are in their agent's process group but
        # not under it: forks of a worker template, which ends with this launcher only when it is its own
        # (a template named in SHARED_TEMPLATE_ENV outlives the run).
        groups = {proc.pid: node for node, (proc, _) in agents}  # each agent leads its group (process_group=0)
        left: dict[int, list[int]] = {}
        for p in psutil.process_iter(["pid", "status"]):
            with contextlib.suppress(psutil.Error, OSError):
                group = os.getpgid(p.pid)
                if group in groups and p.info["status"] != psutil.STATUS_ZOMBIE:
                    left.setdefault(group, []).append(p.pid)
        for group, pids in left.items():
            log.warning("node %s's processes %s outlived its agent; killing them", groups[group], pids)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(group, signal.SIGKILL)

    def _judge_emulation(self, events: list[dict]) -> None:
        """An emulated run says whether it measured the engine or the host (``emulation.validity``), on the
        console and in ``RUN_DIR/emulation.json``."""
        from oobleck_mm.emulation.truth import describe_emulation

        if self._host_cpu is None:
            return
        self._host_cpu.stop()
        steps = [e for e in events if e.get("event") == "step"]
        window = (steps[0]["ts"], steps[-1]["ts"]) if len(steps) > 1 else (None, None)
        verdict = judge(steps, self._host_cpu.share(*window))
        with open(os.path.join(self.run_dir, "emulation.json"), "w", encoding="utf-8") as fh:
            json.dump({**verdict.to_dict(), "emulation": describe_emulation(self.job)}, fh, indent=1)
        print(f"emulated {self.job.cluster.emulate}: {verdict.reason}", flush=True)

    def _report(self) -> None:
        if not os.path.exists(self.event_log_path):
            return
        events = read_events(self.event_log_path)  # once: a long run's log is tens of MB
        self._judge_emulation(events)
        if not self.options.report:
            return
        try:
            from oobleck_mm.faults.figure import plot_run
            from oobleck_mm.faults.report import format_table, recovery_rows

            self.summary = format_table(recovery_rows(events))
            print(self.summary, flush=True)
            if self.options.figure:  # matplotlib's import and the drawing: ~1 s of CPU on a 2-core machine
                plot_run(events, os.path.join(self.run_dir, "run.png"), f"{self.job.model.name}: {self.run_dir}")
        except Exception as exc:  # the report is a courtesy: never turn a finished job into a failure
            log.warning("could not summarise %s: %r", self.event_log_path, exc)

    def _on_signal(self, signum: int, frame) -> None:
        self._signal = signum
