"""How the job recovers from a lost node: ``live`` (reconfigure the survivors) or ``restart``, behind one interface.

The coordinator runs the job's state machine; at the four points where the two
recovery modes differ it asks its policy (``fault_tolerance.recovery``):

- ``wanted``: what the next plan must account for, given the live nodes (and whether the
  current generation abandoned an iteration with no node lost: ``Coordinator.abandoned``);
- ``before_planning``: what happens to the running workers when a plan is due;
- ``fresh_start``: where workers that inherit no state start (checkpoint, step);
- ``below_threshold``: what to do when the live nodes cannot keep f + 1 replicas;
- ``checkpoint_done``: a worker finished its share of a periodic checkpoint.

Live recovery (§2.5): survivors keep their states, the new generation is
planned from the base they hold, joins are admitted at an iteration boundary,
and below the threshold the survivors write a checkpoint of what they hold.
Every ``checkpoint_interval`` steps each worker snapshots the layers it owns
(one replica per layer, ``ExecutionPlan.checkpoint_owner``) and writes them in the background (``runtime/async_checkpoint.py``);
the master completes the checkpoint (``meta.json``) once every rank of that
generation reported, keeps the last ``KEEP_CHECKPOINTS``, and when a loss takes
every copy of some layer the job stops at the newest one (exit 3, the resume
command printed) instead of losing the run.
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
    last_checkpoint: tuple[str, int] | None
    """(directory, step) of the newest complete periodic checkpoint: where the job stops when state is lost."""
    """Workers checkpoint every ``fault_tolerance.checkpoint_interval`` steps."""

    def wanted(self, c: Coordinator, current: GenerationView, live: list[str]) -> Request | StateLost | None:
        """What the next plan must account for while running (None: nothing to plan yet)."""

    def before_planning(self, c: Coordinator, request: Request) -> None:
        """Called once per plan request while running, before the planner is asked."""

    def fresh_start(self, c: Coordinator) -> tuple[str, int]:
        """(checkpoint dir or "", step) where workers without inherited state start."""

    def below_threshold(self, c: Coordinator, request: Request, cannot: CannotKeepReplicas, why: str) -> None:
        """The live nodes cannot keep f + 1 replicas while running: end the job keeping its progress."""

    def checkpoint_done(self, c: Coordinator, gpu, done: pb.CheckpointDone) -> tuple[str, int] | None:
        """A worker's share of a periodic checkpoint; (directory, step) when that completed one."""


class LiveRecovery:
    name = "live"
    periodic_checkpoints = True
    asynchronous_checkpoints = True

    def __init__(self) -> None:
        self.last_checkpoint: tuple[str, int] | None = None
        """(directory, step) of the newest complete periodic checkpoint."""
        self._shares: dict[str, dict] = {}
        """Checkpoint directory -> (node, gpu) -> its worker's CheckpointDone."""
        self.last_timing: dict[str, float] = {}
        self._sampler = None

    def wanted(self, c: Coordinator, current: GenerationView, live: list[str]) -> Request | StateLost | None:
        wanted, _ = plan_request(current, c.views(), c.holdings, live, c.abandoned())
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
            c.stop_below_threshold(why, self.last_checkpoint, "no worker had completed a step")
        else:
            c.start_checkpoint_round(request, cannot, why)  # the survivors still hold every layer

    def checkpoint_done(self, c: Coordinator, gpu, done: pb.CheckpointDone) -> tuple[str, int] | None:
        """Complete once every rank of the generation that took the snapshot wrote its share.

        A generation that changed before that (a failure, a join) never completes it: its
        directory stays without meta.json and goes with the next complete one.
        """
        gen = c.views().get(done.generation)
        if gen is None or gpu not in gen.ranks:
            return None
        shares = self._shares.setdefault(done.dir, {})
        shares[gpu] = done
        if set(shares) != set(gen.ranks):
            return None
        del self._shares[done.dir]
        self.last_timing = {"snapshot_seconds": max(d.snapshot_seconds for d in shares.values()),
                            "write_seconds": max(d.seconds for d in shares.values())}  # the slowest worker's
        from master.checkpointing import write_meta

        self._sampler = write_meta(done.dir, c.job, done.step, self._sampler)
        if self.last_checkpoint is None or done.step > self.last_checkpoint[1]:
            self.last_checkpoint = (done.dir, done.step)
        _prune_checkpoints(done.dir, KEEP_CHECKPOINTS)
        self._shares = {d: s for d, s in self._shares.items() if _step_of(d) > done.step}  # older: abandoned
        return done.dir, done.step


