"""The emulated cluster as a measuring instrument (``cluster.emulate``, docs/emulation.md), and what it measures.

    python scripts/bench_emulated.py calibrate [--pipelines 1,2,4,8,16] [--json out.json]
    python scripts/bench_emulated.py churn [--nodes 8] [--restart] [--json out.json]
    python scripts/bench_emulated.py straggler [--nodes 8] [--steps 100] [--json out.json]
    python scripts/bench_emulated.py join [--runs 5] [--json out.json]
    python scripts/bench_emulated.py balance [--nodes 7] [--json out.json]
    python scripts/bench_emulated.py simulate CHURN.json

``calibrate`` runs the guards that make an emulated run a measurement, on real
processes (gloo groups of the engine's workers, ``runtime.worker.run_local``):

(a) known delay: every true duration of the odd steps x1.1 (``TruthProfile.odd_steps_scale``)
    must make them 10% +- 1.5% longer than the even steps of the same run (interleaved,
    so that whatever load the host carries falls on both alike);
(b) scaling: 1, 2, 4, 8, 16 pipelines of two stages each must step within +-5% of
    the exact 1F1B time (``balance.schedule_time.iteration_time``: DeepSpeed's
    schedule as a recurrence, held to its instruction streams by its tests) of the
    same true durations, plus the gradient all-reduce.

The model is GPT-3 2.7B's shape with 16 blocks (its ops 30-120 ms on an emulated
A100), without noise or per-kind factors, so the exact time is known; the
network at 400 GB/s, so the transfers the 1F1B recurrence does not price stay
under 0.1% of a step. Every figure comes with the run's validity (lateness of its
ops, the host's CPU): an invalid calibration is not a result.

``churn`` runs MLLM-10B on emulated A100-80GB nodes under bursty spot churn, then
failure-free at every node count the churned run trained at, and prints the
churned throughput as a fraction of those (time-weighted), of the full-size
failure-free run, and the bound the state copies' bytes set at the configured
bandwidth; ``--restart`` adds the same churn under checkpoint-restart.

``straggler`` slows one of 8 nodes 2x for good (``slow:NODE@stepNx2``) and prints
the throughput from the slowdown on against the unslowed run, with detection only,
with the re-split alone, and with the engine's whole mitigation (the re-split and the
slow pipeline re-cut for its speeds, then the bench weighed: ``oobleck_mm/master/benching.py``);
target 90%.

``join`` measures the survivors' longest step around a join, in median steps,
for a join alone and a join 3 steps after a loss (target 1.5), and their pause.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from oobleck_mm.balance.assignment import contiguous_assignment  # noqa: E402
from oobleck_mm.balance.schedule_time import iteration_time  # noqa: E402
from oobleck_mm.config import config_from_dict  # noqa: E402
from oobleck_mm.emulation.clock import Lateness  # noqa: E402
from oobleck_mm.emulation.truth import Truth  # noqa: E402
from oobleck_mm.emulation.validity import HostCpu, judge  # noqa: E402
from oobleck_mm.events import read_events  # noqa: E402
from oobleck_mm.planning.layout import ExecutionPlan  # noqa: E402

STAGES = 2
BLOCKS = 32
MICROBATCH_SIZE = 4
MICROBATCHES = 4
"""Per pipeline: 1F1B's ramp and drain are 1 of 5 slots, so a wrong schedule shows."""
WARMUP_STEPS = 2
"""Steps left out of a timing: the first allocations and the first sleeps' page faults."""


WIDTHS = {"2.7b": (2560, 32), "6.7b": (4096, 32)}
"""GPT-3 shapes (hidden, heads) the calibration model may take: the wider, the longer each emulated op for the
same CPU math (the compute copy is shrunk to the same width)."""


