#!/usr/bin/env python3
"""The state machines (the master's, the agent's, the worker's) under random event orders, at depth, and what
their invariants catch.

    python scripts/bench_machine.py                       # 20,000 random sequences (tests/unit/test_cp_machine.py)
    python scripts/bench_machine.py --examples 0 --mutants        # only: each mutant of the machine must be caught
    python scripts/bench_machine.py --machine agent --mutants     # the agent's (tests/unit/test_agent_machine.py)
    python scripts/bench_machine.py --machine worker --mutants    # the worker's (tests/unit/test_worker_machine.py)

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

MASTER_MUTANTS = [
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
        "oobleck_mm/master/losses.py",
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
        "oobleck_mm/master/losses.py",
        "        ctx.effects.append(EndStream(name))\n    for failure",
        "        pass\n    for failure",
        "a node the master dropped has had its stream ended",
    ),
    (
        "stop without the resume command",
        "oobleck_mm/master/stopping.py",
        'f"resume with: {options.resume_command} --resume {directory}"',
        'f""',
        "exit 3 says how to resume",
    ),
    (
        "let the generation number go back on re-adoption",
        "oobleck_mm/master/adoption.py",
        "    s.generation = journal.generation\n",
        "    s.generation = max(0, journal.generation - 1)\n",
        "generations only grow; the job settles with every live node planned",
    ),
    (
        "wait a whole detector tick after a stream ended",
        "oobleck_mm/master/machine.py",
        '    s.next_detection = float("-inf")  # a node\'s health changed',
        "    pass  # a node's health changed",
        "the first tick after a stream ended detects (test_the_machine_detects_every_detector_tick...)",
    ),
]

AGENT_MUTANTS = [
    (
        "listen to a thread of an earlier registration",
        "oobleck_mm/agent/machine.py",
        "    if session != ctx.state.session:",
        "    if False:",
        "a thread of an earlier registration is not listened to",
    ),
    (
        "assign to a worker restart mode killed",
        "oobleck_mm/agent/machine.py",
        "    if event.local_rank not in state.workers:",
        "    if False:",
        "an assignment only goes to a running worker",
    ),
    (
        "wait for a master forever",
        "oobleck_mm/agent/machine.py",
        "        if waited > ctx.settings.master_timeout:",
        "        if False:",
        "nothing waits forever",
    ),
    (
        "wait for the workers' shares forever",
        "oobleck_mm/agent/machine.py",
        "        if now >= state.writing.deadline:",
        "        if False:",
        "nothing waits forever",
    ),
    (
        "end the write at the first share",
        "oobleck_mm/agent/machine.py",
        "    if len(writing.saved) == len(writing.expected):",
        "    if writing.saved:",
        "a pending share is finished or reported",
    ),
    (
        "exit when the master forgets the node",
        "oobleck_mm/agent/machine.py",
        "    if ctx.settings.master_timeout is None:\n        _write_without_master(ctx, event.why)",
        "    if True:\n        _write_without_master(ctx, event.why)",
        "a healthy node always comes back as a join",
    ),
    (
        "write with no worker running",
        "oobleck_mm/agent/machine.py",
        "    if not state.workers:  # restart mode",
        "    if False:  # restart mode",
        "no crash on any order (test_a_master_lost_after_a_restart...)",
    ),
    (
        "tell the workers before collecting their shares",
        "oobleck_mm/agent/machine.py",
        "    ctx.effects.append(CollectShares())\n    ctx.effects.append(SendAll(",
        "    ctx.effects.append(SendAll(",
        "a pending share is finished or reported",
    ),
    (
        "try a lost master rarely",
        "oobleck_mm/agent/machine.py",
        "            state.next_try = now + ctx.settings.interval",
        "            state.next_try = now + 10 * ctx.settings.interval",
        "a lost master is tried every heartbeat interval",
    ),
]

WORKER_MUTANTS = [
    (
        "stop on a shutdown with a share still being written",
        "oobleck_mm/runtime/worker_machine.py",
        '        _finish_shares(state, out, f"shut down ({command.shutdown.reason})")\n',
        "",
        "a share written in the background is finished before the worker stops",
    ),
    (
        "say done with a share still being written",
        "oobleck_mm/runtime/worker_machine.py",
        '    _finish_shares(state, out, f"generation {run.generation}")\n',
        "",
        "a share written in the background is finished before the worker says done",
    ),
    (
        "answer MasterLost between generations with a share in flight",
        "oobleck_mm/runtime/worker_machine.py",
        '        _finish_shares(state, out, "the master is lost")\n        out.effects.append(ReportNothing())',
        "        out.effects.append(ReportNothing())",
        "a share written in the background is finished before the worker stops (found at depth)",
    ),
    (
        "answer MasterLost at a switch with nothing",
        "oobleck_mm/runtime/worker_machine.py",
        '    if command is not None and command.WhichOneof("command") == "master_lost":',
        "    if False:",
        "MasterLost inside a generation is answered with the step written together",
    ),
    (
        "keep a failed step's gradients",
        "oobleck_mm/runtime/worker_machine.py",
        "    _abort(state, out, event.step, event.message, discard=True)",
        "    _abort(state, out, event.step, event.message)",
        "a failed step discards its gradients and abandons the iteration",
    ),
    (
        "abandon an out-of-memory step and go on",
        "oobleck_mm/runtime/worker_machine.py",
        "    if event.out_of_memory:",
        "    if False:",
        "out of memory stops the worker",
    ),
    (
        "train on at a switch",
        "oobleck_mm/runtime/worker_machine.py",
        "    elif run.switch:",
        "    elif False:",
        "at a switch the next command is taken before any further step",
    ),
    (
        "train past the last step",
        "oobleck_mm/runtime/worker_machine.py",
        "    if run.next >= run.steps:",
        "    if run.next > run.steps:",
        "steps never run past the last",
    ),
    (
        "set up the next generation inside the old group",
        "oobleck_mm/runtime/worker_machine.py",
        "    out.effects.append(LeaveGroup())\n    state.running = None\n    _on_taken",
        "    state.running = None\n    _on_taken",
        "a group is left before the next set-up",
    ),
]

MACHINES = {
    # name: (the random model, the file a mutant must fail, mutants, default sequences)
    "master": (TEST, MUTANT_TESTS, MASTER_MUTANTS, 20_000),
    "agent": (
        "tests/unit/test_agent_machine.py::TestAgentMachine",
        "tests/unit/test_agent_machine.py",
        AGENT_MUTANTS,
        5_000,
    ),
    "worker": (
        "tests/unit/test_worker_machine.py::TestWorkerMachine",
        "tests/unit/test_worker_machine.py",
        WORKER_MUTANTS,
        5_000,
    ),
}


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
    parser.add_argument("--machine", choices=sorted(MACHINES), default="master", help="which machine (default master)")
    parser.add_argument(
        "--examples", type=int, default=None, help="random sequences for the model (default 20000; 5000 agent, worker)"
    )
    parser.add_argument("--mutants", action="store_true", help="also check that each mutant of the machine is caught")
    parser.add_argument("--mutant-examples", type=int, default=3000, help="sequences per mutant (default 3000)")
    parser.add_argument("--json", help="write the results here too")
    args = parser.parse_args()

    test, mutant_tests, mutants, default_examples = MACHINES[args.machine]
    examples = default_examples if args.examples is None else args.examples
    ok, result = True, {"machine": args.machine, "examples": examples}
    if examples:
        ok, result = deep(examples, test, args.machine)
    if args.mutants:
        result["mutants"] = []
        for name, file, text, replacement, guard in mutants:
            tree = mutant_tree(file, text, replacement)
            try:  # no shrinking: the question is only whether the model catches it
                passed, took, mout = run_model(
                    args.mutant_examples, tree, {"OOBLECK_MACHINE_SHRINK": "0"}, test=mutant_tests
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


def deep(examples: int, test: str = TEST, name: str = "master") -> tuple[bool, dict]:
    print(f"running {examples} random event sequences through the {name}'s machine ...", flush=True)
    ok, seconds, out = run_model(examples, ROOT, test=test)
    stats = re.findall(r"^\s+- ([\d.]+% .*)$|^\s+\* ([\d.]+%, .*)$", out, re.M)
    result = {
        "machine": name,
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
