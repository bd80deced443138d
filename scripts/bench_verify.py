#!/usr/bin/env python
"""How long ``oobleck-launch verify`` takes on a long float32 run, and what it finds.

    python scripts/bench_verify.py [--steps 600] [--json OUT]

Trains tiny_mm (float32) for ``--steps`` on 4 simulated nodes with
``oobleck-launch local --save-final``, then times, side by side on the same
checkpoint:

- ``verify`` as a user runs it: the reference, plus the reversed-order reference
  in a second process that sets the float32 tolerance;
- ``verify --tolerance T``: the reference alone, what the check costs without the
  noise measurement;
- ``verify --from`` a checkpoint ``--window`` steps before the end (the run is
  resumed from it), the way to check the last steps of a long run.

Then one step fewer, over the whole run and over the window. Printed: wall
seconds of each, the largest difference, the tolerance chosen, and the verdict.
A fault-free run must be within its tolerance both ways and one step fewer must
be outside it over the window. Over the whole float32 run the drift may be as
large as one update (verify then says so): that case is printed, not required.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = str(ROOT / "configs" / "tiny_mm.yaml")


def _cli(*args: str) -> tuple[float, subprocess.CompletedProcess]:
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "oobleck_mm.cli", *args], cwd=ROOT, capture_output=True, text=True, timeout=3600
    )
    return time.perf_counter() - start, proc


def _verdict(proc: subprocess.CompletedProcess) -> dict:
    lines = [line for line in proc.stdout.splitlines() if line.startswith("largest parameter difference")]
    last = lines[-1] if lines else proc.stderr[-500:]
    found = re.search(r"difference (\S+) at (\S+): (within|OUTSIDE) tolerance (\S+)", last)
    if not found:
        raise SystemExit(f"verify printed no verdict (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return {
        "exit": proc.returncode,
        "largest_difference": float(found.group(1)),
        "at": found.group(2),
        "within": found.group(3) == "within",
        "tolerance": float(found.group(4)),
        "line": last,
        "warned_blind": "note: the tolerance is wider than one update" in proc.stdout,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--window", type=int, default=50, help="steps --from checks (default 50)")
    parser.add_argument("--json", default=None, metavar="OUT")
    args = parser.parse_args()
    first = args.steps - args.window
    with tempfile.TemporaryDirectory(prefix="bench-verify-") as tmp:
        mid, final = f"{tmp}/at{first}", f"{tmp}/at{args.steps}"
        print(
            f"training tiny_mm (float32) for {first} + {args.window} steps on 4 nodes ...", file=sys.stderr, flush=True
        )
        for steps, extra in ((first, ()), (args.steps, ("--resume", mid))):
            out = mid if steps == first else final
            seconds, proc = _cli(
                "local",
                "--config",
                CONFIG,
                "--steps",
                str(steps),
                "--save-final",
                out,
                "--run-dir",
                f"{tmp}/run{steps}",
                "--log-every",
                "1000",
                *extra,
            )
            if proc.returncode:
                raise SystemExit(f"training failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
            print(f"  trained to step {steps} in {seconds:.1f} s", file=sys.stderr, flush=True)
        common = ("verify", "--config", CONFIG, "--against", final)
        cases = {
            "default (reference + reversed-order reference in parallel)": common + ("--steps", str(args.steps)),
            "--tolerance 1e-2 (reference alone)": common + ("--steps", str(args.steps), "--tolerance", "1e-2"),
            f"--from step {first} (the last {args.window} steps)": common + ("--steps", str(args.steps), "--from", mid),
            "one step fewer, whole run (float32 drift may hide it)": common + ("--steps", str(args.steps - 1)),
            f"one step fewer, --from step {first} (must be OUTSIDE)": common
            + ("--steps", str(args.steps - 1), "--from", mid),
        }
        results = {}
        for name, cmd in cases.items():
            seconds, proc = _cli(*cmd)
            results[name] = {"seconds": seconds, **_verdict(proc)}
            r = results[name]
            print(
                f"{name:<58} {seconds:7.1f} s  diff {r['largest_difference']:.2e}  tol {r['tolerance']:.1e}  "
                f"{'within' if r['within'] else 'OUTSIDE'}",
                flush=True,
            )
    # A fault-free run passes both ways; a step off is caught by the window check.
    ok = (
        results[next(iter(cases))]["within"]
        and results[f"--from step {first} (the last {args.window} steps)"]["within"]
        and not results[f"one step fewer, --from step {first} (must be OUTSIDE)"]["within"]
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps({"steps": args.steps, "window": args.window, "cases": results, "ok": ok}, indent=2) + "\n"
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
