"""The batch split with measured node speeds: a slow node's pipeline gets fewer microbatches (issue 29).

Pure: a planning ``Plan`` and each slow node's factor in, the same pipelines
with microbatch counts re-split out. The global batch is unchanged (every
sample still runs once per step, so the math is the same); only which
pipeline runs how many microbatches moves.

How a slow node is priced: the stages it runs take ``factor`` times the
template's forward and backward seconds (``master/stragglers.py`` measures
that factor on the node's own compute), and its pipeline's 1F1B time is read
from that slowed template by the same exact ``iteration_time`` every other
batch split uses (``planning/batch.py``). So a node slowed in a light stage
costs its pipeline less than one slowed in the bottleneck stage, as it does on
the hardware.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from oobleck_mm.planning.batch import BatchSplit, split_batch
from oobleck_mm.planning.plan import PipelineInstance, Plan
from oobleck_mm.planning.template import PipelineTemplate


def slowed_template(instance: PipelineInstance, slow: Mapping[str, float]) -> PipelineTemplate:
    """``instance``'s template with the stages of its slow nodes ``slow[node]`` times longer."""
    template = instance.template
    factors = [slow.get(instance.nodes[stage.node], 1.0) for stage in template.stages]
    if all(f == 1.0 for f in factors):
        return template
    stages = tuple(dataclasses.replace(s, forward_s=s.forward_s * f, backward_s=s.backward_s * f)
                   for s, f in zip(template.stages, factors))  # fmt: skip
    return dataclasses.replace(template, stages=stages)


def predicted_samples_per_s(plan: Plan, slow: Mapping[str, float]) -> float:
    """``plan``'s samples/s with its slow nodes' stages ``slow[node]`` times longer: the slowest pipeline's
    1F1B time plus the gradient all-reduce, as ``Plan.samples_per_s`` prices a plan at its templates' speed."""
    slowest = max(slowed_template(p, slow).iteration_time(p.num_microbatches) for p in plan.pipelines)
    return plan.global_batch / (slowest + plan.allreduce_s)


def speed_aware_split(plan: Plan, slow: Mapping[str, float], solver: str = "highs") -> tuple[Plan, BatchSplit]:
    """``plan`` with its global batch re-split for the nodes' speeds (``slow``: node -> factor > 1; the
    others run as their templates say). With no slow node of the plan, the split of the templates as
    they are: a node that recovered gets its share back."""
    templates = [slowed_template(p, slow) for p in plan.pipelines]
    split = split_batch(templates, plan.global_batch, plan.microbatch_size, solver=solver)
    pipelines = tuple(dataclasses.replace(p, num_microbatches=q) for p, q in zip(plan.pipelines, split.microbatches))
    return dataclasses.replace(plan, pipelines=pipelines), split
