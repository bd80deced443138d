#!/usr/bin/env python
"""Mixed precision (issue 12): memory held vs the cost model, step time and update time, bf16 vs fp32.

    python scripts/bench_precision.py [--json OUT] [--steps N] [--rounds R]

One process, one torch thread, the runtime benchmark's model (tiny_mm scaled up by
``bench_runtime.BENCH_OVERRIDES``), trained by the reference trainer, which holds
what a worker holding every layer holds: masters, their compute copies (mixed
precision), gradients and AdamW moments. The modes run side by side, taking turns
step by step (the machine is shared and noisy; compare the ratios):

- memory: bytes of every tensor held after a step (parameters, copies, gradients as
  they are at the end of the backward, optimizer state), by kind, against the
  analytical cost model's ``param_bytes + grad_bytes + optimizer_bytes`` for the
  same job;
- step time: median seconds per step;
- update: median seconds of the optimizer part of a step (clip, AdamW on the
  masters, refreshing the compute copies) per parameter byte;
- activations: the bytes autograd keeps for the backward of a microbatch
  (``torch.autograd.graph.saved_tensors_hooks`` sees every tensor saved; storages
  counted once, weights excluded), over every microbatch of one global batch,
  against the cost model's ``activation_bytes`` for as many microbatches. This is
  what a device allocator would show as activation memory, measured without one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import torch  # noqa: E402

from bench_runtime import base_job_dict  # noqa: E402
from oobleck_mm.config import config_from_dict  # noqa: E402
from oobleck_mm.profiling.analytical import profile_from_config  # noqa: E402
from oobleck_mm.runtime import reference as reference_module  # noqa: E402
from oobleck_mm.runtime.reference import ReferenceTrainer  # noqa: E402

MODES = {"float32": {"dtype": "float32"}, "bfloat16": {"dtype": "bfloat16"}}


def held_bytes(trainer: ReferenceTrainer) -> dict[str, int]:
    seen: set[int] = set()

    def count(tensors) -> int:
        total = 0
        for t in tensors:
            if t is not None and id(t) not in seen:
                seen.add(id(t))
                total += t.numel() * t.element_size()
        return total

    masters = [p for layer in trainer.layers for p in layer.parameters()]
    out = {"masters": count(masters)}
    out["compute_copies"] = count(
        p for i, m in trainer.compute.items() if trainer.mixed is not None for p in m.parameters()
    )
    out["gradients"] = count(p.grad for p in masters)
    out["optimizer"] = count(
        v
        for opt in trainer.optimizers.values()
        for state in opt.state.values()
        for v in state.values()
        if torch.is_tensor(v) and v.dim() > 0
    )
    out["total"] = sum(out.values())
    return out


def activation_bytes(trainer: ReferenceTrainer, step: int = 0) -> tuple[int, int, dict[str, int]]:
    """(bytes saved for backward over every microbatch of ``step``'s global batch, microbatches, bytes by dtype)."""
    weights = {p.untyped_storage().data_ptr() for layer in trainer.layers for p in layer.parameters()}
    weights |= {p.untyped_storage().data_ptr() for m in trainer.compute.values() for p in m.parameters()}
    ids = trainer.data.global_batch(step)
    size = trainer.job.training.microbatch_size
    total, count, by_dtype = 0, 0, {}
    for start in range(0, len(ids), size):
        batch = trainer.data.microbatch(ids[start : start + size])
        seen: set[int] = set()

        def pack(t: torch.Tensor):
            storage = t.untyped_storage()
            if storage.data_ptr() not in weights and storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                nonlocal_total[0] += storage.nbytes()
                key = str(t.dtype).removeprefix("torch.")
                by_dtype[key] = by_dtype.get(key, 0) + storage.nbytes()
            return t

        nonlocal_total = [0]
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            acts: tuple[torch.Tensor, ...] = ()
            for i in range(len(trainer.layers)):
                acts = trainer.compute[i](acts, batch)
        del acts  # the graph (and what it saved) goes with it: no backward needed to count it
        total, count = total + nonlocal_total[0], count + 1
    return total, count, by_dtype


CURRENT: list[ReferenceTrainer] = []
"""The trainer running a step now: the update timer below books its time to it."""


def time_updates() -> None:
    """Time the update apart, and keep each step's gradients (the step frees them) for the memory count."""
    original = reference_module.apply_update

    def timed(*args, **kwargs):
        trainer = CURRENT[-1]
        for layer in trainer.layers:
            for p in layer.parameters():
                if p.grad is not None:
                    p.kept_grad = p.grad.clone()
        t0 = time.perf_counter()
        result = original(*args, **kwargs)
        trainer.update_s.append(time.perf_counter() - t0)
        return result

    reference_module.apply_update = timed


def time_refresh(trainer: ReferenceTrainer) -> None:
    """Refreshing the compute copies from the masters is part of the mixed-precision update."""
    if trainer.mixed is None:
        return
    original = trainer.mixed.sync

    def timed():
        t0 = time.perf_counter()
        original()
        trainer.update_s[-1] += time.perf_counter() - t0

    trainer.mixed.sync = timed


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json")
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    raw = base_job_dict(None)
    jobs, trainers = {}, {}
    for mode, training in MODES.items():
        d = json.loads(json.dumps(raw))
        d["training"].update(training)
        jobs[mode] = config_from_dict(d)
        trainers[mode] = ReferenceTrainer(jobs[mode])
        time_refresh(trainers[mode])
    times = {m: [] for m in MODES}
    updates = {m: [] for m in MODES}
    time_updates()
    for step in range(args.steps):
        for mode, trainer in trainers.items():  # taking turns, step by step
            trainer.update_s = []
            CURRENT.append(trainer)
            t0 = time.perf_counter()
            trainer.train_step(step)
            times[mode].append(time.perf_counter() - t0)
            updates[mode].append(trainer.update_s[-1])
    rows = []
    for mode, trainer in trainers.items():
        for layer in trainer.layers:
            for p in layer.parameters():
                p.grad = getattr(p, "kept_grad", None)
        held = held_bytes(trainer)
        profile = profile_from_config(jobs[mode])
        predicted = sum(l.param_bytes + l.grad_bytes + l.optimizer_bytes for l in profile.layers)
        # The cost model counts the compute copy as the parameters: in fp32 that is the master itself.
        param_bytes = sum(p.numel() * p.element_size() for layer in trainer.layers for p in layer.parameters())
        saved, microbatches, saved_by_dtype = activation_bytes(trainer)
        predicted_acts = microbatches * sum(l.activation_bytes for l in profile.layers)
        rows.append(
            {
                "mode": mode,
                "held_bytes": held,
                "predicted_state_bytes": predicted,
                "activation_bytes": saved,
                "predicted_activation_bytes": predicted_acts,
                "activation_bytes_by_dtype": saved_by_dtype,
                "activations_over_predicted": round(saved / predicted_acts, 3),
                "held_over_predicted": round(held["total"] / predicted, 3),
                "median_step_s": round(statistics.median(times[mode][1:]), 4),
                "median_update_s": round(statistics.median(updates[mode][1:]), 5),
                "update_ns_per_master_byte": round(statistics.median(updates[mode][1:]) / param_bytes * 1e9, 3),
            }
        )
    base = rows[0]
    print(
        f"{'mode':<9} {'held MiB':>9} {'predicted MiB':>13} {'held/pred':>9} {'step s':>8} {'update s':>9} "
        f"{'update ns/B':>11}"
    )
    for r in rows:
        print(
            f"{r['mode']:<9} {r['held_bytes']['total'] / 2**20:9.2f} {r['predicted_state_bytes'] / 2**20:13.2f} "
            f"{r['held_over_predicted']:9.3f} {r['median_step_s']:8.4f} {r['median_update_s']:9.5f} "
            f"{r['update_ns_per_master_byte']:11.3f}"
        )
        print("          held by kind (MiB): " + ", ".join(f"{k} {v / 2**20:.2f}" for k, v in r["held_bytes"].items()))
    print(
        f"{'mode':<9} {'activations MiB':>15} {'predicted MiB':>13} {'measured/pred':>13}   (one global batch, "
        "saved for backward)"
    )
    for r in rows:
        print(
            f"{r['mode']:<9} {r['activation_bytes'] / 2**20:15.2f} {r['predicted_activation_bytes'] / 2**20:13.2f} "
            f"{r['activations_over_predicted']:13.3f}   by dtype (MiB): "
            + ", ".join(f"{k} {v / 2**20:.2f}" for k, v in sorted(r["activation_bytes_by_dtype"].items()))
        )
    for r in rows[1:]:
        print(
            f"{r['mode']} / {base['mode']}: activations {r['activation_bytes'] / base['activation_bytes']:.2f}x "
            f"(predicted {r['predicted_activation_bytes'] / base['predicted_activation_bytes']:.2f}x)"
        )
        print(
            f"{r['mode']} / {base['mode']}: memory {r['held_bytes']['total'] / base['held_bytes']['total']:.2f}x, "
            f"step time {r['median_step_s'] / base['median_step_s']:.2f}x, "
            f"update time {r['median_update_s'] / base['median_update_s']:.2f}x"
        )
    if args.json:
        command = "python scripts/bench_precision.py " + " ".join(argv if argv is not None else sys.argv[1:])
        Path(args.json).write_text(json.dumps({"command": command.strip(), "rows": rows}, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
