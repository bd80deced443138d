"""Stragglers: a node whose stages compute slower than the cost model predicts, measured against the job.

Pure: each step's per-rank compute times in, verdicts out (plain dataclasses,
no gRPC, no torch), so the rule is tested in milliseconds and the simulator
can reuse it.

What is measured: each rank's own forward and backward seconds of the step
(``StepMetrics.forward_s + backward_s``), not its step time: a rank waiting for
a slow peer has a long step but short compute, so only the slow node itself is
flagged. What it is compared with: the cost model's seconds for the same work
(the plan's stage times times the pipeline's microbatches,
``expected_compute``). The model's absolute scale is off on any real machine
(the balancer's predictions run ~2.5x below measured times here), so a node's
*ratio* (measured over predicted) is compared with the median ratio of the
other nodes of the step: ``factor`` = 1 for a node like the rest, 2 for one
taking twice as long as the model says the others do.

The rule, with hysteresis so a verdict never flaps: a node is flagged once the
median of its factors over the last ``straggler_steps`` steps is at least
``straggler_factor``, and cleared once that median is below
``straggler_clear_factor``; and a verdict on a node is never reversed before a
whole window of steps observed after it (``dwell``), doubled for each time the
node was already found and cleared (up to ``MAX_DWELL_DOUBLINGS``). Two
thresholds alone let a node on shared cores flap: five workers on two cores
read 0.4-2.6 step by step, and a job of 150 steps saw the same node found and
cleared four steps apart, six times, each verdict a new generation. A median, not every step: one slow step is noise (a
page fault, a neighbour's burst) and moves it little, while on shared cores a
node slowed three times reads 1.3-2.9 step by step (measured), so "every step
above the threshold" missed it. A node that leaves the job is forgotten
(cleared, with that reason, if it was flagged). While flagged, a median that
moved by ``FACTOR_CHANGE`` from the factor last reported, a full window after
that report, is reported again (``changed``): the batch split follows the
speed the node has now, and a node found slow at 1.6x that then runs at 5x is
weighed for a bench again (``master.benching``).
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from oobleck_mm.planning.layout import ExecutionPlan

MAX_DWELL_DOUBLINGS = 3
"""A node found and cleared k times waits ``straggler_steps * 2**k`` steps between two verdicts, k at most this
(8 windows): a node whose speed swings with its neighbours' load is acted on less and less often."""
FACTOR_CHANGE = 1.25
"""A flagged node's factor is reported again once its median moved this many times (up or down) from the
last one reported: the split follows a real change of speed, not the noise of a median over a few steps."""


@dataclass(frozen=True, slots=True)
class StragglerRule:
    """``fault_tolerance.straggler_*``."""

    factor: float = 1.5
    """Flag at this many times the others' median; 0: detection off."""
    clear_factor: float = 1.2
    steps: int = 8

    @classmethod
    def of(cls, fault_tolerance) -> StragglerRule:
        ft = fault_tolerance
        return cls(ft.straggler_factor, ft.straggler_clear_factor, ft.straggler_steps)

    @property
    def enabled(self) -> bool:
        return self.factor > 0


@dataclass(frozen=True, slots=True)
class RankCompute:
    """One rank's compute in one step."""

    node: str
    measured_s: float
    """Its forward and backward seconds, as its own timers measured them."""
    expected_s: float
    """The cost model's seconds for the same work (> 0)."""


@dataclass(frozen=True, slots=True)
class Verdict:
    kind: str
    """``detected`` | ``changed`` (flagged, at another factor) | ``cleared``."""
    node: str
    step: int
    factor: float
    """The median of the node's factors over the steps that decided it (nan: it left the job)."""
    evidence: tuple[float, ...]
    """Those factors, oldest first."""
    reason: str


@dataclass(slots=True)
class _Track:
    factors: deque
    flagged: bool = False
    reported: float = 0.0
    """The factor of the last verdict that flagged it."""
    since_report: int = 0
    """Steps observed since the last verdict on the node (any kind)."""
    cycles: int = 0
    """How many times it was found and then cleared."""

    def dwell(self, steps: int) -> int:
        """Steps a verdict on this node must stand before the next one."""
        return steps * 2 ** min(self.cycles, MAX_DWELL_DOUBLINGS)


