#!/usr/bin/env python
"""What live mode's periodic checkpoints cost the training: the snapshot, the write, the step time.

    python scripts/bench_checkpoint.py [--steps 60] [--interval 5] [--rounds 2] [--json OUT]

Runs ``oobleck-launch local`` on 4 simulated nodes, a wider tiny_mm (``WIDER``: more
state per layer to copy) in float32, with periodic checkpoints every
``--interval`` steps and without, alternating runs (the machine is shared and
noisy: compare the ratios). Printed, per mode:

- median step time (every step; with checkpoints also the steps right after a
  snapshot, which start late by the snapshot);
- the snapshot: seconds the training thread spends copying its layers to host
  memory, the slowest worker's, and that as a share of the median step;
- the write: seconds the background thread takes to put the files on disk;
- the whole run's wall time from first to last step.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from oobleck_mm.events import read_events  # noqa: E402

WIDER = ["model.llm.hidden=256", "model.llm.num_heads=8", "model.vision.hidden=128", "model.vision.num_heads=4"]


def run(tmp: str, name: str, steps: int, interval: int) -> dict:
    run_dir = Path(tmp) / name
    sets = [*WIDER, f"fault_tolerance.checkpoint_interval={interval}"]
    cmd = [
        sys.executable,
        "-m",
        "oobleck_mm.cli",
        "local",
        "--config",
        str(ROOT / "configs" / "tiny_mm.yaml"),
        "--nodes",
        "4",
        "--steps",
        str(steps),
        "--run-dir",
        str(run_dir),
        "--log-every",
        "1000",
        "--no-tensorboard",
        *[a for s in sets for a in ("--set", s)],
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    if proc.returncode:
        raise SystemExit(f"{name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    with open(run_dir / "metrics.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    times = [float(r["step_time_s"]) for r in rows]
    walls = [float(r["wall_time"]) for r in rows]
    saved = read_events(run_dir / "events.jsonl", "checkpoint_saved")
    after = [
        float(r["step_time_s"])
        for r in rows
        if interval and int(r["step"]) > 1 and (int(r["step"]) - 1) % interval == 0
    ]
    return {
        "median_step_s": statistics.median(times),
        "median_step_after_snapshot_s": statistics.median(after) if after else None,
        "checkpoints": len(saved),
        "snapshot_s": statistics.median(e["snapshot_seconds"] for e in saved) if saved else None,
        "write_s": statistics.median(e["write_seconds"] for e in saved) if saved else None,
        "wall_s": walls[-1] - walls[0] + times[0],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--interval", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", default=None, metavar="OUT")
    args = parser.parse_args()
    results: dict[str, list[dict]] = {"off": [], "on": []}
    with tempfile.TemporaryDirectory(prefix="bench-ckpt-") as tmp:
        for r in range(args.rounds):
            for mode, interval in (("off", 0), ("on", args.interval)):
                results[mode].append(run(tmp, f"{mode}{r}", args.steps, interval))
                print(f"round {r + 1} {mode}: {results[mode][-1]}", file=sys.stderr, flush=True)
    summary = {}
    for mode, runs in results.items():
        pick = lambda key: statistics.median(x[key] for x in runs) if runs[0][key] is not None else None  # noqa: E731
        summary[mode] = {key: pick(key) for key in runs[0]}
    on, off = summary["on"], summary["off"]
    on["snapshot_share_of_step"] = on["snapshot_s"] / off["median_step_s"]
    on["step_time_ratio"] = on["median_step_s"] / off["median_step_s"]
    on["wall_ratio"] = on["wall_s"] / off["wall_s"]
    print(
        f"without checkpoints: median step {off['median_step_s'] * 1e3:.1f} ms, {args.steps} steps in {off['wall_s']:.2f} s"
    )
    print(
        f"checkpoint every {args.interval} steps ({on['checkpoints']:.0f} per run): median step "
        f"{on['median_step_s'] * 1e3:.1f} ms ({on['step_time_ratio']:.3f}x), snapshot {on['snapshot_s'] * 1e3:.2f} ms "
        f"({100 * on['snapshot_share_of_step']:.1f}% of a step), background write {on['write_s'] * 1e3:.1f} ms, "
        f"{args.steps} steps in {on['wall_s']:.2f} s ({on['wall_ratio']:.3f}x)"
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps({"args": vars(args), "summary": summary, "runs": results}, indent=2) + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
