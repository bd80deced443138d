"""Turning workers' reports into progress lines and job-level events.

Workers report per rank; the console and the event log want one line per step
and one event per recovery phase of a generation (when its *last* rank is
through: that is when the phase is over for the job). Reports of an older
generation than the one being collected are ignored; the generation's
timeline is measured from the incident (failure or join) that caused it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from master.recovery import GenerationView
from oobleck_mm.events import EventLog
from oobleck_mm.planning.layout import ExecutionPlan
from oobleck_mm.protocol import oobleck_pb2 as pb

# Worker phase name -> the job-level event written when every rank reported it.
PHASE_EVENTS = {"rendezvous": "rendezvous_done", "states_copied": "states_copied", "resumed": "resumed"}


def layout_summary(plan: ExecutionPlan) -> str:
    stages = ",".join(str(len(p.stages)) for p in plan.pipelines)
    mbs = ",".join(str(p.num_microbatches) for p in plan.pipelines)
    return f"{len(plan.pipelines)} pipelines (stages {stages}; microbatches {mbs})"


@dataclass(frozen=True, slots=True)
class Incident:
    """What made the master plan a new generation, and when it was seen."""

    cause: str
    """``lost`` | ``joined`` | ``restart``."""
    nodes: tuple[str, ...]
    detected_ts: float
    """Wall clock (the event log's)."""
    detected_at: float
    """The master's clock (``Coordinator.clock``) when it was seen."""

    @classmethod
    def now(cls, cause: str, nodes, clock: Callable[[], float]) -> Incident:
        return cls(cause, tuple(nodes), time.time(), clock())

    def with_node(self, node: str) -> Incident:
        """The same incident with one more node (nodes that fail together make one incident)."""
        return Incident(self.cause, (*self.nodes, node), self.detected_ts, self.detected_at)


class Progress:
    """Per-step lines and per-generation phase events for the generation being collected."""

    def __init__(self, events: EventLog, steps: int, say: Callable[[str], None], clock: Callable[[], float]) -> None:
        self.events, self.steps, self.say, self.clock = events, steps, say, clock
        self.gen: GenerationView | None = None
        self.incident: Incident | None = None
        self._steps: dict[tuple[int, int], dict[int, pb.StepMetrics]] = {}
        self._views: dict[int, GenerationView] = {}
        self._phases: dict[str, dict[int, pb.PhaseDone]] = {}

    def start(self, gen: GenerationView, incident: Incident | None) -> None:
        # The previous generation may still finish a step (a join is applied at the next boundary),
        # and an older one's step may have committed on every rank although one of them died
        # before reporting it: its reports are kept until a generation resumes past that step.
        self.gen, self.incident = gen, incident
        self._views[gen.number] = gen
        self._phases.clear()

    def metrics(self, m: pb.StepMetrics) -> None:
        gen = self._views.get(m.generation)
        if gen is None or not 0 <= m.rank < gen.layout.world_size:
            return  # a report of a generation this master never started
        reports = self._steps.setdefault((m.generation, m.step), {})
        reports[m.rank] = m
        if len(reports) == gen.layout.world_size:
            del self._steps[(m.generation, m.step)]
            self._print_step(gen, m.step, list(reports.values()))

    def _settle_steps(self, generation: int, resumed_at: int) -> None:
        """Generation ``generation`` resumed at step ``resumed_at``: every step below it committed.

        A step of an older generation that some rank never reported (it died between the
        step's last all-reduce and its report) is logged from the reports that came, marked
        partial; older steps at or past ``resumed_at`` were abandoned and are dropped.
        """
        for key in sorted(k for k in self._steps if k[0] < generation):
            reports = self._steps.pop(key)
            if key[1] < resumed_at:
                self._print_step(self._views[key[0]], key[1], list(reports.values()), partial=True)
        self._views = {n: v for n, v in self._views.items() if n >= generation}  # older ones have no reports left

    def _print_step(self, gen: GenerationView, step: int, reports: list[pb.StepMetrics], partial: bool = False) -> None:
        first = min(reports, key=lambda r: r.rank)
        slowest = max(r.step_time_s for r in reports)
        extra = {"partial": True, "ranks_reported": len(reports)} if partial else {}
        self.events.write(
            "step", generation=gen.number, step=step, loss=first.loss, samples_per_s=first.samples_per_s,
            step_time_s=slowest, forward_s=max(r.forward_s for r in reports),
            backward_s=max(r.backward_s for r in reports), comm_s=max(r.comm_s for r in reports), **extra,
        )  # fmt: skip
        self.say(
            f"step {step + 1}/{self.steps}  loss {first.loss:.4f}  {first.samples_per_s:.1f} samples/s  "
            f"{slowest:.3f} s/step  gen {gen.number}: {layout_summary(gen.layout)}"
        )

    def phase(self, node: str, local_rank: int, rank: int | None, p: pb.PhaseDone) -> None:
        """Records one worker's phase; writes the job-level event when the generation's last rank is through."""
        if p.phase == "aborted":
            self.events.write("aborted", generation=p.generation, node=node, local_rank=local_rank, rank=rank,
                              step=p.step, message=p.message)  # fmt: skip
            return
        gen = self.gen
        if gen is None or p.generation != gen.number or rank is None or p.phase not in PHASE_EVENTS:
            return
        done = self._phases.setdefault(p.phase, {})
        done[rank] = p
        if len(done) == gen.layout.world_size:
            self._phase_done(p.phase, list(done.values()))

    def _phase_done(self, phase: str, reports: list[pb.PhaseDone]) -> None:
        assert self.gen is not None
        fields = {"generation": self.gen.number, "seconds": max(r.seconds for r in reports)}
        if self.incident is not None:
            fields.update(cause=self.incident.cause, since_detected_s=self.clock() - self.incident.detected_at)
        if phase == "states_copied":
            fields["bytes"] = sum(r.bytes for r in reports)
            fields["transfer_seconds"] = max(r.transfer_seconds for r in reports)
        if phase == "resumed":
            fields["step"] = min(r.step for r in reports)
        self.events.write(PHASE_EVENTS[phase], **fields)
        if phase == "resumed":
            self._settle_steps(self.gen.number, fields["step"])
        if phase == "resumed" and self.incident is not None:
            self.say(f"generation {self.gen.number} resumed at step {fields['step'] + 1} "
                     f"{self.clock() - self.incident.detected_at:.2f} s after the {self.incident.cause} of "
                     f"{', '.join(self.incident.nodes)}")  # fmt: skip
            self.incident = None
