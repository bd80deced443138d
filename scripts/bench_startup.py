#!/usr/bin/env python
"""A worker's start-up: the time to import what an agent-started worker imports, in fresh processes.

    python scripts/bench_startup.py [--repeats 10] [--json OUT]

Every start pays it: the job's first, a restart, a joiner (it is admitted once
its worker is ready), and each of the test suite's hundreds of workers, where
the two cores are shared. Each repeat is a fresh interpreter running
``import oobleck_mm.runtime.agent_worker`` under ``-X importtime``; printed are
the median wall time of the import and the cumulative import time of the heavy
packages (absent: not imported at all). Run it from two trees in turns to
compare them (``PYTHONPATH=TREE``): the machine's load hits both alike.

``--workers`` measures what an agent waits for instead (issue 31): the seconds
from asking for a worker (``oobleck_mm.agent.workers.Worker``, the real worker entry and
configs/tiny_mm.yaml) to its ``ready`` report, for ``--worker-start spawn``
(every worker a fresh interpreter) and ``forkserver`` (forks of the worker
template): the first worker, whose template starts with it, and the next ones,
forked from a template that is already warm. Each round is a fresh stand-in agent
process; the methods take turns. ``--load N`` runs N ``yes > /dev/null`` beside it.

``--local NODES`` times whole ``oobleck-launch local`` runs (configs/tiny_mm.yaml,
``--steps``) with one worker template for all the simulated nodes
(``--worker-start shared``) and with one per agent (``forkserver``), in turns.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODULE = "oobleck_mm.runtime.agent_worker"
HEAVY = ("torch", "deepspeed", "transformers", "numba", "grpc", "safetensors", "PIL")


def one_start() -> dict:
    code = f"import {MODULE}, oobleck_mm; print(oobleck_mm.__file__)"
    t0 = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )
    wall = time.perf_counter() - t0
    cumulative = {}
    for line in done.stderr.splitlines():  # "import time: self [us] | cumulative | imported package"
        if not line.startswith("import time:") or "|" not in line:
            continue
        _, cum, name = line.split("|")
        if name.strip() in HEAVY:
            cumulative[name.strip()] = int(cum) / 1e6
        if name.strip() == MODULE:
            cumulative["import"] = int(cum) / 1e6
    return {"wall_s": wall, "tree": done.stdout.strip(), **cumulative}


AGENT = """
import json, sys, time
sys.path.insert(0, sys.argv[1])
from oobleck_mm.agent.workers import Worker
from oobleck_mm.protocol.pipe import recv_report

if __name__ == "__main__":
    method, count, times = sys.argv[2], int(sys.argv[3]), []
    for rank in range(count):
        started = time.monotonic()
        worker = Worker("oobleck_mm.runtime.agent_worker:worker_main", sys.argv[4], "bench", rank, method)
        while recv_report(worker.conn).WhichOneof("report") != "ready":
            pass
        times.append(time.monotonic() - started)
        worker.kill()
        worker.close()
    print(json.dumps(times))
"""


def worker_ready_times(method: str, count: int) -> list[float]:
    """One stand-in agent: ``count`` workers started one after another, each one's seconds to ready."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        script = Path(d) / "agent.py"  # a file, not -c: multiprocessing's children re-import __main__ by path
        script.write_text(AGENT)
        done = subprocess.run(
            [sys.executable, str(script), str(ROOT), method, str(count), str(ROOT / "configs/tiny_mm.yaml")],
            capture_output=True,
            text=True,
            cwd=ROOT,
            env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"},
            timeout=600,
        )
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-3000:])
    return json.loads(done.stdout.splitlines()[-1])


def bench_workers(repeats: int, count: int, load: int) -> dict:
    hogs = [subprocess.Popen(["yes"], stdout=subprocess.DEVNULL) for _ in range(load)]
    try:
        runs: dict[str, list[list[float]]] = {"spawn": [], "forkserver": []}
        for r in range(repeats):
            for method in ("spawn", "forkserver") if r % 2 == 0 else ("forkserver", "spawn"):
                runs[method].append(worker_ready_times(method, count))
                print(f"  round {r} {method:10s} " + " ".join(f"{t:.2f}" for t in runs[method][-1]), flush=True)
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    row = {}
    for method, times in runs.items():
        row[method] = {
            "first_s": round(statistics.median(t[0] for t in times), 3),
            "next_s": round(statistics.median(x for t in times for x in t[1:]), 3),
        }
    return row


