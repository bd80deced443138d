"""The worker process an agent starts (one per GPU): generations, failures, state hand-over.

A worker lives for the whole job. It trains generation after generation, and
its in-memory layer states are what makes checkpoint-free recovery possible:

1. An ``Assignment`` of generation g arrives (protobuf bytes on the agent's pipe).
2. Rendezvous (``runtime.group.join_generation``, the one join path): an
   arrival barrier under the prefix ``gen{g}`` (``fault_tolerance.
   rendezvous_timeout``, abandoned if a newer command arrives), then a process
   group whose timeout is ``fault_tolerance.collective_timeout``, so a hung peer
   cannot hold survivors longer than that.
3. The start step: survivors agree on their next step (all-reduce max; min must
   match), a fresh job takes the assignment's, a resume the checkpoint's.
4. State hand-over (``adopt_plan``): survivors keep what they still hold and
   copy what they now need (params + Adam state) from surviving replicas;
   joiners receive everything; a resume loads its stage from the checkpoint.
5. Steps. A command that arrives meanwhile is applied at the next iteration
   boundary, the same one on every rank: each step's last collective carries
   whether any rank holds a command, and if one does every rank takes its own
   after that step (a rank that polled alone could start a step its peers left
   and wait out the group timeout). A command that means a peer is gone
   interrupts the step instead. A failed collective (a peer died or hung) aborts the iteration: its
   gradients are discarded, the process group is destroyed (which unblocks
   peers still waiting on this worker), "aborted" is reported and the worker
   waits for the master's next plan. No parameter has changed in an aborted
   iteration (the last collective precedes the update), so rerunning it in the
   next generation gives the failure-free result.

The worker keeps the last generation in which it completed a step
("committed") until the next one completes one: if a recovery itself fails, the
master plans again from the last generation every survivor completed, and the
worker still holds exactly that generation's layers.
"""

from __future__ import annotations

import logging
import math
import os
import queue
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from oobleck_mm.config import load_config
from oobleck_mm.config.emulation import compute_job
from oobleck_mm.config.shape import layer_specs
from oobleck_mm.errors import ExitCode, UserError
from oobleck_mm.planning.layout import ExecutionPlan
from oobleck_mm.protocol import oobleck_pb2 as pb
from oobleck_mm.protocol.convert import plan_from_proto
from oobleck_mm.protocol.pipe import recv_command, send_report
from oobleck_mm.runtime.async_checkpoint import AsyncCheckpointer
from oobleck_mm.runtime.checkpoint import (
    load_layer,
    periodic_checkpoint_dir,
    read_shared_state,
    read_meta,
    save_layers,
    write_error,
)
from oobleck_mm.model.layers import import_layer_code, model_layer_specs
from oobleck_mm.runtime.emulated import Emulation
from oobleck_mm.runtime.engine import StageEngine, engine_subgroups
from oobleck_mm.runtime.balancing import warm_balancer
from oobleck_mm.runtime.group import PreparedGroup, connect_store, join_generation, leave_group, torchrun_environment
from oobleck_mm.runtime.hold import hold, hold_once, hold_step, set_announcer
from oobleck_mm.runtime.state_transfer import Arrival, adopt_plan, prepare_arrival
from oobleck_mm.runtime.timing import peak_memory_bytes
from oobleck_mm.runtime.waiting import PeerFailure, Waiter
from oobleck_mm.runtime.worker import SaveOutcome, device_for, save_checkpoint, write_replica_hashes

log = logging.getLogger(__name__)


