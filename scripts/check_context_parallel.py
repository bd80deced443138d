#!/usr/bin/env python3
"""Samples longer than any plain mapping holds, on four context-parallel lanes, through a kill and a join
(issue 50's "done when"), for the built-in model and a HuggingFace LLaVA.

    python scripts/check_context_parallel.py                     # both models
    python scripts/check_context_parallel.py --models builtin    # or hf
    python scripts/check_context_parallel.py --json benchmarks/check_context_parallel.json

Per model, in a temporary directory (nothing downloads: the LLaVA is a random tiny CLIP + Llama written with
``save_pretrained``):

1. **The samples do not fit.** At the check's memory cap (``cluster.device_memory``), the planner must
   refuse a plain mapping (``context_parallel: 1``) of the long samples on every node count the model's
   layers allow; the longest samples a plain mapping holds there are found by bisection and printed, with
   the ratio, which must be at least 4: the lanes split the tokens and shard the layers' state (FSDP2 over
   the lanes), so four of them hold 4x a plain stage's samples.
2. **They train on four lanes.** ``oobleck-launch local`` with ``context_parallel: 4`` (a node's four
   simulated GPUs split every sample's tokens), float64, ``--inject kill:node2@step2,join@step3``: a
   node is killed (the survivors re-form from the templates and copy its layers from a replica), a node
   joins; every plan must be context-parallel, the lost node the killed one, the last plan on all five
   nodes (the joiner in).
3. **Equal to the reference.** ``oobleck-launch verify`` compares the final checkpoint with the reference
   trainer (one process, the whole sequence, no context parallelism) in float64: 1e-9 for the built-in
   model, 1e-7 for the LLaVA (transformers' RMSNorm computes in float32 even in a float64 model: see
   tests/e2e/test_huggingface.py's ``CP_TOLERANCE``).

Exit 0 when every model passes all three, 1 otherwise. Too heavy for the suite on a 2-core machine (20
worker processes, then a joiner's four, of ~3,000-token float64 attention); the suite holds the pieces (tests/e2e/
test_context_parallel.py, tests/e2e/test_huggingface.py at two lanes; tests/integration/
test_context_parallel_training.py at four lanes without faults).
"""

from __future__ import annotations

import argparse
import copy
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from oobleck_mm.events import read_events  # noqa: E402

LANES = 4
NODES = 5
"""Pipelines of two and three nodes of four lanes (``fault_tolerance.f: 1`` needs 2 n0 + 1 = 5 nodes to cover
every node count): the kill leaves two of two nodes, the join brings a third node back."""
FAULTS = "kill:node2@step2,join@step3"
"""The join early: a joiner takes a few steps to come in, more on a loaded machine."""

MODELS = {
    # name: (memory cap in bytes, mean text tokens of a long sample, verify tolerance). The long samples are
    # over 4x the longest any plain mapping holds at the cap (``longest_plain``: ~284 and ~722 tokens, found to
    # ``STEP`` tokens) and take two nodes of lanes.
    "builtin": (3_000_000, 1400, 1e-9),
    "hf": (3_000_000, 2960, 1e-7),
}
AT_LEAST = 4.0
"""How many times the longest plain sample the long samples must be (issue 50's "done when"), counted from
the bisection's upper bound (``longest_plain`` + ``STEP``: no plain mapping holds that)."""
STEP = 8
"""``longest_plain``'s resolution in tokens."""


def make_config(work: Path, name: str, tokens: int, context_parallel: int, steps: int) -> Path:
    cap = MODELS[name][0]
    if name == "builtin":
        raw = yaml.safe_load((ROOT / "configs" / "tiny_mm.yaml").read_text())
        for part in ("vision", "projector"):
            raw["model"].pop(part)
        raw["data"].update(mean_images_per_sample=0, max_images_per_sample=0)
    else:
        from oobleck_mm.model.tiny_hf import make_tiny_model

        raw = yaml.safe_load((ROOT / "configs" / "llava_tiny.yaml").read_text())
        folder = work / "tiny_llava"
        raw["model"]["huggingface"] = (
            str(folder) if folder.exists() else make_tiny_model(folder, "llama", "clip", tie=False)
        )
        raw["balance"]["enabled"] = False
    raw["data"].update(mean_text_tokens=tokens, max_seq_len=max(2048, 2 * tokens))
    # One sample a microbatch, one microbatch a pipeline: the check's attention is a few long samples' (float64
    # on a 2-core machine, 20 workers).
    raw["training"].update(dtype="float64", steps=steps, global_batch=2, microbatch_size=1)
    raw["cluster"].update(nodes=NODES, gpus_per_node=LANES, device_memory=cap, context_parallel=context_parallel)
    # A lane's work between two transfers takes seconds here (20 workers of ~3,000-token float64 attention on a
    # few cores): collective_timeout (heartbeat_timeout + 5 s) must exceed it, or every step is abandoned.
    raw["fault_tolerance"].update(f=1, heartbeat_interval="500ms", heartbeat_timeout="20s", straggler_factor=0)
    path = work / f"{name}_{tokens}_cp{context_parallel}.yaml"
    path.write_text(yaml.safe_dump(copy.deepcopy(raw)))
    return path


