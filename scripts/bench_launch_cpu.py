#!/usr/bin/env python
"""Where a launch's CPU goes: the CPU seconds of one ``oobleck-launch local`` run by process kind, and
the reference trainer's CPU per step.

    python scripts/bench_launch_cpu.py [--nodes 3] [--steps 8,200] [--json OUT]
    python scripts/bench_launch_cpu.py --compare-templates 3 --steps 8 [--json OUT]

What one e2e test of the suite costs the machine (the float64 tiny model, test heartbeats; the suite's
2 cores are CPU-bound at two tests at a time, so a test's CPU, not its waits, sets the suite's time):
the launcher, the master, its planning helper, the agents, the worker template and its forked workers,
each as a sum over the processes of that kind (polled every 0.1 s: a process's last reading, its
children not counted twice). Each ``--steps`` count is one run; the difference between two of them is
the training's CPU per step, against ``reference_cpu_per_step_s``: the single-process reference trainer
(``oobleck_mm.runtime.reference``) on the same job, what a test's equivalence check replays.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

KINDS = ("cli master", "cli agent", "cli local", "forkserver", "spawn_main", "resource_tracker")
"""Command-line marks of the process kinds (``forkserver``: the worker template and the workers forked
from it; ``spawn_main``: the master's planning helper)."""


def _config(folder: Path, nodes: int, steps: int) -> Path:
    raw = yaml.safe_load((ROOT / "configs" / "tiny_mm.yaml").read_text())
    raw["training"].update(dtype="float64", steps=steps)
    raw["fault_tolerance"].update(heartbeat_interval="200ms", heartbeat_timeout="3s", straggler_factor=0)
    raw["cluster"]["nodes"] = nodes
    path = folder / f"job-{nodes}n-{steps}s.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _kind(cmdline: list[str]) -> str:
    line = " ".join(cmdline)
    return next((k for k in KINDS if k in line), "other")


def launch_cpu(config: Path, run_dir: Path, template: tuple[str, int] | None = None) -> dict:
    """One launch's CPU by process kind; ``template``: (address, pid) of a worker template this process runs,
    offered to the launch (``OOBLECK_WORKER_TEMPLATE``): the workers it forks for the launch are counted, its
    own imports (paid once for every launch) are not."""
    from oobleck_mm.runtime.template import SHARED_TEMPLATE_ENV

    env = dict(os.environ)
    given, before = None, set()
    if template is not None:
        env[SHARED_TEMPLATE_ENV] = template[0]
        given = psutil.Process(template[1])
        before = {p.pid for p in given.children()}
    start = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "oobleck_mm.cli", "local", "--config", str(config), "--run-dir", str(run_dir)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    last: dict[int, float] = {}
    kinds: dict[int, str] = {}
    root = psutil.Process(proc.pid)
    while proc.poll() is None:
        try:
            procs = [root, *root.children(recursive=True)]
            if given is not None:
                procs += [w for w in given.children(recursive=True) if w.pid not in before]
        except psutil.NoSuchProcess:
            break
        for p in procs:
            try:
                times = p.cpu_times()
                last[p.pid] = times.user + times.system
                kinds.setdefault(p.pid, _kind(p.cmdline()))
            except psutil.Error:
                pass
        time.sleep(0.1)
    if proc.returncode != 0:
        raise SystemExit(f"the launch exited {proc.returncode}: see {run_dir}")
    by_kind: dict[str, float] = collections.Counter()
    count: dict[str, int] = collections.Counter()
    for pid, seconds in last.items():
        by_kind[kinds[pid]] += seconds
        count[kinds[pid]] += 1
    return {
        "wall_s": round(time.monotonic() - start, 2),
        "cpu_s": round(sum(by_kind.values()), 2),
        "by_kind": {k: {"cpu_s": round(v, 2), "processes": count[k]} for k, v in by_kind.most_common()},
    }


def reference_cpu_per_step(config: Path, steps: int = 10) -> float:
    import torch

    from oobleck_mm.config import load_config
    from oobleck_mm.runtime.reference import ReferenceTrainer

    torch.set_num_threads(1)
    trainer = ReferenceTrainer(load_config(str(config)))
    for step in range(2):  # the first steps import and warm up
        trainer.train_step(step)
    start = time.process_time()
    for step in range(2, 2 + steps):
        trainer.train_step(step)
    return (time.process_time() - start) / steps


def compare_templates(nodes: int, steps: int, rounds: int) -> dict:
    """``rounds`` launches each way, interleaved: the launcher starting its own worker template, and one this
    process keeps for all of them (what the tests' launches do: ``tests/harness.py``, ``suite_template``)."""
    from oobleck_mm.runtime.template import start_shared_template, template_pid

    template = (start_shared_template({**os.environ, "OMP_NUM_THREADS": "1"}), template_pid())
    runs: dict[str, list[dict]] = {"own": [], "given": []}
    with tempfile.TemporaryDirectory(prefix="bench-launch-cpu-") as tmp:
        folder = Path(tmp)
        config = _config(folder, nodes, steps)
        for i in range(rounds):
            for way in ("own", "given"):
                run = launch_cpu(config, folder / f"{way}-{i}", template if way == "given" else None)
                runs[way].append(run)
                print(
                    f"  {way} template, launch {i + 1}: wall {run['wall_s']:.1f} s, CPU {run['cpu_s']:.1f} s",
                    flush=True,
                )
    own_cpu, given_cpu = (sum(r["cpu_s"] for r in runs[w]) / rounds for w in ("own", "given"))
    own_wall, given_wall = (sum(r["wall_s"] for r in runs[w]) / rounds for w in ("own", "given"))
    template_cpu = sum(psutil.Process(template[1]).cpu_times()[:2])
    print(
        f"a launch of {nodes} nodes, {steps} steps: own template wall {own_wall:.1f} s / CPU {own_cpu:.1f} s, "
        f"a given one wall {given_wall:.1f} s / CPU {given_cpu:.1f} s (x{given_cpu / own_cpu:.2f} CPU, "
        f"x{given_wall / own_wall:.2f} wall); the given template's own imports, once: {template_cpu:.1f} s"
    )
    return {
        "nodes": nodes,
        "steps": steps,
        "rounds": rounds,
        "own": {"wall_s": round(own_wall, 2), "cpu_s": round(own_cpu, 2)},
        "given": {"wall_s": round(given_wall, 2), "cpu_s": round(given_cpu, 2)},
        "given_template_imports_cpu_s": round(template_cpu, 2),
        "runs": runs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--steps", default="8,200", help="comma-separated step counts, one run each")
    parser.add_argument("--json", help="write the results here too")
    parser.add_argument(
        "--compare-templates",
        type=int,
        metavar="ROUNDS",
        help="instead: ROUNDS launches (of the first --steps) with their own worker template and with one given",
    )
    args = parser.parse_args()
    if args.compare_templates:
        results = compare_templates(args.nodes, int(args.steps.split(",")[0]), args.compare_templates)
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
        return
    counts = [int(s) for s in args.steps.split(",")]
    results: dict = {"nodes": args.nodes, "runs": {}}
    with tempfile.TemporaryDirectory(prefix="bench-launch-cpu-") as tmp:
        folder = Path(tmp)
        for steps in counts:
            print(f"launch: {args.nodes} nodes, {steps} steps ...", flush=True)
            run = launch_cpu(_config(folder, args.nodes, steps), folder / f"run-{steps}")
            results["runs"][steps] = run
            kinds = ", ".join(f"{k} {v['cpu_s']:.1f} s (x{v['processes']})" for k, v in run["by_kind"].items())
            print(f"  {steps} steps: wall {run['wall_s']:.1f} s, CPU {run['cpu_s']:.1f} s: {kinds}")
        if len(counts) >= 2:
            low, high = min(counts), max(counts)
            per_step = (results["runs"][high]["cpu_s"] - results["runs"][low]["cpu_s"]) / (high - low)
            results["training_cpu_per_step_s"] = round(per_step, 4)
            print(f"training: {per_step * 1000:.0f} ms of CPU a step (all workers)")
        ref = reference_cpu_per_step(_config(folder, args.nodes, 12))
        results["reference_cpu_per_step_s"] = round(ref, 4)
        print(f"reference trainer: {ref * 1000:.0f} ms of CPU a step")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
