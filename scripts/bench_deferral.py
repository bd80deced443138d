"""Measured: balancing off / data-parallel level only / with Entrain's deferral inside pipelines, side by side.

    python scripts/bench_deferral.py [--layout 2|2+1|4|2+2+1+1...] [--global-batch N] [--microbatch-size N] [--steps N] [--json OUT]

Issue 32 item 3. A skewed LLaVA-style mix (synthetic: 0-3 images, binomial with mean 0.9, so ~34% text-only,
~44% one image, ~22% several; lognormal text with sigma 1.5: long and short answers) on a model whose vision
encoder and LLM cost about the same for the mean sample, cut at ``llm.embed`` so one stage is the encoder
and the other the LLM (what a planner cutting at equal cost does with it).

Every process (one per stage, one torch thread each) holds three engines of the same job and they take
turns step by step on the same global batch: ``off`` (the contiguous split, what ``balance.enabled: false``
runs), ``dp`` (``ours``: which pipeline and microbatch each sample runs in) and ``dp+deferral`` (the same,
then the LLM stages' microbatches evened by deferral). Their parameters stay equal (tested in
``tests/integration/test_runtime_deferral.py``), so only time differs. Step time: wall time of
``train_step`` on rank 0 after a barrier.

Layouts: ``2`` is one pipeline of two stages (two processes: this machine's two cores); the data-parallel
level has one pipeline to balance, so ``dp`` shows only what its microbatch split does. ``2+1`` adds a
one-stage pipeline (three processes on two cores: contention is part of what it measures). Any mix of
pipelines of 1 to 4 stages (``_cuts``), e.g. ``4`` or ``2+2+1+1``, wants a core per process
(``scripts/device_run.sh``): the cost model predicts deferral pays more in deeper pipelines
(``scripts/bench_balancer.py --deferral``: 1.10-1.15x at depth 2, 1.11-1.38x at depths 3-4).

Entrain's own figure of merit is printed too: the coefficient of variation, over a step's microbatches, of
each stage's measured forward + backward seconds (paper Table 4.3), mean over steps and stages.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CONFIG = {
    "model": {
        "name": "deferral_mm",
        "vision": {"num_layers": 2, "hidden": 384, "num_heads": 4, "patch_size": 8, "token_merge": 4},
        "projector": {"num_layers": 1},
        "llm": {"num_layers": 2, "hidden": 384, "num_heads": 4, "vocab_size": 256},
    },
    "data": {
        "kind": "synthetic",
        "mean_text_tokens": 64,
        "text_length_sigma": 1.5,
        "mean_images_per_sample": 0.9,
        "max_images_per_sample": 3,
        "image_size": 128,
        "min_image_size": 32,
        "max_seq_len": 2048,
        "num_samples": 4096,
    },
    "training": {
        "global_batch": 32,
        "microbatch_size": 2,
        "steps": 40,
        "dtype": "float32",
        "optimizer": {"type": "AdamW", "params": {"lr": 1.0e-3}},
    },
    "cluster": {"nodes": 3, "device": "cpu", "backend": "gloo"},
    "balance": {"enabled": True, "algorithm": "ours", "threshold": 0.0, "fit_every": 2},
}
MODES = ("off", "dp", "dp+deferral")


def _depths(layout: str) -> list[int]:
    """``"2+2+1"`` -> ``[2, 2, 1]``: each pipeline's stage count (``_cuts``)."""
    parts = layout.split("+")
    if not parts or any(p not in ("1", "2", "3", "4") for p in parts):
        raise SystemExit(
            f"--layout {layout!r}: pipelines of 1 to 4 stages joined by '+' (e.g. 2, 2+1, 4, 3+3, 2+2+1+1)"
        )
    return [int(p) for p in parts]


def _cuts(specs, depth: int) -> list[int]:
    """Stage boundaries for a pipeline of ``depth`` stages, at block boundaries: 1 the whole model; 2 the
    encoder | the LLM (cut at ``llm.embed``); 3 the encoder | the first LLM block | the rest; 4 one encoder
    block and one LLM block a stage (the encoder and the LLM cost about the same for the mean sample)."""
    seam = next(i for i, s in enumerate(specs) if s.kind == "token_embed")
    blocks = [i for i, s in enumerate(specs) if s.kind == "block"]
    encoder, llm = [i for i in blocks if i < seam], [i for i in blocks if i > seam]
    return {
        1: [0, len(specs)],
        2: [0, seam, len(specs)],
        3: [0, seam, llm[-1], len(specs)],
        4: [0, encoder[-1], seam, llm[-1], len(specs)],
    }[depth]


