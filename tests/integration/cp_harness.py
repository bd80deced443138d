"""Helpers of the control-plane integration tests: configs, real processes, waiting on events, cleanup.

Everything here runs for real: agents and masters are ``oobleck-launch``
subprocesses, workers are the runtime's ``worker_main``. ``Procs`` remembers
every process a test started (and the trees under them) so that teardown can
kill them and prove that none survived.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import psutil
import yaml

from master.server import MasterOptions, MasterServer
from oobleck_mm.config import apply_overrides
from oobleck_mm.config import load_config
from oobleck_mm.events import read_events

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny_mm.yaml"
INTERVAL_S, TIMEOUT_S = 0.2, 3.0  # as the e2e tests: 1 s timeouts declared starved healthy nodes lost on 2 busy cores
"""Heartbeats of the test configs: short, so that hung nodes are found fast."""


def write_config(tmp_path: Path, nodes: int = 2, steps: int = 3, **sections: dict[str, Any]) -> str:
    """The tiny model with test heartbeats, ``nodes`` and ``steps``; ``sections`` patch more fields."""
    raw = yaml.safe_load(TINY.read_text())
    raw["fault_tolerance"].update(heartbeat_interval=f"{INTERVAL_S}s", heartbeat_timeout=f"{TIMEOUT_S}s")
    raw["cluster"]["nodes"] = nodes
    raw["training"]["steps"] = steps
    for name, fields in sections.items():
        raw.setdefault(name, {}).update(fields)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def wait_for(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(0.02)


def wait_event(path: str | Path, event: str, timeout: float = 10.0, **match: Any) -> dict[str, Any]:
    """The first ``event`` in the log whose fields equal ``match``."""

    def find() -> dict[str, Any] | None:
        for e in read_events(path, event):
            if all(e.get(k) == v for k, v in match.items()):
                return e
        return None

    return wait_for(find, timeout, f"event {event} {match} in {path}")


def worker_pid(log_path: Path, local_rank: int = 0, timeout: float = 10.0) -> int:
    """The pid of a worker as its agent logged it when starting it."""
    pattern = re.compile(rf"started worker {local_rank} \(pid (\d+)\)")
    found = wait_for(lambda: pattern.search(log_path.read_text()), timeout, f"worker {local_rank} in {log_path}")
    return int(found.group(1))


def alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    """The processes still running (a zombie has finished: only its parent's bookkeeping is left)."""
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def assert_all_gone(procs: list[psutil.Process], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while alive(procs) and time.monotonic() < deadline:
        time.sleep(0.02)
    survivors = [(p.pid, p.name()) for p in alive(procs)]
    assert survivors == [], f"still running {timeout:g}s later: {survivors}"


def tree(pid: int) -> list[psutil.Process]:
    """The process and everything under it."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


class Procs:
    """Processes started by one test; ``cleanup`` kills them all and checks that none survived."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.started: list[subprocess.Popen] = []
        self.seen: list[psutil.Process] = []  # everything ever observed under them

    def spawn(self, args: list[str], log_name: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen, Path]:
        log_path = self.tmp_path / log_name
        with open(log_path, "ab") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "oobleck_mm.cli", *args], stdout=out, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, cwd=ROOT, env={**os.environ, **(env or {})},
            )  # fmt: skip
        self.started.append(proc)
        return proc, log_path

    def agent(self, address: str, node: str, token_file: str) -> tuple[subprocess.Popen, Path]:
        return self.spawn(["agent", "--master", address, "--node", node, "--token-file", token_file],
                          f"agent-{node}.log")  # fmt: skip

    def remember(self, pid: int) -> list[psutil.Process]:
        found = tree(pid)
        self.seen.extend(found)
        return found

    def cleanup(self) -> None:
        for proc in self.started:
            self.remember(proc.pid)
        for p in self.seen:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()  # also ends SIGSTOPped ones
        for proc in self.started:
            proc.wait(10)
        assert_all_gone(self.seen, 5)


@contextlib.contextmanager
def master_in_process(config: str, tmp_path: Path, **overrides: int) -> Iterator[MasterServer]:
    """A master in the test process (real gRPC and store), stopped on exit."""
    job = apply_overrides(load_config(config), **overrides)
    server = MasterServer(job, MasterOptions(port=0, run_dir=str(tmp_path / "run")), progress=lambda line: None)
    server.start()
    try:
        yield server
    finally:
        server.finish(1, "test over")
        server.stop()


def start_master_process(procs: Procs, config: str, tmp_path: Path, *extra: str) -> tuple[subprocess.Popen, str, Path, str]:
    """``oobleck-launch master`` as a subprocess: (process, address, event log, token file)."""
    run_dir = tmp_path / "run"
    proc, log_path = procs.spawn(["master", "--config", config, "--port", "0", "--run-dir", str(run_dir), *extra],
                                 "master.log")  # fmt: skip
    found = wait_for(lambda: re.search(r"master listening on (\S+) ", log_path.read_text()), 20, "the master")
    return proc, found.group(1), run_dir / "events.jsonl", str(run_dir / "token")


def send(proc: subprocess.Popen, sig: signal.Signals) -> float:
    """Sends ``sig`` and returns the wall-clock time (the event log's clock)."""
    now = time.time()
    os.kill(proc.pid, sig)
    return now
