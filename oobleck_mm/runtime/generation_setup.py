"""A worker's set-up of a generation: prepare what it receives, rendezvous, agree on the start, copy states.

``GenerationSetUp`` is the part of the worker's shell (``oobleck_mm.runtime.agent_worker.WorkerLoop``) that
carries out the machine's ``SetUp`` effect (``oobleck_mm.runtime.worker_machine``): steps 2-4 of the
worker's life (``agent_worker``'s docstring). It keeps the generations this worker holds (``current``,
``committed``) and ``next_step``, the first step not yet applied to its layers.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from oobleck_mm.config.shape import layer_specs
from oobleck_mm.errors import UserError
from oobleck_mm.model.layers import model_layer_specs
from oobleck_mm.planning.layout import ExecutionPlan
from oobleck_mm.protocol.convert import plan_from_proto
from oobleck_mm.runtime.checkpoint import load_layer, read_shared_state
from oobleck_mm.runtime.checkpoint_meta import read_meta
from oobleck_mm.runtime.engine import StageEngine, engine_subgroups
from oobleck_mm.runtime.group import PreparedGroup, connect_store, join_generation, leave_group, torchrun_environment
from oobleck_mm.runtime.hold import hold
from oobleck_mm.runtime.state_transfer import Arrival, adopt_plan, prepare_arrival
from oobleck_mm.runtime.waiting import PeerFailure

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Generation:
    number: int
    plan: ExecutionPlan
    rank: int
    engine: StageEngine


class GenerationSetUp:
    """What ``WorkerLoop`` sets (``__init__``): job, node, local_rank, device, emulation, timeouts, waiter,
    commands, current, committed, next_step, assigned_generation; and ``phase`` to report."""

    def _prepare_group(self, command) -> PreparedGroup | None:
        """(The command reader's thread.) A plan that every old rank outlives (a join, a leave on notice)
        is switched to at an iteration boundary: its gloo group is formed now, in the background."""
        if command is None or command.WhichOneof("command") != "assignment":
            return None
        a = command.assignment
        if not (a.previous_generation and a.at_boundary) or self.job.cluster.resolved_backend != "gloo":
            return None
        timeouts, specs = self.timeouts, model_layer_specs(self.job)
        return PreparedGroup(
            lambda: connect_store(a.store_host, a.store_port, a.store_token, timeout=timeouts.rendezvous_timeout),
            a.generation,
            a.rank,
            a.world_size,
            collective_timeout=timeouts.collective_timeout,
            arrival_timeout=timeouts.rendezvous_timeout,
            subgroups=engine_subgroups(
                self.job,
                plan_from_proto(a.plan),
                specs,
                plan_from_proto(a.previous_plan) if a.previous_generation else None,
                list(a.previous_ranks),
            ),
            before=lambda: hold("forming", self.node),
            gated=a.rank < len(a.previous_ranks) and a.previous_ranks[a.rank] < 0,  # a joiner: see PreparedGroup
        )

    def rendezvous(self, a, prepared: PreparedGroup | None = None):
        """Join generation ``a.generation``; returns a newer command instead if one arrives while waiting."""
        t0 = time.perf_counter()
        self.assigned_generation = a.generation
        leave_group()
        if a.previous_generation:
            hold("rendezvous", self.node)
        os.environ.update(
            torchrun_environment(
                a.rank,
                a.world_size,
                self.local_rank,
                self.node,
                list(a.rank_nodes),
                a.store_host,
                a.store_port,
            )
        )
        store = (
            None
            if prepared is not None
            else connect_store(
                a.store_host,
                a.store_port,
                a.store_token,
                timeout=self.timeouts.rendezvous_timeout,
                interrupt=self.commands.replanned.is_set,  # a peer lost before it connected: do not wait it out
            )
        )
        try:
            pending = join_generation(
                store,
                a.generation,
                a.rank,
                a.world_size,
                self.job.cluster.resolved_backend,
                collective_timeout=self.timeouts.collective_timeout,
                arrival_timeout=self.timeouts.rendezvous_timeout,
                poll=self.commands.poll,  # the master re-planned while we waited (a failure during recovery)
                prepared=prepared,
                before_connect=(lambda: hold("connect", self.node)) if a.previous_generation else None,
            )
        except dist.DistStoreError as error:  # the master (its store) went away or restarted: not a bug
            raise PeerFailure(f"generation {a.generation}: rendezvous: {str(error).splitlines()[0]}") from error
        if pending is not None:
            return pending
        self.phase(a.generation, "rendezvous", seconds=time.perf_counter() - t0, formed_ahead=prepared is not None)
        return None

    def _survivor_engine(self, previous_generation: int) -> StageEngine | None:
        for gen in (self.current, self.committed):
            if gen is not None and gen.number == previous_generation:
                return gen.engine
        return None

    def _held_generations(self) -> list[int]:
        return sorted({g.number for g in (self.current, self.committed) if g is not None})

    def prepare(self, a, plan: ExecutionPlan) -> Arrival | None:
        """Before the rendezvous, build what this rank alone needs for a new plan (``prepare_arrival``):
        a joiner does it while the survivors finish their iteration instead of while they wait."""
        if not a.previous_generation:
            return None
        survivor = a.previous_ranks[a.rank] >= 0
        engine = self._survivor_engine(a.previous_generation) if survivor else None
        if survivor and engine is None:
            return None  # adopt says what is wrong
        try:
            return prepare_arrival(
                self.job,
                engine,
                plan_from_proto(a.previous_plan),
                plan,
                list(a.previous_ranks),
                a.rank,
                list(a.rank_nodes),
                self.device,
                self.emulation,
            )
        except RuntimeError as error:
            if is_out_of_memory(error):
                raise OutOfMemory(self.node, self.local_rank, a.start_step, error) from error
            raise

    def adopt(self, a, plan: ExecutionPlan, arrival: Arrival | None = None) -> tuple[StageEngine, int]:
        t0 = time.perf_counter()
        survivor = bool(a.previous_generation) and a.previous_ranks[a.rank] >= 0
        old_engine = self._survivor_engine(a.previous_generation) if survivor else None
        if survivor and old_engine is None:
            # Not a crash: the master planned from what it knew, and this worker moved on meanwhile. A loss or
            # a notice right after a join's assignment went out is planned from the generation before the join
            # (no report of the join's first step had come yet), while the workers switch to the join and drop
            # it (seen under churn, the master held up 2 s by its journal's fsync: every worker raised here, six
            # nodes were lost and the job stopped at exit 3). Abandoned like a broken iteration: the master
            # learns from this worker's reports which generation it holds and plans again from that one.
            raise PeerFailure(
                f"generation {a.generation}: the master counts this worker as a survivor of generation "
                f"{a.previous_generation}, which it no longer holds (it holds {self._held_generations()})"
            )
        start = self.agree_on_start(a, self.next_step if survivor else None, old_engine)
        try:
            if a.previous_generation:
                hold("copy", self.node)
                old_plan = plan_from_proto(a.previous_plan)
                engine, transfers, moved, transfer_s = adopt_plan(
                    self.job,
                    old_engine,
                    old_plan,
                    plan,
                    list(a.previous_ranks),
                    a.rank,
                    list(a.rank_nodes),
                    self.device,
                    self.waiter,
                    arrival,
                    self.emulation,
                )
            else:
                held = {}
                if a.resume_dir:
                    specs = layer_specs(self.job.model, self.job.data)
                    held = _read_resume(
                        a,
                        lambda: {
                            i: load_layer(a.resume_dir, self.job, i, specs, self.device)
                            for i in plan.stage(a.rank).layers
                        },
                    )
                engine = StageEngine(
                    self.job, plan, a.rank, device=self.device, held=held, waiter=self.waiter, emulation=self.emulation
                )
                if a.resume_dir and held:  # float16's scale and the balancer's model go on from the checkpoint
                    shared = _read_resume(a, lambda: read_shared_state(a.resume_dir, specs[min(held)].name))
                    engine.load_shared_state(shared)
                transfers, moved, transfer_s = [], 0, 0.0
        except PeerFailure:
            raise
        except RuntimeError as error:
            raise PeerFailure(f"generation {a.generation}: state copy failed: {error}") from error
        self.phase(
            a.generation,
            "states_copied",
            step=start,
            seconds=time.perf_counter() - t0,
            nbytes=moved,
            message=f"{len(transfers)} layer transfers in the generation",
            transfer_seconds=transfer_s,
        )
        self.next_step = start
        return engine, start

    def agree_on_start(self, a, mine: int | None, engine: StageEngine | None = None) -> int:
        """Survivors' next step, else the checkpoint's or the assignment's. Survivors one step apart
        (the previous generation's last collective ended on some ranks only) settle it first: the
        ranks behind apply the update the others applied (``_settle``); ``engine``: this survivor's."""
        value = torch.tensor(
            [mine if mine is not None else -1, -(mine if mine is not None else 1 << 40)],
            dtype=torch.int64,
            device=self.device,
        )
        try:
            self.waiter.wait(dist.all_reduce(value, op=dist.ReduceOp.MAX, async_op=True), "start-step agreement")
        except RuntimeError as error:
            raise PeerFailure(f"generation {a.generation}: {error}") from error
        latest, earliest = int(value[0]), -int(value[1])
        if latest >= 0:
            if latest == earliest + 1:
                self._settle(a, engine, mine, earliest)
            elif latest != earliest:
                raise RuntimeError(f"survivors disagree on the step to resume: {earliest} vs {latest}")
            elif engine is not None:
                engine.settle(None)  # nobody applied it: the iteration is rerun
            return latest
        if a.resume_dir:
            return int(_read_resume(a, lambda: read_meta(a.resume_dir))["step"])
        return int(a.start_step)

    def _settle(self, a, engine: StageEngine | None, mine: int | None, step: int) -> None:
        """Step ``step``'s last collective completed on some ranks only: they applied its update, the
        others gave up inside it (a peer died there, or they were interrupted) with the gradients
        reduced. Those apply the same update now, from the norm the others got, before any state
        moves; every rank of the generation takes part (a collective)."""
        reduced = engine.last_reduced if engine is not None else None
        norm_sq = reduced[1] if reduced is not None and reduced[0] == step else -math.inf
        value = torch.tensor([norm_sq], dtype=torch.float64, device=self.device)
        try:
            self.waiter.wait(dist.all_reduce(value, op=dist.ReduceOp.MAX, async_op=True), f"settling step {step}")
        except RuntimeError as error:
            raise PeerFailure(f"generation {a.generation}: {error}") from error
        norm_sq = float(value[0])
        if norm_sq == -math.inf:  # a rank that completed the collective has the norm: none did?
            raise RuntimeError(
                f"survivors disagree on the step to resume ({step} vs {step + 1}) and none of "
                f"them has step {step}'s gradient norm"
            )
        if engine is None:
            return
        if mine != step:
            engine.settle(None)  # ahead: a later step it may have begun was not completed anywhere
            return
        if engine.unsettled != step:
            raise RuntimeError(
                f"this rank is at step {step} while others applied it, but it holds no "
                f"reduced gradients of that step (unsettled: {engine.unsettled})"
            )
        engine.settle(norm_sq)
        self.next_step = step + 1
        log.warning(
            "generation %d: step %d completed on other ranks while this one gave up inside its last "
            "collective; applied its update here too",
            a.generation,
            step,
        )
        self.phase(
            a.generation, "settled", step=step, message=f"step {step}'s update applied at the next generation's start"
        )


class UnreadableCheckpoint(PeerFailure):
    """The checkpoint the master chose for this generation (restart mode) cannot be read: a fault of the run
    (pruned, damaged on disk), not the user's input. The iteration is abandoned naming it, and the master
    restarts from a newer one or stops with exit 3 (issue 56: it was exit 2, the code for a user's mistake)."""

    def __init__(self, directory: str, message: str) -> None:
        super().__init__(message)
        self.directory = directory


def _read_resume(a, read: Callable[[], Any]) -> Any:
    """``read()`` of the assignment's checkpoint; a failure of one the master chose is ``UnreadableCheckpoint``.
    The user's ``--resume`` (``resume_chosen`` unset) stays theirs to fix: exit 2, naming what is wrong."""
    try:
        return read()
    except (UserError, OSError) as error:
        if not a.resume_chosen:
            raise
        raise UnreadableCheckpoint(
            a.resume_dir,
            f"generation {a.generation}: the run's checkpoint {a.resume_dir} "
            f"cannot be read: {str(error).splitlines()[0]}",
        ) from error


class OutOfMemory(UserError):
    """A stage ran out of device (or host) memory: the plan's memory model and the job disagree."""

    def __init__(self, node: str, local_rank: int, step: int, error: BaseException) -> None:
        super().__init__(
            f"out of memory on {node}/gpu{local_rank} in step {step} ({str(error).splitlines()[0]}); lower "
            f"training.microbatch_size or cluster.device_memory (the planner then uses more, smaller stages), "
            f"or set training.activation_checkpointing: true (auto recomputes only on the stages the plan's "
            f"memory model finds tight)"
        )


def is_out_of_memory(error: BaseException) -> bool:
    """torch's OutOfMemoryError (CUDA), or the CPU allocator's own words for it."""
    if isinstance(error, torch.OutOfMemoryError):
        return True
    text = str(error)
    return "can't allocate memory" in text or "out of memory" in text.lower()
