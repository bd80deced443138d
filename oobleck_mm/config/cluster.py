"""The ``cluster``, ``planning`` and ``balance`` sections: the machines, how the planner searches, and the
multimodal balancer. Declarations (cross-field rules: ``config.validation``)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import ClassVar

from oobleck_mm.config.devices import DEVICES
from oobleck_mm.config.values import (
    ConfigError,
    as_bandwidth,
    as_bool,
    as_choice,
    as_float,
    as_int,
    as_size,
    as_str,
    check,
    check_optional,
)


MAX_GPUS_PER_NODE = 256
MAX_NODES = 4096
_NODES_WHY = "the planner makes a template for every node count up to it"

RUN_DEVICES = ("cpu", "cuda")
"""What ``cluster.device`` may be: where the workers run."""


@dataclass(kw_only=True, slots=True)
class ClusterConfig:
    _PATH: ClassVar[str] = "cluster"
    nodes: int = 2
    """Nodes the job starts with."""
    max_nodes: int | None = None
    """Most nodes the job runs on: an agent registering beyond it is refused (exit 2, the reason in
    its log). None: no limit. ``--nodes MIN:MAX`` sets both, as torchrun's ``--nnodes``."""
    gpus_per_node: int = 1
    device: str = "cpu"
    """What the workers run on: ``cpu`` (one process per simulated GPU, gloo) or ``cuda`` (one
    process per GPU, NCCL)."""
    accelerator: str | None = None
    """The accelerator the cost model assumes, a key of ``oobleck_mm.config.devices.DEVICES``
    (``a40``, ``a100-40gb``, ``a100-80gb``, ``h100``, ``cpu`` ...); default ``cpu`` on the cpu,
    required with ``device: cuda``."""
    device_memory: int | None = None
    """Bytes of memory per device; default: the accelerator's."""
    compute_efficiency: float | None = None
    """Fraction of the accelerator's peak FLOP/s real kernels reach, in (0, 1]; default: the
    catalogue's (0.45). Calibrate the analytical cost model to a measured cluster with it."""
    max_gpus_per_stage: int = 1
    """Largest GPU count of one pipeline stage: 1, 2, 4 or 8, at most gpus_per_node."""
    context_parallel: int | str = 1
    """GPUs of one node that split every sample's tokens (all-gather context parallelism, Cornstarch §3.4.3):
    1, 2, 4 or 8, at most gpus_per_node, or ``auto``. Above 1 every stage spans that many GPUs of a node, each
    holding its layers whole and its share of every microbatch's 128-token blocks (Cornstarch's LPT over the
    attention work); attention gathers the others' keys and values. For samples longer than one GPU's memory
    holds. ``auto``: the planner takes the smallest degree at which the job fits its nodes (1 when it fits
    without; ``planning.stage_mapping.resolve_context_parallel``). The built-in model and HuggingFace models
    (their encoders run whole on every GPU of such a stage); not with max_gpus_per_stage above 1."""
    intra_node_bandwidth: float = 150e9
    """Bytes/s between GPUs of a node."""
    inter_node_bandwidth: float = 12.5e9
    """Bytes/s between nodes."""
    backend: str = "auto"
    """torch.distributed backend: ``auto`` (nccl on GPUs, gloo on cpu), ``gloo`` or ``nccl``."""
    emulate: str | None = None
    """Run the job on CPU workers as if on this accelerator (a key of the devices catalogue, not
    ``cpu``; docs/emulation.md): the master plans the real model on it, the workers compute a
    shrunk copy and every stage's forward and backward, every transfer and every state copy ends
    when the real model would have finished it there. Replaces ``accelerator`` (the planner sees the
    accelerator emulated); needs ``device: cpu``."""
    emulate_shrink: int | None = None
    """Emulation: the divisor of every width of the workers' compute copy (hidden sizes, FFN
    widths, heads, vocabulary); token counts and the layer list stay. None: automatic, the LLM's
    width down to about 32 (``config.emulation.auto_shrink``)."""
    emulate_coarsen: int | None = None
    """Emulation: the compute copy's encoders read tokens this many times coarser (patch sides and audio
    downsampling multiplied), so its CPU attention stays cheap; the emulated durations still follow every
    sample's real tokens. None: automatic, every encoder span down to at most 128 tokens
    (``config.emulation.auto_coarsen``); 1: the real token counts."""
    emulate_profile: str | None = None
    """Emulation: a JSON file of the *true* layer times the emulated accelerator runs at (per-kind
    factors on the analytical model, per-sample noise; format in docs/emulation.md). None: the
    built-in truth (``oobleck_mm.emulation.truth.DEFAULT_TRUTH``), which the run prints."""

    def __post_init__(self) -> None:
        self._check_emulation()
        check(self, "nodes", as_int, minimum=1, maximum=MAX_NODES, why=_NODES_WHY)
        check_optional(self, "max_nodes", as_int, minimum=1, maximum=MAX_NODES, why=_NODES_WHY)
        if self.max_nodes is not None and self.max_nodes < self.nodes:
            raise ConfigError(
                f"cluster.max_nodes ({self.max_nodes}) must be >= cluster.nodes ({self.nodes}), the nodes "
                "the job starts with"
            )
        check(
            self,
            "gpus_per_node",
            as_int,
            minimum=1,
            maximum=MAX_GPUS_PER_NODE,
            why="the most GPUs one machine or NVLink domain has, with room to spare",
        )
        if isinstance(self.device, str) and self.device in DEVICES and self.device != "cpu":  # before the split
            raise ConfigError(
                f"cluster.device: {self.device!r} is an accelerator kind, which is now cluster.accelerator (what the "
                f"cost model assumes); cluster.device says what runs: 'cpu' or 'cuda'. Write "
                f"`device: cuda` and `accelerator: {self.device}`"
            )
        check(self, "device", as_choice, RUN_DEVICES)
        if self.accelerator is None:
            if self.device == "cuda":
                raise ConfigError(
                    "cluster.accelerator: required with cluster.device 'cuda' (the cost model's GPU); "
                    f"one of {', '.join(repr(d) for d in DEVICES)}"
                )
            self.accelerator = "cpu"
        check(self, "accelerator", as_choice, tuple(DEVICES))
        if self.device_memory is None:
            self.device_memory = DEVICES[self.accelerator].memory_bytes
        check(self, "device_memory", as_size)
        check_optional(self, "compute_efficiency", as_float, minimum=0.0)
        if self.compute_efficiency is not None and not 0 < self.compute_efficiency <= 1:
            raise ConfigError(f"cluster.compute_efficiency: must be in (0, 1], got {self.compute_efficiency}")
        check(self, "max_gpus_per_stage", as_int, minimum=1)
        if self.max_gpus_per_stage not in (1, 2, 4, 8):
            raise ConfigError(f"cluster.max_gpus_per_stage: must be 1, 2, 4 or 8, got {self.max_gpus_per_stage}")
        if self.context_parallel != "auto":
            try:
                check(self, "context_parallel", as_int, minimum=1)
            except ConfigError:
                raise ConfigError(
                    f"cluster.context_parallel: must be 1, 2, 4, 8 or auto, got {self.context_parallel!r}"
                ) from None
            if self.context_parallel not in (1, 2, 4, 8):
                raise ConfigError(f"cluster.context_parallel: must be 1, 2, 4, 8 or auto, got {self.context_parallel}")
        check(self, "intra_node_bandwidth", as_bandwidth)
        check(self, "inter_node_bandwidth", as_bandwidth)
        check(self, "backend", as_choice, ("auto", "gloo", "nccl"))

    def _check_emulation(self) -> None:
        if self.emulate is None:
            check_optional(self, "emulate_shrink", as_int, minimum=1)
            check_optional(self, "emulate_coarsen", as_int, minimum=1)
            return
        emulable = tuple(d for d in DEVICES if d != "cpu")
        check(self, "emulate", as_choice, emulable)
        if self.device != "cpu":
            raise ConfigError(
                f"cluster.emulate: emulated accelerators run on CPU workers, cluster.device is "
                f"{self.device!r}; set device: cpu (or remove emulate to run on the real GPUs)"
            )
        if self.backend == "nccl":
            raise ConfigError("cluster.backend: 'nccl' cannot run emulated (CPU workers); use auto or gloo")
        self.accelerator = self.emulate
        check_optional(self, "emulate_shrink", as_int, minimum=1)
        check_optional(self, "emulate_coarsen", as_int, minimum=1, maximum=64, why="a patch 64 times wider")
        check_optional(self, "emulate_profile", as_str)
        if self.emulate_profile is not None:
            self.emulate_profile = os.path.abspath(os.path.expanduser(self.emulate_profile))

    @property
    def resolved_backend(self) -> str:
        if self.backend != "auto":
            return self.backend
        return "nccl" if self.device == "cuda" else "gloo"