def _counts(depths: list[int], microbatches: int) -> list[int]:
    counts = [microbatches * d // sum(depths) for d in depths]
    by_remainder = sorted(range(len(depths)), key=lambda i: -(microbatches * depths[i] % sum(depths)))
    for i in by_remainder[: microbatches - sum(counts)]:  # the largest remainders, the first of equal ones
        counts[i] += 1
    if min(counts) < 1:
        raise SystemExit(
            f"--layout {'+'.join(map(str, depths))}: {microbatches} microbatches leave a pipeline "
            f"none; raise --global-batch"
        )
    return counts


def _plan(layout: str, specs, microbatches: int, microbatch_size: int):
    """The pipelines of ``layout``, ranks in order. ``off`` runs the contiguous split of these counts: each
    pipeline's share of the microbatches in proportion to its stages (a two-stage pipeline runs about twice
    the microbatches of a one-stage one in the same time), rounded by largest remainder."""
    from dataclasses import replace

    from oobleck_mm.planning.layout import ExecutionPlan, PipelineLayout, StageLayout

    depths, pipelines, rank = _depths(layout), [], 0
    for depth in depths:
        cuts = _cuts(specs, depth)
        pipelines.append(
            PipelineLayout(tuple(StageLayout(rank + i, a, b) for i, (a, b) in enumerate(zip(cuts, cuts[1:]))), 0)
        )
        rank += depth
    counts = _counts(depths, microbatches)
    return ExecutionPlan(
        tuple(replace(p, num_microbatches=q) for p, q in zip(pipelines, counts)), len(specs), microbatch_size
    )


def _entry(config: dict, layout: str, rank: int, world: int, port: int, steps: int, out: str) -> None:
    from oobleck_mm.balance.assignment import contiguous_assignment
    from oobleck_mm.config import config_from_dict
    from oobleck_mm.model.layers import model_layer_specs
    from oobleck_mm.runtime.engine import StageEngine
    from oobleck_mm.runtime.group import join_generation

    torch.set_num_threads(1)
    jobs = {
        mode: config_from_dict({**config, "balance": {**config["balance"], "deferral": mode == "dp+deferral"}})
        for mode in MODES
    }
    job = jobs["dp"]
    specs = model_layer_specs(job)
    wait = timedelta(seconds=120)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=wait)
    join_generation(store, 0, rank, world, "gloo", collective_timeout=wait, arrival_timeout=wait)
    plan = _plan(layout, specs, job.training.global_batch // job.training.microbatch_size, job.training.microbatch_size)
    engines = {mode: StageEngine(jobs[mode], plan, rank) for mode in MODES}
    counts = [p.num_microbatches for p in plan.pipelines]
    rows = []
    for step in range(steps):
        order = MODES[step % 3 :] + MODES[: step % 3]  # rotate who goes first
        for mode in order:
            engine = engines[mode]
            dist.barrier()
            t0 = time.perf_counter()
            given = (
                contiguous_assignment(engine.data.global_batch(step), counts, plan.microbatch_size)
                if mode == "off"
                else None
            )
            result = engine.train_step(step, given)
            seconds = time.perf_counter() - t0
            metrics = engine.balancer.last_metrics if mode != "off" else {}
            rows.append(
                {
                    "step": step,
                    "mode": mode,
                    "seconds": seconds,
                    "loss": result.loss,
                    "deferred": result.deferred,
                    "pipeline_s": result.pipeline_s,
                    "predicted_max_s": metrics.get("predicted_max_s"),
                    "stage": [engine.pipeline_index, engine.stage_index],
                    "microbatch_s": [f + b for f, b in result.microbatch_times],
                    "microbatch_fb": result.microbatch_times,
                }
            )
    Path(out, f"rank{rank}.json").write_text(json.dumps(rows))
    dist.destroy_process_group()


def _recurrence(rows) -> float:
    """The slowest pipeline's exact 1F1B seconds from one step's measured per-microbatch (forward, backward)
    times of every rank (``rows``: each rank's row of that step, rank order = stage order per pipeline)."""
    from oobleck_mm.balance.schedule_time import iteration_times

    pipelines: dict[int, list] = {}
    for row in rows:
        pipelines.setdefault(row["stage"][0], []).append(row)
    out = []
    for stages in pipelines.values():
        stages.sort(key=lambda r: r["stage"][1])
        fwd = np.array([[f for f, _ in r["microbatch_fb"]] for r in stages])
        bwd = np.array([[b for _, b in r["microbatch_fb"]] for r in stages])
        out.append(float(iteration_times(fwd[None], bwd[None], [len(stages)], [fwd.shape[1]])[0]))
    return max(out)


def _cv(values) -> float:
    return float(np.std(values) / np.mean(values)) if len(values) > 1 and np.mean(values) > 0 else 0.0


def run(layout: str, steps: int, warmup: int, json_out: Path | None) -> int:
    from _ranks import run_ranks

    world = sum(_depths(layout))
    out = Path(tempfile.mkdtemp())
    started = time.perf_counter()
    run_ranks(_entry, lambda rank, port: (CONFIG, layout, rank, world, port, steps, str(out)), world, 1800)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
    rank0 = [r for r in ranks[0] if r["step"] >= warmup]
    by_mode = {m: [r for r in rank0 if r["mode"] == m] for m in MODES}
    total = {m: sum(r["seconds"] for r in rows) for m, rows in by_mode.items()}
    cv = {
        m: statistics.mean(
            _cv(r["microbatch_s"]) for rows in ranks for r in rows if r["mode"] == m and r["step"] >= warmup
        )
        for m in MODES
    }
    worst = max(abs(a["loss"] - b["loss"]) for m in MODES[1:] for a, b in zip(by_mode["off"], by_mode[m]))
    deferred = statistics.mean(r["deferred"] for r in by_mode["dp+deferral"])
    predicted = {m: statistics.mean(r["predicted_max_s"] for r in by_mode[m]) for m in MODES[1:]}
    print(
        f"layout {layout}: {world} processes, 1 torch thread each, on {os.cpu_count()}-core host; "
        f"global batch {CONFIG['training']['global_batch']}, microbatches of {CONFIG['training']['microbatch_size']}"
    )
    print(f"steps {warmup}..{steps - 1}, each run by all three engines in turn ({time.perf_counter() - started:.0f} s)")
    for m in MODES:
        rows = by_mode[m]
        print(
            f"{m:12s}: mean step {total[m] / len(rows) * 1e3:7.1f} ms (median "
            f"{statistics.median(r['seconds'] for r in rows) * 1e3:7.1f}); speed-up over off "
            f"{total['off'] / total[m]:.3f}x; microbatch stage-time CV {cv[m]:.3f}"
        )
    part = {
        m: statistics.mean(
            max(rows[i]["pipeline_s"] for rows in ranks if rows[i]["step"] >= warmup)
            for i in range(len(ranks[0]))
            if ranks[0][i]["mode"] == m and ranks[0][i]["step"] >= warmup
        )
        for m in MODES
    }
    print(
        "1F1B part of the step (slowest stage's schedule, before the update): "
        + ", ".join(f"{m} {part[m] * 1e3:.1f} ms" for m in MODES)
        + f"; deferral on its own there: {part['dp'] / part['dp+deferral']:.3f}x"
    )
    # The CPU ceiling: the exact 1F1B recurrence fed each step's measured per-microbatch stage times, i.e. what
    # the step's 1F1B part would take if the stages overlapped as on separate devices (transfers free).
    ideal = {
        m: statistics.mean(
            _recurrence(rows) for rows in zip(*ranks) if rows[0]["mode"] == m and rows[0]["step"] >= warmup
        )
        for m in MODES
    }
    print(
        "1F1B part from the measured microbatch times, as if the stages overlapped fully: "
        + ", ".join(f"{m} {ideal[m] * 1e3:.1f} ms" for m in MODES)
        + f"; deferral on its own there: {ideal['dp'] / ideal['dp+deferral']:.3f}x (the ceiling: this machine's "
        f"{world} processes share {os.cpu_count()} cores with gloo's threads)"
    )
    print(
        f"deferral on its own (dp+deferral over dp): {total['dp'] / total['dp+deferral']:.3f}x; predicted "
        f"{predicted['dp'] / predicted['dp+deferral']:.3f}x; samples deferred per step {deferred:.1f}"
    )
    print(
        f"CV of per-microbatch stage time: off {cv['off']:.3f} -> dp+deferral {cv['dp+deferral']:.3f} "
        f"({cv['off'] / cv['dp+deferral']:.2f}x lower)"
    )
    for m in MODES:
        work = [
            statistics.mean(sum(r["microbatch_s"]) for r in rows if r["mode"] == m and r["step"] >= warmup)
            for rows in ranks
        ]
        print(f"{m:12s}: compute per step by stage (forward + backward s) {[round(w, 3) for w in work]}")
    print(f"largest loss difference between engines: {worst:.2e} (same batches, same update)")
    if json_out:
        json_out.write_text(
            json.dumps(
                {
                    "layout": layout,
                    "speedup": {m: total["off"] / total[m] for m in MODES},
                    "deferral_alone": total["dp"] / total["dp+deferral"],
                    "predicted_deferral_alone": predicted["dp"] / predicted["dp+deferral"],
                    "cv": cv,
                    "pipeline_part_s": part,
                    "recurrence_s": ideal,
                    "deferred_per_step": deferred,
                    "mean_step_s": {m: total[m] / len(by_mode[m]) for m in MODES},
                    "config": CONFIG,
                    "steps": [
                        {k: r[k] for k in ("step", "mode", "seconds", "pipeline_s", "deferred")} for r in ranks[0]
                    ],
                },
                indent=1,
            )
        )
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--layout",
        default="2",
        help="pipelines of 1 or 2 stages, e.g. 2, 2+1, 2+2+1+1 "
        "(a process each: more than this machine's cores share them)",
    )
    parser.add_argument("--global-batch", type=int, default=CONFIG["training"]["global_batch"])
    parser.add_argument("--microbatch-size", type=int, default=CONFIG["training"]["microbatch_size"])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    CONFIG["training"]["global_batch"] = args.global_batch
    CONFIG["training"]["microbatch_size"] = args.microbatch_size
    _counts(_depths(args.layout), args.global_batch // CONFIG["training"]["microbatch_size"])
    return run(args.layout, args.steps, args.warmup, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
