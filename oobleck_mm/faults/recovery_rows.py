"""Recovery rows from an event log: one per incident (failures injected together, a loss the master found, a
join), each phase timed. The table and the CLI are ``oobleck_mm.faults.report``; the figure
``oobleck_mm.faults.figure``.

Pure over a list of events (``oobleck_mm.events.read_events``); missing phases
are ``None`` (printed ``-``), never an error, so the same code reads a run with
live recovery, checkpoint-restart, or no recovery at all.

One row per *incident*: the failures injected together (same injector
``batch``), a failure the master found by itself (a ``lost`` with no injection
behind it), or a join. Its timeline, each phase measured from the previous one
that is present:

    failure (``injected``) -> detected (``lost``) -> plan decided
    -> rendezvous done -> states copied (bytes, MB/s) -> resumed

The recovery generation is the one of the first step logged after detection
(so a failure during recovery, which needs one more plan, is charged to the
same incident). Time lost = from the end of the last step completed before the
failure to the start of the first run of the interrupted step afterwards:
the wait for detection and recovery plus the abandoned iteration's work, and,
under checkpoint-restart, the steps redone since the checkpoint.

A join stops nobody: its cost is the survivors' pause (``survivors_pause``),
from the moment the joiner is ready to the first step of the generation that
took it in, summed over the wall-clock gaps between consecutive step
completions minus the run's median gap, where positive. That catches a slow
step before the switch (the survivors waiting on the joiner's groups) as well as
the switch itself; it is the "lost s" of a join row and the join figure of
``scripts/bench_recovery.py`` and ``scripts/bench_join.py``. The same sum over
the joiner's start-up (its injection to ready, shaded "joiner start-up" on the
figure) is ``startup_pause_s``: on a real cluster the joiner starts on its own
machine; on one machine its imports take CPU from the survivors, and this says
how much.

Phase events may be written once per worker or once per generation: a phase is
done when its last worker is (the latest ``ts`` of that generation). The
``bytes`` of ``states_copied``, per worker or the master's sum over workers,
count every byte twice (at its sender and its receiver, as
``runtime/state_transfer.py`` counts ``moved``), so the report halves them; an
event that carries ``bytes_transferred`` (each byte once) is taken as is.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Iterable, Mapping, Sequence

from oobleck_mm.faults.spec import FAILURE_KINDS

Event = Mapping[str, Any]

PHASE_ALIASES = {"rendezvous": "rendezvous_done", "detected": "lost", "joined": "registered"}
"""Spellings of the same phase (a worker's ``PhaseDone.phase`` vs. the master's event names)."""
_SAME_MOMENT_S = 0.2
"""Injections without a ``batch`` this close together are one incident; a loss this much before its
injection is still its detection."""


@dataclass(frozen=True, slots=True)
class RecoveryRow:
    kind: str
    """``kill`` | ``killworker`` | ``stop`` | ``preempt`` | ``join`` (injected, ``+``-joined when mixed) or
    ``lost``."""
    nodes: tuple[str, ...]
    at_ts: float
    """When it happened: the injection, or the detection for a failure nobody injected."""
    step: int | None
    """The step interrupted (for a join or a notice to leave: the first step of the new generation),
    0-based as in the event log; the table and ``outcome`` number it as the console does (``+ 1``)."""
    reason: str | None = None
    """How it was detected (``lost`` reasons), ``ready`` for a join whose workers are up (``registered``
    in a log without ``node_ready``)."""
    generation: int | None = None
    """The generation that resumed training (None: it never did)."""
    detect_s: float | None = None
    decide_s: float | None = None
    rendezvous_s: float | None = None
    copy_s: float | None = None
    copy_bytes: int | None = None
    copy_mb_per_s: float | None = None
    resume_s: float | None = None
    abandoned_s: float | None = None
    """Work of the interrupted iteration thrown away: from the last completed step to the failure."""
    lost_s: float | None = None
    """Wall-clock time the job lost. A join: the survivors' pause from the joiner ready to the new
    generation's first step (``survivors_pause``)."""
    startup_pause_s: float | None = None
    """A join: the survivors' pause while the joiner started (its injection to ready), which only a
    joiner sharing the survivors' machine (the local cluster) causes."""
    outcome: str = ""

    @property
    def reconfigure_s(self) -> float | None:
        """Detection to rendezvous done: the reconfiguration without detection, state copy and first step."""
        parts = [p for p in (self.decide_s, self.rendezvous_s) if p is not None]
        return sum(parts) if parts else None

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["nodes"] = list(self.nodes)
        out["reconfigure_s"] = self.reconfigure_s
        return out


