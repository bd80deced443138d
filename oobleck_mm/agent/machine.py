"""The agent's decisions as one pure state machine: ``step(state, event, now, settings) -> Transition``.

The master's shape (``oobleck_mm.master.machine``) for the node agent: every
decision of ``oobleck_mm.agent.agent`` is taken here, from the node's state,
one event and the clock reading it is given; what must happen outside (start,
command, stop or kill workers, call the master, log a line, exit) comes back
as effects for the shell to carry out in order. No threads, gRPC, signals,
clocks or processes: the same events always give the same effects, which is
what ``tests/unit/test_agent_machine.py`` relies on to explore thousands of
orders of worker exits, stream ends, NOT_FOUND heartbeats, a master gone and
back, notices, shutdowns and checkpoint shares.

Events come from the shell's threads (the master's stream, the heartbeat,
the reports thread, signal handlers) through its inbox, or answer an effect
that needed the outside world (``AskLeave`` -> ``LeaveAnswered``, ``TryMaster``
-> ``MasterAnswers``, ``Supervise`` -> ``WorkerFailed``). After every event the
machine checks its clocks (``_timers``): each waiting state has a deadline
(``master_timeout``, ``preempt_grace``, the write without a master), so
nothing waits forever.

A SIGTERM is a preemption notice (what spot providers send before reclaiming a
node): the agent asks the master to plan its node out (``Leave``) and goes on
training until the master's Shutdown, which its workers obey at the next
iteration boundary, so the kill that follows loses nothing. Past
``fault_tolerance.preempt_grace`` without that Shutdown, or on a second signal,
it stops like on any other signal.

When the master is lost (its stream breaks, or it is silent past
``master_silence_limit``) the workers train on: nothing of a running
generation needs the master. The agent keeps their reports (``oobleck_mm.agent.reports``)
and tries every heartbeat interval to reach the master again: the same one
(it was only paused: heartbeats answer again) or one restarted with
``--resume-master`` (a new registration naming the generation the workers
run; the kept reports are replayed). Past ``fault_tolerance.master_timeout``
(or on a SIGTERM meanwhile) the workers are told ``MasterLost``: they finish
the iteration in flight and write that step together, and the agent logs the
resume command.

An event that does not fit the state (a loss seen by a thread of an earlier
registration, a fault of a worker already replaced, a stream message while the
workers write without the master) is ignored with a reason, never a crash.
"""

from __future__ import annotations

import logging
import signal
from dataclasses import dataclass, field

from oobleck_mm.agent.effects import (
    AskLeave,
    CollectShares,
    Effect,
    Exit,
    HoldReports,
    KillWorkers,
    Log,
    Quiet,
    Rejoin,
    ReportFault,
    SendAll,
    SendAssignment,
    StartWorker,
    StopWorkers,
    Supervise,
    TryMaster,
)
from oobleck_mm.agent.inputs import (
    Assign,
    Bench,
    Checkpoint,
    Event,
    Fatal,
    LeaveAnswered,
    MasterAnswers,
    MasterLost,
    Restart,
    Saved,
    Share,
    Shutdown,
    Signal,
    Tick,
    WorkerEnded,
    WorkerFailed,
)
from oobleck_mm.errors import ExitCode
from oobleck_mm.protocol import oobleck_pb2 as pb

# ---------------------------------------------------------------------- settings and state


DEFAULT_RESUME_COMMAND = "oobleck-launch master --config CONFIG"
"""Printed before ``--resume DIR`` when the master did not say how it was started."""


