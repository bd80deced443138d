#!/usr/bin/env python
"""Per-stage recomputation (``training.activation_checkpointing: auto``) against recomputing everywhere.

    python scripts/bench_recompute.py [--json OUT] [--steps N] [--warmup N] [--rounds N] [--no-paper]

Two halves, issue 52 item 3's second target (auto >= 1.15x the global switch at the same memory limit):

1. **Measured on this machine.** One pipeline of 4 one-GPU stages (4 processes, one torch thread each) of an
   LLM-only model whose activations dominate its memory (CPU_MODEL: 8 blocks of width 256, ~400-token
   samples), under a device-memory limit (CPU_DEVICE_MEMORY) at which the 1F1B in-flight activations do not
   fit on the first stage (4 microbatches in flight) but do on the later ones. The planner maps the stages
   three times at that limit: ``auto`` (it recomputes only where keeping would not fit), ``true`` (every
   stage recomputes), ``false`` (no stage does: another cut, if one fits). The three run side by side, taking
   turns step by step in their own processes (``_bench_peers.launch``, as ``bench_runtime.py`` does), the
   order rotated every round. samples/s = global batch x timed steps / the sum over timed steps of that
   step's fastest round. Losses must agree (recomputation changes no value). Peak RSS per rank shows where
   the activations were kept. Beside it, the planner's predicted step of each side with a core per stage:
   on 2 shared cores a step's time is the whole pipeline's CPU work rather than its bottleneck stage, so a
   cut that recomputes nothing (``never``, where one fits) can run faster here than the planner predicts.
2. **Predicted at paper scale.** ``plan`` (the planner's exact 1F1B time) of the configs in PAPER_CONFIGS
   on their own clusters at their own device memory, with each setting.

The CPU device's memory limit is the planner's model (``cluster.device_memory``); a CPU has no allocator
cap, so the peak RSS is reported beside it, not enforced.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", "1")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import yaml  # noqa: E402

from _bench_peers import RunSpec, launch  # noqa: E402
from bench_runtime import _merge, rate, summarise  # noqa: E402
from oobleck_mm.config import config_from_dict, load_config  # noqa: E402
from oobleck_mm.planning.costs import ClusterSpec  # noqa: E402
from oobleck_mm.planning.layout import ExecutionPlan, PipelineLayout, StageLayout  # noqa: E402
from oobleck_mm.planning.stage_mapping import map_stages  # noqa: E402
from oobleck_mm.profiling.analytical import profile_from_config  # noqa: E402

STAGES = 4
SETTINGS = {"auto": "auto", "always": True, "never": False}
"""Side name -> ``training.activation_checkpointing``."""
CPU_MODEL = {
    "model": {"name": "bench_recompute", "llm": {"num_layers": 8, "hidden": 256, "num_heads": 4, "vocab_size": 256}},
    "data": {"mean_images_per_sample": 0, "max_images_per_sample": 0, "mean_text_tokens": 384, "max_seq_len": 512},
    "training": {"global_batch": 16, "microbatch_size": 2, "dtype": "float32"},
}
CPU_DEVICE_MEMORY = int(0.11 * 2**30)
"""Bytes per "GPU": the first stage's four in-flight microbatches of its three layers' activations (~127 MiB
by the cost model) do not fit, the later stages' fewer ones do."""
PAPER_CONFIGS = (
    "configs/mllm_84b.yaml",
    "configs/gpt3_2.7b.yaml",
    "configs/paper/bert_large.yaml",
    "configs/cornstarch_mllm_mmm.yaml",
    "configs/llava_1.5_7b.yaml",
)
TARGET = 1.15
LOSS_TOLERANCE = 1e-6
"""float32, same values recomputed: the losses of the three sides agree to rounding of one microbatch order."""


# --------------------------------------------------------------------------- measured on CPU


def cpu_job(setting):
    with open(ROOT / "configs" / "tiny_mm.yaml", encoding="utf-8") as fh:
        raw = yaml.safe_load(fh)
    for part in ("vision", "projector"):
        raw["model"].pop(part, None)
    over = {"training": {"activation_checkpointing": setting}, "cluster": {"device_memory": CPU_DEVICE_MEMORY}}
    return config_from_dict(_merge(_merge(raw, CPU_MODEL), over))


