#!/usr/bin/env python3
"""A churn soak on real processes: bursty spot churn against a failure-free run of the same job.

    python scripts/soak_churn.py                      # (a) built-in model, float64, 3+2-stage pipelines
    python scripts/soak_churn.py --killmaster         # (c) the same with the master killed inside a burst
    python scripts/soak_churn.py --hf                 # (b) a tiny HF LLaVA (SigLIP + Qwen2, tied), balancer on
    python scripts/soak_churn.py --json benchmarks/soak_churn.json
    python scripts/soak_churn.py --size-control       # also failure-free at each node count the churned run had

Runs ``oobleck-launch local`` twice with the same config: once without
failures, once with ``--churn`` (``oobleck_mm.faults.churn``), then judges the
churned run: exit 0, ``verify --windows`` (float64, every window between its
periodic checkpoints and to its final save within 1e-9 of the reference), every
incident of the recovery table with an outcome, no process left behind. It
prints the throughput of the churned run as a fraction of the failure-free one
(steps per second from the first step to the last), with ``--size-control`` also
as a fraction of the failure-free job at the node counts the churned run
trained at (on one machine's shared cores more simulated nodes make every step
slower, where a real cluster's get faster), per burst of kills, the
time from its last event to the next generation's resumption, and the waits
over a second: a phase that waited for one node, a slow leave of a generation.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from oobleck_mm.events import read_events  # noqa: E402

BASE_SETS = ["training.dtype=float64", "cluster.device_memory=8e6"]
"""float64 (exact verification) and a memory cap that makes n0 = 2: 5 nodes run 3+2-stage pipelines."""


def hf_llava_config(work: Path) -> str:
    """Soak (b): a random tiny LLaVA (SigLIP tower, Qwen2 with tied embeddings) saved with ``save_pretrained``
    under ``work``, trained with the balancer on; the memory cap gives 3+2-stage pipelines like (a)."""
    import yaml

    from oobleck_mm.model.tiny_hf import make_tiny_model

    raw = yaml.safe_load((ROOT / "configs" / "llava_tiny.yaml").read_text())
    raw["model"]["huggingface"] = make_tiny_model(work / "tiny_llava", "qwen2", "siglip", tie=True)
    raw["balance"]["enabled"] = True
    path = work / "llava.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


HF_TOLERANCE = 1e-6
"""verify's bound for soak (b). transformers' Qwen2RMSNorm computes in float32 whatever the model's dtype
(``hidden_states.to(torch.float32)``), so a float64 HF LLaVA is float32-precise there: a reduction-order
difference of 1e-16 can flip a float32 rounding, and 50-step windows then differ by ~1e-8, spread evenly
over every layer (measured). A logic error (a step skipped or applied twice, a stale layer) moves a
layer by about lr = 1e-3, far above this bound."""


def launch(
    config: str, nodes: int, steps: int, run_dir: Path, extra: list[str], sets: list[str], timeout: float
) -> tuple[int, str, float]:
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
        "--log-every",
        "50",
        *extra,
    ]
    for s in sets:
        cmd += ["--set", s]
    began = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    return done.returncode, done.stdout + done.stderr, time.perf_counter() - began


PHANTOM_STARTUP = (
    "import time; t = time.time(); import oobleck_mm.cli, oobleck_mm.agent.agent, oobleck_mm.runtime.agent_worker, torch; "
    "torch.optim.AdamW([torch.zeros(1, requires_grad=True)]); import oobleck_mm.runtime.store"
)
"""What a joining node's processes do before it can join (its agent's imports, then its worker's imports and
optimizer warm-up, ``agent_worker.worker_main``), in one process that then exits: the CPU a join costs the
other simulated nodes on this machine, without joining anything."""


def launch_with_startups(
    config: str, nodes: int, steps: int, run_dir: Path, sets: list[str], timeout: float, at_seconds: list[float]
) -> tuple[int, str, float]:
    """``launch`` (failure-free) while a phantom start-up (``PHANTOM_STARTUP``) begins at each of ``at_seconds``
    after the launch: the control that tells a churned run's recovery cost from its joiners' start-up CPU."""
    stop = threading.Event()
    phantoms: list[subprocess.Popen] = []

    def fire() -> None:
        began = time.monotonic()
        for at in sorted(at_seconds):
            if stop.wait(max(0.0, at - (time.monotonic() - began))):
                return
            phantoms.append(subprocess.Popen([sys.executable, "-c", PHANTOM_STARTUP], cwd=ROOT))

    thread = threading.Thread(target=fire, daemon=True)
    thread.start()
    try:
        return launch(config, nodes, steps, run_dir, [], sets, timeout)
    finally:
        stop.set()
        thread.join()
        for p in phantoms:
            p.wait(timeout=120)


def steps_by_size(events_path: Path) -> dict[int, int]:
    """Live node count -> how many of the run's steps trained at it."""
    out: dict[int, int] = {}
    for e in read_events(events_path, "step"):
        out[e["live_nodes"]] = out.get(e["live_nodes"], 0) + 1
    return out


