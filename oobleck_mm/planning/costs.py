"""Per-layer and per-stage costs: the one currency every planning step uses.

A ``ModelProfile`` is what both cost sources produce (the measured profiler in
``oobleck_mm.profiling.profiler`` and the analytical model in
``oobleck_mm.profiling.analytical``). ``stage_cost`` turns a contiguous layer
range on ``d`` GPUs of one node into the forward/backward seconds and the
memory the planner checks. Frozen-aware backward costs (Cornstarch eq. 3.1-3.3)
are applied once, in ``effective_layers``, so no caller can forget them.

Pure: no torch, no torch.distributed, no grpc.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

# Modalities a layer may belong to. Encoder branches ("vision", "audio") run in
# parallel in the model; the "text" trunk (token embedding + LLM) sits after all
# of them, so a trainable encoder layer makes every later text layer back-propagate.
MODALITIES = ("vision", "audio", "text")

RECOMPUTE_POLICIES = ("auto", "always", "never")


def recompute_policy(activation_checkpointing: bool | str) -> str:
    """``training.activation_checkpointing`` (auto / true / false) as a profile's ``recompute``."""
    if activation_checkpointing == "auto":
        return "auto"
    return "always" if activation_checkpointing else "never"


@dataclass(frozen=True, slots=True)
class LayerCost:
    """Costs of one layer for one microbatch of the profiled size."""

    name: str
    """Layer name, e.g. ``vision.block3`` or ``llm.head``."""
    modality: str
    """``vision``, ``audio`` (encoder branches, projectors included) or ``text`` (LLM trunk)."""
    forward_s: float
    """Forward seconds."""
    backward_weight_s: float
    """Seconds of the weight-gradient part of backward (B_w, eq. 3.1)."""
    backward_input_s: float
    """Seconds of the input-gradient part of backward (B_d, eq. 3.1)."""
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    """Bytes kept alive from forward to backward for one microbatch."""
    output_bytes: int
    """Bytes of the layer's output for one microbatch (what a p2p send carries)."""
    trainable: bool = True
    kept_bytes: int | None = None
    """Bytes kept from forward to backward when the layer recomputes its forward in backward (activation
    checkpointing: its inputs). None: no saving known, the same as ``activation_bytes``."""
    kv_bytes: int = 0
    """Bytes of the keys and values its attention computes for one microbatch (0: no attention over the
    sequence): what a context-parallel stage all-gathers (``stage_cost``)."""

    def __post_init__(self) -> None:
        if self.modality not in MODALITIES:
            raise ValueError(f"layer {self.name!r}: modality {self.modality!r} is not one of {MODALITIES}")
        for name in ("forward_s", "backward_weight_s", "backward_input_s"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"layer {self.name!r}: {name} must be a finite number >= 0, got {value}")
        if self.kept_bytes is not None and self.kept_bytes < 0:
            raise ValueError(f"layer {self.name!r}: kept_bytes must be >= 0 or None, got {self.kept_bytes}")
        for name in ("param_bytes", "grad_bytes", "optimizer_bytes", "activation_bytes", "output_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"layer {self.name!r}: {name} must be >= 0, got {getattr(self, name)}")

    @property
    def backward_s(self) -> float:
        return self.backward_weight_s + self.backward_input_s

    @property
    def recompute_bytes(self) -> int:
        """Bytes kept per microbatch when recomputing: never more than keeping everything."""
        return self.activation_bytes if self.kept_bytes is None else min(self.kept_bytes, self.activation_bytes)

    @property
    def state_bytes(self) -> int:
        """Parameters + gradients + optimizer state: what a layer move copies and what stays resident."""
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes


@dataclass(frozen=True, slots=True)
class ModelProfile:
    """Per-layer costs of a whole model at one microbatch size on one device kind."""

    model_name: str
    device: str
    microbatch_size: int
    layers: tuple[LayerCost, ...]
    source: str = "analytical"
    """``measured`` or ``analytical``."""
    recompute: str = "auto"
    """Which stages recompute activations in backward (``training.activation_checkpointing``): ``auto``, the
    planner decides per stage (a stage keeps its activations when they fit and recomputes when only that
    fits); ``always``; ``never``. The layer costs themselves are always those of keeping."""
    frozen_aware: bool = True
    """Backward times by eq. 3.2 (frozen layers skip their weight gradients, layers with nothing trainable
    before them skip their input gradients). False prices every layer's backward as if the whole model
    trained (``B_w + B_d``), as a partitioner unaware of frozen status does (Cornstarch Table 3.2's baseline,
    ``scripts/bench_modality.py frozen``); memory and gradient bytes stay those of the true frozen status."""
    upstream_trainable: bool = False
    """A trainable layer outside these layers feeds their text trunk: the LLM's part of a model whose encoder
    branches are planned apart (``planning.branches``) and train, so its layers back-propagate input
    gradients (eq. 3.3 across parts)."""

    def __post_init__(self) -> None:
        if self.recompute not in RECOMPUTE_POLICIES:
            raise ValueError(f"recompute must be one of {RECOMPUTE_POLICIES}, got {self.recompute!r}")
        if not self.layers:
            raise ValueError(f"profile of {self.model_name!r} has no layers")
        if self.microbatch_size < 1:
            raise ValueError(f"microbatch_size must be >= 1, got {self.microbatch_size}")

    @property
    def num_layers(self) -> int:
        return len(self.layers)


def with_frozen(profile: ModelProfile, frozen: tuple[str, ...]) -> ModelProfile:
    """Marks layers frozen by exact name (``llm.block1``) or by module (``vision.``).

    An entry ending in ``.`` freezes every layer under it; any other entry
    freezes only the layer of that exact name, so ``llm.block1`` never freezes
    ``llm.block10``. A layer without parameters is never trainable: counting it
    as trainable would make every later layer pay input gradients (eq. 3.3)
    for nothing.
    """

    def is_frozen(name: str) -> bool:
        return any(name == entry or (entry.endswith(".") and name.startswith(entry)) for entry in frozen)

    layers = tuple(
        replace(layer, trainable=layer.param_bytes > 0 and not is_frozen(layer.name)) for layer in profile.layers
    )
    return replace(profile, layers=layers)


def needs_input_grad(layers: tuple[LayerCost, ...], upstream_trainable: bool = False) -> tuple[bool, ...]:
    """For each layer: must it back-propagate input gradients (p(L) of eq. 3.3)?

    A layer needs B_d only when a trainable layer sits *strictly before* it on
    its data path: earlier in its own encoder branch, or, for the text trunk,
    anywhere earlier in any branch. The seed's eq. 3.3 also counts the layer
    itself, which charges the first trainable layer an input gradient nobody
    consumes; we do not. ``upstream_trainable``: a trainable layer before ``layers``
    (in another part of the model) feeds the text trunk.
    """
    seen_trainable = {m: False for m in MODALITIES}
    result = []
    for layer in layers:
        if layer.modality == "text":
            before = upstream_trainable or any(seen_trainable.values())
        else:
            before = seen_trainable[layer.modality]
        result.append(before)
        if layer.trainable:
            seen_trainable[layer.modality] = True
    return tuple(result)


@dataclass(frozen=True, slots=True)
class EffectiveLayer:
    """A layer's costs after frozen status is applied (eq. 3.2)."""

    forward_s: float
    backward_s: float
    resident_bytes: int
    """Params (+ grads + optimizer state when trainable)."""
    activation_bytes: int
    """Kept per in-flight microbatch; 0 when the layer runs no backward at all."""
    output_bytes: int
    grad_bytes: int
    """Bytes all-reduced across replicas each iteration (0 when frozen)."""
    param_bytes: int = 0
    """The parameters alone: what a sharded stage all-gathers before the layer runs (``stage_cost``)."""
    kept_bytes: int = 0
    """Kept per in-flight microbatch when the layer recomputes (0 when it runs no backward)."""
    kv_bytes: int = 0
    """Its keys and values for one microbatch (``LayerCost.kv_bytes``)."""
    recompute_s: float = 0.0
    """What recomputing adds to the backward: one forward (0 when the layer runs no backward)."""
    sequence: bool = True
    """It runs on the LLM's sequence, which a context-parallel stage splits over its GPUs; an encoder layer
    (vision, audio, their projectors) runs whole media on every GPU of such a stage."""


def effective_layers(profile: ModelProfile) -> tuple[EffectiveLayer, ...]:
    """Applies eq. 3.2: B = (B_w if trainable) + (B_d if a trainable layer is before it); with
    ``profile.frozen_aware`` off, B = B_w + B_d for every layer (times only)."""
    out = []
    for layer, input_grad in zip(profile.layers, needs_input_grad(profile.layers, profile.upstream_trainable)):
        backward = (layer.backward_weight_s if layer.trainable else 0.0) + (
            layer.backward_input_s if input_grad else 0.0
        )
        if not profile.frozen_aware:
            backward = layer.backward_weight_s + layer.backward_input_s
        runs_backward = layer.trainable or input_grad
        out.append(
            EffectiveLayer(
                forward_s=layer.forward_s,
                backward_s=backward,
                resident_bytes=layer.state_bytes if layer.trainable else layer.param_bytes,
                activation_bytes=layer.activation_bytes if runs_backward else 0,
                output_bytes=layer.output_bytes,
                grad_bytes=layer.grad_bytes if layer.trainable else 0,
                param_bytes=layer.param_bytes,
                kept_bytes=layer.recompute_bytes if runs_backward else 0,
                kv_bytes=layer.kv_bytes,
                recompute_s=layer.forward_s if runs_backward or not profile.frozen_aware else 0.0,
                sequence=layer.modality == "text",
            )
        )
    return tuple(out)


AUTO_CONTEXT_PARALLEL = 0
"""``ClusterSpec.context_parallel`` for the config's ``auto``: no degree chosen yet (maps as 1 until then)."""


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    """What the planner knows about the hardware: homogeneous nodes of identical GPUs."""

    gpus_per_node: int
    device_memory_bytes: int
    intra_node_bandwidth: float = 150e9
    """Bytes/s between GPUs of one node (NVLink class)."""
    inter_node_bandwidth: float = 12.5e9
    """Bytes/s between nodes (100 Gb/s class)."""
    p2p_latency_s: float = 20e-6
    """Fixed cost of one message."""
    max_gpus_per_stage: int = 1
    """Largest GPU count of one stage (1, 2, 4 or 8 and <= gpus_per_node)."""
    memory_headroom: float = 0.9
    """Fraction of device memory the planner may fill (the rest: allocator, workspace)."""
    context_parallel: int = 1
    """Above 1: every stage spans this many GPUs of a node that split each microbatch's tokens (all-gather
    context parallelism) instead of sharding the layers (``stage_cost``)."""
    min_gpus_per_stage: int = 1
    """Narrowest stage the planner may use (a planning knob, not a config key: the encoder-branch search
    plans a part in wide stages only to keep the branched pipeline shallow, ``planning.branches``)."""
    placement: str = "chain"
    """``planning.placement``: ``auto`` lets ``build_templates`` run encoders as branches where faster."""

    def __post_init__(self) -> None:
        if self.gpus_per_node < 1:
            raise ValueError(f"gpus_per_node must be >= 1, got {self.gpus_per_node}")
        if self.max_gpus_per_stage not in (1, 2, 4, 8):
            raise ValueError(f"max_gpus_per_stage must be 1, 2, 4 or 8, got {self.max_gpus_per_stage}")
        if self.device_memory_bytes <= 0:
            raise ValueError(f"device_memory_bytes must be > 0, got {self.device_memory_bytes}")
        if not 0 < self.memory_headroom <= 1:
            raise ValueError(f"memory_headroom must be in (0, 1], got {self.memory_headroom}")
        if self.context_parallel == AUTO_CONTEXT_PARALLEL:
            pass  # resolved by planning.stage_mapping.resolve_context_parallel before any mapping
        elif self.context_parallel not in (1, 2, 4, 8) or self.gpus_per_node % self.context_parallel:
            raise ValueError(
                f"context_parallel must be 1, 2, 4 or 8 and divide gpus_per_node ({self.gpus_per_node}), "
                f"got {self.context_parallel}"
            )
        if self.context_parallel > 1 and self.max_gpus_per_stage > 1:
            raise ValueError("context_parallel and max_gpus_per_stage above 1 do not combine yet")

    @classmethod
    def from_config(cls, cluster) -> ClusterSpec:
        """From the job's ``cluster`` section (a ``config.ClusterConfig``)."""
        return cls(
            gpus_per_node=cluster.gpus_per_node,
            device_memory_bytes=cluster.device_memory,
            intra_node_bandwidth=cluster.intra_node_bandwidth,
            inter_node_bandwidth=cluster.inter_node_bandwidth,
            max_gpus_per_stage=cluster.max_gpus_per_stage,
            context_parallel=AUTO_CONTEXT_PARALLEL if cluster.context_parallel == "auto" else cluster.context_parallel,
        )

    @property
    def stage_gpu_options(self) -> tuple[int, ...]:
        """GPU counts a stage may use on this cluster: under context parallelism exactly its degree."""
        if self.context_parallel > 1:
            return (self.context_parallel,)
        widest = min(self.max_gpus_per_stage, self.gpus_per_node)
        return tuple(d for d in (1, 2, 4, 8) if min(self.min_gpus_per_stage, widest) <= d <= widest)

    @property
    def usable_memory_bytes(self) -> float:
        return self.device_memory_bytes * self.memory_headroom

    def transfer_s(self, num_bytes: float, cross_node: bool) -> float:
        """Seconds to send ``num_bytes`` point to point."""
        if num_bytes <= 0:
            return 0.0
        bandwidth = self.inter_node_bandwidth if cross_node else self.intra_node_bandwidth
        return self.p2p_latency_s + num_bytes / bandwidth

    def allreduce_s(self, num_bytes: float, participants: int, cross_node: bool) -> float:
        """Ring all-reduce seconds: 2(p-1)/p of the bytes over the slowest link."""
        if participants <= 1 or num_bytes <= 0:
            return 0.0
        bandwidth = self.inter_node_bandwidth if cross_node else self.intra_node_bandwidth
        steps = 2 * (participants - 1)
        return steps * self.p2p_latency_s + steps / participants * num_bytes / bandwidth

    def allgather_s(self, num_bytes: float, participants: int, cross_node: bool) -> float:
        """Ring all-gather (or reduce-scatter) seconds of a tensor of ``num_bytes`` in all: half an
        all-reduce, (p-1)/p of the bytes over the slowest link."""
        return self.allreduce_s(num_bytes, participants, cross_node) / 2


@dataclass(frozen=True, slots=True)
class StageCost:
    forward_s: float
    backward_s: float
    resident_bytes: float
    """Per GPU of the stage."""
    activation_bytes: float
    """Per GPU of the stage, per in-flight microbatch."""
    output_bytes: int
    """Bytes the stage sends to the next one per microbatch (its last layer's output)."""
    grad_bytes: float
    """Per GPU: gradient bytes all-reduced across replicas per iteration."""

    def memory_bytes(self, in_flight: int) -> float:
        return self.resident_bytes + self.activation_bytes * in_flight


class LayerPrefix:
    """Prefix sums over effective layers, so any stage [u, v) costs O(1)."""

    __slots__ = ("layers", "fwd", "bwd", "resident", "act", "grad", "kept", "recompute")

    def __init__(self, layers: tuple[EffectiveLayer, ...]):
        self.layers = layers
        self.fwd = _prefix([l.forward_s for l in layers])
        self.bwd = _prefix([l.backward_s for l in layers])
        self.resident = _prefix([l.resident_bytes for l in layers])
        self.act = _prefix([l.activation_bytes for l in layers])
        self.grad = _prefix([l.grad_bytes for l in layers])
        self.kept = _prefix([l.kept_bytes for l in layers])
        self.recompute = _prefix([l.recompute_s for l in layers])


def _prefix(values: list[float]) -> list[float]:
    out = [0.0]
    for v in values:
        out.append(out[-1] + v)
    return out


def stage_cost(
    prefix: LayerPrefix, cluster: ClusterSpec, start: int, end: int, num_gpus: int, recompute: bool = False
) -> StageCost:
    """Costs of layers [start, end) run as one stage on ``num_gpus`` GPUs of one node.

    ``recompute``: every layer of the stage keeps only its inputs from the forward and runs its forward
    again in the backward (activation checkpointing, layer by layer as the runtime does it): activations
    fall to ``kept_bytes`` and the backward gains one forward of every layer that runs one. The one
    layer's recomputed activations alive during its backward are left to the memory headroom.

    With d > 1 GPUs the stage is sharded as FSDP2 shards it (the mechanism the runtime
    uses, ``docs/runtime.md``): each GPU holds 1/d of every layer's state and runs 1/d of
    the microbatch, so compute, state and activations divide by d; each layer all-gathers
    its parameters over the node's links before its forward and again before its backward
    (resharded after the forward), and reduce-scatters its gradients after the backward.
    This makes wide stages pay for their collectives instead of looking free. Priced per
    microbatch, as FSDP2 runs by default; keeping a step's parameters gathered over its
    microbatches and reduce-scattering once (``reshard_after_forward=False``, gradient sync on
    the last microbatch only) would trade memory for fewer collectives, and is to be priced
    if the runtime does that. Left out, so
    that the cost stays additive over layers (``stage_tables._CostTables``): the one
    layer's gathered parameters held while it runs (the memory headroom covers it), and
    microbatches smaller than d (a GPU with no sample idles).
    """
    assert 0 <= start < end <= len(prefix.layers) and num_gpus >= 1
    d = num_gpus
    forward = (prefix.fwd[end] - prefix.fwd[start]) / d
    backward = (prefix.bwd[end] - prefix.bwd[start]) / d
    if recompute:
        backward += (prefix.recompute[end] - prefix.recompute[start]) / d
    activations = prefix.kept if recompute else prefix.act
    activations_whole = 0.0
    if d > 1 and cluster.context_parallel > 1:
        # Context parallelism: each GPU runs 1/d of every microbatch's tokens; each attention gathers the keys
        # and values of the whole sequence before its forward (again when recomputing) and sums their
        # gradients over the GPUs in its backward (an all-reduce: ``runtime.context_parallel``). Encoder
        # layers run whole media on every GPU: their time and activations are not divided. The layers'
        # state is sharded over the GPUs as below (FSDP2 over the lanes, torchtitan's ``dp_shard_cp``).
        for layer in prefix.layers[start:end]:
            if not layer.sequence:  # the 1/d taken above, given back
                forward += (1 - 1 / d) * layer.forward_s
                backward += (1 - 1 / d) * (layer.backward_s + (layer.recompute_s if recompute else 0.0))
                activations_whole += (1 - 1 / d) * (layer.kept_bytes if recompute else layer.activation_bytes)
            elif layer.kv_bytes:
                gather = cluster.allgather_s(layer.kv_bytes, d, cross_node=False)
                forward += gather
                if layer.backward_s > 0:
                    backward += cluster.allreduce_s(layer.kv_bytes, d, cross_node=False) + (gather if recompute else 0)
    if d > 1:
        for layer in prefix.layers[start:end]:
            gather = cluster.allgather_s(layer.param_bytes, d, cross_node=False)
            forward += gather
            if layer.backward_s > 0:
                backward += gather + cluster.allgather_s(layer.grad_bytes, d, cross_node=False)
    return StageCost(
        forward_s=forward,
        backward_s=backward,
        resident_bytes=(prefix.resident[end] - prefix.resident[start]) / d,
        activation_bytes=(activations[end] - activations[start]) / d + activations_whole,
        output_bytes=prefix.layers[end - 1].output_bytes,
        grad_bytes=(prefix.grad[end] - prefix.grad[start]) / d,
    )
