"""The worker's decisions as one pure state machine: ``step(state, event) -> Transition``.

The shape of the master's and the agent's machines (``oobleck_mm.master.machine``,
``oobleck_mm.agent.machine``) for the worker process (``oobleck_mm.runtime.agent_worker``): what to do with a
command between generations, at a switch and inside a generation's set-up; when to train the next step,
write a checkpoint share (in the background or together), abandon an iteration, finish a background write,
leave a group, stop. The shell carries out each effect (the rendezvous, the state copy, the step, the
write, the reports) and feeds back what came of it as the next event; no torch, threads, pipes or clocks
here, so ``tests/unit/test_worker_machine.py`` explores thousands of orders of commands (from older
generations too), failing steps, switches and shares.

The worker's guarantees, each an invariant of that test:

- a checkpoint share written in the background is finished and reported before the worker stops or says
  done (``FinishShares``): the job's end killed one midway once, leaving a folder of .tmp files (issue 30);
- ``MasterLost`` is always answered with a ``CheckpointDone``: the step every rank stopped at, written
  together, inside a generation; "nothing written" between generations;
- a failed step (a peer died or hung) abandons the iteration and leaves the group before anything else,
  and the next plan reruns it; a step that does not fit in memory stops the worker (the same after any
  recovery);
- steps run in order from the agreed start, never past the generation's last, none after the stop;
- at a switch (some rank held a command when the step ended) the next command is taken before any
  further step, within ``collective_timeout``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union

from oobleck_mm.protocol import oobleck_pb2 as pb


def drops_peers(command) -> bool:
    """A shutdown, a checkpoint, a plan whose previous generation lost ranks, or a re-form of the same
    ranks (the current generation was abandoned): anything but a join, which the current one outlives,
    or the leave of a node on notice (``at_boundary``), which finishes the iteration in flight."""
    kind = command.WhichOneof("command")
    if kind == "shutdown" and command.shutdown.at_boundary:
        return False  # this node leaves on notice: its peers need it until the iteration ends
    if kind == "master_lost" or (kind == "checkpoint" and command.checkpoint.at_boundary):
        return False  # every peer is still there: the iteration in flight ends, then all checkpoint it
    if kind != "assignment":
        return True
    a = command.assignment
    if not a.previous_generation or a.at_boundary:
        return False
    # Ranks, not stages: a stage of several GPUs (sharded or context-parallel) has a rank per GPU. (Counting
    # stages read a lost node of two-GPU stages as nobody lost: the survivors waited out the collective timeout.)
    old_world = sum(1 + len(s.shards) for p in a.previous_plan.pipelines for s in p.stages)
    kept = len({r for r in a.previous_ranks if r >= 0})
    return kept < old_world or a.world_size == old_world


# ---------------------------------------------------------------------- state


@dataclass(slots=True)
class Running:
    """The generation this worker trains now (from its assignment)."""

    generation: int
    steps: int
    """The job's step count: the generation trains up to ``steps - 1``."""
    checkpoint_interval: int = 0
    checkpoint_after_first_step: bool = False
    checkpoint_dir: str = ""
    checkpoint_async: bool = False
    save_final_dir: str = ""
    start: int | None = None
    """The agreed first step (None: still setting up)."""
    next: int | None = None
    """The next step to train."""
    switch: bool = False
    """Some rank held a command when the last step ended: every rank takes its next command now."""
    final_saved: bool = False

    @classmethod
    def of(cls, a: pb.Assignment) -> Running:
        return cls(
            generation=a.generation,
            steps=a.steps,
            checkpoint_interval=a.checkpoint_interval,
            checkpoint_after_first_step=a.checkpoint_after_first_step,
            checkpoint_dir=a.checkpoint_dir,
            checkpoint_async=a.checkpoint_async,
            save_final_dir=a.save_final_dir,
        )


@dataclass(slots=True)
class WorkerState:
    running: Running | None = None
    """None: between generations (waiting for a command)."""
    committed: int | None = None
    """The last generation in which a step completed (kept until the next one completes one)."""
    stopped: bool = False


