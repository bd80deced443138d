"""Measured balancer on vs off in one run (``bench_balancer.py --real``).

Two 1-stage pipelines, one process each with one torch thread (this machine
has 2 cores: more processes would oversubscribe them), a skewed multimodal
dataset (0-8 images of 16-128 px, lognormal text with sigma 2). Each process holds two
engines of the same job, one with the balancer on and one with the contiguous
split, and they take turns step by step: step s of one, then step s of the
other, so both train on the same global batches at the same moments of this
shared machine's load. Their parameters stay equal (the balancer never changes
the update; tested elsewhere), so only time differs. Step time is the wall time
of ``train_step`` on rank 0 (every rank leaves the step at the same all-reduce).
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

CONFIG = {
    "model": {
        "name": "skewed_mm",
        "vision": {"num_layers": 2, "hidden": 192, "num_heads": 4, "patch_size": 8},
        "projector": {"num_layers": 1},
        "llm": {"num_layers": 4, "hidden": 384, "num_heads": 4, "vocab_size": 256},
    },
    "data": {
        "kind": "synthetic",
        "mean_text_tokens": 64,
        "text_length_sigma": 2.0,
        "mean_images_per_sample": 1.0,
        "max_images_per_sample": 8,
        "image_size": 128,
        "min_image_size": 16,
        "max_seq_len": 2048,
        "num_samples": 4096,
    },
    "training": {
        "global_batch": 16,
        "microbatch_size": 2,
        "steps": 60,
        "dtype": "float32",
        "optimizer": {"type": "AdamW", "params": {"lr": 1.0e-3}},
    },
    "cluster": {"nodes": 2, "device": "cpu", "backend": "gloo"},
    "balance": {"enabled": True, "algorithm": "ours", "threshold": 0.0, "fit_every": 2},
}


def _entry(config: dict, rank: int, port: int, steps: int, out: str) -> None:
    from oobleck_mm.balance.assignment import contiguous_assignment
    from oobleck_mm.config import config_from_dict
    from oobleck_mm.model.layers import model_layer_specs
    from oobleck_mm.planning.layout import ExecutionPlan
    from oobleck_mm.runtime.engine import StageEngine
    from oobleck_mm.runtime.group import join_generation

    torch.set_num_threads(1)
    job = config_from_dict(config)
    wait = timedelta(seconds=60)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=wait)
    join_generation(store, 0, rank, 2, "gloo", collective_timeout=wait, arrival_timeout=wait)
    mbs = job.training.global_batch // job.training.microbatch_size
    plan = ExecutionPlan.even(
        len(model_layer_specs(job)), [1, 1], [mbs // 2, mbs - mbs // 2], job.training.microbatch_size
    )
    # Both engines measure every pipeline's time (an all-reduce per step); the "off" one is handed
    # the contiguous split, exactly what runs with the balancer disabled.
    engines = {True: StageEngine(job, plan, rank), False: StageEngine(job, plan, rank)}
    counts = [p.num_microbatches for p in plan.pipelines]
    rows = []
    for step in range(steps):
        # Alternate which goes first, so neither always runs right after the other's all-reduce.
        for balanced in (True, False) if step % 2 == 0 else (False, True):
            engine = engines[balanced]
            dist.barrier()
            t0 = time.perf_counter()
            plain = (
                None
                if balanced
                else contiguous_assignment(engine.data.global_batch(step), counts, plan.microbatch_size)
            )
            result = engine.train_step(step, plain)
            seconds = time.perf_counter() - t0
            metrics = engine.balancer.last_metrics if balanced else {}
            rows.append(
                {
                    "step": step,
                    "balanced": balanced,
                    "seconds": seconds,
                    "predicted_imbalance": metrics.get("predicted_imbalance"),
                    "predicted_max_s": metrics.get("predicted_max_s"),
                    "predicted_contiguous_max_s": metrics.get("predicted_contiguous_max_s"),
                    "pipeline_times": result.pipeline_times,
                    "loss": result.loss,
                }
            )
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    dist.destroy_process_group()


def run_real(steps: int = 60, warmup: int = 6, json_out: Path | None = None) -> int:
    from _ranks import run_ranks

    out = Path(tempfile.mkdtemp()) / "rows.json"
    run_ranks(_entry, lambda rank, port: (CONFIG, rank, port, steps, str(out)), 2, 900, timedelta(seconds=60))
    rows = [r for r in json.loads(out.read_text()) if r["step"] >= warmup]
    on = {r["step"]: r for r in rows if r["balanced"]}
    off = {r["step"]: r for r in rows if not r["balanced"]}
    total_on = sum(r["seconds"] for r in on.values())
    total_off = sum(r["seconds"] for r in off.values())
    per_step = [off[s]["seconds"] / on[s]["seconds"] for s in sorted(on)]
    g = CONFIG["training"]["global_batch"]
    print(
        f"layout: 2 pipelines x 1 stage (1 process, 1 torch thread each); global batch {g}, microbatches of "
        f"{CONFIG['training']['microbatch_size']}"
    )
    print(f"skewed_mm: {json.dumps(CONFIG['model'])}")
    print(f"data: {json.dumps(CONFIG['data'])}")
    print(f"steps {warmup}..{steps - 1}: each step's global batch run by both engines, taking turns")
    print(
        f"balancer on : mean step {total_on / len(on) * 1e3:.1f} ms (median "
        f"{statistics.median(r['seconds'] for r in on.values()) * 1e3:.1f})"
    )
    print(
        f"balancer off: mean step {total_off / len(off) * 1e3:.1f} ms (median "
        f"{statistics.median(r['seconds'] for r in off.values()) * 1e3:.1f})"
    )

    def measured(rs):
        return statistics.mean(max(r["pipeline_times"]) / statistics.mean(r["pipeline_times"]) for r in rs)

    predicted = statistics.mean(r["predicted_imbalance"] for r in on.values())
    print(
        f"max/mean pipeline time: on {measured(on.values()):.3f} measured ({predicted:.3f} predicted), "
        f"off {measured(off.values()):.3f} measured"
    )
    worst = max(abs(on[s]["loss"] - off[s]["loss"]) for s in on)
    print(f"largest loss difference between the two engines: {worst:.2e} (same batches, same update)")
    ceiling = sum(r["predicted_contiguous_max_s"] for r in on.values()) / sum(r["predicted_max_s"] for r in on.values())
    print(
        f"predicted by the cost model: slowest pipeline {ceiling:.2f}x faster with the balancer "
        f"(what a perfect cost model and no fixed per-step costs would measure)"
    )
    speedup = total_off / total_on
    print(
        f"per-step speed-up: median {statistics.median(per_step):.2f}x, range {min(per_step):.2f}-{max(per_step):.2f}x"
    )
    print(f"speed-up with the balancer (total time off / on): {speedup:.2f}x (target >= 1.2x)")
    if json_out:
        json_out.write_text(
            json.dumps(
                {
                    "speedup": speedup,
                    "median_step_speedup": statistics.median(per_step),
                    "predicted_speedup": ceiling,
                    "mean_on_s": total_on / len(on),
                    "mean_off_s": total_off / len(off),
                    "steps": rows,
                    "config": CONFIG,
                },
                indent=1,
            )
        )
    return 0