class RestartRecovery:
    name = "restart"
    periodic_checkpoints = True
    asynchronous_checkpoints = False  # a restart loads the newest checkpoint: written at a barrier
    last_timing: dict[str, float] = {}

    def __init__(self) -> None:
        self.last_checkpoint: tuple[str, int] | None = None
        """(directory, step) of the newest periodic checkpoint every rank finished."""
        self._restarted_for = 0

    def wanted(self, c: Coordinator, current: GenerationView, live: list[str]) -> Request | StateLost | None:
        gone = tuple(n for n in current.nodes if n not in live)
        if not gone and not c.abandoned():
            return None  # joins wait for the next restart: restarting for them would redo steps
        new = tuple(n for n in live if n not in current.nodes)
        return Request(base=0, plan_from=current.number, lost=gone, joined=new, live=tuple(live), failure=True)

    def before_planning(self, c: Coordinator, request: Request) -> None:
        """Every surviving agent kills its workers; fresh ones start on the next assignment."""
        if self._restarted_for == c.generation:
            return  # already restarted for a failure of this generation
        self._restarted_for = c.generation
        reason = (f"restart recovery after losing {', '.join(request.lost)}" if request.lost
                  else "restart recovery after an iteration abandoned with no node lost")
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

    def checkpoint_done(self, c: Coordinator, gpu, done: pb.CheckpointDone) -> tuple[str, int] | None:
        """A periodic checkpoint finished (one report means every rank passed its closing barrier).

        The one before it is then removed: a restart only ever loads the newest complete one.
        Directories of saves cut short by a failure (no meta.json) are removed with it.
        """
        if done.step > 0 and (self.last_checkpoint is None or done.step > self.last_checkpoint[1]):
            self.last_checkpoint = (done.dir, done.step)
            _prune_checkpoints(done.dir, 1)
            return done.dir, done.step
        return None


def policy_for(recovery: str) -> LiveRecovery | RestartRecovery:
    """The policy of ``fault_tolerance.recovery``."""
    return RestartRecovery() if recovery == "restart" else LiveRecovery()


KEEP_CHECKPOINTS = 2
"""Complete periodic checkpoints live mode keeps (the newest, and one in case it is damaged)."""


def _step_of(directory: str) -> int:
    name = os.path.basename(directory)
    return int(name[4:]) if name.startswith("step") and name[4:].isdigit() else -1


def _prune_checkpoints(directory: str, keep: int) -> None:
    """Keeps the ``keep`` newest complete periodic checkpoints beside ``directory`` (``runtime.checkpoint``
    names them ``stepNNNNNNNN``) and removes older ones, complete or cut short (no meta.json)."""
    parent = os.path.dirname(directory)
    steps = sorted((s for s in map(_step_of, (os.path.join(parent, n) for n in os.listdir(parent))) if s >= 0),
                   reverse=True) if os.path.isdir(parent) else []  # fmt: skip
    complete = [s for s in steps if os.path.exists(os.path.join(parent, f"step{s:08d}", "meta.json"))]
    oldest_kept = complete[keep - 1] if len(complete) >= keep else (complete[-1] if complete else 0)
    for s in steps:
        if s < oldest_kept:
            shutil.rmtree(os.path.join(parent, f"step{s:08d}"), ignore_errors=True)