# ---------------------------------------------------------------------- events
def phase_name(event: Event) -> str:
    """The event's name, with a generic ``phase`` event resolved and aliases folded."""
    name = str(event.get("event", ""))
    if name in ("phase", "phase_done") and "phase" in event:
        name = str(event["phase"])
    return PHASE_ALIASES.get(name, name)


def _sorted(events: Iterable[Event]) -> list[Event]:
    return sorted((e for e in events if isinstance(e.get("ts"), (int, float))), key=lambda e: e["ts"])


def _steps(events: Sequence[Event]) -> list[Event]:
    return [e for e in events if phase_name(e) == "step" and isinstance(e.get("step"), int)]


# ---------------------------------------------------------------------- incidents
@dataclass(frozen=True, slots=True)
class _Incident:
    kind: str
    nodes: tuple[str, ...]
    ts: float
    join: bool
    injected: bool


def incidents(events: Sequence[Event]) -> list[_Incident]:
    """Injected failures grouped by batch, joins, and losses nobody injected, in time order."""
    injected = [e for e in events if phase_name(e) == "injected"]
    groups: dict[tuple, list[Event]] = {}
    for e in injected:
        join = e.get("kind") == "join"
        key = ("batch", e["batch"], join) if "batch" in e else ("ts", round(e["ts"] / _SAME_MOMENT_S), join)
        groups.setdefault(key, []).append(e)
    out = []
    for (_, _, join), group in groups.items():
        kinds = sorted({str(e.get("kind")) for e in group})
        nodes = tuple(str(e.get("node")) for e in group)
        out.append(_Incident("+".join(kinds), nodes, min(e["ts"] for e in group), join, True))
    hit = {(str(e.get("node")), e["ts"]) for e in injected if e.get("kind") in FAILURE_KINDS}
    for e in events:
        if phase_name(e) == "lost" and not any(n == e.get("node") and ts - _SAME_MOMENT_S <= e["ts"] for n, ts in hit):
            out.append(_Incident("lost", (str(e.get("node")),), e["ts"], False, False))
    return sorted(out, key=lambda i: i.ts)


# ---------------------------------------------------------------------- one incident
def recovery_rows(events: Iterable[Event]) -> list[RecoveryRow]:
    """The per-incident breakdown of a run's event log."""
    ordered = _sorted(events)
    return [_row(ordered, incident) for incident in incidents(ordered)]


def _first(events: Sequence[Event], name: str, after: float, **match: Any) -> Event | None:
    for e in events:
        if e["ts"] >= after and phase_name(e) == name and all(e.get(k) == v for k, v in match.items()):
            return e
    return None


def _last_before(events: Sequence[Event], name: str, before: float) -> Event | None:
    found = None
    for e in events:
        if e["ts"] > before:
            break
        if phase_name(e) == name:
            found = e
    return found


def _detection(events: Sequence[Event], incident: _Incident) -> tuple[float | None, str | None]:
    """When every node of the incident was detected (lost, or registered for a join), and why."""
    if incident.kind == "killmaster":  # "detected": the restarted master has its nodes back
        adopted = _first(events, "adopted", incident.ts)
        return (None, None) if adopted is None else (adopted["ts"], "re-adopted")
    if incident.join:
        return _join_ready(events, incident)
    # Tolerance: a log written before the injector logged ahead of its signals can show the loss first.
    found = [
        min(
            (
                e
                for e in (
                    _first(events, name, incident.ts - _SAME_MOMENT_S, node=node) for name in ("lost", "leaving")
                )  # leaving: a preemption notice taken
                if e is not None
            ),
            key=lambda e: e["ts"],
            default=None,
        )
        for node in incident.nodes
    ]
    found = [e for e in found if e is not None]
    if not found:
        return None, None
    reasons = sorted({"notice" if phase_name(e) == "leaving" else str(e.get("reason")) for e in found})
    return max(e["ts"] for e in found), "+".join(reasons)