DEFAULT_CHURN = "50,burst=3,min=4,max=9,seed=1,spread=0.8,preempt=0.2,notice=3,duration=150,start=3,warmup=10,calm=1.5"
"""Issue 27's soak: >= 60 events inside a 600-step run of the built-in model (the timeline holds 63 by 90 s of
launch time; the churned run takes 90-130 s here, the failure-free one ~65 s), bursts of up to 3 events 0.8 s
apart at most, 20% of failures preemptions with 3 s of notice, failures at least ``calm`` 1.5 s apart (a
recovery's copy restores the second replica ~0.35 s after the loss) and between 4 and 9 live nodes. Its events
come at wall-clock times: a slower run meets more of them."""

SIZE_CONTROL_MIN_SHARE = 0.05
"""A node count the churned run spent fewer of its steps at is priced at the nearest count measured."""


def same_size_seconds(sizes: dict[int, int], step_s: dict[int, float]) -> float:
    """What the churned run's steps would take failure-free at the sizes they trained at: each size's steps
    times the failure-free step time measured at that size (else at the nearest size measured)."""
    return sum(n * step_s[min(step_s, key=lambda m: (abs(m - size), m))] for size, n in sizes.items())


def training_seconds(events_path: Path) -> float:
    """Wall seconds from the first step's report to the last one's."""
    steps = read_events(events_path, "step")
    return steps[-1]["ts"] - steps[0]["ts"] if len(steps) > 1 else float("nan")


def leftovers(run_dir: Path) -> list[int]:
    """Processes still alive that this run started (their command line names its run dir or its master)."""
    out = []
    text = str(run_dir)
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if any(text in part for part in (p.info["cmdline"] or [])):
                out.append(p.info["pid"])
        except psutil.Error:
            pass
    return out


def burst_recoveries(events_path: Path) -> list[dict]:
    """Per burst of failures (injected events of one ``churn burst K``) that cost the plan a node: seconds from
    its last event to the first ``resumed`` of a generation planned after it. A burst that only killed nodes
    still starting (not in the plan) needs no recovery: the next ``resumed`` is a later join's, not its own."""
    planned_losses = {e["node"] for e in read_events(events_path, "lost") if e.get("in_plan")}
    planned_losses |= {e["node"] for e in read_events(events_path, "leaving") if e.get("in_plan")}
    injected = [e for e in read_events(events_path, "injected") if str(e.get("source", "")).startswith("churn burst")]
    resumed = read_events(events_path, "resumed")
    decided = {e["generation"]: e["ts"] for e in read_events(events_path, "plan_decided")}
    bursts: dict[str, list[dict]] = {}
    for e in injected:
        bursts.setdefault(e["source"].split(" event")[0], []).append(e)
    out = []
    for name, group in bursts.items():
        if any(e["kind"] == "join" for e in group):
            continue  # a join waits for its workers' start-up: not a planning figure
        if not any(e["node"] in planned_losses for e in group):
            continue
        last = max(e["ts"] for e in group)
        after = [r for r in resumed if decided.get(r["generation"], 0) >= last]
        if after:
            out.append({"burst": name, "events": len(group), "to_resumed_s": round(after[0]["ts"] - last, 3)})
    return out


def table_outcomes(events_path: Path) -> list[str]:
    """The recovery table's outcome column (``faults.report``, what the console prints at the end)."""
    from oobleck_mm.faults.report import recovery_rows

    return [row.outcome for row in recovery_rows(read_events(events_path))]


SLOW_WAIT_S = 1.0
"""A generation phase whose last report came this long after its first, or a worker's leave of its
groups that took this long, is listed: what the churned run's time went to (the node waited for)."""


