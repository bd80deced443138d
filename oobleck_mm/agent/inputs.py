"""What happens to an agent, as the events of its machine (``oobleck_mm.agent.machine``).

The shell (``oobleck_mm.agent.agent``) turns what its threads put in its inbox (the master's stream, the
heartbeat, the reports thread, signal handlers) into these, and feeds the answers to effects that asked the
outside world a question (``AskLeave``, ``TryMaster``, ``Supervise``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from oobleck_mm.protocol import oobleck_pb2 as pb


@dataclass(frozen=True, slots=True)
class Share:
    """One worker's answer to ``MasterLost``: the step it wrote (``error`` set, or step < 0: nothing)."""

    step: int
    dir: str = ""
    error: str = ""

    @property
    def written(self) -> bool:
        return not self.error and self.step >= 0


@dataclass(frozen=True, slots=True)
class Shutdown:
    """The master's Shutdown: the job ended, or (``at_boundary``) this node is planned out after its notice."""

    shutdown: pb.Shutdown


@dataclass(frozen=True, slots=True)
class Assign:
    local_rank: int
    assignment: pb.Assignment


@dataclass(frozen=True, slots=True)
class Checkpoint:
    command: pb.Checkpoint


@dataclass(frozen=True, slots=True)
class Restart:
    """Restart-mode recovery: fresh worker processes (started by the next assignment) load the checkpoint."""

    reason: str


@dataclass(frozen=True, slots=True)
class Bench:
    reason: str


@dataclass(frozen=True, slots=True)
class MasterLost:
    """The stream ended, the master was silent too long, or it no longer knows this node (NOT_FOUND)."""

    session: str
    why: str


@dataclass(frozen=True, slots=True)
class Fatal:
    """The shell cannot go on under registration ``session`` (its reports thread failed)."""

    session: str
    why: str


@dataclass(frozen=True, slots=True)
class Signal:
    signum: int


@dataclass(frozen=True, slots=True)
class LeaveAnswered:
    """The master's answer to ``AskLeave``."""

    accepted: bool
    error: str = ""


@dataclass(frozen=True, slots=True)
class MasterAnswers:
    """A lost master answers again: the same one (``session`` None, it still knows this registration) or a
    restarted one that took a new registration (``adopted``: it took this node's workers as they are)."""

    session: str | None
    adopted: bool = True


@dataclass(frozen=True, slots=True)
class WorkerEnded:
    """A worker's pipe closed: supervision says why, now."""

    local_rank: int


@dataclass(frozen=True, slots=True)
class WorkerFailed:
    """Supervision found a worker dead, a zombie or stopped (``kind``: a ``pb.WorkerFailure``)."""

    local_rank: int
    kind: int
    reason: str
    message: str


@dataclass(frozen=True, slots=True)
class Saved:
    """A worker's ``CheckpointDone`` while the master is gone for good."""

    local_rank: int
    share: Share


@dataclass(frozen=True, slots=True)
class Tick:
    """Time passed with nothing else to say."""


Event = Union[
    Shutdown,
    Assign,
    Checkpoint,
    Restart,
    Bench,
    MasterLost,
    Fatal,
    Signal,
    LeaveAnswered,
    MasterAnswers,
    WorkerEnded,
    WorkerFailed,
    Saved,
    Tick,
]


def from_inbox(kind: str, value) -> Event:
    """An inbox item (put there by a thread or a signal handler) as the machine's event."""
    if kind == "event":
        which = value.WhichOneof("event")
        if which == "shutdown":
            return Shutdown(value.shutdown)
        if which == "assignment":
            return Assign(value.assignment.local_rank, value.assignment.assignment)
        if which == "checkpoint":
            return Checkpoint(value.checkpoint)
        if which == "restart":
            return Restart(value.restart.reason)
        if which == "bench":
            return Bench(value.bench.reason)
        return Tick()  # a kind this agent does not know: nothing to do
    if kind == "master_lost":
        return MasterLost(*value)
    if kind == "fatal":
        return Fatal(*value)
    if kind == "signal":
        return Signal(value)
    if kind == "worker_eof":
        return WorkerEnded(value)
    if kind == "saved":
        local_rank, done = value
        return Saved(local_rank, Share(done.step, done.dir, done.error))
    return Tick()