def local_run_seconds(method: str, nodes: int, steps: int) -> tuple[float, float]:
    """One ``oobleck-launch local`` of configs/tiny_mm.yaml: (seconds from launch to exit, seconds from
    launch to its first step's event)."""
    import tempfile

    from oobleck_mm.events import read_events

    with tempfile.TemporaryDirectory() as d:
        started = time.time()
        subprocess.run(
            [
                sys.executable,
                "-m",
                "oobleck_mm.cli",
                "local",
                "--config",
                "configs/tiny_mm.yaml",
                "--nodes",
                str(nodes),
                "--steps",
                str(steps),
                "--worker-start",
                method,
                "--run-dir",
                d,
                "--no-tensorboard",
            ],
            cwd=ROOT,
            check=True,
            capture_output=True,
            timeout=600,
        )
        wall = time.time() - started
        first = read_events(Path(d) / "events.jsonl", "step")[0]["ts"] - started
    return wall, first


def bench_local(repeats: int, nodes: int, steps: int) -> dict:
    runs: dict[str, list[tuple[float, float]]] = {"shared": [], "forkserver": []}
    for r in range(repeats):
        for method in ("shared", "forkserver") if r % 2 == 0 else ("forkserver", "shared"):
            runs[method].append(local_run_seconds(method, nodes, steps))
            wall, first = runs[method][-1]
            print(f"  round {r} {method:10s} run {wall:.2f} s, first step at {first:.2f} s", flush=True)
    return {
        method: {
            "run_s": round(statistics.median(w for w, _ in times), 3),
            "first_step_s": round(statistics.median(f for _, f in times), 3),
        }
        for method, times in runs.items()
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--json")
    ap.add_argument("--workers", action="store_true", help="time worker starts (spawn vs forkserver) instead")
    ap.add_argument("--count", type=int, default=3, help="--workers: workers per stand-in agent")
    ap.add_argument("--load", type=int, default=0, help="--workers: `yes > /dev/null` processes beside it")
    ap.add_argument(
        "--local",
        type=int,
        default=0,
        metavar="NODES",
        help="time whole `oobleck-launch local` runs of NODES nodes instead: one worker template for "
        "all nodes (--worker-start shared) against one per agent (forkserver)",
    )
    ap.add_argument("--steps", type=int, default=5, help="--local: training steps per run")
    args = ap.parse_args(argv)
    command = "python scripts/bench_startup.py " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.local:
        print(f"oobleck-launch local, {args.local} nodes, {args.steps} steps: {args.repeats} rounds per method")
        row = bench_local(args.repeats, args.local, args.steps)
        for method, r in row.items():
            print(f"  {method:10s} run {r['run_s']:.2f} s, first step {r['first_step_s']:.2f} s after launch (medians)")
        print(
            f"  shared template: the run {row['forkserver']['run_s'] / row['shared']['run_s']:.2f}x faster, "
            f"the first step {row['forkserver']['first_step_s'] / row['shared']['first_step_s']:.2f}x sooner"
        )
        if args.json:
            Path(args.json).write_text(json.dumps({"command": command, **row}, indent=1) + "\n")
        return 0
    if args.workers:
        print(f"worker start to ready: {args.repeats} rounds of {args.count} workers per method, load {args.load}")
        row = bench_workers(args.repeats, args.count, args.load)
        for method, r in row.items():
            print(f"  {method:10s} first worker {r['first_s']:.3f} s, next workers {r['next_s']:.3f} s (medians)")
        ratio = row["spawn"]["next_s"] / row["forkserver"]["next_s"]
        print(f"  a later worker: forkserver {ratio:.1f}x faster than spawn")
        if args.json:
            Path(args.json).write_text(
                json.dumps(
                    {
                        "command": "python scripts/bench_startup.py "
                        + " ".join(argv if argv is not None else sys.argv[1:]),
                        **row,
                    },
                    indent=1,
                )
                + "\n"
            )
        return 0
    runs = [one_start() for _ in range(args.repeats)]
    print(f"{MODULE} from {Path(runs[0]['tree']).parent}: {args.repeats} fresh processes, medians")
    row = {
        "process_wall_s": round(statistics.median(r["wall_s"] for r in runs), 3),
        "import_s": round(statistics.median(r["import"] for r in runs), 3),
    }
    print(f"  process (interpreter + imports) {row['process_wall_s']:.3f} s, the import {row['import_s']:.3f} s")
    for name in HEAVY:
        seen = [r[name] for r in runs if name in r]
        row[name] = round(statistics.median(seen), 3) if seen else None
        print(f"  {name:<12} " + (f"{row[name]:.3f} s" if seen else "not imported"))
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "command": "python scripts/bench_startup.py "
                    + " ".join(argv if argv is not None else sys.argv[1:]),
                    **row,
                },
                indent=1,
            )
            + "\n"
        )
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
