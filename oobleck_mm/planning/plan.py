"""Plans: pipelines instantiated from templates on concrete nodes, with the batch split."""

from __future__ import annotations

from dataclasses import dataclass

from oobleck_mm.planning.template import PipelineTemplate


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
    with the others, so the slowest stage bounds the phase.
    """
    replicas = len(templates)
    worst = max(s.grad_bytes for t in templates for s in t.stages)
    return cluster.allreduce_s(worst, replicas, cross_node=True)
