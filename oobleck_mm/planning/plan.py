"""Plans: pipelines instantiated from templates on concrete nodes, with the batch split."""

from __future__ import annotations

from dataclasses import dataclass

from oobleck_mm.planning.template import PipelineTemplate, StageSpec


@dataclass(frozen=True, slots=True)
class PipelineInstance:
    template: PipelineTemplate
    nodes: tuple[str, ...]
    """Node names in pipeline order; ``nodes[i]`` runs the template's node ``i``."""
    num_microbatches: int

    def __post_init__(self) -> None:
        assert len(self.nodes) == self.template.num_nodes, (self.nodes, self.template.num_nodes)

    @property
    def iteration_time_s(self) -> float:
        return self.template.iteration_time(self.num_microbatches)

    def layers_on(self) -> dict[tuple[str, int], range]:
        """(node name, local gpu) -> layers that GPU holds in this pipeline."""
        return {(self.nodes[n], g): r for (n, g), r in self.template.layers_of_gpu().items()}


@dataclass(frozen=True, slots=True)
class Plan:
    pipelines: tuple[PipelineInstance, ...]
    global_batch: int
    microbatch_size: int
    allreduce_s: float
    """Seconds of the end-of-iteration gradient all-reduce across replicas."""

    @property
    def num_pipelines(self) -> int:
        return len(self.pipelines)

    @property
    def nodes(self) -> tuple[str, ...]:
        return tuple(n for p in self.pipelines for n in p.nodes)

    @property
    def iteration_time_s(self) -> float:
        return max(p.iteration_time_s for p in self.pipelines) + self.allreduce_s

    @property
    def samples_per_s(self) -> float:
        return self.global_batch / self.iteration_time_s


def gradient_allreduce_s(templates: list[PipelineTemplate] | tuple[PipelineTemplate, ...], cluster) -> float:
    """End-of-iteration all-reduce seconds for pipelines built from ``templates``.

    Every layer is all-reduced across all r replicas (layer-wise, §2.6.1). The
    replicas of a layer sit on different nodes, so the ring runs over the
    inter-node links; each GPU reduces its own stage's gradients in parallel
    with the others, so the slowest stage bounds the phase. A stage of several GPUs (sharded, or context-
    parallel lanes, which shard their layers too) holds one copy, each GPU its 1/d of the rows
    (``StageSpec.grad_bytes`` per GPU), summed with the other pipelines' GPUs holding the same rows.
    """
    replicas = len(templates)
    worst = max(s.grad_bytes for t in templates for s in t.stages)
    return cluster.allreduce_s(worst, replicas, cross_node=True)


def plan_to_dict(plan: Plan) -> dict:
    """``plan`` as JSON-ready data (the master's journal holds data, never pickles: ``oobleck_mm.master.journal``)."""
    return {
        "global_batch": plan.global_batch,
        "microbatch_size": plan.microbatch_size,
        "allreduce_s": plan.allreduce_s,
        "pipelines": [
            {
                "nodes": list(p.nodes),
                "num_microbatches": p.num_microbatches,
                "template": {
                    "num_nodes": p.template.num_nodes,
                    "gpus_per_node": p.template.gpus_per_node,
                    "send_activation_s": list(p.template.send_activation_s),
                    "send_grad_s": list(p.template.send_grad_s),
                    "stages": [
                        [
                            s.layer_start,
                            s.layer_end,
                            s.node,
                            list(s.gpus),
                            s.forward_s,
                            s.backward_s,
                            s.memory_bytes,
                            s.grad_bytes,
                            s.recompute,
                            s.context_parallel,
                        ]
                        for s in p.template.stages
                    ],
                },
            }
            for p in plan.pipelines
        ],
    }


def _stage_from_row(row: list) -> StageSpec:
    # A journal written before per-stage recomputation has 8 fields (those stages kept their activations), one
    # before context parallelism 9.
    a, b, node, gpus, f, bw, mem, grad, *rest = row
    if len(rest) > 2:
        raise ValueError(f"a stage row has 8 to 10 fields, got {len(row)}")
    recompute, context_parallel = (*rest, False, False)[:2]
    for name, value in (("recompute", recompute), ("context_parallel", context_parallel)):
        if not isinstance(value, bool):
            raise ValueError(f"a stage's {name} must be true or false, got {value!r}")
    return StageSpec(
        int(a),
        int(b),
        int(node),
        tuple(int(g) for g in gpus),
        float(f),
        float(bw),
        float(mem),
        float(grad),
        recompute,
        context_parallel,
    )


def plan_from_dict(d: dict) -> Plan:
    """The ``Plan`` ``plan_to_dict`` wrote; ``KeyError``/``TypeError``/``ValueError`` when ``d`` is not one."""
    pipelines = []
    for p in d["pipelines"]:
        t = p["template"]
        stages = tuple(_stage_from_row(row) for row in t["stages"])
        if not stages or len(t["send_activation_s"]) != len(stages) - 1 or len(t["send_grad_s"]) != len(stages) - 1:
            raise ValueError(f"a template of {len(stages)} stages needs {max(0, len(stages) - 1)} send times each")
        template = PipelineTemplate(
            int(t["num_nodes"]),
            int(t["gpus_per_node"]),
            stages,
            tuple(float(x) for x in t["send_activation_s"]),
            tuple(float(x) for x in t["send_grad_s"]),
        )
        nodes = tuple(str(n) for n in p["nodes"])
        if len(nodes) != template.num_nodes:
            raise ValueError(f"a pipeline names {len(nodes)} nodes, its template has {template.num_nodes}")
        pipelines.append(PipelineInstance(template, nodes, int(p["num_microbatches"])))
    return Plan(tuple(pipelines), int(d["global_batch"]), int(d["microbatch_size"]), float(d["allreduce_s"]))