@dataclass(frozen=True, slots=True)
class Settings:
    """The timeouts the agent decides with (all from the job's ``fault_tolerance``, in seconds)."""

    interval: float
    """``heartbeat_interval``: supervision of the workers and each try to reach a lost master."""
    master_timeout: float | None
    """How long the workers train on without a master (None: they write the step they are at at once)."""
    preempt_grace: float
    worker_stop: float
    """``worker_stop_timeout``: the workers' grace at the job's end."""
    collective: float
    """``collective_timeout``: bounds a benched node's iteration in flight."""
    write_without_master: float
    """``checkpoint_round_timeout + collective_timeout``: the workers' write of the step they are at."""
    left_exit_code: int = 0
    resume_command: str = DEFAULT_RESUME_COMMAND

    @classmethod
    def of(cls, ft, left_exit_code: int = 0, resume_command: str = "") -> Settings:
        """From a ``FaultToleranceConfig``."""
        return cls(
            interval=ft.heartbeat_interval.total_seconds(),
            master_timeout=ft.master_timeout.total_seconds() if ft.master_timeout is not None else None,
            preempt_grace=ft.preempt_grace.total_seconds(),
            worker_stop=ft.worker_stop_timeout.total_seconds(),
            collective=ft.collective_timeout.total_seconds(),
            write_without_master=(ft.checkpoint_round_timeout + ft.collective_timeout).total_seconds(),
            left_exit_code=left_exit_code,
            resume_command=resume_command or DEFAULT_RESUME_COMMAND,
        )


@dataclass(slots=True)
class Writing:
    """The master is gone for good: the workers write the step they are at (``MasterLost``)."""

    deadline: float
    expected: frozenset[int]
    saved: dict[int, Share] = field(default_factory=dict)


@dataclass(slots=True)
class AgentState:
    session: str
    """This node's registration with the master now (a thread of an older one is not listened to)."""
    workers: set[int] = field(default_factory=set)
    """Local ranks with a worker process started and not yet stopped or killed."""
    assigned: bool = False
    """Some work reached the workers (there is a step to write if the master is lost)."""
    generation: int = 0
    """The newest generation assigned (``RegisterRequest.adopt_generation``)."""
    leave_by: float | None = None
    """Deadline of a preemption notice the master took; None: no notice."""
    orphaned_at: float | None = None
    """Since when the master is lost while the workers train on; None: a master listens."""
    next_try: float = 0.0
    next_check: float = 0.0
    writing: Writing | None = None
    exit_code: int | None = None
    """Set once: the agent exits with it (the shell's clean-up kills whatever is left)."""

    @property
    def waiting(self) -> bool:
        """Waiting on a deadline: for a master, for the plan-out after a notice, for the workers' write."""
        return self.orphaned_at is not None or self.leave_by is not None or self.writing is not None


def registered(session: str, gpus: int, now: float, settings: Settings) -> Transition:
    """The state right after the master took the registration: every worker starts now, not on the first
    assignment (they import and warm up while the job plans, or before a joining node is admitted)."""
    state = AgentState(session=session, next_check=now + settings.interval)
    ctx = _Context(state, settings, now)
    for local_rank in range(gpus):
        ctx.start_worker(local_rank)
    return ctx.transition()


@dataclass(frozen=True, slots=True)
class Transition:
    state: AgentState
    effects: tuple[Effect, ...]
    reason: str


# ---------------------------------------------------------------------- the machine


class _Context:
    def __init__(self, state: AgentState, settings: Settings, now: float) -> None:
        self.state, self.settings, self.now = state, settings, now
        self.effects: list[Effect] = []
        self.reasons: list[str] = []

    def because(self, why: str) -> None:
        self.reasons.append(why)

    def say(self, level: int, text: str) -> None:
        self.effects.append(Log(level, text))

    def start_worker(self, local_rank: int) -> None:
        self.state.workers.add(local_rank)
        self.effects.append(StartWorker(local_rank))

    def exit(self, code: int, why: str) -> None:
        self.state.exit_code = int(code)
        self.state.leave_by = self.state.orphaned_at = self.state.writing = None
        self.because(why)
        self.effects.append(Exit(int(code)))

    def transition(self) -> Transition:
        return Transition(self.state, tuple(self.effects), "; ".join(self.reasons))