def _join_ready(events: Sequence[Event], incident: _Incident) -> tuple[float | None, str | None]:
    """When every joiner could be used: its workers built their layers (``node_ready``, joining), reason
    ``ready``. The survivors train on meanwhile, so that start-up is not charged to planning. A log
    without ``node_ready`` (an older master) falls back to registration, reason ``registered``."""
    found = []
    for node in incident.nodes:
        registered = _first(events, "registered", incident.ts - _SAME_MOMENT_S, node=node)
        if registered is None:
            continue
        ready = _first(events, "node_ready", registered["ts"], node=node, joining=True)
        found.append(("ready", ready) if ready is not None else ("registered", registered))
    if not found:
        return None, None
    return max(e["ts"] for _, e in found), "+".join(sorted({reason for reason, _ in found}))


def _row(events: Sequence[Event], incident: _Incident) -> RecoveryRow:
    detect_ts, reason = _detection(events, incident)
    if incident.join and detect_ts is None:
        return _never_joined(events, incident)
    if (
        incident.injected
        and not incident.join
        and incident.kind != "killmaster"
        and not _was_training(events, incident)
    ):
        return _not_training(incident)
    since = detect_ts if detect_ts is not None else incident.ts
    # A restarted master plans nothing: the workers never stopped (a later plan answers another incident).
    plan = None if incident.kind == "killmaster" else _recovery_plan(events, since, incident.nodes)
    # A join or a notice to leave changes nothing until its plan is decided; a failure interrupts at once.
    planned_change = incident.join or incident.kind == "preempt"
    boundary = plan["ts"] if planned_change and plan is not None else since
    if incident.kind == "killmaster":  # the workers went on at once: their next step is the one that counts
        boundary = incident.ts
    last_old = _last_before(_steps(events), "step", boundary)
    wanted = 0 if last_old is None else last_old["step"] + 1
    after = since if plan is None else plan["ts"]
    if incident.kind == "killmaster":
        after = incident.ts
    # A step of the old generation can still complete just after the plan (a join or a notice is
    # applied at the boundary after it): the resumed step is the new generation's first.
    newer = (plan or {}).get("generation")
    first_new = next(
        (
            e
            for e in _steps(events)
            if e["ts"] > after and e["step"] >= wanted and (newer is None or e.get("generation", newer) >= newer)
        ),
        None,
    )
    if planned_change and plan is None:
        first_new = None  # never planned (the job ended, or stopped at a checkpoint, first): nothing resumed
    if incident.kind == "preempt" and first_new is not None:
        # Applied at the boundary: the step in flight at the plan completed, and is the last old one.
        last_old = _last_before([e for e in _steps(events) if e["step"] < first_new["step"]], "step", first_new["ts"])
    generation = None if plan is None else plan.get("generation")
    phases = _phase_times(events, generation, plan)
    durations = _chain(
        incident.ts,
        [
            ("detect", detect_ts),
            ("decide", None if plan is None else plan["ts"]),
            ("rendezvous", phases["rendezvous_done"]),
            ("copy", phases["states_copied"]),
            ("resume", phases["resumed"] or (None if first_new is None else first_new["ts"])),
        ],
    )
    copy_bytes, copy_seconds = _copied(events, generation)
    copy_window = copy_seconds or durations["copy"]
    return RecoveryRow(
        kind=incident.kind,
        nodes=incident.nodes,
        at_ts=incident.ts,
        step=(first_new["step"] if first_new is not None else None)
        if planned_change
        else (wanted if last_old else None),
        reason=reason,
        generation=generation if first_new is not None else None,
        detect_s=durations["detect"],
        decide_s=durations["decide"],
        rendezvous_s=durations["rendezvous"],
        copy_s=durations["copy"],
        copy_bytes=copy_bytes,
        copy_mb_per_s=(copy_bytes / 1e6 / copy_window) if copy_bytes and copy_window else None,
        resume_s=durations["resume"],
        abandoned_s=None if incident.join or last_old is None else _abandoned(events, incident, last_old, plan),
        lost_s=survivors_pause(events, since, first_new) if incident.join else _time_lost(last_old, first_new),
        startup_pause_s=(
            survivors_pause(events, incident.ts, first_new, until_ts=since)
            if incident.join and first_new is not None
            else None
        ),
        outcome=_outcome(events, incident, first_new),
    )


