"""Layer-wise gradient synchronisation across heterogeneous pipelines (dissertation §2.6.1).

Pipelines built from different templates cut the model differently, so a
layer's replicas sit on ranks that hold different neighbours. Gradients are
therefore all-reduced per layer, across exactly the ranks holding it, with
layers sharing the same holder set forming one bucket. Every rank creates every
group in the same order (torch.distributed requires it) and starts its buckets'
all-reduces in one global order (last layer first; below), so the collectives
cannot deadlock. The sum is the update: each microbatch's loss is already divided by
the global number of loss tokens.

Gradient-norm clipping counts each layer once: the first holder of a layer
(its owner) contributes that layer's squared norm.

Tied embeddings (the LM head's matrix is the token embedding's) follow
Megatron's pipeline-split tying: the head holds a copy, and after the per-layer
sums the embedding's owner and the head's owner contribute their sums to one
all-reduce over every holder of either, whose result is both copies' gradient.
Copies that start equal and take the same gradient and optimizer steps stay equal.

A layer held by a stage of several GPUs somewhere (sharded by FSDP2, each rank
holding a chunk of every parameter's rows) cannot be summed as whole tensors:
its holders hold different rows. Its gradients are summed over the common
refinement of the holders' cuts (``planning.shards.reduction_pieces``), each
piece among the one rank per pipeline holding its rows, pieces of equal rank
sets flattened into one all-reduce. FSDP2's own reduce-scatter has already summed
each rank's rows over its stage. The norm counts each row once: every rank of the
owner's stage adds its own rows.

The buckets' all-reduces overlap the step's last backward (``training.grad_overlap``, DDP's reducer idea):
each bucket is cut into chunks of whole layers of about ``training.grad_bucket_mb``
(``chunks``), and during the backward of the step's last microbatch a post-accumulate-grad hook
on every parameter starts a chunk's all-reduce (asynchronous: gloo's worker thread, NCCL's
stream) once all its parameters have their final gradient, while the layers below still
compute. Every rank starts its chunks in one order, the last layer first, whatever order the
hooks fire in (a chunk whose hook fired early waits for the chunks before it): every rank's
order is part of one global order, so no two ranks can wait on each other's groups in a cycle,
and the members of a group issue its chunks alike. A chunk some parameter of which got no
gradient in that backward (a frozen path, a text-only microbatch) starts when the backward is
over, with the rest. The sums are the same values as one all-reduce per bucket: each element
is summed over the same ranks. The tied embedding's sum and the sums over pieces still run
after the buckets' (they read the per-layer sums).

A chunk's gradients are views of one flat buffer it keeps (DDP's ``gradient_as_bucket_view``): ``attach``
points each parameter's ``.grad`` into it at the step's start, the backward accumulates into it in place
(autograd adds into a gradient that exists), and the all-reduce sums the buffer itself. Without the views every
chunk was copied into a fresh buffer before its sum and back after: per 100 MB of gradients on one CPU thread,
29 ms into the fresh buffer (18 of them its page faults) and 10 back, against the views' 7 ms to zero the buffer
(and an add instead of a steal for the first microbatch's gradient). On the benchmark's all-reduce-heavy model
the sums after the backward went 0.56-0.64 -> 0.28-0.32 s a step (``scripts/bench_runtime.py --cases d``).
A chunk whose sum runs in another dtype (``reduce_dtype``) still goes by a copy. The optimizer's
``zero_grad(set_to_none=True)`` drops the views after the update; the next ``attach`` restores them, zeroed.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from oobleck_mm.planning.layout import ExecutionPlan
from oobleck_mm.planning.shards import Piece, chunk_rows, reduction_pieces
from oobleck_mm.runtime.waiting import Waiter
from oobleck_mm.runtime.update import fill_missing_grads, grad_sq, local, trainable_params


@dataclass(frozen=True, slots=True)
class Bucket:
    holders: tuple[int, ...]
    layers: tuple[int, ...]


def sharded_layers(plan: ExecutionPlan, trainable: tuple[bool, ...]) -> tuple[int, ...]:
    """Trainable layers some stage of several GPUs holds: summed over pieces of rows, not in buckets."""
    return tuple(
        layer
        for layer in range(plan.num_layers)
        if trainable[layer] and any(len(h) > 1 for h in plan.shard_holders(layer))
    )


@dataclass(frozen=True, slots=True)
class PieceSum:
    """Rows of some parameters of sharded layers, all summed among ``ranks`` in one all-reduce: each entry
    ``(layer, parameter index, start, end)`` in the parameter's global rows."""

    ranks: tuple[int, ...]
    rows: tuple[tuple[int, int, int, int], ...]