def planned(job) -> tuple[ExecutionPlan, dict] | None:
    """The planner's one-pipeline template on STAGES one-GPU nodes at the job's memory, as an execution plan
    (ranks 0..STAGES-1), and what it predicted (per stage, and the step with a core per stage); None when
    nothing fits."""
    microbatches = job.training.global_batch // job.training.microbatch_size
    template = map_stages(
        profile_from_config(job), ClusterSpec.from_config(job.cluster), STAGES, microbatches_hint=microbatches
    )
    if template is None:
        return None
    stages = tuple(
        StageLayout(k, s.layer_start, s.layer_end, recompute=s.recompute) for k, s in enumerate(template.stages)
    )
    predicted = [
        {
            "layers": [s.layer_start, s.layer_end],
            "recompute": s.recompute,
            "memory_mib": round(s.memory_bytes / 2**20, 1),
            "forward_backward_s": round(s.forward_s + s.backward_s, 4),
        }
        for s in template.stages
    ]
    plan = ExecutionPlan((PipelineLayout(stages, microbatches),), template.num_layers, job.training.microbatch_size)
    return plan, {"step_s": round(template.iteration_time(microbatches), 4), "stages": predicted}


def run_measured(rounds: int, steps: dict, work: Path) -> dict:
    sides, predicted = {}, {}
    for name, setting in SETTINGS.items():
        job = cpu_job(setting)
        result = planned(job)
        if result is None:
            print(f"  {name}: no mapping fits {CPU_DEVICE_MEMORY / 2**20:.0f} MiB per GPU", flush=True)
            continue
        plan, predicted[name] = result
        sides[name] = RunSpec("engine", job, plan, **steps)
        print(f"  {name:>6}: {plan.describe()}  predicted {predicted[name]}", flush=True)
    runs: dict[str, list[dict]] = {name: [] for name in sides}
    names = list(sides)
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        print(f"  round {r + 1}/{rounds}: {' and '.join(order)} taking turns ...", flush=True)
        for name, ranks in zip(order, launch([sides[n] for n in order], work / f"r{r}"), strict=True):
            runs[name].append(summarise(sides[name], ranks))
    best = {name: [min(x["step_s"][i] for x in rs) for i in range(steps["timed"])] for name, rs in runs.items()}
    rates = {name: rate(sides[name], b) for name, b in best.items()}
    losses = {name: rs[0]["losses"] for name, rs in runs.items()}
    rss = {name: [max(col) for col in zip(*(x["peak_rss_mb"] for x in rs))] for name, rs in runs.items()}
    return {
        "device_memory_mib": round(CPU_DEVICE_MEMORY / 2**20, 1),
        "plans": {name: spec.plan.describe() for name, spec in sides.items()},
        "predicted": predicted,
        "predicted_auto_over_always": round(predicted["always"]["step_s"] / predicted["auto"]["step_s"], 3),
        "samples_s": {name: round(v, 3) for name, v in rates.items()},
        "auto_over_always": round(rates["auto"] / rates["always"], 3),
        "auto_over_never": round(rates["auto"] / rates["never"], 3) if "never" in rates else None,
        "rounds_samples_s": {n: [round(rate(sides[n], x["step_s"]), 3) for x in rs] for n, rs in runs.items()},
        "peak_rss_mb_per_rank": rss,
        "max_loss_diff": max(abs(a - b) for ls in losses.values() for a, b in zip(ls, losses["always"], strict=True)),
        "losses": losses,
        "breakdown_s_per_step": {name: rs[0]["breakdown_s"] for name, rs in runs.items()},
    }


# --------------------------------------------------------------------------- predicted at paper scale


def run_predicted() -> list[dict]:
    from oobleck_mm.errors import UserError
    from oobleck_mm.planning.planner import plan_job

    rows = []
    for path in PAPER_CONFIGS:
        base = load_config(str(ROOT / path))
        row = {"config": path, "nodes": base.cluster.nodes, "device": base.cluster.device}
        for name, setting in SETTINGS.items():
            job = dataclasses.replace(
                base, training=dataclasses.replace(base.training, activation_checkpointing=setting)
            )
            t0 = time.perf_counter()
            try:
                plan = plan_job(job, profile_from_config(job), [f"n{i}" for i in range(job.cluster.nodes)]).plan
            except UserError as error:
                row[name] = {"fits": False, "why": str(error).splitlines()[0][:160]}
                continue
            stages = [s for p in plan.pipelines for s in p.template.stages]
            row[name] = {
                "fits": True,
                "samples_s": round(plan.samples_per_s, 3),
                "recomputing_stages": sum(s.recompute for s in stages),
                "stages": len(stages),
                "planning_s": round(time.perf_counter() - t0, 2),
            }
        row["auto_over_always"] = round(row["auto"]["samples_s"] / row["always"]["samples_s"], 3)
        if row["never"]["fits"]:
            row["auto_over_never"] = round(row["auto"]["samples_s"] / row["never"]["samples_s"], 3)
        rows.append(row)
        print(f"  {describe_row(row)}", flush=True)
    return rows


