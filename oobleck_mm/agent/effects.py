"""What the agent's machine (``oobleck_mm.agent.machine``) asks its shell to do, as plain data.

``oobleck_mm.agent.agent`` carries them out in order (worker processes, their pipes, the master's RPCs,
log lines); a test reads them instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from oobleck_mm.protocol import oobleck_pb2 as pb


@dataclass(frozen=True, slots=True)
class StartWorker:
    local_rank: int


@dataclass(frozen=True, slots=True)
class SendAssignment:
    local_rank: int
    assignment: pb.Assignment


@dataclass(frozen=True, slots=True)
class SendAll:
    """A command to every worker of the node."""

    command: pb.WorkerCommand


@dataclass(frozen=True, slots=True)
class StopWorkers:
    """``stop_all`` the workers (blocking up to ``grace``); ``forget``: they are replaced after (a bench)."""

    grace: float
    shutdown: pb.Shutdown
    drain: bool
    forget: bool = False


@dataclass(frozen=True, slots=True)
class KillWorkers:
    pass


@dataclass(frozen=True, slots=True)
class Quiet:
    """No more heartbeats or reports: the master is going away."""


@dataclass(frozen=True, slots=True)
class AskLeave:
    """Call the master's Leave (answered by ``LeaveAnswered``)."""


@dataclass(frozen=True, slots=True)
class ReportFault:
    local_rank: int
    kind: int
    message: str


@dataclass(frozen=True, slots=True)
class HoldReports:
    """The master is lost: workers' reports are kept for the next master (``agent.reports``)."""


@dataclass(frozen=True, slots=True)
class CollectShares:
    """The workers' ``CheckpointDone`` reports come to the machine (``Saved``) from now on."""


@dataclass(frozen=True, slots=True)
class TryMaster:
    """One try to reach a master again (answered by ``MasterAnswers`` when one answers)."""


@dataclass(frozen=True, slots=True)
class Rejoin:
    """A master answers: replay the held reports, then talk to it (a new stream if ``session`` is new)."""

    session: str | None
    adopted: bool
    waited: float


@dataclass(frozen=True, slots=True)
class Supervise:
    """Check every worker process (answered by ``WorkerFailed`` for the first one found failed)."""


@dataclass(frozen=True, slots=True)
class Log:
    level: int
    text: str


@dataclass(frozen=True, slots=True)
class Exit:
    code: int


Effect = Union[
    StartWorker,
    SendAssignment,
    SendAll,
    StopWorkers,
    KillWorkers,
    Quiet,
    AskLeave,
    ReportFault,
    HoldReports,
    CollectShares,
    TryMaster,
    Rejoin,
    Supervise,
    Log,
    Exit,
]
