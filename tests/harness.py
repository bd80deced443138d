"""The one harness of the tests that start processes (tests/e2e, tests/integration).

- configs: the tiny model with short test heartbeats (``write_config``);
- ``Launch``: ``oobleck-launch local`` in a subprocess whose process tree is
  snapshotted while it runs, so a test can prove that every process it caused
  (master helpers, agents, workers, joiners, restarted workers) is gone; faults
  from ``--inject`` or, when the target depends on the plan, from the same
  ``oobleck_mm.faults`` injector driven by the test;
- ``Procs``: single agents and masters started by a control-plane test, killed
  and checked at teardown; a master in the test process (``master_in_process``);
- the oracle: the single-process reference trainer (float64, computed once per
  training config and step count), and the in-process resume of a written
  checkpoint (``assert_resume_equals_reference``).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import psutil
import yaml

from oobleck_mm.config import apply_overrides, load_config
from oobleck_mm.events import EventLog, read_events

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny_mm.yaml"
INTERVAL, TIMEOUT = "200ms", "3s"
INTERVAL_S, TIMEOUT_S = 0.2, 3.0
"""Short heartbeats; the timeout leaves room for a 2-core machine where five workers start at once
(importing torch) next to other test runs: 1-2 s timeouts declared healthy nodes lost there."""
STEP_PACE_S = 0.2
PACE = f"pace:{STEP_PACE_S:g}"
"""An ``OOBLECK_HOLD_AT`` entry (``runtime/hold.py``) for a test whose job must still be training when something
slow happens (a join, a detection, a held journal): its workers start steps at least ``STEP_PACE_S`` apart, so
N steps span N * STEP_PACE_S seconds on any host, and the test's step count is set by the wall time it needs
instead of by the fastest host's steps (each trained, and replayed by the reference, for nothing after)."""
SMALL_GPU = 8_000_000
"""Bytes of device memory that make the float64 tiny model need n0 = 2 nodes: pipelines span nodes."""


def write_config(tmp_path: Path, nodes: int, steps: int = 8, memory: int | None = None, **sections) -> str:
    raw = yaml.safe_load(TINY.read_text())
    raw["training"].update(dtype="float64", steps=steps)
    # No straggler detection: these scenarios assert the generations their faults cause, and under a loaded
    # CI a node 1.5x slower than the others for 8 steps is a straggler (a re-split is a generation more;
    # seen in CI). tests/e2e/test_slow_node.py turns it on.
    raw["fault_tolerance"].update(heartbeat_interval=INTERVAL, heartbeat_timeout=TIMEOUT, straggler_factor=0)
    raw["cluster"]["nodes"] = nodes
    if memory is not None:
        raw["cluster"]["device_memory"] = memory
    for name, fields in sections.items():
        raw.setdefault(name, {}).update(fields)
    path = tmp_path / f"job-{nodes}n-{steps}s.yaml"
    path.write_text(yaml.dump(raw, Dumper=getattr(yaml, "CSafeDumper", yaml.SafeDumper)))  # libyaml: 6 MiB configs
    return str(path)


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(0.02)


def tree(pid: int) -> list[psutil.Process]:
    """``pid`` (first) and every process below it, alive now."""
    found = []
    for each in descendants([pid], parents()):
        with contextlib.suppress(psutil.NoSuchProcess):
            found.append(psutil.Process(each))
    return found


