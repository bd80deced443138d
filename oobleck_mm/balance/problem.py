"""One balancing decision as arrays: samples x pipeline stages costs, and how to score a placement.

``BalanceProblem.build`` turns the global batch (sample ids + work features),
the pipelines (microbatch counts + stage layer ranges) and the cost model into
integer tick costs of every sample on every distinct stage. Every algorithm in
the registry reads only this object and returns a ``Placement`` (pipeline and
microbatch of each sample); scoring is shared, so all algorithms are judged by
the same clock.

Why integer ticks: every rank must reach the same decision. Costs are rounded
to ``tick_s`` (1 ns) once, from elementwise IEEE products; after that every
sum the algorithms compare is a sum of integers held exactly in float64 (below
2^53 ticks, ~104 days), so it is the same in any order and on any CPU.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from oobleck_mm.balance.cost_model import CostCoefficients, CostModel
from oobleck_mm.balance.schedule_time import iteration_times
from oobleck_mm.balance.work import LLM_FEATURES, NUM_FEATURES


@dataclass(frozen=True, slots=True)
class PipelineShape:
    """What the balancer needs of one pipeline of the execution plan."""

    num_microbatches: int
    stages: tuple[tuple[int, int], ...]
    """``(layer_start, layer_end)`` of each stage, in pipeline order (end exclusive)."""
    slowdowns: tuple[float, ...] = ()
    """Per stage, how many times the cost model's seconds its node takes (a straggler's measured factor);
    empty: every stage as modelled."""
    recompute: tuple[bool, ...] = ()
    """Per stage, whether it recomputes its activations in backward (one more forward per microbatch, the
    plan's ``StageLayout.recompute``); empty: none does."""
    branches: tuple[int, ...] = ()
    """Encoder branches (``planning.layout.PipelineLayout.branches``): the stage where each branch starts, the
    branches running concurrently before ``merge``, the LLM's first stage. Empty: a chain."""
    merge: int = 0

    def __post_init__(self) -> None:
        if self.num_microbatches < 1:
            raise ValueError(f"num_microbatches must be >= 1, got {self.num_microbatches}")
        if not self.stages:
            raise ValueError("a pipeline needs at least one stage")
        for name in ("slowdowns", "recompute"):
            if getattr(self, name) and len(getattr(self, name)) != len(self.stages):
                raise ValueError(f"{name} has {len(getattr(self, name))} entries for {len(self.stages)} stages")
        if self.branches and not (
            self.branches[0] == 0
            and all(a < b for a, b in zip(self.branches, (*self.branches[1:], self.merge)))
            and self.merge < len(self.stages)
        ):
            raise ValueError(
                f"branches {self.branches} must start at stage 0 and ascend below merge {self.merge}, which must "
                f"be one of the {len(self.stages)} stages"
            )

    def chain_positions(self) -> tuple[tuple[int, ...], ...]:
        """The stages at each position of the chain the search sees: a chain's stages one by one; a branched
        pipeline's branch stages aligned at the merge (each branch's last stage at the position before the
        LLM's first, its earlier ones before that), then the LLM's stages one by one. The stages of one
        position run concurrently, and the slowest of them holds the LLM's first stage each microbatch."""
        if not self.branches:
            return tuple((k,) for k in range(len(self.stages)))
        ends = (*self.branches[1:], self.merge)
        depth = max(end - start for start, end in zip(self.branches, ends))
        positions: list[list[int]] = [[] for _ in range(depth)]
        for start, end in zip(self.branches, ends):
            for k in range(start, end):
                positions[depth - (end - k)].append(k)
        return (*map(tuple, positions), *((k,) for k in range(self.merge, len(self.stages))))


def recompute_factor(forward_share: float) -> float:
    """How many times its modelled seconds a stage takes when it recomputes its activations: the forward
    (``forward_share`` of forward + backward) runs once more, in the backward."""
    return 1.0 + forward_share


def pipeline_shapes(plan) -> tuple[PipelineShape, ...]:
    """The shapes of an ``oobleck_mm.planning.layout.ExecutionPlan``'s pipelines. A stage of ``d`` GPUs splits
    every microbatch over them: priced as a stage ``d`` times as fast (its FSDP2 traffic left out)."""
    return tuple(
        PipelineShape(
            p.num_microbatches,
            tuple((s.layer_start, s.layer_end) for s in p.stages),
            tuple(s.slowdown / s.width for s in p.stages)
            if any(s.slowdown != 1.0 or s.width > 1 for s in p.stages)
            else (),
            tuple(s.recompute for s in p.stages) if any(s.recompute for s in p.stages) else (),
            p.branches,
            p.merge,
        )
        for p in plan.pipelines
    )


@dataclass(frozen=True, slots=True)
class Placement:
    """Where each sample (by position in the problem) runs; microbatch numbers are execution order."""

    pipeline: np.ndarray
    microbatch: np.ndarray


@dataclass(frozen=True, slots=True, eq=False)
class BalanceProblem:
    sample_ids: np.ndarray
    """``(N,)`` int64, in the sampler's order."""
    features: np.ndarray
    """``(N, NUM_FEATURES)`` work features (``work.sample_features``)."""
    num_microbatches: np.ndarray
    """``(P,)`` per pipeline, fixed by the plan."""
    num_stages: np.ndarray
    stage_index: np.ndarray
    """``(P, S_max)`` index of each stage among the distinct stages; padding points at the zero column."""
    cost: np.ndarray
    """``(N, U + 1)`` ticks (integral float64) of each sample on each distinct stage; last column 0."""
    microbatch_cost: np.ndarray
    """``(U + 1,)`` fixed ticks per microbatch on each distinct stage."""
    forward_share: np.ndarray
    """``(U + 1,)`` forward's share of a stage's time."""
    microbatch_size: int | None
    """Samples per microbatch of the unbalanced split (``contiguous_assignment``), if it applies."""
    seed: int
    """Seed of randomised baselines (e.g. the step), so a decision is a function of its inputs."""
    tick_s: float
    llm_cost: np.ndarray | None = None
    """``(N, U + 1)`` the part of ``cost`` on the LLM's layers (its features: ``work.LLM_FEATURES``); the
    rest is the encoders'. Entrain's deferral (``deferral.py``) moves only this part between microbatches."""
    concurrent: tuple[tuple[int, ...], ...] = ()
    """Columns standing for the concurrent stages of a branched pipeline's chain position (``PipelineShape.
    chain_positions``): column ``U - len(concurrent) + g`` is concurrent group ``g``, whose members are these
    columns of the stages. Its per-sample cost is the largest of its members' for that sample: the search's
    linear stand-in for the slowest branch (at least the microbatch's real slowest branch's ticks, at most
    their sum). Exact times run the branches themselves (``branched``)."""
    branched: tuple[tuple[tuple[int, ...], tuple[int, ...], int] | None, ...] = ()
    """Per pipeline: None for a chain; for a branched one (its stages' own columns in plan order, its
    ``branches``, its ``merge``), which ``predicted_times`` runs as the engine does."""

    @property
    def num_samples(self) -> int:
        return len(self.sample_ids)

    @property
    def num_pipelines(self) -> int:
        return len(self.num_microbatches)

    @classmethod
    def build(
        cls,
        sample_ids: Sequence[int],
        features: np.ndarray,
        pipelines: Sequence[PipelineShape],
        model: CostModel,
        coefficients: CostCoefficients,
        microbatch_size: int | None = None,
        seed: int = 0,
        tick_s: float = 1e-9,
    ) -> BalanceProblem:
        ids = np.asarray(sample_ids, dtype=np.int64)
        features = np.asarray(features, dtype=float)
        if features.shape != (len(ids), NUM_FEATURES):
            raise ValueError(f"features must be ({len(ids)}, {NUM_FEATURES}), got {features.shape}")
        if len(np.unique(ids)) != len(ids):
            raise ValueError("sample_ids must be distinct")
        if not pipelines:
            raise ValueError("need at least one pipeline")
        # A distinct stage is a layer range at a speed, recomputing or not: a straggler's stage costs its
        # factor times more, a recomputing one its forward once more (``recompute_factor``).
        keyed = [
            tuple(
                (*stage, p.slowdowns[j] if p.slowdowns else 1.0, bool(p.recompute and p.recompute[j]))
                for j, stage in enumerate(p.stages)
            )
            for p in pipelines
        ]
        # A branched pipeline's concurrent branch stages become one position of the search's chain, a column
        # of its own (``concurrent``); a position of one stage is that stage's column.
        chains = [
            [tuple(sorted({keys[k] for k in at})) for at in p.chain_positions()] for p, keys in zip(pipelines, keyed)
        ]
        distinct = sorted({stage for stages in keyed for stage in stages})
        groups = sorted({at for chain in chains for at in chain if len(at) > 1})
        position = {stage: i for i, stage in enumerate(distinct)}
        position.update({(group,): len(distinct) + g for g, group in enumerate(groups)})
        width = len(distinct) + len(groups)
        vectors = np.zeros((width + 1, NUM_FEATURES))
        share = np.ones(width + 1)
        for i, (start, end, slowdown, recompute) in enumerate(distinct):
            forward = model.forward_share(start, end)
            factor = recompute_factor(forward) if recompute else 1.0
            vectors[i] = model.stage_vector(coefficients, start, end) * slowdown * factor
            share[i] = forward / factor
        s_max = max(len(chain) for chain in chains)
        stage_index = np.full((len(pipelines), s_max), width, dtype=np.int64)
        for i, chain in enumerate(chains):
            stage_index[i, : len(chain)] = [position[at[0] if len(at) == 1 else (at,)] for at in chain]
        cost = np.zeros((len(ids), width + 1))
        llm_cost = np.zeros_like(cost)
        # Every layer's terms read features of its own modality only (``work.LINEAR_FEATURE``), so the
        # LLM features' columns are exactly the LLM layers' cost: the split needs no layer boundary.
        for f in range(1, NUM_FEATURES):  # column 0 is the per-microbatch constant
            if vectors[:, f].any() and features[:, f].any():
                term = features[:, f : f + 1] * vectors[None, :, f]
                cost += term
                if f in LLM_FEATURES:
                    llm_cost += term
        cost, llm_cost = np.rint(cost / tick_s), np.rint(llm_cost / tick_s)
        fixed = np.rint(vectors[:, 0] / tick_s)
        concurrent = tuple(tuple(position[key] for key in group) for group in groups)
        for g, members in enumerate(concurrent):
            column, members = len(distinct) + g, list(members)
            cost[:, column] = cost[:, members].max(axis=1)
            llm_cost[:, column] = llm_cost[:, members].max(axis=1)
            fixed[column] = fixed[members].max()
            # The search times the position with one forward share: the slowest member's, by the batch's mean.
            typical = cost[:, members].mean(axis=0) + fixed[members]
            forward = (share[members] * typical).max()
            backward = ((1 - share[members]) * typical).max()
            share[column] = forward / (forward + backward) if forward + backward > 0 else share[members[0]]
        return cls(
            sample_ids=ids,
            features=features,
            num_microbatches=np.array([p.num_microbatches for p in pipelines], dtype=np.int64),
            num_stages=np.array([len(chain) for chain in chains], dtype=np.int64),
            stage_index=stage_index,
            cost=cost,
            microbatch_cost=fixed,
            forward_share=share,
            microbatch_size=microbatch_size,
            seed=seed,
            tick_s=tick_s,
            llm_cost=llm_cost,
            concurrent=concurrent,
            branched=tuple(
                (tuple(position[key] for key in keys), p.branches, p.merge) if p.branches else None
                for p, keys in zip(pipelines, keyed)
            ),
        )

    def with_pipeline_speeds(self, factors) -> BalanceProblem:
        """The same problem with pipeline ``p``'s stages costing ``factors[p]`` times as much (each pipeline its
        own distinct stages): what a placement should aim at when a pipeline will run faster or slower than
        its stages' costs say (e.g. after Entrain's deferral inside it). A branched pipeline's own stage
        columns (``branched``) are copied and scaled too, so its exact time scales with its factor; the
        rescaled problem names no ``concurrent`` groups (its columns are per pipeline; nothing reads them)."""
        columns, index = [], np.zeros_like(self.stage_index)
        zero = self.cost.shape[1] - 1
        branched = []
        for p in range(self.num_pipelines):
            for j in range(int(self.num_stages[p])):
                index[p, j] = len(columns)
                columns.append((int(self.stage_index[p, j]), float(factors[p])))
            index[p, int(self.num_stages[p]) :] = -1
            shape = self.branched[p] if self.branched else None
            if shape is not None:
                own, branches, merge = shape
                branched.append((tuple(range(len(columns), len(columns) + len(own))), branches, merge))
                columns.extend((int(c), float(factors[p])) for c in own)
            else:
                branched.append(None)
        width = len(columns)
        index[index < 0] = width
        take = np.array([c for c, _ in columns] + [zero])
        scale = np.array([f for _, f in columns] + [0.0])
        scaled = lambda a: np.rint(a[..., take] * scale)  # noqa: E731
        return dataclasses.replace(
            self,
            stage_index=index,
            cost=scaled(self.cost),
            microbatch_cost=scaled(self.microbatch_cost),
            forward_share=self.forward_share[take],
            llm_cost=scaled(self.llm_cost) if self.llm_cost is not None else None,
            concurrent=(),
            branched=tuple(branched) if self.branched else (),
        )

    # ------------------------------------------------------------------ derived costs
    def cost_at(self, positions: np.ndarray, columns: np.ndarray) -> np.ndarray:
        """``cost[positions, columns]`` (broadcast) through one flat take: numpy's fast gather path."""
        return np.take(self.cost.reshape(-1), positions * self.cost.shape[1] + columns)

    def sample_stage_cost(self, positions: np.ndarray, pipelines: np.ndarray) -> np.ndarray:
        """``(..., S_max)`` ticks of samples ``positions`` on the stages of ``pipelines`` (broadcast)."""
        return self.cost_at(np.asarray(positions)[..., None], self.stage_index[np.asarray(pipelines)])

    def total_cost(self) -> np.ndarray:
        """``(N,)`` ticks of each sample through the whole model (on pipeline 0's cut)."""
        return self.cost[:, self.stage_index[0, : self.num_stages[0]]].sum(axis=1)

    def stage_loads(self, pipeline: np.ndarray) -> np.ndarray:
        """``(P, S_max)`` ticks per stage of each pipeline's samples, fixed microbatch costs included."""
        own = self.sample_stage_cost(np.arange(self.num_samples), pipeline)
        loads = np.zeros((self.num_pipelines, own.shape[1]))
        for k in range(own.shape[1]):
            loads[:, k] = np.bincount(pipeline, weights=own[:, k], minlength=self.num_pipelines)
        return loads + self.num_microbatches[:, None] * self.microbatch_cost[self.stage_index]

    def proxy_times(self, loads: np.ndarray) -> np.ndarray:
        """``(P,)`` ticks: 1F1B time if each pipeline's load were split into equal microbatches.

        ``(M - 1) * max_k t_k + sum_k t_k`` with ``t_k = load_k / M``: the steady
        state runs at the slowest stage, fill and drain pass every stage once.
        """
        m = self.num_microbatches
        return ((m - 1) * loads.max(axis=1) + loads.sum(axis=1)) / m

    def microbatch_ticks(self, placement: Placement) -> np.ndarray:
        """``(P, S_max, M_max)`` ticks of every microbatch on every stage."""
        m_max = int(self.num_microbatches.max())
        own = self.sample_stage_cost(np.arange(self.num_samples), placement.pipeline)
        key = placement.pipeline * m_max + placement.microbatch
        out = np.zeros((own.shape[1], self.num_pipelines * m_max))
        for k in range(own.shape[1]):
            out[k] = np.bincount(key, weights=own[:, k], minlength=out.shape[1])
        out = out.reshape(-1, self.num_pipelines, m_max).transpose(1, 0, 2)
        exists = np.arange(m_max)[None, :] < self.num_microbatches[:, None]
        return out + self.microbatch_cost[self.stage_index][:, :, None] * exists[:, None, :]

    def predicted_times(self, placement: Placement) -> np.ndarray:
        """``(P,)`` seconds: each pipeline's exact 1F1B iteration time (``schedule_time``); a branched pipeline's
        with its branches run as the engine runs them (``planning.branch_time.simulate_microbatches``)."""
        times = self.iteration_seconds(np.arange(self.num_pipelines), self.microbatch_ticks(placement))
        for p, branched in enumerate(self.branched):
            if branched is not None:
                times[p] = self._branched_seconds(p, branched, placement)
        return times

    def _branched_seconds(self, p: int, branched, placement: Placement) -> float:
        from oobleck_mm.planning.branch_time import simulate_microbatches

        columns, branches, merge = branched
        m = int(self.num_microbatches[p])
        mine = np.flatnonzero(placement.pipeline == p)
        ticks = (
            np.stack(
                [np.bincount(placement.microbatch[mine], weights=self.cost[mine, c], minlength=m) for c in columns]
            )
            + self.microbatch_cost[list(columns)][:, None]
        )
        seconds = ticks * self.tick_s
        forward = seconds * self.forward_share[list(columns)][:, None]
        return simulate_microbatches(branches, merge, forward.tolist(), (seconds - forward).tolist())

    def iteration_seconds(self, pipes: np.ndarray, ticks: np.ndarray) -> np.ndarray:
        """``(I,)`` exact 1F1B seconds of instances of pipelines ``pipes`` with microbatch stage
        ticks ``(I, S_max, M_max)`` (fixed costs included; padding ignored)."""
        seconds = ticks * self.tick_s
        forward = seconds * self.forward_share[self.stage_index[pipes]][:, :, None]
        return iteration_times(forward, seconds - forward, self.num_stages[pipes], self.num_microbatches[pipes])

    def check(self, placement: Placement) -> None:
        """Raise unless every sample has a valid place and every microbatch holds a sample."""
        pipe, micro = placement.pipeline, placement.microbatch
        if pipe.shape != (self.num_samples,) or micro.shape != (self.num_samples,):
            raise ValueError(f"placement must give each of the {self.num_samples} samples a pipeline and microbatch")
        if ((pipe < 0) | (pipe >= self.num_pipelines)).any() or (micro < 0).any():
            raise ValueError("placement names a pipeline or microbatch that does not exist")
        if (micro >= self.num_microbatches[pipe]).any():
            raise ValueError("placement uses a microbatch beyond its pipeline's count")
        m_max = int(self.num_microbatches.max())
        used = np.zeros(self.num_pipelines * m_max, dtype=bool)
        used[pipe * m_max + micro] = True
        empty = (~used.reshape(self.num_pipelines, m_max)) & (np.arange(m_max) < self.num_microbatches[:, None])
        if empty.any():
            p, m = map(int, np.argwhere(empty)[0])
            raise ValueError(f"placement leaves microbatch {m} of pipeline {p} empty")


def check_enough_samples(num_samples: int, num_microbatches: Sequence[int]) -> None:
    """Every microbatch needs a sample: ValueError naming the numbers otherwise."""
    need = int(sum(num_microbatches))
    if num_samples < need:
        raise ValueError(
            f"global batch of {num_samples} samples cannot give each of the {need} microbatches "
            f"(per pipeline: {list(map(int, num_microbatches))}) at least one sample"
        )
