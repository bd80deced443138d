#!/usr/bin/env python
"""Runtime benchmark (issue 3): the engine against DDP and against DeepSpeed's PipelineEngine.

    python scripts/bench_runtime.py [--json OUT] [--steps N] [--warmup N] [--rounds N]
                                    [--cases ab|c|abc] [--config FILE]

Same model, same global batch, 4 processes per system on this machine, one torch
thread each:

  (a) the engine as 4 pipelines x 1 stage   vs torch DistributedDataParallel (gloo),
      on the skewed synthetic data (0..2 images of varying size, lognormal text);
  (c) a small HuggingFace LLaVA (CLIP + Llama, made with transformers and save_pretrained):
      the engine as 4 pipelines x 1 stage vs the plain transformers model under DDP (gloo),
      each microbatch right-padded with an attention mask, on the same skewed samples;
  (b) the engine as 1 pipeline x 4 stages   vs DeepSpeed's PipelineEngine (gloo, CPU accelerator),
      on fixed-shape data (one image of one size, one text length per sample), because
      DeepSpeed caches activation shapes after the first microbatch. Both cut the
      layers where DeepSpeed's ``partition_method="uniform"`` cuts them.

Engine and peer run side by side, each in its own processes (so each has its own
peak RSS), taking turns step by step: step s of one, then step s of the other,
while the idle side sleeps. On this shared 2-core machine, load from other work
comes and goes within seconds; taking turns exposes both sides to it alike. Each
round uses fresh processes and flips the turn order; ``--warmup`` untimed steps,
then ``--steps`` timed steps; a step's time is its slowest rank's. samples/s =
global batch x timed steps / the sum over timed steps of each step's fastest
round. Losses of engine and peer are compared step by step: equal at step 0
proves the same weights and batch, close afterwards the same update.

  (d) the engine with its gradient all-reduce overlapped with the last backward
      (``training.grad_overlap``) vs the same engine without it vs DDP, three side by side,
      4 pipelines x 1 stage, on a model whose all-reduce is a large share of the step
      (COMM_HEAVY: many parameters, few tokens). Issue 52's targets: overlap / no overlap
      >= 1.10, overlap / DDP >= 1.0.

``--link-mbit N`` runs every case on a bench network instead of this host's loopback: rank r of every
system in host r's network namespace (``tests/network.py``: a veth link each, one bridge; needs root and
iproute2), each link limited to N Mbit/s each way by ``tc``'s token bucket (0: no limit). There the
all-reduce waits on a wire, as between a cluster's nodes, not only on the CPU it shares with the backward.

Without ``--config`` the model is configs/tiny_mm.yaml scaled up by BENCH_OVERRIDES
(the tiny model is all overhead); ``--config FILE`` uses that job file as it is.
Target: engine/peer >= 0.9 in every case. Exit status 1 if the losses disagree.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

# Before anything imports deepspeed (the engine imports its schedule); spawned workers inherit both.
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", "1")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import yaml  # noqa: E402
from deepspeed.runtime.utils import partition_uniform  # noqa: E402

from _bench_peers import Host, RunSpec, launch  # noqa: E402
from oobleck_mm.config import config_from_dict, load_config  # noqa: E402
from oobleck_mm.data.loader import TrainingData  # noqa: E402
from oobleck_mm.model.layers import model_layer_specs  # noqa: E402
from oobleck_mm.planning.layout import ExecutionPlan, PipelineLayout, StageLayout  # noqa: E402

WORLD = 4
LOSS_TOLERANCE = 1e-4
"""Largest |engine - peer| loss over the run accepted as "same training" (float32, different sum orders)."""
BENCH_OVERRIDES = {
    "model": {
        "name": "bench_mm",
        "vision": {"num_layers": 2, "hidden": 128, "num_heads": 4, "patch_size": 8},
        "projector": {"num_layers": 1},
        "llm": {"num_layers": 6, "hidden": 192, "num_heads": 4, "vocab_size": 256},
    },
    "data": {
        "image_size": 48,
        "min_image_size": 32,
        "mean_images_per_sample": 1,
        "max_images_per_sample": 2,
        "mean_text_tokens": 32,
        "max_seq_len": 256,
    },
    "training": {"global_batch": 32, "microbatch_size": 2, "dtype": "float32"},
}
HF_TEXT = {
    "hidden_size": 192,
    "intermediate_size": 512,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
}
HF_VISION = {
    "hidden_size": 128,
    "intermediate_size": 512,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "image_size": 48,
    "patch_size": 8,
}
"""Case (c)'s LLaVA: the size of case (a)'s model (the CLIP tower runs 2 of its 3 blocks)."""
COMM_HEAVY = {
    "model": {"llm": {"num_layers": 8, "hidden": 512, "num_heads": 8, "vocab_size": 256}},
    "data": {"mean_images_per_sample": 0.5, "max_images_per_sample": 1, "mean_text_tokens": 8, "max_seq_len": 64},
    "training": {"global_batch": 8, "microbatch_size": 1, "grad_bucket_mb": 4},
}
"""Case (d): ~26 M parameters (100 MB of float32 gradients per rank) and ~20 tokens a sample, two one-sample
microbatches per pipeline: the all-reduce is most of the step. Buckets of 4 MB: about one LLM block each."""


def hf_job_dict(raw: dict, directory: str) -> dict:
    """Case (a)'s data and training on a HuggingFace LLaVA saved in ``directory``."""
    data = {**raw["data"], "min_image_size": HF_VISION["image_size"], "image_size": HF_VISION["image_size"]}
    return {**{k: v for k, v in raw.items() if k != "model"}, "model": {"huggingface": directory}, "data": data}