def _was_training(events: Sequence[Event], incident: _Incident) -> bool:
    """Whether some node of a failure was in the plan the job ran when it failed (a log without plans:
    assumed so)."""
    plan = _last_before(events, "plan_decided", incident.ts)
    return plan is None or "nodes" not in plan or bool(set(incident.nodes) & set(plan["nodes"]))


def _not_training(incident: _Incident) -> RecoveryRow:
    """A failure of nodes no plan had taken in (a joiner still starting, a spare): the job lost nothing."""
    return RecoveryRow(
        kind=incident.kind,
        nodes=incident.nodes,
        at_ts=incident.ts,
        step=None,
        lost_s=0.0,
        outcome="not training: nothing lost",
    )


def _never_joined(events: Sequence[Event], incident: _Incident) -> RecoveryRow:
    """A join whose node was never ready: killed first, or the job ended first."""
    failed = [
        e
        for e in events
        if phase_name(e) == "injected"
        and e["ts"] >= incident.ts
        and e.get("kind") in FAILURE_KINDS
        and str(e.get("node")) in incident.nodes
    ]
    outcome = "never joined (killed before it was ready)" if failed else _outcome(events, incident, None)
    if outcome == "not resumed":
        outcome = "never joined"
    return RecoveryRow(kind=incident.kind, nodes=incident.nodes, at_ts=incident.ts, step=None, outcome=outcome)


def _abandoned(events: Sequence[Event], incident: _Incident, last_old: Event, plan: Event | None) -> float:
    """Work of the iteration in flight thrown away. A node that left on notice (a preemption)
    is planned out at the iteration boundary: nothing, unless some worker gave that iteration up."""
    if incident.kind in ("preempt", "killmaster"):  # the workers train on without a master
        until = plan["ts"] if plan is not None else float("inf")
        if incident.kind == "killmaster":  # aborted iterations after its nodes were back are another story
            until = (_first(events, "adopted", incident.ts) or {"ts": until})["ts"]
        if not any(phase_name(e) == "aborted" and incident.ts <= e["ts"] <= until + 1.0 for e in events):
            return 0.0
    return max(0.0, incident.ts - last_old["ts"])


def _recovery_plan(events: Sequence[Event], since: float, nodes: Sequence[str] = ()) -> Event | None:
    """The plan of the generation that resumed training after ``since``.

    Usually the first plan after it that names one of ``nodes`` as lost or joined (a joiner is
    admitted once its workers are ready, after plans for other incidents may have come and gone);
    when a failure during recovery forced another plan, the last one before the first step of the
    new generation.
    """
    plans = [e for e in events if e["ts"] >= since and phase_name(e) == "plan_decided"]
    named = [e for e in plans if set(nodes) & {*e.get("lost", ()), *e.get("joined", ())}]
    first_plan = named[0] if named else (plans[0] if plans else None)
    if first_plan is None:
        return None
    resumed = next((e for e in _steps(events) if e["ts"] > first_plan["ts"]), None)
    if resumed is None:
        return first_plan
    plans = [e for e in events if phase_name(e) == "plan_decided" and first_plan["ts"] <= e["ts"] <= resumed["ts"]]
    same = [e for e in plans if "generation" in resumed and e.get("generation") == resumed["generation"]]
    return (same or plans)[-1]


