"""How the job recovers from a lost node: ``live`` (reconfigure the survivors) or ``restart``, behind one interface.

The machine (``oobleck_mm.master.machine``) runs the job; at the points where the two
recovery modes differ it asks its policy (``fault_tolerance.recovery``). A
policy keeps no state and calls nothing back: it reads ``Facts`` (a snapshot
of the job's state) and answers in values:

- ``wanted``: what the next plan must account for, given the live nodes;
- ``restarts_workers``: whether every worker restarts before a plan (restart mode);
- ``fresh_start``: where workers that inherit no state start (checkpoint, step);
- ``below_threshold``: what to do when the live nodes cannot keep f + 1 replicas
  (``ROUND``: the survivors write what they hold; ``STOP``: stop at the newest checkpoint);
- ``checkpoint_complete_by``: what completes a periodic checkpoint: ``SHARES`` (every rank of the
  generation that wrote it reported its share) or ``BARRIER`` (one report: the workers wrote it
  at a barrier); the machine keeps its checkpoint book by that rule.

Live recovery (§2.5): survivors keep their states, the new generation is
planned from the base they hold, joins are admitted at an iteration boundary,
and below the threshold the survivors write a checkpoint of what they hold.
Every ``checkpoint_interval`` steps each worker snapshots the layers it owns
(one replica per layer, ``ExecutionPlan.checkpoint_owner``) and writes them in
the background (``runtime/async_checkpoint.py``); the master completes the
checkpoint (``meta.json``) once every rank of that generation reported, keeps
the last ``fault_tolerance.keep_checkpoints`` (2), and when a loss takes every copy of some layer
the job stops at the newest one (exit 3, the resume command printed) instead
of losing the run.
Restart recovery (the baseline every checkpoint-based system uses): every
worker is restarted and loads the last periodic checkpoint; joins wait for the
next restart; below the threshold the job stops at that checkpoint.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from oobleck_mm.master.recovery import GenerationView, Holdings, Request, StateLost, plan_request
from oobleck_mm.planning.layout import Gpu


def keep_checkpoints(recovery: str, configured: int) -> int:
    """Complete periodic checkpoints to keep (``fault_tolerance.keep_checkpoints``; 0: all): restart
    mode only ever loads the newest one, so it keeps one unless told to keep all."""
    if configured == 0:
        return 0
    return 1 if recovery == "restart" else configured


ROUND = "round"
"""Below the threshold: the survivors write the layers they hold, then the job stops."""
STOP = "stop"
"""Below the threshold: the job stops at the newest complete checkpoint (or says there is none)."""
SHARES = "shares"
"""A periodic checkpoint is complete once every rank of the generation that wrote it reported its share
(``CheckpointBook.record_share``)."""
BARRIER = "barrier"
"""A periodic checkpoint is complete at its first report: written at a barrier
(``CheckpointBook.record_barrier_checkpoint``)."""


@dataclass(frozen=True, slots=True)
class Facts:
    """What a policy reads of the job's state."""

    views: Mapping[int, GenerationView]
    holdings: Mapping[Gpu, Holdings]
    abandoned: bool
    """The current generation abandoned an iteration and ``reform_after`` passed with no node lost."""
    next_step: int
    steps: int
    resume_dir: str
    resume_step: int
    last_checkpoint: tuple[str, int] | None
    keeps_replicas_from: int = 0
    """(f + 1) * n0 of the current generation's plan; 0: not known."""
    newer_checkpoint: tuple[str, int] | None = None
    """A checkpoint newer than the one the current generation loads and anything it trained
    (``JobState.newer_checkpoint``)."""


class LiveRecovery:
    name = "live"
    periodic_checkpoints = True
    asynchronous_checkpoints = True
    checkpoint_complete_by = SHARES  # each owner writes its layers in the background and reports when done
    restarts_workers = False  # survivors keep training until the plan arrives at an iteration boundary

    def wanted(self, facts: Facts, current: GenerationView, live: list[str]) -> Request | StateLost | None:
        wanted, _ = plan_request(current, facts.views, facts.holdings, live, facts.abandoned, facts.keeps_replicas_from)
        if isinstance(wanted, Request) and not wanted.failure and facts.next_step >= facts.steps:
            return None  # every step is done: a node joining now has nothing left to train
        if isinstance(wanted, Request) and wanted.base == 0 and facts.next_step > facts.resume_step:
            # Starting afresh is right only before any step: after one, it would silently redo the job.
            return StateLost(f"every worker that held the trained state (step {facts.next_step}) is gone")
        return wanted

    def fresh_start(self, facts: Facts) -> tuple[str, int]:
        return facts.resume_dir, facts.resume_step

    def below_threshold(self, request: Request) -> str:
        return ROUND if request.base else STOP  # the survivors still hold every layer of the base


class RestartRecovery:
    name = "restart"
    periodic_checkpoints = True
    asynchronous_checkpoints = False  # a restart loads the newest checkpoint: written at a barrier
    checkpoint_complete_by = BARRIER
    restarts_workers = True

    def wanted(self, facts: Facts, current: GenerationView, live: list[str]) -> Request | StateLost | None:
        gone = tuple(n for n in current.nodes if n not in live)
        if not gone and not facts.abandoned and facts.newer_checkpoint is None:
            return None  # joins wait for the next restart: restarting for them would redo steps
        new = tuple(n for n in live if n not in current.nodes)
        return Request(base=0, plan_from=current.number, lost=gone, joined=new, live=tuple(live), failure=True)

    def fresh_start(self, facts: Facts) -> tuple[str, int]:
        if facts.last_checkpoint is not None:
            return facts.last_checkpoint
        return facts.resume_dir, facts.resume_step

    def below_threshold(self, request: Request) -> str:
        return STOP


def policy_for(recovery: str) -> LiveRecovery | RestartRecovery:
    """The policy of ``fault_tolerance.recovery``."""
    return RestartRecovery() if recovery == "restart" else LiveRecovery()
