"""A stage's layers sharded over its GPUs with FSDP2, and whole again (docs/runtime.md, "Stages of several GPUs").

``shard_layer`` turns a whole layer (built fresh, loaded from a checkpoint, or handed
over from another plan) and its optimizer state into FSDP2 shards over the stage's
mesh: rank ``k`` keeps chunk ``k`` of every parameter's rows and of its AdamW
moments (``torch.chunk``'s cut, ``planning.shards.chunk_rows``). ``whole_layer`` is
the inverse: every rank of the stage gathers the layer's parameters and moments
(``DTensor.full_tensor``, a collective over the stage) into a plain layer and
optimizer, what checkpoints write and what a one-GPU stage holds. So a checkpoint
is the same files whatever the layout that wrote it, and resumes on any other.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from oobleck_mm.planning.shards import chunk_rows
from oobleck_mm.runtime.optim import build_layer_optimizer, load_optimizer_state, optimizer_state
from oobleck_mm.runtime.update import local, trainable_params


def shard_layer(module: nn.Module, mesh, training, state: Mapping[str, torch.Tensor] | None = None):
    """Shard ``module`` in place over ``mesh`` (one FSDP2 unit, its reduce-scatter a sum) and return its
    optimizer over the shards (None when frozen), holding this rank's chunk of ``state`` (a whole layer's
    ``optim.optimizer_state``; None: fresh). ``training.zero_stage`` 3 gathers the parameters again for the
    backward; 1 and 2 keep them gathered from the forward (``reshard_after_forward``).

    Mixed precision is FSDP2's own (``MixedPrecisionPolicy``): the shards are the masters (``master_dtype``),
    gathered and cast to ``dtype`` for the forward and backward; each piece's gradients are cast to the
    reduction dtype (``precision.reduce_dtype``), summed over the stage and accumulated into the master
    shards. What ``runtime.mixed.ComputeCopies`` does for a one-GPU stage, without a second copy."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from oobleck_mm.precision import compute_dtype, is_mixed, reduce_dtype

    policy = (
        MixedPrecisionPolicy(
            param_dtype=compute_dtype(training), reduce_dtype=reduce_dtype(training), cast_forward_inputs=False
        )  # the packed batches are in the compute dtype already
        if is_mixed(training)
        else MixedPrecisionPolicy()
    )
    fully_shard(module, mesh=mesh, reshard_after_forward=training.zero_stage == 3, mp_policy=policy)
    module.set_gradient_divide_factor(1.0)  # a sum: the engine's losses are already divided by the global tokens
    # ... as a plain SUM: with factor 1, float32/bfloat16 gradients otherwise reduce with PREMUL_SUM(1.0), which
    # gloo refuses ("Cannot use ReduceOp.PREMUL_SUM with Gloo"; float64 took the plain path, so the float64
    # tests did not see it); a sum times 1 is exact either way.
    module.set_force_sum_reduction_for_comms(True)
    params = trainable_params(module)
    if not params:
        return None
    optimizer = build_layer_optimizer(params, training)
    if state is not None:
        width, k = mesh.size(), mesh.get_local_rank()
        shards = optimizer_state(optimizer)  # zero DTensors shaped (and sharded) as the parameters
        for key, shard in shards.items():
            whole = state[key]
            if shard.dim() == 0:
                shard.copy_(whole)
                continue
            start, end = chunk_rows(whole.shape[0], width)[k]
            local(shard).copy_(whole[start:end])
        load_optimizer_state(optimizer, shards)
    return optimizer


@dataclass(frozen=True, slots=True)
class Gather:
    """The group a stage's shards are gathered over: the stage's own (``Gather.of_stage``), or after a
    recovery a group of its survivors in the new generation (``planning.transfers.gather_groups``)."""

    group: object
    chunks: tuple[int, ...]
    """The chunk each member of ``group`` holds, by its rank in the group."""

    @classmethod
    def of_stage(cls, group, ranks: tuple[int, ...], members: tuple[int, ...] | None = None) -> Gather:
        """``group`` over ``members`` (default ``ranks``), whose member ``ranks[k]`` holds chunk ``k``
        (torch orders a group's members by rank)."""
        members = ranks if members is None else members
        return cls(group, tuple(ranks.index(r) for r in sorted(members)))


def whole_layer(module: nn.Module, optimizer, build: Callable[[], nn.Module], training, over: Gather):
    """The layer ``module`` (sharded by ``shard_layer``) whole on every rank of ``over``, with its optimizer
    and whole moments: ``(plain module, optimizer or None)``. Collective over ``over.group``: its every member
    calls it for the same layers in the same order. ``build()`` makes the plain layer to load into."""
    whole = lambda v: gathered(v, over)  # noqa: E731
    plain = build()
    plain.load_state_dict({k: whole(v) for k, v in module.state_dict().items()})
    if optimizer is None:
        return plain, None
    moments = {k: whole(v) for k, v in optimizer_state(optimizer).items()}
    params = trainable_params(plain)
    whole_optimizer = build_layer_optimizer(params, training)
    load_optimizer_state(whole_optimizer, moments)
    return plain, whole_optimizer


def gathered(value: torch.Tensor, over: Gather) -> torch.Tensor:
    """``value`` whole from its shards, gathered over ``over.group`` (rows cut as ``chunk_rows`` cuts them).

    Written by hand instead of ``DTensor.full_tensor``: that resolves the mesh's group by its name, and
    torch names groups from a counter every generation restarts (``runtime/group.py``), so once an older
    generation's group of the same name was destroyed the name no longer resolved (a 2-GPU stage's final
    save failed so, 10 steps after a join) or could resolve to another group. Here the group is an object."""
    if not isinstance(value, DTensor):
        return value
    mine, shape = value.to_local(), value.shape
    cuts = chunk_rows(shape[0], len(over.chunks))
    size = max(end - start for start, end in cuts)
    padded = mine.new_zeros((size, *shape[1:]))
    padded[: mine.shape[0]] = mine
    parts = [torch.empty_like(padded) for _ in over.chunks]
    dist.all_gather(parts, padded, group=over.group)
    out = mine.new_empty(shape)
    for part, chunk in zip(parts, over.chunks):
        start, end = cuts[chunk]
        out[start:end] = part[: end - start]
    return out
