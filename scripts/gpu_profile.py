#!/usr/bin/env python
"""The engine's one-stage bf16 step on a 1 B HF Llama against a plain PyTorch loop, with MFU and a profile.

    python scripts/gpu_profile.py [--json OUT] [--size 1b|tiny] [--device cuda|cpu] [--steps N] [--warmup N]
                                  [--profile-steps N] [--trace FILE] [--peak-tflops X]

Issue 52 item 4, prepared to run in one device call (about 3 minutes on an H100-class GPU):

1. A random Llama of SIZES[size] (TinyLlama's shape at ``1b``: 22 blocks of width 2048, GQA 32/4 heads,
   1.1 B parameters) written with ``save_pretrained`` (bf16 safetensors) into a temporary folder.
2. **The engine**: that folder as ``model.huggingface``, one pipeline of one stage on GPU 0 (a real one-rank
   NCCL group), ``training.dtype: bfloat16`` (bf16 compute copies, fp32 masters and AdamW), fixed-length
   text samples (TOKENS a sample, MICROBATCH samples a microbatch, GLOBAL_BATCH a step).
3. **The plain loop**: the same folder through ``AutoModelForCausalLM.from_pretrained`` (fp32 weights, SDPA),
   ``torch.autocast(bfloat16)``, fused AdamW, the same global batches cut into the same microbatches
   (right-padded rows, no padding at fixed length), the engine's own loss normalisation and clipping:
   what a user would write without the engine.
4. Median step time of each after ``--warmup`` steps, engine / plain (target >= 0.95), MFU of each against
   ``--peak-tflops`` (default: the GPU's dense bf16 peak from PEAK_TFLOPS by name), peak memory.
5. ``torch.profiler`` over ``--profile-steps`` engine steps: the top kernels by device time, the device's busy
   share of the wall time (the rest: host gaps), the time in the optimizer update, packing and the
   gradient sync, and the top host operators; ``--trace FILE`` also writes the Chrome trace.

``--device cpu --size tiny`` runs the same code on this machine in seconds (the suite does, so the CUDA path
stays correct by construction when no GPU is lent). Exit status 1 if a loss is not finite or the two
systems' first losses differ by more than 1e-2 (bf16 and different sum orders: the same training).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

SIZES = {
    "1b": {
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "num_hidden_layers": 22,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "vocab_size": 32000,
        "max_position_embeddings": 4096,
    },
    "tiny": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 256,
    },
}
SHAPES = {
    "1b": {"tokens": 2048, "microbatch": 4, "global_batch": 16},
    "tiny": {"tokens": 32, "microbatch": 2, "global_batch": 4},
}
"""Per size: text tokens a sample (fixed), samples a microbatch, samples a step."""
PEAK_TFLOPS = {"H200": 989.5, "H100": 989.5, "A100": 312.0, "L40S": 362.0, "A40": 149.7}
"""Dense bf16 tensor-core peak by GPU name (vendor data sheets)."""
TARGET = 0.95
FIRST_LOSS_TOLERANCE = 1e-2


def job_for(directory: str, size: str, device: str):
    from oobleck_mm.config import config_from_dict

    shape = SHAPES[size]
    return config_from_dict(
        {
            "model": {"huggingface": directory},
            "data": {
                "kind": "synthetic",
                "seed": 0,
                "mean_text_tokens": shape["tokens"],
                "text_length_sigma": 0.0,
                "mean_images_per_sample": 0,
                "max_images_per_sample": 0,
                "max_seq_len": shape["tokens"] + 8,
                "num_samples": 4096,
            },
            "training": {
                "global_batch": shape["global_batch"],
                "microbatch_size": shape["microbatch"],
                "steps": 1000,
                "dtype": "bfloat16",
                "optimizer": {"type": "AdamW", "params": {"lr": 1.0e-4, "weight_decay": 0.0}},
                "gradient_clipping": 1.0,
                "activation_checkpointing": False,
            },
            "fault_tolerance": {"f": 0},
            "cluster": {"nodes": 1, "gpus_per_node": 1, "device": device, "backend": "auto"},
        }
    )


def model_flops_per_token(cfg: dict, tokens_per_sample: int) -> float:
    """Training FLOPs per token (PaLM's appendix B): 6 x the non-embedding matmul parameters, plus the causal
    attention's 12 x layers x width x sequence halved, plus the LM head's 6 x width x vocabulary."""
    h, f, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    kv = h * cfg["num_key_value_heads"] // cfg["num_attention_heads"]
    per_block = h * h * 2 + h * kv * 2 + 3 * h * f  # q, o; k, v; gate, up, down
    return 6 * layers * per_block + 6 * h * cfg["vocab_size"] + 12 * layers * h * tokens_per_sample / 2


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_gib(device: torch.device) -> float | None:
    return round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


# --------------------------------------------------------------------------- the engine


class EngineRun:
    """``StageEngine`` as it is, with its update, packing and gradient sync timed by wrapping them."""

    def __init__(self, job, device: torch.device):
        import oobleck_mm.runtime.engine as engine_module
        from oobleck_mm.model.layers import model_layer_specs
        from oobleck_mm.planning.layout import ExecutionPlan

        count = job.training.global_batch // job.training.microbatch_size
        plan = ExecutionPlan.even(len(model_layer_specs(job)), [1], [count], job.training.microbatch_size)
        self.engine = engine_module.StageEngine(job, plan, 0, device=device)
        self.parts: dict[str, float] = {}
        self.engine.data.microbatch = self._timed("pack_s", self.engine.data.microbatch)
        self.engine.sync.all_reduce = self._timed("grad_allreduce_s", self.engine.sync.all_reduce)
        self._restore = engine_module.apply_update
        engine_module.apply_update = self._timed("update_s", engine_module.apply_update)
        self._module = engine_module

    def _timed(self, key: str, fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.parts[key] = self.parts.get(key, 0.0) + time.perf_counter() - t0

        return wrapper

    def parameters(self) -> int:
        return sum(p.numel() for m in self.engine.layers.values() for p in m.parameters())

    def step(self, step: int) -> float:
        return self.engine.train_step(step).loss

    def close(self) -> None:
        self._module.apply_update = self._restore
        del self.engine


# --------------------------------------------------------------------------- the plain loop


class PlainRun:
    """The transformers model as a user trains it without the engine: fp32 weights under bf16 autocast, fused
    AdamW, the engine's samples, microbatches, loss normalisation, clipping and learning rate."""

    def __init__(self, job, device: torch.device):
        import transformers

        from oobleck_mm.data.loader import TrainingData

        self.job, self.device = job, device
        self.data = TrainingData(job)
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            job.model.huggingface, attn_implementation="sdpa", dtype=torch.float32
        ).to(device)
        self.model.train()
        hp = job.training.optimizer.params
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=hp.lr,
            betas=tuple(hp.betas),
            eps=hp.eps,
            weight_decay=hp.weight_decay,
            fused=device.type == "cuda",
        )
        self.parts: dict[str, float] = {}

    def parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def step(self, step: int) -> float:
        from oobleck_mm.balance.assignment import contiguous_assignment
        from oobleck_mm.model.layers import microbatch_loss
        from oobleck_mm.runtime.optim import lr_at, set_lr

        t = self.job.training
        ids = self.data.global_batch(step)
        loss_tokens = self.data.loss_tokens(ids)
        (mine,) = contiguous_assignment(ids, [t.global_batch // t.microbatch_size], t.microbatch_size).pipelines
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for ids_mb in mine:
            t0 = time.perf_counter()
            batch = self.data.microbatch(ids_mb)
            rows = [batch.tokens[s:e] for s, e in batch.spans()]
            width = max(len(r) for r in rows)
            input_ids = torch.zeros(len(rows), width, dtype=torch.long)
            mask = torch.zeros(len(rows), width, dtype=torch.long)
            for k, r in enumerate(rows):
                input_ids[k, : len(r)], mask[k, : len(r)] = r, 1
            batch = batch.to(self.device)
            input_ids, mask = input_ids.to(self.device), mask.to(self.device)
            self.parts["pack_s"] = self.parts.get("pack_s", 0.0) + time.perf_counter() - t0
            with torch.autocast(self.device.type, dtype=torch.bfloat16):
                logits = self.model(input_ids=input_ids, attention_mask=mask).logits
            packed = torch.cat([logits[k, : len(r)] for k, r in enumerate(rows)])
            loss = microbatch_loss(packed, batch, loss_tokens)
            loss.backward()
            total += loss.detach().double()
        t0 = time.perf_counter()
        if t.gradient_clipping > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), t.gradient_clipping)
        set_lr(self.optimizer, lr_at(t, step))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.parts["update_s"] = self.parts.get("update_s", 0.0) + time.perf_counter() - t0
        return float(total)

    def close(self) -> None:
        del self.model, self.optimizer