# ---------------------------------------------------------------------- events


@dataclass(frozen=True, slots=True)
class Taken:
    """The next command from the agent's pipe (None: the agent is gone)."""

    command: pb.WorkerCommand | None


@dataclass(frozen=True, slots=True)
class Adopted:
    """The generation's set-up (rendezvous, start-step agreement, state copy) ended: train from ``start``."""

    start: int


@dataclass(frozen=True, slots=True)
class Interrupted:
    """A newer command arrived while the rendezvous waited: act on it instead."""

    command: pb.WorkerCommand | None


@dataclass(frozen=True, slots=True)
class SetUpFailed:
    """A peer failed during the set-up (or a checkpoint to resume from could not be read: ``bad_checkpoint``)."""

    message: str
    at_step: int
    bad_checkpoint: str = ""


@dataclass(frozen=True, slots=True)
class StepDone:
    step: int
    switch: bool
    checkpoint_due: bool = False


@dataclass(frozen=True, slots=True)
class StepFailed:
    step: int
    message: str
    out_of_memory: bool = False


@dataclass(frozen=True, slots=True)
class SwitchCommand:
    """What arrived at the switch (``Taken`` semantics), or None within ``collective_timeout``: nothing
    (the master sent this rank nothing: a peer's next step will fail, which aborts the iteration)."""

    command: pb.WorkerCommand | None
    arrived: bool = True


@dataclass(frozen=True, slots=True)
class FinalSaved:
    """The final model is written (or this rank had nothing of it to write)."""


@dataclass(frozen=True, slots=True)
class WriteFailed:
    """A save that every rank takes part in failed (a peer died mid-save): the step stands, the save does not."""

    at_step: int
    message: str


Event = Union[Taken, Adopted, Interrupted, SetUpFailed, StepDone, StepFailed, SwitchCommand, FinalSaved, WriteFailed]

# ---------------------------------------------------------------------- effects


@dataclass(frozen=True, slots=True)
class NextCommand:
    """Wait for the agent's next command (answered by ``Taken``)."""


@dataclass(frozen=True, slots=True)
class AwaitSwitch:
    """Take the next command within ``collective_timeout`` (answered by ``SwitchCommand``)."""


@dataclass(frozen=True, slots=True)
class SetUp:
    """Prepare, rendezvous, agree on the start and copy the states for ``command``'s assignment (answered by
    ``Adopted``, ``Interrupted`` or ``SetUpFailed``)."""

    command: pb.WorkerCommand


@dataclass(frozen=True, slots=True)
class Train:
    """Train ``step`` (answered by ``StepDone`` or ``StepFailed``)."""

    step: int


@dataclass(frozen=True, slots=True)
class Committed:
    """The generation's first completed step: it is the one to keep (``PhaseDone("resumed")``)."""

    generation: int
    step: int


@dataclass(frozen=True, slots=True)
class WriteShare:
    """A periodic checkpoint of step ``step``: in the background (``background``: each layer by one
    holder; ``finish_first``: the previous write must end first) or together (answered by ``WriteFailed``
    when a peer died mid-save)."""

    step: int
    background: bool
    finish_first: bool = False


@dataclass(frozen=True, slots=True)
class SaveFinal:
    """The final model (answered by ``WriteFailed`` when a peer died mid-save)."""


@dataclass(frozen=True, slots=True)
class FinishShares:
    """Wait (bounded by ``checkpoint_round_timeout``) for the background write, which reports itself."""

    when: str


@dataclass(frozen=True, slots=True)
class Abort:
    """Abandon the iteration: discard its gradients, leave the group at once, report ``aborted``."""

    generation: int
    step: int
    message: str
    bad_checkpoint: str = ""
    discard: bool = False
    """The iteration's gradients are discarded first (a step failed inside it)."""


@dataclass(frozen=True, slots=True)
class LeaveGroup:
    pass


@dataclass(frozen=True, slots=True)
class BelowThreshold:
    """The master's below-threshold checkpoint: write the layers this worker owns among the survivors."""

    checkpoint: pb.Checkpoint


