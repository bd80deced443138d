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
    done = subprocess.run([sys.executable, "-X", "importtime", "-c", code], capture_output=True, text=True,
                          check=True, cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})  # fmt: skip
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    runs = [one_start() for _ in range(args.repeats)]
    print(f"{MODULE} from {Path(runs[0]['tree']).parent}: {args.repeats} fresh processes, medians")
    row = {"process_wall_s": round(statistics.median(r["wall_s"] for r in runs), 3),
           "import_s": round(statistics.median(r["import"] for r in runs), 3)}  # fmt: skip
    print(f"  process (interpreter + imports) {row['process_wall_s']:.3f} s, the import {row['import_s']:.3f} s")
    for name in HEAVY:
        seen = [r[name] for r in runs if name in r]
        row[name] = round(statistics.median(seen), 3) if seen else None
        print(f"  {name:<12} " + (f"{row[name]:.3f} s" if seen else "not imported"))
    if args.json:
        Path(args.json).write_text(json.dumps({"command": "python scripts/bench_startup.py "
                                               + " ".join(argv if argv is not None else sys.argv[1:]),
                                               **row}, indent=1) + "\n")  # fmt: skip
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