def process_table() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, start time in clock ticks since boot) of every process on the machine, in one pass
    over ``/proc``. Written here because psutil's only public way (``children(recursive=True)``,
    ``process_iter``) makes such a pass per call and per root: a launch's watcher asked for several each 50 ms
    poll, ~2.5 ms each with two tests' processes running, and spent 8 of a 36 s e2e test's CPU-seconds there
    (py-spy) on a suite that is CPU-bound. The start time tells a process from a later one under its reused pid
    without another read per process (``psutil.Process.is_running`` reads its ``stat`` again)."""
    found = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/stat", "rb") as f:
                    stat = f.read()
            except OSError:  # ended meanwhile
                continue
            # "pid (comm) state ppid ... starttime ...": comm may hold spaces and parentheses, so split after its
            # last ")"; starttime is the stat's 22nd field, the 20th after comm
            fields = stat[stat.rindex(b")") + 2 :].split(maxsplit=20)
            found[int(entry.name)] = (int(fields[1]), int(fields[19]))
    return found


def parents() -> dict[int, int]:
    """pid -> parent pid of every process on the machine (``process_table``)."""
    return {pid: ppid for pid, (ppid, _) in process_table().items()}


def descendants(roots: list[int], parent_of: dict[int, int]) -> list[int]:
    """``roots`` that are alive and every process below them, from one ``parents()`` snapshot."""
    children: dict[int, list[int]] = {}
    for pid, ppid in parent_of.items():
        children.setdefault(ppid, []).append(pid)
    out, todo = [], [pid for pid in roots if pid in parent_of]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, ()))
    return out


def alive(procs) -> list[psutil.Process]:
    out = []
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
    return out


def suite_template() -> tuple[str, int]:
    """This test process's warm worker template (``runtime.template``), offered to the launches it starts
    (``SHARED_TEMPLATE_ENV``): its address and its pid. The one ``run_local`` forks its ranks from: each
    launch then skips a template's imports of its own (~4.5 s of CPU, a third of a short launch's). Started
    again should it have died (``ensure_running``)."""
    from oobleck_mm.runtime.template import start_shared_template, template_pid

    # As ``local`` starts its own: one torch thread per simulated GPU (the workers set it from their agent's
    # environment in any case).
    address = start_shared_template({**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
    return address, template_pid()


class TemplateForks:
    """The suite's template (``suite_template``, started if need be) and what it had forked before a run
    started: the run's workers are the children it forks after (``Launch``'s and ``Procs``' agents)."""

    def __init__(self) -> None:
        self.address, self.pid = suite_template()
        self.before = {p.pid for p in psutil.Process(self.pid).children()}

    def forked(self, parent_of: dict[int, int] | None = None) -> list[int]:
        """Its children that were not there at the start, from ``parent_of`` (a ``parents()`` snapshot) or a
        fresh pass."""
        parent_of = parents() if parent_of is None else parent_of
        return [pid for pid, ppid in parent_of.items() if ppid == self.pid and pid not in self.before]


WORKER_STARTED = re.compile(r"started worker (\d+) \(pid (\d+)\)")
"""An agent's log line for each worker it starts: local rank, pid."""


