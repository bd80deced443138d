#!/usr/bin/env python
"""The one-command GPU check (issue 28, item 7): every CUDA test, then a short bench, one summary.

    make gpu-check                      # = python scripts/gpu_check.py --json gpu_check.json
    python scripts/gpu_check.py [--json OUT] [--bench-steps N] [--no-tests] [--no-bench]

1. The machine: torch, CUDA, NCCL, the GPUs, the package versions the engine runs on.
2. Every CUDA test, in one pytest run: the one-GPU NCCL equivalence tests
   (``tests/integration/test_one_gpu.py``: float64 equal to the CPU reference, a checkpoint
   from CUDA tensors read back on the CPU, bf16 and fp16), the per-step synchronisation test
   (``test_engine_prefetch.py``), the two-GPU NCCL pipeline and a stage sharded over two GPUs
   by FSDP2 (``test_cuda_smoke.py``, skipped with fewer than two GPUs: NCCL will not put two
   ranks of one group on one GPU), the
   meta-device placement tests and the worker template's (``test_worker_template.py``: a
   worker forked from it computes on CUDA; the template never initialised the driver).
3. The whole job on GPU 0: ``oobleck-launch local`` on one node (master, agent and worker
   processes, the gRPC control plane), a periodic checkpoint written from CUDA tensors while
   training and a final one, read back on the CPU by the reference trainer.
4. A short bench: the engine as one one-stage pipeline on GPU 0 (a real one-rank NCCL group),
   a scaled-up tiny_mm (BENCH_MODEL), float32 and bfloat16 side by side: median step time,
   samples/s, tokens/s and peak GPU memory. bf16 faster than float32 shows the mixed-precision
   path reaches the tensor cores.

Without CUDA it says so and exits 0 (CI has no GPU; the CUDA tests skip there anyway).
Exit status 1 if a test failed or the bench's losses are not finite.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

CUDA_TESTS = [
    "tests/integration/test_one_gpu.py",
    "tests/integration/test_engine_prefetch.py",
    "tests/integration/test_cuda_smoke.py",
    "tests/unit/test_device_placement.py",
    "tests/integration/test_worker_template.py",
]
# tiny_mm scaled until a step is GPU work, not launch overhead (~0.5 B parameters).
BENCH_MODEL = {
    "vision": {"num_layers": 6, "hidden": 1024, "num_heads": 16, "patch_size": 16},
    "projector": {"num_layers": 1},
    "llm": {"num_layers": 8, "hidden": 2048, "num_heads": 16, "vocab_size": 32000},
}
BENCH_DATA = {
    "image_size": 336,
    "min_image_size": 224,
    "mean_images_per_sample": 1,
    "max_images_per_sample": 2,
    "mean_text_tokens": 256,
    "max_seq_len": 1024,
}
BENCH_TRAINING = {"global_batch": 32, "microbatch_size": 4}


def environment() -> dict:
    import importlib.metadata as md

    env = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": sys.version.split()[0],
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
    }
    if torch.cuda.is_available():
        env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        free, total = torch.cuda.mem_get_info(0)
        env["gpu0_memory_gib"] = round(total / 2**30, 1)
    for package in ("deepspeed", "transformers", "grpcio", "pyomo", "highspy"):
        try:
            env[package] = md.version(package)
        except md.PackageNotFoundError:
            env[package] = None
    return env


def run_tests(out_dir: Path) -> dict:
    """Every CUDA test in one pytest process; each test's outcome from its JUnit report."""
    report = out_dir / "gpu_tests.xml"
    started = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", *CUDA_TESTS, "-q", "-p", "no:cacheprovider", "-rfEs", f"--junitxml={report}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    (out_dir / "gpu_tests.log").write_text(proc.stdout + proc.stderr)
    outcomes = {}
    if report.exists():
        for case in ET.parse(report).iter("testcase"):
            name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
            kids = {child.tag for child in case}
            outcomes[name] = "failed" if kids & {"failure", "error"} else "skipped" if "skipped" in kids else "passed"
    counts = {k: sum(v == k for v in outcomes.values()) for k in ("passed", "failed", "skipped")}
    return {
        "exit": proc.returncode,
        "seconds": round(time.perf_counter() - started, 1),
        **counts,
        "tests": outcomes,
        "tail": (proc.stdout + proc.stderr)[-3000:],
    }