def step(state: AgentState, event: Event, now: float, settings: Settings) -> Transition:
    """Applies ``event`` seen at clock ``now`` (changes ``state`` in place); the effects, in order, and why."""
    ctx = _Context(state, settings, now)
    if state.exit_code is not None:
        ctx.because(f"exiting ({state.exit_code}): {type(event).__name__} ignored")
        return ctx.transition()
    handler = _HANDLERS.get(type(event))
    if handler is None:  # a programming error in the shell, not an event order
        raise TypeError(f"the agent's machine has no handler for {type(event).__name__}")
    if state.writing is not None and type(event) not in _WHILE_WRITING:
        ctx.because(f"{type(event).__name__} ignored: the workers write the step they are at")
    else:
        handler(ctx, event)
    if state.exit_code is None:
        _timers(ctx)
    return ctx.transition()


def _timers(ctx: _Context) -> None:
    """The clocks, checked after every event (the shell ticks at least every 0.1 s)."""
    state, now = ctx.state, ctx.now
    if state.writing is not None:
        if now >= state.writing.deadline:
            _end_write(ctx, "the write's deadline passed")
        return  # nothing else is looked at until the workers wrote
    if state.orphaned_at is not None:
        assert ctx.settings.master_timeout is not None  # no master_timeout: lost means writing at once
        waited = now - state.orphaned_at
        if waited > ctx.settings.master_timeout:
            _write_without_master(ctx, f"no master came back within {waited:.0f} s (fault_tolerance.master_timeout)")
            return
        if now >= state.next_try:
            state.next_try = now + ctx.settings.interval
            ctx.effects.append(TryMaster())
    if state.leave_by is not None and now > state.leave_by:
        ctx.say(
            logging.ERROR,
            f"not planned out within fault_tolerance.preempt_grace ({ctx.settings.preempt_grace:.0f} s) of the "
            "preemption notice; stopping the node's workers",
        )
        ctx.exit(ExitCode.ERROR, "the notice's grace passed")
        return
    if now >= state.next_check:
        state.next_check = now + ctx.settings.interval
        ctx.effects.append(Supervise())


def _on_shutdown(ctx: _Context, event: Shutdown) -> None:
    shutdown, state, settings = event.shutdown, ctx.state, ctx.settings
    ctx.say(logging.INFO, f"shutdown from the master: {shutdown.reason}")
    grace = settings.worker_stop
    if shutdown.at_boundary:  # planned out after our notice: the iteration in flight ends first
        grace = max(grace, (state.leave_by or 0.0) - ctx.now)
    else:
        ctx.effects.append(Quiet())
    ctx.effects.append(StopWorkers(grace, shutdown, drain=shutdown.at_boundary))
    if shutdown.at_boundary:  # (otherwise quiet already)
        ctx.effects.append(Quiet())
    state.workers.clear()
    if shutdown.at_boundary and settings.left_exit_code:
        ctx.say(logging.INFO, f"left the job after the notice: exit {settings.left_exit_code} (--left-exit-code)")
        ctx.exit(settings.left_exit_code, "planned out after the notice")
        return
    ctx.exit(ExitCode.OK, "the master's shutdown")


def _on_assign(ctx: _Context, event: Assign) -> None:
    state = ctx.state
    state.assigned = True
    state.generation = max(state.generation, event.assignment.generation)
    if event.local_rank not in state.workers:  # restart mode killed it: a fresh one loads the checkpoint
        ctx.start_worker(event.local_rank)
    ctx.effects.append(SendAssignment(event.local_rank, event.assignment))
    ctx.because(f"generation {event.assignment.generation} to worker {event.local_rank}")


def _on_checkpoint(ctx: _Context, event: Checkpoint) -> None:
    # Every worker of the node writes its share; each answers CheckpointDone on its own.
    ctx.effects.append(SendAll(pb.WorkerCommand(checkpoint=event.command)))


def _on_restart(ctx: _Context, event: Restart) -> None:
    ctx.say(logging.WARNING, f"restarting the node's workers: {event.reason}")
    ctx.effects.append(KillWorkers())
    ctx.state.workers.clear()


