#!/usr/bin/env python3
"""Stragglers on real processes: a slowed node, with the batch re-split for its speed and without.

    python scripts/bench_straggler.py                         # x2 for good from step 50, 6 nodes
    python scripts/bench_straggler.py --slow x3+20s           # a transient x3 slowdown of 20 s
    python scripts/bench_straggler.py --loaded 2000           # false positives: 2,000 steps beside two `yes`
    python scripts/bench_straggler.py --json benchmarks/bench_straggler.json
    python scripts/bench_straggler.py --slow x16 --bench 5s    # also: weighed for a bench 5 s after found

Runs ``oobleck-launch local`` on the built-in model (float64) three times, one
after the other: unslowed; slowed with ``fault_tolerance.straggler_resplit=false``
(detected and reported, nothing done: every pipeline waits for the slow one);
slowed with the re-split on. The slowdown is ``--inject slow:NODE@stepN...``
(``oobleck_mm/faults/slowdown.py``: the node's workers frozen 1 - 1/F of the
time). It prints the throughput of the steps from the slowdown on, as a fraction
of the unslowed run's over the same steps, the detection latency (steps and
seconds from ``slowed`` to ``straggler_detected``), and for a transient slowdown
the time each slowed run lost against the unslowed one and whether the last plan
has the first plan's split again.

A caveat of this machine: six simulated nodes share two cores, so a frozen node's
CPU goes to the others, which then run faster; the unmitigated loss is smaller
here than on a cluster, where each node has its own accelerator.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from oobleck_mm.events import read_events  # noqa: E402

CONFIG = ROOT / "configs" / "tiny_mm.yaml"
SETS = ["training.dtype=float64", "training.global_batch=48"]
"""float64 (verifiable), and a batch of 24 microbatches: six pipelines of 4 leave room to move some."""


def launch(
    run_dir: Path,
    nodes: int,
    steps: int,
    extra: list[str],
    sets: list[str],
    timeout: float,
    config: Path = CONFIG,
    base_sets: list[str] = SETS,
) -> int:
    cmd = [
        sys.executable,
        "-m",
        "oobleck_mm.cli",
        "local",
        "--config",
        str(config),
        "--nodes",
        str(nodes),
        "--steps",
        str(steps),
        "--run-dir",
        str(run_dir),
        "--log-every",
        "100",
        *extra,
    ]
    for s in [*base_sets, *sets]:
        cmd += ["--set", s]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout).returncode


def seconds_from(events: Path, step: int) -> float:
    """Wall seconds from step ``step``'s completion to the last step's."""
    steps = {e["step"]: e["ts"] for e in read_events(events, "step")}
    last = max(steps)
    return steps[last] - steps[min(s for s in steps if s >= step)]


def summary(events: Path, from_step: int) -> dict:
    slowed = read_events(events, "slowed")
    detected = read_events(events, "straggler_detected")
    steps = {e["step"]: e["ts"] for e in read_events(events, "step")}
    out: dict = {
        "seconds_from_slowdown": round(seconds_from(events, from_step), 3),
        "detected": [(e["node"], e["step"], e["factor"]) for e in detected],
        "cleared": [(e["node"], e["step"]) for e in read_events(events, "straggler_cleared")],
    }
    if slowed and detected:
        out["detection_steps"] = detected[0]["step"] - slowed[0]["step"]
        out["detection_s"] = round(steps.get(detected[0]["step"], detected[0]["ts"]) - slowed[0]["ts"], 3)
    plans = read_events(events, "plan_decided")
    splits = [[p["num_microbatches"] for p in plan["layout"]["pipelines"]] for plan in plans]
    out["splits"] = splits
    out["returned_to_first_split"] = len(splits) > 1 and splits[-1] == splits[0]
    out["benched"] = [
        (e["node"], e["generation"], round(e["factor"], 3)) for e in read_events(events, "straggler_benched")
    ]
    out["kept"] = [e["reason"].rsplit("; ", 1)[-1] for e in read_events(events, "straggler_kept")]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=6)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--node", default="node2")
    parser.add_argument("--at", type=int, default=50, help="the step the slowdown begins")
    parser.add_argument("--slow", default="x2", help="xF[+Ts]: the factor, and how long (default: for good)")
    parser.add_argument(
        "--loaded",
        type=int,
        default=0,
        help="instead: run this many steps unslowed beside two `yes > /dev/null` and count detections",
    )
    parser.add_argument(
        "--bench",
        default=None,
        metavar="DURATION",
        help="also a run whose straggler is weighed for a bench DURATION after it was found "
        "(fault_tolerance.straggler_replan_after; the bench lasts the run)",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        dest="sets",
        help="a config override for every run, e.g. training.microbatch_size=1 (finer re-splits)",
    )
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="oobleck-straggler-"))
    if args.loaded:
        return loaded(args, work)
    inject = ["--inject", f"slow:{args.node}@step{args.at}{args.slow}"]
    runs = {
        "unslowed": ([], []),
        "slowed, detection only": (inject, ["fault_tolerance.straggler_resplit=false"]),
        "slowed, re-split": (inject, ["fault_tolerance.straggler_replan_after=null"]),
    }
    if args.bench:
        runs["slowed, re-split and bench"] = (
            inject,
            [f"fault_tolerance.straggler_replan_after={args.bench}", "fault_tolerance.straggler_bench=1h"],
        )
    result = {
        "nodes": args.nodes,
        "steps": args.steps,
        "slow": f"{args.node}@step{args.at}{args.slow}",
        "sets": [*SETS, *args.sets],
        "runs": {},
    }
    for name, (extra, sets) in runs.items():
        run_dir = work / name.replace(" ", "_").replace(",", "")
        began = time.perf_counter()
        code = launch(run_dir, args.nodes, args.steps, extra, [*args.sets, *sets], args.timeout)
        info = summary(run_dir / "events.jsonl", args.at) if code == 0 else {}
        info.update(exit=code, wall_s=round(time.perf_counter() - began, 1))
        result["runs"][name] = info
        print(
            f"{name}: exit {code}, {info.get('seconds_from_slowdown', float('nan')):.1f} s from step {args.at} "
            f"to the end; detected {info.get('detected')}; cleared {info.get('cleared')}",
            flush=True,
        )
    base = result["runs"]["unslowed"].get("seconds_from_slowdown")
    slowed = [name for name in result["runs"] if name != "unslowed"]
    for name in slowed:
        run = result["runs"][name]
        if base and run.get("seconds_from_slowdown"):
            run["throughput_vs_unslowed"] = round(base / run["seconds_from_slowdown"], 3)
            run["seconds_lost"] = round(run["seconds_from_slowdown"] - base, 2)
    for name in slowed:
        run = result["runs"][name]
        latency = (
            f"; detected after {run['detection_steps']} steps ({run['detection_s']:.2f} s)"
            if "detection_steps" in run
            else "; not detected"
        )
        print(
            f"{name}: {run.get('throughput_vs_unslowed', float('nan')):.1%} of the unslowed throughput "
            f"({run.get('seconds_lost', float('nan')):+.1f} s){latency}; splits {run.get('splits')}; "
            f"last split = first: {run.get('returned_to_first_split')}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0 if all(r.get("exit") == 0 for r in result["runs"].values()) else 1


def loaded(args, work: Path) -> int:
    """False positives: an unslowed run beside two busy loops; every ``straggler_detected`` is one."""
    hogs = [subprocess.Popen(["yes"], stdout=subprocess.DEVNULL) for _ in range(2)]
    try:
        began = time.perf_counter()
        code = launch(work / "loaded", args.nodes, args.loaded, [], args.sets, args.timeout)
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    events = work / "loaded" / "events.jsonl"
    detected = read_events(events, "straggler_detected")
    factors = [e.get("slowest_node_factor") for e in read_events(events, "step") if e.get("slowest_node_factor")]
    factors.sort()
    result = {
        "nodes": args.nodes,
        "steps": args.loaded,
        "exit": code,
        "wall_s": round(time.perf_counter() - began, 1),
        "false_positives": len(detected),
        "detected": [(e["node"], e["step"], e["factor"]) for e in detected],
        "slowest_node_factor_p50": factors[len(factors) // 2] if factors else None,
        "slowest_node_factor_p99": factors[int(len(factors) * 0.99)] if factors else None,
    }
    print(
        f"loaded run: exit {code}, {args.loaded} steps in {result['wall_s']} s beside two `yes`: "
        f"{len(detected)} nodes flagged {result['detected']}; the slowest node's factor per step: "
        f"median {result['slowest_node_factor_p50']:.2f}, p99 {result['slowest_node_factor_p99']:.2f}"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0 if code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