# --------------------------------------------------------------------------- jobs and plans


def _merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in over.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def base_job_dict(config: str | None) -> dict:
    """The job as a plain dict: ``config`` as it is (paths resolved), else tiny_mm.yaml + BENCH_OVERRIDES."""
    if config:
        return load_config(config).to_dict()
    with open(ROOT / "configs" / "tiny_mm.yaml", encoding="utf-8") as fh:
        return _merge(yaml.safe_load(fh), BENCH_OVERRIDES)


def fixed_shape_job_dict(raw: dict) -> dict:
    """The same model on data where every sample has one image of the largest size and one text length."""
    data = raw["data"]
    fixed = {
        "min_image_size": data["image_size"],
        "mean_images_per_sample": 1,
        "max_images_per_sample": 1,
        "text_length_sigma": 0.0,
        "mean_text_tokens": round(data.get("mean_text_tokens", 32)),
    }
    return _merge(raw, {"data": fixed})


def check_fixed_shapes(job, steps: int) -> None:
    """Every sample of the run has the same metadata shape (else DeepSpeed's cached shapes would be wrong)."""
    data = TrainingData(job)
    shapes = {(m.text_tokens, m.image_sizes) for s in range(steps) for m in data.metas(data.global_batch(s))}
    if len(shapes) != 1:
        raise ValueError(f"fixed-shape data has {len(shapes)} sample shapes, e.g. {sorted(shapes)[:3]}")


