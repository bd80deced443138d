#!/usr/bin/env python3
"""The master's state machine under random event orders, at depth, and what its invariants catch.

    python scripts/bench_machine.py                       # 20,000 random sequences (tests/unit/test_cp_machine.py)
    python scripts/bench_machine.py --examples 0 --mutants        # only: each mutant of the machine must be caught

The suite runs the same model shallowly (``OOBLECK_MACHINE_EXAMPLES``, 150 by
default). ``--mutants`` copies ``oobleck_mm/`` to a temporary folder, breaks one
guard at a time (each named below with the invariant that should catch it),
and runs the model against the broken copy: a mutant the model does not catch
is printed as ``SURVIVED`` and fails the script.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEST = "tests/unit/test_cp_machine.py::TestMachine"
MUTANT_TESTS = "tests/unit/test_cp_machine.py"
"""A mutant must fail the machine's test file: the random model, or a regression test kept beside it."""

MUTANTS = [
    # (name, file, text, replacement, the invariant that should fail)
    (
        "apply a plan the membership overtook",
        "oobleck_mm/master/generations.py",
        "    if wanted(ctx) != request:  # holdings changed",
        "    if False:  # holdings changed",
        "no plan uses a node that is not live",
    ),
    (
        "supersede nothing",
        "oobleck_mm/master/generations.py",
        "        if want == pending.request:\n            return",
        "        if True:\n            return",
        "a second loss while planning cancels the stale call (test_a_plan_the_membership_overtook...)",
    ),
    (
        "hand a round on before popping every lost node",
        "oobleck_mm/master/machine.py",
        "        ctx.effects.append(EndStream(name))\n",
        "        ctx.effects.append(EndStream(name))\n        if s.phase is JobPhase.CHECKPOINTING:\n"
        "            stopping.round_lost(ctx, [name])\n",
        "nothing is sent to a node that is not registered",
    ),
    (
        "admit joiners before their workers are ready",
        "oobleck_mm/master/generations.py",
        "n in planned or (s.registry.nodes[n].all_ready and n not in benched)]",
        "n in planned or (True and n not in benched)]",
        "a joiner is admitted once its workers are ready",
    ),
    (
        "finish when any worker is done",
        "oobleck_mm/master/generations.py",
        "    if all(s.done.get(gpu, (0, -1)) >= finished for gpu in current.ranks):",
        "    if any(s.done.get(gpu, (0, -1)) >= (s.generation, 0) for gpu in current.ranks):",
        "exit 0 only once every worker of the last generation said done",
    ),
    (
        "forget to end a lost node's stream",
        "oobleck_mm/master/machine.py",
        "        ctx.effects.append(EndStream(name))\n    for failure",
        "        pass\n    for failure",
        "a node the master dropped has had its stream ended",
    ),
    (
        "stop without the resume command",
        "oobleck_mm/master/stopping.py",
        'f"resume with: {options.resume_command} --resume {directory}")',
        'f"")',
        "exit 3 says how to resume",
    ),
    (
        "let the generation number go back on re-adoption",
        "oobleck_mm/master/generations.py",
        "    s.generation = journal.generation\n",
        "    s.generation = max(0, journal.generation - 1)\n",
        "generations only grow; the job settles with every live node planned",
    ),
]


def run_model(
    examples: int, root: Path, env_extra: dict | None = None, timeout: float = 3600, test: str = TEST
) -> tuple[bool, float, str]:
    env = {**os.environ, "OOBLECK_MACHINE_EXAMPLES": str(examples), "PYTHONPATH": str(root), **(env_extra or {})}
    began = time.perf_counter()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            test,
            "-x",
            "-q",
            "-p",
            "no:cacheprovider",
            "--hypothesis-show-statistics",
            "--timeout",
            "0",
            "--rootdir",
            str(root),
        ],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return proc.returncode == 0, time.perf_counter() - began, proc.stdout + proc.stderr


def mutant_tree(file: str, text: str, replacement: str) -> Path:
    tmp = Path(tempfile.mkdtemp(prefix="oobleck-mutant-"))
    for part in ("oobleck_mm", "tests/unit", "configs", "data"):
        shutil.copytree(ROOT / part, tmp / part, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml",):
        shutil.copy(ROOT / name, tmp / name)
    target = tmp / file
    source = target.read_text()
    if text not in source:
        raise SystemExit(f"mutant: {text!r} is not in {file} any more; update scripts/bench_machine.py")
    target.write_text(source.replace(text, replacement, 1))
    return tmp


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--examples", type=int, default=20_000, help="random sequences for the model (default 20000)")
    parser.add_argument("--mutants", action="store_true", help="also check that each mutant of the machine is caught")
    parser.add_argument("--mutant-examples", type=int, default=3000, help="sequences per mutant (default 3000)")
    parser.add_argument("--json", help="write the results here too")
    args = parser.parse_args()

    ok, result = True, {"examples": args.examples}
    if args.examples:
        ok, result = deep(args.examples)
    if args.mutants:
        result["mutants"] = []
        for name, file, text, replacement, guard in MUTANTS:
            tree = mutant_tree(file, text, replacement)
            try:  # no shrinking: the question is only whether the model catches it
                passed, took, mout = run_model(
                    args.mutant_examples, tree, {"OOBLECK_MACHINE_SHRINK": "0"}, test=MUTANT_TESTS
                )
            finally:
                shutil.rmtree(tree, ignore_errors=True)
            caught = not passed
            failure = next((line.strip(" |") for line in mout.splitlines() if "Error:" in line), "")
            print(
                f"{'caught  ' if caught else 'SURVIVED'} {name} ({file}; {took:.0f} s): expected: {guard}; "
                f"got: {failure[:200]}",
                flush=True,
            )
            result["mutants"].append(
                {
                    "name": name,
                    "file": file,
                    "caught": caught,
                    "seconds": round(took, 1),
                    "expected": guard,
                    "failure": failure[:300],
                }
            )
            ok = ok and caught
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0 if ok else 1


def deep(examples: int) -> tuple[bool, dict]:
    print(f"running {examples} random event sequences through master.machine ...", flush=True)
    ok, seconds, out = run_model(examples, ROOT)
    stats = re.findall(r"^\s+- ([\d.]+% .*)$|^\s+\* ([\d.]+%, .*)$", out, re.M)
    result = {
        "examples": examples,
        "passed": ok,
        "seconds": round(seconds, 1),
        "sequences_per_s": round(examples / seconds, 1),
        "outcomes": [line for line in (a or b for a, b in stats) if "Retried draw" not in line][:40],
    }
    print(f"{'passed' if ok else 'FAILED'}: {examples} sequences in {seconds:.0f} s ({examples / seconds:.0f}/s)")
    for line in result["outcomes"]:
        print("   ", line)
    if not ok:  # the failing sequence, as hypothesis shrank it (it is also in .hypothesis/, replayed first)
        failing = [
            line for line in out.splitlines() if line.startswith(("E   ", "  | E", "  | state", "E       state"))
        ]
        print("\n".join(failing[:150]) or out[-6000:])
    return ok, result


if __name__ == "__main__":
    sys.exit(main())
