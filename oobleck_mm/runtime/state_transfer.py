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
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from oobleck_mm.planning.shards import chunk_rows
from oobleck_mm.planning.transfers import Transfer, gather_groups, rank_transfers
from oobleck_mm.data.loader import TrainingData
from oobleck_mm.runtime.balancing import step_balancer
from oobleck_mm.runtime.emulated import copy_wait
from oobleck_mm.model.layers import model_layer_specs
from oobleck_mm.runtime.engine import HeldLayer, StageEngine, fresh_layer
from oobleck_mm.runtime.optim import load_optimizer_state, optimizer_state
from oobleck_mm.runtime.sharding import Gather
from oobleck_mm.runtime.waiting import Waiter


def _tensors(held: HeldLayer) -> list[torch.Tensor]:
    """What travels, in a fixed order both sides derive from the layer's shapes alone."""
    out = [t.detach() for t in held.module.state_dict().values()]
    if held.optimizer is not None:
        out += list(optimizer_state(held.optimizer).values())
    return out


def _sharded(held: HeldLayer) -> list[bool]:
    """Per tensor of ``_tensors``: whether a stage of several GPUs holds it by rows (a parameter or an
    AdamW moment of one, at least 1-D), so a copy to one of its GPUs carries only that GPU's rows; buffers
    and optimizer steps travel whole."""
    params = {name for name, _ in held.module.named_parameters()}
    out = [name in params and t.dim() >= 1 for name, t in held.module.state_dict().items()]
    if held.optimizer is not None:
        out += [t.dim() >= 1 for t in optimizer_state(held.optimizer).values()]
    return out


def _rows(
    tensors: Sequence[torch.Tensor], sharded: Sequence[bool], shard: tuple[int, int] | None
) -> list[torch.Tensor]:
    """``tensors`` as a copy to a GPU holding chunk ``shard = (k, width)`` carries them: its rows of each
    sharded one (views), the others whole; all of them when ``shard`` is None."""
    if shard is None:
        return list(tensors)
    k, width = shard
    out = []
    for t, cut in zip(tensors, sharded, strict=True):
        if cut:
            start, end = chunk_rows(t.shape[0], width)[k]
            t = t[start:end]
        out.append(t)
    return out


def transfer_layers(
    transfers: Sequence[Transfer],
    rank: int,
    held: Mapping[int, HeldLayer],
    build: Callable[[int], Receiver],
    device: torch.device | str = "cpu",
    waiter: Waiter = Waiter(),
    shard_of: Callable[[int], tuple[int, int] | None] = lambda rank: None,
) -> tuple[dict[int, HeldLayer], int, float]:
    """Run this rank's part of ``transfers``; returns the layers received, the bytes moved here and
    the seconds the transfers took once every rank was ready (building the receiving layers, the
    slowest part for a joiner, comes before: a barrier separates the two).

    ``held``: the layers this rank holds now (sources read from it). ``build(layer)``
    gives the ``Receiver`` of a layer this rank receives (``prepare_arrival`` builds them
    ahead). Every rank of the group calls this with the same ``transfers``. ``shard_of(dst)``: (chunk,
    width) when ``dst`` is a GPU of a stage of several GPUs, which is sent only its rows of the layer
    (copies in shard units: 1/width of the bytes), else None.
    """
    transfers = sorted(transfers)
    ops: list[dist.P2POp] = []
    received: dict[int, Receiver] = {}
    moved = 0
    for index, t in enumerate(transfers):
        if t.src == t.dst:
            raise ValueError(f"transfer of layer {t.layer} from rank {t.src} to itself")
        if t.src == rank:
            if t.layer not in held:
                raise ValueError(f"rank {rank} is asked to send layer {t.layer} it does not hold ({sorted(held)})")
            source = held[t.layer]
            packed = pack(_rows(_tensors(source), _sharded(source), shard_of(t.dst)), device)
            ops.append(dist.P2POp(dist.isend, packed, t.dst, tag=index))  # one message per transfer
            moved += packed.numel()
        if t.dst == rank:
            if t.layer in received:
                raise ValueError(f"rank {rank} would receive layer {t.layer} twice")
            receiver = build(t.layer)
            ops.append(dist.P2POp(dist.irecv, receiver.buffer, t.src, tag=index))
            moved += receiver.buffer.numel()
            received[t.layer] = receiver
    seconds = 0.0
    if transfers:  # the same list on every rank: all of them reach this barrier or none
        waiter.wait(dist.barrier(async_op=True), "ready for the layer state transfer")
        t0 = time.perf_counter()
        if ops:
            for request in dist.batch_isend_irecv(ops):
                waiter.wait(request, f"layer state transfer on rank {rank}", pollable=False)
        seconds = time.perf_counter() - t0
    out = {layer: receiver.load() for layer, receiver in received.items()}
    return out, moved, seconds


