"""Pipeline templates: a fixed stage mapping for a given number of nodes.

A template says, for ``num_nodes`` nodes of ``gpus_per_node`` GPUs each, how
the model's layers are cut into stages and which node-local GPUs run each
stage. Templates are computed once per job (``stage_mapping.build_templates``)
and never change; pipelines are instantiated from them on concrete nodes.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from oobleck_mm.planning import branch_time
from oobleck_mm.planning.pipeline_time import iteration_times


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
    recompute: bool = False
    """The stage keeps only each layer's inputs from the forward and recomputes the rest in the backward
    (activation checkpointing); ``backward_s`` and ``memory_bytes`` already count it."""
    context_parallel: bool = False
    """Its GPUs split every microbatch's tokens (``cluster.context_parallel``) instead of sharding its layers."""

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
    branches: tuple[int, ...] = ()
    """Encoder branches (``planning.branches``; ``planning.layout.PipelineLayout.branches``): the stage where
    each branch starts; ``merge`` is the LLM's first stage. Empty: a chain. In a branched template boundary k
    is stage k's outgoing transfer (to the next stage of its branch, or to ``merge`` from a branch's last)."""
    merge: int = 0

    def __post_init__(self) -> None:
        assert len(self.send_activation_s) == len(self.stages) - 1
        assert len(self.send_grad_s) == len(self.stages) - 1

    @property
    def branched(self) -> bool:
        return bool(self.branches)

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def num_layers(self) -> int:
        return self.stages[-1].layer_end

    def iteration_time(self, num_microbatches: int) -> float:
        """Exact 1F1B iteration seconds (DeepSpeed ``TrainSchedule``) for ``num_microbatches``.

        Read from the template's ``TimeTable``: one source for every planning
        decision and report.
        """
        return time_table(self)(num_microbatches)

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
            mark = "|| " if i and i in self.branches else "=> " if self.branched and i == self.merge else ""
            parts.append(f"{mark}s{i}[L{s.layer_start}-{s.layer_end - 1} n{s.node} g{','.join(map(str, s.gpus))}]")
        return " ".join(parts)


class TimeTable:
    """``T(q)`` of one template for ``q = 1, 2, ...``, computed in chunks on demand.

    ``pipeline_time.iteration_times`` gives ``T(1..M)`` for about the cost of
    ``T(M)`` alone (less once the steady state's period shows), and the table
    is extended only as far as a search needs: ``capacity`` first extends it to
    a cheap upper bound on the answer (``_capacity_bound``), then doubles if
    needed. Every planning decision and report reads ``T(q)`` from here.
    """

    __slots__ = ("template", "_first", "_values", "_short", "_offsets", "_per_microbatch", "_branched")

    def __init__(self, template: PipelineTemplate):
        self.template = template
        # Runs of q < S microbatches each need their own drain (O(S^3) for all of them), and a
        # search on a deep template often never asks for them: they are computed apart, when asked.
        self._first = template.num_stages
        self._values: list[float] = []  # T(first), T(first + 1), ...
        self._short: list[float] = []  # T(1) .. T(first - 1)
        self._branched: dict[int, float] = {}  # a branched template's T(q), as asked
        # Stage k cannot start before microbatch 0 went forward through stages < k
        # and cannot finish before the last backward came back through them, and
        # it runs all q forwards and backwards itself, one at a time:
        #     T(q) >= max_k sum_{i<k} (F_i + B_i) + q (F_k + B_k).
        busy = [s.forward_s + s.backward_s for s in template.stages]
        self._offsets = _path_offsets(template, busy)
        self._per_microbatch = busy

    def __call__(self, q: int) -> float:
        assert q >= 1, q
        if self.template.branched:  # executed instruction by instruction (planning.branches), memoised
            if q not in self._branched:
                self._branched[q] = branch_time.iteration_time(self.template, q)
            return self._branched[q]
        if q < self._first:
            if not self._short:
                self._short = iteration_times(*self._latencies(), self._first - 1)
            return self._short[q - 1]
        index = q - self._first
        if index >= len(self._values):
            self._values = iteration_times(*self._latencies(), max(q, self._first + 2 * len(self._values)), self._first)
        return self._values[index]

    def _latencies(self) -> tuple:
        t = self.template
        return [s.forward_s for s in t.stages], [s.backward_s for s in t.stages], t.send_activation_s, t.send_grad_s

    def _capacity_bound(self, time_s: float) -> float:
        """An upper bound on ``capacity(time_s)`` from the lower bound on ``T(q)`` above."""
        bound = float("inf")
        for offset, busy in zip(self._offsets, self._per_microbatch):
            if busy > 0:
                bound = min(bound, (time_s - offset) / busy)
        return bound

    def capacity(self, time_s: float, limit: int, known: int = 0, strict: bool = False) -> int:
        """Largest ``q`` in ``[known, limit]`` with ``T(q) <= time_s`` (``<`` if ``strict``).

        ``known`` is a ``q`` already known to qualify (0: none).
        """

        def fits(q: int) -> bool:
            return self(q) < time_s if strict else self(q) <= time_s

        # Compute the table up to the bound (+1: it may round down) and bisect
        # below it; gallop beyond it only if the bound was not one after all.
        lo = known
        hi = max(lo, min(limit, int(min(self._capacity_bound(time_s), limit)) + 1))
        if hi == lo or fits(hi):
            lo, step = hi, 1
            while lo + step <= limit and fits(lo + step):
                lo += step
                step *= 2
            hi = min(limit, lo + step - 1)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if fits(mid):
                lo = mid
            else:
                hi = mid - 1
        return lo


def _path_offsets(template: PipelineTemplate, busy: list[float]) -> list[float]:
    """Per stage, the work of the stages before it on its path (every earlier stage of a chain; a branch's
    earlier stages; for the LLM's, the longest branch and the LLM's earlier stages): no microbatch reaches the
    stage before them, nor leaves before its gradient came back through them."""
    if not template.branched:
        return [sum(busy[:k]) for k in range(len(busy))]
    ends = (*template.branches[1:], template.merge)
    offsets = [0.0] * len(busy)
    for start, end in zip(template.branches, ends):
        for k in range(start, end):
            offsets[k] = sum(busy[start:k])
    longest = max(sum(busy[start:end]) for start, end in zip(template.branches, ends))
    for k in range(template.merge, len(busy)):
        offsets[k] = longest + sum(busy[template.merge : k])
    return offsets


@lru_cache(maxsize=4096)
def time_table(template: PipelineTemplate) -> TimeTable:
    """The shared, growing ``T(q)`` table of ``template`` (memoised: templates never change)."""
    return TimeTable(template)


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
