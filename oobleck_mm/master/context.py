"""One step of the machine in progress: the state, the settings, the clock reading, the effects so far.

``oobleck_mm.master.machine``, ``oobleck_mm.master.generations`` and ``oobleck_mm.master.stopping`` decide
through a ``Context``: they change ``ctx.s`` and append effects. The decisions
all three share (``finish``, incidents, the journal, the base the live nodes
hold) live here, so that the three never import each other in a circle.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from oobleck_mm.master.effects import CancelPlan, Effect, EndStream, Finished, Record, Say, Send, WriteJournal
from oobleck_mm.master.journal import KEEP_GENERATIONS, Journal
from oobleck_mm.master.policies import Facts, policy_for
from oobleck_mm.master.progress import Incident
from oobleck_mm.master.recovery import Base, choose_base
from oobleck_mm.master.registry import Refused
from oobleck_mm.master.state import Finish, JobPhase, JobState, Settings
from oobleck_mm.protocol import oobleck_pb2 as pb
from oobleck_mm.protocol.encoded import EncodedEvent


@dataclass(frozen=True, slots=True)
class Transition:
    """What one event did: the state (the same object, changed), the effects in order, and why."""

    state: JobState
    effects: tuple[Effect, ...]
    reason: str
    answer: Any = None
    """What the caller gets back: (session, gpus) for a registration."""
    refused: Refused | None = None
    """The call was refused (a bad name, a stale session): the gRPC status to answer with."""


class Context:
    def __init__(self, state: JobState, settings: Settings, now: float) -> None:
        self.s, self.cfg, self.now = state, settings, now
        self.policy = policy_for(settings.options.recovery)
        self.effects: list[Effect] = []
        self.reasons: list[str] = []
        self.answer: Any = None
        self.refused: Refused | None = None

    def record(self, kind: str, **fields) -> None:
        self.effects.append(Record(kind, fields))

    def say(self, text: str) -> None:
        self.effects.append(Say(text))

    def send(self, node: str, event: pb.AgentEvent | EncodedEvent) -> None:
        self.effects.append(Send(node, event))

    def because(self, reason: str) -> None:
        self.reasons.append(reason)

    def facts(self, abandoned: bool = False) -> Facts:
        s, options = self.s, self.cfg.options
        current = s.gens.get(s.generation)
        return Facts(
            s.views(),
            s.holdings,
            abandoned,
            s.next_step,
            self.cfg.steps,
            options.resume_dir,
            options.resume_step,
            s.checkpoints.last,
            current.keeps_replicas_from if current is not None else 0,
            s.newer_checkpoint(),
        )

    def transition(self) -> Transition:
        return Transition(self.s, tuple(self.effects), "; ".join(self.reasons), self.answer, self.refused)


def finish(ctx: Context, exit_code: int, message: str) -> None:
    """Ends the job: every live agent gets Shutdown and its stream ends; a plan on its way is dropped."""
    s = ctx.s
    if s.finish is not None:
        ctx.because(f"already finished; not again with exit {exit_code}")
        return
    cancel_planning(ctx)
    s.phase = JobPhase.FINISHED
    s.finish = Finish(exit_code, message)
    for entry in s.registry.nodes.values():
        ctx.send(entry.name, pb.AgentEvent(shutdown=pb.Shutdown(reason=message)))
        entry.end_stream()
        ctx.effects.append(EndStream(entry.name))
    ctx.record("shutdown", exit_code=exit_code, reason=message)
    ctx.effects.append(Finished(exit_code, message))
    ctx.because(f"finished with exit {exit_code}")


def add_to_incident(ctx: Context, cause: str, node: str) -> None:
    """Nodes lost (or leaving) together make one incident, timed from the first."""
    s = ctx.s
    if s.incident is None or s.incident.cause != cause:
        s.incident = Incident(cause, (node,), ctx.now)
    elif node not in s.incident.nodes:
        s.incident = s.incident.with_node(node)


def cancel_planning(ctx: Context) -> None:
    """Drops the plan on its way (its answer, when it comes, is ignored)."""
    if ctx.s.planning is not None:
        ctx.effects.append(CancelPlan(ctx.s.planning.id))
        ctx.s.planning = None


def base_held_by_everyone_alive(ctx: Context) -> Base | None:
    """The generation the live nodes hold, nodes on notice included (they can still write it)."""
    s = ctx.s
    return choose_base(s.views(), s.holdings, [*s.registry.names(), *s.registry.leaving()])[0]


def write_journal(ctx: Context) -> None:
    """Journals the current generation (``oobleck_mm.master.journal``); the shell adds its address and start time."""
    s = ctx.s
    current = s.gens.get(s.generation)
    if current is None:
        return
    views = tuple(s.gens[n].view for n in sorted(s.gens) if n > s.generation - KEEP_GENERATIONS)
    journal = Journal(
        config_yaml=ctx.cfg.config_yaml,
        host="",
        port=0,
        options=asdict(ctx.cfg.options),
        generation=s.generation,
        template_nodes=current.template_nodes,
        views=views,
        plan=current.plan,
        last_checkpoint=s.checkpoints.last,
        pin=s.pin,
    )
    ctx.effects.append(WriteJournal(journal))