class Launch:
    """``oobleck-launch local`` in a subprocess; every process ever under it is remembered.

    Its agents fork their workers from this test process's template (``suite_template``) unless
    ``own_template``: those workers are remembered as the template's children that appeared during the run."""

    def __init__(
        self,
        tmp_path: Path,
        config: str,
        *args: str,
        name: str = "run",
        own_template: bool = False,
        figure: bool = False,
    ) -> None:
        self.run_dir = tmp_path / name
        self.events_path = self.run_dir / "events.jsonl"
        cmd = [
            sys.executable,
            "-m",
            "oobleck_mm.cli",
            "local",
            "--config",
            config,
            "--run-dir",
            str(self.run_dir),
            *args,
            # run.png costs ~1 CPU-s a launch (matplotlib), on a suite that is CPU-bound; test_main_job checks it
            *([] if figure else ["--no-figure"]),
        ]
        env = dict(os.environ)
        self._template: TemplateForks | None = None
        if not own_template:
            from oobleck_mm.runtime.template import SHARED_TEMPLATE_ENV

            self._template = TemplateForks()
            env[SHARED_TEMPLATE_ENV] = self._template.address
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.seen: dict[int, psutil.Process] = {}
        self._started: dict[int, int] = {}
        """pid -> start time (``process_table``) of the process ``seen`` holds under it."""
        self.commands: dict[int, list[str]] = {}
        """pid -> command line, read when the watcher first saw it (it may be gone when asked)."""
        self.stdout = self.stderr = ""
        self._watch = threading.Thread(target=self._watch_tree, daemon=True)
        self._watch.start()

    def _processes(self) -> list[psutil.Process]:
        """The launcher's tree, and the workers the suite's template forked for it (with their children)."""
        return [p for p, _ in self._scan()]

    def _scan(self) -> list[tuple[psutil.Process, int]]:
        """``_processes`` with each one's start time, from one ``process_table``: a process ``seen`` already
        (same pid, same start) is not read again."""
        table = process_table()
        parent_of = {pid: ppid for pid, (ppid, _) in table.items()}
        roots = [self.proc.pid]
        if self._template is not None:
            roots += self._template.forked(parent_of)
        found = []
        for pid in descendants(roots, parent_of):
            started = table[pid][1]
            known = self.seen.get(pid)
            if known is not None and self._started.get(pid) == started:  # the same process, not a reused pid
                found.append((known, started))
                continue
            with contextlib.suppress(psutil.Error):
                found.append((psutil.Process(pid), started))
        return found

    def _watch_tree(self) -> None:
        while self.proc.poll() is None:
            for p, started in self._scan():
                if self.seen.get(p.pid) is not p:  # new, or a new process under a reused pid
                    self.seen[p.pid], self._started[p.pid] = p, started
                    with contextlib.suppress(psutil.Error):
                        self.commands[p.pid] = p.cmdline()
            # A process that lives under 0.1 s unseen cannot outlive the run; one reparented away from the tree
            # within it would (none of the engine's daemonises).
            time.sleep(0.1)

    def wait(self, timeout: float = 80.0) -> int:
        try:
            self.stdout, self.stderr = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill_all()
            self.stdout, self.stderr = self.proc.communicate()
            raise AssertionError(
                f"the launcher ran past {timeout:g}s:\n{self.stdout[-3000:]}\n{self.stderr[-3000:]}"
            ) from None
        self._watch.join(1)
        return self.proc.returncode

    def stop_when(self, done, what: str, timeout: float = 150.0) -> int:
        """SIGTERM to the launcher (the job checkpoints the step it is at and exits 3) once ``done()`` says the
        scenario played out: the steps after it would train, and be replayed by the reference, for nothing
        (a test's step count is set for a loaded host). Returns the launcher's exit code."""
        wait_for(done, timeout, what)
        self.proc.send_signal(signal.SIGTERM)
        return self.wait(timeout=120)

    def events(self, name: str | None = None, **match: Any) -> list[dict[str, Any]]:
        return [e for e in read_events(self.events_path, name) if all(e.get(k) == v for k, v in match.items())]

    def wait_event(self, name: str, timeout: float = 60.0, **match: Any) -> dict[str, Any]:
        return wait_for(lambda: next(iter(self.events(name, **match)), None), timeout, f"event {name} {match}")

    def started_below_the_master(self) -> list[str]:
        """Command lines of what the run started besides the launcher and its master process (agents,
        workers, the master's planning helper): empty when the master refused the job at once."""
        # A child caught between fork and exec still shows the launcher's command line: not a start.
        return [
            " ".join(cmd)[:120]
            for pid, cmd in self.commands.items()
            if pid != self.proc.pid
            and cmd[1:3] == ["-m", "oobleck_mm.cli"]
            and cmd[3:4] != ["master"]
            and cmd[3:4] != ["local"]
            or "spawn_main" in " ".join(cmd)
        ]

    def kill_all(self) -> None:
        for p in [*self._processes(), *self.seen.values()]:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()

    def assert_all_gone(self, timeout: float = 5.0) -> None:
        """Every process the run started has ended (the launcher itself has exited)."""
        assert len(self.seen) > 1, "the watcher saw no process under the launcher"
        deadline = time.monotonic() + timeout
        while alive(self.seen.values()) and time.monotonic() < deadline:
            time.sleep(0.05)
        left = [(p.pid, " ".join(p.cmdline())[:100]) for p in alive(self.seen.values())]
        self.kill_all()
        assert left == [], f"still running after the launcher exited: {left}"

    # ------------------------------------------------------------------ faults chosen at run time
    def agent_pids(self) -> dict[str, int]:
        return {e["node"]: e["pid"] for e in self.events("registered")}

    def inject(self, kind: str, node: str, local_rank: int = 0) -> dict[str, Any]:
        """Fires one fault now with the launcher's own injector (its record goes to the same event log)."""
        from oobleck_mm.faults.injector import Injector
        from oobleck_mm.faults.spec import FaultEvent

        fault = FaultEvent(kind=kind, node=node, step=0, local_rank=local_rank, source=f"test {kind}:{node}")
        log = EventLog(self.events_path)
        try:
            injector = Injector(
                [], event_log_path=self.events_path, events=log, agents=self.agent_pids, start_agent=lambda name: None
            )
            [record] = injector.fire([fault])
        finally:
            log.close()
        assert record["event"] == "injected", record
        return record

    def wait_steps(self, count: int, timeout: float = 60.0) -> None:
        wait_for(lambda: any(e["step"] >= count - 1 for e in self.events("step")), timeout, f"{count} steps")