class CommandReader:
    """Reads the agent's pipe in a thread so training can poll for commands between iterations."""

    def __init__(self, conn, on_arrival: Callable[[Any], Any] | None = None):
        """``on_arrival(command)``: called as each command arrives (before it is queued); what it
        returns for a command, if not None, is something being prepared for it in the background
        (``PreparedGroup``): until it is ready the command does not count as ``waiting``."""
        self.conn = conn
        self.on_arrival = on_arrival
        self.preparing: dict[int, Any] = {}
        """id(command) -> what ``on_arrival`` prepares for it, while the command is queued."""
        self._handed: tuple[Any, Any] = (None, None)
        """The command taken last from the queue and what was prepared for it (``prepared_for``)."""
        self.queue: queue.Queue = queue.Queue()
        self.replanned = threading.Event()
        """Set when a queued command means a peer is gone: waits on collectives give up at once."""
        threading.Thread(target=self._run, daemon=True, name="commands").start()

    def _run(self) -> None:
        while True:
            try:
                command = recv_command(self.conn)
            except (EOFError, OSError):
                self.queue.put(None)  # the agent is gone
                self.replanned.set()
                return
            if self.on_arrival is not None:
                try:
                    prepared = self.on_arrival(command)
                except Exception:  # noqa: BLE001 - only an optimisation: the switch forms the groups then
                    log.exception("could not start forming the next generation's groups ahead")
                    prepared = None
                if prepared is not None:
                    self.preparing[id(command)] = prepared
            self.queue.put(command)  # before the flag: get() clears it only once the queue is empty
            if _drops_peers(command):
                self.replanned.set()

    def get(self):
        command = self.queue.get()
        if self.queue.empty():
            self.replanned.clear()
        return self._taken(command)

    def poll(self):
        try:
            command = self.queue.get_nowait()
        except queue.Empty:
            return None
        if self.queue.empty():
            self.replanned.clear()
        return self._taken(command)

    def _taken(self, command):
        # Out of ``preparing`` as it leaves the queue: an id is unique only among live objects.
        self._handed = (command, self.preparing.pop(id(command), None))
        return command

    def waiting(self) -> bool:
        """A command (or the agent's end) is queued, and ready to act on: a plan whose group is still
        being formed in the background waits for it (the old generation trains on meanwhile), unless
        another command came after it."""
        with self.queue.mutex:
            queued = list(self.queue.queue)
        if len(queued) != 1 or queued[0] is None:
            return bool(queued)
        prepared = self.preparing.get(id(queued[0]))
        return prepared is None or prepared.ready()

    def prepared_for(self, command):
        """What ``on_arrival`` prepared for ``command``, the command taken last (None: nothing), handed over once."""
        taken, prepared = self._handed
        if taken is not command:
            return None
        self._handed = (None, None)
        return prepared

    def get_within(self, seconds: float):
        """The next command, or ``NOT_ARRIVED`` after ``seconds``."""
        try:
            command = self.queue.get(timeout=seconds)
        except queue.Empty:
            return NOT_ARRIVED
        if self.queue.empty():
            self.replanned.clear()
        return self._taken(command)


SLOW_PREPARE_S = 1.0
"""A generation's preparation (``prepare_arrival``) longer than this is logged: the other ranks wait."""

NOT_ARRIVED = object()
"""``CommandReader.get_within`` timed out."""


def _drops_peers(command) -> bool:
    """A shutdown, a checkpoint, a plan whose previous generation lost ranks, or a re-form of the same
    ranks (the current generation was abandoned): anything but a join, which the current one outlives,
    or the leave of a node on notice (``at_boundary``), which finishes the iteration in flight."""
    kind = command.WhichOneof("command")
    if kind == "shutdown" and command.shutdown.at_boundary:
        return False  # this node leaves on notice: its peers need it until the iteration ends
    if kind == "master_lost" or (kind == "checkpoint" and command.checkpoint.at_boundary):
        return False  # every peer is still there: the iteration in flight ends, then all checkpoint it
    if kind != "assignment":
        return True
    a = command.assignment
    if not a.previous_generation or a.at_boundary:
        return False
    old_world = sum(len(p.stages) for p in a.previous_plan.pipelines)
    kept = len({r for r in a.previous_ranks if r >= 0})
    return kept < old_world or a.world_size == old_world


@dataclass(slots=True)
class Generation:
    number: int
    plan: ExecutionPlan
    rank: int
    engine: StageEngine


