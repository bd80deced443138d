"""Turning workers' reports into progress lines and job-level events.

Workers report per rank; the console and the event log want one line per step
and one event per recovery phase of a generation (when its *last* rank is
through: that is when the phase is over for the job). Reports of an older
generation than the one being collected are ignored; the generation's
timeline is measured from the incident (failure or join) that caused it.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from oobleck_mm.master.recovery import GenerationView
from oobleck_mm.master.stragglers import RankCompute, stage_ranges
from oobleck_mm.events import EventLog
from oobleck_mm.planning.layout import ExecutionPlan
from oobleck_mm.protocol import oobleck_pb2 as pb

# Worker phase name -> the job-level event written when every rank reported it.
CAUSE_WORDS = {
    "lost": "loss",
    "joined": "join",
    "abandoned": "abandoned iteration",
    "left": "notice to leave",
    "straggler": "change of speed",
    "checkpoint": "newer checkpoint",
}
"""An incident's cause as a noun, for the console."""
PHASE_EVENTS = {"rendezvous": "rendezvous_done", "states_copied": "states_copied", "resumed": "resumed"}


def layout_summary(plan: ExecutionPlan) -> str:
    stages = ",".join(str(len(p.stages)) for p in plan.pipelines)
    mbs = ",".join(str(p.num_microbatches) for p in plan.pipelines)
    return f"{len(plan.pipelines)} pipelines (stages {stages}; microbatches {mbs})"


@dataclass(frozen=True, slots=True)
class Incident:
    """What made the master plan a new generation, and when it was seen."""

    cause: str
    """``lost`` | ``joined`` | ``left`` (a preemption notice) | ``restart`` | ``abandoned`` (an iteration
    given up with no node lost) | ``checkpoint`` (restart mode: a newer checkpoint than the one being loaded)."""
    nodes: tuple[str, ...]
    detected_at: float
    """The master's clock (``Coordinator.clock``) when it was seen."""

    def with_node(self, node: str) -> Incident:
        """The same incident with one more node (nodes that fail together make one incident)."""
        return Incident(self.cause, (*self.nodes, node), self.detected_at)


@dataclass(frozen=True, slots=True)
class StepFacts:
    """What turning ranks' reports into a step's row needs to know about the job."""

    global_batch: int
    flops_per_sample: float = 0.0
    """Model FLOPs of one sample's forward and backward (``profiling.analytical``): MFU's numerator."""
    peak_flops: float = 0.0
    """One accelerator's peak FLOP/s: MFU's denominator, times the generation's GPUs."""
    balancer: bool = False
    log_every: int = 1
    """Console lines every N steps (and the first, the last, and the first of each generation)."""
    eta_window: int = 20
    """Steps the ETA's recent pace is averaged over (the current layout's speed, not the run's)."""

    @classmethod
    def of(cls, job, log_every: int = 1) -> StepFacts:
        from oobleck_mm.profiling.analytical import model_flops_per_sample, peak_flops

        return cls(
            job.training.global_batch,
            model_flops_per_sample(job),
            peak_flops(job),
            job.balance.enabled,
            log_every,
        )


