"""Which nodes exist when: the membership timeline a simulation replays.

Two sources: a spot-instance trace (``faults.trace.read_trace``; the trace's own
node names are kept, so a node that comes back is a fresh node without state)
or the paper's controlled failures (§2.7.2: N nodes, one removed every
interval until ``until_nodes`` remain). Events sharing a timestamp form one
``Change``: a zone reclaimed at once is one correlated loss, as the engine's
master sees it after its settle window.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from oobleck_mm.errors import UserError
from oobleck_mm.faults.spec import FaultEvent
from oobleck_mm.faults.trace import TraceEvent


@dataclass(frozen=True, slots=True)
class Change:
    seconds: float
    """Since the start of the simulation."""
    added: tuple[str, ...]
    removed: tuple[str, ...]
    slowed: tuple[tuple[str, float], ...] = ()
    """Nodes whose speed changes now: (node, how many times slower; 1.0: back to full speed)."""


@dataclass(frozen=True, slots=True)
class Availability:
    initial: tuple[str, ...]
    """Nodes present at time 0."""
    changes: tuple[Change, ...]
    """Later changes, in time order, each with at least one node added, removed or slowed."""
    end_s: float
    """Where the simulation stops."""
    source: str

    @property
    def peak_nodes(self) -> int:
        live, peak = set(self.initial), len(self.initial)
        for change in self.changes:
            live = (live - set(change.removed)) | set(change.added)
            peak = max(peak, len(live))
        return peak

    def nodes_at(self, seconds: float) -> int:
        live = set(self.initial)
        for change in self.changes:
            if change.seconds > seconds:
                break
            live = (live - set(change.removed)) | set(change.added)
        return len(live)

    def clipped(self, hours: float | None) -> Availability:
        """The first ``hours`` (None: unchanged); an hour past the trace's end is idle time at its last size."""
        if hours is None:
            return self
        if not hours > 0:
            raise UserError(f"--hours: must be > 0, got {hours}")
        end = hours * 3600.0
        kept = tuple(c for c in self.changes if c.seconds < end)
        return Availability(self.initial, kept, end, self.source)

    def with_stragglers(self, spec: StragglerSpec) -> Availability:
        """This membership with ``spec``'s slowdowns: ``share`` of the peak node count, drawn from every node
        that ever takes part, each slowed by a factor drawn uniformly from [low, high] at a uniform time of the
        run (from ``at`` when given), for ``duration_s`` (None: for good). A node slowed while it is away is
        slow when it comes."""
        import random

        rng = random.Random(spec.seed)
        pool = sorted({*self.initial, *(n for c in self.changes for n in c.added)})
        chosen = rng.sample(pool, min(len(pool), round(spec.share * self.peak_nodes)))
        timed: list[tuple[float, str, float]] = []
        for node in chosen:
            start = spec.at_s if spec.at_s is not None else rng.uniform(0.0, self.end_s)
            timed.append((start, node, round(rng.uniform(spec.low, spec.high), 3)))
            if spec.duration_s is not None:
                timed.append((start + spec.duration_s, node, 1.0))
        changes = list(self.changes)
        for seconds, node, factor in timed:
            if seconds < self.end_s:
                changes.append(Change(seconds, (), (), ((node, factor),)))
        changes.sort(key=lambda c: c.seconds)  # stable: a membership change keeps its place at a tie
        return Availability(self.initial, tuple(changes), self.end_s, f"{self.source}; stragglers {spec.text}")


@dataclass(frozen=True, slots=True)
class StragglerSpec:
    """``--stragglers SHARE[,min=F,max=F,seed=S,at=T,for=T]``: a per-node slowdown distribution."""

    share: float
    low: float = 1.5
    high: float = 3.0
    seed: int = 0
    at_s: float | None = None
    duration_s: float | None = None
    text: str = ""


def parse_stragglers(text: str) -> StragglerSpec:
    """``0.05,min=1.5,max=3,seed=1`` -> a ``StragglerSpec``; a ``UserError`` names the bad part."""
    head, *rest = [p.strip() for p in text.split(",") if p.strip()]
    try:
        share = float(head)
    except ValueError:
        raise UserError(f"--stragglers: expected SHARE (0-1) first, got {head!r}") from None
    if not 0 < share <= 1:
        raise UserError(f"--stragglers: SHARE must be in (0, 1] (the fraction of nodes slowed), got {share}")
    fields: dict = {}
    for part in rest:
        key, _, value = part.partition("=")
        if key not in ("min", "max", "seed", "at", "for") or not value:
            raise UserError(f"--stragglers: unknown part {part!r}; valid: min=F, max=F, seed=S, at=T, for=T")
        if key in ("min", "max"):
            fields["low" if key == "min" else "high"] = float(value)
        elif key == "seed":
            fields["seed"] = int(value)
        else:
            fields["at_s" if key == "at" else "duration_s"] = parse_duration(value)
    spec = StragglerSpec(share, text=text, **fields)
    if not 1 < spec.low <= spec.high:
        raise UserError(
            f"--stragglers: need 1 < min <= max (how many times slower), got min={spec.low} max={spec.high}"
        )
    return spec


