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
    """Its node's measured slowness (``oobleck_mm/master/stragglers.py``): its work takes this many times what the
    cost model says, and the balancer prices it so (``balance.problem.PipelineShape``)."""
    shards: tuple[int, ...] = ()
    """The global ranks of the stage's other GPUs, in shard order after ``rank``: a stage of several GPUs
    (always inside one node) holds its layers sharded over ``ranks`` with FSDP2 and each rank runs part of
    every microbatch (docs/runtime.md, "Stages of several GPUs"). Empty: one GPU."""
    recompute: bool = False
    """Recompute the stage's activations in backward, each layer keeping only its input (the planner's
    per-stage choice, ``planning.template.StageSpec.recompute``)."""
    context_parallel: bool = False
    """A stage of several GPUs that splits every microbatch's *tokens* over ``ranks`` instead of its samples:
    each rank runs its share of the sequence's 128-token blocks, and attention gathers the others' keys and
    values (``runtime.context_parallel``). Its layers are sharded over the ranks all the same (FSDP2, as any
    stage of several GPUs: torchtitan's ``dp_shard_cp``), so a lane holds 1/width of their state too. A
    pipeline with such a stage has only such stages, all as wide: rank ``k`` of every stage runs share ``k``
    (a lane)."""

    @property
    def layers(self) -> range:
        return range(self.layer_start, self.layer_end)

    @property
    def ranks(self) -> tuple[int, ...]:
        """Every rank of the stage, in shard order (rank ``k`` holds chunk ``k`` of every parameter)."""
        return (self.rank, *self.shards)

    @property
    def width(self) -> int:
        """GPUs of the stage."""
        return 1 + len(self.shards)

    @property
    def sharded(self) -> bool:
        """Its layers are sharded over its GPUs (FSDP2): any stage of several GPUs, context-parallel or not."""
        return self.width > 1