def step_row(gen: GenerationView, step: int, reports: list[pb.StepMetrics], facts: StepFacts) -> dict:
    """One step's metrics from its ranks' reports: the ``step`` event's fields, ``metrics.csv``'s row.

    The step lasts as long as its slowest rank; a pipeline's 1F1B time is its slowest stage's.
    """
    first = min(reports, key=lambda r: r.rank)
    step_time = max(r.step_time_s for r in reports)
    gpus = gen.layout.world_size
    by_pipeline: dict[int, float] = {}
    pipeline_of = {s.rank: i for i, p in enumerate(gen.layout.pipelines) for s in p.stages}
    for r in reports:
        i = pipeline_of.get(r.rank)
        if i is not None:
            by_pipeline[i] = max(by_pipeline.get(i, 0.0), r.pipeline_s)
    measured = list(by_pipeline.values())
    samples_per_s = facts.global_batch / step_time if step_time > 0 else 0.0
    peak_total = facts.peak_flops * gpus
    row = {
        "generation": gen.number,
        "step": step,
        "loss": first.loss,
        "lr": first.lr,
        "grad_norm": first.grad_norm,
        "samples_per_s": samples_per_s,
        "tokens_per_s": first.tokens / step_time if step_time > 0 else 0.0,
        "step_time_s": step_time,
        "forward_s": max(r.forward_s for r in reports),
        "backward_s": max(r.backward_s for r in reports),
        "comm_s": max(r.comm_s for r in reports),
        "live_nodes": len(gen.nodes),
        "gpus": gpus,
        "pipelines": len(gen.layout.pipelines),
        "mfu": facts.flops_per_sample * samples_per_s / peak_total if peak_total > 0 else None,
        "peak_memory_mb": max(r.peak_memory_bytes for r in reports) / 2**20,
        "balancer": facts.balancer,
        "measured_max_s": max(measured) if measured else None,
        "measured_mean_s": sum(measured) / len(measured) if measured else None,
        "skipped": first.skipped,
        "loss_scale": first.loss_scale or None,
        "finished_at": max(r.finished_at for r in reports) or None,
    }
    if any(r.emulated_s > 0 for r in reports):  # an emulated device: did the host keep its deadlines?
        row.update(
            emulated_ops=sum(r.emulated_ops for r in reports),
            emulated_late_ops=sum(r.emulated_late_ops for r in reports),
            emulated_worst_lateness=max(r.emulated_worst_lateness for r in reports),
            emulated_late_s=sum(r.emulated_late_s for r in reports),
            emulated_host_cpu_s=sum(r.host_cpu_s for r in reports),
            emulated_busiest_rank_cpu_s=max(r.host_cpu_s for r in reports),
            # Which ranks' ops were late (the event log only: a dict is no metrics.csv column)
            emulated_late_ranks={str(r.rank): r.emulated_late_ops for r in reports if r.emulated_late_ops},
        )
    if facts.balancer:
        row.update(
            predicted_max_s=first.predicted_max_s,
            predicted_mean_s=first.predicted_mean_s,
            predicted_contiguous_max_s=first.predicted_contiguous_max_s or None,
            deferred=first.deferred,
        )
        if first.predicted_max_s > 0 and measured:
            # The cost model is fitted to measured compute, so this is what it misses: transfers, waits, and
            # its own error; a user reads it as "how far to trust predicted_*".
            row["prediction_error"] = max(measured) / first.predicted_max_s - 1
    return row


def format_step(row: dict, steps: int, elapsed_s: float, eta_s: float | None) -> str:
    """The console's line for a step: compact, no layout (printed when it changes)."""
    norm = "overflow" if row["skipped"] else f"{row['grad_norm']:.3g}"
    mfu = f"  mfu {100 * row['mfu']:.1f}%" if row.get("mfu") is not None else ""
    eta = f", eta {format_duration(eta_s)}" if eta_s is not None else ""
    return (
        f"step {row['step'] + 1}/{steps}  loss {row['loss']:.4f}  lr {row['lr']:.2e}  gnorm {norm}  "
        f"{row['samples_per_s']:.1f} samples/s  {_si(row['tokens_per_s'])} tok/s  {row['step_time_s']:.3f} s/step"
        f"{mfu}  [{format_duration(elapsed_s)}{eta}]"
    )


