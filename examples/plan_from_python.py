#!/usr/bin/env python
"""Use the planner as a library: templates, a plan, and the plan after a failure and a join.

    python examples/plan_from_python.py [configs/tiny_mm.yaml] [NODES]

Everything here is pure planning (no processes, no GPUs): the same calls the
master makes at start-up and on every membership change.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from oobleck_mm.config import load_config  # noqa: E402
from oobleck_mm.planning.costs import ClusterSpec  # noqa: E402
from oobleck_mm.planning.instantiate import instantiate  # noqa: E402
from oobleck_mm.planning.reconfigure import CannotKeepReplicas, reconfigure  # noqa: E402
from oobleck_mm.planning.stage_mapping import build_templates  # noqa: E402
from oobleck_mm.profiling.analytical import profile_from_config  # noqa: E402


def main() -> None:
    config = sys.argv[1] if len(sys.argv) > 1 else "configs/tiny_mm.yaml"
    job = load_config(config)
    num_nodes = int(sys.argv[2]) if len(sys.argv) > 2 else job.cluster.nodes
    f, cluster = job.fault_tolerance.f, ClusterSpec.from_config(job.cluster)
    batch, micro = job.training.global_batch, job.training.microbatch_size

    profile = profile_from_config(job)  # per-layer costs, frozen-aware
    templates = build_templates(profile, cluster, num_nodes, f, total_microbatches=batch // micro)
    print(f"{len(templates.templates)} templates for {templates.min_nodes}..{templates.max_nodes} nodes")

    nodes = [f"node{i}" for i in range(num_nodes)]
    plan = instantiate(templates, nodes, f, batch, micro, cluster)
    print(
        f"plan: {[len(p.nodes) for p in plan.pipelines]} nodes per pipeline, "
        f"{[p.num_microbatches for p in plan.pipelines]} microbatches, {plan.samples_per_s:.1f} samples/s"
    )

    result = reconfigure(
        plan, lost=[nodes[-1]], joined=["spare0"], template_set=templates, fault_tolerance=f, cluster=cluster
    )
    if isinstance(result, CannotKeepReplicas):
        print(f"cannot keep {f + 1} replicas: {result.reason}")
        return
    for action in result.actions:
        print(f"  - {action}")
    print(
        f"after losing {nodes[-1]} and adding spare0: {[list(p.nodes) for p in result.plan.pipelines]}, "
        f"{result.layer_states_moved} layer states to copy"
    )


if __name__ == "__main__":
    main()