def run_job(out_dir: Path, steps: int = 10) -> dict:
    """``oobleck-launch local`` on one GPU: exit 0, every step, the checkpoints readable on the CPU."""
    run_dir = out_dir / "job"
    started = time.perf_counter()
    sets = ["cluster.device=cuda", "cluster.accelerator=h100", "cluster.backend=auto", "fault_tolerance.f=0"]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "oobleck_mm.cli",
            "local",
            "--config",
            "configs/tiny_mm.yaml",
            "--nodes",
            "1",
            "--steps",
            str(steps),
            "--checkpoint-interval",
            "5",
            "--run-dir",
            str(run_dir),
            "--save-final",
            str(run_dir / "final"),
            *(a for kv in sets for a in ("--set", kv)),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    (out_dir / "gpu_job.log").write_text(proc.stdout + proc.stderr)
    result = {
        "exit": proc.returncode,
        "seconds": round(time.perf_counter() - started, 1),
        "done": f"done: {steps} steps" in proc.stdout,
        "tail": (proc.stdout + proc.stderr)[-3000:],
    }
    if proc.returncode == 0:
        from oobleck_mm.config import config_from_dict
        from oobleck_mm.runtime.reference import ReferenceTrainer

        trainer = ReferenceTrainer(config_from_dict(_tiny_mm_one_node()))
        result["final_step_read_on_cpu"] = trainer.load_checkpoint(str(run_dir / "final"))
        result["periodic_checkpoints"] = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    result["ok"] = result["exit"] == 0 and result["done"] and result.get("final_step_read_on_cpu") == steps
    return result


def bench_job(dtype: str):
    from oobleck_mm.config import config_from_dict

    d = _tiny_mm_one_node()
    d["model"].update(name="gpu_bench_mm", **BENCH_MODEL)
    d["data"].update(BENCH_DATA)
    d["training"].update(dtype=dtype, **BENCH_TRAINING)
    d["cluster"].update(device="cuda", accelerator="h100", backend="auto")
    return config_from_dict(d)


def _tiny_mm_one_node() -> dict:
    """configs/tiny_mm.yaml as a dict, on one node (f = 0: nothing to survive)."""
    import yaml

    with open(ROOT / "configs/tiny_mm.yaml") as f:
        d = yaml.safe_load(f)
    d["fault_tolerance"]["f"] = 0
    d["cluster"]["nodes"] = 1
    return d


def run_bench(steps: int, warmup: int, out_dir: Path) -> dict:
    """float32 and bfloat16 in one process, one NCCL group, same data: median step time and peak memory."""
    from datetime import timedelta

    import torch.distributed as dist

    from oobleck_mm.planning.layout import ExecutionPlan
    from oobleck_mm.runtime.engine import StageEngine
    from oobleck_mm.runtime.group import join_generation, leave_group
    from oobleck_mm.runtime.worker import device_for

    results = {}
    wait = timedelta(seconds=120)
    job0 = bench_job("float32")
    device = device_for(job0, 0)  # torch.cuda.set_device(0), before NCCL binds to it
    join_generation(
        dist.FileStore(str(out_dir / "bench_store"), 1),
        0,
        0,
        1,
        job0.cluster.resolved_backend,
        collective_timeout=wait,
        arrival_timeout=wait,
    )
    try:
        for dtype in ("float32", "bfloat16"):
            job = bench_job(dtype)
            count = job.training.global_batch // job.training.microbatch_size
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
            plan = ExecutionPlan.even(_layers(job), [1], [count], job.training.microbatch_size)
            engine = StageEngine(job, plan, 0, device=device)
            params = sum(p.numel() for m in engine.layers.values() for p in m.parameters())
            times, losses, tokens, parts = [], [], [], []
            for step in range(warmup + steps):
                torch.cuda.synchronize(device)
                started = time.perf_counter()
                result = engine.train_step(step)
                torch.cuda.synchronize(device)
                if step >= warmup:
                    times.append(time.perf_counter() - started)
                    tokens.append(_step_tokens(engine, step))
                    parts.append((result.pack_s, result.forward_s, result.backward_s, result.pipeline_s))
                losses.append(result.loss)
                print(
                    f"  bench {dtype} step {step}: {time.perf_counter() - started:.3f} s, loss {result.loss:.4f}",
                    flush=True,
                )
            median = statistics.median(times)
            results[dtype] = {
                "parameters": params,
                "median_step_s": round(median, 4),
                "samples_per_s": round(job.training.global_batch / median, 1),
                "tokens_per_s": round(statistics.mean(tokens) / median),
                "peak_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2),
                # Host seconds packing microbatches, device seconds of forward and
                # backward, and the 1F1B part of the step: where a step's time goes.
                **{
                    f"median_{name}": round(statistics.median(p[k] for p in parts), 4)
                    for k, name in enumerate(("pack_s", "forward_s", "backward_s", "pipeline_s"))
                },
                "losses": [round(x, 5) for x in losses],
                "finite": all(x == x and abs(x) != float("inf") for x in losses),
            }
            del engine
    finally:
        leave_group()
    if "float32" in results and "bfloat16" in results:
        results["bf16_speedup"] = round(results["float32"]["median_step_s"] / results["bfloat16"]["median_step_s"], 2)
    return results


