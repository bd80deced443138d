"""Copying whole layer states between workers after a reconfiguration (dissertation §2.5).

A layer moves as one unit: its parameters and its optimizer state (both Adam
moments and the step). Seed Oobleck copied parameters only, so a moved layer
restarted Adam from zero and diverged from a run without failures; here the
receiver ends bit-identical to the sender.

All transfers of a reconfiguration are posted at once as non-blocking
sends/receives in the new generation's process group, so different senders
copy in parallel (the master spreads the senders over surviving replicas).
Each message gets its own tag, so several layers between the same two ranks
cannot be confused.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from oobleck_mm.runtime.engine import HeldLayer
from oobleck_mm.runtime.optim import load_optimizer_state, optimizer_state
from oobleck_mm.runtime.waiting import Waiter


@dataclass(frozen=True, slots=True, order=True)
class Transfer:
    layer: int
    dst: int
    """Rank (in the new generation) that needs the layer."""
    src: int
    """Rank (in the new generation) that holds it."""


def _tensors(held: HeldLayer) -> list[torch.Tensor]:
    """What travels, in a fixed order both sides derive from the layer's shapes alone."""
    out = [t.detach() for t in held.module.state_dict().values()]
    if held.optimizer is not None:
        out += list(optimizer_state(held.optimizer).values())
    return out


def transfer_layers(
    transfers: Sequence[Transfer],
    rank: int,
    held: Mapping[int, HeldLayer],
    build: Callable[[int], HeldLayer],
    device: torch.device | str = "cpu",
    waiter: Waiter = Waiter(),
) -> tuple[dict[int, HeldLayer], int, float]:
    """Run this rank's part of ``transfers``; returns the layers received, the bytes moved here and
    the seconds the transfers took once every rank was ready (building the receiving layers, the
    slowest part for a joiner, comes before: a barrier separates the two).

    ``held``: the layers this rank holds now (sources read from it). ``build(layer)``
    makes a fresh layer to receive into. Every rank of the group calls this with
    the same ``transfers``.
    """
    transfers = sorted(transfers)
    ops: list[dist.P2POp] = []
    received: dict[int, tuple[HeldLayer, list[torch.Tensor], list[torch.Tensor]]] = {}
    moved = 0
    for index, t in enumerate(transfers):
        if t.src == t.dst:
            raise ValueError(f"transfer of layer {t.layer} from rank {t.src} to itself")
        if t.src == rank:
            if t.layer not in held:
                raise ValueError(f"rank {rank} is asked to send layer {t.layer} it does not hold ({sorted(held)})")
            for k, tensor in enumerate(_tensors(held[t.layer])):
                tensor = tensor.to(device).contiguous()
                ops.append(dist.P2POp(dist.isend, tensor, t.dst, tag=_tag(index, k)))
                moved += tensor.numel() * tensor.element_size()
        if t.dst == rank:
            if t.layer in received:
                raise ValueError(f"rank {rank} would receive layer {t.layer} twice")
            fresh = build(t.layer)
            targets = _tensors(fresh)
            buffers = [torch.empty_like(x, device=device) for x in targets]
            for k, buf in enumerate(buffers):
                ops.append(dist.P2POp(dist.irecv, buf, t.src, tag=_tag(index, k)))
                moved += buf.numel() * buf.element_size()
            received[t.layer] = (fresh, targets, buffers)
    seconds = 0.0
    if transfers:  # the same list on every rank: all of them reach this barrier or none
        waiter.wait(dist.barrier(async_op=True), "ready for the layer state transfer")
        t0 = time.perf_counter()
        if ops:
            for request in dist.batch_isend_irecv(ops):
                waiter.wait(request, f"layer state transfer on rank {rank}", pollable=False)
        seconds = time.perf_counter() - t0
    out = {}
    for layer, (fresh, _, buffers) in received.items():
        names = list(fresh.module.state_dict())
        params = dict(zip(names, buffers[: len(names)]))
        fresh.module.load_state_dict(params)
        if fresh.optimizer is not None:
            keys = list(optimizer_state(fresh.optimizer))
            load_optimizer_state(fresh.optimizer, dict(zip(keys, buffers[len(names) :])))
        out[layer] = fresh
    return out, moved, seconds


def _tag(transfer_index: int, tensor_index: int) -> int:
    return transfer_index * 1024 + tensor_index


def plan_transfers(old_holders: Mapping[int, Sequence[int]], new_plan) -> list[Transfer]:
    """Transfers so every rank of ``new_plan`` holds its layers, spreading the senders.

    ``old_holders[layer]``: new-generation ranks that still hold the layer. Each
    missing (layer, rank) pair is served by the holder that has sent the least so
    far (ties: lowest rank), so copies run in parallel from many survivors.
    """
    load: dict[int, int] = {}
    out = []
    for layer in range(new_plan.num_layers):
        sources = sorted(old_holders.get(layer, ()))
        for dst in new_plan.holders(layer):
            if dst in sources:
                continue
            if not sources:
                raise ValueError(f"layer {layer} has no surviving holder to copy from")
            src = min(sources, key=lambda r: (load.get(r, 0), r))
            load[src] = load.get(src, 0) + 1
            out.append(Transfer(layer, dst, src))
    return out


def surviving_holders(old_plan, survivors: Mapping[int, int]) -> dict[int, list[int]]:
    """layer -> new ranks that held it in ``old_plan``; ``survivors`` maps old rank -> new rank."""
    return {
        layer: [survivors[r] for r in old_plan.holders(layer) if r in survivors]
        for layer in range(old_plan.num_layers)
    }


def adopt_plan(job, engine, old_plan, new_plan, survivors: Mapping[int, int], new_rank: int,
               device: torch.device | str = "cpu", waiter: Waiter = Waiter()):
    """Move a surviving worker from ``engine`` (old plan) to ``new_plan``, keeping every layer it still needs.

    Call after joining the new generation's process group, on every rank of it (a
    joining worker passes ``engine=None``). Returns (new engine, transfers, bytes moved here,
    transfer seconds).
    """
    from oobleck_mm.runtime.engine import StageEngine, fresh_layer

    transfers = plan_transfers(surviving_holders(old_plan, survivors), new_plan)
    held = engine.held() if engine is not None else {}
    specs = engine.specs if engine is not None else None
    received, moved, seconds = transfer_layers(transfers, new_rank, held,
                                               lambda i: fresh_layer(job, i, specs, device), device, waiter)
    keep = {i: h for i, h in held.items() if i in new_plan.stage(new_rank).layers}
    keep.update(received)
    data = engine.data if engine is not None else None
    balancer = engine.balancer if engine is not None else None  # the cost model carries over
    engine = StageEngine(job, new_plan, new_rank, data=data, device=device, held=keep, waiter=waiter,
                         balancer=balancer)
    if engine.balancer is not None and survivors:
        # Joiners start with the initial cost model: every rank must use the survivors' one.
        engine.balancer.share_from(min(survivors.values()))
    return engine, transfers, moved, seconds
