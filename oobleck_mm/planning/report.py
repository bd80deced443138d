"""Human-readable and JSON renderings of templates, plans and reconfigurations.

One place turns planning results into what ``oobleck-launch plan`` prints, so
the text table and the ``--json`` document always describe the same objects.
"""

from __future__ import annotations

from typing import Any

from oobleck_mm.planning.plan import Plan
from oobleck_mm.planning.template import PipelineTemplate, TemplateSet


def template_to_dict(template: PipelineTemplate, microbatches: int) -> dict[str, Any]:
    return {
        "nodes": template.num_nodes,
        "num_stages": template.num_stages,
        "stages": [
            {
                "layers": [s.layer_start, s.layer_end],
                "node": s.node,
                "gpus": list(s.gpus),
                "forward_s": s.forward_s,
                "backward_s": s.backward_s,
                "memory_bytes": s.memory_bytes,
                "recompute": s.recompute,
                "context_parallel": s.context_parallel,
            }
            for s in template.stages
        ],
        "iteration_time_s": template.iteration_time(microbatches),
        "microbatches_for_time": microbatches,
    }


def plan_to_dict(plan: Plan) -> dict[str, Any]:
    return {
        "num_pipelines": plan.num_pipelines,
        "global_batch": plan.global_batch,
        "microbatch_size": plan.microbatch_size,
        "iteration_time_s": plan.iteration_time_s,
        "samples_per_s": plan.samples_per_s,
        "allreduce_s": plan.allreduce_s,
        "pipelines": [
            {
                "template_nodes": p.template.num_nodes,
                "nodes": list(p.nodes),
                "num_microbatches": p.num_microbatches,
                "samples": p.num_microbatches * plan.microbatch_size,
                "iteration_time_s": p.iteration_time_s,
                "stages": [
                    {
                        "layers": [s.layer_start, s.layer_end],
                        "node": p.nodes[s.node],
                        "gpus": list(s.gpus),
                        "recompute": s.recompute,
                    }
                    for s in p.template.stages
                ],
            }
            for p in plan.pipelines
        ],
    }


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms" if seconds < 1 else f"{seconds:.3f} s"


def format_templates(template_set: TemplateSet, layer_names: list[str], microbatches: int) -> str:
    lines = [
        f"pipeline templates: {len(template_set.templates)} (nodes {template_set.min_nodes}"
        f"..{template_set.max_nodes}; n0 = {template_set.min_nodes})",
        f"  {'nodes':>5} {'stages':>6}  {'iter time @' + str(microbatches) + ' mb':>18}  stage layout "
        "((r): the stage recomputes its activations in backward; (cp): its GPUs split the tokens; "
        "A || B => C: encoder branches A and B run concurrently and feed C)",
    ]
    for t in template_set.templates:
        layout = "".join(
            ("" if j == 0 else " || " if j in t.branches else " => " if t.branched and j == t.merge else " | ")
            + f"{_layer_range(layer_names, s.layer_start, s.layer_end)}@n{s.node}g{'+'.join(map(str, s.gpus))}"
            + ("(r)" if s.recompute else "")
            + ("(cp)" if s.context_parallel else "")
            for j, s in enumerate(t.stages)
        )
        lines.append(f"  {t.num_nodes:>5} {t.num_stages:>6}  {_ms(t.iteration_time(microbatches)):>18}  {layout}")
    return "\n".join(lines)


def _layer_range(names: list[str], start: int, end: int) -> str:
    if end - start == 1:
        return names[start]
    return f"{names[start]}..{names[end - 1]}"


def format_plan(plan: Plan, layer_names: list[str], title: str) -> str:
    lines = [
        f"{title}: {plan.num_pipelines} pipelines on {len(plan.nodes)} nodes, "
        f"global batch {plan.global_batch} = microbatch {plan.microbatch_size} x "
        f"{sum(p.num_microbatches for p in plan.pipelines)} microbatches",
        f"  predicted iteration time {_ms(plan.iteration_time_s)} "
        f"(all-reduce {_ms(plan.allreduce_s)}), {plan.samples_per_s:.2f} samples/s",
    ]
    for i, p in enumerate(plan.pipelines):
        lines.append(
            f"  pipeline {i}: {p.template.num_nodes} nodes [{', '.join(p.nodes)}], "
            f"{p.template.num_stages} stages, {p.num_microbatches} microbatches "
            f"({p.num_microbatches * plan.microbatch_size} samples), {_ms(p.iteration_time_s)}"
        )
        for k, s in enumerate(p.template.stages):
            lines.append(
                f"    stage {k}: layers {s.layer_start}-{s.layer_end - 1} "
                f"({_layer_range(layer_names, s.layer_start, s.layer_end)}) on {p.nodes[s.node]} "
                f"gpu {','.join(map(str, s.gpus))}; fwd {_ms(s.forward_s)}, bwd {_ms(s.backward_s)}, "
                f"mem {s.memory_bytes / 2**30:.2f} GiB"
                + (", recomputes activations" if s.recompute else "")
                + (", context-parallel" if s.context_parallel else "")
                + _branch_role(p.template, k)
            )
    return "\n".join(lines)


def _branch_role(template, k: int) -> str:
    """A branched template's stage: which encoder branch it is in, or that it merges them."""
    if not template.branched:
        return ""
    if k == template.merge:
        return f", takes the {len(template.branches)} encoder branches' outputs"
    if k < template.merge:
        return f", encoder branch {max(b for b, start in enumerate(template.branches) if start <= k)}"
    return ""


def format_ranges(indices: list[int]) -> str:
    """Sorted layer (or node) indices as ranges: [1, 2, 3, 7] -> '1-3, 7'."""
    parts, start = [], indices[0]
    for prev, cur in zip(indices, [*indices[1:], None]):
        if cur != prev + 1:
            parts.append(str(start) if start == prev else f"{start}-{prev}")
            start = cur
    return ", ".join(parts)