def _phase_times(events: Sequence[Event], generation: Any, plan: Event | None) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for name in ("rendezvous_done", "states_copied", "resumed"):
        times = [
            e["ts"]
            for e in events
            if phase_name(e) == name
            and plan is not None
            and e["ts"] >= plan["ts"]
            and (generation is None or e.get("generation", generation) == generation)
        ]
        out[name] = max(times) if times else None  # done when the last worker is
    return out


def _chain(start: float, chain: list[tuple[str, float | None]]) -> dict[str, float | None]:
    """Each phase's duration from the previous phase that happened (missing ones are None)."""
    out: dict[str, float | None] = {}
    previous = start
    for name, ts in chain:
        if ts is None:
            out[name] = None
            continue
        out[name] = max(0.0, ts - previous)
        previous = ts
    return out


def _copied(events: Sequence[Event], generation: Any) -> tuple[int | None, float | None]:
    """(bytes transferred, each once; the slowest worker's copy seconds) of a generation.

    Copy seconds are the transfers alone (``transfer_seconds``: after every rank had built the
    layers it receives into) where the log has them, else the whole phase.
    """
    copies = [
        e
        for e in events
        if phase_name(e) == "states_copied" and (generation is None or e.get("generation", generation) == generation)
    ]
    if generation is None or not copies:
        return None, None
    if all("bytes_transferred" in e for e in copies):
        total = sum(int(e["bytes_transferred"] or 0) for e in copies)
    else:
        # Workers count a byte where it is sent and where it is received (state_transfer's ``moved``),
        # whether one event per worker or the master's sum over them: each byte twice.
        total = sum(int(e.get("bytes", 0) or 0) for e in copies) // 2
    seconds = max((float(e.get("transfer_seconds") or e.get("seconds", 0) or 0) for e in copies), default=0.0)
    return total, seconds or None


def step_gaps(events: Sequence[Event]) -> list[tuple[float, float]]:
    """(completion time, wall-clock seconds since the previous completion) of every step but the first."""
    done = sorted(_finished_at(e) for e in _steps(events))
    return [(b, b - a) for a, b in zip(done, done[1:])]


def median_step_gap(events: Sequence[Event]) -> float | None:
    """The run's median wall-clock gap between consecutive step completions (None: under two steps)."""
    ordered = sorted(gap for _, gap in step_gaps(events))
    return ordered[len(ordered) // 2] if ordered else None


def survivors_pause(
    events: Sequence[Event], since: float, until_step: Event | None, until_ts: float | None = None
) -> float | None:
    """Seconds the survivors lost from ``since`` to the completion of ``until_step`` (or to ``until_ts``):
    each gap between consecutive step completions ending in that window, less the run's median gap,
    summed where positive."""
    median = median_step_gap(events)
    if until_step is None or median is None:
        return None
    gaps = step_gaps(events)
    end = _finished_at(until_step) if until_ts is None else until_ts
    return sum(max(0.0, gap - median) for done, gap in gaps if since < done <= end)


def _time_lost(last_old: Event | None, first_new: Event | None) -> float | None:
    if last_old is None or first_new is None:
        return None
    started = _finished_at(first_new) - float(first_new.get("step_time_s", 0.0) or 0.0)
    return max(0.0, started - _finished_at(last_old))


def _finished_at(step: Event) -> float:
    """When the workers finished the step: their own clock where the event has it (a step trained while no
    master listened is logged when a restarted master hears of it), else when the master logged it."""
    return float(step.get("finished_at") or step["ts"])


def _outcome(events: Sequence[Event], incident: _Incident, first_new: Event | None) -> str:
    if first_new is not None:
        return f"resumed at step {first_new['step'] + 1}"  # the console's numbering (step 1 is the first)
    end = _first(events, "shutdown", incident.ts)
    if end is None:
        return "not resumed"
    return f"job ended (exit {end.get('exit_code', '?')})"


# ---------------------------------------------------------------------- text