def calibration_job(
    pipelines: int,
    profile: str,
    steps: int,
    microbatches: int = MICROBATCHES,
    width: str = "2.7b",
    coarsen: int | None = None,
):
    """GPT-3's blocks (``BLOCKS`` of them, ``width``), emulated on A100s, one pipeline of two stages per two
    nodes."""
    hidden, heads = WIDTHS[width]
    return config_from_dict(
        {
            "model": {
                "name": "calibration-gpt",
                "llm": {
                    "num_layers": BLOCKS,
                    "hidden": hidden,
                    "num_heads": heads,
                    "ffn_hidden": 4 * hidden,
                    "vocab_size": 50257,
                },
            },
            "data": {"kind": "synthetic", "mean_text_tokens": 2048, "max_seq_len": 2048, "num_samples": 4096},
            "training": {
                "global_batch": MICROBATCH_SIZE * microbatches * pipelines,
                "microbatch_size": MICROBATCH_SIZE,
                "steps": steps,
                "dtype": "bfloat16",
                "optimizer": {"type": "AdamW", "params": {"lr": 1.0e-4}},
            },
            "fault_tolerance": {"f": 0},
            "cluster": {
                "nodes": STAGES * pipelines,
                "gpus_per_node": 1,
                "device": "cpu",
                "emulate": "a100-80gb",
                "emulate_profile": profile,
                "inter_node_bandwidth": "400GB/s",
                "emulate_coarsen": coarsen,
            },
        }
    )


def write_profile(directory: Path, scale: float, odd_steps_scale: float = 1.0) -> str:
    path = directory / f"truth_x{scale:g}_odd_x{odd_steps_scale:g}.json"
    path.write_text(json.dumps({"factors": {}, "noise": 0.0, "scale": scale, "odd_steps_scale": odd_steps_scale}))
    return str(path)


def predicted_step_s(truth: Truth, data, plan: ExecutionPlan, step: int) -> float:
    """The exact 1F1B time of ``plan``'s slowest pipeline over step ``step``'s true durations (``truth`` and the
    real job's ``data``), plus the slowest stage's gradient all-reduce."""
    ids = data.global_batch(step)
    assignment = contiguous_assignment(ids, [p.num_microbatches for p in plan.pipelines], plan.microbatch_size)
    slowest = 0.0
    for pipeline, microbatches in zip(plan.pipelines, assignment.pipelines):
        groups = [truth.groups(stage.layers) for stage in pipeline.stages]
        times = np.array([[truth.stage_seconds(g, data.metas(mb)) for mb in microbatches] for g in groups])
        slowest = max(slowest, iteration_time(times[:, :, 0], times[:, :, 1]))
    allreduce = max(truth.allreduce_s(stage.layers, len(plan.pipelines)) for p in plan.pipelines for stage in p.stages)
    return slowest + allreduce


def run(job, steps: int, workdir: Path) -> dict:
    """Trains ``job`` on its even plan for ``steps``; the measured step times (slowest rank) after the warm-up,
    the exact prediction, and the run's validity. ``lag_share``: the time every rank's device idled for its
    host (and its syncs woke late), over the ranks' time: what the host's load can have added to a step."""
    from oobleck_mm.data.loader import TrainingData
    from oobleck_mm.runtime.worker import run_local

    pipelines = job.cluster.nodes // STAGES
    plan = ExecutionPlan.even(
        BLOCKS + 2, [STAGES] * pipelines, [MICROBATCHES] * pipelines, job.training.microbatch_size
    )
    cpu = HostCpu()
    began = time.time()
    outs = run_local(job, plan, steps, workdir, timeout_s=600)
    cpu.stop()
    per_step = [max(o["results"][s].step_time_s for o in outs) for s in range(steps)]
    lateness = Lateness()
    for o in outs:
        for r in o["results"][WARMUP_STEPS:]:
            lateness.merge(r.lateness)
    timed = range(WARMUP_STEPS, steps)
    rows = [
        {
            "emulated_ops": lateness.ops,
            "emulated_late_ops": lateness.late_ops,
            "emulated_worst_lateness": lateness.worst,
            # what the workers asked of the host (the verdict's cores), per timed step
            "emulated_host_cpu_s": statistics.mean(sum(o["results"][s].host_cpu_s for o in outs) for s in timed),
            "emulated_busiest_rank_cpu_s": max(o["results"][s].host_cpu_s for o in outs for s in timed),
            "step_time_s": statistics.mean(per_step[s] for s in timed),
        }
    ]
    verdict = judge(rows, cpu.share(began + sum(per_step[:WARMUP_STEPS]), time.time()))
    measured = statistics.median(per_step[s] for s in timed)
    # The host's set-up of each step before its first op (assignment, packing), the slowest rank's: device
    # idle time that is the step's own, reported apart from the device's (``emulation.clock.Lateness.setup_s``).
    setup = statistics.median(max(o["results"][s].lateness.setup_s for o in outs) for s in timed)
    truth, data = Truth(job), TrainingData(job)
    exact = {s: predicted_step_s(truth.at_step(s), data, plan, s) for s in timed}
    predicted = statistics.median(exact.values())
    # Each step against the exact time of its own samples without an odd step's delay: the steps' batches
    # differ, so the delay shows as the odd steps' ratio over the even steps'.
    undelayed = {s: predicted_step_s(truth.at_step(0), data, plan, s) for s in timed}
    even, odd = ([per_step[s] / undelayed[s] for s in timed if s % 2 == parity] for parity in (0, 1))
    return {
        "pipelines": pipelines,
        "measured_s": measured,
        "predicted_s": predicted,
        "even_ratio": statistics.median(even),
        "odd_ratio": statistics.median(odd) if odd else None,
        "ratio": measured / predicted,
        "valid": verdict.valid,
        "verdict": verdict.reason,
        "deadlines_kept": lateness.valid,
        "cpu_share": verdict.cpu_share,
        "lag_share": lateness.late_s / (len(outs) * sum(per_step[s] for s in timed)),
        "setup_s": setup,
        "setup_share": setup / measured,
    }