class WorkerLoop:
    def __init__(self, conn, job, node: str, local_rank: int):
        self.conn, self.node, self.local_rank = conn, node, local_rank
        self.job = compute_job(job)
        """What this worker computes: the job, or an emulated job's shrunk compute copy (``config.emulation``)."""
        self.emulation = Emulation.for_job(job, node)
        """An emulated job's accelerator: the real job's true op times (None when not emulated)."""
        self.commands = CommandReader(conn, on_arrival=self._prepare_group)
        self.device = device_for(job, local_rank)
        self.committed: Generation | None = None  # last generation in which a step completed
        self.current: Generation | None = None
        self.next_step: int | None = None  # first step not yet applied to this worker's layers
        self.timeouts = job.fault_tolerance
        self.waiter = Waiter(
            self.timeouts.collective_timeout,
            self.commands.replanned.is_set,
            on_stall=self._stalled,
            stall_after=self.timeouts.stall_report_after.total_seconds(),
        )
        self._send_lock = threading.Lock()  # the checkpoint writer reports from its own thread
        self.checkpointer = AsyncCheckpointer(self._checkpoint_written, self._checkpoint_failed, node=node)
        self.assigned_generation = 0
        """The generation of the assignment in hand (from its rendezvous on)."""
        # A hold point (runtime/hold.py, tests and --inject @phase:P) is reported before it holds.
        set_announcer(
            lambda point, seconds: self.phase(self.assigned_generation, "holding", seconds=seconds, message=point)
        )

    # ------------------------------------------------------------------ reports
    def report(self, **kind) -> None:
        with self._send_lock:
            send_report(self.conn, pb.WorkerReport(**kind))

    def _checkpoint_written(self, directory: str, step: int, layers: int, generation: int, seconds: float) -> None:
        self.report(
            checkpoint_done=pb.CheckpointDone(
                dir=directory,
                step=step,
                layers=layers,
                generation=generation,
                seconds=seconds,
                snapshot_seconds=self.checkpointer.snapshot_s,
            )
        )

    def _checkpoint_failed(self, directory: str, step: int, generation: int, error: str) -> None:
        self.report(checkpoint_done=pb.CheckpointDone(dir=directory, step=step, generation=generation, error=error))

    def phase(
        self,
        generation: int,
        name: str,
        step: int = -1,
        seconds: float = 0.0,
        nbytes: int = 0,
        message: str = "",
        transfer_seconds: float = 0.0,
        formed_ahead: bool = False,
        bad_checkpoint: str = "",
    ) -> None:
        self.report(
            phase=pb.PhaseDone(
                generation=generation,
                phase=name,
                step=step,
                seconds=seconds,
                bytes=nbytes,
                message=message,
                transfer_seconds=transfer_seconds,
                formed_ahead=formed_ahead,
                bad_checkpoint=bad_checkpoint,
            )
        )

    def _stalled(self, what: str, waited: float) -> None:
        generation = self.current.number if self.current is not None else 0
        self.report(stalled=pb.Stalled(generation=generation, what=what, waited_s=waited))

    # ------------------------------------------------------------------ main loop
    def run(self) -> None:
        command = self.commands.get()
        while command is not None:
            kind = command.WhichOneof("command")
            if kind == "shutdown":
                self._finish_checkpoint_write(f"shut down ({command.shutdown.reason})")
                return
            if kind == "checkpoint":
                self.checkpoint(command.checkpoint)
                command = self.commands.get()
            elif kind == "master_lost":  # between generations: no step every rank agreed on to write
                self.report(checkpoint_done=pb.CheckpointDone(step=-1, error="not inside a generation"))
                return
            else:
                command = self.run_generation(command)

    def _finish_checkpoint_write(self, when: str) -> None:
        """A periodic checkpoint's share still being written in the background is finished (bounded by
        ``checkpoint_round_timeout``) and reported, so the master completes its ``meta.json``, before this
        worker says done or goes: the job's end killed it midway, leaving a step folder of .tmp files (issue
        30); and a leave on notice switches at an iteration boundary, which may be a checkpoint step whose
        share the leaving worker has just snapshotted (seen in ``test_partition.py``)."""
        if not self.checkpointer.wait(self.timeouts.checkpoint_round_timeout.total_seconds()):
            log.warning(
                "%s: the background checkpoint write did not finish within checkpoint_round_timeout; "
                "its folder stays incomplete (no meta.json)",
                when,
            )

    def run_generation(self, command):
        """Train generation ``command.assignment``; returns the next command to act on (None: the agent is gone)."""
        a = command.assignment
        prepared = self.commands.prepared_for(command)
        plan = plan_from_proto(a.plan)
        t0 = time.perf_counter()
        try:
            arrival = self.prepare(a, plan)
        finally:
            if prepared is not None:
                prepared.may_arrive()  # a joiner's group forms once it can adopt at once (PreparedGroup's gate)
        if (took := time.perf_counter() - t0) > SLOW_PREPARE_S:  # its peers wait for it in the rendezvous
            log.warning("generation %d: building what this rank receives took %.1f s", a.generation, took)
        try:
            pending = self.rendezvous(a, prepared)
            if pending is not None:
                return pending
            engine, start = self.adopt(a, plan, arrival)
        except PeerFailure as error:
            return self.abort(
                a.generation,
                self.next_step or a.start_step,
                str(error),
                bad_checkpoint=error.directory if isinstance(error, UnreadableCheckpoint) else "",
            )
        gen = Generation(a.generation, plan, a.rank, engine)
        self.current = gen
        engine.command_waiting = self.commands.waiting
        engine.before_reduce = lambda: hold_once("reduce", self.node)
        every = self.timeouts.checkpoint_every.total_seconds() if self.timeouts.checkpoint_every else 0.0
        if every and a.checkpoint_dir:  # time-based periodic checkpoints: this worker's clock, agreed by all
            last_checkpoint = time.monotonic()
            engine.checkpoint_due = lambda: time.monotonic() - last_checkpoint >= every
        switch = False
        for step in range(start, a.steps):
            if switch:  # every rank: some rank held a command when the last step ended (StepResult.switch)
                asked = time.perf_counter()
                pending = self.commands.get_within(self.timeouts.collective_timeout.total_seconds())
                if (waited := time.perf_counter() - asked) > SLOW_PREPARE_S:
                    log.warning("generation %d: waited %.1f s at the switch for the next command", a.generation, waited)
                if (
                    pending is not NOT_ARRIVED
                    and pending is not None
                    and pending.WhichOneof("command") == "master_lost"
                ):
                    return self.checkpoint_without_master(a, engine)
                if pending is not NOT_ARRIVED:  # (else the master sent us nothing: a peer's step will fail)
                    leave_group()
                    return pending  # a new plan (a join, a leave, a failure elsewhere) or a shutdown
            hold_step(step, self.node)
            try:
                result = engine.train_step(step)
            except RuntimeError as error:
                if is_out_of_memory(error):  # this stage does not fit: the same after any recovery
                    raise OutOfMemory(self.node, self.local_rank, step, error) from error
                # gloo/NCCL: a peer died, hung past the timeout, or left
                engine.discard_iteration()
                return self.abort(a.generation, step, str(error).splitlines()[0])
            self.next_step = step + 1
            switch = result.switch
            self.report(metrics=step_metrics(a, plan, engine, result))
            if self.committed is not gen:
                self.committed = gen
                self.phase(a.generation, "resumed", step=step)
            by_steps = a.checkpoint_interval and self.next_step % a.checkpoint_interval == 0
            again = a.checkpoint_after_first_step and step == start  # the loss cut the last one short
            if (by_steps or again or result.checkpoint_due) and a.checkpoint_dir:
                if every:
                    last_checkpoint = time.monotonic()
                # A directory per step: a save cut short by a lost peer leaves a directory without
                # meta.json next to the last complete checkpoint, never a mix of two steps in one.
                directory = periodic_checkpoint_dir(a.checkpoint_dir, self.next_step)
                if a.checkpoint_async:  # live mode: each layer by one holder, written in the background
                    if again:  # this rank may still write the checkpoint the loss cut short: not skipped
                        self.checkpointer.wait(self.timeouts.checkpoint_round_timeout.total_seconds())
                    owned = [i for i in engine.layers if plan.checkpoint_owner(i) == a.rank]
                    self.checkpointer.save(
                        directory,
                        engine.held(),
                        owned,
                        engine.specs,
                        self.next_step,
                        a.generation,
                        engine.shared_state(),
                    )
                    continue
                try:
                    saved = save_checkpoint(directory, engine, self.next_step, self.node)
                except RuntimeError as error:  # a peer died mid-save: the step stands, the checkpoint does not
                    return self.abort(a.generation, self.next_step, f"checkpoint: {str(error).splitlines()[0]}")
                if saved.error:  # the disk refused this rank's share: said as such, training goes on
                    self.report(
                        checkpoint_done=pb.CheckpointDone(
                            dir=directory, step=self.next_step, generation=a.generation, error=saved.error
                        )
                    )
                elif saved.complete:  # the generation: the master tells a gone generation's late one (issue 56)
                    self.report(
                        checkpoint_done=pb.CheckpointDone(
                            dir=directory, step=self.next_step, layers=len(engine.layers), generation=a.generation
                        )
                    )
        if a.save_final_dir:
            try:
                saved = save_checkpoint(
                    a.save_final_dir, engine, a.steps, self.node
                )  # its hold point (kill@phase:checkpoint)
            except RuntimeError as error:  # the next generation (no steps left) saves it again
                return self.abort(a.generation, a.steps, f"final save: {str(error).splitlines()[0]}")
            if saved.error:  # every step trained; the disk refused the model: the user's to fix, named
                raise UserError(f"--save-final: could not write the final checkpoint: {saved.error}")
            if saved.complete:
                write_replica_hashes(a.save_final_dir, engine)
        self._finish_checkpoint_write(f"generation {a.generation}")
        self.report(done=pb.WorkerDone(step=a.steps - 1))
        leave_group()
        return self.commands.get()

    def checkpoint_without_master(self, a, engine: StageEngine):
        """The master is gone and every rank of this generation stopped after the same step (the switch):
        together they write that step, meta.json included, where the job's periodic checkpoints go, so
        ``--resume`` loses nothing. Reports the result to the agent (which prints the resume command)
        and stops."""
        self.checkpointer.wait(self.timeouts.checkpoint_round_timeout.total_seconds())  # one writer at a time
        directory = periodic_checkpoint_dir(a.checkpoint_dir, self.next_step)
        try:
            saved = save_checkpoint(directory, engine, self.next_step, self.node)
        except RuntimeError as error:  # a peer died too: nothing complete to offer
            saved = SaveOutcome(False, f"a peer failed during the checkpoint: {str(error).splitlines()[0]}")
        if saved.complete:
            self.report(
                checkpoint_done=pb.CheckpointDone(
                    dir=directory, step=self.next_step, layers=len(engine.layers), generation=a.generation
                )
            )
        else:
            self.report(
                checkpoint_done=pb.CheckpointDone(
                    dir=directory,
                    step=self.next_step,
                    generation=a.generation,
                    error=saved.error or "another rank could not write",
                )
            )
        leave_group()
        return pb.WorkerCommand(shutdown=pb.Shutdown(reason="the master is lost"))

    def abort(self, generation: int, step: int, message: str, bad_checkpoint: str = ""):
        log.warning("generation %d: iteration %d abandoned: %s", generation, step, message)
        t0 = time.perf_counter()
        leave_group(abort=True)  # closes our connections: peers blocked on us fail fast instead of timing out
        # (seconds: the leave itself; a slow one holds this rank out of the next generation's rendezvous)
        self.phase(
            generation,
            "aborted",
            step=step,
            message=message[:500],
            seconds=time.perf_counter() - t0,
            bad_checkpoint=bad_checkpoint,
        )
        return self.commands.get()

    # ------------------------------------------------------------------ generation set-up
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

    # ------------------------------------------------------------------ below threshold
    def checkpoint(self, c) -> None:
        """Write the layers this worker owns among the survivors of generation ``c.generation``."""
        gen = self.committed if self.committed and self.committed.number == c.generation else self.current
        if gen is None or gen.number != c.generation or self.next_step is None:
            self.report(checkpoint_done=pb.CheckpointDone(dir=c.dir, step=-1, layers=0))
            return
        alive = set(c.surviving_ranks)
        owned = [i for i in gen.engine.layers if min(r for r in gen.plan.holders(i) if r in alive) == gen.rank]
        try:
            save_layers(c.dir, gen.engine.held(), owned, gen.engine.specs, gen.engine.shared_state())
        except OSError as exc:  # a full disk is what it is, not a lost node or a bug
            error = write_error(exc, c.dir)
            self.report(checkpoint_done=pb.CheckpointDone(dir=c.dir, step=self.next_step, error=error))
            return
        self.report(checkpoint_done=pb.CheckpointDone(dir=c.dir, step=self.next_step, layers=len(owned)))