def plans(job) -> tuple[ExecutionPlan, ExecutionPlan]:
    """(4 pipelines x 1 stage, 1 pipeline x 4 stages cut where DeepSpeed's 'uniform' cuts)."""
    num_layers = len(model_layer_specs(job))
    mbs = job.training.microbatch_size
    microbatches = job.training.global_batch // mbs
    if microbatches % WORLD:
        raise ValueError(f"training.global_batch / microbatch_size ({microbatches}) must be a multiple of {WORLD}")
    data_parallel = ExecutionPlan.even(num_layers, [1] * WORLD, [microbatches // WORLD] * WORLD, mbs)
    cuts = partition_uniform(num_items=num_layers, num_parts=WORLD)
    stages = tuple(StageLayout(r, cuts[r], cuts[r + 1]) for r in range(WORLD))
    pipeline = ExecutionPlan((PipelineLayout(stages, microbatches),), num_layers, mbs)
    return data_parallel, pipeline


# --------------------------------------------------------------------------- running


def summarise(spec: RunSpec, ranks: list[dict]) -> dict:
    """One system's run: losses, each timed step's time (its slowest rank's), breakdown and RSS per rank."""
    return {
        "losses": ranks[0]["losses"],
        "step_s": [max(r["step_s"][i] for r in ranks) for i in range(spec.timed)],
        "breakdown_s": [{k: round(v, 4) for k, v in r["breakdown"].items()} for r in ranks],
        "peak_rss_mb": [round(r["peak_rss_mb"], 1) for r in ranks],
    }


def rate(spec: RunSpec, step_s: list[float]) -> float:
    return spec.plan.global_batch * len(step_s) / sum(step_s)


def run_case(key: str, name: str, engine: RunSpec, peer: RunSpec, rounds: int, work: Path, hosts=None) -> dict:
    """Engine and peer side by side, taking turns step by step; the turn order flips every round."""
    runs: dict[str, list[dict]] = {"engine": [], "peer": []}
    for r in range(rounds):
        order = [("engine", engine), ("peer", peer)]
        order = order if r % 2 == 0 else order[::-1]
        print(
            f"  {name}: round {r + 1}/{rounds}, {' and '.join(s.system for _, s in order)} taking turns ...", flush=True
        )
        reports = launch([spec for _, spec in order], work / f"{key}{r}", hosts=hosts)
        for (side, spec), ranks in zip(order, reports, strict=True):
            runs[side].append(summarise(spec, ranks))
    # Per step, the fastest round: a burst of load must hit the same step in every round to count.
    best = {side: [min(x["step_s"][i] for x in rs) for i in range(engine.timed)] for side, rs in runs.items()}
    rss = {side: [max(col) for col in zip(*(x["peak_rss_mb"] for x in rs))] for side, rs in runs.items()}
    pairs = [p / e for x, y in zip(runs["engine"], runs["peer"]) for e, p in zip(x["step_s"], y["step_s"])]
    e, p = runs["engine"][0]["losses"], runs["peer"][0]["losses"]
    return {
        "case": name,
        "engine": engine.plan.describe(),
        "engine_samples_s": round(rate(engine, best["engine"]), 3),
        "peer": peer.system,
        "peer_samples_s": round(rate(peer, best["peer"]), 3),
        "ratio": round(rate(engine, best["engine"]) / rate(peer, best["peer"]), 3),
        "median_step_ratio": round(statistics.median(pairs), 3),
        "engine_peak_rss_mb": max(rss["engine"]),
        "peer_peak_rss_mb": max(rss["peer"]),
        "engine_rss_per_rank_mb": rss["engine"],
        "peer_rss_per_rank_mb": rss["peer"],
        "engine_rounds_samples_s": [round(rate(engine, x["step_s"]), 3) for x in runs["engine"]],
        "peer_rounds_samples_s": [round(rate(peer, x["step_s"]), 3) for x in runs["peer"]],
        "engine_step_s": [[round(t, 4) for t in x["step_s"]] for x in runs["engine"]],
        "peer_step_s": [[round(t, 4) for t in x["step_s"]] for x in runs["peer"]],
        "loss_step0": {"engine": e[0], "peer": p[0]},
        "max_loss_diff": max(abs(a - b) for a, b in zip(e, p, strict=True)),
        "losses": {"engine": e, "peer": p},
        "engine_breakdown_s_per_step": runs["engine"][0]["breakdown_s"],
        "peer_breakdown_s_per_step": runs["peer"][0]["breakdown_s"],
    }


def run_overlap_case(job_dict: dict, rounds: int, work: Path, steps: dict, hosts=None) -> dict:
    """Case (d): engine with overlap, engine without, DDP; three side by side, the order rotated each round."""
    on = config_from_dict(_merge(job_dict, {"training": {"grad_overlap": True}}))
    off = config_from_dict(_merge(job_dict, {"training": {"grad_overlap": False}}))
    plan, _ = plans(on)
    m, d = on.model, on.data
    print(
        f"(d) model: llm {m.llm.num_layers} blocks, hidden {m.llm.hidden}; text mean {d.mean_text_tokens:g} tokens, "
        f"0..{d.max_images_per_sample} images; global batch {on.training.global_batch}, microbatch "
        f"{on.training.microbatch_size}; buckets of {on.training.grad_bucket_mb:g} MB; {plan.describe()}",
        flush=True,
    )
    sides = {
        "overlap": RunSpec("engine", on, plan, **steps),
        "no overlap": RunSpec("engine", off, plan, **steps),
        "ddp": RunSpec("ddp", on, plan, **steps),
    }
    runs: dict[str, list[dict]] = {name: [] for name in sides}
    for r in range(rounds):
        order = list(sides)[r % 3 :] + list(sides)[: r % 3]
        print(f"  (d) overlap: round {r + 1}/{rounds}, {' and '.join(order)} taking turns ...", flush=True)
        for name, ranks in zip(order, launch([sides[n] for n in order], work / f"d{r}", hosts=hosts), strict=True):
            runs[name].append(summarise(sides[name], ranks))
    best = {name: [min(x["step_s"][i] for x in rs) for i in range(steps["timed"])] for name, rs in runs.items()}
    rates = {name: rate(sides[name], b) for name, b in best.items()}
    losses = {name: rs[0]["losses"] for name, rs in runs.items()}
    return {
        "case": "(d) overlap 4 x 1 stage",
        "engine": plan.describe(),
        "samples_s": {name: round(v, 3) for name, v in rates.items()},
        "overlap_over_no_overlap": round(rates["overlap"] / rates["no overlap"], 3),
        "overlap_over_ddp": round(rates["overlap"] / rates["ddp"], 3),
        "no_overlap_over_ddp": round(rates["no overlap"] / rates["ddp"], 3),
        "rounds_samples_s": {name: [round(rate(sides[name], x["step_s"]), 3) for x in rs] for name, rs in runs.items()},
        "step_s": {name: [[round(t, 4) for t in x["step_s"]] for x in rs] for name, rs in runs.items()},
        "max_loss_diff": max(abs(a - b) for a, b in zip(losses["overlap"], losses["ddp"], strict=True)),
        "overlap_equals_no_overlap": losses["overlap"] == losses["no overlap"],
        "losses": losses,
        "breakdown_s_per_step": {name: rs[0]["breakdown_s"] for name, rs in runs.items()},
    }


def _part(key: str, value: float) -> str:
    """One entry of a breakdown: seconds (``*_s``) to the millisecond, counts whole."""
    return f"{key.removesuffix('_s')} {value:.3f}" if key.endswith("_s") else f"{key} {value:.0f}"


def print_overlap(c: dict) -> None:
    r = c["samples_s"]
    print(
        f"{c['case']}: samples/s overlap {r['overlap']:.2f}, no overlap {r['no overlap']:.2f}, DDP {r['ddp']:.2f}; "
        f"overlap / no overlap {c['overlap_over_no_overlap']:.3f} (target >= 1.10), overlap / DDP "
        f"{c['overlap_over_ddp']:.3f} (target >= 1.0), no overlap / DDP {c['no_overlap_over_ddp']:.3f}"
    )
    print(
        f"  per round: {c['rounds_samples_s']}; losses overlap == no overlap: {c['overlap_equals_no_overlap']}; "
        f"max |overlap - DDP| loss {c['max_loss_diff']:.1e}"
    )
    for name, parts in c["breakdown_s_per_step"].items():
        print(
            f"  {name} s/step per rank (round 1): "
            + " ".join("{" + ", ".join(_part(k, v) for k, v in sorted(b.items())) + "}" for b in parts)
        )


# --------------------------------------------------------------------------- report


def describe_model(job, fixed_job) -> dict:
    m, d, t = job.model, job.data, job.training
    v = m.vision
    return {
        "layers": [s.name for s in model_layer_specs(job)],
        "vision": f"{v.num_layers} blocks, hidden {v.hidden}, {v.num_heads} heads, patch {v.patch_size}" if v else None,
        "llm": f"{m.llm.num_layers} blocks, hidden {m.llm.hidden}, {m.llm.num_heads} heads, vocab {m.llm.vocab_size}",
        "dtype": t.dtype,
        "global_batch": t.global_batch,
        "microbatch_size": t.microbatch_size,
        "data_a": f"synthetic: 0..{d.max_images_per_sample} images (mean {d.mean_images_per_sample}) of "
        f"{d.min_image_size}..{d.image_size} px, text mean {d.mean_text_tokens} tokens "
        f"(lognormal sigma {d.text_length_sigma})",
        "data_b": f"fixed: 1 image of {fixed_job.data.image_size}x{fixed_job.data.image_size} px, "
        f"{fixed_job.data.mean_text_tokens:g} text tokens per sample",
    }


def print_table(cases: list[dict]) -> None:
    head = (
        f"{'case':<26} {'engine samples/s':>16} {'peer':>10} {'peer samples/s':>14} {'ratio':>6} "
        f"{'engine peak RSS MB':>18} {'peer peak RSS MB':>16}"
    )
    print(head)
    print("-" * len(head))
    for c in cases:
        print(
            f"{c['case']:<26} {c['engine_samples_s']:>16.2f} {c['peer']:>10} {c['peer_samples_s']:>14.2f} "
            f"{c['ratio']:>6.2f} {c['engine_peak_rss_mb']:>18.0f} {c['peer_peak_rss_mb']:>16.0f}"
        )
    print()
    for c in cases:
        print(
            f"{c['case']}: peak RSS per rank (MB) engine {c['engine_rss_per_rank_mb']}, peer {c['peer_rss_per_rank_mb']}"
        )
        print(
            f"  samples/s per round: engine {c['engine_rounds_samples_s']}, peer {c['peer_rounds_samples_s']}; "
            f"median over steps of peer step / engine step {c['median_step_ratio']:.2f}"
        )
        print(
            f"  step-0 loss engine {c['loss_step0']['engine']:.7f}, peer {c['loss_step0']['peer']:.7f}; "
            f"max |engine - peer| loss over {len(c['losses']['engine'])} steps {c['max_loss_diff']:.1e}"
        )
        for side in ("engine", "peer"):
            parts = [
                "{" + ", ".join(_part(k, v) for k, v in sorted(b.items())) + "}"
                for b in c[f"{side}_breakdown_s_per_step"]
            ]
            print(f"  {side} s/step per rank (round 1): {' '.join(parts)}")


def bench_network(link_mbit: float, count: int = WORLD):
    """``count`` hosts on a bridge (``tests/network.py``), each link limited to ``link_mbit`` Mbit/s (0: none):
    ``(network, hosts)``; the caller closes the network. Exits 2 naming ``--link-mbit`` when this machine
    cannot make one."""
    sys.path.insert(0, str(ROOT / "tests"))
    from network import GLOO_INTERFACE, Network, unavailable

    why = unavailable()
    if why is not None:
        print(f"--link-mbit needs network namespaces: {why}", file=sys.stderr)
        sys.exit(2)
    network = Network([f"host{r}" for r in range(count)])
    try:
        if link_mbit > 0:
            for node in network.nodes:
                network.throttle(node, round(link_mbit * 1000))
        hosts = [Host(f"/run/netns/{network.namespace(n)}", network.address(n), GLOO_INTERFACE) for n in network.nodes]
    except BaseException:
        network.close()
        raise
    return network, hosts


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per run (default 10)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    ap.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="runs per case, fresh processes each, turn order flipped each round (default 2)",
    )
    ap.add_argument(
        "--cases",
        default="ab",
        help="which cases to run: letters of abcd (default ab; c: the HF LLaVA; d: the overlap)",
    )
    ap.add_argument("--config", help="job YAML used as is (default: configs/tiny_mm.yaml + BENCH_OVERRIDES)")
    ap.add_argument(
        "--link-mbit",
        type=float,
        help="run on a bench network, one namespace per rank, each link limited to this many Mbit/s (0: no limit)",
    )
    args = ap.parse_args(argv)
    if args.link_mbit is not None and args.link_mbit < 0:
        ap.error(f"--link-mbit must be >= 0 (0: no limit), got {args.link_mbit:g}")
    for name in ("steps", "rounds"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1")
    if args.warmup < 1:
        ap.error("--warmup must be >= 1 (step 0 is the loss check and pays one-off costs)")
    if not args.cases or set(args.cases) - {"a", "b", "c", "d"}:
        ap.error(f"--cases must be letters of abcd, got {args.cases!r}")
    return args


def write_json(path: str, cases: list[dict], model: dict, settings: dict, argv: list[str] | None) -> None:
    command = "python scripts/bench_runtime.py " + " ".join(argv if argv is not None else sys.argv[1:])
    settings = {
        **settings,
        "method": "engine and peer in their own processes, taking turns step by step",
        "samples_s": "global batch x timed steps / sum over timed steps of that step's fastest round; "
        "a step's time is its slowest rank's",
        "rounds_samples_s": "per round: global batch / mean timed step",
    }
    out = {"cases": cases, "model": model, "command": command.strip(), "settings": settings}
    Path(path).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    raw = base_job_dict(args.config)
    job, fixed_job = config_from_dict(raw), config_from_dict(fixed_shape_job_dict(raw))
    check_fixed_shapes(fixed_job, args.warmup + args.steps)
    plan_a, _ = plans(job)
    _, plan_b = plans(fixed_job)
    model = describe_model(job, fixed_job)
    print(f"model: {len(model['layers'])} layers; vision {model['vision']}; llm {model['llm']}; {model['dtype']}")
    print(
        f"batch: global {model['global_batch']} samples, microbatch {model['microbatch_size']}; "
        f"(a) {model['data_a']}; (b) {model['data_b']}"
    )
    print(f"plans: (a) {plan_a.describe()}  (b) {plan_b.describe()}")
    print(
        f"{args.warmup} warm-up + {args.steps} timed steps, {args.rounds} rounds, {WORLD} processes x 1 torch thread",
        flush=True,
    )

    steps = {"warmup": args.warmup, "timed": args.steps}
    cases = []
    load = [os.getloadavg()[0]]
    with contextlib.ExitStack() as stack:
        hosts, network = None, None
        if args.link_mbit is not None:
            network, hosts = bench_network(args.link_mbit)
            stack.callback(network.close)
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="bench_runtime_"))
        work = Path(tmp)
        selected = [
            c
            for c in (
                ("a", "(a) 4 pipelines x 1 stage", job, plan_a, "ddp"),
                ("b", "(b) 1 pipeline x 4 stages", fixed_job, plan_b, "deepspeed"),
            )
            if c[0] in args.cases
        ]
        if "c" in args.cases:
            from oobleck_mm.model.tiny_hf import make_tiny_model

            directory = make_tiny_model(work / "llava", "llama", "clip", text_sizes=HF_TEXT, vision_sizes=HF_VISION)
            hf_job = config_from_dict(hf_job_dict(raw, directory))
            hf_plan, _ = plans(hf_job)
            print(f"(c) HuggingFace LLaVA: {len(model_layer_specs(hf_job))} layers, {hf_plan.describe()}", flush=True)
            selected.append(("c", "(c) HF LLaVA 4 x 1 stage", hf_job, hf_plan, "hf_ddp"))
        for key, name, case_job, plan, peer in selected:
            cases.append(
                run_case(
                    key,
                    name,
                    RunSpec("engine", case_job, plan, **steps),
                    RunSpec(peer, case_job, plan, **steps),
                    args.rounds,
                    work,
                    hosts,
                )
            )
        overlap = (
            run_overlap_case(_merge(raw, COMM_HEAVY), args.rounds, work, steps, hosts) if "d" in args.cases else None
        )
        if network is not None:
            held = [network.throttled_packets(n) for n in network.nodes]
            print(
                f"bench network: {network.nodes} at {args.link_mbit:g} Mbit/s; times each link held packets back: {held}"
            )
    load.append(os.getloadavg()[0])
    wall_s = time.perf_counter() - started
    print(
        f"\nwall time {wall_s:.0f} s; 1-min load average at start {load[0]:.1f}, at end {load[1]:.1f} "
        "(2 cores; the end figure includes this benchmark's own workers)\n"
    )
    if cases:
        print_table(cases)
    if overlap is not None:
        print_overlap(overlap)
        cases.append(overlap)
    bad = [c["case"] for c in cases if c["max_loss_diff"] > LOSS_TOLERANCE]
    if bad:
        print(f"ERROR: engine and peer losses differ by more than {LOSS_TOLERANCE:g} in {bad}: not the same training")
    if args.json:
        settings = {
            "processes": WORLD,
            "threads_per_process": 1,
            **steps,
            "rounds": args.rounds,
            "load_average_start_end": load,
            "link_mbit": args.link_mbit,
            "wall_s": round(wall_s, 1),
        }
        write_json(args.json, cases, model, settings, argv)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