def from_trace(events: Sequence[TraceEvent], name: str, replicas: int = 1) -> Availability:
    """The trace's membership. Time 0 is its first event; the nodes added then are the start.

    ``replicas`` > 1 scales the trace up: every trace node becomes ``replicas`` nodes
    (``node7`` -> ``node7.0``, ``node7.1``, ...) that come and go together, so a
    32-node trace drives a 320-node cluster with the same churn pattern. The
    simulation ends at the trace's last event.
    """
    if replicas < 1:
        raise UserError(f"trace scale: replicas must be >= 1, got {replicas}")
    if not events:
        raise UserError(f"{name}: no events")

    def expand(node: str) -> list[str]:
        return [node] if replicas == 1 else [f"{node}.{i}" for i in range(replicas)]

    start_ms = events[0].ms
    live: dict[str, None] = {}
    changes: list[Change] = []
    pending_add: list[str] = []
    pending_remove: list[str] = []
    current_ms = start_ms

    def flush() -> None:
        if pending_add or pending_remove:
            changes.append(Change((current_ms - start_ms) / 1000, tuple(pending_add), tuple(pending_remove)))
        pending_add.clear()
        pending_remove.clear()

    initial: list[str] = []
    slows: list[tuple[float, str, float]] = []
    for event in events:
        if event.ms != current_ms:
            flush()
            current_ms = event.ms
        names = expand(event.node)
        if event.action == "slow":  # every node the trace node stands for, slowed together
            ms = event.ms - start_ms
            slows.extend((ms / 1000, n, event.factor) for n in names)
            if event.duration_s is not None:
                slows.extend((ms / 1000 + event.duration_s, n, 1.0) for n in names)
            continue
        if event.action == "add":
            fresh = [n for n in names if n not in live]
            live.update(dict.fromkeys(fresh))
            (initial if event.ms == start_ms else pending_add).extend(fresh)
        else:
            gone = [n for n in names if n in live]  # a removal of an absent node is dropped
            for n in gone:
                del live[n]
            if event.ms == start_ms:
                initial[:] = [n for n in initial if n not in gone]
            else:
                # A node added and removed in the same instant never existed for the job.
                both = [n for n in gone if n in pending_add]
                pending_add[:] = [n for n in pending_add if n not in both]
                pending_remove.extend(n for n in gone if n not in both)
    flush()
    end_s = (events[-1].ms - start_ms) / 1000
    label = name if replicas == 1 else f"{name} x{replicas}"
    changes = [c for c in changes if c.added or c.removed]
    changes += [Change(seconds, (), (), ((node, factor),)) for seconds, node, factor in slows if seconds < end_s]
    changes.sort(key=lambda c: c.seconds)
    return Availability(tuple(initial), tuple(changes), end_s, label)


def from_faults(nodes: Sequence[str], faults: Sequence[FaultEvent], end_s: float, source: str) -> Availability:
    """The membership a local replay produces: ``nodes`` at time 0, then each timed ``kill`` removes
    and each ``join`` adds its node (``faults.trace.trace_timeline`` picks them, as ``oobleck-launch
    local --trace`` does), so the simulation sees exactly the cluster the run saw."""
    changes: list[Change] = []
    for fault in sorted((f for f in faults if f.seconds is not None), key=lambda f: f.seconds):
        if fault.seconds >= end_s or fault.kind not in ("kill", "join"):
            continue
        added, removed = ((fault.node,), ()) if fault.kind == "join" else ((), (fault.node,))
        if changes and changes[-1].seconds == fault.seconds:
            last = changes.pop()
            added, removed = last.added + added, last.removed + removed
        changes.append(Change(fault.seconds, added, removed))
    return Availability(tuple(nodes), tuple(changes), end_s, source)


def periodic(nodes: int, interval_s: float, until_nodes: int | None = None) -> Availability:
    """§2.7.2's controlled failures: ``nodes`` at time 0, one removed every ``interval_s``
    (the newest first) until ``until_nodes`` remain (default: half, as the paper's 30 -> 15).
    The simulation ends at the last removal."""
    if nodes < 1:
        raise UserError(f"--nodes: must be >= 1, got {nodes}")
    if not interval_s > 0:
        raise UserError(f"--failure-interval: must be > 0, got {interval_s} s")
    until = nodes // 2 if until_nodes is None else until_nodes
    if not 0 <= until < nodes:
        raise UserError(f"--until-nodes: must be in [0, {nodes - 1}] for {nodes} nodes, got {until}")
    names = tuple(f"node{i + 1}" for i in range(nodes))
    changes = tuple(Change((k + 1) * interval_s, (), (names[nodes - 1 - k],)) for k in range(nodes - until))
    return Availability(names, changes, changes[-1].seconds, f"1 of {nodes} nodes lost every {interval_s:g} s")


def parse_duration(text: str) -> float:
    """``10m``, ``1h``, ``6h``, ``90s``, ``2d`` or plain seconds -> seconds."""
    units = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
    raw = text.strip()
    try:
        if raw and raw[-1] in units:
            return float(raw[:-1]) * units[raw[-1]]
        return float(raw)
    except ValueError:
        raise UserError(f"duration {text!r}: expected a number with s, m, h or d (e.g. 10m, 6h)") from None