def worker_main(conn, config_path: str, node: str, local_rank: int) -> None:
    """Entry point of a worker process started by an agent (one per GPU)."""
    if "OMP_NUM_THREADS" in os.environ:
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    level = getattr(logging, os.environ.get("OOBLECK_LOG_LEVEL", "info").upper(), logging.INFO)  # the agent's
    logging.basicConfig(level=level, format=f"%(asctime)s {node}/gpu{local_rank} %(levelname)s %(message)s")
    # torch's first optimizer imports torch._dynamo (1.5-2 s on this machine): pay it while the
    # process starts, not inside the first generation's state copy.
    torch.optim.AdamW([torch.zeros(1, requires_grad=True)])
    # The rendezvous store's client (its module pulls gRPC's stubs): imported on a worker's first
    # rendezvous it made a joiner's 0.11-0.15 s against the survivors' 0.06 s, and the survivors wait
    # for the last to arrive (4 ranks, one run each: 0.05-0.065 s with the import paid here).
    import oobleck_mm.runtime.store  # noqa: F401

    try:
        loop = WorkerLoop(conn, load_config(config_path), node, local_rank)
        import_layer_code(loop.job)  # an HF model's modules: at start-up, not in a recovery's copy
        warm_balancer(loop.job)  # and the balancer's kernels, not in a joiner's preparation
        # Ready to join a generation at once: a joining node is admitted only now, so the
        # survivors never wait for a new worker's start-up (imports, warm-up).
        loop.report(ready=pb.WorkerReady(startup_s=time.time() - _process_start()))
        loop.run()
    except (UserError, MemoryError) as error:  # deterministic: every replica fails alike, recovery cannot help
        log.error("worker stopped by the job's input: %s", error)
        _report_failure(conn, pb.WorkerFailed(message=str(error) or "out of host memory", user_error=True))
        raise SystemExit(ExitCode.BAD_INPUT) from None
    except Exception as error:  # neither a peer's failure (those end an iteration) nor the user's: a bug
        message = traceback.format_exc()
        log.error("worker failed (a bug):\n%s", message)
        summary = f"{type(error).__name__}: {error}"
        _report_failure(conn, pb.WorkerFailed(message=f"{summary}\n{message}", bug=True))
        raise SystemExit(ExitCode.ERROR) from None


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