def position_nodes(plan_event: dict[str, Any]) -> list[list[str]]:
    """Node names per pipeline, stage by stage, from a ``plan_decided`` event (one GPU per node)."""
    nodes = plan_event["nodes"]  # in rank order: node i runs rank i with one GPU per node
    return [[nodes[rank] for rank, _, _ in p["stages"]] for p in plan_event["layout"]["pipelines"]]


def kill_node1_of_the_deeper_pipeline(launches: list, tmp_path: Path, config: str, final: Path) -> Launch:
    """``local`` on a 3+2-stage plan with node1 killed at step 4, saving the final states; checks it
    ended well, left no process, lost exactly node1, and kept every replica identical."""
    run = Launch(tmp_path, config, "--save-final", str(final), "--inject", "kill:node1@step4")
    launches.append(run)
    code = run.wait(timeout=150)
    assert code == 0, f"exit {code}\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    run.assert_all_gone()
    assert "generation 1: 2 pipelines (stages 3,2;" in run.stdout, run.stdout[:2000]
    assert [e["node"] for e in run.events("lost")] == ["node1"]
    assert_replicas_identical(final)
    return run


# ---------------------------------------------------------------------- agents and masters one by one
def wait_event(path: str | Path, event: str, timeout: float = 10.0, **match: Any) -> dict[str, Any]:
    """The first ``event`` in the log whose fields equal ``match``."""

    def find() -> dict[str, Any] | None:
        for e in read_events(path, event):
            if all(e.get(k) == v for k, v in match.items()):
                return e
        return None

    return wait_for(find, timeout, f"event {event} {match} in {path}")


def worker_pid(log_path: Path, local_rank: int = 0, timeout: float = 60.0) -> int:
    """The pid of a worker as its agent logged it when starting it."""

    def pids() -> list[str]:
        return [pid for rank, pid in WORKER_STARTED.findall(log_path.read_text()) if int(rank) == local_rank]

    return int(wait_for(pids, timeout, f"worker {local_rank} in {log_path}")[0])


