"""What an agent keeps of its workers' reports so that a restarted master learns what the lost one knew.

The master knows the states each worker holds (``oobleck_mm.master.recovery.Holdings``),
the step the job is at and which periodic checkpoints completed only from the
workers' reports. When it dies, that knowledge dies with it, while the workers
train on. So the agent keeps, per worker, its latest report of each kind that
feeds that knowledge (``latest``) and, while no master listens, every report in
order (``unsent``). Registered again with a restarted master, it replays both:
the latest ones flagged ``replayed`` (the lost master may have seen them: they
update the master's facts but log no step twice), then the unsent ones as they
came. Pure bookkeeping, no gRPC: ``oobleck_mm.agent.agent`` sends what ``replay`` returns.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from oobleck_mm.protocol import oobleck_pb2 as pb

MAX_UNSENT = 100_000
"""Reports kept while no master listens (about one per worker and step): a day of steps at 1 s. Past it
the oldest go; the newest of each kind is kept in ``latest`` anyway, so the master's facts stay right
and only old step lines are missing from its log."""


@dataclass(frozen=True, slots=True)
class Pending:
    seq: int
    local_rank: int
    report: pb.WorkerReport
    replayed: bool


def replay_key(local_rank: int, report: pb.WorkerReport) -> tuple | None:
    """Which of a worker's reports a later one of the same key supersedes; None: not replayed.

    Phases are kept one per name (``states_copied`` and ``resumed`` say different things about the
    states held); stalls, failures and hold points are about a moment that has passed.
    """
    kind = report.WhichOneof("report")
    if kind in ("metrics", "done", "ready", "checkpoint_done"):
        return (local_rank, kind)
    if kind == "phase" and report.phase.phase != "holding":
        return (local_rank, kind, report.phase.phase)
    return None


class ReportLog:
    """Not thread-safe: the agent calls it under its reports lock."""

    def __init__(self) -> None:
        self._seq = 0
        self._latest: dict[tuple, Pending] = {}
        self._unsent: deque[Pending] = deque(maxlen=MAX_UNSENT)

    def record(self, local_rank: int, report: pb.WorkerReport) -> int:
        """Notes a report forwarded (or about to be); returns its sequence number."""
        self._seq += 1
        key = replay_key(local_rank, report)
        if key is not None:
            self._latest[key] = Pending(self._seq, local_rank, report, replayed=True)
        return self._seq

    def hold(self, seq: int, local_rank: int, report: pb.WorkerReport) -> None:
        """A report no master took (none listens, or the call failed): sent on the next registration."""
        self._unsent.append(Pending(seq, local_rank, report, replayed=False))

    def replay(self, latest: bool = True) -> list[Pending]:
        """What a newly registered master gets, in the order the workers sent them: the unsent reports,
        and (``latest``) the latest of each kind that some master took, flagged replayed. Empties
        ``unsent``."""
        unsent = {p.seq for p in self._unsent}
        sent = [p for p in self._latest.values() if latest and p.seq not in unsent]
        out = sorted([*sent, *self._unsent], key=lambda p: p.seq)
        self._unsent.clear()
        return out

    @property
    def unsent(self) -> int:
        return len(self._unsent)
