"""Part of the machine (``oobleck_mm.master.machine``): a detection pass (at the machine's cadence,
``Tick.detect``): failed and silent nodes (``oobleck_mm.master.detector``), the master's own stalls
forgiven, and the nodes declared lost with their consequences.
"""

from __future__ import annotations

import logging
import statistics

from oobleck_mm.master import stopping
from oobleck_mm.master.context import Context, add_to_incident
from oobleck_mm.master.detector import Failure, detect_failures, recent_stalls, silent_reporters
from oobleck_mm.master.effects import EndStream
from oobleck_mm.master.generations import SETTLE_S
from oobleck_mm.master.state import TRAINING, JobPhase

log = logging.getLogger(__name__)


def detect(ctx: Context) -> None:
    s, timeouts = ctx.s, ctx.cfg.timeouts
    _forgive_own_stall(ctx)
    s.stalls = recent_stalls(ctx.now, s.stalls, s.registry.nodes, timeouts)
    failures = detect_failures(ctx.now, s.registry.health(), timeouts, s.stalls)
    declare_lost(ctx, failures + _silent_reporters(ctx, {f.node for f in failures}))


def _silent_reporters(ctx: Context, lost: set[str]) -> list[Failure]:
    """Registered nodes of the running generation whose workers' reports lag the job's (``detector``)."""
    s = ctx.s
    current = s.current_view()
    if s.phase is not JobPhase.RUNNING or current is None:
        return []  # a restarted master hears the agents' replays as they register: nothing lags yet
    # Steps every rank of the current generation reported are no evidence against anyone any more.
    behind = min((s.latest_step.get(gpu, (0, -1)) for gpu in current.ranks), default=(s.generation, -1))
    s.step_seen = {key: at for key, at in s.step_seen.items() if key > behind and key[0] >= s.generation}
    step_s = statistics.median(s.recent_step_s) if s.recent_step_s else 0.0
    limit = ctx.cfg.timeouts.reports_silence_limit(step_s).total_seconds()
    gpus = [gpu for gpu in current.ranks if gpu[0] in s.registry.nodes and gpu[0] not in lost]
    return silent_reporters(ctx.now, s.generation, gpus, s.latest_step, s.step_seen, limit)


def _forgive_own_stall(ctx: Context) -> None:
    """Time the master itself was frozen (starved of CPU, paused) is nobody's silence.

    Heartbeats that arrived meanwhile wait unread in its sockets; without this, a
    master descheduled for longer than the timeout would declare every node lost
    at its next tick (``fault_tolerance.master_stall_threshold`` says why the gap).
    """
    s, now = ctx.s, ctx.now
    last, s.last_detect = s.last_detect, now
    gap = 0.0 if last is None else now - last
    if gap <= ctx.cfg.timeouts.master_stall_threshold.total_seconds():
        return
    s.registry.forgive(gap, now)
    s.last_progress = min(now, s.last_progress + gap)
    s.step_seen = {key: at + gap for key, at in s.step_seen.items()}  # nor the reports' lag
    ctx.record("master_stalled", seconds=gap)
    log.warning("the master did not run for %.2fs; not counting it as the nodes' silence", gap)


def declare_lost(ctx: Context, failures: list[Failure]) -> None:
    """Every node of ``failures`` leaves the registry first, then the consequences follow: nothing is
    sent to a node declared lost in the same tick (a round handed on, a plan)."""
    s = ctx.s
    in_plan = {}
    for failure in failures:
        name = failure.node
        s.registry.pop(name)
        in_plan[name] = s.in_plan(name)
        ctx.record(
            "lost",
            node=name,
            reason=failure.reason,
            detail=failure.detail,
            phase=s.phase.value,
            in_plan=in_plan[name],
            generation=s.generation,
        )
        log.warning("node %s lost: %s (%s)", name, failure.reason, failure.detail)
        s.forget(name)
        # Tell it nothing: a hung (stopped) node must not find orders when it wakes. Ending
        # the stream frees the handler thread; a live agent reads the end as "master gone" and
        # stops its workers, which is what a node declared lost must do.
        ctx.effects.append(EndStream(name))
    for failure in failures:
        if s.phase in TRAINING and in_plan[failure.node]:
            s.settle_until = ctx.now + SETTLE_S
            ctx.say(f"node {failure.node} lost ({failure.reason}); planning generation {s.generation + 1}")
            add_to_incident(ctx, "lost", failure.node)
    if s.phase is JobPhase.CHECKPOINTING and in_plan:
        stopping.round_lost(ctx, list(in_plan))
