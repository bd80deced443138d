"""Copying whole layer states between workers after a reconfiguration (dissertation §2.5).

A layer moves as one unit: its parameters and its optimizer state (both Adam
moments and the step). Seed Oobleck copied parameters only, so a moved layer
restarted Adam from zero and diverged from a run without failures; here the
receiver ends bit-identical to the sender.

Which holder sends which layer is decided by ``planning.transfers`` (the same
rule the master logs and the planner reports: a sender on the receiver's node
first, then the least-asked one), from the assignment alone, so every rank
derives the same list. All transfers are posted at once as non-blocking
sends/receives in the new generation's process group, so different senders
copy in parallel. Each message gets its own tag, so several layers between the
same two ranks cannot be confused.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from oobleck_mm.planning.transfers import Transfer, rank_transfers
from oobleck_mm.runtime.engine import HeldLayer, StageEngine, fresh_layer
from oobleck_mm.runtime.optim import load_optimizer_state, optimizer_state
from oobleck_mm.runtime.waiting import Waiter


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


def share_loss_scaler(scaler, src: int, device) -> None:
    """Collective: every rank takes rank ``src``'s loss-scaler state (a joiner starts from the config's)."""
    keys = sorted(k for k, v in scaler.state_dict().items() if not isinstance(v, bool))
    state = scaler.state_dict()
    values = torch.tensor([float(state[k]) for k in keys], dtype=torch.float64, device=device)
    dist.broadcast(values, src=src)
    scaler.load_state_dict({k: type(state[k])(v) for k, v in zip(keys, values.tolist())})


def _tag(transfer_index: int, tensor_index: int) -> int:
    return transfer_index * 1024 + tensor_index


def adopt_plan(job, engine, old_plan, new_plan, previous_ranks: Sequence[int], new_rank: int,
               rank_nodes: Sequence[str] = (), device: torch.device | str = "cpu", waiter: Waiter = Waiter()):
    """Move a surviving worker from ``engine`` (old plan) to ``new_plan``, keeping every layer it still needs.

    Call after joining the new generation's process group, on every rank of it (a
    joining worker passes ``engine=None``). ``previous_ranks[r]``: new rank r's rank in
    ``old_plan`` (-1: no state); ``rank_nodes[r]``: its node, for the same-node preference
    of ``planning.transfers``. Returns (new engine, transfers, bytes moved here, transfer seconds).
    """
    transfers = rank_transfers(old_plan, new_plan, previous_ranks, rank_nodes)
    held = engine.held() if engine is not None else {}
    specs = engine.specs if engine is not None else None
    received, moved, seconds = transfer_layers(transfers, new_rank, held,
                                               lambda i: fresh_layer(job, i, specs, device), device, waiter)
    keep = {i: h for i, h in held.items() if i in new_plan.stage(new_rank).layers}
    keep.update(received)
    data = engine.data if engine is not None else None
    balancer = engine.balancer if engine is not None else None  # the cost model carries over
    scaler = engine.scaler if engine is not None else None  # so does float16's loss scale
    engine = StageEngine(job, new_plan, new_rank, data=data, device=device, held=keep, waiter=waiter,
                         balancer=balancer, scaler=scaler)
    survivors = [rank for rank, previous in enumerate(previous_ranks) if previous >= 0]
    if engine.balancer is not None and survivors:
        # Joiners start with the initial cost model: every rank must use the survivors' one.
        engine.balancer.share_from(min(survivors))
    if engine.scaler is not None and survivors:
        share_loss_scaler(engine.scaler, min(survivors), device)
    return engine, transfers, moved, seconds