@dataclass(slots=True)
class StragglerDetector:
    """The detection state of one job: per node, its latest factors and whether it is flagged."""

    rule: StragglerRule
    tracks: dict[str, _Track] = field(default_factory=dict)
    latest: dict[str, float] = field(default_factory=dict)
    """Each node's factor in the latest step observed."""

    @property
    def flagged(self) -> dict[str, float]:
        """Flagged nodes and their latest factor."""
        return {n: self.latest.get(n, float("nan")) for n, t in self.tracks.items() if t.flagged}

    def observe(self, step: int, ranks: Sequence[RankCompute]) -> list[Verdict]:
        """One completed step: each node's factor, and the verdicts it completes."""
        if not self.rule.enabled:
            return []
        factors = node_factors(ranks)
        self.latest = factors
        out = []
        for node, factor in factors.items():
            track = self.tracks.setdefault(node, _Track(deque(maxlen=self.rule.steps)))
            track.factors.append(factor)
            if len(track.factors) < self.rule.steps:
                continue
            track.since_report += 1
            window = tuple(track.factors)
            median = statistics.median(window)
            if track.since_report < track.dwell(self.rule.steps) and (track.flagged or track.cycles):
                continue  # the last verdict stands a while: see the module docstring
            if not track.flagged and median >= self.rule.factor:
                track.flagged, track.reported, track.since_report = True, median, 0
                out.append(Verdict("detected", node, step, median, window,
                                   f"its compute took a median {median:.2f}x what the cost model predicts, relative "
                                   f"to the other nodes, over the last {self.rule.steps} steps (>= {self.rule.factor:g}x)"))
            elif (track.flagged and median >= self.rule.clear_factor
                  and max(median / track.reported, track.reported / median) >= FACTOR_CHANGE):
                before, track.reported, track.since_report = track.reported, median, 0
                out.append(Verdict("changed", node, step, median, window,
                                   f"a median {median:.2f}x over the last {self.rule.steps} steps (was {before:.2f}x)"))
            elif track.flagged and median < self.rule.clear_factor:
                track.flagged, track.since_report = False, 0
                track.cycles += 1
                out.append(Verdict("cleared", node, step, median, window,
                                   f"a median {median:.2f}x over the last {self.rule.steps} steps "
                                   f"(< {self.rule.clear_factor:g}x)"))  # fmt: skip
        return out

    def keep_only(self, nodes: Sequence[str], step: int) -> list[Verdict]:
        """The job now runs on ``nodes``: every other node is forgotten (cleared if it was flagged)."""
        out = []
        for node in [n for n in self.tracks if n not in set(nodes)]:
            if self.tracks.pop(node).flagged:
                out.append(Verdict("cleared", node, step, float("nan"), (), "no longer in the plan"))
            self.latest.pop(node, None)
        return out


def node_factors(ranks: Sequence[RankCompute]) -> dict[str, float]:
    """Per node, its measured-over-predicted compute divided by the median of the other nodes' (at least two
    nodes; a node's ranks are summed, so a node of several GPUs counts once)."""
    measured: dict[str, float] = {}
    expected: dict[str, float] = {}
    for r in ranks:
        if r.expected_s > 0:
            measured[r.node] = measured.get(r.node, 0.0) + r.measured_s
            expected[r.node] = expected.get(r.node, 0.0) + r.expected_s
    ratios = {n: measured[n] / expected[n] for n in measured}
    if len(ratios) < 2:
        return {}  # nobody to compare with
    out = {}
    for node, ratio in ratios.items():
        others = statistics.median(r for n, r in ratios.items() if n != node)
        out[node] = ratio / others if others > 0 else float("inf") if ratio > 0 else 1.0
    return out


def expected_compute(plan, layout: ExecutionPlan) -> dict[int, float]:
    """Per rank, the cost model's forward and backward seconds of one step: its stage's per-microbatch times
    (the planning ``Plan``'s templates) times its pipeline's microbatches. Without a plan (a generation a
    restarted master read from its journal), each layer counts the same."""
    out: dict[int, float] = {}
    planned = getattr(plan, "pipelines", None)
    if planned is not None and len(planned) != len(layout.pipelines):
        planned = None  # not this layout's plan: no event order should lead here, and layers still count
    for i, pipeline in enumerate(layout.pipelines):
        specs = planned[i].template.stages if planned is not None else None
        for j, stage in enumerate(pipeline.stages):
            if specs is not None and j < len(specs):
                per_microbatch = specs[j].forward_s + specs[j].backward_s
            else:
                per_microbatch = float(stage.layer_end - stage.layer_start)
            out[stage.rank] = per_microbatch * pipeline.num_microbatches
    return out