def piece_sums(plan: ExecutionPlan, trainable: tuple[bool, ...], rows: Mapping[int, Sequence[int]]) -> list[PieceSum]:
    """Every sum over pieces the sharded layers need, one per rank set, in the order the rank sets first
    occur (layers in order, parameters in order, pieces by row): the same list on every rank (pure).
    ``rows``: first-dimension size of each trainable parameter of each sharded layer
    (``model.layers.parameter_rows``)."""
    by_ranks: dict[tuple[int, ...], list[tuple[int, int, int, int]]] = {}
    for layer in sharded_layers(plan, trainable):
        holders = plan.shard_holders(layer)
        for k, size in enumerate(rows[layer]):
            for piece in reduction_pieces(size, holders):
                if len(piece.ranks) > 1:
                    by_ranks.setdefault(piece.ranks, []).append((layer, k, piece.start, piece.end))
    return [PieceSum(ranks, tuple(entries)) for ranks, entries in by_ranks.items()]


@dataclass(frozen=True, slots=True)
class Chunk:
    """Layers of one bucket whose gradients go in one all-reduce."""

    holders: tuple[int, ...]
    layers: tuple[int, ...]
    """Descending: the order the backward makes them."""


def chunks(rank_buckets: Sequence[Bucket], layer_bytes: Mapping[int, int], cap_bytes: float) -> list[Chunk]:
    """One rank's buckets cut into chunks of whole layers, each closed once it holds ``cap_bytes`` (a layer
    larger than that is a chunk of its own), in the order they are started: the last layer first (pure;
    every holder of a bucket cuts it alike, from the layers' gradient bytes)."""
    out = []
    for bucket in sorted(rank_buckets, key=lambda b: b.layers[0], reverse=True):
        current, size = [], 0
        for layer in sorted(bucket.layers, reverse=True):
            current.append(layer)
            size += layer_bytes[layer]
            if size >= cap_bytes:
                out.append(Chunk(bucket.holders, tuple(current)))
                current, size = [], 0
        if current:
            out.append(Chunk(bucket.holders, tuple(current)))
    return out


def stage_meshes(plan: ExecutionPlan) -> list[tuple[int, ...]]:
    """The ranks of every stage of several GPUs, pipeline by pipeline: each is FSDP2's mesh for its stage, or
    the group a context-parallel stage gathers its keys and values over."""
    return [s.ranks for p in plan.pipelines for s in p.stages if s.width > 1]


def buckets(plan: ExecutionPlan, trainable: tuple[bool, ...]) -> list[Bucket]:
    """Trainable layers held by one-GPU stages only, grouped by identical holder sets, ordered by their
    first layer (pure)."""
    sharded = set(sharded_layers(plan, trainable))
    by_holders: dict[tuple[int, ...], list[int]] = {}
    for layer in range(plan.num_layers):
        if trainable[layer] and layer not in sharded:
            by_holders.setdefault(tuple(sorted(plan.holders(layer))), []).append(layer)
    out = [Bucket(h, tuple(ls)) for h, ls in by_holders.items()]
    return sorted(out, key=lambda b: b.layers[0])