# --------------------------------------------------------------------------- measuring


def timed_steps(run, device: torch.device, warmup: int, steps: int, name: str) -> dict:
    times, losses = [], []
    for step in range(warmup + steps):
        if step == warmup:
            run.parts.clear()
        _sync(device)
        t0 = time.perf_counter()
        losses.append(run.step(step))
        _sync(device)
        elapsed = time.perf_counter() - t0
        if step >= warmup:
            times.append(elapsed)
        print(f"  {name} step {step}: {elapsed:.3f} s, loss {losses[-1]:.4f}", flush=True)
    return {
        "median_step_s": round(statistics.median(times), 4),
        "step_s": [round(x, 4) for x in times],
        "losses": [round(x, 5) for x in losses],
        "parts_s_per_step": {k: round(v / steps, 4) for k, v in sorted(run.parts.items())},
        "finite": all(x == x and abs(x) != float("inf") for x in losses),
    }


def profile_engine(run: EngineRun, device: torch.device, first: int, steps: int, trace: str | None) -> dict:
    """``torch.profiler`` over ``steps`` engine steps: where the device's and the host's time goes."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    _sync(device)
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        for step in range(first, first + steps):
            run.step(step)
        _sync(device)
    wall = time.perf_counter() - t0
    events = prof.key_averages()
    out: dict = {"wall_s_per_step": round(wall / steps, 4)}
    if device.type == "cuda":
        kernels = [e for e in events if getattr(e, "self_device_time_total", 0) > 0 and e.device_type.name == "CUDA"]
        busy = sum(e.self_device_time_total for e in kernels) / 1e6
        out["device_busy_share"] = round(busy / wall, 3)
        out["top_kernels"] = [
            {"name": e.key[:120], "ms_per_step": round(e.self_device_time_total / 1e3 / steps, 3), "calls": e.count}
            for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:12]
        ]
    host = sorted(events, key=lambda e: -e.self_cpu_time_total)[:12]
    out["top_host_ops"] = [
        {"name": e.key[:120], "ms_per_step": round(e.self_cpu_time_total / 1e3 / steps, 3), "calls": e.count}
        for e in host
    ]
    if trace:
        prof.export_chrome_trace(trace)
        out["trace"] = trace
    return out


def mfu(flops_per_step: float, step_s: float, peak_tflops: float | None) -> float | None:
    return round(flops_per_step / step_s / (peak_tflops * 1e12), 4) if peak_tflops else None


def default_peak(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), None)


def run(args: argparse.Namespace, work: Path) -> dict:
    from oobleck_mm.model.tiny_hf import make_tiny_model
    from oobleck_mm.runtime.group import join_generation, leave_group
    from oobleck_mm.runtime.worker import device_for

    t0 = time.perf_counter()
    directory = make_tiny_model(work / "llama", "llama", vision=None, text_sizes=SIZES[args.size], dtype=torch.bfloat16)
    print(f"model written in {time.perf_counter() - t0:.1f} s: {directory}", flush=True)
    job = job_for(str(directory), args.size, args.device)
    device = device_for(job, 0)
    wait = timedelta(seconds=300)
    store = torch.distributed.FileStore(str(work / "store"), 1)
    join_generation(store, 0, 0, 1, job.cluster.resolved_backend, collective_timeout=wait, arrival_timeout=wait)
    shape = SHAPES[args.size]
    tokens_per_step = shape["tokens"] * shape["global_batch"]
    flops_per_step = model_flops_per_token(SIZES[args.size], shape["tokens"]) * tokens_per_step
    peak = args.peak_tflops or default_peak(device)
    results: dict = {
        "size": args.size,
        "model": SIZES[args.size],
        "shape": shape,
        "model_flops_per_step": flops_per_step,
        "peak_tflops": peak,
    }
    try:
        for name, cls in (("engine", EngineRun), ("plain", PlainRun)):
            _reset_peak(device)
            system = cls(job, device)
            results[name] = timed_steps(system, device, args.warmup, args.steps, name)
            results[name]["parameters"] = system.parameters()
            results[name]["peak_gib"] = _peak_gib(device)
            step_s = results[name]["median_step_s"]
            results[name]["tokens_per_s"] = round(tokens_per_step / step_s)
            results[name]["mfu"] = mfu(flops_per_step, step_s, peak)
            if name == "engine" and args.profile_steps:
                results["engine_profile"] = profile_engine(
                    system, device, args.warmup + args.steps, args.profile_steps, args.trace
                )
            system.close()
    finally:
        leave_group()
    results["engine_over_plain"] = round(results["plain"]["median_step_s"] / results["engine"]["median_step_s"], 3)
    results["first_loss_diff"] = abs(results["engine"]["losses"][0] - results["plain"]["losses"][0])
    return results


def report(r: dict) -> None:
    for name in ("engine", "plain"):
        s = r[name]
        print(
            f"{name}: {s['parameters'] / 1e9:.3f} B parameters, median step {s['median_step_s']:.4f} s, "
            f"{s['tokens_per_s']} tokens/s, MFU {s['mfu']}, peak {s['peak_gib']} GiB; parts per step "
            f"{s['parts_s_per_step']}"
        )
    print(
        f"engine / plain {r['engine_over_plain']:.3f} (target >= {TARGET}); first losses differ by {r['first_loss_diff']:.1e}"
    )
    p = r.get("engine_profile")
    if p:
        print(f"engine profile: {p['wall_s_per_step']} s a step, device busy {p.get('device_busy_share')}")
        for k in p.get("top_kernels", []):
            print(f"  kernel {k['ms_per_step']:>9.3f} ms x{k['calls']:<5} {k['name']}")
        for k in p["top_host_ops"]:
            print(f"  host   {k['ms_per_step']:>9.3f} ms x{k['calls']:<5} {k['name']}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--size", choices=tuple(SIZES), default="1b")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per system (default 10)")
    ap.add_argument("--warmup", type=int, default=4, help="untimed steps first (default 4)")
    ap.add_argument("--profile-steps", type=int, default=2, help="engine steps under torch.profiler (0: none)")
    ap.add_argument("--trace", help="also write the profiler's Chrome trace here")
    ap.add_argument("--peak-tflops", type=float, help="the GPU's dense bf16 peak (default: by its name)")
    args = ap.parse_args(argv)
    for name in ("steps", "warmup"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.profile_steps < 0:
        ap.error(f"--profile-steps must be >= 0, got {args.profile_steps}")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: this machine has no CUDA device (use --device cpu --size tiny to try the script)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="gpu_profile_") as tmp:
        results = run(args, Path(tmp))
    results["device"] = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    results["versions"] = {"torch": torch.__version__, "cuda": torch.version.cuda}
    report(results)
    ok = (
        results["engine"]["finite"]
        and results["plain"]["finite"]
        and results["first_loss_diff"] <= FIRST_LOSS_TOLERANCE
    )
    if not ok:
        print("ERROR: a loss is not finite, or the two systems' first losses differ: not the same training")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