def calibrate(pipeline_counts: list[int], steps: int, delay_pipelines: int, **shape) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        base, delayed = write_profile(tmp, 1.0), write_profile(tmp, 1.0, odd_steps_scale=1.1)
        scaling = []
        for p in pipeline_counts:
            result = run(calibration_job(p, base, steps, **shape), steps, tmp / f"p{p}")
            scaling.append(result)
            print(
                f"(b) {p:2d} pipelines: {result['measured_s']:.3f} s/step measured, {result['predicted_s']:.3f} "
                f"exact 1F1B: {100 * (result['ratio'] - 1):+.1f}%  [{result['verdict']}]",
                flush=True,
            )
        slow = run(calibration_job(delay_pipelines, delayed, steps, **shape), steps, tmp / "delayed")
        delay = {
            "pipelines": delay_pipelines,
            "even_ratio": slow["even_ratio"],
            "odd_ratio": slow["odd_ratio"],
            "ratio": slow["odd_ratio"] / slow["even_ratio"],
            "valid": slow["valid"],
            "verdict": slow["verdict"],
        }
        print(
            f"(a) every duration of the odd steps x1.1: even steps x{delay['even_ratio']:.4f}, odd steps "
            f"x{delay['odd_ratio']:.4f} of their exact undelayed times: x{delay['ratio']:.4f} (target 1.10 +- "
            f"0.015)  [{delay['verdict']}]",
            flush=True,
        )
    return {"scaling": scaling, "delay": delay}


MLLM_SETS = [
    "cluster.emulate=a100-80gb",
    "cluster.device=cpu",
    "cluster.backend=gloo",
    "cluster.gpus_per_node=1",
    "cluster.max_gpus_per_stage=1",
    "cluster.inter_node_bandwidth=200Gbps",
    "training.microbatch_size=4",
]
"""MLLM-10B as issue 48 measures it: emulated A100-80GB nodes of one GPU and a 200 Gb/s NIC, microbatches of 4
(the compute copy's CPU per sample: 43 ms, against 69 ms for microbatches of 1; docs/benchmarks.md)."""
DEFAULT_CHURN = "1,burst=3,min=6,max=9,seed=3,spread=0.8,preempt=0.3,notice=10,duration=700,start=30,warmup=10,calm=1.5"
"""About one event every 30 s of job time: a burst a minute of up to 3 events within 0.8 s, 30% preemptions with
10 s of notice, between 6 ((f + 1) n0 for MLLM-10B on A100-80GB) and 9 live nodes, for 700 s."""


def verdict_of(run_dir: Path) -> dict:
    path = run_dir / "emulation.json"
    return json.loads(path.read_text()) if path.exists() else {"valid": False, "reason": "no emulation.json"}


def copy_seconds(events_path: Path) -> float:
    """Seconds the run's generations spent copying layer states (each generation's slowest receiver)."""
    per_generation: dict[int, float] = {}
    for e in read_events(events_path, "states_copied"):
        per_generation[e["generation"]] = max(per_generation.get(e["generation"], 0.0), e.get("transfer_seconds", 0.0))
    return sum(per_generation.values())