def _layers(job) -> int:
    from oobleck_mm.model.layers import model_layer_specs

    return len(model_layer_specs(job))


def _step_tokens(engine, step: int) -> int:
    """LLM tokens (text and media) of the step's global batch."""
    return engine.data.llm_tokens(engine.data.global_batch(step))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write the summary here as JSON")
    parser.add_argument("--bench-steps", type=int, default=8)
    parser.add_argument("--bench-warmup", type=int, default=3)
    parser.add_argument("--no-tests", action="store_true")
    parser.add_argument("--no-job", action="store_true")
    parser.add_argument("--no-bench", action="store_true")
    parser.add_argument("--out-dir", help="logs and the JUnit report (default: a temporary directory)")
    args = parser.parse_args(argv)
    out_dir = Path(args.out_dir or tempfile.mkdtemp(prefix="gpu_check_"))
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = {"environment": environment()}
    print(json.dumps(summary["environment"]), flush=True)
    if not torch.cuda.is_available():
        print("gpu-check: no CUDA device here; nothing to check (the CUDA tests skip on this machine)")
        return 0
    failed = False
    if not args.no_tests:
        print(f"gpu-check: {len(CUDA_TESTS)} CUDA test files ...", flush=True)
        summary["tests"] = tests = run_tests(out_dir)
        failed |= tests["exit"] != 0
    if not args.no_job:
        print("gpu-check: the job on one GPU ...", flush=True)
        try:
            summary["job"] = job = run_job(out_dir)
        except Exception:  # noqa: BLE001 - reported in the summary, and the exit status says so
            import traceback

            summary["job"] = job = {"ok": False, "tail": traceback.format_exc()[-3000:]}
        failed |= not job["ok"]
    if not args.no_bench:
        print("gpu-check: bench ...", flush=True)
        try:
            summary["bench"] = bench = run_bench(args.bench_steps, args.bench_warmup, out_dir)
            failed |= not all(v["finite"] for v in bench.values() if isinstance(v, dict))
        except Exception:  # noqa: BLE001 - reported in the summary, and the exit status says so
            import traceback

            summary["bench"] = {"error": traceback.format_exc()[-3000:]}
            failed = True
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    print("\n== gpu-check summary ==")
    env = summary["environment"]
    print(f"machine: {', '.join(env['gpus'])}; torch {env['torch']} CUDA {env['cuda']} NCCL {env.get('nccl')}")
    if "tests" in summary:
        t = summary["tests"]
        print(
            f"tests: {t['passed']} passed, {t['failed']} failed, {t['skipped']} skipped in {t['seconds']} s "
            f"(pytest exit {t['exit']})"
        )
        for name, outcome in t["tests"].items():
            print(f"  {outcome:8s} {name}")
        if t["exit"] != 0:
            print(t["tail"])
    if "job" in summary:
        j = summary["job"]
        print(
            f"job: {'ok' if j['ok'] else 'FAILED'} (exit {j.get('exit')}, {j.get('seconds')} s, final checkpoint "
            f"read on the cpu at step {j.get('final_step_read_on_cpu')}, periodic {j.get('periodic_checkpoints')})"
        )
        if not j["ok"]:
            print(j["tail"])
    if "bench" in summary:
        b = summary["bench"]
        if "error" in b:
            print("bench: FAILED\n" + b["error"])
        for dtype in ("float32", "bfloat16"):
            if dtype in b:
                r = b[dtype]
                print(
                    f"bench {dtype:8s}: {r['parameters'] / 1e6:.0f} M params, step {r['median_step_s']:.3f} s, "
                    f"{r['samples_per_s']} samples/s, {r['tokens_per_s']} tokens/s, peak {r['peak_gib']} GiB; "
                    f"pack {r['median_pack_s']:.3f} s, forward {r['median_forward_s']:.3f} s, "
                    f"backward {r['median_backward_s']:.3f} s, 1F1B {r['median_pipeline_s']:.3f} s"
                )
        if "bf16_speedup" in b:
            print(f"bench bf16 speed-up over float32: {b['bf16_speedup']}x")
    print("gpu-check:", "FAILED" if failed else "passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
