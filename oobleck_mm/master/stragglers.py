"""Stragglers: a node whose stages compute slower than the cost model predicts, measured against the job.

Pure: each step's per-rank compute times in, verdicts out (plain dataclasses,
no gRPC, no torch), so the rule is tested in milliseconds and the simulator
can reuse it.

What is measured: each rank's own forward and backward seconds of the step
(``StepMetrics.forward_s + backward_s``), not its step time: a rank waiting for
a slow peer has a long step but short compute, so only the slow node itself is
flagged. What it is compared with: the cost model's seconds for the same work:
the rank's stage over the step's own samples, which each worker reports
(``runtime.balancing.ComputeExpectation``; pipelines get different samples each
step, and the plan's mean microbatch read a node slowed exactly 2x at 1.2-2.8x
step by step on emulated MLLM-10B), else the plan's stage times times the
pipeline's microbatches (``expected_compute``). The model's absolute scale is off on any real machine
(the balancer's predictions run ~2.5x below measured times here), so a node's
*ratio* (measured over predicted) is compared with the median ratio of the
other nodes of the step: ``factor`` = 1 for a node like the rest, 2 for one
taking twice as long as the model says the others do.

The model's *shape* is off as well: on this project's CPU it priced tiny_mm's
layers 0-7 1.3-1.7x cheaper, against the rest, than they ran, so the first stage
of every split pipeline read "slow" on healthy nodes (docs/benchmarks.md). So the
job learns each layer range's error (``calibration``): for every step, the ratio
of the node that ran the range (``RankCompute.work``) over the median ratio of
the step, the lower median of them when several nodes ran it (pipelines of one
template), from nodes not flagged, the last ``CALIBRATION_HISTORY`` of them per
range; a node's ratio is divided by its range's median record (bounded by
``CALIBRATION_CAP`` either way) before it is compared. The error belongs to the
range, not to the node, so it is kept across generations, and a slow node beside
a healthy one on the same range is not learned as the range's error. What
this gives up: a node slow *from the start* on a range no other node runs is
taken for a model error up to the cap, so it is found only above ``factor`` x
``CALIBRATION_CAP``; a node that turns slow later is found as before, since its
range learned its healthy speed. A range observed fewer than
``CALIBRATION_WARMUP`` times is not judged yet (the job's first steps, a range
new in a re-plan).

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
weighed for a bench again (``oobleck_mm.master.benching``).
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


CALIBRATION_HISTORY = 64
"""Observations kept per layer range to learn the cost model's error for it (their median is the correction)."""
CALIBRATION_WARMUP = 16
"""A node whose layer range has fewer records (one per step it ran) is not judged yet."""
CALIBRATION_CAP = 1.5
"""The most a range's correction may be, either way. The cost model's largest shape error measured here was
1.7x between two ranges, 1.3-1.45x against the job's median (tiny_mm on the CPU); the cap is what a node slow
from the start on a range of its own may hide behind."""


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
    """The cost model's seconds for the same work (> 0): over the step's own samples where the rank reported
    them (``runtime.balancing.ComputeExpectation``), else the plan's mean microbatch (``expected_compute``)."""
    work: tuple[int, int] | None = None
    """The layer range it ran (``[start, end)``), under which the model's error is learned; None: not
    calibrated (compared as measured)."""


