"""Helpers of the end-to-end recovery tests: configs, a watched ``oobleck-launch local``, faults, the oracle.

``Launch`` runs the real launcher in a subprocess and snapshots its process
tree while it runs, so a test can prove that every process it caused (master
helpers, agents, workers, joiners, restarted workers) is gone at the end.
Faults come from ``--inject`` or, when the target depends on the plan (a node
at a given pipeline position), from the same ``oobleck_mm.faults`` injector
driven by this process. Results are checked against the single-process
reference trainer (float64, computed once per training config and step count).
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import yaml

from oobleck_mm.config import load_config
from oobleck_mm.events import EventLog, read_events

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny_mm.yaml"
INTERVAL, TIMEOUT = "200ms", "3s"
TIMEOUT_S = 3.0
"""Short heartbeats; the timeout leaves room for a 2-core machine where five workers start at once
(importing torch) next to other test runs: 1-2 s timeouts declared healthy nodes lost there."""
SMALL_GPU = 8_000_000
"""Bytes of device memory that make the float64 tiny model need n0 = 2 nodes: pipelines span nodes."""


def write_config(tmp_path: Path, nodes: int, steps: int = 8, memory: int | None = None, **sections) -> str:
    raw = yaml.safe_load(TINY.read_text())
    raw["training"].update(dtype="float64", steps=steps)
    raw["fault_tolerance"].update(heartbeat_interval=INTERVAL, heartbeat_timeout=TIMEOUT)
    raw["cluster"]["nodes"] = nodes
    if memory is not None:
        raw["cluster"]["device_memory"] = memory
    for name, fields in sections.items():
        raw.setdefault(name, {}).update(fields)
    path = tmp_path / f"job-{nodes}n-{steps}s.yaml"
    path.write_text(yaml.safe_dump(raw))
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


def _tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _alive(procs) -> list[psutil.Process]:
    out = []
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
    return out


class Launch:
    """``oobleck-launch local`` in a subprocess; every process ever under it is remembered."""

    def __init__(self, tmp_path: Path, config: str, *args: str, name: str = "run") -> None:
        self.run_dir = tmp_path / name
        self.events_path = self.run_dir / "events.jsonl"
        cmd = [sys.executable, "-m", "oobleck_mm.cli", "local", "--config", config, "--run-dir", str(self.run_dir),
               *args]  # fmt: skip
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.seen: dict[int, psutil.Process] = {}
        self.commands: dict[int, list[str]] = {}
        """pid -> command line, read when the watcher first saw it (it may be gone when asked)."""
        self.stdout = self.stderr = ""
        self._watch = threading.Thread(target=self._watch_tree, daemon=True)
        self._watch.start()

    def _watch_tree(self) -> None:
        while self.proc.poll() is None:
            for p in _tree(self.proc.pid):
                if p.pid not in self.seen:
                    self.seen[p.pid] = p
                    with contextlib.suppress(psutil.Error):
                        self.commands[p.pid] = p.cmdline()
            time.sleep(0.05)

    def wait(self, timeout: float = 80.0) -> int:
        try:
            self.stdout, self.stderr = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill_all()
            self.stdout, self.stderr = self.proc.communicate()
            raise AssertionError(f"the launcher ran past {timeout:g}s:\n{self.stdout[-3000:]}\n{self.stderr[-3000:]}")
        self._watch.join(1)
        return self.proc.returncode

    def events(self, name: str | None = None, **match: Any) -> list[dict[str, Any]]:
        return [e for e in read_events(self.events_path, name) if all(e.get(k) == v for k, v in match.items())]

    def wait_event(self, name: str, timeout: float = 60.0, **match: Any) -> dict[str, Any]:
        return wait_for(lambda: next(iter(self.events(name, **match)), None), timeout, f"event {name} {match}")

    def started_below_the_master(self) -> list[str]:
        """Command lines of what the run started besides the launcher and its master process (agents,
        workers, the master's planning helper): empty when the master refused the job at once."""
        # A child caught between fork and exec still shows the launcher's command line: not a start.
        return [" ".join(cmd)[:120] for pid, cmd in self.commands.items()
                if pid != self.proc.pid and cmd[1:3] == ["-m", "oobleck_mm.cli"] and cmd[3:4] != ["master"]
                and cmd[3:4] != ["local"] or "spawn_main" in " ".join(cmd)]  # fmt: skip

    def kill_all(self) -> None:
        for p in [*_tree(self.proc.pid), *self.seen.values()]:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()

    def assert_all_gone(self, timeout: float = 5.0) -> None:
        """Every process the run started has ended (the launcher itself has exited)."""
        assert len(self.seen) > 1, "the watcher saw no process under the launcher"
        deadline = time.monotonic() + timeout
        while _alive(self.seen.values()) and time.monotonic() < deadline:
            time.sleep(0.05)
        left = [(p.pid, " ".join(p.cmdline())[:100]) for p in _alive(self.seen.values())]
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
            injector = Injector([], event_log_path=self.events_path, events=log, agents=self.agent_pids,
                                start_agent=lambda name: None)  # fmt: skip
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


# ---------------------------------------------------------------------- the oracle
_REFERENCES: dict[tuple[str, int], dict[str, dict]] = {}


def reference_state(config: str, steps: int) -> dict[str, dict]:
    """Layer name -> parameters after ``steps`` reference steps (cached across tests: only the cluster differs)."""
    from oobleck_mm.runtime.reference import ReferenceTrainer

    raw = yaml.safe_load(Path(config).read_text())
    key = (json.dumps({k: raw[k] for k in ("model", "data", "training")}, sort_keys=True), steps)
    if key not in _REFERENCES:
        import torch

        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # the tiny model gains nothing from threads, and OpenMP spins on a busy machine
        try:
            trainer = ReferenceTrainer(load_config(config))
            for _ in trainer.train(steps):
                pass
            _REFERENCES[key] = {spec.name: trainer.layer_state(i) for i, spec in enumerate(trainer.specs)}
        finally:
            torch.set_num_threads(threads)
    return _REFERENCES[key]


def max_param_diff(config: str, steps: int, directory: Path) -> tuple[float, str]:
    from oobleck_mm.runtime.checkpoint import load_params, read_meta

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
