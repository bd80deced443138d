#!/usr/bin/env python
"""What a join costs the nodes already training (issue 31 item 3): the survivors' pause, run after run.

    python scripts/bench_join.py [--runs 5] [--load N] [--steps 150] [--json OUT]

``oobleck-launch local`` on 4 nodes (configs/tiny_mm.yaml, live recovery), two
scenarios taking turns, ``--runs`` times each:

  join alone         ``join@step5``
  join after crash   ``kill:node1@step5,join@step8`` (a join a few steps after a crash)

For each run: the join row's "lost s", which is the survivors' pause
(``oobleck_mm.faults.report.survivors_pause``: from the joiner ready to the new
generation's first step, each gap between step completions less the run's
median gap, summed where positive), the median step, the pause in median steps
(target: at most 1.5), and apart the survivors' pause while the joiner started
(``startup_pause_s``: on this one machine the joiner's imports take CPU from the
survivors; a real joiner starts on its own machine). ``--load N`` runs N
``yes > /dev/null`` beside it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from oobleck_mm.events import read_events  # noqa: E402
from oobleck_mm.faults.report import median_step_gap, phase_name, recovery_rows, step_gaps  # noqa: E402

SCENARIOS = {"join alone": "join@step5", "join after crash": "kill:node1@step5,join@step8"}
TARGET_MEDIAN_STEPS = 1.5


def one_run(
    inject: str,
    steps: int,
    run_dir: Path,
    config: str = "configs/tiny_mm.yaml",
    nodes: int = 4,
    sets: tuple[str, ...] = (),
    timeout: float = 600,
) -> dict:
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
        "--inject",
        inject,
        "--run-dir",
        str(run_dir),
        "--log-every",
        "1000",
        "--no-tensorboard",
    ]
    for s in sets:
        cmd += ["--set", s]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    events = read_events(run_dir / "events.jsonl")
    joins = [r for r in recovery_rows(events) if r.kind.startswith("join")]
    median = median_step_gap(events)
    pause = joins[0].lost_s if joins else None
    longest = longest_gap_around_join(events, joins[0] if joins else None)
    return {
        "exit": proc.returncode,
        "pause_s": pause,
        "median_step_s": median,
        "median_steps": None if pause is None or not median else pause / median,
        "longest_step_s": longest,
        "longest_median_steps": None if longest is None or not median else longest / median,
        "joiner_ready_s": joins[0].detect_s if joins else None,
        "startup_pause_s": joins[0].startup_pause_s if joins else None,
    }


def longest_gap_around_join(events, join) -> float | None:
    """The survivors' longest step around ``join`` (a recovery row): the largest gap between consecutive step
    completions from its injection to the completion of the new generation's third step, so the boundary
    switch, the copies and the new generation's first steps are all inside."""
    if join is None or join.step is None:
        return None
    ends = [
        float(e.get("finished_at") or e["ts"])
        for e in events
        if phase_name(e) == "step" and e.get("step") == join.step + 2
    ]
    end = ends[0] if ends else float("inf")
    return max((gap for done, gap in step_gaps(events) if join.at_ts < done <= end), default=None)


def _f(value, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--steps", type=int, default=150)  # ~15 s: the joiner (2-4 s to start) joins well before the end
    ap.add_argument("--load", type=int, default=0)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    hogs = [subprocess.Popen(["yes"], stdout=subprocess.DEVNULL) for _ in range(args.load)]
    results: dict[str, list[dict]] = {name: [] for name in SCENARIOS}
    try:
        with tempfile.TemporaryDirectory() as d:
            for r in range(args.runs):
                for name, inject in SCENARIOS.items():
                    row = one_run(inject, args.steps, Path(d) / f"{r}-{len(results[name])}-{name.replace(' ', '_')}")
                    results[name].append(row)
                    print(
                        f"  run {r} {name:16s} exit {row['exit']}, pause {_f(row['pause_s'])} s = "
                        f"{_f(row['median_steps'], 1)} median steps of {_f(row['median_step_s'])} s, longest "
                        f"step {_f(row['longest_median_steps'], 2)} median steps; joiner "
                        f"ready after {_f(row['joiner_ready_s'])} s, pause meanwhile "
                        f"{_f(row['startup_pause_s'])} s",
                        flush=True,
                    )
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    print(
        f"the survivors' pause at a join, {args.runs} runs per scenario, load {args.load} "
        f"(target <= {TARGET_MEDIAN_STEPS} median steps)"
    )
    summary = {}
    for name, rows in results.items():
        ratios = [row["median_steps"] for row in rows]
        ok = [x for x in ratios if x is not None]
        summary[name] = {
            "runs": rows,
            "median_steps_each": ratios,
            "worst_median_steps": max(ok) if ok else None,
            "median_median_steps": statistics.median(ok) if ok else None,
            "target_met": len(ok) == len(ratios) and max(ok) <= TARGET_MEDIAN_STEPS,
        }
        print(
            f"  {name:16s} "
            + ", ".join("-" if x is None else f"{x:.1f}" for x in ratios)
            + f"  (worst {summary[name]['worst_median_steps']}, target {'met' if summary[name]['target_met'] else 'missed'})"
        )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "command": "python scripts/bench_join.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                    "load": args.load,
                    **summary,
                },
                indent=1,
            )
            + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