@dataclass(frozen=True, slots=True)
class Verdict:
    kind: str
    """``detected`` | ``changed`` (flagged, at another factor) | ``cleared``."""
    node: str
    step: int
    factor: float
    """The node's speed factor: for ``detected``, the median of the window's factors since it slowed
    (``slowed_median``); otherwise the median over the steps that decided it (nan: it left the job)."""
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
    calibration: dict[tuple, deque] = field(default_factory=dict)
    """Per layer range (a node's ``work``), one record per step: its nodes' ratio over the step's median ratio
    (the lower median of several), newest last."""

    @property
    def flagged(self) -> dict[str, float]:
        """Flagged nodes and their latest factor."""
        return {n: self.latest.get(n, float("nan")) for n, t in self.tracks.items() if t.flagged}

    def observe(self, step: int, ranks: Sequence[RankCompute]) -> list[Verdict]:
        """One completed step: each node's factor, and the verdicts it completes."""
        if not self.rule.enabled:
            return []
        factors = self._calibrated_factors(ranks)
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
                speed = slowed_median(window, self.rule.clear_factor)
                track.flagged, track.reported, track.since_report = True, speed, 0
                out.append(
                    Verdict(
                        "detected",
                        node,
                        step,
                        speed,
                        window,
                        f"its compute took a median {median:.2f}x what the cost model predicts, relative "
                        f"to the other nodes, over the last {self.rule.steps} steps (>= {self.rule.factor:g}x); "
                        f"{speed:.2f}x since it slowed",
                    )
                )
            elif (
                track.flagged
                and median >= self.rule.clear_factor
                and max(median / track.reported, track.reported / median) >= FACTOR_CHANGE
            ):
                before, track.reported, track.since_report = track.reported, median, 0
                out.append(
                    Verdict(
                        "changed",
                        node,
                        step,
                        median,
                        window,
                        f"a median {median:.2f}x over the last {self.rule.steps} steps (was {before:.2f}x)",
                    )
                )
            elif track.flagged and median < self.rule.clear_factor:
                track.flagged, track.since_report = False, 0
                track.cycles += 1
                out.append(
                    Verdict(
                        "cleared",
                        node,
                        step,
                        median,
                        window,
                        f"a median {median:.2f}x over the last {self.rule.steps} steps (< {self.rule.clear_factor:g}x)",
                    )
                )
        return out

    def _calibrated_factors(self, ranks: Sequence[RankCompute]) -> dict[str, float]:
        """``node_factors`` with each node's ratio divided by its layer range's learned error; the ranges'
        records take this step (from nodes not flagged), and a node whose range is still warming up is not
        judged (it still serves the others as a reference, uncorrected)."""
        ratios, works = node_ratios(ranks)
        if len(ratios) < 2:
            return {}
        median = statistics.median(ratios.values())
        by_work: dict[tuple, list[float]] = {}
        for node, ratio in ratios.items():
            track = self.tracks.get(node)
            if works[node] is not None and median > 0 and not (track is not None and track.flagged):
                by_work.setdefault(works[node], []).append(ratio / median)
        for work, seen in by_work.items():
            # One record per range and step: of several nodes running it, the lower median, so that one slow
            # node beside a healthy one is not learned as the range's error (it is only ever slower).
            self.calibration.setdefault(work, deque(maxlen=CALIBRATION_HISTORY)).append(statistics.median_low(seen))
        corrections: dict[str, float] = {}
        judged = set()
        for node, work in works.items():
            seen = self.calibration.get(work, ()) if work is not None else None
            if seen is None:
                judged.add(node)
            elif len(seen) >= CALIBRATION_WARMUP:
                corrections[node] = min(max(statistics.median(seen), 1 / CALIBRATION_CAP), CALIBRATION_CAP)
                judged.add(node)
        adjusted = {node: ratio / corrections.get(node, 1.0) for node, ratio in ratios.items()}
        return {node: f for node, f in relative_factors(adjusted).items() if node in judged}

    def keep_only(self, nodes: Sequence[str], step: int) -> list[Verdict]:
        """The job now runs on ``nodes``: every other node is forgotten (cleared if it was flagged)."""
        out = []
        for node in [n for n in self.tracks if n not in set(nodes)]:
            if self.tracks.pop(node).flagged:
                out.append(Verdict("cleared", node, step, float("nan"), (), "no longer in the plan"))
            self.latest.pop(node, None)
        return out


def slowed_median(window: Sequence[float], floor: float) -> float:
    """The median of the window's newest factors that are all at least ``floor`` (the clear threshold): the
    node's speed since it slowed. The window that first crosses the threshold still holds the steps before
    the slowdown (a node slowed 2x for good from a step is flagged with four of eight steps slowed: a window
    median of 1.5), and the split sized for 1.5x gives it a third too much work; the "changed" verdict that
    would correct it waits a whole window. The median of the window if its newest factor is below ``floor``."""
    since = []
    for factor in reversed(window):
        if factor < floor:
            break
        since.append(factor)
    return statistics.median(since) if since else statistics.median(window)


def node_factors(ranks: Sequence[RankCompute]) -> dict[str, float]:
    """Per node, its measured-over-predicted compute divided by the median of the other nodes' (at least two
    nodes; a node's ranks are summed, so a node of several GPUs counts once). Uncalibrated: see
    ``StragglerDetector`` for the factors the rule reads."""
    return relative_factors(node_ratios(ranks)[0])


def node_ratios(ranks: Sequence[RankCompute]) -> tuple[dict[str, float], dict[str, tuple | None]]:
    """Per node, measured over predicted compute (its ranks summed), and the work it is learned under: its
    rank's layer range, the ranges of a node of several GPUs together, None if any rank has none."""
    measured: dict[str, float] = {}
    expected: dict[str, float] = {}
    works: dict[str, set] = {}
    for r in ranks:
        if r.expected_s > 0:
            measured[r.node] = measured.get(r.node, 0.0) + r.measured_s
            expected[r.node] = expected.get(r.node, 0.0) + r.expected_s
            works.setdefault(r.node, set()).add(r.work)
    keys = {n: None if None in w else tuple(sorted(w)) if len(w) > 1 else next(iter(w)) for n, w in works.items()}
    return {n: measured[n] / expected[n] for n in measured}, keys


def relative_factors(ratios: Mapping[str, float]) -> dict[str, float]:
    """Each node's ratio over the median of the other nodes' (none for fewer than two nodes)."""
    if len(ratios) < 2:
        return {}  # nobody to compare with
    out = {}
    for node, ratio in ratios.items():
        others = statistics.median(r for n, r in ratios.items() if n != node)
        out[node] = ratio / others if others > 0 else float("inf") if ratio > 0 else 1.0
    return out


def stage_ranges(layout: ExecutionPlan) -> dict[int, tuple[int, int]]:
    """Per rank, the layer range its stage runs (every GPU of a sharded stage the same): its ``work``."""
    out = {}
    for pipeline in layout.pipelines:
        for stage in pipeline.stages:
            for rank in (stage.rank, *stage.shards):
                out[rank] = (stage.layer_start, stage.layer_end)
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
