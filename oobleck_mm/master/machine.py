"""The master's decisions as one pure state machine: ``step(state, event, now) -> Transition``.

Like torchft's lighthouse (``quorum_compute(now, state, opts)`` decides,
``_quorum_tick`` applies), every decision of the master is taken here, from
the job's state (``oobleck_mm.master.state``), one event (``oobleck_mm.master.inputs``) and the
clock reading it is given; what must happen outside (messages, planning
calls, the journal, files, log lines) comes back as effects
(``oobleck_mm.master.effects``) for the shell (``oobleck_mm.master.coordinator``) to carry out. No
locks, threads, clocks or I/O: the same event order always gives the same
state and effects, which is what ``tests/unit/test_cp_machine.py`` relies on
to explore thousands of orders.

An event that does not fit the state (a report of a generation long gone, a
planner answer that the membership has overtaken, a stream of a node already
lost) is logged or ignored with a reason, never a crash: ``assert`` is kept for
what no event order can reach.

Planning, adoption and the journal live in ``oobleck_mm.master.generations``; stops and
checkpoint rounds in ``oobleck_mm.master.stopping``; both are parts of this machine.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from oobleck_mm.master import adoption, benching, generations, losses, slow_nodes, stopping
from oobleck_mm.master.generations import SETTLE_S
from oobleck_mm.master.context import Context, Transition, add_to_incident, finish
from oobleck_mm.master.detector import (
    LATE_HEARTBEAT_SHARE,
    WORKER_FAILED,
)
from oobleck_mm.master.effects import ProgressMetrics, ProgressPhase
from oobleck_mm.master.inputs import (
    Adopt,
    Event,
    FinishRequested,
    Heartbeat,
    Leave,
    OpenStream,
    PlanAnswered,
    Register,
    Report,
    StopRequested,
    StepCompleted,
    Straggler,
    StreamEnded,
    Tick,
    WorkerFailure,
)
from oobleck_mm.master.recovery import Holdings
from oobleck_mm.master.registry import Refused
from oobleck_mm.master.state import TRAINING, JobPhase, JobState, Settings
from oobleck_mm.errors import ExitCode
from oobleck_mm.planning.layout import Gpu
from oobleck_mm.protocol import oobleck_pb2 as pb

log = logging.getLogger(__name__)


def step(state: JobState, event: Event, now: float, settings: Settings) -> Transition:
    """Applies ``event`` seen at clock ``now`` to ``state`` (changed in place and returned, so that a
    heartbeat of a thousand-node job costs no copy); the effects to carry out, in order, and why."""
    ctx = Context(state, settings, now)
    handler = _HANDLERS.get(type(event))
    if handler is None:  # a programming error in the shell, not an event order
        raise TypeError(f"the master's machine has no handler for {type(event).__name__}")
    try:
        handler(ctx, event)
    except Refused as refusal:
        ctx.refused = refusal
        ctx.because(f"refused: {refusal}")
    return ctx.transition()


# ---------------------------------------------------------------------- calls from agents
def _register(ctx: Context, ev: Register) -> None:
    s, job = ctx.s, ctx.cfg.job
    want = job.cluster.gpus_per_node
    s.registry.check_new(ev.node, ev.gpus, want)
    if s.phase in (JobPhase.FINISHED, JobPhase.CHECKPOINTING):
        raise Refused("FAILED_PRECONDITION", f"the job is {s.phase.value}")
    most = job.cluster.max_nodes
    if most is not None and len(s.registry.nodes) >= most:  # registered, streams open or not
        raise Refused(
            "RESOURCE_EXHAUSTED",
            f"the job already runs on {most} nodes, its maximum "
            f"(cluster.max_nodes, --nodes MIN:MAX); node {ev.node} is not needed",
        )
    current = s.current_view()
    adopted = s.phase is JobPhase.ADOPTING and current is not None and ev.node in current.nodes
    spare = s.phase is not JobPhase.WAITING and not adopted
    added = s.registry.add(ev.node, ev.session, want, ctx.now)
    added.adopt_generation = ev.adopt_generation
    ctx.record(
        "registered",
        node=ev.node,
        gpus=want,
        memory_bytes=ev.memory_bytes,
        pid=ev.pid,
        peer=ev.peer,
        spare=spare,
        adopt_generation=ev.adopt_generation,
    )
    count, num_nodes = len(s.registry.nodes), ctx.cfg.num_nodes
    if adopted:
        ctx.say(f"node {ev.node} is back (its workers run generation {ev.adopt_generation})")
    elif spare:
        ctx.say(f"node {ev.node} registered: it joins once its workers are ready")
    elif num_nodes <= 16 or count % max(1, num_nodes // 10) == 0 or count >= num_nodes:
        ctx.say(f"agent {ev.node} registered ({count}/{num_nodes})")  # start-up progress, no silent gap
    ctx.answer = (ev.session, want, adopted)
    ctx.because(f"{ev.node} registered" + (" as a spare" if spare else ""))


def _open_stream(ctx: Context, ev: OpenStream) -> None:
    entry = ctx.s.registry.live(ev.node, ev.session)
    if entry.stream != "pending":
        raise Refused("FAILED_PRECONDITION", f"node {ev.node} already has an event stream")
    entry.stream = "open"
    ctx.record("subscribed", node=ev.node)


def _stream_ended(ctx: Context, ev: StreamEnded) -> None:
    s = ctx.s
    s.next_detection = float("-inf")  # a node's health changed: the next tick looks (a kill is seen at once)
    entry = s.registry.nodes.get(ev.node)
    if entry is None or entry.session != ev.session:
        ctx.because(f"the stream of a registration of {ev.node} that is gone: nothing to do")
        return
    entry.stream = "closed"
    if entry.dismissed:  # it left on notice and hung up: gone, and nothing was lost
        s.registry.pop(ev.node)
        s.forget(ev.node)
        ctx.because(f"{ev.node} left on notice and hung up")
    else:
        ctx.because(f"{ev.node}'s stream ended: the next tick declares it lost unless the master hung up")


def _heartbeat(ctx: Context, ev: Heartbeat) -> None:
    entry = ctx.s.registry.nodes.get(ev.node)
    if entry is None or entry.session != ev.session:
        return  # answered NOT_FOUND when it arrived; a beat of a node lost since is no news
    gap, limit = ev.at - entry.last_heartbeat, ctx.cfg.timeouts.heartbeat_timeout.total_seconds()
    if gap > LATE_HEARTBEAT_SHARE * limit:
        ctx.record("heartbeat_late", node=ev.node, gap_s=round(gap, 3), timeout_s=limit)
    entry.last_heartbeat = max(entry.last_heartbeat, ev.at)


def _report(ctx: Context, ev: Report) -> None:
    s = ctx.s
    entry = s.registry.live(ev.node, ev.session)
    gpu = (ev.node, ev.local_rank)
    report = ev.report
    kind = report.WhichOneof("report")
    if kind == "metrics":
        _on_metrics(ctx, gpu, report.metrics, ev.replayed)
    elif kind == "phase":
        _on_phase(ctx, gpu, report.phase, ev.replayed)
    elif kind == "checkpoint_done":
        stopping.on_checkpoint_done(ctx, gpu, report.checkpoint_done)
    elif kind == "done":
        # WorkerDone names no generation: it ends the one the worker last reported from.
        s.done[gpu] = (s.reported.get(gpu, 0), report.done.step)
        # Done is one step past the last: a rank whose done does not come lags the job's. Its peers' may
        # come up to a checkpoint round before its own (a background share finished first, bounded so).
        slack = ctx.cfg.timeouts.checkpoint_round_timeout.total_seconds()
        _stepped(ctx, gpu, s.done[gpu][0], report.done.step + 1, seen_at=ctx.now + slack)
    elif kind == "ready":
        _on_ready(ctx, entry, ev.local_rank, report.ready)
    elif kind == "stalled":
        s.stalls[ev.node] = ctx.now  # evidence for the detector: this node's worker waits on its peers
    elif kind == "failed":
        failed = report.failed
        ctx.record(
            "worker_failed",
            node=ev.node,
            local_rank=ev.local_rank,
            message=failed.message,
            user_error=failed.user_error,
            bug=failed.bug,
        )
        if failed.user_error:  # the same on every replica: stop once, naming the cause
            finish(ctx, ExitCode.BAD_INPUT, f"{ev.node}/gpu{ev.local_rank}: {failed.message}")
        elif failed.bug:  # every replica would meet it again: recovering would only repeat it
            finish(
                ctx,
                ExitCode.ERROR,
                f"{ev.node}/gpu{ev.local_rank} stopped the job: "
                f"{failed.message.splitlines()[0] if failed.message else 'no message'} "
                f"(traceback in {ev.node}'s log)",
            )
        elif entry.worker_failure is None:
            entry.worker_failure = WORKER_FAILED
            entry.detail = f"local rank {ev.local_rank}: {failed.message}"
    else:
        ctx.because(f"an empty report from {ev.node}/gpu{ev.local_rank}: ignored")


RECENT_STEPS = 32
"""Step times kept for the median that paces ``fault_tolerance.reports_silence_limit``."""


def _on_metrics(ctx: Context, gpu: Gpu, m: pb.StepMetrics, replayed: bool) -> None:
    s = ctx.s
    s.last_progress = ctx.now
    s.reforms = 0
    s.reported[gpu] = max(s.reported.get(gpu, 0), m.generation)
    _check_running(ctx)
    s.holdings[gpu] = s.holdings.get(gpu, Holdings()).completed_step(m.generation)
    _check_base_held(ctx, gpu)
    s.next_step = max(s.next_step, m.step + 1)
    _stepped(ctx, gpu, m.generation, m.step)
    s.recent_step_s = [*s.recent_step_s[-(RECENT_STEPS - 1) :], m.step_time_s]
    # Replayed or not: the lost master may have died before logging the step, and ``Progress`` drops a
    # step it (or the lost master, ``progress.logged_steps``) logged already.
    ctx.effects.append(ProgressMetrics(m))


def _check_running(ctx: Context) -> None:
    s = ctx.s
    if s.running == s.generation:
        return  # once per generation, not a pass over every rank on every report
    current = s.current_view()
    if current is not None and all(s.reported.get(gpu, 0) >= s.generation for gpu in current.ranks):
        s.running = max(s.running, s.generation)


def _stepped(ctx: Context, gpu: Gpu, generation: int, step: int, seen_at: float | None = None) -> None:
    """``gpu`` reported ``step`` of ``generation``: the evidence ``detector.silent_reporters`` weighs (from
    ``seen_at``, now by default)."""
    s = ctx.s
    s.latest_step[gpu] = max(s.latest_step.get(gpu, (0, -1)), (generation, step))
    s.step_seen.setdefault((generation, step), ctx.now if seen_at is None else seen_at)


def _on_phase(ctx: Context, gpu: Gpu, p: pb.PhaseDone, replayed: bool) -> None:
    s = ctx.s
    if p.phase == "holding":  # a hold point (tests, --inject @phase:P): what the injector fires on
        ctx.record(
            "holding", node=gpu[0], local_rank=gpu[1], generation=p.generation, point=p.message, seconds=p.seconds
        )
        return
    s.last_progress = ctx.now
    if p.phase == "aborted" and p.bad_checkpoint and p.generation == s.generation:
        if _checkpoint_unreadable(ctx, gpu, p):
            return
    if p.phase == "aborted" and p.generation == s.generation and s.abandoned is None:
        s.abandoned = (ctx.now, p.message.splitlines()[0] if p.message else "no message")
    s.reported[gpu] = max(s.reported.get(gpu, 0), p.generation)
    _check_running(ctx)
    holdings = s.holdings.get(gpu, Holdings())
    if p.phase == "states_copied":
        s.holdings[gpu] = holdings.adopted(p.generation)
    elif p.phase == "resumed":
        s.holdings[gpu] = holdings.completed_step(p.generation)
        _check_base_held(ctx, gpu)
    if not replayed:  # the lost master logged that phase already
        gen = s.gens.get(p.generation)
        rank = None if gen is None else gen.view.ranks.get(gpu)
        ctx.effects.append(ProgressPhase(gpu[0], gpu[1], rank, p))


def _checkpoint_unreadable(ctx: Context, gpu: Gpu, p: pb.PhaseDone) -> bool:
    """The checkpoint the master chose for the current generation cannot be read (issue 56): the run's fault,
    never the user's. Forgotten; the generation's abandoned iteration then restarts from a newer checkpoint,
    and with none left the job stops with exit 3, saying so. True when it stopped."""
    s = ctx.s
    if p.bad_checkpoint in ctx.s.checkpoints.unreadable:
        return False  # another worker's report of it
    s.checkpoints.unreadable.add(p.bad_checkpoint)
    ctx.record(
        "checkpoint_unreadable",
        dir=p.bad_checkpoint,
        node=gpu[0],
        local_rank=gpu[1],
        generation=p.generation,
        message=p.message,
    )
    last = s.checkpoints.last
    if last is not None and last[0] != p.bad_checkpoint:
        ctx.because(f"{p.bad_checkpoint} cannot be read; the restart takes the newer {last[0]}")
        return False
    s.checkpoints.last = None
    options = ctx.cfg.options
    why = p.message.splitlines()[0] if p.message else "no message"
    headline = (
        f"cannot restart: the checkpoint {p.bad_checkpoint} that generation {p.generation} was told to "
        f"load cannot be read ({why}), and no other complete checkpoint of this run is left"
    )
    if options.resume_dir:  # true, if costly: the steps since that resume are lost
        finish(
            ctx,
            ExitCode.NO_REPLICAS,
            f"{headline}.\nThe run started from {options.resume_dir}; the steps since "
            f"are lost. resume with: {options.resume_command} --resume "
            f"{options.resume_dir}",
        )
    else:
        finish(
            ctx,
            ExitCode.NO_REPLICAS,
            f"{headline}. No checkpoint to resume from: the run starts again with {options.resume_command}",
        )
    return True


def _check_base_held(ctx: Context, gpu: Gpu) -> None:
    """A survivor that the current generation takes states from its base completed a step of a newer
    generation: it dropped the base, so the current generation cannot start (each such survivor abandons
    it, ``WorkerLoop.adopt``). The master planned it from the generation before a join that the workers
    switched to meanwhile (its reports had not come; under churn, with the generation's sends queued behind
    its journal). Re-formed now from what the workers hold, not after ``reform_after`` (3 s in
    ``tests/e2e/test_recovery.py``'s reproduction) of waiting for a loss that will not come."""
    s = ctx.s
    current, held = s.gens.get(s.generation), s.holdings[gpu].held()
    if current is None or current.base <= 0 or s.abandoned is not None or s.generation in held:
        return
    base = s.gens.get(current.base)
    if current.base in held or gpu not in current.view.ranks or base is None or gpu not in base.view.ranks:
        return  # still holds the base; or not a survivor the generation takes states from
    why = (
        f"{gpu[0]} completed a step of generation {max(held)} and no longer holds generation {current.base}, "
        f"which generation {s.generation} was planned from"
    )
    s.abandoned = (ctx.now - ctx.cfg.timeouts.reform_after.total_seconds(), why)
    ctx.record(
        "base_dropped", generation=s.generation, base=current.base, node=gpu[0], local_rank=gpu[1], holds=sorted(held)
    )
    ctx.because(why + ": re-form now")


def _on_ready(ctx: Context, entry, local_rank: int, ready: pb.WorkerReady) -> None:
    if local_rank in entry.ready:
        return
    entry.ready.add(local_rank)
    if not entry.all_ready:
        return
    joining = ctx.s.phase in TRAINING and not ctx.s.in_plan(entry.name)
    ctx.record("node_ready", node=entry.name, startup_s=ready.startup_s, joining=joining)
    bench = ctx.s.benched.get(entry.name)
    if joining and bench is not None and ctx.now < bench.until:
        ctx.say(
            f"node {entry.name}'s fresh workers are ready (started in {ready.startup_s:.1f} s): it joins "
            f"once its bench ends, in {bench.until - ctx.now:.0f} s"
        )
    elif joining:
        ctx.say(
            f"node {entry.name} ready (its workers started in {ready.startup_s:.1f} s): it joins at the "
            "next step boundary"
        )


def _worker_failure(ctx: Context, ev: WorkerFailure) -> None:
    ctx.s.next_detection = float("-inf")  # the next tick looks
    entry = ctx.s.registry.live(ev.node, ev.session)
    if entry.worker_failure is None:
        entry.worker_failure = ev.reason
        entry.detail = f"local rank {ev.local_rank}: {ev.message}"


def _leave(ctx: Context, ev: Leave) -> None:
    """A preemption notice: plan the node out at the next iteration boundary while it still holds
    its state (its layers are copied off it if it has the last copies), then dismiss it."""
    s = ctx.s
    entry = s.registry.live(ev.node, ev.session)
    if entry.leaving:
        ctx.because(f"{ev.node} already gave notice")
        return
    entry.leaving = ev.reason or "preemption notice"
    in_plan = s.phase in TRAINING and s.in_plan(ev.node)
    ctx.record(
        "leaving", node=ev.node, reason=entry.leaving, phase=s.phase.value, in_plan=in_plan, generation=s.generation
    )
    log.warning("node %s leaves: %s", ev.node, entry.leaving)
    if s.phase is JobPhase.CHECKPOINTING:
        ctx.because("a checkpoint round runs: it decides, and the job ends with it")
    elif s.phase is JobPhase.FINISHED:
        ctx.because("the job is over")
    elif not in_plan:  # waiting, or a spare not planned yet: nothing of the job's is on it
        generations.dismiss(ctx, ev.node, "left before it was planned in")
    else:
        s.settle_until = ctx.now + SETTLE_S  # a zone's notices come together
        ctx.say(
            f"node {ev.node} leaves ({entry.leaving}): planning generation {s.generation + 1} "
            "without it, at the next step boundary"
        )
        add_to_incident(ctx, "left", ev.node)


def _stop_requested(ctx: Context, ev: StopRequested) -> None:
    stopping.request_stop(ctx, ev.reason)


def _finish_requested(ctx: Context, ev: FinishRequested) -> None:
    finish(ctx, ev.exit_code, ev.message)


def _plan_answered(ctx: Context, ev: PlanAnswered) -> None:
    generations.apply(ctx, ev)
    _advance(ctx)


def _straggler(ctx: Context, ev: Straggler) -> None:
    """A verdict given from outside (a test's): applied as the machine's own are (``slow_nodes``)."""
    if slow_nodes.apply(ctx, ev.node, ev.factor, ev.detected):
        _replan_for_speeds(ctx)


def _step_completed(ctx: Context, ev: StepCompleted) -> None:
    """A completed step, judged for stragglers (``slow_nodes``): the verdicts are a function of these events."""
    if slow_nodes.step_completed(ctx, ev):
        _replan_for_speeds(ctx)


def _replan_for_speeds(ctx: Context) -> None:
    if ctx.s.phase in (JobPhase.WAITING, JobPhase.RUNNING):
        generations.maybe_plan(ctx)


def _adopt(ctx: Context, ev: Adopt) -> None:
    adoption.adopt(ctx, ev.journal, ev.seconds_since_start)


# ---------------------------------------------------------------------- the clock
def _tick(ctx: Context, ev: Tick) -> None:
    """Detects failures (at the machine's cadence: ``Tick.detect``), plans when membership changed, checks
    rounds, adoption, the end."""
    s = ctx.s
    detect = ev.detect if ev.detect is not None else ctx.now >= s.next_detection
    if detect:
        s.next_detection = ctx.now + ctx.cfg.timeouts.detector_tick.total_seconds()
    if ctx.s.phase is not JobPhase.FINISHED and detect:
        losses.detect(ctx)
        benching.check_bench_returns(ctx)
    _advance(ctx)


def _advance(ctx: Context) -> None:
    """Everything that may be due after any change: a plan, the end, a stall, a round, adoption."""
    s = ctx.s
    if s.phase in (JobPhase.WAITING, JobPhase.RUNNING):
        generations.maybe_plan(ctx)
    if s.phase is JobPhase.RUNNING and s.planning is None:
        generations.check_done(ctx)
        _check_stall(ctx)
    if s.phase is JobPhase.CHECKPOINTING:
        stopping.check_round(ctx)
    if s.phase is JobPhase.ADOPTING:
        adoption.check_adopted(ctx)


def _check_stall(ctx: Context) -> None:
    """The last resort against a hang nothing else bounds: no progress for ``stall_timeout``."""
    s, limit = ctx.s, ctx.cfg.timeouts.stall_timeout.total_seconds()
    silent = ctx.now - s.last_progress
    if silent > limit:
        finish(
            ctx,
            ExitCode.ERROR,
            f"no progress for {silent:.0f} s (fault_tolerance.stall_timeout {limit:g} s): "
            f"generation {s.generation}, next step {s.next_step}; see the agents' logs",
        )


_HANDLERS: dict[type, Callable[[Context, object], None]] = {
    Register: _register,
    OpenStream: _open_stream,
    StreamEnded: _stream_ended,
    Heartbeat: _heartbeat,
    Report: _report,
    WorkerFailure: _worker_failure,
    Leave: _leave,
    StopRequested: _stop_requested,
    FinishRequested: _finish_requested,
    PlanAnswered: _plan_answered,
    Straggler: _straggler,
    StepCompleted: _step_completed,
    Tick: _tick,
    Adopt: _adopt,
}
"""One handler per event type (a dispatch table, like DeepSpeed's pipeline executor)."""

__all__ = ["SETTLE_S", "Transition", "step"]