def _on_bench(ctx: _Context, event: Bench) -> None:
    """Planned out for being slow (issue 29): the workers finish the iteration in flight, as on a leave after
    a notice, and fresh ones start at once, so that the node is ready when the master takes it back. The node
    stays registered and heartbeats all along: a bench is not a failure."""
    state = ctx.state
    ctx.say(
        logging.WARNING,
        f"benched: {event.reason}; the workers stop at the iteration boundary, fresh ones wait to join again",
    )
    # A slow node's iteration in flight is bounded like any collective of the job.
    shutdown = pb.Shutdown(reason=event.reason, at_boundary=True)
    ctx.effects.append(StopWorkers(ctx.settings.collective, shutdown, drain=True, forget=True))
    ranks = sorted(state.workers)
    state.workers.clear()
    state.assigned, state.generation = False, 0  # the fresh workers hold nothing of the job yet
    for local_rank in ranks:
        ctx.start_worker(local_rank)


def _current(ctx: _Context, session: str, what: str) -> bool:
    """A thread of this registration, about a loss not known yet."""
    if session != ctx.state.session:
        ctx.because(f"{what} of an earlier registration ({session}) ignored")
        return False
    if ctx.state.orphaned_at is not None:
        ctx.because(f"{what} ignored: the master is known lost")
        return False
    return True


def _on_master_lost(ctx: _Context, event: MasterLost) -> None:
    if not _current(ctx, event.session, "a loss of the master"):
        return
    if ctx.settings.master_timeout is None:
        _write_without_master(ctx, event.why)
        return
    # Assigned or not (a joiner not admitted yet): a restarted master takes it as it was.
    ctx.state.orphaned_at = ctx.now
    ctx.state.next_try = ctx.now
    ctx.effects.append(HoldReports())
    ctx.say(
        logging.ERROR,
        f"{event.why}; the workers train on while this agent waits up to {ctx.settings.master_timeout:.0f} s "
        "(fault_tolerance.master_timeout) for the master, or one restarted with: oobleck-launch master "
        "--resume-master RUN_DIR; then they write the step they are at",
    )


def _on_fatal(ctx: _Context, event: Fatal) -> None:
    if not _current(ctx, event.session, "a fatal error"):
        return
    ctx.say(logging.ERROR, f"{event.why}; stopping the node's workers")
    ctx.exit(ExitCode.ERROR, "fatal")


def _on_signal(ctx: _Context, event: Signal) -> None:
    state = ctx.state
    if state.writing is not None:  # stop waiting: what was written is what there is
        _end_write(ctx, f"{signal.Signals(event.signum).name} while the workers write")
        return
    if event.signum == signal.SIGTERM and state.orphaned_at is not None:  # a notice, and no master to plan
        _write_without_master(ctx, "a preemption notice (SIGTERM) while the master is away")
        return
    if event.signum == signal.SIGTERM and state.leave_by is None:
        ctx.effects.append(AskLeave())
        ctx.because("a preemption notice: the master is asked to plan this node out")
        return
    ctx.say(logging.WARNING, f"got {signal.Signals(event.signum).name}; stopping the node's workers")
    ctx.exit(ExitCode.ERROR, "a signal")


def _on_leave_answered(ctx: _Context, event: LeaveAnswered) -> None:
    if not event.accepted:
        ctx.say(logging.ERROR, f"preemption notice: the master did not take it ({event.error})")
        ctx.say(logging.WARNING, "got SIGTERM; stopping the node's workers")
        ctx.exit(ExitCode.ERROR, "the notice was not taken")
        return
    grace = ctx.settings.preempt_grace
    ctx.state.leave_by = ctx.now + grace
    ctx.say(
        logging.WARNING,
        "preemption notice (SIGTERM): leaving the job at the next step boundary; the workers stop in "
        f"{grace:.0f} s at the latest (fault_tolerance.preempt_grace); another signal stops them now",
    )