def assert_all_gone(procs: list[psutil.Process], timeout: float) -> None:
    """Every process in ``procs`` has ended within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while alive(procs) and time.monotonic() < deadline:
        time.sleep(0.02)
    survivors = [(p.pid, p.name()) for p in alive(procs)]
    assert survivors == [], f"still running {timeout:g}s later: {survivors}"


class Procs:
    """Processes started by one test; ``cleanup`` kills them all and checks that none survived.

    Its agents fork their workers from this test process's template (``suite_template``), as ``Launch``'s do,
    unless started in a network namespace (a fork of the template would be in the test's) or with
    ``own_template``: a template per agent, as on a cluster, is ~5 CPU-s of imports each, most of a short
    control-plane test's CPU on a suite that is CPU-bound. Those agents' workers are remembered from their logs
    (``remember``), and at ``cleanup`` with every other process the template forked meanwhile."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.started: list[subprocess.Popen] = []
        self.seen: list[psutil.Process] = []  # everything ever observed under them
        self._logs: dict[int, Path] = {}
        """Agent pid -> its log, for agents that fork their workers from the suite's template."""
        self._template: TemplateForks | None = None

    def spawn(
        self, args: list[str], log_name: str, env: dict[str, str] | None = None, wrap=lambda argv: argv
    ) -> tuple[subprocess.Popen, Path]:
        """``oobleck-launch ARGS`` logging to ``log_name``; ``wrap`` may run it elsewhere (a network namespace:
        ``tests/network.py``) as long as the pid stays the CLI's own."""
        log_path = self.tmp_path / log_name
        with open(log_path, "ab") as out:
            proc = subprocess.Popen(
                wrap([sys.executable, "-m", "oobleck_mm.cli", *args]),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=ROOT,
                env={**os.environ, **(env or {})},
            )
        self.started.append(proc)
        return proc, log_path

    def agent(
        self,
        address: str,
        node: str,
        token_file: str,
        network=None,
        extra: tuple[str, ...] = (),
        own_template: bool = False,
    ) -> tuple[subprocess.Popen, Path]:
        """An agent (``extra``: more of its flags); with ``network`` (a ``tests/network.Network``) in ``node``'s
        namespace, with a worker template of its own."""
        args = ["agent", "--master", address, "--node", node, "--token-file", token_file, *extra]
        if network is not None:
            return self.spawn(
                args, f"agent-{node}.log", env=network.env(), wrap=lambda argv: network.command(node, argv)
            )
        if own_template:
            return self.spawn(args, f"agent-{node}.log")
        from oobleck_mm.runtime.template import SHARED_TEMPLATE_ENV

        if self._template is None:
            self._template = TemplateForks()
        proc, log = self.spawn(args, f"agent-{node}.log", env={SHARED_TEMPLATE_ENV: self._template.address})
        self._logs[proc.pid] = log
        return proc, log

    def remember(self, pid: int) -> list[psutil.Process]:
        """``pid``'s processes, alive now: its tree, and for an agent whose workers the suite's template forks,
        the workers its log names so far (and theirs)."""
        found = tree(pid)
        if pid in self._logs:
            text = self._logs[pid].read_text()
            for _, worker in WORKER_STARTED.findall(text):
                found += tree(int(worker))
        self.seen.extend(found)
        return found

    def cleanup(self) -> None:
        for proc in self.started:
            self.remember(proc.pid)
        if self._template is not None:  # what it forked during the test: the agents' workers
            for pid in self._template.forked():
                self.remember(pid)
        for p in self.seen:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()  # also ends SIGSTOPped ones
        for proc in self.started:
            proc.wait(10)
        assert_all_gone(self.seen, 5)


@contextlib.contextmanager
def master_in_process(config: str, tmp_path: Path, **overrides: int) -> Iterator[Any]:
    """A master in the test process (real gRPC and store, a ``oobleck_mm.master.server.MasterServer``), stopped on exit."""
    from oobleck_mm.master.server import MasterOptions, MasterServer

    job = apply_overrides(load_config(config), **overrides)
    server = MasterServer(job, MasterOptions(port=0, run_dir=str(tmp_path / "run")), progress=lambda line: None)
    server.start()
    try:
        yield server
    finally:
        server.finish(1, "test over")
        server.stop()


def start_master_process(
    procs: Procs, config: str, tmp_path: Path, *extra: str
) -> tuple[subprocess.Popen, str, Path, str]:
    """``oobleck-launch master`` as a subprocess: (process, address, event log, token file)."""
    run_dir = tmp_path / "run"
    proc, log_path = procs.spawn(
        ["master", "--config", config, "--port", "0", "--run-dir", str(run_dir), *extra], "master.log"
    )
    found = wait_for(lambda: re.search(r"master listening on (\S+) ", log_path.read_text()), 20, "the master")
    return proc, found.group(1), run_dir / "events.jsonl", str(run_dir / "token")


def send(proc: subprocess.Popen, sig: signal.Signals) -> float:
    """Sends ``sig`` and returns the wall-clock time (the event log's clock)."""
    now = time.time()
    os.kill(proc.pid, sig)
    return now


# ---------------------------------------------------------------------- the oracle
_REFERENCES: dict[tuple[str, int], dict[str, dict]] = {}

REFERENCE_CACHE_ENV = "OOBLECK_TEST_REFERENCE_CACHE"
"""A folder the suite's processes share (``tests/conftest.py`` makes one per run, removed at its end): the
reference trainer's whole state (layers, Adam moments, loss scale) at each step count it was asked for."""
_CACHE_MAX_BYTES = 64 * 2**20
"""States larger than this are not written (the tiny models' are ~6 MB)."""


def _trainer(config: str):
    import torch

    from oobleck_mm.runtime.reference import ReferenceTrainer

    torch.set_num_threads(1)  # the tiny model gains nothing from threads, and OpenMP spins on a busy machine
    return ReferenceTrainer(load_config(config))


def _trained_states(config: str, steps: int, checkpoint: str | Path | None = None) -> tuple[dict[str, dict], int]:
    """Layer name -> parameters of the reference trainer after ``steps``, from step 0 or resumed from
    ``checkpoint`` (parameters, Adam moments, loss scale, its step); and the step it started from."""
    import torch

    threads = torch.get_num_threads()
    try:
        trainer = _trainer(config)
        start = 0 if checkpoint is None else trainer.load_checkpoint(str(checkpoint))
        for _ in trainer.train(steps - start, start_step=start):
            pass
        return _layer_states(trainer), start
    finally:
        torch.set_num_threads(threads)


def _trajectory_key(config: str) -> str:
    """What the reference's parameters after step ``s`` depend on besides ``s``: the model, the data and the
    training section, less ``training.steps`` (a step's samples and lr are functions of the step) unless a
    learning-rate schedule spans the run; and an injected overflow."""
    from oobleck_mm.runtime.mixed import OVERFLOW_ENV

    raw = yaml.safe_load(Path(config).read_text())
    training = dict(raw.get("training") or {})
    if not training.get("scheduler"):
        training.pop("steps", None)
    return json.dumps(
        {
            "model": raw.get("model"),
            "data": raw.get("data"),
            "training": training,
            "overflow": os.environ.get(OVERFLOW_ENV),
        },
        sort_keys=True,
    )


def _layer_states(trainer) -> dict[str, dict]:
    return {spec.name: trainer.layer_state(i) for i, spec in enumerate(trainer.specs)}


def _cached_reference(config: str, key: str, steps: int) -> dict[str, dict]:
    """The reference after ``steps``, trained on from the longest trajectory of the same job any test of this
    run already trained (``REFERENCE_CACHE_ENV``) no further than ``steps``: the e2e tests ask for 8 to 330
    steps of the same float64 tiny job, ~0.16 s of CPU a step, and each trained from step 0. The same
    arithmetic from the same state on one thread: bit for bit what training from 0 gives
    (``tests/unit/test_reference_cache.py``)."""
    import hashlib

    import torch

    folder = os.environ.get(REFERENCE_CACHE_ENV)
    if not folder:
        return _trained_states(config, steps)[0]
    cache = Path(folder) / hashlib.sha256(key.encode()).hexdigest()[:24]
    cache.mkdir(parents=True, exist_ok=True)
    done = sorted((int(f.stem), f) for f in cache.glob("*.pt") if f.stem.isdigit() and int(f.stem) <= steps)
    threads = torch.get_num_threads()
    try:
        trainer = _trainer(config)
        start = 0
        for at, path in reversed(done):
            try:
                saved = torch.load(path, weights_only=False)
            except Exception:  # noqa: BLE001 - a file another process is still renaming into place: the next one
                continue
            for i, layer in enumerate(trainer.layers):
                layer.load_state_dict(saved["layers"][i])
            for i, optimizer in trainer.optimizers.items():
                optimizer.load_state_dict(saved["optimizers"][i])
            if trainer.scaler is not None:
                trainer.scaler.load_state_dict(saved["scaler"])
            if trainer.mixed is not None:
                trainer.mixed.sync()
            start = at
            break
        for _ in trainer.train(steps - start, start_step=start):
            pass
        if start != steps:
            state = {
                "layers": [layer.state_dict() for layer in trainer.layers],
                "optimizers": {i: o.state_dict() for i, o in trainer.optimizers.items()},
                "scaler": trainer.scaler.state_dict() if trainer.scaler is not None else None,
            }
            size = sum(t.numel() * t.element_size() for t in trainer.layers.parameters()) * 3
            if size <= _CACHE_MAX_BYTES:
                tmp = cache / f".{steps}.{os.getpid()}.tmp"
                torch.save(state, tmp)
                os.replace(tmp, cache / f"{steps}.pt")  # whole or absent to a reader
        return _layer_states(trainer)
    finally:
        torch.set_num_threads(threads)


def reference_state(config: str, steps: int) -> dict[str, dict]:
    """Layer name -> parameters after ``steps`` reference steps (cached across tests: only the cluster differs)."""
    key = (_trajectory_key(config), steps)
    if key not in _REFERENCES:
        _REFERENCES[key] = _cached_reference(config, key[0], steps)
    return _REFERENCES[key]


def max_param_diff(config: str, steps: int, directory: Path) -> tuple[float, str]:
    from oobleck_mm.runtime.checkpoint import load_params
    from oobleck_mm.runtime.checkpoint_meta import read_meta

    assert read_meta(directory)["step"] == steps
    worst, where = 0.0, ""
    for name, ref in reference_state(config, steps).items():
        saved = load_params(directory, name)
        for key, value in ref.items():
            diff = (saved[key].to(value.dtype) - value).abs().max().item()
            if diff >= worst:
                worst, where = diff, f"{name}.{key}"
    return worst, where


def assert_matches_reference(config: str, steps: int, directory: Path, tolerance: float = 1e-9) -> None:
    worst, where = max_param_diff(config, steps, directory)
    assert worst <= tolerance, f"largest parameter difference {worst:.3e} at {where}"


def assert_windows_match_reference(config: str, windows: list[tuple[str | None, str, int]]) -> None:
    """``verify.checkpoint_windows``'s judgement, from the shared reference cache: the end of every window (a
    checkpoint of the run's, or its final save) equals the uninterrupted reference at its step. Equal to
    ``compare_windows`` for a run short enough that float64 drift stays under 1e-9 from step 0 (~190 tiny_mm
    steps): each end is judged from the start, not from the window's own start, and costs no replay once
    another test of the same trajectory trained that far."""
    for _, end, step in windows:
        assert_matches_reference(config, step, Path(end))


def assert_resume_equals_reference(config: str, steps: int, checkpoint: str | Path, tolerance: float = 1e-9) -> int:
    """The written checkpoint resumed in this process: the reference trainer loads it (parameters, Adam
    moments, loss scale, its step) and trains on to ``steps``; every parameter must equal the
    uninterrupted reference's. That is what a second launch resuming from it proved about the checkpoint,
    without a second cluster; the launcher's own resume path keeps its launches (the resume on another
    node count in test_recovery.py, the float32 resume in test_verify.py). Returns the checkpoint's step."""
    resumed, start = _trained_states(config, steps, checkpoint)
    for name, ref in reference_state(config, steps).items():
        for key, value in ref.items():
            diff = (resumed[name][key] - value).abs().max().item()
            assert diff <= tolerance, f"resumed from {checkpoint} (step {start}): {name}.{key} off by {diff:.3e}"
    return start


def windows_with_switches(windows: list[tuple[str | None, str, int]], events: str | Path) -> list:
    """The ``verify.checkpoint_windows`` a generation switch trained in, and the last one.

    A window from the run's own checkpoint of step ``a`` to the one of step ``b`` replays steps ``a..b-1``;
    a generation that resumed at step ``s`` (a loss, a join, a leave, a re-split: its copies, its new
    split) is judged by the window with ``a <= s < b``. The windows between switches replay what one
    generation trained without a fault, as the failure-free tests do already, and each costs the reference
    trainer ~75 ms a step on one core: a test whose run must be long enough for its faults to happen under
    load compares where they happened."""
    from oobleck_mm.runtime.checkpoint_meta import read_meta

    switched = {int(e["step"]) for e in read_events(events, "resumed")}
    kept = []
    for i, (start, end, step) in enumerate(windows):
        first = int(read_meta(start)["step"]) if start else 0
        if i >= len(windows) - 2 or any(first <= s < step for s in switched):
            kept.append((start, end, step))
    return kept


def assert_replicas_identical(directory: Path) -> None:
    """Every replica of every layer hashed the same (``replicas/rank{r}.json`` of ``--save-final``)."""
    files = sorted((directory / "replicas").glob("rank*.json"))
    assert files, f"no replica hashes in {directory}"
    by_layer: dict[str, set[str]] = {}
    for f in files:
        for layer, digest in json.loads(f.read_text()).items():
            by_layer.setdefault(layer, set()).add(digest)
    meta = json.loads((directory / "meta.json").read_text())
    assert sorted(by_layer) == sorted(meta["layer_names"])
    differing = {layer: len(d) for layer, d in by_layer.items() if len(d) != 1}
    assert differing == {}, f"replicas differ: {differing}"