@dataclass(frozen=True, slots=True)
class WriteWithoutMaster:
    """Every rank stopped after the same step and the master is gone: write it together and report it."""

    step: int


@dataclass(frozen=True, slots=True)
class ReportNothing:
    """``MasterLost`` between generations: no step every rank agreed on to write (``CheckpointDone(step=-1)``)."""


@dataclass(frozen=True, slots=True)
class ReportDone:
    step: int


@dataclass(frozen=True, slots=True)
class OutOfMemory:
    """The stage does not fit: stop the worker with the error (the same after any recovery)."""

    step: int
    message: str


@dataclass(frozen=True, slots=True)
class Stop:
    pass


Effect = Union[
    NextCommand,
    AwaitSwitch,
    SetUp,
    Train,
    Committed,
    WriteShare,
    SaveFinal,
    FinishShares,
    Abort,
    LeaveGroup,
    BelowThreshold,
    WriteWithoutMaster,
    ReportNothing,
    ReportDone,
    OutOfMemory,
    Stop,
]


@dataclass(frozen=True, slots=True)
class Transition:
    state: WorkerState
    effects: tuple[Effect, ...]
    reason: str = ""


# ---------------------------------------------------------------------- the machine


@dataclass(slots=True)
class _Out:
    effects: list = field(default_factory=list)
    reason: str = ""


def step(state: WorkerState, event: Event) -> Transition:
    """Applies ``event`` to ``state`` (changed in place); the effects to carry out, in order, and why.

    The shell carries the effects out in order; one that is answered (``NextCommand``, ``AwaitSwitch``,
    ``SetUp``, ``Train``, ``SaveFinal``, a ``WriteShare`` that failed) ends the list there: its answer is
    the next event, and what came after it is not done (a failed write abandons the iteration)."""
    out = _Out()
    if state.stopped:
        return Transition(state, (), f"stopped: {type(event).__name__} ignored")
    handler = _HANDLERS.get(type(event))
    if handler is None:  # a programming error in the shell, not an event order
        raise TypeError(f"the worker's machine has no handler for {type(event).__name__}")
    handler(state, event, out)
    return Transition(state, tuple(out.effects), out.reason)


def _stop(state: WorkerState, out: _Out) -> None:
    state.stopped, state.running = True, None
    out.effects.append(Stop())


def _finish_shares(state: WorkerState, out: _Out, when: str) -> None:
    out.effects.append(FinishShares(when))


def _on_taken(state: WorkerState, event: Taken, out: _Out) -> None:
    """A command between generations (or the one a generation ended on)."""
    command = event.command
    if command is None:  # the agent is gone: nobody to report to
        out.reason = "the agent is gone"
        _stop(state, out)
        return
    kind = command.WhichOneof("command")
    if kind == "shutdown":
        _finish_shares(state, out, f"shut down ({command.shutdown.reason})")
        _stop(state, out)
    elif kind == "checkpoint":
        out.effects.extend([BelowThreshold(command.checkpoint), NextCommand()])
    elif kind == "master_lost":
        # A share still written in the background reports itself first: the agent keeps each worker's last
        # answer, and "nothing" must be it (no meta.json completes that share without a master). Found by the
        # model at depth: a step-0 share, the next step failed, then MasterLost between generations.
        _finish_shares(state, out, "the master is lost")
        out.effects.append(ReportNothing())
        _stop(state, out)
    elif kind == "assignment":
        state.running = Running.of(command.assignment)
        out.effects.append(SetUp(command))
    else:
        out.reason = f"an unknown command {kind!r} ignored"
        out.effects.append(NextCommand())


def _on_interrupted(state: WorkerState, event: Interrupted, out: _Out) -> None:
    state.running = None
    _on_taken(state, Taken(event.command), out)


def _abort(state: WorkerState, out: _Out, step: int, message: str, bad: str = "", discard: bool = False) -> None:
    assert state.running is not None
    out.effects.extend([Abort(state.running.generation, step, message, bad, discard), NextCommand()])
    state.running = None