def tied_holders(plan: ExecutionPlan, trainable: tuple[bool, ...], tied: tuple[int, int] | None) -> tuple[int, ...]:
    """Every holder of either tied layer (empty when nothing is tied or either is frozen)."""
    if tied is None or not (trainable[tied[0]] and trainable[tied[1]]):
        return ()
    return tuple(sorted(set(plan.holders(tied[0])) | set(plan.holders(tied[1]))))


def tied_pieces(
    plan: ExecutionPlan, trainable: tuple[bool, ...], tied: tuple[int, int] | None, tied_rows: int
) -> list[Piece]:
    """On a plan with stages of several GPUs, the tied embedding's rows cut at every holding stage's chunks (a
    stage holding both the embedding and the head counted once), each naming the one rank per holding stage
    whose chunk holds it (``planning.shards.reduction_pieces``); empty when nothing is tied or either side is
    frozen."""
    if tied is None or not (trainable[tied[0]] and trainable[tied[1]]):
        return []
    stages = list(dict.fromkeys(ranks for layer in tied for ranks in plan.shard_holders(layer)))
    return reduction_pieces(tied_rows, stages)


def subgroup_ranks(
    plan: ExecutionPlan,
    trainable: tuple[bool, ...],
    tied: tuple[int, int] | None = None,
    rows: Mapping[int, Sequence[int]] | None = None,
    tied_rows: int | None = None,
) -> list[tuple[int, ...]]:
    """The ranks of every process group ``GradientSync`` forms, in the order it forms them (pure):
    ``runtime.group.PreparedGroup`` forms the same ones ahead of a switch.

    A bucket over every rank gets a group of its own too, not the default group: a gradient
    all-reduce abandoned on a hung peer keeps its group busy until the group's timeout, and the
    default group must close at once when the iteration is abandoned (``leave_group(abort=True)``).
    For the same reason the step's last collectives (the gradient norm with the loss and flags, the
    balancer's pipeline times) run on a group of every rank, the last one: on the default group an
    abandoned one made the aborting worker's destroy of that group wait for it (1.5-2.6 s under churn).

    A plan with stages of several GPUs adds, after the buckets', the groups of its sums over pieces
    (``piece_sums``; ``rows`` is then required), those of the tied embedding's pieces (``tied_pieces``,
    ``tied_rows`` its rows; instead of one group of every holder), and each such stage's FSDP2 mesh
    (``stage_meshes``).
    """
    out = [b.holders for b in buckets(plan, trainable) if len(b.holders) > 1]
    if plan.sharded:
        if rows is None:
            raise ValueError("subgroup_ranks: a plan with stages of several GPUs needs the parameters' rows")
        out += [s.ranks for s in piece_sums(plan, trainable, rows)]
        pieces = tied_pieces(plan, trainable, tied, tied_rows or 0) if tied_holders(plan, trainable, tied) else []
        out += list(dict.fromkeys(p.ranks for p in pieces if len(p.ranks) > 1))
        out += stage_meshes(plan)
    tied_ranks = tied_holders(plan, trainable, tied)
    if len(tied_ranks) > 1 and not plan.sharded:
        out.append(tied_ranks)
    out.append(tuple(range(plan.world_size)))  # the step group (GradientSync.step_group)
    return out


@dataclass(frozen=True, slots=True)
class _Buffer:
    """A chunk's parameters and, when their gradients can be views of one buffer (one dtype, the all-reduce's;
    one device), that buffer and the views (``GradientSync.attach``); else ``flat`` is None."""

    modules: tuple[int, ...]
    """``id`` of each layer module it was made for: other modules get a new one."""
    params: list[nn.Parameter]
    flat: torch.Tensor | None
    views: list[torch.Tensor]

    def holds(self, p: nn.Parameter, view: torch.Tensor) -> bool:
        """Whether ``p``'s gradient is ``view``, its place in the buffer."""
        return p.grad is not None and p.grad.data_ptr() == view.data_ptr()

    def holds_all(self) -> bool:
        """Whether every gradient of the chunk is its view: the buffer is what to sum."""
        return self.flat is not None and all(self.holds(p, view) for p, view in zip(self.params, self.views))


