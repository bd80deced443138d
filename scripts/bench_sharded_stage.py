#!/usr/bin/env python
"""A stage of d GPUs (FSDP2) at d = 1, 2, 4: per-rank memory and step time, measured against the cost model.

    python scripts/bench_sharded_stage.py [--widths 1,2,4] [--steps 4] [--json OUT]

One pipeline of one stage holding the whole model (a built-in model larger than tiny_mm, float32, microbatches
of 4 samples, 16 a step), trained for ``--steps`` steps by d worker processes (gloo, one per simulated GPU).
Per width:

- memory: each rank's parameters, gradients and AdamW moments once the step's gradients are summed
  (``StageEngine.state_bytes``, its shards), the largest rank, against ``planning.costs.stage_cost``'s resident
  bytes per GPU (the planner's figure: the whole stage's state over d). Target: within 10%.
- time: the median step after the first, against the cost model's 1F1B time of the stage (microbatches x
  (forward + backward), FSDP2's all-gathers and reduce-scatters at the cluster's intra-node bandwidth),
  from the job's analytical CPU profile. This machine has 2 cores shared by the d processes: d = 4 cannot
  run faster than d = 2 here (the CPU ceiling is printed), so the time ratio is the figure to read, not
  the absolute.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODEL = {
    "vision": {"num_layers": 2, "hidden": 128, "num_heads": 4, "patch_size": 8},
    "projector": {"num_layers": 1},
    "llm": {"num_layers": 4, "hidden": 256, "num_heads": 4, "vocab_size": 1024},
}


def job_for(width_max: int):
    import yaml

    from oobleck_mm.config import config_from_dict

    raw = yaml.safe_load((ROOT / "configs" / "tiny_mm.yaml").read_text())
    raw["model"].update(MODEL)
    raw["training"].update(microbatch_size=4, global_batch=16, dtype="float32")
    raw["cluster"].update(gpus_per_node=width_max, max_gpus_per_stage=width_max)
    return config_from_dict(raw)


def _gather_rank(rank: int, port: int, world: int, nbytes: int, out: str) -> None:
    import time

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False)  # run_ranks' store
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    shard = torch.ones(nbytes // 4 // world)
    parts = [torch.empty_like(shard) for _ in range(world)]
    dist.all_gather(parts, shard)  # warm
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        dist.all_gather(parts, shard)
        times.append(time.perf_counter() - t0)
    if rank == 0:
        Path(out).write_text(json.dumps(statistics.median(times)))
    dist.destroy_process_group()


def loopback_bandwidth(world: int = 2, nbytes: int = 16_000_000) -> float:
    """Bytes/s this machine's gloo all-gather moves between ``world`` processes over loopback, in the cost
    model's terms (``ClusterSpec.allgather_s``: (p - 1)/p of the bytes over the link)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from _ranks import run_ranks

    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "t.json")
        run_ranks(_gather_rank, lambda rank, port: (rank, port, world, nbytes, out), world, timeout_s=120)
        seconds = json.loads(Path(out).read_text())
    return (world - 1) / world * nbytes / seconds


def predicted(job, width: int, microbatches: int) -> tuple[float, float]:
    """(resident bytes per GPU, 1F1B seconds of the step) of the whole model as one stage of ``width`` GPUs."""
    from oobleck_mm.planning.costs import ClusterSpec, LayerPrefix, effective_layers, stage_cost
    from oobleck_mm.profiling.load import load_profile

    profile = load_profile(job)
    prefix = LayerPrefix(effective_layers(profile))
    cost = stage_cost(prefix, ClusterSpec.from_config(job.cluster), 0, len(profile.layers), width)
    return cost.resident_bytes, microbatches * (cost.forward_s + cost.backward_s)


def measure(job, width: int, steps: int) -> dict:
    from oobleck_mm.planning.layout import ExecutionPlan
    from oobleck_mm.model.layers import model_layer_specs
    from oobleck_mm.runtime.worker import run_local

    layers = len(model_layer_specs(job))
    microbatches = job.training.global_batch // job.training.microbatch_size
    plan = ExecutionPlan.even(layers, [1], [microbatches], job.training.microbatch_size, widths=[[width]])
    with tempfile.TemporaryDirectory() as out:
        outs = run_local(job, plan, steps, out, timeout_s=600)
    per_rank = [max(r.state_bytes for r in o["results"]) for o in outs]
    times = [statistics.median(r.step_time_s for r in o["results"][1:]) for o in outs]
    bytes_pred, time_pred = predicted(job, width, microbatches)
    return {
        "width": width,
        "state_bytes_per_rank": per_rank,
        "state_bytes_max": max(per_rank),
        "predicted_bytes": bytes_pred,
        "bytes_ratio": max(per_rank) / bytes_pred,
        "step_s": max(times),
        "predicted_step_s": time_pred,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", default="1,2,4")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    widths = [int(w) for w in args.widths.split(",")]
    job = job_for(max(widths))
    bandwidth = loopback_bandwidth()
    print(
        f"gloo all-gather over loopback, 2 processes: {bandwidth / 1e9:.2f} GB/s in the cost model's terms "
        f"(cluster.intra_node_bandwidth default {job.cluster.intra_node_bandwidth / 1e9:.0f} GB/s, an NVLink's)"
    )
    measured_link = dataclasses.replace(job, cluster=dataclasses.replace(job.cluster, intra_node_bandwidth=bandwidth))
    rows = []
    print(
        f"{'d':>2} {'state MB/rank':>14} {'predicted':>10} {'ratio':>6} {'step s':>8} {'predicted':>10} "
        f"{'at loopback':>12} {'ratio':>6} {'vs d=1':>7}"
    )
    for width in widths:
        row = measure(job, width, args.steps)
        row["predicted_step_s_loopback"] = predicted(
            measured_link, width, job.training.global_batch // job.training.microbatch_size
        )[1]
        rows.append(row)
        base = rows[0]["step_s"]
        print(
            f"{width:>2} {row['state_bytes_max'] / 1e6:>14.3f} {row['predicted_bytes'] / 1e6:>10.3f} "
            f"{row['bytes_ratio']:>6.3f} {row['step_s']:>8.3f} {row['predicted_step_s']:>10.4f} "
            f"{row['predicted_step_s_loopback']:>12.4f} {row['step_s'] / row['predicted_step_s_loopback']:>6.2f} "
            f"{base / row['step_s']:>6.2f}x",
            flush=True,
        )
    print(
        "CPU ceiling: 2 cores shared by the d processes (d = 4 cannot beat d = 2 here); predicted times are the "
        "analytical CPU profile's"
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps({"rows": rows, "model": MODEL, "loopback_bytes_per_s": bandwidth}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