@dataclass(kw_only=True, slots=True)
class PlanningConfig:
    _PATH: ClassVar[str] = "planning"
    profile: str = "analytical"
    """Layer costs from the ``analytical`` model or ``measured`` by running the layers."""
    solver: str = "highs"
    """Batch-distribution solver: ``highs`` (exact MILP of the predicted iteration time, default),
    ``mindtpy`` (the seed's eq. 2.6 MINLP via MindtPy; needs scripts/install_minlp.sh) or
    ``python`` (the same exact min-max optimum without Pyomo)."""
    profile_cache_dir: str = "~/.cache/oobleck_mm/profiles"
    """Where measured profiles are cached (``~`` is expanded)."""
    microbatches_hint: int | None = None
    """Microbatches per pipeline the templates are optimised for; default: derived from the batch."""
    replan_gain: float | None = 0.02
    """On reconfiguration, lay the live nodes out afresh (more layer states to copy) when that is
    predicted this much faster than the seed's incremental steps; ``null``: never."""
    placement: str = "chain"
    """Where a multimodal model's encoders run: ``chain`` (in the layer list's order, vision -> audio -> LLM,
    a stage may hold both) or ``auto``: per node count, each encoder on stages of its own, concurrently,
    feeding the LLM's first stage (Cornstarch's modality parallelism, docs/planning.md "Encoder placement")
    wherever the exact 1F1B time says it is faster, else the chain."""

    def __post_init__(self) -> None:
        check_optional(self, "replan_gain", as_float, minimum=0.0)
        check(self, "placement", as_choice, ("chain", "auto"))
        check(self, "profile", as_choice, ("analytical", "measured"))
        check(self, "solver", as_choice, ("highs", "mindtpy", "python"))
        check(self, "profile_cache_dir", as_str)
        self.profile_cache_dir = os.path.expanduser(self.profile_cache_dir)
        check_optional(self, "microbatches_hint", as_int, minimum=1)


