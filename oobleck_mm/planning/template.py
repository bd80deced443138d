"""Pipeline templates: a fixed stage mapping for a given number of nodes.

A template says, for ``num_nodes`` nodes of ``gpus_per_node`` GPUs each, how
the model's layers are cut into stages and which node-local GPUs run each
stage. Templates are computed once per job (``stage_mapping.build_templates``)
and never change; pipelines are instantiated from them on concrete nodes.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from oobleck_mm.planning.pipeline_time import iteration_time_1f1b


@dataclass(frozen=True, slots=True)
class StageSpec:
    layer_start: int
    layer_end: int
    """Exclusive."""
    node: int
    """Node index inside the template (0-based, in pipeline order)."""
    gpus: tuple[int, ...]
    """Node-local GPU indices."""
    forward_s: float
    backward_s: float
    memory_bytes: float
    """Peak bytes per GPU with the activations 1F1B keeps in flight on this stage."""
    grad_bytes: float = 0.0
    """Per GPU: gradient bytes this stage all-reduces with other replicas each iteration."""

    @property
    def num_layers(self) -> int:
        return self.layer_end - self.layer_start

    @property
    def layers(self) -> range:
        return range(self.layer_start, self.layer_end)


@dataclass(frozen=True, slots=True)
class PipelineTemplate:
    num_nodes: int
    gpus_per_node: int
    stages: tuple[StageSpec, ...]
    send_activation_s: tuple[float, ...]
    """Per stage boundary k (between stage k and k+1): seconds to send one microbatch's activation."""
    send_grad_s: tuple[float, ...]
    """Per stage boundary k: seconds to send one microbatch's input gradient back."""

    def __post_init__(self) -> None:
        assert len(self.send_activation_s) == len(self.stages) - 1
        assert len(self.send_grad_s) == len(self.stages) - 1

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def num_layers(self) -> int:
        return self.stages[-1].layer_end

    def iteration_time(self, num_microbatches: int) -> float:
        """Exact 1F1B iteration seconds (DeepSpeed ``TrainSchedule``) for ``num_microbatches``."""
        return _cached_time(self, num_microbatches)

    def layers_of_gpu(self) -> dict[tuple[int, int], range]:
        """(template node, local gpu) -> layer range that GPU holds."""
        out = {}
        for stage in self.stages:
            for gpu in stage.gpus:
                out[(stage.node, gpu)] = stage.layers
        return out

    def describe(self) -> str:
        parts = []
        for i, s in enumerate(self.stages):
            parts.append(f"s{i}[L{s.layer_start}-{s.layer_end - 1} n{s.node} g{','.join(map(str, s.gpus))}]")
        return " ".join(parts)


@lru_cache(maxsize=65536)
def _cached_time(template: PipelineTemplate, num_microbatches: int) -> float:
    return iteration_time_1f1b(
        [s.forward_s for s in template.stages],
        [s.backward_s for s in template.stages],
        template.send_activation_s,
        template.send_grad_s,
        num_microbatches,
    )


@dataclass(frozen=True, slots=True)
class TemplateSet:
    """All templates of a job: one per node count n0..n_max (consecutive, §2.4.1.1)."""

    min_nodes: int
    """n0: the fewest nodes whose memory holds the model with 1F1B's in-flight activations."""
    templates: tuple[PipelineTemplate, ...]
    """Sorted by ``num_nodes``; node counts are consecutive from ``min_nodes``."""

    def __post_init__(self) -> None:
        counts = [t.num_nodes for t in self.templates]
        assert counts == list(range(self.min_nodes, self.min_nodes + len(counts))), counts

    @property
    def max_nodes(self) -> int:
        return self.templates[-1].num_nodes

    @property
    def node_counts(self) -> tuple[int, ...]:
        return tuple(t.num_nodes for t in self.templates)

    def for_nodes(self, num_nodes: int) -> PipelineTemplate | None:
        i = num_nodes - self.min_nodes
        return self.templates[i] if 0 <= i < len(self.templates) else None