def describe_row(row: dict) -> str:
    def side(name):
        s = row[name]
        if not s["fits"]:
            return f"{name} does not fit"
        return f"{name} {s['samples_s']:.2f} samples/s ({s['recomputing_stages']}/{s['stages']} stages recompute)"

    never = f", auto / never {row['auto_over_never']:.3f}" if "auto_over_never" in row else ""
    return (
        f"{row['config']} ({row['nodes']} x {row['device']}): {side('auto')}; {side('always')}; {side('never')}; "
        f"auto / always {row['auto_over_always']:.3f}{never}"
    )


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per run (default 8)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    ap.add_argument("--rounds", type=int, default=3, help="runs, fresh processes each, order rotated (default 3)")
    ap.add_argument("--no-paper", action="store_true", help="skip the paper-scale predictions")
    args = ap.parse_args(argv)
    for name in ("steps", "warmup", "rounds"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    steps = {"warmup": args.warmup, "timed": args.steps}
    m = CPU_MODEL["model"]["llm"]
    print(
        f"measured: llm {m['num_layers']} blocks of width {m['hidden']}, ~{CPU_MODEL['data']['mean_text_tokens']} "
        f"text tokens a sample, global batch {CPU_MODEL['training']['global_batch']}, microbatch "
        f"{CPU_MODEL['training']['microbatch_size']}; 1 pipeline x {STAGES} stages at "
        f"{CPU_DEVICE_MEMORY / 2**20:.0f} MiB per GPU; {args.warmup} warm-up + {args.steps} timed steps, "
        f"{args.rounds} rounds",
        flush=True,
    )
    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory(prefix="bench_recompute_") as tmp:
        measured = run_measured(args.rounds, steps, Path(tmp))
    load.append(os.getloadavg()[0])
    r = measured["samples_s"]
    print(
        f"measured samples/s: {', '.join(f'{k} {v:.2f}' for k, v in r.items())}; auto / always "
        f"{measured['auto_over_always']:.3f} (target >= {TARGET})"
        + (f", auto / never {measured['auto_over_never']:.3f}" if measured["auto_over_never"] else "")
    )
    print(
        "  predicted step with a core per stage: "
        + ", ".join(f"{k} {v['step_s']:.3f} s" for k, v in measured["predicted"].items())
        + f"; auto / always {measured['predicted_auto_over_always']:.3f}"
    )
    print(f"  per round: {measured['rounds_samples_s']}")
    print(f"  peak RSS per rank (MB): {measured['peak_rss_mb_per_rank']}")
    print(f"  max loss difference between the settings: {measured['max_loss_diff']:.1e}")
    predicted = []
    if not args.no_paper:
        print("predicted at paper scale (the planner's exact 1F1B time, each config's own cluster):", flush=True)
        predicted = run_predicted()
    wall_s = time.perf_counter() - started
    print(f"wall time {wall_s:.0f} s; 1-min load average at start {load[0]:.1f}, at end {load[1]:.1f}")
    ok = measured["max_loss_diff"] <= LOSS_TOLERANCE
    if not ok:
        print(f"ERROR: losses differ by {measured['max_loss_diff']:.1e} > {LOSS_TOLERANCE:g}: not the same training")
    if args.json:
        command = "python scripts/bench_recompute.py " + " ".join(argv if argv is not None else sys.argv[1:])
        out = {
            "command": command.strip(),
            "target_auto_over_always": TARGET,
            "measured": measured,
            "predicted": predicted,
            "settings": {**steps, "rounds": args.rounds, "load_average_start_end": load, "wall_s": round(wall_s, 1)},
        }
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
