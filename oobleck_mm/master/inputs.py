"""What the machine (``oobleck_mm.master.machine``) is fed: every event the master can see, as plain data.

The gRPC handlers (``oobleck_mm.master.service`` through ``oobleck_mm.master.coordinator``), the
planning helper and the control thread's clock each turn what they saw into
one of these; ``oobleck_mm.master.machine.step`` decides what it means. Each carries what
its source knew and nothing the machine could read itself: no clock (``step``
is given ``now``), no queue, no socket.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from oobleck_mm.protocol import oobleck_pb2 as pb


@dataclass(frozen=True, slots=True)
class Register:
    """An agent's ``Register`` call; ``session`` is the number the shell drew for it."""

    node: str
    session: int
    gpus: int
    memory_bytes: int = 0
    pid: int = 0
    peer: str = ""
    adopt_generation: int = 0
    """The generation its workers run when it comes back to a restarted master (0: a new agent)."""


@dataclass(frozen=True, slots=True)
class OpenStream:
    node: str
    session: int


@dataclass(frozen=True, slots=True)
class StreamEnded:
    """The node's Subscribe stream ended, whoever ended it."""

    node: str
    session: int


@dataclass(frozen=True, slots=True)
class Heartbeat:
    node: str
    session: int
    at: float
    """The clock when it arrived (the shell collects heartbeats without waiting for the machine)."""


@dataclass(frozen=True, slots=True)
class Report:
    """A worker's report, relayed by its agent (``replayed``: sent again to a restarted master)."""

    node: str
    session: int
    local_rank: int
    report: pb.WorkerReport
    replayed: bool = False


@dataclass(frozen=True, slots=True)
class WorkerFailure:
    """The agent saw a worker exit, turn zombie or stop (a ``detector.WORKER_REASONS`` reason)."""

    node: str
    session: int
    local_rank: int
    reason: str
    message: str


@dataclass(frozen=True, slots=True)
class Leave:
    """A preemption notice: the node goes soon and still holds its state."""

    node: str
    session: int
    reason: str


@dataclass(frozen=True, slots=True)
class StopRequested:
    """A graceful stop (SIGTERM to the master or to ``local``)."""

    reason: str


@dataclass(frozen=True, slots=True)
class FinishRequested:
    """The job ends from outside (a second signal, the local launcher)."""

    exit_code: int
    message: str


@dataclass(frozen=True, slots=True)
class PlanAnswered:
    """The planner answered call ``id`` (``outcome``: a ``planning.planner.PlanOutcome``), or raised ``error``."""

    id: int
    outcome: Any = None
    error: str = ""


@dataclass(frozen=True, slots=True)
class Straggler:
    """A verdict of ``oobleck_mm.master.stragglers`` on a node's speed: slow by ``factor`` (``detected``: found slow, or
    its factor changed), or no longer."""

    node: str
    factor: float
    detected: bool
    step: int = -1


@dataclass(frozen=True, slots=True)
class StepCompleted:
    """Every rank of ``generation`` reported ``step`` (the shell's progress collects the reports): each rank's
    compute against its prediction, which the machine judges (``oobleck_mm.master.slow_nodes``)."""

    generation: int
    step: int
    ranks: tuple  # of ``oobleck_mm.master.stragglers.RankCompute``


@dataclass(frozen=True, slots=True)
class Tick:
    """The clock moved: detect failures, plan, check rounds, adoption, the end."""

    detect: bool | None = None
    """Look for silent and failed nodes (every node's health: O(nodes)): None (the shell's ticks) lets the
    machine's cadence decide: every ``detector_tick``, and at the first tick after a node's health changed (a
    stream ended, a worker failed: a kill is seen at once). The shell ticks on every change (a registration, a
    report): at 4,000 nodes a detection per registration made the start-up quadratic (26 s to register,
    heartbeats unread meanwhile). True or False: forced (the model's tests)."""


@dataclass(frozen=True, slots=True)
class Adopt:
    """A restarted master (``--resume-master``) takes over the generations of its journal."""

    journal: Any
    """A ``oobleck_mm.master.journal.Journal``."""
    seconds_since_start: float
    """Wall seconds since the lost master planned generation 1 (the run is timed from it)."""


Event = (
    Register
    | OpenStream
    | StreamEnded
    | Heartbeat
    | Report
    | WorkerFailure
    | Leave
    | StopRequested
    | FinishRequested
    | PlanAnswered
    | Straggler
    | StepCompleted
    | Tick
    | Adopt
)
