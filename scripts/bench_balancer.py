"""Benchmark of the multimodal data-parallel balancer: predicted imbalance and decision time per algorithm.

    python scripts/bench_balancer.py [--json OUT] [--quick]
    python scripts/bench_balancer.py --real [--json OUT]   (measured: balancer on vs off, one run)
    python scripts/bench_balancer.py --deferral            (predicted: Entrain's deferral, seconds)

Workload: OrchMLLM's MLLM-10B (configs/mllm_10b.yaml: ViT + Whisper-style
audio encoder + Qwen2-7B-class LLM) with a 2x2 vision token merge (Qwen2-VL),
analytical H100 profile. Each sample has 0-8 images of 224-896 px sides
(most have 0-2), lognormal text of 16-4096 tokens (heavy tail), and 20%
carry one 1-30 s audio clip. Pipelines have mixed depths (2, 3, 4, 6, 8
stages, cut at equal mean-sample cost) and microbatch counts proportional to
depth (two samples per microbatch on average), as the planner would give
them; the global batch is exactly what the unbalanced split fills.

Each row: one (pipelines, samples per pipeline) case and algorithm; imbalance
is predicted max/mean pipeline iteration time (the exact 1F1B model of
``oobleck_mm.balance.schedule_time``); ``ms`` and ``cpu_ms`` are the best wall
and CPU time of several runs of ``balance.ALGORITHMS[name](problem)`` (the
table prints CPU time, which a machine shared with other jobs inflates less);
building the problem (the per-sample stage costs) is ``build_ms`` (CPU).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from oobleck_mm.balance.balancer import ALGORITHMS  # noqa: E402
from oobleck_mm.balance.cost_model import CostCoefficients, CostModel  # noqa: E402
from oobleck_mm.balance.metrics import imbalance  # noqa: E402
from oobleck_mm.balance.problem import BalanceProblem, PipelineShape  # noqa: E402
from oobleck_mm.balance.work import sample_features  # noqa: E402
from oobleck_mm.config import load_config  # noqa: E402
from oobleck_mm.data.dataset import ModelInputs  # noqa: E402
from oobleck_mm.data.sample import SampleMeta  # noqa: E402
from oobleck_mm.config.shape import layer_specs  # noqa: E402
from oobleck_mm.profiling.analytical import profile_from_config  # noqa: E402

PIPELINES = (4, 16, 64, 256)
SAMPLES_PER_PIPELINE = (16, 64, 128)
DEPTHS = (2, 3, 4, 6, 8)
MICROBATCH_SIZE = 2
IMAGE_COUNT_P = (0.30, 0.34, 0.12, 0.07, 0.05, 0.04, 0.03, 0.03, 0.02)
FIXED_S_PER_LAYER = 30e-6


def bench_model():
    job = load_config(ROOT / "configs" / "mllm_10b.yaml")
    job.model.vision = replace(job.model.vision, token_merge=4)
    specs = layer_specs(job.model, job.data)
    cost_model = CostModel.from_profile(profile_from_config(job), specs)
    return job, cost_model, CostCoefficients.initial(FIXED_S_PER_LAYER), ModelInputs.from_model(job.model)


def skewed_metas(num: int, dims: ModelInputs, rng: np.random.Generator) -> list[SampleMeta]:
    unit = dims.patch_size
    metas = []
    for i in range(num):
        images = int(rng.choice(len(IMAGE_COUNT_P), p=IMAGE_COUNT_P))
        sides = rng.integers(224 // unit, 896 // unit + 1, size=(images, 2)) * unit
        text = int(np.clip(rng.lognormal(np.log(250), 1.1), 16, 4096))
        clips = ()
        if rng.random() < 0.2:
            step = dims.audio_downsample * dims.audio_merge
            clips = (int(rng.integers(100, 3001)) // step * step,)
        metas.append(
            SampleMeta(
                index=i,
                text_tokens=text + images + len(clips),
                image_sizes=tuple(map(tuple, sides.tolist())),
                audio_frames=clips,
            )
        )
    return metas


def cut_stages(cost_model, coefficients, mean_features, depth: int) -> tuple[tuple[int, int], ...]:
    """Stages of equal mean-sample cost (what a planner would aim at for the average sample)."""
    per_layer = np.array(
        [cost_model.predict(coefficients, l, l + 1, mean_features) for l in range(cost_model.num_layers)]
    )
    cum = np.cumsum(per_layer)
    cuts = [0]
    for k in range(1, depth):
        cut = int(np.searchsorted(cum, cum[-1] * k / depth)) + 1
        cuts.append(min(max(cut, cuts[-1] + 1), cost_model.num_layers - (depth - k)))
    cuts.append(cost_model.num_layers)
    return tuple(zip(cuts, cuts[1:]))


def case(num_pipes: int, per_pipe: int, cost_model, coefficients, dims, seed: int):
    rng = np.random.default_rng([seed, num_pipes, per_pipe])
    depths = [DEPTHS[i % len(DEPTHS)] for i in range(num_pipes)]
    mean_depth = float(np.mean(depths))
    micro = [max(1, round(per_pipe * d / mean_depth / MICROBATCH_SIZE)) for d in depths]
    num = sum(micro) * MICROBATCH_SIZE
    metas = skewed_metas(num, dims, rng)
    features = sample_features(metas, dims)
    mean = features.mean(axis=0)
    mean[0] = 1.0 / MICROBATCH_SIZE
    stages = {d: cut_stages(cost_model, coefficients, mean * MICROBATCH_SIZE, d) for d in set(depths)}
    shapes = [PipelineShape(m, stages[d]) for m, d in zip(micro, depths)]
    ids = rng.permutation(10 * num)[:num]
    best = np.inf
    for _ in range(3):
        start = time.process_time()
        problem = BalanceProblem.build(ids, features, shapes, cost_model, coefficients, MICROBATCH_SIZE, seed)
        best = min(best, time.process_time() - start)
    return problem, best * 1e3


def numpy_call_us() -> float:
    """Median microseconds of one small ufunc call here and now: how loaded this machine is.

    A workstation does this in ~1 us; decision times scale with it (they are mostly numpy calls).
    """
    a, b = np.random.default_rng(0).random((2, 64))
    samples = []
    for _ in range(21):
        start = time.perf_counter()
        for _ in range(1000):
            np.maximum(a, b, out=a)
        samples.append((time.perf_counter() - start) * 1e3)
    return float(np.median(samples))


def timed(fn, problem, repeats: int):
    """(placement, best wall ms, best CPU ms): CPU time is what a decision costs when this shared
    machine is busy with other work, wall time what it costs here and now."""
    wall = cpu = np.inf
    placement = None
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        placement = fn(problem)
        wall = min(wall, time.perf_counter() - start)
        cpu = min(cpu, time.process_time() - start_cpu)
    return placement, wall * 1e3, cpu * 1e3


def run(pipelines, per_pipeline, algorithms, repeats: int, seed: int = 0) -> list[dict]:
    _, cost_model, coefficients, dims = bench_model()
    rows = []
    for num_pipes in pipelines:
        for per_pipe in per_pipeline:
            problem, build_ms = case(num_pipes, per_pipe, cost_model, coefficients, dims, seed)
            for name in algorithms:
                reps = repeats if problem.num_samples <= 8192 else 1
                placement, ms, cpu_ms = timed(ALGORITHMS[name], problem, reps)
                problem.check(placement)
                rows.append(
                    {
                        "pipelines": num_pipes,
                        "samples": problem.num_samples,
                        "samples_per_pipeline": per_pipe,
                        "algorithm": name,
                        "imbalance": imbalance(problem.predicted_times(placement)),
                        "ms": ms,
                        "cpu_ms": cpu_ms,
                        "build_ms": build_ms,
                    }
                )
    return rows


def print_table(rows: list[dict], algorithms) -> list[str]:
    """Print the table; return the rows where ours is not better than every seed baseline."""
    cases = sorted({(r["pipelines"], r["samples_per_pipeline"], r["samples"]) for r in rows})
    header = f"{'pipes':>5} {'per':>4} {'samples':>7} " + " ".join(f"{a:>18}" for a in algorithms)
    print("imbalance (predicted max/mean) | decision CPU ms")
    print(header)
    losses = []
    for p, per, n in cases:
        found = {r["algorithm"]: r for r in rows if (r["pipelines"], r["samples_per_pipeline"]) == (p, per)}
        cells = [f"{found[a]['imbalance']:8.4f} |{found[a]['cpu_ms']:7.1f}" for a in algorithms]
        print(f"{p:>5} {per:>4} {n:>7} " + " ".join(f"{c:>18}" for c in cells))
        baselines = [a for a in algorithms if not a.startswith("ours")]
        if "ours" in found and any(found[a]["imbalance"] <= found["ours"]["imbalance"] for a in baselines):
            losses.append(f"{p}x{per}")
    print(f"numpy call overhead at the end of the run: {numpy_call_us():.1f} us (a free workstation: ~1 us)")
    return losses


def run_deferral(seeds: int = 4) -> int:
    """Predicted by the cost model: Entrain's deferral on its own (one pipeline, the contiguous split, stages
    cut at equal mean cost) and on top of ``ours`` (four pipelines), with and without placing again at the
    speeds deferral gave (``balance(..., deferral=True)``)."""
    from oobleck_mm.balance.balancer import _balance, balance, with_deferral

    _, cost_model, coefficients, dims = bench_model()

    def problem(depths, mbs, seed):
        rng = np.random.default_rng(seed)
        num = 8 * len(depths) * mbs
        features = sample_features(skewed_metas(num, dims, rng), dims)
        mean = features.mean(axis=0)
        mean[0] = 1.0 / mbs
        shapes = [PipelineShape(8, cut_stages(cost_model, coefficients, mean * mbs, d)) for d in depths]
        return BalanceProblem.build(np.arange(num), features, shapes, cost_model, coefficients, mbs, seed)

    print("one pipeline of 8 microbatches: contiguous split -> with deferral (predicted speed-up per seed)")
    for mbs in (2, 4, 8):
        for depth in (2, 3, 4):
            gains = []
            for seed in range(seeds):
                pb = problem([depth], mbs, seed)
                gains.append(
                    balance(pb, "ours", 0.0).predicted_s[0] / balance(pb, "ours", 0.0, deferral=True).predicted_s[0]
                )
            print(f"  {mbs} samples/microbatch, depth {depth}: {' '.join(f'{g:.3f}' for g in gains)}")
    print("four pipelines of 8 microbatches: speed-up over the contiguous split: ours / + deferral / + placed again")
    for mbs in (2, 4):
        for depths in ((2, 3, 4, 2), (3, 3, 3, 3)):
            cells = []
            for seed in range(seeds):
                pb = problem(depths, mbs, seed)
                off = max(balance(pb, "ours", 1e9).predicted_s)
                plain = _balance(pb, "ours", 0.0)
                once, again = with_deferral(pb, plain), balance(pb, "ours", 0.0, deferral=True)
                cells.append("/".join(f"{off / max(r.predicted_s):.3f}" for r in (plain, once, again)))
            print(f"  {mbs} samples/microbatch, depths {depths}: {'  '.join(cells)}")
    return 0


def run_branches(batches: int = 20, json_out: Path | None = None) -> int:
    """Predicted by the cost model: a pipeline whose encoders run as branches (vision on one or two stages
    beside audio on one, the LLM on two) beside chains of 2 and 3 stages, 8 microbatches each; the slowest
    pipeline under the contiguous split over the balanced one, and both imbalances (docs/balancer.md,
    "Branched pipelines")."""
    from oobleck_mm.balance.balancer import balance

    job, cost_model, coefficients, dims = bench_model()
    names = [s.name for s in layer_specs(job.model, job.data)]
    audio, llm, end = names.index("audio.embed"), names.index("llm.embed"), len(names)
    mid = (llm + end) // 2
    rows = []
    for vision_stages in (1, 2):
        vision = [round(k * audio / vision_stages) for k in range(vision_stages + 1)]
        stages = (*zip(vision, vision[1:]), (audio, llm), (llm, mid), (mid, end))
        branched = PipelineShape(8, stages, branches=(0, vision_stages), merge=vision_stages + 1)
        gains, before, after = [], [], []
        for seed in range(batches):
            rng = np.random.default_rng(seed)
            num = 3 * 8 * MICROBATCH_SIZE
            features = sample_features(skewed_metas(num, dims, rng), dims)
            mean = features.mean(axis=0)
            mean[0] = 1.0 / MICROBATCH_SIZE
            chains = [PipelineShape(8, cut_stages(cost_model, coefficients, mean * MICROBATCH_SIZE, d)) for d in (2, 3)]
            problem = BalanceProblem.build(
                np.arange(num), features, [branched, *chains], cost_model, coefficients, MICROBATCH_SIZE, seed
            )
            result = balance(problem, "ours", 0.0)
            gains.append(max(result.unbalanced_s) / max(result.predicted_s))
            before.append(imbalance(result.unbalanced_s))
            after.append(imbalance(result.predicted_s))
        row = {
            "vision_stages": vision_stages,
            "batches": batches,
            "contiguous_over_balanced_median": float(np.median(gains)),
            "contiguous_over_balanced_worst": float(np.min(gains)),
            "imbalance_contiguous_median": float(np.median(before)),
            "imbalance_balanced_median": float(np.median(after)),
            "imbalance_balanced_worst": float(np.max(after)),
        }
        rows.append(row)
        print(
            f"vision on {vision_stages} stage(s) || audio => LLM on 2, beside chains of 2 and 3 stages: slowest "
            f"pipeline contiguous / balanced x{row['contiguous_over_balanced_median']:.3f} median "
            f"(x{row['contiguous_over_balanced_worst']:.3f} worst of {batches} batches); imbalance "
            f"{row['imbalance_contiguous_median']:.3f} -> {row['imbalance_balanced_median']:.3f} "
            f"(worst {row['imbalance_balanced_worst']:.3f})"
        )
    if json_out:
        json_out.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path, help="write the rows here")
    parser.add_argument("--quick", action="store_true", help="a small grid (seconds)")
    parser.add_argument("--repeats", type=int, default=5, help="decision timings per row (best is kept)")
    parser.add_argument("--real", action="store_true", help="measured on-vs-off run on this machine")
    parser.add_argument("--deferral", action="store_true", help="Entrain's deferral, predicted (seconds)")
    parser.add_argument("--branches", action="store_true", help="a branched pipeline beside chains, predicted")
    args = parser.parse_args(argv)
    if args.deferral:
        return run_deferral()
    if args.branches:
        return run_branches(json_out=args.json)
    if args.real:
        from _bench_balancer_real import run_real

        return run_real(json_out=args.json)
    from oobleck_mm.balance.search import warm_up

    print(f"ours' compiled kernels loaded (or compiled) in {warm_up():.2f} s, once per process")
    algorithms = list(ALGORITHMS)
    pipelines, per = ((4, 16), (16, 64)) if args.quick else (PIPELINES, SAMPLES_PER_PIPELINE)
    rows = run(pipelines, per, algorithms, args.repeats)
    losses = print_table(rows, algorithms)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    if losses:
        print(f"ours is not better than every baseline in: {', '.join(losses)}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
