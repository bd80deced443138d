#!/usr/bin/env python
"""How far the stage mapping is from the exact 1F1B optimum, by brute force on small instances.

For random models (5-10 layers, 2-4 nodes of 1 GPU, random F/B_w/B_d and
activation sizes over a 1 GB/s network) and M = ratio x S microbatches, it
compares the exact 1F1B time of the planner's mapping with the best exact time
over every mapping, for the plain lexicographic objective (no hint) and for
the tuned mapping (``microbatches_hint=M``). Prints mean / p90 / max relative
gap per ratio.

    python scripts/stage_mapping_gap.py [--trials N] [--json OUT]
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from oobleck_mm.planning.costs import ClusterSpec, LayerCost, LayerPrefix, ModelProfile, effective_layers, stage_cost  # noqa: E402
from oobleck_mm.planning.pipeline_time import iteration_time_1f1b  # noqa: E402
from oobleck_mm.planning.stage_mapping import map_stages  # noqa: E402


def random_profile(rng: random.Random, num_layers: int) -> ModelProfile:
    layers = tuple(
        LayerCost(
            name=f"llm.block{i}",
            modality="text",
            forward_s=rng.uniform(0.2, 2),
            backward_weight_s=rng.uniform(0.2, 2),
            backward_input_s=rng.uniform(0.2, 2),
            param_bytes=0,
            grad_bytes=0,
            optimizer_bytes=0,
            activation_bytes=0,
            output_bytes=rng.choice([0, 10**8, 10**9]),
        )
        for i in range(num_layers)
    )
    return ModelProfile(model_name="random", device="synthetic", microbatch_size=1, layers=layers)


def exact_optimum(profile: ModelProfile, cluster: ClusterSpec, num_nodes: int, microbatches: int) -> float:
    prefix = LayerPrefix(effective_layers(profile))
    L, best = profile.num_layers, float("inf")
    for cuts in itertools.combinations(range(1, L), num_nodes - 1):
        bounds = (0, *cuts, L)
        costs = [stage_cost(prefix, cluster, bounds[k], bounds[k + 1], 1) for k in range(num_nodes)]
        sends = [cluster.transfer_s(c.output_bytes, cross_node=True) for c in costs[:-1]]
        best = min(
            best,
            iteration_time_1f1b(
                [c.forward_s for c in costs], [c.backward_s for c in costs], sends, sends, microbatches
            ),
        )
    return best


def summary(gaps: list[float]) -> dict:
    gaps = sorted(gaps)
    return {"mean": sum(gaps) / len(gaps), "p90": gaps[int(0.9 * len(gaps))], "max": gaps[-1]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=150)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    cluster = ClusterSpec(gpus_per_node=1, device_memory_bytes=10**15, inter_node_bandwidth=1e9)
    rows = []
    print(f"{'M/S':>4}  {'lexicographic mean/p90/max':>28}  {'tuned mean/p90/max':>28}")
    for ratio in (1, 2, 4, 8):
        rng = random.Random(1)
        plain, tuned = [], []
        for _ in range(args.trials):
            num_layers = rng.randint(5, 10)
            num_nodes = rng.randint(2, 4)
            profile = random_profile(rng, num_layers)
            m = ratio * num_nodes
            best = exact_optimum(profile, cluster, num_nodes, m)
            plain.append(map_stages(profile, cluster, num_nodes).iteration_time(m) / best - 1)
            tuned.append(map_stages(profile, cluster, num_nodes, microbatches_hint=m).iteration_time(m) / best - 1)
        p, t = summary(plain), summary(tuned)
        rows.append({"ratio": ratio, "trials": args.trials, "lexicographic": p, "tuned": t})
        print(
            f"{ratio:>4}  {p['mean']:>8.2%} {p['p90']:>8.2%} {p['max']:>8.2%}   "
            f"{t['mean']:>8.2%} {t['p90']:>8.2%} {t['max']:>8.2%}",
            flush=True,
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
