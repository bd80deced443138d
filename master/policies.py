"""How the job recovers from a lost node: ``live`` (reconfigure the survivors) or ``restart``, behind one interface.

The coordinator runs the job's state machine; at the four points where the two
recovery modes differ it asks its policy (``fault_tolerance.recovery``):

- ``wanted``: what the next plan must account for, given the live nodes;
- ``before_planning``: what happens to the running workers when a plan is due;
- ``fresh_start``: where workers that inherit no state start (checkpoint, step);
- ``below_threshold``: what to do when the live nodes cannot keep f + 1 replicas.

Live recovery (§2.5): survivors keep their states, the new generation is
planned from the base they hold, joins are admitted at an iteration boundary,
and below the threshold the survivors write a checkpoint of what they hold.
Restart recovery (the baseline every checkpoint-based system uses): every
worker is restarted and loads the last periodic checkpoint; joins wait for the
next restart; below the threshold the job stops at that checkpoint.
"""

from __future__ import annotations

import os
import shutil
from typing import TYPE_CHECKING, Protocol

from master.recovery import GenerationView, Request, StateLost, plan_request
from oobleck_mm.planning.reconfigure import CannotKeepReplicas
from oobleck_mm.protocol import oobleck_pb2 as pb

if TYPE_CHECKING:
    from master.coordinator import Coordinator


class RecoveryPolicy(Protocol):
    name: str
    periodic_checkpoints: bool
    """Workers checkpoint every ``fault_tolerance.checkpoint_interval`` steps."""

    def wanted(self, c: Coordinator, current: GenerationView, live: list[str]) -> Request | StateLost | None:
        """What the next plan must account for while running (None: nothing to plan yet)."""

    def before_planning(self, c: Coordinator, request: Request) -> None:
        """Called once per plan request while running, before the planner is asked."""

    def fresh_start(self, c: Coordinator) -> tuple[str, int]:
        """(checkpoint dir or "", step) where workers without inherited state start."""

    def below_threshold(self, c: Coordinator, request: Request, cannot: CannotKeepReplicas, why: str) -> None:
        """The live nodes cannot keep f + 1 replicas while running: end the job keeping its progress."""

    def checkpoint_saved(self, directory: str, step: int) -> bool:
        """A periodic checkpoint of ``step`` finished; True if it is the newest (worth an event)."""


class LiveRecovery:
    name = "live"
    periodic_checkpoints = False

    def wanted(self, c: Coordinator, current: GenerationView, live: list[str]) -> Request | StateLost | None:
        wanted, _ = plan_request(current, c.views(), c.holdings, live)
        if isinstance(wanted, Request) and not wanted.failure and c.next_step >= c.steps:
            return None  # every step is done: a node joining now has nothing left to train
        if isinstance(wanted, Request) and wanted.base == 0 and c.next_step > c.options.resume_step:
            # Starting afresh is right only before any step: after one, it would silently redo the job.
            return StateLost(f"every worker that held the trained state (step {c.next_step}) is gone")
        return wanted

    def before_planning(self, c: Coordinator, request: Request) -> None:
        pass  # survivors keep training until the plan arrives at an iteration boundary

    def fresh_start(self, c: Coordinator) -> tuple[str, int]:
        return c.options.resume_dir, c.options.resume_step

    def below_threshold(self, c: Coordinator, request: Request, cannot: CannotKeepReplicas, why: str) -> None:
        if request.base == 0:
            c.stop_below_threshold(why, None, "no worker had completed a step")
        else:
            c.start_checkpoint_round(request, cannot, why)  # the survivors still hold every layer

    def checkpoint_saved(self, directory: str, step: int) -> bool:
        return False  # live mode writes no periodic checkpoints


class RestartRecovery:
    name = "restart"
    periodic_checkpoints = True

    def __init__(self) -> None:
        self.last_checkpoint: tuple[str, int] | None = None
        """(directory, step) of the newest periodic checkpoint every rank finished."""
        self._restarted_for = 0

    def wanted(self, c: Coordinator, current: GenerationView, live: list[str]) -> Request | StateLost | None:
        gone = tuple(n for n in current.nodes if n not in live)
        if not gone:
            return None  # joins wait for the next restart: restarting for them would redo steps
        new = tuple(n for n in live if n not in current.nodes)
        return Request(base=0, plan_from=current.number, lost=gone, joined=new, live=tuple(live), failure=True)

    def before_planning(self, c: Coordinator, request: Request) -> None:
        """Every surviving agent kills its workers; fresh ones start on the next assignment."""
        if self._restarted_for == c.generation:
            return  # already restarted for a failure of this generation
        self._restarted_for = c.generation
        reason = f"restart recovery after losing {', '.join(request.lost) or 'a node'}"
        for node in request.live:
            c.send(node, pb.AgentEvent(restart=pb.RestartWorkers(reason=reason)))
        c.forget_workers()
        c.events.write("restart", generation=c.generation, nodes=list(request.live), reason=reason)

    def fresh_start(self, c: Coordinator) -> tuple[str, int]:
        if self.last_checkpoint is not None:
            return self.last_checkpoint
        return c.options.resume_dir, c.options.resume_step

    def below_threshold(self, c: Coordinator, request: Request, cannot: CannotKeepReplicas, why: str) -> None:
        c.stop_below_threshold(why, self.last_checkpoint)

    def checkpoint_saved(self, directory: str, step: int) -> bool:
        """A periodic checkpoint finished (one report means every rank passed its closing barrier).

        The one before it is then removed: a restart only ever loads the newest complete one.
        Directories of saves cut short by a failure (no meta.json) are removed with it.
        """
        if step > 0 and (self.last_checkpoint is None or step > self.last_checkpoint[1]):
            self.last_checkpoint = (directory, step)
            _remove_older_checkpoints(directory, step)
            return True
        return False


def policy_for(recovery: str) -> LiveRecovery | RestartRecovery:
    """The policy of ``fault_tolerance.recovery``."""
    return RestartRecovery() if recovery == "restart" else LiveRecovery()


def _remove_older_checkpoints(directory: str, step: int) -> None:
    """Periodic checkpoints of steps below ``step`` beside ``directory`` (``runtime.checkpoint`` names them)."""
    parent = os.path.dirname(directory)
    for name in os.listdir(parent) if os.path.isdir(parent) else ():
        if name.startswith("step") and name[4:].isdigit() and int(name[4:]) < step:
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