def churn(args) -> dict:
    """Churn against failure-free runs at the node counts the churned run trained at, time-weighted; the bound
    the state copies' bytes set; the same churn under checkpoint-restart."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from soak_churn import SIZE_CONTROL_MIN_SHARE, launch, same_size_seconds, steps_by_size, training_seconds

    work = Path(tempfile.mkdtemp(prefix="oobleck-emulated-churn-"))
    sets = [*MLLM_SETS, f"training.global_batch={args.global_batch}", *args.sets]
    config = str(ROOT / "configs" / "mllm_10b.yaml")
    runs = {"live": ["--churn", args.churn]}
    if args.restart:
        runs["restart"] = ["--churn", args.churn, "--recovery", "restart"]
    out: dict = {"nodes": args.nodes, "steps": args.steps, "churn": args.churn, "sets": sets, "runs": {}}
    for name, extra in runs.items():
        code, _, wall = launch(config, args.nodes, args.steps, work / name, extra, sets, args.timeout)
        events = work / name / "events.jsonl"
        out["runs"][name] = {
            "exit": code,
            "wall_s": round(wall, 1),
            "training_s": training_seconds(events),
            "sizes": steps_by_size(events),
            "copy_s": copy_seconds(events),
            "events": len(read_events(events, "injected")),
            "verdict": verdict_of(work / name),
        }
        print(
            f"{name}: exit {code}, {out['runs'][name]['training_s']:.0f} s of training, "
            f"{out['runs'][name]['events']} events, steps per node count {out['runs'][name]['sizes']}; "
            f"{out['runs'][name]['verdict'].get('reason')}",
            flush=True,
        )
    live = out["runs"]["live"]
    step_s: dict[int, float] = {}
    for size, n in sorted(live["sizes"].items()):
        if n < SIZE_CONTROL_MIN_SHARE * args.steps and size != args.nodes:
            continue
        run = work / f"size{size}"
        # f = 0: failure-free, and the planner's coverage rule refuses to *start* MLLM-10B (n0 = 3) at 7 nodes
        # with f = 1, where a churned run trains after a loss. Its own plan for the size: as fast or faster than
        # the churned run's reconfigured one, so the fraction is not flattered.
        code, _, _ = launch(config, size, args.size_steps, run, [], [*sets, "fault_tolerance.f=0"], args.timeout)
        if code == 0:
            step_s[size] = training_seconds(run / "events.jsonl") / max(1, args.size_steps - 1)
            print(
                f"failure-free at {size} nodes: {step_s[size]:.2f} s/step; {verdict_of(run).get('reason')}", flush=True
            )
    same = same_size_seconds(live["sizes"], step_s)
    steps = sum(live["sizes"].values())
    out["failure_free_step_s"] = step_s
    out["vs_same_sizes"] = same / live["training_s"]
    out["vs_full_size"] = steps * step_s.get(args.nodes, float("nan")) / live["training_s"]
    out["copy_bound"] = same / (same + live["copy_s"])
    print(
        f"churned: {out['vs_same_sizes']:.1%} of failure-free at the same node counts (time-weighted; target 95%, "
        f"or within 2 points of the copies' bound {out['copy_bound']:.1%}: {live['copy_s']:.1f} s of layer-state "
        f"copies at the configured bandwidth); {out['vs_full_size']:.1%} of the full-size failure-free run",
        flush=True,
    )
    out["simulator"] = simulator_check(out)
    if "restart" in out["runs"]:
        restart = out["runs"]["restart"]
        out["restart_vs_live"] = live["training_s"] / restart["training_s"] if restart["exit"] == 0 else None
        print(
            f"checkpoint-restart: {restart['training_s']:.0f} s against live's {live['training_s']:.0f} s", flush=True
        )
    return out


SIMULATOR_TARGET = 0.10
EMULATED_PHASES = {"detection_s": 0.01, "rendezvous_s": 0.6}
"""What the simulator is told of the emulated cluster's control plane, measured there (docs/benchmarks.md, "A loss
and a join on 8 emulated A100s"): a killed node's stream resets at once, a loss's rendezvous took 0.63 s. Its
iteration times are the failure-free runs' measured seconds per step at each node count (``iteration_of``), so
the check tests the simulator's model of recovery, not the cost model the emulation's truth departs from."""


def simulator_check(result: dict) -> dict:
    """``oobleck-launch simulate``'s prediction of a churn run (``result``, the ``churn`` subcommand's figures):
    the same config, accelerator and churn, the measured step time per node count; samples/s and their ratio."""
    import dataclasses

    from oobleck_mm.config import load_config
    from oobleck_mm.faults.churn import churn_trace, parse_churn
    from oobleck_mm.simulator import availability as av
    from oobleck_mm.simulator.params import SimParams
    from oobleck_mm.simulator.run import simulate

    job = load_config(ROOT / "configs" / "mllm_10b.yaml", overrides=result["sets"])
    names = [f"node{i}" for i in range(result["nodes"])]
    live = result["runs"]["live"]
    step_s = {int(k): v for k, v in result["failure_free_step_s"].items()}

    def iteration_of(plan) -> float:
        # A node count without a failure-free run of its own (too few steps there): the nearest larger one's.
        n = len(plan.nodes)
        return step_s.get(n) or step_s[min((k for k in step_s if k > n), default=max(step_s))]

    availability = av.from_trace(churn_trace(parse_churn(result["churn"]), names), f"churn {result['churn']}")
    params = dataclasses.replace(SimParams(), **EMULATED_PHASES)
    sim = simulate(job, availability, ["oobleck"], params, iteration_of=iteration_of)[0]
    measured = sum(live["sizes"].values()) * job.training.global_batch / live["training_s"]
    # The simulation runs the churn's whole availability; the emulated run stopped at its last step.
    out = {
        "nodes": result["nodes"],
        "simulated_samples_per_s": sim.samples_per_s,
        "emulated_samples_per_s": measured,
        "ratio": sim.samples_per_s / measured,
        "breakdown_s": {k: round(v, 1) for k, v in sim.breakdown.items() if v},
        "params": EMULATED_PHASES,
    }
    met = abs(out["ratio"] - 1) <= SIMULATOR_TARGET
    print(
        f"simulator at {result['nodes']} nodes: {sim.samples_per_s:.3f} samples/s predicted, {measured:.3f} "
        f"emulated: x{out['ratio']:.3f} (target within {SIMULATOR_TARGET:.0%}: {'met' if met else 'missed'}); "
        f"breakdown {out['breakdown_s']}",
        flush=True,
    )
    return out


STRAGGLER_TARGET = 0.90
JOIN_TARGET_MEDIAN_STEPS = 1.5


def straggler(args) -> dict:
    """One node of ``--nodes`` slowed ``--factor`` x for good from step ``--at``: unslowed; detection only; the
    engine's mitigation (the batch re-split for its speed, then weighed for a bench). Throughput of the steps
    from the slowdown on, as a fraction of the unslowed run's over the same steps (``bench_straggler``)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from bench_straggler import launch, summary

    work = Path(tempfile.mkdtemp(prefix="oobleck-emulated-straggler-"))
    sets = [*MLLM_SETS, f"training.global_batch={args.global_batch}", *args.sets]
    config = ROOT / "configs" / "mllm_10b.yaml"
    slow = f"slow:{args.node}@step{args.at}x{args.factor:g}"
    runs = {
        "unslowed": ([], []),
        "slowed, detection only": (["--inject", slow], ["fault_tolerance.straggler_resplit=false"]),
        "slowed, re-split only": (
            ["--inject", slow],
            ["fault_tolerance.straggler_replan_after=null", "fault_tolerance.straggler_recut=false"],
        ),
        "slowed, mitigated": (["--inject", slow], []),
    }
    out: dict = {"nodes": args.nodes, "steps": args.steps, "slow": slow, "sets": sets, "runs": {}}
    for name, (extra, more) in runs.items():
        if args.only and not any(name.endswith(o) for o in args.only):
            continue
        run_dir = work / name.replace(" ", "_").replace(",", "")
        began = time.perf_counter()
        code = launch(run_dir, args.nodes, args.steps, extra, more, args.timeout, config=config, base_sets=sets)
        info = summary(run_dir / "events.jsonl", args.at) if code == 0 else {}
        info.update(exit=code, wall_s=round(time.perf_counter() - began, 1), verdict=verdict_of(run_dir))
        out["runs"][name] = info
        print(
            f"{name}: exit {code}, {info.get('seconds_from_slowdown', float('nan')):.1f} s from step {args.at} to "
            f"the end; detected {info.get('detected')}; benched {info.get('benched')}; "
            f"{info['verdict'].get('reason')}",
            flush=True,
        )
    base = out["runs"].get("unslowed", {}).get("seconds_from_slowdown")
    for name, run in out["runs"].items():
        if name != "unslowed" and base and run.get("seconds_from_slowdown"):
            run["throughput_vs_unslowed"] = base / run["seconds_from_slowdown"]
            met = (
                ""
                if name != "slowed, mitigated"
                else (
                    f" (target {STRAGGLER_TARGET:.0%}: {'met' if run['throughput_vs_unslowed'] >= STRAGGLER_TARGET else 'missed'})"
                )
            )
            print(
                f"{name}: {run['throughput_vs_unslowed']:.1%} of the unslowed throughput from step {args.at} on"
                f"{met}; splits {run.get('splits')}",
                flush=True,
            )
    return out