@dataclass(kw_only=True, slots=True)
class BalanceConfig:
    _PATH: ClassVar[str] = "balance"
    enabled: bool = False
    """Assign each global batch's samples to pipelines and microbatches by predicted cost;
    false keeps the contiguous split (fixed-size microbatches in sampler order)."""
    algorithm: str = "ours"
    """One of ``oobleck_mm.balance.balancer.ALGORITHMS``: ours, ours_fast, random, orchmllm_lpt,
    orchmllm_padded, orchmllm_quadratic, mmscale."""
    threshold: float = 0.02
    """Keep the contiguous split when its predicted max/mean pipeline time is within 1 + threshold."""
    fixed_s_per_layer: float = 0.0
    """First guess of a layer's fixed seconds per microbatch, before the online fit."""
    fit_every: int = 10
    """Steps between refits of the cost model from measured stage times (0: never refit)."""
    fit_window: int = 512
    """Most recent stage timings a fit uses."""
    ridge: float = 1.0e-4
    """Pull of a fit toward the previous coefficients."""
    deferral: bool = False
    """Inside each pipeline, Entrain's pairwise deferral (``balance/deferral.py``): the LLM stages run
    microbatches of equal LLM work by deferring some samples' LLM work to the next microbatch, kept only
    when the exact 1F1B model predicts the pipeline faster. Needs a model with an encoder."""

    def __post_init__(self) -> None:
        check(self, "enabled", as_bool)
        check(self, "deferral", as_bool)
        check(
            self,
            "algorithm",
            as_choice,
            ("ours", "ours_fast", "random", "orchmllm_lpt", "orchmllm_padded", "orchmllm_quadratic", "mmscale"),
        )
        check(self, "threshold", as_float, minimum=0.0)
        check(self, "fixed_s_per_layer", as_float, minimum=0.0)
        check(self, "fit_every", as_int, minimum=0)
        check(self, "fit_window", as_int, minimum=1)
        check(self, "ridge", as_float, minimum=0.0)