def _on_master_answers(ctx: _Context, event: MasterAnswers) -> None:
    state = ctx.state
    if state.orphaned_at is None:
        ctx.because("a master's answer ignored: none was lost")
        return
    waited = ctx.now - state.orphaned_at
    state.orphaned_at = None
    if event.session is not None:
        state.session = event.session
    ctx.effects.append(Rejoin(event.session, event.adopted, waited))
    ctx.because("a master answers again")


def _on_worker_ended(ctx: _Context, event: WorkerEnded) -> None:
    ctx.state.next_check = ctx.now  # supervision says why, now (``_timers``)


def _on_worker_failed(ctx: _Context, event: WorkerFailed) -> None:
    if event.local_rank not in ctx.state.workers:
        ctx.because(f"a fault of worker {event.local_rank}, which is not running, ignored")
        return
    ctx.say(logging.ERROR, f"worker {event.local_rank} failed: {event.reason} ({event.message}); the node is lost")
    ctx.effects.append(ReportFault(event.local_rank, event.kind, event.message))
    ctx.exit(ExitCode.ERROR, "a worker failed")


def _on_saved(ctx: _Context, event: Saved) -> None:
    writing = ctx.state.writing
    if writing is None or event.local_rank not in writing.expected:
        ctx.because(f"a share of worker {event.local_rank} nobody waits for ignored")
        return
    writing.saved[event.local_rank] = event.share
    if len(writing.saved) == len(writing.expected):
        _end_write(ctx, "every worker answered")


def _on_tick(ctx: _Context, event: Tick) -> None:
    pass


def _write_without_master(ctx: _Context, why: str) -> None:
    """The master is gone: the workers finish the iteration in flight and write the step they are at together
    (``MasterLost``), so the run resumes from it instead of from nothing."""
    state = ctx.state
    state.orphaned_at = state.leave_by = None
    if not state.assigned:
        ctx.say(logging.ERROR, f"{why} before any work was assigned; stopping the node's workers")
        ctx.exit(ExitCode.ERROR, "lost the master with nothing to write")
        return
    if not state.workers:  # restart mode killed them, and no new assignment came
        ctx.say(logging.ERROR, f"{why} with no worker running (restart-mode recovery); stopping")
        ctx.exit(ExitCode.ERROR, "lost the master with no worker to write")
        return
    ctx.say(logging.ERROR, f"{why}; the workers write the step they are at, then stop")
    state.writing = Writing(ctx.now + ctx.settings.write_without_master, frozenset(state.workers))
    ctx.effects.append(CollectShares())
    ctx.effects.append(SendAll(pb.WorkerCommand(master_lost=pb.MasterLost(reason=why))))


def _end_write(ctx: _Context, why: str) -> None:
    writing = ctx.state.writing
    assert writing is not None
    shares = list(writing.saved.values())
    if len(shares) == len(writing.expected) and all(s.written for s in shares):
        where, at = shares[0].dir, shares[0].step
        ctx.say(
            logging.ERROR,
            f"the master is lost; the workers wrote the checkpoint of step {at} to {where}; resume with: "
            f"{ctx.settings.resume_command} --resume {where}",
        )
        ctx.exit(ExitCode.NO_REPLICAS, why)
        return
    errors = "; ".join(s.error for s in shares if s.error) or "no answer from every worker in time"
    ctx.say(logging.ERROR, f"the master is lost and the workers could not write a checkpoint ({errors})")
    ctx.exit(ExitCode.ERROR, why)


_HANDLERS = {
    Shutdown: _on_shutdown,
    Assign: _on_assign,
    Checkpoint: _on_checkpoint,
    Restart: _on_restart,
    Bench: _on_bench,
    MasterLost: _on_master_lost,
    Fatal: _on_fatal,
    Signal: _on_signal,
    LeaveAnswered: _on_leave_answered,
    MasterAnswers: _on_master_answers,
    WorkerEnded: _on_worker_ended,
    WorkerFailed: _on_worker_failed,
    Saved: _on_saved,
    Tick: _on_tick,
}
_WHILE_WRITING = (Saved, Signal, Tick)
"""What the machine listens to while the workers write without a master."""
