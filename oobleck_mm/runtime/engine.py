"""One worker's training engine: its pipeline stage, run as DeepSpeed's 1F1B instruction stream.

Each iteration the stage walks ``deepspeed.runtime.pipe.schedule.TrainSchedule``
for its pipeline's microbatch count and stage index and executes every
instruction through a dispatch table (an unknown instruction raises). Then
gradients are all-reduced layer-wise across pipelines (``GradientSync``) and
every layer's optimizer steps (``apply_update``).

Which samples a microbatch holds comes from an ``Assignment`` of the step's
global batch (contiguous by default, the balancer's otherwise); every stage
packs the microbatch itself from the local dataset, so only hidden states and
their gradients cross stages.

Frozen layers (§3.3.1): they get no gradients and no optimizer. A stage
back-propagates into its input only when a trainable layer sits before it, so
with a frozen vision encoder at the front nothing flows back into it at all.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping

import os

import torch
from torch.distributed.tensor import DTensor

if not torch.cuda.is_available():
    # Tell DeepSpeed up front instead of letting every worker log its accelerator probe.
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
from deepspeed.runtime.pipe import schedule as ds  # noqa: E402

from oobleck_mm.balance.assignment import Assignment, contiguous_assignment
from oobleck_mm.config.shape import MEDIA_INPUT_KINDS
from oobleck_mm.data.loader import TrainingData
from oobleck_mm.model.layers import (
    build_layer,
    model_layer_specs,
    parameter_rows,
    tied_pair,
    tied_rows,
    trainable_mask,
)
from oobleck_mm.runtime.balancing import ComputeExpectation, step_balancer
from oobleck_mm.runtime.context_parallel import check_context_parallel
from oobleck_mm.runtime.grad_sync import GradientSync, sharded_layers
from oobleck_mm.planning.layout import ExecutionPlan, piece_samples
from oobleck_mm.precision import LossScaler, compute_dtype, is_mixed, reduce_dtype
from oobleck_mm.runtime.mixed import ComputeCopies, overflow_injected, poison_gradients
from oobleck_mm.runtime.optim import lr_at, optimizer_state
from oobleck_mm.runtime.sharding import Gather, gathered, shard_layer, whole_layer
from oobleck_mm.runtime.p2p import send_abandoned
from oobleck_mm.runtime.timing import Stopwatch
from oobleck_mm.runtime.update import apply_update, local, trainable_params
from oobleck_mm.runtime.waiting import Waiter
from oobleck_mm.runtime.microbatch_flow import MicrobatchFlow
from oobleck_mm.runtime.stage_parts import (  # noqa: F401 - engine_subgroups: read from here by its users
    HeldLayer,
    RanksDisagree,
    StepResult,
    assignments_agree,
    engine_subgroups,
    execute,
    fresh_layer,
)

log = logging.getLogger(__name__)


class StageEngine(MicrobatchFlow):
    def __init__(
        self,
        job,
        plan: ExecutionPlan,
        rank: int,
        data: TrainingData | None = None,
        device: torch.device | str = "cpu",
        held: Mapping[int, HeldLayer] | None = None,
        waiter: Waiter | None = None,
        balancer=None,
        scaler: LossScaler | None = None,
        emulation=None,
    ):
        """``held``: layers this worker already holds (after a reconfiguration, with their optimizers);
        every other layer of the stage is built fresh from the seed. ``emulation``: the worker's emulated
        accelerator (``runtime.emulated.Emulation``) when ``cluster.emulate`` is set: ``job`` is then the
        compute copy, and every op of the stage ends when the real model's would on the emulated GPU."""
        self.job, self.plan, self.rank, self.device = job, plan, rank, torch.device(device)
        self.specs = model_layer_specs(job)
        if plan.num_layers != len(self.specs):
            raise ValueError(f"plan has {plan.num_layers} layers, the model {len(self.specs)}")
        if plan.microbatch_size != job.training.microbatch_size:
            raise ValueError(
                f"plan microbatch size {plan.microbatch_size} != training.microbatch_size "
                f"{job.training.microbatch_size}"
            )
        self.data = data if data is not None else TrainingData(job)
        self.waiter = waiter or Waiter()
        if balancer is None and job.balance.enabled:
            balancer = step_balancer(job, self.data, self.specs, self.device, emulation)
        self.balancer = balancer
        work = getattr(balancer, "work", None)
        self.expectation = (
            ComputeExpectation(work, job.balance.fixed_s_per_layer)
            if work is not None
            else ComputeExpectation.for_job(job, self.data, self.specs, emulation)
        )
        """What the cost model says this rank's compute of a step's samples takes (the master's straggler
        detector's reference): with a balancer, over its cached features."""
        self.scaler = scaler if scaler is not None else LossScaler.for_training(job.training)
        """float16's loss scaler (None otherwise); handed on across plans like the balancer."""
        """Assigns samples to pipelines each step (None: contiguous); handed on across plans."""
        """How every transfer and collective is waited on (timeouts, the master's interrupt)."""
        self.clock = Stopwatch(self.device)
        self.emulation = emulation
        self.prefetch = self.device.type == "cuda" or emulation is not None
        """Pack the next microbatch as soon as this one's forward is queued: on a GPU (and an emulated one) the
        host packs (and copies, pinned and asynchronous) while the device computes; on the CPU nothing
        overlaps."""
        self.command_waiting: Callable[[], bool] = lambda: False
        """Whether this worker holds a command to apply at an iteration boundary (the worker sets it):
        the step's last collective tells every rank whether any rank does, so all switch together."""
        self.checkpoint_due: Callable[[], bool] = lambda: False
        """Whether this worker's clock says a periodic checkpoint is due; agreed in the same collective."""
        self.before_reduce: Callable[[], None] = lambda: None
        """Called before the step's last collective (the worker's ``reduce`` hold point)."""
        self.unsettled: int | None = None
        """A step whose gradients this rank all-reduced but whose update it has not applied: the step's
        last collective failed here (or was abandoned), and it may have completed on other ranks, which
        then applied the update. A collective can end on some ranks and fail on others: a peer that dies
        inside it after sending its last message, or a rank that gives up waiting (the master re-planned)
        while its gloo thread still finishes the collective for the others. The next generation settles
        it (``settle``): applied here too if any rank applied it, else discarded."""
        self.last_reduced: tuple[int, float] | None = None
        """(step, all-reduced squared gradient norm) of the last step whose last collective ended here:
        what a rank that missed it needs to apply the same update (``settle``)."""
        self.pipeline_index, self.stage_index = plan.position(rank)
        self.pipeline = plan.pipelines[self.pipeline_index]
        self.stage = self.pipeline.stages[self.stage_index]
        self.pieces = self.pipeline.pieces_of(self.stage_index, rank)
        """The pieces of every microbatch this rank runs: all (one) on a pipeline of one-GPU stages; on a stage
        of several GPUs each rank runs its share of the samples (``PipelineLayout.pieces``)."""
        senders, receiver = self.pipeline.neighbours(self.stage_index)
        self.prev_ranks = {k: self.pipeline.piece_rank(senders[0], k) for k in self.pieces} if senders else {}
        self.next_ranks = {} if receiver is None else {k: self.pipeline.piece_rank(receiver, k) for k in self.pieces}
        """Per piece this rank runs, the rank that sends its input (receives its output)."""
        self.branch_ranks = (
            {k: tuple(self.pipeline.piece_rank(j, k) for j in senders) for k in self.pieces} if len(senders) > 1 else {}
        )
        """The merge stage of a branched pipeline (``PipelineLayout.branches``): per piece this rank runs, the
        rank of each branch's last stage that runs that piece, in branch order; their outputs together are the
        piece's input. Empty elsewhere."""
        self._abandon_notices: list = []  # (tensor, request) of the notices sent when a step was given up
        self.prev_rank = self.prev_ranks[self.pieces[0]] if self.prev_ranks else None
        self.next_rank = self.next_ranks[self.pieces[0]] if self.next_ranks else None
        """The neighbours of this rank's first piece (the only one on a pipeline of one-GPU stages); None at an end."""

        self.reads_media = any(self.specs[i].kind in MEDIA_INPUT_KINDS for i in self.stage.layers)
        """Whether this stage holds an encoder's input layer, the only layers that read pixels and frames: the
        other stages pack their microbatches' layout alone (``TrainingData.microbatch(media=False)``)."""
        embeds = [i for i, spec in enumerate(self.specs) if spec.kind == "token_embed"]
        self.seam = embeds[0] if embeds and embeds[0] > 0 else None
        """The LLM's first layer (``llm.embed``), where encoder outputs become the LLM's input: the
        boundary Entrain's deferral regroups samples at (None: no encoder before it)."""
        self.side = (
            "encoder"
            if self.seam is not None and self.stage.layer_end <= self.seam
            else "seam"
            if self.seam is not None and self.stage.layer_start <= self.seam
            else "llm"
        )
        """Which microbatches this stage runs when the LLM's microbatches are decoupled (see ``_decouple``)."""
        self._decoupled = False
        self.timer = (
            emulation.stage(self.stage.layers, self.seam, len(plan.pipelines), self.stage.recompute)
            if emulation
            else None
        )
        """The stage's ops on the emulated device (None: not emulated)."""

        trainable = trainable_mask(job, self.specs)
        # A stage needs the gradient of its input iff a trainable layer feeds it (every earlier layer in a
        # chain; a branch's own earlier layers in a branched pipeline: the other branches do not feed it).
        upstream = self.pipeline.upstream_layers(self.stage_index)
        feeding = (*upstream, *self.stage.layers)
        self.needs_input_grad = any(trainable[i] for i in upstream)
        self.next_needs_grad = self.next_rank is not None and any(trainable[i] for i in feeding)
        self.needs_backward = any(trainable[i] for i in feeding)
        self.branch_needs_grad = tuple(
            any(trainable[i] for i in self.pipeline.branch_layers(b))
            for b in range(len(senders) if self.branch_ranks else 0)
        )
        """Per branch of the merge stage: whether that branch trains, so takes its output's gradient back."""

        handed_over = dict(held or {})
        held = dict(held or {})
        for i in self.stage.layers:
            if i not in held:
                held[i] = fresh_layer(job, i, self.specs, self.device)
        self.layers = {i: held[i].module for i in self.stage.layers}
        """The master layers: what the optimizer updates and what moves, checkpoints and verifies."""
        self.optimizers = {i: held[i].optimizer for i in self.stage.layers if held[i].optimizer is not None}
        # (a stage of several GPUs: FSDP2's mixed precision instead, runtime/sharding.py)
        self.mixed = (
            ComputeCopies(self.layers, compute_dtype(job.training))
            if is_mixed(job.training) and not self.stage.sharded
            else None
        )
        self.compute = self.mixed.compute if self.mixed is not None else self.layers
        """What forward and backward run: the masters, or their compute-dtype copies."""
        rows = parameter_rows(job, sharded_layers(plan, trainable), self.specs) if plan.sharded else None
        layer_bytes = {
            i: sum(p.numel() * p.element_size() for p in trainable_params(m)) for i, m in self.layers.items()
        }
        self.sync = GradientSync(
            plan,
            rank,
            trainable,
            self.waiter.timeout,
            tied_pair(self.specs),
            reduce_dtype(job.training),
            rows,
            tied_rows(job, self.specs) if plan.sharded else None,
            layer_bytes,
            job.training.grad_bucket_mb * 2**20,
        )
        # The emulated device prices the all-reduce after the backward (``timer.ready_for_allreduce``).
        self.overlap = job.training.grad_overlap and emulation is None
        """Start the gradient all-reduces during the step's last backward (``GradientSync.arm``)."""
        if self.stage.sharded:
            self._shard(handed_over)
        if self.stage.context_parallel:
            check_context_parallel(job, self.specs, self.stage)
        self._dispatch: dict[type, Callable] = {
            ds.LoadMicroBatch: self._load_microbatch,
            ds.RecvActivation: self._recv_activation,
            ds.ForwardPass: self._forward,
            ds.SendActivation: self._send_activation,
            ds.RecvGrad: self._recv_grad,
            ds.BackwardPass: self._backward,
            ds.SendGrad: self._send_grad,
            ds.ReduceTiedGrads: self._reduce_tied_grads,
            ds.ReduceGrads: self._reduce_grads,
            ds.OptimizerStep: self._optimizer_step,
        }

    def _shard(self, held: Mapping[int, HeldLayer]) -> None:
        """Shard this stage's layers over its ranks with FSDP2 (``runtime/sharding.py``; docs/runtime.md,
        "Stages of several GPUs"), ``held`` ones (handed over, loaded from a checkpoint) with their optimizer
        state.

        Each layer is its own ``fully_shard`` unit: its parameters are all-gathered before its forward and
        its backward and its gradients reduce-scattered after, per piece, as the planner prices it
        (``planning.costs.stage_cost``)."""
        from torch.distributed.device_mesh import DeviceMesh

        mesh = DeviceMesh.from_group(self.sync.stage_group, self.device.type)
        for i, module in self.layers.items():
            handed = held.get(i)
            state = optimizer_state(handed.optimizer) if handed is not None and handed.optimizer is not None else None
            optimizer = shard_layer(module, mesh, self.job.training, state)
            if optimizer is not None:
                self.optimizers[i] = optimizer

    # ------------------------------------------------------------------ iteration
    def train_step(self, step: int, assignment: Assignment | None = None) -> StepResult:
        """Run global iteration ``step`` (0-based) on this stage; every rank of the plan must call it."""
        t0, cpu0 = time.perf_counter(), time.process_time()
        if self.emulation is not None:
            self.emulation.begin_step(step, self.waiter.interrupt)
        self._pipeline_mark = self.clock.start()
        ids = self.data.global_batch(step)
        if assignment is None and self.balancer is not None:
            self.balancer.maybe_fit(step)
            assignment = self.balancer.assign(step, ids, self.plan)
        if assignment is None:
            counts = [p.num_microbatches for p in self.plan.pipelines]
            assignment = contiguous_assignment(ids, counts, self.plan.microbatch_size)
        self._step = step
        self._microbatches = assignment.pipelines[self.pipeline_index]
        self._digest = assignment.digest()
        self._decouple(assignment)
        self._loss_tokens = self.data.loss_tokens(ids)
        self._batches: dict = {}
        self._inputs: dict[int, tuple] = {}
        self._branch_sizes: dict[int, dict[int, list[int]]] = {}  # merge stage: per buffer and piece, the
        # tensors each branch sent
        self._outputs: dict[int, tuple] = {}
        self._grads: dict[int, tuple] = {}
        self._buffer_mb: dict[int, int] = {}
        self._grad_mb: dict[int, int] = {}  # buffer -> slot of the gradients SendGrad sends
        self._pack_s: dict[int, float] = {}
        self._next_forward = self._next_load = 0
        self._backwards = 0  # BackwardPass instructions run this step: the last one arms the overlap
        self._intervals: list[list] = []  # per microbatch: [forward, backward] intervals of self.clock
        self._loss = torch.zeros((), dtype=torch.float64, device=self.device)
        self._result = StepResult(
            step,
            0.0,
            0.0,
            0.0,
            0.0,
            tokens=self.data.llm_tokens(ids),
            microbatches=tuple(tuple(mb) for p in assignment.pipelines for mb in p),
            pieces=tuple(
                piece
                for layout, p in zip(self.plan.pipelines, assignment.pipelines)
                for mb in p
                for k in range(1 if layout.stages[0].context_parallel else layout.pieces)
                if (piece := piece_samples(mb, 1 if layout.stages[0].context_parallel else layout.pieces, k))
            ),
            deferred=sum(len(d) for p in assignment.deferred for d in p),
        )
        stages, stage_id = self.pipeline.schedule_position(self.stage_index)
        schedule = ds.TrainSchedule(micro_batches=len(self._microbatches), stages=stages, stage_id=stage_id)
        self.sync.attach(self.layers)  # the backward accumulates into the all-reduce's buffers
        try:
            execute(schedule.steps(), self._dispatch)
        except RuntimeError:
            self._tell_neighbours_abandoned()
            raise
        # The microbatches' times, read once the step's work is done (CUDA events: one sync here).
        self._result.microbatch_times = [(self.clock.seconds(f), self.clock.seconds(b)) for f, b in self._intervals]
        if self.balancer is None:  # (with a balancer, _measure_pipelines read it for the exchange)
            self._result.pipeline_s = self.clock.seconds(self._pipeline_interval)
        self._result.forward_s = sum(f for f, _ in self._result.microbatch_times)
        self._result.backward_s = sum(b for _, b in self._result.microbatch_times)
        self._result.expected_compute_s = self.expectation.seconds(
            self.stage, self._microbatches, self._llm_microbatches if self._decoupled else None
        )
        if self.balancer is not None:
            # Packing is this stage's work for the microbatch too (it grows with images and text):
            # the balancer's cost model is fitted to all of it (emulated: inside the forward's window).
            pack = {} if self.timer is not None else self._pack_s
            times = [(f + pack.get(mb, 0.0), b) for mb, (f, b) in enumerate(self._result.microbatch_times)]
            if self.rank == self.stage.rank:  # a stage of d GPUs: its first rank's share, as one GPU's seconds
                times = [(f * self.stage.width, b * self.stage.width) for f, b in times]
                self.balancer.observe(
                    self.stage, self._microbatches, times, self._llm_microbatches if self._decoupled else None
                )
        if self.emulation is not None:
            self._result.lateness = self.emulation.take()
        self._result.step_time_s = time.perf_counter() - t0
        self._result.host_cpu_s = time.process_time() - cpu0
        return self._result

    def _tell_neighbours_abandoned(self) -> None:
        """This rank gave up the step (a peer failed, or told it so): every pipeline neighbour that may be
        blocked receiving from it is told at once (``p2p.send_abandoned``), so the abort spreads along the
        pipeline in milliseconds instead of one group timeout per stage (measured: a branched pipeline's
        audio branch waited out 8 s for the gradients of a merge stage that had already given up)."""
        branches = (r for ranks in self.branch_ranks.values() for r in ranks)
        peers = {*self.prev_ranks.values(), *self.next_ranks.values(), *branches} - {self.rank}
        for peer in sorted(peers):
            try:
                self._abandon_notices.append(send_abandoned(peer, self.device))
            except RuntimeError:  # that peer is gone, or the group is: nothing to tell
                pass

    def _reduce_tied_grads(self, ins) -> None:
        pass  # done after the per-layer sums, in GradientSync.all_reduce (see its docstring)

    def _reduce_grads(self, ins) -> None:
        ready = []
        if self.timer is not None:  # the all-reduce starts when the devices have made the gradients
            self.timer.sync("gradients", self.waiter.interrupt)
            ready = self.timer.ready_for_allreduce(self.sync, self.waiter)
        t0 = time.perf_counter()
        # This stage's 1F1B part of the iteration, on the device's clock (read at the step's end:
        # a GPU's host reaches here while kernels still run).
        self._pipeline_interval = self.clock.stop(self._pipeline_mark)
        if overflow_injected(self._step, self.rank):
            poison_gradients(self.layers)
        self._result.grad_bytes = self.sync.all_reduce(self.layers, self.waiter)
        self._result.grad_bytes_overlapped = self.sync.overlapped_bytes
        self._result.grad_bytes_copied = self.sync.copied_bytes
        if self.timer is not None:
            self.timer.allreduce(ready)
        self._result.comm_s += time.perf_counter() - t0
        self._result.state_bytes = self.state_bytes()

    def _optimizer_step(self, ins) -> None:
        # The last collective of the iteration carries both the squared gradient norm and the
        # loss, *before* any parameter changes: if a peer fails before it, no rank has updated
        # anything and the iteration can be discarded and rerun after reconfiguration. If it fails
        # inside it, some ranks may have completed it (and updated): see ``unsettled``.
        t0 = time.perf_counter()
        if self.timer is not None:
            self.timer.sync("all-reduce", self.waiter.interrupt)
        self.before_reduce()
        try:
            norm_sq, extras = self.sync.global_grad_sq(
                self.layers,
                self.device,
                waiter=self.waiter,
                extras=(
                    self._loss,
                    1.0 if self.command_waiting() else 0.0,
                    1.0 if self.checkpoint_due() else 0.0,
                    float(self._digest),
                ),
            )
            loss, waiting, due, digests = extras
            world = torch.distributed.get_world_size(self.sync.step_group)
            if not assignments_agree(digests, world, self._digest):
                raise RanksDisagree(
                    f"step {self._step}: the {world} ranks did not all run the same assignment of the "
                    f"global batch (this rank's digest {self._digest}, sum {digests:.0f}); no update "
                    f"applied. A balancing decision is not deterministic across processes: a bug"
                )
            self.last_reduced = (self._step, norm_sq)
            self._result.loss = loss
            self._result.switch = waiting > 0
            self._result.checkpoint_due = due > 0
            if self.balancer is not None:
                self._measure_pipelines()
        except RuntimeError:
            self.unsettled = self._step  # every rank's gradients were reduced; some may have gone on
            raise
        self._result.comm_s += time.perf_counter() - t0
        self._apply_update(norm_sq)

    def _apply_update(self, norm_sq: float) -> None:
        """The step's update from its all-reduced squared gradient norm (the same on every rank)."""
        scale = self.scaler.scale if self.scaler is not None else 1.0
        if self.scaler is not None:
            self._result.loss_scale = scale
            # Every rank sees the same all-reduced norm, so every rank skips the same step.
            overflow = LossScaler.overflowed(norm_sq)
            self.scaler.update(overflow)
            if overflow:
                for optimizer in self.optimizers.values():
                    optimizer.zero_grad(set_to_none=True)
                self._result.skipped, self._result.grad_norm = True, math.inf
                self._result.lr = lr_at(self.job.training, self._step)
                log.warning(
                    "step %d: float16 gradients overflowed at loss scale %g; step skipped on every rank, scale now %g",
                    self._step,
                    scale,
                    self.scaler.scale,
                )
                return
        self._result.grad_norm, self._result.lr = apply_update(
            self.layers, self.optimizers, norm_sq, self._step, self.job.training, grad_scale=scale
        )
        if self.mixed is not None:
            self.mixed.sync()

    def settle(self, applied_elsewhere: float | None) -> int | None:
        """Settle an ``unsettled`` step at the next generation's start (before any state moves).

        ``applied_elsewhere``: the step's all-reduced squared gradient norm when some rank completed
        the step's last collective (and so applied its update), else None. Applies the same update
        here from the gradients kept since (``discard_iteration`` keeps them), or drops them.
        Returns the step applied here, if any.
        """
        step, self.unsettled = self.unsettled, None
        if step is None:
            return None
        if applied_elsewhere is None:
            for module in self.layers.values():
                module.zero_grad(set_to_none=True)
            return None
        self._step = step
        self._apply_update(applied_elsewhere)
        for module in self.layers.values():
            module.zero_grad(set_to_none=True)
        return step

    def _measure_pipelines(self) -> None:
        """Measured 1F1B seconds of every pipeline (its slowest stage), for the balancer's metrics."""
        times = torch.zeros(len(self.plan.pipelines), dtype=torch.float64)
        self._result.pipeline_s = self.clock.seconds(self._pipeline_interval)  # the step's one sync, a bit early
        times[self.pipeline_index] = self._result.pipeline_s
        times = times.to(self.device)
        self.waiter.wait(
            torch.distributed.all_reduce(
                times, op=torch.distributed.ReduceOp.MAX, group=self.sync.step_group, async_op=True
            ),
            "pipeline time all-reduce",
        )
        self._result.pipeline_times = [float(t) for t in times.cpu()]

    def discard_iteration(self) -> None:
        """Forget a failed iteration: gradients, in-flight activations, packed microbatches. An
        ``unsettled`` step keeps its reduced gradients (on the masters) for ``settle``."""
        self.sync.disarm()
        keep = {id(m) for m in self.layers.values()} if self.unsettled is not None else set()
        for module in (*self.layers.values(), *self.compute.values()):
            if id(module) not in keep:
                module.zero_grad(set_to_none=True)
        for name in (
            "_batches",
            "_inputs",
            "_outputs",
            "_grads",
            "_buffer_mb",
            "_grad_mb",
            "_group_in",
            "_group_out",
            "_held",
            "_backward_groups",
        ):
            if hasattr(self, name):
                getattr(self, name).clear()

    # ------------------------------------------------------------------ state
    def scaler_state(self) -> dict | None:
        return self.scaler.state_dict() if self.scaler is not None else None

    def shared_state(self) -> dict:
        """What every checkpoint shard carries besides its layer (``checkpoint.SHARED_KEYS``)."""
        return {
            "loss_scaler": self.scaler_state(),
            "balancer": self.balancer.state_dict() if self.balancer is not None else None,
        }

    def load_shared_state(self, state: dict) -> None:
        """A checkpoint's ``shared_state``: training goes on with its loss scale and fitted cost model."""
        if self.scaler is not None and state.get("loss_scaler") is not None:
            self.scaler.load_state_dict(state["loss_scaler"])
        if self.balancer is not None and state.get("balancer") is not None:
            self.balancer.load_state_dict(state["balancer"])

    def held(self, over: Gather | None = None) -> dict[int, HeldLayer]:
        """Every layer of the stage with its optimizer. On a stage of several GPUs each is gathered whole (a
        copy, ``sharding.whole_layer``): collective over the stage, its every rank calls it at once (every
        checkpoint path does, before picking the layers it writes; so does a recovery's state copy, ``over``
        a group of the new generation)."""
        if not self.stage.sharded:
            return {i: HeldLayer(m, self.optimizers.get(i)) for i, m in self.layers.items()}
        over = over or Gather.of_stage(self.sync.stage_group, self.stage.ranks)
        out = {}
        for i, module in sorted(self.layers.items()):
            build = lambda i=i: build_layer(self.job, i, self.specs, initialize=False).to(self.device)  # noqa: E731
            out[i] = HeldLayer(*whole_layer(module, self.optimizers.get(i), build, self.job.training, over))
        return out

    def state_bytes(self) -> int:
        """Bytes of this rank's parameters, gradients and optimizer state (its shards on a stage of several
        GPUs): what the cost model calls a stage's resident bytes per GPU (``planning.costs.stage_cost``)."""
        tensors = [local(p) for m in self.layers.values() for p in m.parameters()]
        tensors += [local(p.grad) for m in self.layers.values() for p in m.parameters() if p.grad is not None]
        tensors += [
            local(v)
            for opt in self.optimizers.values()
            for state in opt.state.values()
            for v in state.values()
            if isinstance(v, torch.Tensor) and v.dim() > 0
        ]
        return sum(t.numel() * t.element_size() for t in tensors)

    def layer_state(self, index: int) -> dict[str, torch.Tensor]:
        """Layer ``index``'s whole state; on a stage of several GPUs gathered from its shards (collective over
        the stage: its every rank asks for the same layers in the same order)."""
        over = Gather.of_stage(self.sync.stage_group, self.stage.ranks) if self.stage.sharded else None
        return {
            k: (gathered(v, over) if isinstance(v, DTensor) else v).detach().cpu().clone()
            for k, v in self.layers[index].state_dict().items()
        }
