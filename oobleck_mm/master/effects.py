"""What the machine (``oobleck_mm.master.machine``) asks the shell to do: every side effect of a decision, as plain data.

``oobleck_mm.master.coordinator`` carries them out in order: messages into the agents'
outboxes, calls to the planning helper, the journal, checkpoint files, the
event log and the console. A test reads them instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from collections.abc import Mapping
from typing import Any

from oobleck_mm.master.progress import Incident
from oobleck_mm.master.recovery import GenerationView
from oobleck_mm.protocol import oobleck_pb2 as pb
from oobleck_mm.protocol.encoded import EncodedEvent


@dataclass(frozen=True, slots=True)
class Send:
    """Put ``event`` on ``node``'s event stream (ignored if the node has none any more)."""

    node: str
    event: pb.AgentEvent | EncodedEvent
    """A message, or one in wire form (a generation's assignments: ``oobleck_mm/master/assignments.py``)."""


@dataclass(frozen=True, slots=True)
class EndStream:
    """Hang up ``node``'s event stream (after what was sent to it)."""

    node: str


@dataclass(frozen=True, slots=True)
class Record:
    """One line of the structured event log."""

    kind: str
    fields: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Say:
    """One console line."""

    text: str


@dataclass(frozen=True, slots=True)
class AskPlanner:
    """Plan: ``fresh`` on ``names``, or ``reconfigure`` ``base`` (templates for ``template_nodes``)."""

    id: int
    call: str
    names: tuple[str, ...] = ()
    template_nodes: int = 0
    base: Any = None
    lost: tuple[str, ...] = ()
    joined: tuple[str, ...] = ()
    slow: tuple[tuple[str, float], ...] | None = None
    """Slow nodes and their factors: the batch split is planned for their speed (``planning.speed``); ``()``:
    for the templates' own speeds again; None: as the planner splits it (no speed was ever measured)."""
    bench: tuple[str, ...] = ()
    """Slow nodes the planner weighs planning out (``planning.planner.weigh_bench``)."""


@dataclass(frozen=True, slots=True)
class CancelPlan:
    """Call ``id`` answers a membership that changed since: drop it if it has not started."""

    id: int


@dataclass(frozen=True, slots=True)
class WarmPlanner:
    """Build the templates for ``template_nodes`` nodes ahead of the first reconfiguration."""

    template_nodes: int


@dataclass(frozen=True, slots=True)
class WriteJournal:
    """Write ``journal`` (a ``oobleck_mm.master.journal.Journal``; the shell adds its address) before any assignment."""

    journal: Any


@dataclass(frozen=True, slots=True)
class WriteMeta:
    """Complete the checkpoint in ``directory``: its ``meta.json`` (the step, the sampler, the config)."""

    directory: str
    step: int
    written_to: str = ""
    """Where the workers wrote the layer files, when not ``directory``: a checkpoint round's folder is named
    by the step the job was at when it began, and the workers write the step they reached (an iteration in
    flight completes first), so the folder is renamed to the step its meta.json says (issue 54 item 4)."""


@dataclass(frozen=True, slots=True)
class PrepareMeta:
    """Start building what ``meta.json`` records (``checkpointing.start_meta_sampler``: the data order, torch's
    imports, seconds on a busy host) in the background: a checkpoint round began, and the job's exit waits for
    its ``meta.json``. Built when the round's ``WriteMeta`` came instead, it outlasted the master's shutdown
    grace under load and the stop's checkpoint was left without one (and its ``checkpoint_written`` event,
    queued behind it, unwritten)."""


@dataclass(frozen=True, slots=True)
class PruneCheckpoints:
    """Keep the ``keep`` newest complete periodic checkpoints beside ``directory``, and ``pinned``."""

    directory: str
    keep: int
    pinned: tuple[str, ...] = ()
    """Checkpoints a generation was told to load and has not loaded yet (``JobState.pin``): never removed."""


@dataclass(frozen=True, slots=True)
class StartProgress:
    """Progress lines and phase events follow generation ``view`` (``oobleck_mm.master.progress``)."""

    view: GenerationView
    incident: Incident | None
    expected: Mapping[int, float] = field(default_factory=dict)
    """Per rank, the cost model's compute seconds of a step (``oobleck_mm.master.stragglers.expected_compute``)."""


@dataclass(frozen=True, slots=True)
class ProgressMetrics:
    metrics: pb.StepMetrics


@dataclass(frozen=True, slots=True)
class LogStep:
    """Log step ``step`` of ``generation`` (its row: the event log, metrics.csv, the console), judged: the
    nodes flagged slow (None: the straggler rule is off) and each node's latest factor."""

    generation: int
    step: int
    stragglers: int | None
    latest: Mapping[str, float]


@dataclass(frozen=True, slots=True)
class ProgressPhase:
    node: str
    local_rank: int
    rank: int | None
    phase: pb.PhaseDone


@dataclass(frozen=True, slots=True)
class Finished:
    """The job is over with this exit code and message (every stream was told and ended first)."""

    exit_code: int
    message: str


Effect = (
    Send
    | EndStream
    | Record
    | Say
    | AskPlanner
    | CancelPlan
    | WarmPlanner
    | WriteJournal
    | WriteMeta
    | PruneCheckpoints
    | StartProgress
    | ProgressMetrics
    | LogStep
    | ProgressPhase
    | Finished
)