def share_loss_scaler(scaler, src: int, device) -> None:
    """Collective: every rank takes rank ``src``'s loss-scaler state (a joiner starts from the config's)."""
    keys = sorted(k for k, v in scaler.state_dict().items() if not isinstance(v, bool))
    state = scaler.state_dict()
    values = torch.tensor([float(state[k]) for k in keys], dtype=torch.float64, device=device)
    dist.broadcast(values, src=src)
    scaler.load_state_dict({k: type(state[k])(v) for k, v in zip(keys, values.tolist())})


ALIGN_BYTES = 16
"""Each tensor starts this aligned in a packed layer, so it can be viewed back in any dtype."""


def _nbytes(tensor: torch.Tensor) -> int:
    """The tensor's bytes in a packed layer, padding included."""
    return -(-tensor.numel() * tensor.element_size() // ALIGN_BYTES) * ALIGN_BYTES


def pack(tensors: Sequence[torch.Tensor], device: torch.device | str) -> torch.Tensor:
    """The tensors' bytes, one after the other (each ``ALIGN_BYTES``-aligned), as one uint8 tensor on ``device``.

    A layer travels as one message: its parameters and Adam state are dozens of small tensors,
    and a message each made a joiner's receive of 10 small layers take ~40 ms (gloo handles one
    pair's messages one by one).
    """
    out = torch.zeros(sum(_nbytes(t) for t in tensors), dtype=torch.uint8, device=device)
    offset = 0
    for t in tensors:
        raw = t.detach().reshape(-1).view(torch.uint8)
        out[offset : offset + raw.numel()].copy_(raw)
        offset += _nbytes(t)
    return out


def unpack(buffer: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of ``buffer`` (from ``pack``) with the dtypes and shapes of ``like``, in order."""
    expected = sum(_nbytes(t) for t in like)
    if expected != buffer.numel():
        raise ValueError(f"a layer's state of {buffer.numel()} bytes does not match its shapes ({expected} bytes)")
    out, offset = [], 0
    for t in like:
        raw = buffer[offset : offset + t.numel() * t.element_size()]
        out.append(raw.view(t.dtype).view(t.shape))
        offset += _nbytes(t)
    return out


@dataclass(slots=True)
class Receiver:
    """A fresh layer, what its state is (``_tensors``), and the buffer its packed state arrives in."""

    layer: HeldLayer
    targets: list[torch.Tensor]
    buffer: torch.Tensor
    whole: list[torch.Tensor] = field(default_factory=list)
    """The layer's tensors whole (``_tensors``); ``targets`` are their rows this rank receives."""

    @classmethod
    def for_layer(cls, fresh: HeldLayer, device: torch.device | str, shard: tuple[int, int] | None = None) -> Receiver:
        """``shard``: (chunk, width) of this rank's stage of several GPUs: only its rows arrive, into the whole
        tensors' rows, and ``StageEngine`` keeps exactly those rows when it shards the layer (the other rows
        are never read)."""
        whole = _tensors(fresh)
        targets = _rows(whole, _sharded(fresh), shard)
        return cls(
            fresh, targets, torch.empty(sum(_nbytes(x) for x in targets), dtype=torch.uint8, device=device), whole
        )

    def load(self) -> HeldLayer:
        """The layer, holding the state that arrived."""
        for target, value in zip(self.targets, unpack(self.buffer, self.targets), strict=True):
            target.copy_(value)  # rows (views) of the whole tensors
        module, optimizer = self.layer.module, self.layer.optimizer
        names = list(module.state_dict())
        module.load_state_dict(dict(zip(names, self.whole[: len(names)])))
        if optimizer is not None:
            keys = list(optimizer_state(optimizer))
            load_optimizer_state(optimizer, dict(zip(keys, self.whole[len(names) :])))
        return self.layer


@dataclass(slots=True)
class Arrival:
    """What a worker builds for a new plan before its rendezvous (``prepare_arrival``): the layers it
    will receive into and, for a joiner, its data and balancer. Built while the survivors still
    train (a join) or wait for the slowest arrival (a failure), not while every rank waits on it."""

    transfers: list[Transfer]
    """Every rank's copies for the plan (``planning.transfers.rank_transfers``)."""
    receive: dict[int, Receiver] = field(default_factory=dict)
    """This rank's, by layer."""
    data: TrainingData | None = None
    balancer: object = None


def prepare_arrival(
    job,
    engine,
    old_plan,
    new_plan,
    previous_ranks: Sequence[int],
    new_rank: int,
    rank_nodes: Sequence[str] = (),
    device: torch.device | str = "cpu",
    emulation=None,
) -> Arrival:
    """Build what ``adopt_plan`` will need on this rank that no peer is involved in (no collective)."""
    transfers = rank_transfers(old_plan, new_plan, previous_ranks, rank_nodes)
    specs = engine.specs if engine is not None else model_layer_specs(job)
    # What arrives is the whole state (every value of the layer and its optimizer): no random init.
    shard = shard_of(new_plan)(new_rank)
    receive = {
        t.layer: Receiver.for_layer(fresh_layer(job, t.layer, specs, device, initialize=False), device, shard)
        for t in transfers
        if t.dst == new_rank
    }
    if engine is not None:
        return Arrival(transfers, receive)
    data = TrainingData(job)
    balancer = step_balancer(job, data, specs, torch.device(device), emulation) if job.balance.enabled else None
    return Arrival(transfers, receive, data, balancer)


def shard_of(plan) -> Callable[[int], tuple[int, int] | None]:
    """For ``transfer_layers``: a rank's (chunk, width) in ``plan`` when its stage spans several GPUs, else None."""

    def of(rank: int) -> tuple[int, int] | None:
        stage = plan.stage(rank)
        return (stage.ranks.index(rank), stage.width) if stage.sharded else None

    return of


def _held_whole(engine, old_plan, previous_ranks: Sequence[int], new_rank: int, waiter: Waiter) -> dict[int, HeldLayer]:
    """What this survivor holds of ``old_plan`` as whole layers. A stage of several GPUs gathers its shards in
    the new generation, over a group of its surviving ranks (``gather_groups``: every rank of the generation
    forms every one, in order); one that lost a rank holds nothing whole."""
    groups = gather_groups(old_plan, previous_ranks)
    formed = [dist.new_group(list(ranks), timeout=waiter.timeout) for ranks in groups]
    if not engine.stage.sharded:
        return engine.held()
    mine = [(ranks, group) for ranks, group in zip(groups, formed) if new_rank in ranks]
    if not mine:
        return {}
    ranks, group = mine[0]  # new ranks in the old stage's shard order
    return engine.held(Gather.of_stage(group, ranks))


def adopt_plan(
    job,
    engine,
    old_plan,
    new_plan,
    previous_ranks: Sequence[int],
    new_rank: int,
    rank_nodes: Sequence[str] = (),
    device: torch.device | str = "cpu",
    waiter: Waiter = Waiter(),
    arrival: Arrival | None = None,
    emulation=None,
):
    """Move a surviving worker from ``engine`` (old plan) to ``new_plan``, keeping every layer it still needs.

    Call after joining the new generation's process group, on every rank of it (a
    joining worker passes ``engine=None``). ``previous_ranks[r]``: new rank r's rank in
    ``old_plan`` (-1: no state); ``rank_nodes[r]``: its node, for the same-node preference
    of ``planning.transfers``. ``arrival``: what ``prepare_arrival`` built before the rendezvous
    (else it is built here). ``emulation``: the worker's emulated accelerator (``runtime.emulated``), which
    makes the layers this rank receives take their real bytes' time on its link. Returns (new engine,
    transfers, bytes moved here, transfer seconds).
    """
    if arrival is None:
        arrival = prepare_arrival(
            job, engine, old_plan, new_plan, previous_ranks, new_rank, rank_nodes, device, emulation
        )
    transfers = arrival.transfers
    held = _held_whole(engine, old_plan, previous_ranks, new_rank, waiter) if engine is not None else {}
    received, moved, seconds = transfer_layers(
        transfers, new_rank, held, arrival.receive.pop, device, waiter, shard_of(new_plan)
    )
    if emulation is not None and received:  # the copy began once every rank was ready (transfer_layers' barrier)
        began = time.monotonic() - seconds
        copy_wait(emulation, sorted(received), began, waiter.interrupt)
        seconds = time.monotonic() - began
    keep = {i: h for i, h in held.items() if i in new_plan.stage(new_rank).layers}
    keep.update(received)
    data = engine.data if engine is not None else arrival.data
    balancer = engine.balancer if engine is not None else arrival.balancer  # the cost model carries over
    scaler = engine.scaler if engine is not None else None  # so does float16's loss scale
    engine = StageEngine(
        job,
        new_plan,
        new_rank,
        data=data,
        device=device,
        held=keep,
        waiter=waiter,
        balancer=balancer,
        scaler=scaler,
        emulation=emulation,
    )
    survivors = [rank for rank, previous in enumerate(previous_ranks) if previous >= 0]
    if engine.balancer is not None and survivors:
        # Joiners start with the initial cost model: every rank must use the survivors' one.
        engine.balancer.share_from(min(survivors))
    if engine.scaler is not None and survivors:
        share_loss_scaler(engine.scaler, min(survivors), device)
    if transfers:  # the same list on every rank
        # The first step starts when the receivers have loaded what they received: a sender that
        # started computing at once would only wait for them in the step's first collective, and
        # where ranks share CPU cores it slows their loading down (5 ranks on 2 cores: a joiner's
        # 3 MB took ~40 ms to arrive and load instead of ~10).
        waiter.wait(dist.barrier(async_op=True), "every rank holds its layers for the new plan")
    return engine, transfers, moved, seconds
