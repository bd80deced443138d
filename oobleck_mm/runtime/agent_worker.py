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
import os
import threading
import time
import traceback

import torch

from oobleck_mm.config import load_config
from oobleck_mm.config.emulation import compute_job
from oobleck_mm.errors import ExitCode, UserError
from oobleck_mm.protocol import oobleck_pb2 as pb
from oobleck_mm.protocol.convert import plan_from_proto
from oobleck_mm.protocol.pipe import send_report
from oobleck_mm.runtime.async_checkpoint import AsyncCheckpointer
from oobleck_mm.runtime.checkpoint import save_layers, write_error
from oobleck_mm.runtime.checkpoint_meta import periodic_checkpoint_dir
from oobleck_mm.model.layers import import_layer_code
from oobleck_mm.runtime.emulated import Emulation
from oobleck_mm.runtime.balancing import warm_balancer
from oobleck_mm.runtime.group import leave_group
from oobleck_mm.runtime.hold import hold_once, hold_step, set_announcer
from oobleck_mm.runtime.waiting import PeerFailure, Waiter
from oobleck_mm.runtime import worker_machine as wm
from oobleck_mm.runtime.commands import NOT_ARRIVED, CommandReader
from oobleck_mm.runtime.generation_setup import (
    Generation,
    GenerationSetUp,
    OutOfMemory,
    UnreadableCheckpoint,
    is_out_of_memory,
)
from oobleck_mm.runtime.step_metrics import step_metrics
from oobleck_mm.runtime.worker import SaveOutcome, device_for, save_checkpoint, write_replica_hashes

log = logging.getLogger(__name__)


SLOW_PREPARE_S = 1.0
"""A generation's preparation (``prepare_arrival``) longer than this is logged: the other ranks wait."""


