"""Measured balancer on vs off in one run (``bench_balancer.py --real``).

Two 1-stage pipelines, one process each with one torch thread (this machine
has 2 cores: more processes would oversubscribe them), a skewed multimodal
dataset (0-8 images of 16-64 px, heavy-tailed text), and steps that alternate
between the balancer's assignment and the contiguous split. Both kinds of step
see the same model and the same kind of batches; the parameters end the same
either way (tested elsewhere), so only time differs. Step time is the wall time
of ``train_step`` on rank 0 (every rank leaves the step at the same all-reduce).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import yaml

CONFIG = {
    "model": {"name": "skewed_mm", "vision": {"num_layers": 2, "hidden": 64, "num_heads": 4, "patch_size": 8},
              "projector": {"num_layers": 1}, "llm": {"num_layers": 4, "hidden": 128, "num_heads": 4, "vocab_size": 256}},
    "data": {"kind": "synthetic", "mean_text_tokens": 64, "text_length_sigma": 1.6, "mean_images_per_sample": 1.0,
             "max_images_per_sample": 8, "image_size": 128, "min_image_size": 16, "max_seq_len": 2048,
             "num_samples": 4096},
    "training": {"global_batch": 8, "microbatch_size": 1, "steps": 40, "dtype": "float32",
                 "optimizer": {"type": "AdamW", "params": {"lr": 1.0e-3}}},
    "cluster": {"nodes": 2, "device": "cpu", "backend": "gloo"},
    "balance": {"enabled": True, "algorithm": "ours", "threshold": 0.0, "fit_every": 4},
}


def _entry(config: dict, rank: int, port: int, steps: int, out: str) -> None:
    from oobleck_mm.balance.assignment import contiguous_assignment
    from oobleck_mm.config import config_from_dict
    from oobleck_mm.model.layers import model_layer_specs
    from oobleck_mm.runtime.engine import StageEngine
    from oobleck_mm.runtime.layout import ExecutionPlan

    torch.set_num_threads(1)
    job = config_from_dict(config)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    mbs = job.training.global_batch // job.training.microbatch_size
    plan = ExecutionPlan.even(len(model_layer_specs(job)), [1, 1], [mbs // 2, mbs - mbs // 2],
                              job.training.microbatch_size)
    engine = StageEngine(job, plan, rank)
    rows = []
    for step in range(steps):
        balanced = step % 2 == 0
        assignment = None
        if not balanced:
            ids = engine.data.global_batch(step)
            assignment = contiguous_assignment(ids, [p.num_microbatches for p in plan.pipelines], plan.microbatch_size)
        dist.barrier()
        t0 = time.perf_counter()
        result = engine.train_step(step, assignment)
        rows.append({"step": step, "balanced": balanced, "seconds": time.perf_counter() - t0,
                     "predicted_imbalance": engine.balancer.last_metrics.get("predicted_imbalance") if balanced else None,
                     "pipeline_times": result.pipeline_times})
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    dist.destroy_process_group()


def run_real(steps: int = 40, warmup: int = 6, json_out: Path | None = None) -> int:
    from oobleck_mm.runtime.worker import free_port

    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    out = Path(tempfile.mkdtemp()) / "rows.json"
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_entry, args=(CONFIG, r, port, steps, str(out)), daemon=True) for r in range(2)]
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.join(900)
        if any(p.exitcode != 0 for p in procs):
            raise RuntimeError(f"workers exited with {[p.exitcode for p in procs]}")
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        del store
    rows = [r for r in json.loads(out.read_text()) if r["step"] >= warmup]
    on = [r["seconds"] for r in rows if r["balanced"]]
    off = [r["seconds"] for r in rows if not r["balanced"]]
    mean_on, mean_off = statistics.mean(on), statistics.mean(off)
    print("layout: 2 pipelines x 1 stage (1 process, 1 torch thread each); global batch 8, microbatches of 1;")
    print(f"skewed_mm: {json.dumps(CONFIG['model'])}")
    print(f"steps {warmup}..{steps - 1}, alternating (balancer on even steps, contiguous split on odd steps)")
    print(f"balancer on : mean step {mean_on * 1e3:.1f} ms (median {statistics.median(on) * 1e3:.1f})")
    print(f"balancer off: mean step {mean_off * 1e3:.1f} ms (median {statistics.median(off) * 1e3:.1f})")
    measured = lambda rs: statistics.mean(max(r["pipeline_times"]) / statistics.mean(r["pipeline_times"]) for r in rs)
    print(f"measured max/mean pipeline time: on {measured([r for r in rows if r['balanced']]):.3f}, "
          f"off {measured([r for r in rows if not r['balanced']]):.3f}")
    speedup = mean_off / mean_on
    print(f"speed-up with the balancer: {speedup:.2f}x (target >= 1.2x)")
    if json_out:
        json_out.write_text(json.dumps({"speedup": speedup, "mean_on_s": mean_on, "mean_off_s": mean_off,
                                        "steps": rows, "config": CONFIG}, indent=1))
    return 0