def format_duration(seconds: float) -> str:
    """``h:mm:ss`` (``m:ss`` under an hour)."""
    total = max(0, round(seconds))
    h, rest = divmod(total, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def _si(value: float) -> str:
    for unit, scale in (("M", 1e6), ("k", 1e3)):
        if value >= scale:
            return f"{value / scale:.1f}{unit}"
    return f"{value:.0f}"


class Progress:
    """Per-step lines and per-generation phase events for the generation being collected."""

    def __init__(
        self,
        events: EventLog,
        steps: int,
        say: Callable[[str], None],
        clock: Callable[[], float],
        facts: StepFacts,
        judged: bool = False,
    ) -> None:
        """``judged``: a completed step is logged once the master's machine judged it (``take_completed``,
        ``log_step``: its row holds the straggler columns); without a machine (tests), at once."""
        self.events, self.steps, self.say, self.clock = events, steps, say, clock
        self.facts = facts
        self.started = clock()
        self.gen: GenerationView | None = None
        self._steps: dict[tuple[int, int], dict[int, pb.StepMetrics]] = {}
        self._views: dict[int, GenerationView] = {}
        self._phases: dict[tuple[int, str], dict[int, tuple[pb.PhaseDone, float, str]]] = {}
        """(generation, phase) -> rank -> (report, clock, node), until every rank of the generation reported it."""
        self._incidents: dict[int, Incident | None] = {}
        """Per generation in flight, the incident it answers (its recovery phases are timed from it)."""
        self._recent: list[tuple[int, float]] = []
        """(step, clock) of the latest steps logged: the ETA's pace."""
        self._printed_generation = 0
        self._gen_started = self.started
        self.judged = judged
        self._expected: dict[int, dict[int, float]] = {}
        """Per generation, each rank's predicted compute seconds of a step (``StartProgress.expected``)."""
        self.completed: list[tuple[int, int, tuple[RankCompute, ...]]] = []
        """Steps every rank reported, not yet judged by the machine (``take_completed``)."""
        self._judging: dict[tuple[int, int], tuple[GenerationView, list[pb.StepMetrics]]] = {}
        """(generation, step) -> its reports, until the machine's judgement logs it (``log_step``)."""
        self._flagged: int | None = None
        """Nodes flagged slow at the latest judged step (a partial step's row says the same)."""
        self._logged: dict[int, int] = {}
        """Per generation, the last step logged. A generation's steps are logged in order (a step
        needs every rank's report, and each agent reports in order), so a report at or below it is
        one seen twice: an RPC whose answer was lost while this master was paused, which the
        agent then sent again."""

    def seed_logged(self, logged: Mapping[int, int]) -> None:
        """Steps a lost master logged (``logged_steps``, from the event log this master appends to): its
        workers' replayed reports of them are dropped as seen twice, and one it never logged is logged."""
        for generation, step in logged.items():
            self._logged[generation] = max(step, self._logged.get(generation, -1))

    def start(self, gen: GenerationView, incident: Incident | None, expected: dict[int, float] | None = None) -> None:
        # The previous generation may still finish a step (a join is applied at the next boundary),
        # and an older one's step may have committed on every rank although one of them died
        # before reporting it: its reports are kept until a generation resumes past that step.
        self.gen = gen
        self._gen_started = self.clock()
        self._views[gen.number] = gen
        self._expected[gen.number] = dict(expected or {})
        # A generation planned before this one may still switch and resume (a join the workers took while
        # this one was planned from the generation before it): its phases are still logged, with its incident.
        self._incidents = {n: i for n, i in self._incidents.items() if n >= gen.number - PHASES_KEPT_FOR}
        self._incidents[gen.number] = incident
        self._phases = {k: v for k, v in self._phases.items() if k[0] >= gen.number - PHASES_KEPT_FOR}

    def metrics(self, m: pb.StepMetrics) -> None:
        gen = self._views.get(m.generation)
        if gen is None or not 0 <= m.rank < gen.layout.world_size:
            return  # a report of a generation this master never started
        if m.step <= self._logged.get(m.generation, -1):
            return  # that step is logged already: a report delivered twice
        reports = self._steps.setdefault((m.generation, m.step), {})
        reports[m.rank] = m
        if len(reports) == gen.layout.world_size:
            del self._steps[(m.generation, m.step)]
            if not self.judged:
                self._print_step(gen, m.step, list(reports.values()))
                return
            self._logged[gen.number] = max(m.step, self._logged.get(gen.number, -1))  # (a report seen twice)
            self._judging[(gen.number, m.step)] = (gen, list(reports.values()))
            self.completed.append((gen.number, m.step, self._ranks(gen, list(reports.values()))))

    def take_completed(self) -> list[tuple[int, int, tuple[RankCompute, ...]]]:
        """The steps completed since the last call (the shell feeds them to the machine as ``StepCompleted``)."""
        out, self.completed = self.completed, []
        return out

    def log_step(self, generation: int, step: int, flagged: int | None, latest: Mapping[str, float]) -> None:
        """The machine judged the step (``LogStep``): its row, with the straggler columns."""
        judging = self._judging.pop((generation, step), None)
        if judging is None:
            return
        self._flagged = flagged
        self._print_step(judging[0], step, judging[1], latest=latest)

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
        self._expected = {n: e for n, e in self._expected.items() if n >= generation}
        self._logged = {n: step for n, step in self._logged.items() if n >= generation}

    def _print_step(
        self,
        gen: GenerationView,
        step: int,
        reports: list[pb.StepMetrics],
        partial: bool = False,
        latest: Mapping[str, float] | None = None,
    ) -> None:
        row = step_row(gen, step, reports, self.facts)
        self._logged[gen.number] = max(step, self._logged.get(gen.number, -1))
        now = self.clock()
        elapsed = now - self.started
        row["elapsed_s"] = elapsed
        row["wall_time"] = time.time()
        row["stragglers"] = self._flagged
        latest = latest or {}
        slowest = max(latest, key=latest.__getitem__, default=None)
        row["slowest_node"], row["slowest_node_factor"] = slowest, latest.get(slowest) if slowest else None
        extra = {"partial": True, "ranks_reported": len(reports)} if partial else {}
        self.events.write("step", **row, **extra)
        self._recent = [*self._recent[-(self.facts.eta_window - 1) :], (step, now)] if self.facts.eta_window > 1 else []
        eta = None
        if len(self._recent) >= 2 and self._recent[-1][0] > self._recent[0][0]:
            pace = (self._recent[-1][1] - self._recent[0][1]) / (self._recent[-1][0] - self._recent[0][0])
            eta = pace * max(0, self.steps - 1 - step)
        every = max(1, self.facts.log_every)
        if (step + 1) % every == 0 or step == 0 or step == self.steps - 1 or gen.number != self._printed_generation:
            self._printed_generation = gen.number
            self.say(format_step(row, self.steps, elapsed, eta))

    def _ranks(self, gen: GenerationView, reports: list[pb.StepMetrics]) -> tuple[RankCompute, ...]:
        """Each rank's compute against its prediction, under its stage's layer range (what the machine judges)."""
        expected = self._expected.get(gen.number, {})
        nodes, works = gen.rank_nodes, stage_ranges(gen.layout)
        # Each rank's own samples' cost where it reported it (``StepMetrics.expected_compute_s``), else its plan's
        # mean microbatch's (a worker of an older build, a report replayed from before).
        return tuple(
            RankCompute(
                nodes[r.rank],
                r.forward_s + r.backward_s,
                r.expected_compute_s or expected.get(r.rank, 0.0),
                works.get(r.rank),
            )
            for r in reports
            if 0 <= r.rank < len(nodes)
        )

    def phase(self, node: str, local_rank: int, rank: int | None, p: pb.PhaseDone) -> None:
        """Records one worker's phase; writes the job-level event when the generation's last rank is through."""
        if p.phase == "aborted":
            self.events.write(
                "aborted",
                generation=p.generation,
                node=node,
                local_rank=local_rank,
                rank=rank,
                step=p.step,
                message=p.message,
                leave_s=round(p.seconds, 4),
            )
            return
        if p.phase == "settled":  # this rank applied a step its peers completed while it gave up inside it
            self.events.write(
                "step_settled", generation=p.generation, node=node, local_rank=local_rank, rank=rank, step=p.step
            )
            return
        gen = self._views.get(p.generation)
        if gen is None or p.generation not in self._incidents or rank is None or p.phase not in PHASE_EVENTS:
            return
        done = self._phases.setdefault((gen.number, p.phase), {})
        done[rank] = (p, self.clock(), node)
        if len(done) == gen.layout.world_size:
            del self._phases[(gen.number, p.phase)]
            self._phase_done(gen, p.phase, list(done.values()))

    def _phase_done(self, gen: GenerationView, phase: str, arrivals: list[tuple[pb.PhaseDone, float, str]]) -> None:
        reports = [r for r, _, _ in arrivals]
        first, (_, last_at, last_node) = min(t for _, t, _ in arrivals), max(arrivals, key=lambda a: a[1])
        # Which node was the generation waiting for: the last to report, and how long after the first.
        fields = {
            "generation": gen.number,
            "seconds": max(r.seconds for r in reports),
            "last": last_node,
            "spread_s": round(last_at - first, 4),
        }
        incident = self._incidents.get(gen.number)
        if incident is not None:
            fields.update(cause=incident.cause, since_detected_s=self.clock() - incident.detected_at)
        if phase == "rendezvous":
            fields["formed_ahead"] = sum(r.formed_ahead for r in reports)  # ranks whose groups were ready before
        if phase == "states_copied":
            fields["bytes"] = sum(r.bytes for r in reports)
            fields["transfer_seconds"] = max(r.transfer_seconds for r in reports)
        if phase == "resumed":
            fields["step"] = min(r.step for r in reports)
        self.events.write(PHASE_EVENTS[phase], **fields)
        if phase == "rendezvous" and gen.number == 1:
            self.say(
                f"all {gen.layout.world_size} workers ready {self.clock() - self._gen_started:.1f} s "
                "after their assignments; training"
            )
        if phase == "resumed":
            self._settle_steps(gen.number, fields["step"])
        if phase == "resumed" and incident is not None:
            self.say(
                f"generation {gen.number} resumed at step {fields['step'] + 1} "
                f"{self.clock() - incident.detected_at:.2f} s after the "
                f"{CAUSE_WORDS.get(incident.cause, incident.cause)} of {', '.join(incident.nodes)}"
            )
            self._incidents[gen.number] = None


PHASES_KEPT_FOR = 2
"""Generations before the newest whose recovery phases are still logged: under churn the master plans
a generation before the workers switched to the one planned before it, and they may still take that one
(``_phase_done``); older ones have been overtaken twice."""

LOGGED_TAIL_BYTES = 1 << 20
"""How much of the event log's end a restarted master reads for the steps the lost one logged: its last
steps are there (a step line is ~700 bytes), and a log of weeks of steps is not read whole."""


def logged_steps(path: str | None, tail_bytes: int = LOGGED_TAIL_BYTES) -> dict[int, int]:
    """Per generation, the last step the event log at ``path`` holds, from its last ``tail_bytes``.

    A restarted master needs it because the lost one's last step may not be logged: the agents replay
    each worker's latest report flagged as seen (``replayed``), and a report the lost master received
    but died before logging was seen by no one (a test's ``killmaster`` under load lost a step line).
    With this, replayed reports go through the same dedupe as any report delivered twice."""
    if not path or not os.path.exists(path):
        return {}
    with open(path, "rb") as fh:
        fh.seek(0, os.SEEK_END)
        size = fh.tell()
        fh.seek(max(0, size - tail_bytes))
        lines = fh.read().split(b"\n")
    if size > tail_bytes:
        lines = lines[1:]  # the first is cut
    out: dict[int, int] = {}
    for line in lines:
        if b'"event":"step"' not in line:
            continue
        try:
            event = json.loads(line)
        except ValueError:
            continue  # the line being written when the lost master was killed
        generation, step = event.get("generation"), event.get("step")
        if isinstance(generation, int) and isinstance(step, int):
            out[generation] = max(step, out.get(generation, -1))
    return out