@dataclass(frozen=True, slots=True)
class PipelineLayout:
    stages: tuple[StageLayout, ...]
    num_microbatches: int
    branches: tuple[int, ...] = ()
    """Encoder branches (Cornstarch's modality parallelism, issue 49): the stage index where each branch
    starts, the first 0, each branch's stages running its encoder's layers (in layer order, one branch after
    another) concurrently with the others'; ``merge`` is the LLM's first stage, which takes every branch's
    output. Empty: a chain, every stage feeding the next."""
    merge: int = 0
    """The LLM's first stage of a branched pipeline (``branches``); 0 for a chain."""

    @property
    def branched(self) -> bool:
        return bool(self.branches)

    def _branch_of(self, stage: int) -> tuple[int, int]:
        """(first stage, end stage) of the branch holding ``stage`` (a stage before ``merge``)."""
        ends = (*self.branches[1:], self.merge)
        b = max(k for k, start in enumerate(self.branches) if start <= stage)
        return self.branches[b], ends[b]

    def neighbours(self, stage: int) -> tuple[tuple[int, ...], int | None]:
        """(stages that send ``stage`` its input, in branch order; the stage it sends its output to, None at
        the end). A chain's stage has one sender (none for the first); a branch's first stage has none, its
        last sends to ``merge``, which has one sender per branch."""
        n = len(self.stages)
        if not self.branched or stage > self.merge:
            return ((stage - 1,) if stage > 0 else ()), (stage + 1 if stage + 1 < n else None)
        if stage == self.merge:
            ends = (*self.branches[1:], self.merge)
            return tuple(end - 1 for end in ends), (stage + 1 if stage + 1 < n else None)
        start, end = self._branch_of(stage)
        return ((stage - 1,) if stage > start else ()), (stage + 1 if stage + 1 < end else self.merge)

    def schedule_position(self, stage: int) -> tuple[int, int]:
        """(stages, stage_id) of ``stage``'s DeepSpeed ``TrainSchedule``. A 1F1B stage's instruction order
        depends only on its distance to the pipeline's end, so a branch's stage ``k`` of ``K`` before the
        LLM's ``S`` stages runs stage ``k`` of ``K + S``, and the LLM's stage ``j`` runs ``1 + j`` of ``1 + S``
        (the exact time ``planning.branches.simulate_branched`` computes runs the same)."""
        if not self.branched:
            return len(self.stages), stage
        llm = len(self.stages) - self.merge
        if stage >= self.merge:
            return 1 + llm, 1 + stage - self.merge
        start, end = self._branch_of(stage)
        return end - start + llm, stage - start

    def upstream_layers(self, stage: int) -> tuple[int, ...]:
        """The layers whose outputs reach ``stage``'s input (its branch's earlier layers; every earlier layer for
        a chain or an LLM stage): it needs its input's gradient iff one of them trains."""
        first = self.stages[stage].layer_start
        if not self.branched or stage >= self.merge:
            return tuple(range(first))
        start, _ = self._branch_of(stage)
        return tuple(range(self.stages[start].layer_start, first))

    def branch_layers(self, branch: int) -> range:
        """The layers of branch ``branch``."""
        ends = (*self.branches[1:], self.merge)
        return range(self.stages[self.branches[branch]].layer_start, self.stages[ends[branch]].layer_start)

    @property
    def ranks(self) -> tuple[int, ...]:
        """Every rank of the pipeline, stage by stage."""
        return tuple(r for s in self.stages for r in s.ranks)

    @property
    def pieces(self) -> int:
        """Parts every microbatch of the pipeline is cut into: its widest stage's width. Stage widths are
        powers of two (``planning.costs.ClusterSpec.stage_gpu_options``), so each divides it, and rank ``k``
        of a stage of width ``d`` runs pieces ``k * pieces / d`` to ``(k + 1) * pieces / d`` (``pieces_of``):
        every rank of a stage runs as many pieces, so its FSDP2 collectives pair up."""
        return max(s.width for s in self.stages)

    def pieces_of(self, stage: int, rank: int) -> range:
        """The pieces of every microbatch that ``rank`` of stage ``stage`` runs."""
        s = self.stages[stage]
        per = self.pieces // s.width
        k = s.ranks.index(rank)
        return range(k * per, (k + 1) * per)

    def piece_rank(self, stage: int, piece: int) -> int:
        """The rank of stage ``stage`` that runs ``piece``."""
        s = self.stages[stage]
        return s.ranks[piece // (self.pieces // s.width)]


@dataclass(frozen=True, slots=True)
class ExecutionPlan:
    pipelines: tuple[PipelineLayout, ...]
    num_layers: int
    microbatch_size: int

    def __post_init__(self) -> None:
        if not self.pipelines:
            raise ValueError("execution plan: needs at least one pipeline")
        ranks = sorted(r for p in self.pipelines for s in p.stages for r in s.ranks)
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
            if p.branched:
                _check_branches(i, p)
            widths = [s.width for s in p.stages]
            if any(p.pieces % w for w in widths):
                raise ValueError(
                    f"execution plan: pipeline {i} has stages of {widths} GPUs; each must divide the "
                    f"widest ({p.pieces}): widths are 1, 2, 4 or 8"
                )
            if any(s.context_parallel for s in p.stages):
                if any(not s.context_parallel or s.width != p.pieces for s in p.stages):
                    raise ValueError(
                        f"execution plan: pipeline {i} has a context-parallel stage; every stage of it must be "
                        f"context-parallel over as many GPUs (widths {widths}, context-parallel "
                        f"{[s.context_parallel for s in p.stages]})"
                    )
            elif p.pieces > self.microbatch_size:
                raise ValueError(
                    f"execution plan: pipeline {i} has a stage of {p.pieces} GPUs, which splits every "
                    f"microbatch's samples over them, but a microbatch holds {self.microbatch_size} "
                    f"(training.microbatch_size); raise it to at least {p.pieces} or lower "
                    f"cluster.max_gpus_per_stage"
                )

    # ------------------------------------------------------------------ queries
    @property
    def branched(self) -> bool:
        """Some pipeline runs encoder branches (``PipelineLayout.branches``)."""
        return any(p.branched for p in self.pipelines)

    @property
    def world_size(self) -> int:
        return sum(s.width for p in self.pipelines for s in p.stages)

    @property
    def sharded(self) -> bool:
        """Some stage spans several GPUs: it shards its layers over them (FSDP2), context-parallel or not, and
        its ranks get a group of their own."""
        return any(s.sharded for p in self.pipelines for s in p.stages)

    @property
    def global_batch(self) -> int:
        return sum(p.num_microbatches for p in self.pipelines) * self.microbatch_size

    def position(self, rank: int) -> tuple[int, int]:
        """(pipeline index, stage index) of ``rank``."""
        for i, p in enumerate(self.pipelines):
            for j, s in enumerate(p.stages):
                if rank in s.ranks:
                    return i, j
        raise ValueError(f"rank {rank} is not in the plan (world size {self.world_size})")

    def stage(self, rank: int) -> StageLayout:
        i, j = self.position(rank)
        return self.pipelines[i].stages[j]

    def holders(self, layer: int) -> tuple[int, ...]:
        """The ranks standing for each copy of ``layer``, in pipeline order: one per pipeline (a sharded
        stage's first rank)."""
        return tuple(s.rank for p in self.pipelines for s in p.stages if s.layer_start <= layer < s.layer_end)

    def shard_holders(self, layer: int) -> tuple[tuple[int, ...], ...]:
        """The ranks of each copy of ``layer``, in pipeline order: a sharded stage's ranks in shard order."""
        return tuple(s.ranks for p in self.pipelines for s in p.stages if s.layer_start <= layer < s.layer_end)

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
        widths: Sequence[Sequence[int]] | None = None,
        recompute: Sequence[Sequence[bool]] | None = None,
        context_parallel: Sequence[bool] | None = None,
    ) -> ExecutionPlan:
        """Pipelines cutting the layers into near-equal stages; ranks numbered pipeline by pipeline.
        ``widths``: GPUs of each stage of each pipeline (default 1 each); ``recompute``: which stages of each
        pipeline recompute their activations (default none); ``context_parallel``: which pipelines split tokens
        over their stages' GPUs instead of sharding layers (default none)."""
        if len(stages_per_pipeline) != len(microbatches):
            raise ValueError(
                f"stages_per_pipeline has {len(stages_per_pipeline)} entries, microbatches {len(microbatches)}"
            )
        pipelines, rank = [], 0
        for p, (num_stages, mbs) in enumerate(zip(stages_per_pipeline, microbatches)):
            if not 1 <= num_stages <= num_layers:
                raise ValueError(f"a pipeline of {num_stages} stages cannot hold {num_layers} layers")
            cuts = [round(k * num_layers / num_stages) for k in range(num_stages + 1)]
            stage_widths = list(widths[p]) if widths is not None else [1] * num_stages
            if len(stage_widths) != num_stages:
                raise ValueError(f"widths of pipeline {p}: {stage_widths} for {num_stages} stages")
            stage_recompute = list(recompute[p]) if recompute is not None else [False] * num_stages
            if len(stage_recompute) != num_stages:
                raise ValueError(f"recompute of pipeline {p}: {stage_recompute} for {num_stages} stages")
            stages = []
            for (start, end), width, again in zip(zip(cuts, cuts[1:]), stage_widths, stage_recompute):
                cp = bool(context_parallel and context_parallel[p])
                stages.append(
                    StageLayout(
                        rank,
                        start,
                        end,
                        shards=tuple(range(rank + 1, rank + width)),
                        recompute=again,
                        context_parallel=cp,
                    )
                )
                rank += width
            pipelines.append(PipelineLayout(tuple(stages), mbs))
        return cls(tuple(pipelines), num_layers, microbatch_size)

    @classmethod
    def from_plan(cls, plan, ranks: Mapping[Gpu, int], slow: Mapping[str, float] | None = None) -> ExecutionPlan:
        """From a planning ``Plan``; ``ranks`` maps (node name, local gpu) to a global rank; ``slow``: the
        measured slowdown of slow nodes, carried by their stages (``StageLayout.slowdown``). A stage of
        several GPUs gets their ranks in GPU order (``StageLayout.shards``)."""
        pipelines = []
        for instance in plan.pipelines:
            stages = []
            for spec in instance.template.stages:
                node = instance.nodes[spec.node]
                stages.append(
                    StageLayout(
                        ranks[(node, spec.gpus[0])],
                        spec.layer_start,
                        spec.layer_end,
                        (slow or {}).get(node, 1.0),
                        tuple(ranks[(node, g)] for g in spec.gpus[1:]),
                        spec.recompute,
                        spec.context_parallel,
                    )
                )
            template = instance.template
            pipelines.append(
                PipelineLayout(tuple(stages), instance.num_microbatches, template.branches, template.merge)
            )
        return cls(tuple(pipelines), plan.pipelines[0].template.num_layers, plan.microbatch_size)

    def to_dict(self) -> dict[str, Any]:
        return {
            "num_layers": self.num_layers,
            "microbatch_size": self.microbatch_size,
            "pipelines": [
                {
                    "num_microbatches": p.num_microbatches,
                    "stages": [
                        [
                            s.rank,
                            s.layer_start,
                            s.layer_end,
                            *([s.slowdown] if s.slowdown != 1.0 or s.shards or s.recompute else []),
                            *([list(s.shards)] if s.shards or s.recompute else []),
                            *([s.recompute] if s.recompute or s.context_parallel else []),
                            *([True] if s.context_parallel else []),
                        ]
                        for s in p.stages
                    ],
                }
                | ({"branches": list(p.branches), "merge": p.merge} if p.branched else {})
                for p in self.pipelines
            ],
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ExecutionPlan:
        pipelines = tuple(
            PipelineLayout(
                tuple(
                    StageLayout(
                        *map(int, s[:3]),
                        *map(float, s[3:4]),
                        *(tuple(map(int, x)) for x in s[4:5]),
                        *(bool(x) for x in s[5:7]),
                    )
                    for s in p["stages"]
                ),
                int(p["num_microbatches"]),
                tuple(map(int, p.get("branches", ()))),
                int(p.get("merge", 0)),
            )
            for p in d["pipelines"]
        )
        return cls(pipelines, int(d["num_layers"]), int(d["microbatch_size"]))

    def describe(self) -> str:
        parts = []
        for p in self.pipelines:
            # A branched pipeline: its branches side by side ("  ||  "), then "=>" the LLM's stages.
            stages = "".join(
                ("" if j == 0 else " || " if j in p.branches else " => " if p.branched and j == p.merge else "|")
                + f"r{'+'.join(map(str, s.ranks))}:{s.layer_start}-{s.layer_end - 1}"
                + (f"(slow x{s.slowdown:.2f})" if s.slowdown != 1.0 else "")
                + ("(r)" if s.recompute else "")
                + ("(cp)" if s.context_parallel else "")
                for j, s in enumerate(p.stages)
            )
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


def _check_branches(i: int, p: PipelineLayout) -> None:
    """A branched pipeline: branches start at 0 in increasing order, each non-empty, before a merge stage that
    leaves the LLM at least one stage. Stages of several GPUs are fine: piece ``k`` of a microbatch (its
    samples' share, or under context parallelism lane ``k``, whose encoders run on the whole media) goes from
    each branch's rank running it to the merge stage's."""
    starts = list(p.branches)
    if starts[0] != 0 or starts != sorted(set(starts)) or not starts[-1] < p.merge < len(p.stages):
        raise ValueError(
            f"execution plan: pipeline {i}'s branches start at stages {starts} and merge at stage {p.merge}: "
            f"branches start at 0, in increasing order, each before the merge, which is one of its "
            f"{len(p.stages)} stages"
        )


def piece_samples(samples: Sequence[int], pieces: int, piece: int) -> tuple[int, ...]:
    """The samples of a microbatch that piece ``piece`` of ``pieces`` runs (``PipelineLayout.pieces``):
    contiguous parts, the first ``len % pieces`` one sample longer, so the pieces in order are the
    microbatch."""
    n = len(samples)
    size, extra = divmod(n, pieces)
    start = piece * size + min(piece, extra)
    return tuple(samples[start : start + size + (1 if piece < extra else 0)])
