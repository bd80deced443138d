"""The batch split with measured node speeds: a slow node's pipeline gets fewer microbatches (issue 29).

Pure: a planning ``Plan`` and each slow node's factor in, the same pipelines
with microbatch counts re-split out. The global batch is unchanged (every
sample still runs once per step, so the math is the same); only which
pipeline runs how many microbatches moves.

How a slow node is priced: the stages it runs take ``factor`` times the
template's forward and backward seconds (``oobleck_mm/master/stragglers.py`` measures
that factor on the node's own compute), and its pipeline's 1F1B time is read
from that slowed template by the same exact ``iteration_time`` every other
batch split uses (``planning/batch.py``). So a node slowed in a light stage
costs its pipeline less than one slowed in the bottleneck stage, as it does on
the hardware.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from collections.abc import Callable

from oobleck_mm.planning.batch import BatchSplit, split_batch
from oobleck_mm.planning.plan import PipelineInstance, Plan
from oobleck_mm.planning.template import PipelineTemplate


def slowed_template(instance: PipelineInstance, slow: Mapping[str, float]) -> PipelineTemplate:
    """``instance``'s template with the stages of its slow nodes ``slow[node]`` times longer."""
    template = instance.template
    factors = [slow.get(instance.nodes[stage.node], 1.0) for stage in template.stages]
    if all(f == 1.0 for f in factors):
        return template
    stages = tuple(
        dataclasses.replace(s, forward_s=s.forward_s * f, backward_s=s.backward_s * f)
        for s, f in zip(template.stages, factors)
    )
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


RECUT_GAIN = 0.02
"""A slow node's pipeline is re-cut (its stages' layers moved for their speeds) only when the plan is predicted
this much faster than with the batch re-split alone: a near tie is not worth moving layer states."""

Recut = Callable[[PipelineTemplate, list[float], int], PipelineTemplate]
"""(template, each stage's slowdown factor, microbatches) -> the template with its layer boundaries moved
(``planning.stage_mapping.recut_for_speeds``)."""


def speed_aware_plan(
    plan: Plan,
    slow: Mapping[str, float],
    solver: str = "highs",
    recut: Recut | None = None,
    restore: Callable[[int], PipelineTemplate | None] | None = None,
) -> tuple[Plan, BatchSplit, bool]:
    """``plan`` for the nodes' speeds: the batch re-split (``speed_aware_split``) and, with ``recut``, each slow
    node's pipeline re-cut so its stage takes fewer layers, whichever is predicted faster (by ``RECUT_GAIN``);
    the third value says the re-cut was taken.

    Why both: the re-split alone is bounded by the split's whole microbatches (MLLM-10B on 8 nodes, 2 pipelines
    of 4 stages, one node 2x slow: 89% of unslowed predicted at 8 microbatches, 82% at 16), while a pipeline whose
    slow stage holds fewer layers runs near the speed of its nodes' sum (92% at 16 microbatches). ``restore(n)``:
    the job's own template for ``n``-node pipelines, which a pipeline that was re-cut for a node since
    recovered (or left) gets back."""
    if restore is not None:
        plan = with_own_templates(plan, restore)
    kept, split = speed_aware_split(plan, slow, solver)
    slowed = [p for p in plan.pipelines if any(slow.get(n, 1.0) != 1.0 for n in p.nodes)]
    if recut is None or not slowed:
        return kept, split, False
    pipelines = []
    for p in plan.pipelines:
        factors = [slow.get(p.nodes[stage.node], 1.0) for stage in p.template.stages]
        # Only stages of different speeds: a pipeline slowed evenly (every stage on the slow node) has nothing
        # to move, and a "re-cut" would only re-tune the template for another microbatch count.
        if len(set(factors)) > 1:
            p = dataclasses.replace(p, template=recut(p.template, factors, p.num_microbatches))
        pipelines.append(p)
    cut, cut_split = speed_aware_split(dataclasses.replace(plan, pipelines=tuple(pipelines)), slow, solver)
    if predicted_samples_per_s(cut, slow) > predicted_samples_per_s(kept, slow) * (1 + RECUT_GAIN):
        return cut, cut_split, True
    return kept, split, False


def with_own_templates(plan: Plan, restore: Callable[[int], PipelineTemplate | None]) -> Plan:
    """``plan`` with every pipeline re-cut for a slow node (``speed_aware_plan``) on the job's own template for
    its node count again (``restore(n)``, e.g. ``TemplateSet.for_nodes``): what the reconfiguration of a loss or
    a join starts from, since it places pipelines by the templates (the workers derive the state copies from
    the layouts they actually hold)."""
    pipelines = []
    for p in plan.pipelines:
        own = restore(p.template.num_nodes)
        if own is not None and own != p.template and own.num_stages == p.template.num_stages:
            p = dataclasses.replace(p, template=own)
        pipelines.append(p)
    return dataclasses.replace(plan, pipelines=tuple(pipelines))