def join(args) -> dict:
    """The survivors' pause at a join, and their longest step around it in median steps, for a join alone and a
    join a few steps after a loss, ``--runs`` each, on emulated MLLM-10B (``bench_join``'s measures)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from bench_join import one_run

    work = Path(tempfile.mkdtemp(prefix="oobleck-emulated-join-"))
    sets = (*MLLM_SETS, f"training.global_batch={args.global_batch}", *args.sets)
    scenarios = {
        "join alone": f"join@step{args.at}",
        "join after a loss": f"kill:node1@step{args.at},join@step{args.at + 3}",
    }
    out: dict = {"nodes": args.nodes, "steps": args.steps, "sets": list(sets), "scenarios": {}}
    for name, inject in scenarios.items():
        rows = []
        for r in range(args.runs):
            run_dir = work / f"{name.replace(' ', '_')}{r}"
            row = one_run(
                inject,
                args.steps,
                run_dir,
                config=str(ROOT / "configs" / "mllm_10b.yaml"),
                nodes=args.nodes,
                sets=sets,
                timeout=args.timeout,
            )
            row["verdict"] = verdict_of(run_dir)
            rows.append(row)
            print(
                f"{name} #{r}: exit {row['exit']}, longest step {row['longest_median_steps'] or float('nan'):.2f} "
                f"median steps of {row['median_step_s'] or float('nan'):.2f} s, pause "
                f"{row['pause_s'] or float('nan'):.2f} s; {row['verdict'].get('reason')}",
                flush=True,
            )
        longest = [r["longest_median_steps"] for r in rows if r["longest_median_steps"] is not None]
        out["scenarios"][name] = {
            "inject": inject,
            "runs": rows,
            "worst_longest_median_steps": max(longest, default=None),
            "target_met": len(longest) == len(rows) and max(longest) <= JOIN_TARGET_MEDIAN_STEPS,
        }
        print(
            f"{name}: longest step around the join, worst of {len(rows)}: "
            f"{out['scenarios'][name]['worst_longest_median_steps']} median steps (target "
            f"<= {JOIN_TARGET_MEDIAN_STEPS}: {'met' if out['scenarios'][name]['target_met'] else 'missed'})",
            flush=True,
        )
    return out


BALANCE_TARGET = 1.3
SKEWED_DATA = [
    "data.text_length_sigma=2.0",
    "data.mean_images_per_sample=1.0",
    "data.max_images_per_sample=8",
    "data.min_image_size=224",
]
"""A long-tailed image/audio/text mix: lognormal text with log-sigma 2 (most samples short, a few of thousands
of tokens), 0-8 images of 224-448 px sides (mean 1), one clip of audio on 80% of samples."""


def balance(args) -> dict:
    """The balancer and Entrain's deferral on vs off on skewed data, pipelines of different depths (MLLM-10B on
    7 emulated A100s: 4 and 3 stages), each run's median step after its warm-up; target 1.3x."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from soak_churn import launch

    work = Path(tempfile.mkdtemp(prefix="oobleck-emulated-balance-"))
    sets = [*MLLM_SETS, f"training.global_batch={args.global_batch}", "fault_tolerance.f=0", *SKEWED_DATA, *args.sets]
    config = str(ROOT / "configs" / "mllm_10b.yaml")
    runs = {"off": ["balance.enabled=false"], "on": ["balance.enabled=true", "balance.deferral=true"]}
    out: dict = {"nodes": args.nodes, "steps": args.steps, "sets": sets, "runs": {}}
    for name, more in runs.items():
        run = work / name
        code, _, wall = launch(config, args.nodes, args.steps, run, [], [*sets, *more], args.timeout)
        steps = sorted(float(e.get("finished_at") or e["ts"]) for e in read_events(run / "events.jsonl", "step"))
        gaps = [b - a for a, b in zip(steps, steps[1:])][WARMUP_STEPS:]
        plan = read_events(run / "events.jsonl", "plan_decided")
        out["runs"][name] = {
            "exit": code,
            "wall_s": round(wall, 1),
            "median_step_s": statistics.median(gaps) if gaps else None,
            "mean_step_s": statistics.fmean(gaps) if gaps else None,
            "verdict": verdict_of(run),
            "plan": plan[0]["describe"] if plan else None,
        }
        print(
            f"balance {name}: exit {code}, median {out['runs'][name]['median_step_s']} s/step, mean "
            f"{out['runs'][name]['mean_step_s']} s/step; {out['runs'][name]['verdict'].get('reason')}",
            flush=True,
        )
    off, on = out["runs"]["off"].get("mean_step_s"), out["runs"]["on"].get("mean_step_s")
    layout = read_events(work / "on" / "events.jsonl", "plan_decided")
    if layout:
        from oobleck_mm.config import load_config

        job = load_config(config, overrides=[*sets, *runs["on"], f"cluster.nodes={args.nodes}"])
        out["exact"] = exact_balance(
            job, ExecutionPlan.from_dict(layout[0]["layout"]), range(WARMUP_STEPS + 1, args.steps)
        )
        print(
            f"the same steps' exact 1F1B compute under the truth (no transfers, all-reduce or host): off "
            f"{out['exact']['off_s']:.3f} s, on {out['exact']['on_s']:.3f} s: x{out['exact']['speedup']:.3f}, the "
            f"most these assignments give on perfect hosts",
            flush=True,
        )
    if off and on:
        out["speedup"] = off / on
        print(
            f"balancer and deferral on vs off: x{out['speedup']:.3f} (mean step, steps {WARMUP_STEPS + 1}-"
            f"{args.steps}; target {BALANCE_TARGET}x: {'met' if out['speedup'] >= BALANCE_TARGET else 'missed'})",
            flush=True,
        )
    return out