def longest_plain(work: Path, name: str, steps: int) -> int:
    """The longest mean sample (to ``STEP`` tokens) a plain mapping holds at the model's cap, by bisection."""
    lo, hi = 16, MODELS[name][1]
    while hi - lo > STEP:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(make_config(work, name, mid, 1, steps))[0] else (lo, mid)
    return lo


def fits(config: Path) -> tuple[bool, str]:
    """Whether the planner finds any mapping of ``config``'s model and samples, and its message if not."""
    from oobleck_mm.config import load_config
    from oobleck_mm.errors import UserError
    from oobleck_mm.planning.costs import ClusterSpec
    from oobleck_mm.planning.stage_mapping import min_nodes
    from oobleck_mm.profiling.analytical import profile_from_config

    job = load_config(str(config))
    try:
        n0 = min_nodes(profile_from_config(job), ClusterSpec.from_config(job.cluster))
    except UserError as refused:
        return False, str(refused).splitlines()[0]
    return True, f"fits on {n0} node(s) of {job.cluster.gpus_per_node} GPUs"


def cli(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "oobleck_mm.cli", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


def check(name: str, work: Path, steps: int, timeout: float) -> dict:
    cap, tokens, tolerance = MODELS[name]
    plain = longest_plain(work, name, steps)
    long_fits, long_why = fits(make_config(work, name, tokens, 1, steps))
    config = make_config(work, name, tokens, LANES, steps)
    cp_fits, cp_why = fits(config)
    print(
        f"{name}: at device_memory {cap / 1e6:g} MB a plain mapping holds samples of up to ~{plain} tokens; "
        f"{tokens}-token samples (x{tokens / (plain + STEP):.2f} of the {plain + STEP} no plain mapping holds) "
        f"without context parallelism: {long_why}; "
        f"with context_parallel {LANES}: {cp_why}",
        flush=True,
    )
    row = {
        "device_memory": cap,
        "nodes": NODES,
        "lanes": LANES,
        "long_tokens": tokens,
        "longest_plain_tokens": plain,
        "long_vs_plain": tokens / plain,
        "long_vs_refused_plain": tokens / (plain + STEP),
        "long_fits_without_cp": long_fits,
        "long_fits_with_cp": cp_fits,
        "faults": FAULTS,
    }
    run_dir, final = work / f"{name}_run", work / f"{name}_final"
    began = time.perf_counter()
    done = cli(
        "local", "--config", str(config), "--run-dir", str(run_dir), "--inject", FAULTS,
        "--save-final", str(final), timeout=timeout,
    )  # fmt: skip
    row["exit"] = done.returncode
    row["wall_s"] = time.perf_counter() - began
    events = run_dir / "events.jsonl"
    layouts = [e["describe"] for e in read_events(events, "plan_decided")] if events.exists() else []
    lost = [e["node"] for e in read_events(events, "lost")] if events.exists() else []
    decided = read_events(events, "plan_decided") if events.exists() else []
    row.update(
        plans=layouts,
        lost=lost,
        causes=[e["cause"] for e in decided],
        final_nodes=len(decided[-1]["nodes"]) if decided else 0,
    )
    print(
        f"  local: exit {done.returncode} in {row['wall_s']:.0f} s; {len(layouts)} plans ({', '.join(row['causes'])}); "
        f"lost {lost}; the last plan on {row['final_nodes']} nodes",
        flush=True,
    )
    for layout in layouts:
        print(f"    {layout}", flush=True)
    if done.returncode != 0:
        print(done.stdout[-3000:] + done.stderr[-3000:], flush=True)
    verified = cli(
        "verify", "--config", str(config), "--steps", str(steps), "--against", str(final),
        "--tolerance", str(tolerance), timeout=timeout,
    ) if done.returncode == 0 else None  # fmt: skip
    row["verify_exit"] = verified.returncode if verified else None
    row["verify"] = verified.stdout.strip().splitlines()[-3:] if verified else []
    print("  verify: " + ("\n    ".join(row["verify"]) if verified else "not run"), flush=True)
    row["passed"] = (
        tokens >= AT_LEAST * (plain + STEP)
        and not long_fits
        and cp_fits
        and done.returncode == 0
        and len(layouts) >= 3
        and all("(cp)" in layout for layout in layouts)
        and lost == ["node2"]
        and row["final_nodes"] == NODES
        and row["verify_exit"] == 0
    )
    print(f"  {name}: {'PASSED' if row['passed'] else 'FAILED'}", flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated: {', '.join(MODELS)}")
    parser.add_argument("--steps", type=int, default=6, help="training steps (default 6)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per launch and per verify")
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument(
        "--work", help="keep the configs, run directories and checkpoints here (default: a temporary one)"
    )
    args = parser.parse_args(argv)
    names = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in names if m not in MODELS]
    if unknown:
        parser.error(f"--models: {unknown} unknown; valid: {', '.join(MODELS)}")
    if args.steps < 4:
        parser.error(f"--steps: must be >= 4 (the faults land at steps 2 and 3), got {args.steps}")
    if args.work:
        Path(args.work).mkdir(parents=True, exist_ok=True)
        result = {name: check(name, Path(args.work), args.steps, args.timeout) for name in names}
    else:
        with tempfile.TemporaryDirectory(prefix="check_cp_") as tmp:
            result = {name: check(name, Path(tmp), args.steps, args.timeout) for name in names}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0 if all(r["passed"] for r in result.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