class WorkerLoop(GenerationSetUp):
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
        self.machine = wm.WorkerState()
        """The worker's decision state (``oobleck_mm.runtime.worker_machine``)."""
        self.a = None
        """The assignment of the generation in hand."""
        self._last_checkpoint = 0.0
        self._error: BaseException | None = None
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
        """Feeds the worker's machine (``oobleck_mm.runtime.worker_machine``, where every decision is taken)
        and carries out its effects, until it stops."""
        event: wm.Event | None = wm.Taken(self.commands.get())
        while event is not None:
            transition = wm.step(self.machine, event)
            event = None
            for effect in transition.effects:
                event = _EFFECTS[type(effect)](self, effect)
                if event is not None:  # an answer: the next event, and the rest of the list is not done
                    break

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

    # ------------------------------------------------------------------ effects
    def _next_command(self, e: wm.NextCommand) -> wm.Taken:
        return wm.Taken(self.commands.get())

    def _await_switch(self, e: wm.AwaitSwitch) -> wm.SwitchCommand:
        asked = time.perf_counter()
        pending = self.commands.get_within(self.timeouts.collective_timeout.total_seconds())
        if (waited := time.perf_counter() - asked) > SLOW_PREPARE_S:
            log.warning("generation %d: waited %.1f s at the switch for the next command", self.a.generation, waited)
        if pending is NOT_ARRIVED:
            return wm.SwitchCommand(None, arrived=False)
        return wm.SwitchCommand(pending)

    def _set_up(self, e: wm.SetUp) -> wm.Event:
        """Prepare, rendezvous, agree on the start, copy the states: generation ``e.command.assignment``."""
        command = e.command
        a = self.a = command.assignment
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
                return wm.Interrupted(pending)
            engine, start = self.adopt(a, plan, arrival)
        except PeerFailure as error:
            return wm.SetUpFailed(
                str(error),
                self.next_step or a.start_step,
                bad_checkpoint=error.directory if isinstance(error, UnreadableCheckpoint) else "",
            )
        self.current = Generation(a.generation, plan, a.rank, engine)
        engine.command_waiting = self.commands.waiting
        engine.before_reduce = lambda: hold_once("reduce", self.node)
        every = self.timeouts.checkpoint_every.total_seconds() if self.timeouts.checkpoint_every else 0.0
        if every and a.checkpoint_dir:  # time-based periodic checkpoints: this worker's clock, agreed by all
            self._last_checkpoint = time.monotonic()
            engine.checkpoint_due = lambda: time.monotonic() - self._last_checkpoint >= every
        return wm.Adopted(start)

    def _train(self, e: wm.Train) -> wm.Event:
        gen = self.current
        hold_step(e.step, self.node)
        try:
            result = gen.engine.train_step(e.step)
        except RuntimeError as error:
            self._error = error
            return wm.StepFailed(e.step, str(error).splitlines()[0], out_of_memory=is_out_of_memory(error))
        self.next_step = e.step + 1
        self.report(metrics=step_metrics(self.a, gen.plan, gen.engine, result))
        return wm.StepDone(e.step, result.switch, result.checkpoint_due)

    def _committed(self, e: wm.Committed) -> None:
        self.committed = self.current
        self.phase(e.generation, "resumed", step=e.step)

    def _write_share(self, e: wm.WriteShare) -> wm.WriteFailed | None:
        a, gen = self.a, self.current
        if self.timeouts.checkpoint_every:
            self._last_checkpoint = time.monotonic()
        directory = periodic_checkpoint_dir(a.checkpoint_dir, e.step)
        if e.background:  # live mode: each layer by one holder, written in the background
            if e.finish_first:  # this rank may still write the checkpoint the loss cut short: not skipped
                self.checkpointer.wait(self.timeouts.checkpoint_round_timeout.total_seconds())
            owned = [i for i in gen.engine.layers if gen.plan.checkpoint_owner(i) == a.rank]
            self.checkpointer.save(
                directory, gen.engine.held(), owned, gen.engine.specs, e.step, a.generation, gen.engine.shared_state()
            )
            return None
        try:
            saved = save_checkpoint(directory, gen.engine, e.step, self.node)
        except RuntimeError as error:  # a peer died mid-save: the step stands, the checkpoint does not
            return wm.WriteFailed(e.step, f"checkpoint: {str(error).splitlines()[0]}")
        if saved.error:  # the disk refused this rank's share: said as such, training goes on
            self.report(
                checkpoint_done=pb.CheckpointDone(
                    dir=directory, step=e.step, generation=a.generation, error=saved.error
                )
            )
        elif saved.complete:  # the generation: the master tells a gone generation's late one (issue 56)
            self.report(
                checkpoint_done=pb.CheckpointDone(
                    dir=directory, step=e.step, layers=len(gen.engine.layers), generation=a.generation
                )
            )
        return None

    def _save_final(self, e: wm.SaveFinal) -> wm.Event:
        a, engine = self.a, self.current.engine
        try:
            saved = save_checkpoint(
                a.save_final_dir, engine, a.steps, self.node
            )  # its hold point (kill@phase:checkpoint)
        except RuntimeError as error:  # the next generation (no steps left) saves it again
            return wm.WriteFailed(a.steps, f"final save: {str(error).splitlines()[0]}")
        if saved.error:  # every step trained; the disk refused the model: the user's to fix, named
            raise UserError(f"--save-final: could not write the final checkpoint: {saved.error}")
        if saved.complete:
            write_replica_hashes(a.save_final_dir, engine)
        return wm.FinalSaved()

    def _finish_shares(self, e: wm.FinishShares) -> None:
        self._finish_checkpoint_write(e.when)

    def _abort(self, e: wm.Abort) -> None:
        if e.discard:
            self.current.engine.discard_iteration()
        log.warning("generation %d: iteration %d abandoned: %s", e.generation, e.step, e.message)
        t0 = time.perf_counter()
        leave_group(abort=True)  # closes our connections: peers blocked on us fail fast instead of timing out
        # (seconds: the leave itself; a slow one holds this rank out of the next generation's rendezvous)
        self.phase(
            e.generation,
            "aborted",
            step=e.step,
            message=e.message[:500],
            seconds=time.perf_counter() - t0,
            bad_checkpoint=e.bad_checkpoint,
        )

    def _leave_group(self, e: wm.LeaveGroup) -> None:
        leave_group()

    def _below_threshold(self, e: wm.BelowThreshold) -> None:
        self.checkpoint(e.checkpoint)

    def _write_without_master(self, e: wm.WriteWithoutMaster) -> None:
        """The master is gone and every rank of this generation stopped after the same step (the switch):
        together they write that step, meta.json included, where the job's periodic checkpoints go, so
        ``--resume`` loses nothing. Reports the result to the agent (which prints the resume command)."""
        a, engine = self.a, self.current.engine
        directory = periodic_checkpoint_dir(a.checkpoint_dir, e.step)
        try:
            saved = save_checkpoint(directory, engine, e.step, self.node)
        except RuntimeError as error:  # a peer died too: nothing complete to offer
            saved = SaveOutcome(False, f"a peer failed during the checkpoint: {str(error).splitlines()[0]}")
        if saved.complete:
            done = pb.CheckpointDone(dir=directory, step=e.step, layers=len(engine.layers), generation=a.generation)
        else:
            error = saved.error or "another rank could not write"
            done = pb.CheckpointDone(dir=directory, step=e.step, generation=a.generation, error=error)
        self.report(checkpoint_done=done)

    def _report_nothing(self, e: wm.ReportNothing) -> None:
        self.report(checkpoint_done=pb.CheckpointDone(step=-1, error="not inside a generation"))

    def _report_done(self, e: wm.ReportDone) -> None:
        self.report(done=pb.WorkerDone(step=e.step))

    def _out_of_memory(self, e: wm.OutOfMemory) -> None:
        raise OutOfMemory(self.node, self.local_rank, e.step, self._error) from self._error

    def _stop(self, e: wm.Stop) -> None:
        pass

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


_EFFECTS = {
    wm.NextCommand: WorkerLoop._next_command,
    wm.AwaitSwitch: WorkerLoop._await_switch,
    wm.SetUp: WorkerLoop._set_up,
    wm.Train: WorkerLoop._train,
    wm.Committed: WorkerLoop._committed,
    wm.WriteShare: WorkerLoop._write_share,
    wm.SaveFinal: WorkerLoop._save_final,
    wm.FinishShares: WorkerLoop._finish_shares,
    wm.Abort: WorkerLoop._abort,
    wm.LeaveGroup: WorkerLoop._leave_group,
    wm.BelowThreshold: WorkerLoop._below_threshold,
    wm.WriteWithoutMaster: WorkerLoop._write_without_master,
    wm.ReportNothing: WorkerLoop._report_nothing,
    wm.ReportDone: WorkerLoop._report_done,
    wm.OutOfMemory: WorkerLoop._out_of_memory,
    wm.Stop: WorkerLoop._stop,
}


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


def _process_start() -> float:
    """This process's start (wall clock), from the kernel: imports included."""
    import psutil

    return psutil.Process().create_time()


def _report_failure(conn, failed: pb.WorkerFailed) -> None:
    try:
        send_report(conn, pb.WorkerReport(failed=failed))
    except (OSError, EOFError):
        pass  # the agent is gone: its supervision (or the master's detector) says why