def exact_balance(job, plan: ExecutionPlan, steps) -> dict:
    """The mean over ``steps`` of the slowest pipeline's exact 1F1B compute (the emulation's truth of every
    stage and microbatch, ``balance.schedule_time.iteration_time``) for the contiguous split and for the
    balancer's assignment (its analytical cost model as at the start, with Entrain's deferral as the job
    says): what the balancer's choices are worth before transfers, the gradient all-reduce and the hosts."""
    from oobleck_mm.data.loader import TrainingData
    from oobleck_mm.runtime.balancing import StepBalancer

    truth, data = Truth(job), TrainingData(job)
    balancer = StepBalancer(job, data, truth.specs)
    seam = next((i for i, s in enumerate(truth.specs) if s.kind == "token_embed"), 0)

    def slowest(pipelines, llm_of) -> float:
        worst = 0.0
        for k, (layout, microbatches) in enumerate(zip(plan.pipelines, pipelines)):
            llm = llm_of(k, microbatches)
            forward, backward = [], []
            for stage in layout.stages:
                encoder = truth.groups([i for i in stage.layers if i < seam])
                decoder, every = truth.groups([i for i in stage.layers if i >= seam]), truth.groups(list(stage.layers))
                forward.append(
                    [
                        truth.stage_seconds(encoder, data.metas(mb))[0] + truth.stage_seconds(decoder, data.metas(l))[0]
                        for mb, l in zip(microbatches, llm)
                    ]
                )
                backward.append([truth.stage_seconds(every, data.metas(l), stage.recompute)[1] for l in llm])
            worst = max(worst, iteration_time(np.array(forward), np.array(backward)))
        return worst

    off, on = [], []
    for step in steps:
        ids = data.global_batch(step)
        off.append(
            slowest(
                contiguous_assignment(
                    ids, [p.num_microbatches for p in plan.pipelines], plan.microbatch_size
                ).pipelines,
                lambda k, mbs: mbs,
            )
        )
        assignment = balancer.assign(step, ids, plan)
        on.append(slowest(assignment.pipelines, lambda k, mbs: assignment.llm_microbatches(k)))
    return {
        "off_s": statistics.fmean(off),
        "on_s": statistics.fmean(on),
        "speedup": statistics.fmean(off) / statistics.fmean(on),
    }