def slow_waits(events_path: Path) -> list[dict]:
    """The churned run's waits over ``SLOW_WAIT_S``: phases that waited for one node (the phase events'
    ``last`` and ``spread_s``) and slow leaves of a generation's groups (``aborted``'s ``leave_s``)."""
    out = []
    for e in read_events(events_path):
        if e["event"] in ("rendezvous_done", "states_copied", "resumed") and e.get("spread_s", 0) > SLOW_WAIT_S:
            out.append(
                {
                    "generation": e["generation"],
                    "seconds": e["spread_s"],
                    "what": f"generation {e['generation']} ({e.get('cause', '?')}): {e['event']} waited for "
                    f"{e.get('last')}",
                }
            )
        elif e["event"] == "aborted" and e.get("leave_s", 0) > SLOW_WAIT_S:
            out.append(
                {
                    "generation": e["generation"],
                    "seconds": e["leave_s"],
                    "what": f"generation {e['generation']}: {e['node']} left its groups slowly ({e['message'][:60]})",
                }
            )
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(ROOT / "configs" / "tiny_mm.yaml"))
    parser.add_argument("--nodes", type=int, default=6)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--churn", default=DEFAULT_CHURN)
    parser.add_argument("--set", action="append", default=[], dest="sets", help="more --set overrides")
    parser.add_argument("--killmaster", action="store_true", help="also kill the master inside a burst")
    parser.add_argument(
        "--hf",
        action="store_true",
        help="soak (b): a tiny HF LLaVA (SigLIP + Qwen2, tied embeddings) with the balancer on",
    )
    parser.add_argument(
        "--tolerance",
        type=float,
        default=None,
        help="verify's bound per window (default 1e-9; 1e-6 with --hf: see HF_TOLERANCE)",
    )
    parser.add_argument("--checkpoint-interval", type=int, default=50)
    parser.add_argument("--timeout", type=float, default=3000)
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--size-control",
        action="store_true",
        help="also run the failure-free job at each node count the churned run trained at: on one "
        "machine's shared cores more simulated nodes make every step slower (the failure-free "
        "job took 0.102, 0.115 and 0.122 s a step on 6, 7 and 8 nodes here), which on a real "
        "cluster they make faster",
    )
    parser.add_argument("--size-control-steps", type=int, default=200)
    parser.add_argument(
        "--startup-control",
        action="store_true",
        help="also run the failure-free job with the churned run's joiners' start-ups beside it "
        "(no joins): how much of the loss is their CPU on this machine",
    )
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="oobleck-soak-"))
    if args.hf:
        args.config = hf_llava_config(work)
    sets = [*BASE_SETS, *args.sets]
    print(f"failure-free run: {args.nodes} nodes, {args.steps} steps ({work}/free)", flush=True)
    code0, out0, wall0 = launch(args.config, args.nodes, args.steps, work / "free", [], sets, args.timeout)
    free_s = training_seconds(work / "free" / "events.jsonl")
    print(f"  exit {code0}, {free_s:.1f} s of training ({wall0:.1f} s in all)", flush=True)

    extra = ["--churn", args.churn, "--save-final", str(work / "churn" / "final")]
    churn_sets = [
        *sets,
        "fault_tolerance.keep_checkpoints=0",
        f"fault_tolerance.checkpoint_interval={args.checkpoint_interval}",
    ]
    if args.killmaster:
        extra += ["--inject", "killmaster@t20s"]
    print(
        f"churned run: --churn {args.churn}{' + killmaster@t20s' if args.killmaster else ''} ({work}/churn)", flush=True
    )
    code1, out1, wall1 = launch(args.config, args.nodes, args.steps, work / "churn", extra, churn_sets, args.timeout)
    events = work / "churn" / "events.jsonl"
    churn_s = training_seconds(events)
    injected = read_events(events, "injected")
    skipped = read_events(events, "inject_skipped")
    print(
        f"  exit {code1}, {churn_s:.1f} s of training ({wall1:.1f} s in all); {len(injected)} events injected, "
        f"{len(skipped)} skipped; {len(read_events(events, 'plan_decided'))} generations",
        flush=True,
    )
    if code1 != 0:
        print(out1[-5000:])
    outcomes = table_outcomes(events)
    no_outcome = [o for o in outcomes if o in ("", "-")]
    time.sleep(2)
    left = leftovers(work / "churn")

    verified, verify_out = False, ""
    if code1 == 0:
        cmd = [
            sys.executable,
            "-m",
            "oobleck_mm.cli",
            "verify",
            "--config",
            args.config,
            "--steps",
            str(args.steps),
            "--against",
            str(work / "churn" / "final"),
            "--windows",
            str(work / "churn" / "checkpoints"),
        ]
        tolerance = args.tolerance if args.tolerance is not None else (HF_TOLERANCE if args.hf else None)
        if tolerance is not None:
            cmd += ["--tolerance", str(tolerance)]
        for s in churn_sets:
            cmd += ["--set", s]
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout)
        verified, verify_out = done.returncode == 0, done.stdout.strip()
        print("verify --windows:\n  " + "\n  ".join(verify_out.splitlines()[-4:]), flush=True)

    ratio = free_s / churn_s if churn_s == churn_s and churn_s > 0 else float("nan")
    control_s = float("nan")
    if args.startup_control:
        joins = [e["seconds"] for e in injected if e["kind"] == "join"]
        print(
            f"control: failure-free with {len(joins)} joiners' start-ups beside it, no joins ({work}/control)",
            flush=True,
        )
        code2, _, wall2 = launch_with_startups(
            args.config, args.nodes, args.steps, work / "control", sets, args.timeout, joins
        )
        control_s = training_seconds(work / "control" / "events.jsonl")
        print(
            f"  exit {code2}, {control_s:.1f} s of training ({wall2:.1f} s in all): failure-free "
            f"{free_s / control_s:.1%} of the failure-free run's throughput with the start-ups beside it; churned "
            f"{control_s / churn_s:.1%} of this control",
            flush=True,
        )
    same_size_s = float("nan")
    size_step_s: dict[int, float] = {}
    if args.size_control and churn_s == churn_s:
        sizes = steps_by_size(events)
        size_step_s[args.nodes] = free_s / max(1, args.steps - 1)
        for size, n in sorted(sizes.items()):
            if size in size_step_s or n < SIZE_CONTROL_MIN_SHARE * args.steps:
                continue
            run = work / f"size{size}"
            code, _, _ = launch(args.config, size, args.size_control_steps, run, [], sets, args.timeout)
            if code == 0:
                size_step_s[size] = training_seconds(run / "events.jsonl") / max(1, args.size_control_steps - 1)
        same_size_s = same_size_seconds(sizes, size_step_s)
        print(
            f"size control: steps per node count {dict(sorted(sizes.items()))}; failure-free step time "
            + ", ".join(f"{k} nodes {v * 1000:.0f} ms" for k, v in sorted(size_step_s.items()))
            + f": {same_size_s:.1f} s failure-free at the churned run's sizes; churned "
            f"{same_size_s / churn_s:.1%} of that",
            flush=True,
        )
    recoveries = burst_recoveries(events)
    waits = slow_waits(events)
    result = {
        "config": "tiny HF LLaVA (SigLIP + Qwen2, tied), balancer on" if args.hf else Path(args.config).name,
        "nodes": args.nodes,
        "steps": args.steps,
        "churn": args.churn,
        "killmaster": args.killmaster,
        "free_exit": code0,
        "free_training_s": round(free_s, 2),
        "churn_exit": code1,
        "churn_training_s": round(churn_s, 2),
        "throughput_fraction": round(ratio, 3),
        "events_injected": len(injected),
        "events_skipped": len(skipped),
        "generations": len(read_events(events, "plan_decided")),
        "incidents": len(outcomes),
        "incidents_without_outcome": len(no_outcome),
        "leftover_pids": left,
        "verified": verified,
        "verify": verify_out.splitlines()[-1] if verify_out else "",
        "burst_to_resumed_s": recoveries,
        "slow_waits": waits,
        "run_dir": str(work),
        "startup_control_training_s": round(control_s, 2) if control_s == control_s else None,
        "throughput_vs_startup_control": round(control_s / churn_s, 3) if control_s == control_s else None,
        "steps_by_live_nodes": steps_by_size(events),
        "size_control_step_s": {k: round(v, 4) for k, v in sorted(size_step_s.items())} or None,
        "same_size_failure_free_s": round(same_size_s, 2) if same_size_s == same_size_s else None,
        "throughput_vs_same_sizes": round(same_size_s / churn_s, 3) if same_size_s == same_size_s else None,
    }
    print(
        f"throughput {ratio:.1%} of failure-free; {len(outcomes)} incidents, {len(no_outcome)} without outcome; "
        f"leftover processes {left or 'none'}; verified {verified}"
    )
    if recoveries:
        times = sorted(r["to_resumed_s"] for r in recoveries)
        print(
            f"kill bursts: last event -> resumed, median {times[len(times) // 2]:.2f} s, max {times[-1]:.2f} s "
            f"over {len(times)} bursts"
        )
    for wait in waits:
        print(f"  waited {wait['seconds']:.2f} s: {wait['what']}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    ok = code0 == 0 and code1 == 0 and verified and not left and not no_outcome
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
