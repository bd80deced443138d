"""The engine's plain parts: a step's result, a held layer, the engine's process subgroups, the dispatch loop."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from oobleck_mm.model.layers import (
    build_layer,
    model_layer_specs,
    parameter_rows,
    tied_pair,
    tied_rows,
    trainable_mask,
)
from oobleck_mm.planning.layout import ExecutionPlan
from oobleck_mm.planning.transfers import gather_groups
from oobleck_mm.runtime.grad_sync import sharded_layers, subgroup_ranks
from oobleck_mm.runtime.optim import build_layer_optimizer
from oobleck_mm.runtime.update import trainable_params

if TYPE_CHECKING:  # the engine imports DeepSpeed's schedules (after setting its accelerator)
    from deepspeed.runtime.pipe import schedule as ds


class RanksDisagree(Exception):
    """Ranks ran different assignments of one step: a decision that is not a function of the shared inputs
    (a bug; reported as one, never retried as a peer failure)."""


def assignments_agree(digest_sum: float, world: int, mine: int) -> bool:
    """Whether every rank's assignment digest equals this rank's, from their sum (exact in float64: 31-bit
    digests summed over fewer than 2**22 ranks). Any disagreement shows on every rank."""
    return digest_sum == float(world) * float(mine)


@dataclass(slots=True)
class StepResult:
    step: int
    loss: float
    """Mean token loss of the whole global batch (all-reduced)."""
    grad_norm: float
    lr: float
    step_time_s: float
    forward_s: float = 0.0
    backward_s: float = 0.0
    expected_compute_s: float = 0.0
    """The cost model's forward and backward seconds of this rank over the step's samples
    (``balancing.ComputeExpectation``)."""
    comm_s: float = 0.0
    """Seconds in stage-to-stage transfers and the gradient all-reduce."""
    bytes_sent: int = 0
    grad_bytes: int = 0
    """Bytes this rank all-reduced of its layers' gradients (the bucket sums, those over pieces, the tied one)."""
    grad_bytes_overlapped: int = 0
    """Of the buckets' bytes, those whose all-reduce started during the backward (``training.grad_overlap``)."""
    grad_bytes_copied: int = 0
    """Of the buckets' bytes, those copied into a buffer to be summed and back, not summed where the backward made
    them (``GradientSync.attach``: a sum in another dtype than the gradients')."""
    microbatch_times: list[tuple[float, float]] = field(default_factory=list)
    """(forward s, backward s) of each microbatch on this stage, in order."""
    pack_s: float = 0.0
    """Seconds packing (rendering, decoding) microbatches on this stage."""
    pipeline_s: float = 0.0
    """Seconds from the step's start to this stage's gradient all-reduce (its 1F1B part)."""
    pipeline_times: list[float] = field(default_factory=list)
    """Measured 1F1B seconds of every pipeline (with the balancer on)."""
    recomputed: int = 0
    """Layer forwards this rank ran under activation checkpointing this step, each run again in its backward
    (the plan's per-stage choice, ``StageLayout.recompute``)."""
    skipped: bool = False
    """float16: the gradients overflowed on some rank, so no rank updated anything this step."""
    loss_scale: float = 0.0
    """float16: the loss scale of the step (0 otherwise)."""
    tokens: int = 0
    """LLM tokens of the whole global batch (text and media tokens), for tokens/s."""
    switch: bool = False
    """Some rank held a command when the step's last collective ran: every rank applies it after
    this step (one boundary for all, whoever received the command first)."""
    checkpoint_due: bool = False
    """Some rank's clock said a periodic checkpoint is due (``fault_tolerance.checkpoint_every``):
    every rank checkpoints after this step, the same step everywhere."""
    deferred: int = 0
    """Samples of the whole step whose LLM work ran one microbatch after their encoders' (Entrain's deferral)."""
    pieces: tuple[tuple[int, ...], ...] = ()
    """The sample groups every forward of the step ran, pipeline by pipeline: ``microbatches``, except that a
    pipeline with a stage of several GPUs ran each microbatch as pieces (``PipelineLayout.pieces``; a piece
    without samples left out). What a reference replays where compute rounds per group (float32)."""
    state_bytes: int = 0
    """This rank's parameters, gradients and optimizer state once its gradients were summed (``state_bytes``)."""
    microbatches: tuple[tuple[int, ...], ...] = ()
    """Sample ids of every microbatch of every pipeline this step (the reference trainer can replay
    them: float32 compute rounds differently for another microbatch composition)."""
    lateness: object = None
    """An emulated run (``cluster.emulate``): this rank's ``emulation.clock.Lateness`` of the step."""
    host_cpu_s: float = 0.0
    """CPU seconds this worker's process spent in the step, every thread (``time.process_time``): what the
    step cost its host, beside what it cost the device (an emulated run's verdict adds them up)."""


@dataclass(slots=True)
class HeldLayer:
    """A layer a worker holds: its module and its optimizer (None when frozen). Moves as one unit."""

    module: torch.nn.Module
    optimizer: torch.optim.Optimizer | None


def fresh_layer(job, index: int, specs=None, device: torch.device | str = "cpu", initialize: bool = True) -> HeldLayer:
    """Layer ``index`` and its optimizer on ``device``; ``initialize=False`` when the caller writes
    every value next (``build_layer``)."""
    module = build_layer(job, index, specs, initialize).to(device)
    params = trainable_params(module)
    return HeldLayer(module, build_layer_optimizer(params, job.training) if params else None)


def engine_subgroups(
    job, plan: ExecutionPlan, specs=None, old_plan: ExecutionPlan | None = None, previous_ranks=()
) -> list[tuple[int, ...]]:
    """The ranks of every process group a generation forms on ``plan``, in order: what a ``runtime.group.
    PreparedGroup`` forms ahead of a switch. First the state copy's (``old_plan``: the generation before, with
    ``previous_ranks``; ``planning.transfers.gather_groups``), then a ``StageEngine``'s (``grad_sync.
    subgroup_ranks``)."""
    specs = specs if specs is not None else model_layer_specs(job)
    trainable = trainable_mask(job, specs)
    rows = parameter_rows(job, sharded_layers(plan, trainable), specs) if plan.sharded else None
    vocab = tied_rows(job, specs) if plan.sharded else None
    return gather_groups(old_plan, previous_ranks) + subgroup_ranks(plan, trainable, tied_pair(specs), rows, vocab)


def execute(steps: Iterable[Iterable[ds.PipeInstruction]], table: Mapping[type, Callable]) -> int:
    """Run an instruction stream through a dispatch table; an instruction without a handler raises."""
    count = 0
    for instructions in steps:
        for instruction in instructions:
            handler = table.get(type(instruction))
            if handler is None:
                raise RuntimeError(
                    f"no handler for pipeline instruction {instruction!r}; handled: {sorted(t.__name__ for t in table)}"
                )
            handler(instruction)
            count += 1
    return count