def _process_start() -> float:
    """This process's start (wall clock), from the kernel: imports included."""
    import psutil

    return psutil.Process().create_time()


class OutOfMemory(UserError):
    """A stage ran out of device (or host) memory: the plan's memory model and the job disagree."""

    def __init__(self, node: str, local_rank: int, step: int, error: BaseException) -> None:
        super().__init__(
            f"out of memory on {node}/gpu{local_rank} in step {step} ({str(error).splitlines()[0]}); lower "
            f"training.microbatch_size or cluster.device_memory (the planner then uses more, smaller stages), "
            f"or turn on training.activation_checkpointing"
        )


def is_out_of_memory(error: BaseException) -> bool:
    """torch's OutOfMemoryError (CUDA), or the CPU allocator's own words for it."""
    if isinstance(error, torch.OutOfMemoryError):
        return True
    text = str(error)
    return "can't allocate memory" in text or "out of memory" in text.lower()


def _report_failure(conn, failed: pb.WorkerFailed) -> None:
    try:
        send_report(conn, pb.WorkerReport(failed=failed))
    except (OSError, EOFError):
        pass  # the agent is gone: its supervision (or the master's detector) says why


def step_metrics(a, plan: ExecutionPlan, engine: StageEngine, result) -> pb.StepMetrics:
    """What the master logs of one step on this rank (metrics.csv, TensorBoard, the console)."""
    predicted = engine.balancer.last_metrics if engine.balancer is not None else {}
    return pb.StepMetrics(
        generation=a.generation,
        step=result.step,
        rank=a.rank,
        loss=result.loss,
        samples_per_s=plan.global_batch / result.step_time_s,
        step_time_s=result.step_time_s,
        forward_s=result.forward_s,
        backward_s=result.backward_s,
        comm_s=result.comm_s,
        lr=result.lr,
        expected_compute_s=result.expected_compute_s,
        grad_norm=result.grad_norm,
        tokens=result.tokens,
        peak_memory_bytes=peak_memory_bytes(engine.device),
        pipeline_s=result.pipeline_s,
        skipped=result.skipped,
        loss_scale=result.loss_scale,
        predicted_max_s=predicted.get("predicted_max_s", 0.0),
        predicted_mean_s=predicted.get("predicted_mean_s", 0.0),
        predicted_contiguous_max_s=predicted.get("predicted_contiguous_max_s", 0.0),
        finished_at=time.time(),
        deferred=result.deferred,
        **_lateness_fields(result.lateness),
    )


def _lateness_fields(lateness) -> dict:
    """An emulated step's ``emulation.clock.Lateness`` as ``StepMetrics`` fields (none when not emulated)."""
    if lateness is None:
        return {}
    return dict(
        emulated_ops=lateness.ops,
        emulated_late_ops=lateness.late_ops,
        emulated_worst_lateness=lateness.worst,
        emulated_s=lateness.emulated_s,
        emulated_late_s=lateness.late_s,
    )