@dataclass(slots=True)
class _Started:
    """An all-reduce in flight: the tensors its result goes back into."""

    tensors: list[torch.Tensor]
    flat: torch.Tensor
    work: object
    what: str

    @classmethod
    @torch.no_grad()
    def start(cls, tensors: Sequence[torch.Tensor], group, what: str, dtype: torch.dtype | None = None) -> _Started:
        """Sum ``tensors`` (views included) over ``group`` in one all-reduce of their concatenation (in
        ``dtype`` when given); ``finish`` writes the sums back."""
        flat = torch.cat([t.reshape(-1) for t in tensors])
        if dtype is not None and flat.dtype != dtype:
            flat = flat.to(dtype)
        return cls(list(tensors), flat, dist.all_reduce(flat, group=group, async_op=True), what)

    @classmethod
    def in_place(cls, flat: torch.Tensor, group, what: str) -> _Started:
        """Sum ``flat``, whose views are the gradients (``GradientSync.attach``), over ``group``: nothing to copy."""
        return cls([], flat, dist.all_reduce(flat, group=group, async_op=True), what)

    @torch.no_grad()
    def finish(self, waiter: Waiter) -> int:
        """Waits for the sum, writes it back into each tensor; returns the bytes reduced."""
        waiter.wait(self.work, self.what)
        offset = 0
        for t in self.tensors:
            t.copy_(self.flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()
        return self.flat.numel() * self.flat.element_size()


def _sum_in_place(
    tensors: Sequence[torch.Tensor], group, waiter: Waiter, what: str, dtype: torch.dtype | None = None
) -> int:
    """Sum ``tensors`` over ``group`` now (``_Started``); returns the bytes reduced."""
    return _Started.start(tensors, group, what, dtype).finish(waiter)


class GradientSync:
    def __init__(
        self,
        plan: ExecutionPlan,
        rank: int,
        trainable: tuple[bool, ...],
        timeout: timedelta | None = None,
        tied: tuple[int, int] | None = None,
        reduce_dtype: torch.dtype | None = None,
        rows: Mapping[int, Sequence[int]] | None = None,
        tied_rows: int | None = None,
        layer_bytes: Mapping[int, int] | None = None,
        bucket_bytes: float = float("inf"),
    ):
        """``tied``: (token embedding, LM head) layer indices whose weights are one parameter.
        ``reduce_dtype``: the all-reduce's dtype when it differs from the gradients' (bf16 reduction).
        ``rows``: with stages of several GPUs, the first-dimension sizes of the sharded layers' parameters.
        ``layer_bytes``: the gradient bytes of each layer this rank holds, cut into chunks of ``bucket_bytes``
        (``chunks``; without it, one chunk per bucket)."""
        self.rank = rank
        self.reduce_dtype = reduce_dtype
        self.plan = plan
        self.buckets = buckets(plan, trainable)
        self.piece_sums = piece_sums(plan, trainable, rows) if plan.sharded else []
        # Each row counted once in the norm: every rank of the owner's stage (the first pipeline's) adds its own.
        self.owned = {layer for layer in range(plan.num_layers) if rank in plan.shard_holders(layer)[0]}
        self._shard_start = {}  # (layer, parameter index) -> the first global row of this rank's chunk
        for p in plan.pipelines:
            for s in p.stages:
                if rank in s.ranks and s.sharded:
                    for layer in s.layers:
                        for k, size in enumerate((rows or {}).get(layer, ())):
                            self._shard_start[(layer, k)] = chunk_rows(size, s.width)[s.ranks.index(rank)][0]
        self.tied = tied if tied is not None and trainable[tied[0]] and trainable[tied[1]] else None
        self.tied_holders = tied_holders(plan, trainable, tied)
        # new_group is collective over the default group: every rank, same order.
        # Without an explicit timeout a subgroup waits 30 min on a hung peer, whatever the world's.
        self.tied_pieces = tied_pieces(plan, trainable, tied, tied_rows or 0) if plan.sharded else []
        every = subgroup_ranks(plan, trainable, tied, rows, tied_rows)
        formed = [dist.new_group(list(ranks), timeout=timeout) for ranks in every]
        self.step_group = formed.pop()
        """Every rank: the step's last collectives (``global_grad_sq``, the balancer's pipeline times)."""
        every = every[:-1]
        self.tied_group = None
        if len(self.tied_holders) > 1 and not plan.sharded:  # the last one (a bucket's ranks get their own)
            tied_group, every = formed.pop(), every[:-1]
            self.tied_group = tied_group if rank in self.tied_holders else None
        self.stage_group = None
        """The group of this rank's stage when it spans several GPUs: its FSDP2 mesh is made from it."""
        meshes = stage_meshes(plan)
        if meshes:
            mine = [g for ranks, g in zip(every[-len(meshes) :], formed[-len(meshes) :]) if rank in ranks]
            self.stage_group = mine[0] if mine else None
            every, formed = every[: -len(meshes)], formed[: -len(meshes)]
        self.groups = {ranks: group for ranks, group in zip(every, formed) if rank in ranks}
        mine = [b for b in self.buckets if rank in b.holders]
        self.alone = [layer for b in mine if len(b.holders) == 1 for layer in b.layers]
        """Layers no other rank holds: nothing to sum."""
        shared = [b for b in mine if len(b.holders) > 1]
        sizes = layer_bytes if layer_bytes is not None else {layer: 0 for b in shared for layer in b.layers}
        self.chunks = chunks(shared, sizes, bucket_bytes if layer_bytes is not None else float("inf"))
        """This rank's all-reduces of whole layers, in the order it starts them."""
        self._buffers: dict[int, _Buffer] = {}
        """Chunk index -> its parameters and the buffer their gradients are views of (``_buffer``, ``attach``)."""
        self._started: list[_Started] = []
        self._ready: set[int] = set()
        self._hooks: list = []
        self._unfired = 0  # armed parameters still without their final gradient
        self._early: list[_Started] = []
        self.overlapped_bytes = 0
        """Bytes of the last ``all_reduce`` whose sum started while some of this rank's gradients were still
        being computed: what the overlap won back (a chunk started by the backward's last hook overlaps nothing)."""
        self.copied_bytes = 0
        """Bytes of the last ``all_reduce``'s chunks copied into a buffer and back: those not views (``attach``)."""

    def _buffer(self, k: int, layers: Mapping[int, nn.Module]) -> _Buffer:
        """Chunk ``k``'s parameters in ``layers`` and, where they can be views of one buffer, that buffer: made
        once per set of layer modules (a step lists them several times; ``Module.parameters`` walks the
        module tree each time)."""
        chunk = self.chunks[k]
        modules = tuple(id(layers[i]) for i in chunk.layers)
        made = self._buffers.get(k)
        if made is not None and made.modules == modules:
            return made
        params = [p for i in chunk.layers for p in trainable_params(layers[i])]
        kinds = {(p.dtype, p.device) for p in params}
        flat, views = None, []
        if len(kinds) == 1 and len({id(p) for p in params}) == len(params):
            dtype, device = kinds.pop()
            if self.reduce_dtype is None or self.reduce_dtype == dtype:
                flat = torch.empty(sum(p.numel() for p in params), dtype=dtype, device=device)
                offsets = itertools.accumulate((p.numel() for p in params), initial=0)
                views = [flat[at : at + p.numel()].view_as(p) for at, p in zip(offsets, params)]
        made = self._buffers[k] = _Buffer(modules, params, flat, views)
        return made

    @torch.no_grad()
    def attach(self, layers: Mapping[int, nn.Module]) -> None:
        """Before the step's first backward: every parameter of a chunk gets its gradient as a view of the
        chunk's flat buffer (module docstring), holding what its gradient held (zero where it had none), so the
        backward accumulates into the buffer and the all-reduce needs no copies. Any state is fine: a gradient
        already the view stays as it is. A chunk summed in another dtype, or whose parameters differ in dtype or
        device, keeps its gradients as they are."""
        for k in range(len(self.chunks)):
            made = self._buffer(k, layers)
            if made.flat is None:
                continue
            if all(p.grad is None for p in made.params):  # the usual case, after the update's zero_grad
                made.flat.zero_()
                for p, view in zip(made.params, made.views):
                    p.grad = view
                continue
            for p, view in zip(made.params, made.views):
                if made.holds(p, view):
                    continue
                if p.grad is None:
                    view.zero_()
                else:
                    view.copy_(p.grad)
                p.grad = view

    def arm(self, layers: Mapping[int, nn.Module], compute: Mapping[int, nn.Module]) -> None:
        """Before the step's last backward: start each chunk's all-reduce as soon as that backward has made
        every gradient of it (module docstring). ``compute``: the modules the backward runs (``layers``
        themselves, or their compute-dtype copies whose own hook has added each gradient into its master's
        by the time these run: registered earlier, they run first)."""
        self.disarm()
        for k, chunk in enumerate(self.chunks):
            params = [p for i in chunk.layers for p in trainable_params(compute[i])]
            remaining = [len(params)]

            def fired(_, k=k, remaining=remaining) -> None:
                remaining[0] -= 1
                self._unfired -= 1
                if remaining[0] == 0:
                    self._ready.add(k)
                    self._start_ready(layers)

            self._hooks += [p.register_post_accumulate_grad_hook(fired) for p in params]
            self._unfired += len(params)

    def disarm(self) -> None:
        """Forget the step's hooks and its all-reduces in flight (an abandoned iteration's too)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks, self._started, self._ready, self._early, self._unfired = [], [], set(), [], 0

    def _start_ready(self, layers: Mapping[int, nn.Module]) -> None:
        """Start the chunks that are ready, in order, up to the first that is not."""
        while len(self._started) < len(self.chunks) and len(self._started) in self._ready:
            self._start(len(self._started), layers)
            if self._unfired > 0:
                self._early.append(self._started[-1])

    def _start(self, k: int, layers: Mapping[int, nn.Module]) -> None:
        chunk, made = self.chunks[k], self._buffer(k, layers)
        group, what = self.groups[chunk.holders], f"gradient all-reduce over ranks {chunk.holders}"
        if made.holds_all():
            self._started.append(_Started.in_place(made.flat, group, what))
            return
        for i in chunk.layers:
            fill_missing_grads(layers[i])
        self._started.append(_Started.start([p.grad for p in made.params], group, what, self.reduce_dtype))

    def all_reduce(self, layers: Mapping[int, nn.Module], waiter: Waiter = Waiter()) -> int:
        """Sum every held layer's gradients over its holders; returns bytes reduced. The chunks ``arm`` started
        during the backward are waited for; the rest start now."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        for layer in self.alone:
            fill_missing_grads(layers[layer])
        try:
            while len(self._started) < len(self.chunks):
                self._start(len(self._started), layers)
            sums = [started.finish(waiter) for started in self._started]
            early = {id(s) for s in self._early}
            self.overlapped_bytes = sum(n for s, n in zip(self._started, sums) if id(s) in early)
            self.copied_bytes = sum(n for s, n in zip(self._started, sums) if s.tensors)
        finally:
            self._started, self._ready, self._early, self._unfired = [], set(), [], 0
        return sum(sums) + self._reduce_pieces(layers, waiter) + self._reduce_tied(layers, waiter)

    def _reduce_pieces(self, layers: Mapping[int, nn.Module], waiter: Waiter) -> int:
        """Sum the sharded layers' gradients over the refinement of their holders' cuts (module docstring)."""
        total, filled = 0, set()
        for piece_sum in self.piece_sums:
            if self.rank not in piece_sum.ranks:
                continue
            views = []
            for layer, k, start, end in piece_sum.rows:
                module = layers[layer]
                if layer not in filled:
                    fill_missing_grads(module)
                    filled.add(layer)
                grad = local(trainable_params(module)[k].grad)
                first = self._shard_start.get((layer, k), 0)
                views.append(grad[start - first : end - first] if grad.dim() else grad.view(1))
            total += _sum_in_place(
                views,
                self.groups[piece_sum.ranks],
                waiter,
                f"sharded gradient all-reduce over ranks {piece_sum.ranks}",
                self.reduce_dtype,
            )
        return total

    def _reduce_tied(self, layers: Mapping[int, nn.Module], waiter: Waiter) -> int:
        """Both copies of a tied embedding get (embedding's gradient sum) + (head's gradient sum)."""
        if self.tied is None:
            return 0
        if self.plan.sharded:
            return self._reduce_tied_pieces(layers, waiter)
        if self.rank not in self.tied_holders:
            return 0
        embed, head = self.tied
        mine = [layers[i].tied_weight for i in self.tied if i in layers]
        total = torch.zeros_like(mine[0])
        for i in self.tied:  # only the owners contribute: the other holders have the same sums
            if i in layers and self.plan.holders(i)[0] == self.rank:
                total += layers[i].tied_weight.grad
        if self.tied_group is not None:
            waiter.wait(
                dist.all_reduce(total, group=self.tied_group, async_op=True),
                f"tied-embedding all-reduce over ranks {self.tied_holders}",
            )
        for weight in mine:
            weight.grad.copy_(total)
        return total.numel() * total.element_size() if self.tied_group is not None else 0

    def _reduce_tied_pieces(self, layers: Mapping[int, nn.Module], waiter: Waiter) -> int:
        """``_reduce_tied`` over the tied embedding's pieces (``tied_pieces``): per piece of rows, the rank of the
        embedding's first holding stage and of the head's add their rows (every holder has the same sums by
        now), summed among the piece's ranks; every copy this rank holds gets the total."""
        mine = [i for i in self.tied if i in layers]
        if not mine:
            return 0
        stage = self.plan.stage(self.rank)
        first = chunk_rows(self.tied_pieces[-1].end, stage.width)[stage.ranks.index(self.rank)][0]
        grads = {i: local(layers[i].tied_weight.grad) for i in mine}
        owned = [i for i in mine if self.rank in self.plan.shard_holders(i)[0]]
        by_ranks: dict[tuple[int, ...], list] = {}
        for piece in self.tied_pieces:
            if self.rank not in piece.ranks:
                continue
            rows = slice(piece.start - first, piece.end - first)
            total = torch.zeros_like(grads[mine[0]][rows])
            for i in owned:
                total += grads[i][rows]
            by_ranks.setdefault(piece.ranks, []).append((rows, total))
        moved = 0
        for ranks, parts in by_ranks.items():  # in the pieces' order: the same on every member
            if len(ranks) > 1:
                moved += _sum_in_place(
                    [t for _, t in parts], self.groups[ranks], waiter, f"tied-embedding all-reduce over ranks {ranks}"
                )
            for rows, t in parts:
                for i in mine:
                    grads[i][rows].copy_(t)
        return moved

    def global_grad_sq(
        self,
        layers: Mapping[int, nn.Module],
        device,
        extras: Sequence[torch.Tensor | float] = (),
        waiter: Waiter = Waiter(),
    ) -> tuple[float, list[float]]:
        """Squared global gradient norm, each layer counted once (by its owner), and the sum over
        all ranks of each of ``extras`` (scalars), in the same collective: ``(norm_sq, sums)``."""
        local = torch.zeros(1 + len(extras), dtype=torch.float64, device=device)  # on the device: one sync
        for i in sorted(self.owned & layers.keys()):
            local[0] += grad_sq(layers[i]).to(device)
        for k, value in enumerate(extras, start=1):
            local[k] = value.double() if isinstance(value, torch.Tensor) else float(value)
        waiter.wait(dist.all_reduce(local, group=self.step_group, async_op=True), "gradient-norm all-reduce")
        values = local.cpu().tolist()
        return values[0], values[1:]
