#!/usr/bin/env python
"""The simulator against this machine (issue 16): a trace replayed for real, and simulated.

    python scripts/check_simulator_local.py [--config configs/tiny_mm.yaml] [--nodes 6]
        [--trace data/traces/10m.csv] [--time-scale 0.02] [--steps 200] [--json OUT]

1. Calibration: failure-free ``oobleck-launch local`` runs on each node count the
   replay will pass through, before and after the replay (the machine is shared:
   the two say how much its load drifted); the mean of their median seconds
   between steps is the local cluster's measured cost of that layout (the cost
   model cannot know that six CPU "nodes" share two cores).
2. The replay: ``oobleck-launch local --trace`` on the same config; its average
   samples/s from its first step to its last.
3. The simulation of that replay: the same kills and joins
   (``faults.trace.load_timeline``, what the launcher fires), the same planner, the
   measured iteration times of step 1, and the recovery phases measured on this
   machine (docs/recovery.md: a crash seen in 0.01 s from the reset stream, about
   0.25 s from detection to the next step, a joiner's worker starting in about 3 s).
   The lost iteration in flight, the pauses and where each event lands are the
   simulator's own.

Prints both averages and their ratio (target: within 20%).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from oobleck_mm.config import load_config  # noqa: E402
from oobleck_mm.faults.trace import load_timeline  # noqa: E402
from oobleck_mm.simulator.availability import from_faults  # noqa: E402
from oobleck_mm.simulator.params import SimParams  # noqa: E402
from oobleck_mm.simulator.run import simulate  # noqa: E402

# Measured on this machine (docs/recovery.md, "Measured by the e2e tests").
LOCAL_PHASES = SimParams(detection_s=0.01, rendezvous_s=0.25, worker_start_s=2.8)


def launch(config: str, nodes: int, steps: int, run_dir: Path, extra: list[str]) -> list[dict]:
    cmd = [
        sys.executable,
        "-m",
        "oobleck_mm.cli",
        "local",
        "--config",
        config,
        "--nodes",
        str(nodes),
        "--steps",
        str(steps),
        "--run-dir",
        str(run_dir),
        *extra,
    ]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    if done.returncode not in (0, 3):
        raise SystemExit(f"{' '.join(cmd)} exited {done.returncode}:\n{done.stderr[-3000:]}")
    with open(run_dir / "events.jsonl", encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def step_times(events: list[dict]) -> list[float]:
    return sorted(float(e["ts"]) for e in events if e.get("event") == "step")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/tiny_mm.yaml")
    parser.add_argument("--nodes", type=int, default=6)
    parser.add_argument("--trace", default="data/traces/10m.csv")
    parser.add_argument("--time-scale", type=float, default=0.02)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--calibration-steps", type=int, default=40)
    parser.add_argument("--min-nodes", type=int, default=2, help="calibrate node counts from here up")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    say = lambda line: print(line, flush=True)  # noqa: E731
    job = load_config(ROOT / args.config)
    names = [f"node{i}" for i in range(args.nodes)]

    with tempfile.TemporaryDirectory(prefix="oobleck-simcheck-") as tmp:
        say(f"replay: {args.trace} at time scale {args.time_scale} on {args.nodes} local nodes, {args.steps} steps")
        # The kills the launcher will fire, and the node counts the replay passes through (with
        # the steps' time span unknown yet, every count the trace reaches is calibrated).
        faults = load_timeline(ROOT / args.trace, names, time_scale=args.time_scale)
        everything = from_faults(names, faults, float("inf"), "all")
        counts = sorted({everything.nodes_at(0)} | {everything.nodes_at(c.seconds) for c in everything.changes})
        counts = [n for n in counts if n >= args.min_nodes]
        # Calibrate before and after the replay, so a change in the machine's load during the
        # replay shows up as a spread instead of a silent bias (the machine is shared).
        runs: dict[int, list[float]] = {n: [] for n in counts}
        for rounds, when in enumerate(("before", "after")):
            for n in counts:
                stamps_n = step_times(launch(args.config, n, args.calibration_steps, Path(tmp) / f"cal{n}-{when}", []))
                gaps = [b - a for a, b in zip(stamps_n[5:], stamps_n[6:])]  # past the first steps' warm-up
                runs[n].append(statistics.median(gaps))
            if rounds == 0:
                say("replay (between the two calibrations)")
                events = launch(
                    args.config,
                    args.nodes,
                    args.steps,
                    Path(tmp) / "replay",
                    ["--trace", args.trace, "--time-scale", str(args.time_scale)],
                )
        seconds_by_nodes = {n: statistics.mean(v) for n, v in runs.items()}
        for n, (before, after) in runs.items():
            say(f"calibration: {n} nodes, {before:.3f} s per step before the replay, {after:.3f} after")
        stamps = step_times(events)
        measured_s = stamps[-1] - stamps[0]
        real = (len(stamps) - 1) * job.training.global_batch / measured_s
        availability = from_faults(names, faults, measured_s, f"{os.path.basename(args.trace)} x{args.time_scale}")
        say(f"replay: {len(stamps)} steps in {measured_s:.1f} s = {real:.2f} samples/s")
        by_generation: dict[int, list[float]] = {}
        steps = sorted((float(e["ts"]), e["generation"]) for e in events if e.get("event") == "step")
        for (a, g1), (b, g2) in zip(steps, steps[1:]):
            if g1 == g2:
                by_generation.setdefault(g1, []).append(b - a)
        for g, gaps in sorted(by_generation.items()):
            say(f"replay generation {g}: median {statistics.median(gaps):.3f} s per step over {len(gaps)} steps")

    def iteration_of(plan) -> float:
        return seconds_by_nodes[len(plan.nodes)]

    result = simulate(job, availability, ["oobleck"], LOCAL_PHASES, iteration_of=iteration_of)[0]
    ratio = result.samples_per_s / real
    say(
        f"simulated: {result.samples_per_s:.2f} samples/s ({len(result.incidents)} changes); "
        f"measured {real:.2f}; simulated/measured = {ratio:.3f}"
    )
    say("breakdown: " + ", ".join(f"{k} {v:.1f} s" for k, v in result.breakdown.items() if v))
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "config": args.config,
                    "trace": args.trace,
                    "time_scale": args.time_scale,
                    "nodes": args.nodes,
                    "measured_samples_per_s": real,
                    "simulated_samples_per_s": result.samples_per_s,
                    "ratio": ratio,
                    "seconds_per_step_by_nodes": seconds_by_nodes,
                    "calibrations": runs,
                    "wall_s": measured_s,
                    "breakdown": result.breakdown,
                },
                indent=2,
            )
            + "\n"
        )
    return 0 if abs(ratio - 1) <= 0.2 else 1


if __name__ == "__main__":
    raise SystemExit(main())
