"""The discrete-event loop shared by every system: iterations, checkpoints, failures, pauses.

A ``SystemModel`` (``simulator.systems``) decides what the job runs on a set of
live nodes and what each membership change costs; this loop owns time. Between
changes the job runs whole iterations (and, for checkpointing systems, a
synchronous save every k of them). At a change:

- a loss without notice abandons the iteration in flight (``fallback``); a
  system that recovers from checkpoints also loses every iteration since its
  last complete save (relabelled ``fallback``, their samples taken back);
- with a preemption notice, a system that reconfigures live finishes the
  iteration in flight when it ends inside the grace period; a checkpointing
  system saves at the notice and keeps its work when the save fits the grace;
- a join waits for the next iteration boundary when the system admits nodes
  there (a later change before that boundary takes the join along);
- the system's pause (detection, reconfiguration, state copy, restart...) is laid
  from then on; a change arriving inside it cuts it short and starts the next.

A change of a node's speed (a straggler, ``Change.slowed``) is no membership
change: the system prices its layout at the new speeds at once (every pipeline
waits for the slowest at the all-reduce) and may ask to be called back later
(``Response.timers``: this engine detects a straggler after
``straggler_steps`` iterations, re-splits the batch, weighs a bench later);
what it decides then is switched at the next iteration boundary
(``Response.at_boundary``), like a join.

Every second of wall time lands in exactly one ``Segment``; the breakdown is
their sum per kind. Samples are credited when an iteration completes and are
only ever taken back by a rollback.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Any, Protocol

from oobleck_mm.simulator.availability import Availability, Change

KINDS = ("compute", "fallback", "detection", "reconfiguration", "state_copy", "checkpoint_save", "restart", "down")
"""Where wall time goes (the dissertation's Fig. 2.11 categories, plus detection and down)."""


@dataclass(frozen=True, slots=True)
class Layout:
    """What a system runs until the next change."""

    iteration_s: float
    global_batch: int
    used: frozenset[str]
    """Nodes the layout trains on; losing another live node costs nothing."""
    label: str
    state: Any = None
    """The system's own description (the planner's ``Plan``, a grid...)."""


@dataclass(frozen=True, slots=True)
class Down:
    """The system cannot train on the live nodes; why."""

    reason: str


@dataclass(frozen=True, slots=True)
class Response:
    """A system's answer to a change: what it runs next and the pause before it does."""

    next: Layout | Down
    pause: tuple[tuple[str, float], ...] = ()
    """(kind, seconds) phases, in order."""
    rollback: bool = False
    """Resume from the last complete checkpoint (work since it is lost)."""
    restart_from_scratch: bool = False
    """No state survived and no checkpoint exists: every sample trained so far is lost."""
    commit: bool = False
    """The pause begins with a complete checkpoint save: work so far is kept."""
    note: str = ""
    timers: tuple[float, ...] = ()
    """Seconds from now at which the loop calls the system's ``on_timer`` (a decision it takes later)."""
    at_boundary: bool = False
    """A planned switch (a re-split, a bench): the iteration in flight completes first when it can."""


class SystemModel(Protocol):
    name: str
    checkpoint_every: int
    """Iterations between synchronous checkpoints (0: none)."""
    checkpoint_save_s: float
    recovers_from_checkpoint: bool
    """A loss rolls back to the last checkpoint (Varuna, restart mode), not to the last iteration."""
    joins_at_boundary: bool
    """A join is acted on at the next iteration boundary (False: joined nodes wait for the next loss)."""
    saves_on_signal: bool
    """Every removal arrives as a notice for this system (it catches the termination signal)."""

    def start(self, live: list[str]) -> Response: ...

    def change(
        self, live: list[str], lost: list[str], joined: list[str], noticed: bool, now: float = 0.0
    ) -> Response: ...

    def speeds_changed(self, now: float, live: list[str], slowed: dict[str, float]) -> Response | None:
        """Nodes run ``slowed[node]`` times slower from now (1.0: full speed again); None: nothing changes."""
        ...

    def on_timer(self, now: float, live: list[str]) -> Response | None:
        """A time the system asked for (``Response.timers``); None: nothing to do."""
        ...


@dataclass(frozen=True, slots=True)
class Segment:
    start: float
    end: float
    kind: str
    samples: int = 0
    """Samples trained and kept (compute only)."""
    nodes: int = 0
    """Nodes the job used meanwhile."""

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass(frozen=True, slots=True)
class Incident:
    seconds: float
    lost: tuple[str, ...]
    joined: tuple[str, ...]
    live_nodes: int
    outcome: str
    """The layout the system runs next, or why it cannot."""
    pause: tuple[tuple[str, float], ...]
    rollback_s: float
    """Trained seconds thrown away by this incident (in flight + since the checkpoint)."""


@dataclass(slots=True)
class SimResult:
    system: str
    wall_s: float
    samples: int
    segments: list[Segment]
    incidents: list[Incident]
    start_layout: str
    note: str = ""
    straggler_actions: dict[str, int] = field(default_factory=dict)
    """What the system did about slow nodes: found, changed, cleared, kept, benched, back (counts)."""

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def breakdown(self) -> dict[str, float]:
        out = dict.fromkeys(KINDS, 0.0)
        for seg in self.segments:
            out[seg.kind] += seg.seconds
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "system": self.system,
            "samples_per_s": self.samples_per_s,
            "samples": self.samples,
            "wall_s": self.wall_s,
            "breakdown": self.breakdown,
            "start_layout": self.start_layout,
            "incidents": len(self.incidents),
            "note": self.note,
            "straggler_actions": self.straggler_actions,
        }

    def throughput_series(self, window_s: float) -> list[tuple[float, float]]:
        """(window end s, samples/s in the window): compute segments' kept samples spread evenly
        over their duration (Fig. 2.10's smoothed lines)."""
        if window_s <= 0 or self.wall_s <= 0:
            return []
        bins = [0.0] * max(1, int(-(-self.wall_s // window_s)))
        for seg in self.segments:
            if seg.kind != "compute" or seg.samples == 0 or seg.seconds <= 0:
                continue
            rate = seg.samples / seg.seconds
            b = int(seg.start // window_s)
            while b < len(bins) and b * window_s < seg.end:
                lo, hi = max(seg.start, b * window_s), min(seg.end, (b + 1) * window_s)
                bins[b] += rate * max(0.0, hi - lo)
                b += 1
        return [(min((i + 1) * window_s, self.wall_s), v / window_s) for i, v in enumerate(bins)]


@dataclass(slots=True)
class _Run:
    """The loop's mutable state (private)."""

    system: SystemModel
    t: float = 0.0
    layout: Layout | Down | None = None
    segments: list[Segment] = field(default_factory=list)
    samples: int = 0
    uncommitted: list[int] = field(default_factory=list)
    """Indices of compute segments since the last complete checkpoint."""
    iterations_since_save: int = 0
    inflight_start: float | None = None
    pause_end: float = 0.0
    incidents: list[Incident] = field(default_factory=list)

    # ------------------------------------------------------------------ recording

    def add(self, kind: str, start: float, end: float, samples: int = 0) -> int:
        nodes = len(self.layout.used) if isinstance(self.layout, Layout) else 0
        if end <= start:
            return -1
        last = self.segments[-1] if self.segments else None
        mergeable = kind != "compute" or not self.system.recovers_from_checkpoint
        if last and mergeable and last.kind == kind and last.end == start and last.nodes == nodes:
            self.segments[-1] = Segment(last.start, end, kind, last.samples + samples, nodes)
        else:
            self.segments.append(Segment(start, end, kind, samples, nodes))
        self.samples += samples
        return len(self.segments) - 1

    def relabel_fallback(self, indices: list[int]) -> float:
        lost = 0.0
        for i in indices:
            seg = self.segments[i]
            self.samples -= seg.samples
            self.segments[i] = Segment(seg.start, seg.end, "fallback", 0, seg.nodes)
            lost += seg.seconds
        return lost

    # ------------------------------------------------------------------ training

    def train_until(self, until: float) -> None:
        """Whole iterations (and due checkpoints) from ``self.t``; leaves the one in flight open."""
        layout = self.layout
        if not isinstance(layout, Layout):
            if self.t < until:
                self.add("down", self.t, until)
                self.t = until
            return
        t, step = self.t, layout.iteration_s
        every = self.system.checkpoint_every
        while True:
            if every and self.iterations_since_save >= every:
                save = self.system.checkpoint_save_s
                if t + save > until:
                    # Cut short by the change: the save never completes.
                    self.add("checkpoint_save", t, until)
                    t = until
                    self.inflight_start = None
                    break
                self.add("checkpoint_save", t, t + save)
                t += save
                self.commit()
            if t + step > until:
                self.inflight_start = t
                break
            index = self.add("compute", t, t + step, layout.global_batch)
            if self.system.recovers_from_checkpoint:
                self.uncommitted.append(index)
            t += step
            self.iterations_since_save += 1
        self.t = t

    def commit(self) -> None:
        self.uncommitted.clear()
        self.iterations_since_save = 0

    def boundary(self) -> float | None:
        """When the iteration in flight ends (None: none in flight)."""
        if not isinstance(self.layout, Layout) or self.inflight_start is None:
            return None
        return self.inflight_start + self.layout.iteration_s

    def finish_inflight(self) -> None:
        end = self.boundary()
        assert end is not None
        index = self.add("compute", self.inflight_start, end, self.layout.global_batch)
        if self.system.recovers_from_checkpoint:
            self.uncommitted.append(index)
        self.iterations_since_save += 1
        self.inflight_start = None
        self.t = end

    def abandon_inflight(self, at: float) -> float:
        lost = 0.0
        if self.inflight_start is not None:
            self.add("fallback", self.inflight_start, at)
            lost = at - self.inflight_start
        self.inflight_start = None
        self.t = max(self.t, at)
        return lost

    # ------------------------------------------------------------------ changes

    def apply(
        self, response: Response, at: float, lost: list[str], joined: list[str], live_nodes: int, thrown: float
    ) -> None:
        if response.rollback:
            thrown += self.relabel_fallback(self.uncommitted)
            self.commit()
        if response.restart_from_scratch:
            thrown += self.relabel_fallback([i for i, s in enumerate(self.segments) if s.kind == "compute"])
            self.commit()
        if response.commit:
            self.commit()
        self.layout = response.next
        t = at
        for kind, seconds in response.pause:
            self.add(kind, t, t + seconds)
            t += seconds
        self.pause_end = t
        self.t = t
        outcome = response.next.label if isinstance(response.next, Layout) else f"down: {response.next.reason}"
        self.incidents.append(Incident(at, tuple(lost), tuple(joined), live_nodes, outcome, response.pause, thrown))

    def cut_pause(self, at: float) -> None:
        """A change inside a pause: the pause's segments end at ``at``."""
        if self.pause_end <= at:
            return
        kept = []
        for seg in self.segments:
            if seg.start >= at:
                continue
            kept.append(Segment(seg.start, min(seg.end, at), seg.kind, seg.samples, seg.nodes))
        self.segments = kept
        self.t = at
        self.pause_end = at


def simulate_system(
    system: SystemModel, availability: Availability, preemption_notice: bool = False, grace_s: float = 0.0
) -> SimResult:
    """Run ``system`` through ``availability``; every wall second lands in one segment."""
    run = _Run(system)
    live = list(availability.initial)
    first = system.start(list(live))
    run.layout = first.next
    start_label = first.next.label if isinstance(first.next, Layout) else f"down: {first.next.reason}"
    end = availability.end_s
    queue: list[tuple[float, int, Change]] = []
    for seq, change in enumerate(availability.changes):
        heapq.heappush(queue, (change.seconds, seq, change))
    seq = len(availability.changes)
    waiting_joins: list[str] = []

    def schedule(response: Response, at: float) -> None:
        nonlocal seq
        for delay in response.timers:
            heapq.heappush(queue, (at + delay, seq, _Timer(at + delay, (), ())))
            seq += 1

    schedule(first, 0.0)
    while queue and queue[0][0] < end:
        at, _, change = heapq.heappop(queue)
        if isinstance(change, _Timer) or (change.slowed and not change.added and not change.removed):
            if at >= run.pause_end:
                run.train_until(at)
            if isinstance(change, _Timer):
                response = system.on_timer(at, list(live))
            else:
                response = system.speeds_changed(at, list(live), dict(change.slowed))
            if response is not None:
                _switch(run, response, at, len(live), _next_membership(queue, end))
                schedule(response, at)
            continue
        deferred = getattr(change, "deferred", False)
        if deferred and not waiting_joins:
            continue  # an earlier change already took the joins this boundary was for
        # Membership is a fact at the change's time, whatever the system does with it.
        removed = [n for n in change.removed if n in live]
        live = [n for n in live if n not in set(removed)] + [n for n in change.added if n not in live]
        joined = waiting_joins + list(change.added)
        if at < run.pause_end:
            run.cut_pause(at)
        else:
            run.train_until(at)
        layout = run.layout
        used = layout.used if isinstance(layout, Layout) else frozenset()
        lost = [n for n in removed if n in used]
        joined = [n for n in joined if n in live]
        if not lost and removed and not joined and isinstance(layout, Layout):
            continue  # only idle nodes left: nothing to do
        if not lost and joined and isinstance(layout, Layout):
            if not system.joins_at_boundary:
                waiting_joins = joined
                continue
            boundary = run.boundary()
            if boundary is not None and not deferred:
                waiting_joins = joined
                if boundary < end:
                    marker = _Deferred(boundary, (), ())
                    heapq.heappush(queue, (boundary, seq, marker))
                    seq += 1
                continue
            if deferred and run.inflight_start == at:
                run.inflight_start = None  # the iteration that ended here is credited; the next has not begun
        if not lost and not joined and isinstance(layout, Layout):
            continue  # a deferred boundary whose joins an earlier change already took
        waiting_joins = []
        thrown = 0.0
        noticed = (preemption_notice or system.saves_on_signal) and bool(lost)
        if lost and noticed and not system.recovers_from_checkpoint:
            boundary = run.boundary()
            if boundary is not None and boundary <= at + grace_s and boundary < _next_time(queue, end):
                run.finish_inflight()
                at = boundary
            else:
                thrown += run.abandon_inflight(at)
        elif lost and noticed and system.recovers_from_checkpoint:
            thrown += run.abandon_inflight(at)
            save = system.checkpoint_save_s
            run.add("checkpoint_save", at, at + min(save, grace_s))
            if save <= grace_s:
                run.commit()
            at += min(save, grace_s)
        elif lost:
            thrown += run.abandon_inflight(at)
        elif run.inflight_start is not None:
            thrown += run.abandon_inflight(at)
        if not isinstance(layout, Layout) or lost or joined:
            if not isinstance(layout, Layout) and not (lost or joined or removed):
                continue
            response = system.change(list(live), lost, joined, noticed, now=at)
            run.apply(response, at, lost, joined, len(live), thrown)
            schedule(response, at)

    if run.pause_end > end:
        run.cut_pause(end)
    run.train_until(end)
    if run.inflight_start is not None:
        run.abandon_inflight(end)
    actions: dict[str, int] = {}
    for _, _, what in getattr(getattr(system, "st", None), "actions", ()):
        actions[what] = actions.get(what, 0) + 1
    return SimResult(
        system.name, end, run.samples, run.segments, run.incidents, start_label, getattr(system, "note", ""), actions
    )


def _switch(run: _Run, response: Response, at: float, live_nodes: int, next_event: float) -> None:
    """A layout the system chose without a membership change: at once when it costs no pause (the same
    plan at other speeds: the iteration in flight goes on), else at the next iteration boundary (the one in
    flight completes when it ends before the next event, as a join's; after a pause still running)."""
    if not response.pause:
        run.layout = response.next
        return
    start, thrown = max(at, run.pause_end), 0.0
    if start == at:
        boundary = run.boundary()
        if boundary is not None and response.at_boundary and boundary < next_event:
            run.finish_inflight()
            start = boundary
        else:
            thrown = run.abandon_inflight(at)
    run.apply(response, start, [], [], live_nodes, thrown)


class _Timer(Change):
    """A time a system asked to be called back at (queued by the loop itself)."""

    __slots__ = ()


class _Deferred(Change):
    """A join acted on at the iteration boundary after it (queued by the loop itself)."""

    __slots__ = ()
    deferred = True


def _next_membership(queue: list[tuple[float, int, Change]], end: float) -> float:
    """When the next node comes or goes (a timer or a change of speed interrupts no iteration)."""
    times = [t for t, _, c in queue if not isinstance(c, _Timer) and (c.added or c.removed)]
    return min(times, default=end)


def _next_time(queue: list[tuple[float, int, Change]], end: float) -> float:
    return queue[0][0] if queue else end
