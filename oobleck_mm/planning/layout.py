"""Execution plans: which global rank runs which layers of which pipeline, with how many microbatches.

This is what a worker needs from a planning ``Plan`` once nodes have ranks
(``rank_table``). It is plain data (JSON-able through ``to_dict``/``from_dict``,
protobuf through ``protocol.convert``) so the master can ship it over the
control plane and tests can write one by hand.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from oobleck_mm.errors import UserError

Gpu = tuple[str, int]
"""(node name, node-local GPU index)."""


@dataclass(frozen=True, slots=True)
class StageLayout:
    rank: int
    """Global rank in this generation's process group."""
    layer_start: int
    layer_end: int
    """Exclusive."""
    slowdown: float = 1.0
    """Its node's measured slowness (``master/stragglers.py``): its work takes this many times what the
    cost model says, and the balancer prices it so (``balance.problem.PipelineShape``)."""

    @property
    def layers(self) -> range:
        return range(self.layer_start, self.layer_end)


@dataclass(frozen=True, slots=True)
class PipelineLayout:
    stages: tuple[StageLayout, ...]
    num_microbatches: int

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(s.rank for s in self.stages)


@dataclass(frozen=True, slots=True)
class ExecutionPlan:
    pipelines: tuple[PipelineLayout, ...]
    num_layers: int
    microbatch_size: int

    def __post_init__(self) -> None:
        if not self.pipelines:
            raise ValueError("execution plan: needs at least one pipeline")
        ranks = sorted(s.rank for p in self.pipelines for s in p.stages)
        if ranks != list(range(len(ranks))):
            raise ValueError(f"execution plan: ranks must be 0..{len(ranks) - 1} each once, got {ranks}")
        for i, p in enumerate(self.pipelines):
            if p.num_microbatches < 1:
                raise ValueError(f"execution plan: pipeline {i} has num_microbatches={p.num_microbatches}, need >= 1")
            bounds = [(s.layer_start, s.layer_end) for s in p.stages]
            expected_start = 0
            for start, end in bounds:
                if start != expected_start or end <= start:
                    raise ValueError(
                        f"execution plan: pipeline {i} stages {bounds} must cover layers 0..{self.num_layers} "
                        "contiguously, each stage non-empty"
                    )
                expected_start = end
            if expected_start != self.num_layers:
                raise ValueError(f"execution plan: pipeline {i} ends at layer {expected_start}, not {self.num_layers}")

    # ------------------------------------------------------------------ queries
    @property
    def world_size(self) -> int:
        return sum(len(p.stages) for p in self.pipelines)

    @property
    def global_batch(self) -> int:
        return sum(p.num_microbatches for p in self.pipelines) * self.microbatch_size

    def position(self, rank: int) -> tuple[int, int]:
        """(pipeline index, stage index) of ``rank``."""
        for i, p in enumerate(self.pipelines):
            for j, s in enumerate(p.stages):
                if s.rank == rank:
                    return i, j
        raise ValueError(f"rank {rank} is not in the plan (world size {self.world_size})")

    def stage(self, rank: int) -> StageLayout:
        i, j = self.position(rank)
        return self.pipelines[i].stages[j]

    def holders(self, layer: int) -> tuple[int, ...]:
        """Ranks holding ``layer``, one per pipeline, in pipeline order."""
        return tuple(s.rank for p in self.pipelines for s in p.stages if s.layer_start <= layer < s.layer_end)

    def checkpoint_owner(self, layer: int) -> int:
        """The one rank that writes ``layer`` in a periodic checkpoint: its replicas take turns by layer
        index, so every rank copies and writes a share instead of the first pipeline all of them."""
        holders = self.holders(layer)
        return holders[layer % len(holders)]

    def microbatch_offsets(self) -> tuple[int, ...]:
        """Index of each pipeline's first microbatch in the step's global list of microbatches."""
        out, total = [], 0
        for p in self.pipelines:
            out.append(total)
            total += p.num_microbatches
        return tuple(out)

    # ------------------------------------------------------------------ construction
    @classmethod
    def even(
        cls,
        num_layers: int,
        stages_per_pipeline: Sequence[int],
        microbatches: Sequence[int],
        microbatch_size: int,
    ) -> ExecutionPlan:
        """Pipelines cutting the layers into near-equal stages; ranks numbered pipeline by pipeline."""
        if len(stages_per_pipeline) != len(microbatches):
            raise ValueError(
                f"stages_per_pipeline has {len(stages_per_pipeline)} entries, microbatches {len(microbatches)}"
            )
        pipelines, rank = [], 0
        for num_stages, mbs in zip(stages_per_pipeline, microbatches):
            if not 1 <= num_stages <= num_layers:
                raise ValueError(f"a pipeline of {num_stages} stages cannot hold {num_layers} layers")
            cuts = [round(k * num_layers / num_stages) for k in range(num_stages + 1)]
            stages = []
            for start, end in zip(cuts, cuts[1:]):
                stages.append(StageLayout(rank, start, end))
                rank += 1
            pipelines.append(PipelineLayout(tuple(stages), mbs))
        return cls(tuple(pipelines), num_layers, microbatch_size)

    @classmethod
    def from_plan(cls, plan, ranks: Mapping[Gpu, int], slow: Mapping[str, float] | None = None) -> ExecutionPlan:
        """From a planning ``Plan``; ``ranks`` maps (node name, local gpu) to a global rank; ``slow``: the
        measured slowdown of slow nodes, carried by their stages (``StageLayout.slowdown``).

        Stages spanning several GPUs (sharded with FSDP2 inside a stage: docs/runtime.md) are not run by
        this engine yet.
        """
        pipelines = []
        for instance in plan.pipelines:
            stages = []
            for spec in instance.template.stages:
                if len(spec.gpus) != 1:
                    raise UserError(
                        f"stage over layers {spec.layer_start}..{spec.layer_end} uses {len(spec.gpus)} GPUs; "
                        "the runtime runs one GPU per stage (cluster.max_gpus_per_stage: 1)"
                    )
                node = instance.nodes[spec.node]
                stages.append(StageLayout(ranks[(node, spec.gpus[0])], spec.layer_start, spec.layer_end,
                                          (slow or {}).get(node, 1.0)))
            pipelines.append(PipelineLayout(tuple(stages), instance.num_microbatches))
        return cls(tuple(pipelines), plan.pipelines[0].template.num_layers, plan.microbatch_size)

    def to_dict(self) -> dict[str, Any]:
        return {
            "num_layers": self.num_layers,
            "microbatch_size": self.microbatch_size,
            "pipelines": [
                {"num_microbatches": p.num_microbatches,
                 "stages": [[s.rank, s.layer_start, s.layer_end, *([s.slowdown] if s.slowdown != 1.0 else [])]
                            for s in p.stages]}
                for p in self.pipelines
            ],
        }  # fmt: skip

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ExecutionPlan:
        pipelines = tuple(
            PipelineLayout(tuple(StageLayout(*map(int, s[:3]), *map(float, s[3:4])) for s in p["stages"]),
                           int(p["num_microbatches"]))
            for p in d["pipelines"]
        )
        return cls(pipelines, int(d["num_layers"]), int(d["microbatch_size"]))

    def describe(self) -> str:
        parts = []
        for p in self.pipelines:
            stages = "|".join(f"r{s.rank}:{s.layer_start}-{s.layer_end - 1}"
                              + (f"(slow x{s.slowdown:.2f})" if s.slowdown != 1.0 else "") for s in p.stages)
            parts.append(f"[{stages}]x{p.num_microbatches}mb")
        return " ".join(parts)


def rank_table(plan) -> dict[Gpu, int]:
    """(node, local GPU) -> global rank for a planning ``Plan``: pipeline by pipeline, stage by stage."""
    ranks: dict[Gpu, int] = {}
    for instance in plan.pipelines:
        for spec in instance.template.stages:
            for gpu in spec.gpus:
                ranks[(instance.nodes[spec.node], gpu)] = len(ranks)
    return ranks