def _on_set_up_failed(state: WorkerState, event: SetUpFailed, out: _Out) -> None:
    _abort(state, out, event.at_step, event.message, event.bad_checkpoint)


def _on_adopted(state: WorkerState, event: Adopted, out: _Out) -> None:
    run = state.running
    assert run is not None
    run.start = run.next = event.start
    _next(state, out)


def _next(state: WorkerState, out: _Out) -> None:
    """What comes after a step (or the set-up): the switch, the next step, or the generation's end."""
    run = state.running
    assert run is not None and run.next is not None
    if run.next >= run.steps:
        _end_generation(state, out)
    elif run.switch:
        out.effects.append(AwaitSwitch())
    else:
        out.effects.append(Train(run.next))


def _on_step_done(state: WorkerState, event: StepDone, out: _Out) -> None:
    run = state.running
    assert run is not None and run.start is not None
    run.next = event.step + 1
    run.switch = event.switch
    if state.committed != run.generation:
        state.committed = run.generation
        out.effects.append(Committed(run.generation, event.step))
    by_steps = run.checkpoint_interval and run.next % run.checkpoint_interval == 0
    again = run.checkpoint_after_first_step and event.step == run.start  # the loss cut the last one short
    if (by_steps or again or event.checkpoint_due) and run.checkpoint_dir:
        # A directory per step: a save cut short by a lost peer leaves a directory without meta.json next
        # to the last complete checkpoint, never a mix of two steps in one.
        out.effects.append(WriteShare(run.next, run.checkpoint_async, finish_first=bool(again)))
    _next(state, out)


def _on_step_failed(state: WorkerState, event: StepFailed, out: _Out) -> None:
    if event.out_of_memory:  # this stage does not fit: the same after any recovery
        out.effects.append(OutOfMemory(event.step, event.message))
        state.stopped, state.running = True, None
        return
    # gloo/NCCL: a peer died, hung past the timeout, or left
    _abort(state, out, event.step, event.message, discard=True)


def _on_switch_command(state: WorkerState, event: SwitchCommand, out: _Out) -> None:
    run = state.running
    assert run is not None and run.next is not None
    run.switch = False
    if not event.arrived:  # the master sent us nothing: a peer's step will fail
        out.reason = "nothing arrived at the switch"
        out.effects.append(Train(run.next))
        return
    command = event.command
    if command is not None and command.WhichOneof("command") == "master_lost":
        _finish_shares(state, out, "the master is lost")  # one writer at a time
        out.effects.extend([WriteWithoutMaster(run.next), LeaveGroup()])
        _stop(state, out)
        return
    out.effects.append(LeaveGroup())
    state.running = None
    _on_taken(state, Taken(command), out)  # a new plan (a join, a leave, a failure elsewhere) or a shutdown


def _on_final_saved(state: WorkerState, event: FinalSaved, out: _Out) -> None:
    assert state.running is not None
    state.running.final_saved = True
    _end_generation(state, out)


def _on_write_failed(state: WorkerState, event: WriteFailed, out: _Out) -> None:
    # Drop whatever the step decided after the write: the iteration is abandoned at the step after it.
    _abort(state, out, event.at_step, event.message)


def _end_generation(state: WorkerState, out: _Out) -> None:
    run = state.running
    assert run is not None
    if run.save_final_dir and not run.final_saved:
        out.effects.append(SaveFinal())  # answered by FinalSaved (or WriteFailed: the next generation saves it)
        return
    _finish_shares(state, out, f"generation {run.generation}")
    out.effects.extend([ReportDone(run.steps - 1), LeaveGroup(), NextCommand()])
    state.running = None


_HANDLERS = {
    Taken: _on_taken,
    Interrupted: _on_interrupted,
    Adopted: _on_adopted,
    SetUpFailed: _on_set_up_failed,
    StepDone: _on_step_done,
    StepFailed: _on_step_failed,
    SwitchCommand: _on_switch_command,
    FinalSaved: _on_final_saved,
    WriteFailed: _on_write_failed,
}