def _run_flags(parser: argparse.ArgumentParser, timeout: float) -> None:
    """What every subcommand that launches MLLM-10B takes: config overrides, a timeout per launch, the JSON."""
    parser.add_argument("--set", action="append", default=[], dest="sets")
    parser.add_argument("--timeout", type=float, default=timeout)
    parser.add_argument("--json", help="write the figures here")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    cal = sub.add_parser("calibrate", help="guards (a) known delay and (b) scaling")
    cal.add_argument("--pipelines", default="1,2,4,8,16", help="pipeline counts of (b), comma-separated")
    cal.add_argument("--steps", type=int, default=8)
    cal.add_argument("--delay-pipelines", type=int, default=2, help="pipelines of (a)'s run")
    cal.add_argument("--width", choices=sorted(WIDTHS), default="2.7b", help="the GPT-3 shape of the blocks")
    cal.add_argument("--coarsen", type=int, help="cluster.emulate_coarsen (default: automatic)")
    cal.add_argument("--json", help="write the figures here")
    ch = sub.add_parser("churn", help="bursty churn vs failure-free at the same node counts (MLLM-10B, A100)")
    ch.add_argument("--nodes", type=int, default=8)
    ch.add_argument("--steps", type=int, default=130)
    ch.add_argument("--global-batch", type=int, default=32)
    ch.add_argument("--churn", default=DEFAULT_CHURN)
    ch.add_argument("--size-steps", type=int, default=25, help="steps of each failure-free run at a node count")
    ch.add_argument("--restart", action="store_true", help="also the same churn under --recovery restart")
    _run_flags(ch, timeout=3600)
    st = sub.add_parser("straggler", help="one node slowed for good: unslowed, detection only, mitigated")
    st.add_argument("--nodes", type=int, default=8)
    st.add_argument("--steps", type=int, default=70)
    st.add_argument("--node", default="node5")
    st.add_argument("--at", type=int, default=20, help="the step the slowdown begins (after the detector's warm-up)")
    st.add_argument("--factor", type=float, default=2.0)
    st.add_argument(
        "--global-batch",
        type=int,
        default=64,
        help="16 microbatches: a split of 8 bounds every mitigation near 89%% (docs/benchmarks.md)",
    )
    st.add_argument("--only", action="append", default=[], help="run only the runs whose name ends so (repeatable)")
    _run_flags(st, timeout=3600)
    jo = sub.add_parser("join", help="the survivors' longest step around a join, alone and after a loss")
    jo.add_argument("--nodes", type=int, default=8)
    jo.add_argument("--steps", type=int, default=30)
    jo.add_argument("--at", type=int, default=8, help="the step of the join (of the loss, then the join 3 later)")
    jo.add_argument("--runs", type=int, default=5)
    jo.add_argument("--global-batch", type=int, default=32)
    _run_flags(jo, timeout=1800)
    si = sub.add_parser("simulate", help="the simulator's prediction of a churn run's figures (item 4)")
    si.add_argument("churn_json", help="a `churn --json` output")
    si.add_argument("--json", help="write the figures here")
    ba = sub.add_parser("balance", help="the balancer and deferral on vs off, skewed data, mixed depths")
    ba.add_argument("--nodes", type=int, default=7)
    ba.add_argument("--steps", type=int, default=20)
    ba.add_argument("--global-batch", type=int, default=32)
    _run_flags(ba, timeout=1800)
    args = parser.parse_args(argv)
    if args.command == "balance":
        out = balance(args)
    if args.command == "simulate":
        out = simulator_check(json.loads(Path(args.churn_json).read_text()))
    if args.command == "straggler":
        out = straggler(args)
    if args.command == "join":
        out = join(args)
    if args.command == "churn":
        out = churn(args)
    if args.command == "calibrate":
        out = calibrate(
            [int(p) for p in args.pipelines.split(",")],
            args.steps,
            args.delay_pipelines,
            width=args.width,
            coarsen=args.coarsen,
        )
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
