"""The grid systems of the simulator: Varuna (checkpoint-restart onto a re-sized D x P grid) and Bamboo
(redundant computation; a grid that shrinks only by whole pipelines). Same analytical model and interface as
``oobleck_mm.simulator.systems``' Oobleck and restart systems: only their policies differ.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from oobleck_mm.errors import UserError
from oobleck_mm.planning.costs import ClusterSpec
from oobleck_mm.planning.stage_mapping import planning_cluster, ModelProfile
from oobleck_mm.planning.plan import gradient_allreduce_s
from oobleck_mm.planning.stage_mapping import build_templates
from oobleck_mm.planning.template import PipelineTemplate
from oobleck_mm.simulator.params import SimParams
from oobleck_mm.simulator.stragglers import grid_iteration_s
from oobleck_mm.simulator.timeline import Down, Layout, Response


from oobleck_mm.simulator.systems import (
    _detection_phase,
    _Timed,
    checkpoint_io_s,
    largest_stage_bytes,
    node_order,
)


@dataclasses.dataclass(frozen=True, slots=True)
class Grid:
    template: PipelineTemplate
    replicas: int
    nodes: tuple[tuple[str, ...], ...]
    """Node names of each pipeline, in stage order."""
    iteration_s: float


class _GridPlanner:
    """The best single pipeline depth replicated D times on N nodes (Varuna's and Bamboo's layout),
    from this repository's templates built for f = 0 on the system's own profile."""

    def __init__(self, job, profile: ModelProfile, cluster: ClusterSpec, max_nodes: int):
        self.job, self.profile, self.cluster = job, profile, cluster
        t = job.training
        self.total_microbatches = t.global_batch // profile.microbatch_size
        self.templates = build_templates(
            profile, cluster, max_nodes, 0, total_microbatches=self.total_microbatches
        ).templates

    def best(self, live: Sequence[str]) -> Grid | None:
        nodes = node_order(live)
        best: Grid | None = None
        for template in self.templates:
            d = len(nodes) // template.num_nodes
            if d < 1:
                continue
            d = min(d, self.total_microbatches)
            per_pipeline = -(-self.total_microbatches // d)
            seconds = template.iteration_time(per_pipeline) + gradient_allreduce_s([template] * d, self.cluster)
            if best is None or seconds < best.iteration_s - 1e-12:
                n = template.num_nodes
                groups = tuple(tuple(nodes[i * n : (i + 1) * n]) for i in range(d))
                best = Grid(template, d, groups, seconds)
        return best


def _grid_layout(
    grid: Grid, global_batch: int, per_pipeline: int = 0, speeds: dict[str, float] | None = None
) -> Layout:
    """The grid at the nodes' speeds (``speeds``; none: full speed): every pipeline waits for the slowest."""
    used = frozenset(n for group in grid.nodes for n in group)
    seconds = grid.iteration_s
    if speeds and used & set(speeds):
        seconds = grid_iteration_s(grid.template, grid.nodes, per_pipeline, grid.iteration_s, speeds)
    label = f"{grid.replicas} x {grid.template.num_nodes}-stage pipelines, {grid.iteration_s:.2f} s/iteration"
    return Layout(seconds, global_batch, used, label, grid)


class VarunaSystem:
    name = "varuna"
    recovers_from_checkpoint = True
    joins_at_boundary = True

    def __init__(self, job, profile: ModelProfile, params: SimParams, max_nodes: int):
        self.job, self.profile, self.params = job, profile, params
        self.saves_on_signal = params.varuna_saves_on_signal
        self.cluster = planning_cluster(job, profile)
        self.timed = _Timed(params)
        self.note = ""
        self.grid: Grid | None = None
        self.speeds: dict[str, float] = {}
        """node -> how many times slower (absent: full speed)."""
        self.planner: _GridPlanner | None = None
        try:
            if profile is not None:  # None: no microbatch fits (Bamboo out of memory)
                self.planner, _ = self.timed(_GridPlanner, job, profile, self.cluster, max_nodes)
        except UserError as exc:
            self.note = f"cannot run: {exc}"
        free = params.varuna_no_checkpoint_cost
        self.checkpoint_every = 2 if free else params.varuna_checkpoint_every
        self.checkpoint_save_s = 0.0
        self.load_s = 0.0
        if free:
            self.name = "varuna-no-ckpt"

    def _plan(self, live: Sequence[str]) -> tuple[Grid | None, float]:
        if self.planner is None:
            return None, 0.0
        grid, seconds = self.timed(self.planner.best, live)
        if grid is not None:
            stage = largest_stage_bytes(self.profile, [grid.template])
            save = checkpoint_io_s(self.profile, stage, self.cluster, self.params.storage_write_bandwidth)
            self.checkpoint_save_s = 0.0 if self.params.varuna_no_checkpoint_cost else save
            self.load_s = checkpoint_io_s(self.profile, stage, self.cluster, self.params.storage_read_bandwidth)
        return grid, seconds

    def _down(self, live: Sequence[str]) -> Down:
        return Down(self.note or f"no pipeline fits {len(live)} nodes")

    def _layout_of(self, grid: Grid) -> Layout:
        per = -(-self.planner.total_microbatches // grid.replicas) if self.planner is not None else 0
        return _grid_layout(grid, self.job.training.global_batch, per, self.speeds)

    def start(self, live: list[str]) -> Response:
        self.grid, _ = self._plan(live)
        return Response(self._layout_of(self.grid) if self.grid else self._down(live))

    def speeds_changed(self, now: float, live: list[str], slowed: dict[str, float]) -> Response | None:
        """No straggler policy: the grid runs at its slowest node's pace."""
        for node, factor in slowed.items():
            if factor == 1.0:
                self.speeds.pop(node, None)
            else:
                self.speeds[node] = factor
        return Response(self._layout_of(self.grid)) if self.grid is not None else None

    def on_timer(self, now: float, live: list[str]) -> Response | None:
        return None

    def change(self, live: list[str], lost: list[str], joined: list[str], noticed: bool, now: float = 0.0) -> Response:
        detect = _detection_phase(self.params, self.job, lost, noticed)
        old = self.grid
        grid, seconds = self._plan(live)
        if grid is None:
            self.grid = None
            return Response(self._down(live), detect, rollback=bool(lost))
        if not lost and old is not None and (grid.template, grid.replicas) == (old.template, old.replicas):
            return Response(self._layout_of(old))  # the join changes nothing
        self.grid = grid
        restart = self.params.worker_start_s + seconds + self.params.rendezvous_s + self.load_s
        layout = self._layout_of(grid)
        if lost:
            return Response(layout, detect + (("restart", restart),), rollback=True)
        # A join: morph at the iteration boundary; save first so no work is lost.
        return Response(layout, (("checkpoint_save", self.checkpoint_save_s), ("restart", restart)), commit=True)


def bamboo_profile(job, params: SimParams, max_nodes: int) -> tuple[ModelProfile | None, str]:
    """Bamboo's costs: no activation checkpointing, the largest microbatch (power of two up to the
    config's) whose doubled model state and activations fit (each stage keeps its successor's
    forward for a fast failover), every pass ``bamboo_rc_slowdown`` times longer.
    None and the reason when even a microbatch of 1 does not fit (OOM)."""
    from oobleck_mm.profiling.analytical import profile_from_config

    cluster = ClusterSpec.from_config(job.cluster)
    t = job.training
    sizes = [params.bamboo_microbatch] if params.bamboo_microbatch else _powers_of_two_down(t.microbatch_size)
    for size in sizes:
        if t.global_batch % size:
            continue
        training = dataclasses.replace(t, microbatch_size=size, activation_checkpointing=False)
        base = profile_from_config(dataclasses.replace(job, training=training))
        factor, slow = params.bamboo_memory_factor, params.bamboo_rc_slowdown
        layers = tuple(
            dataclasses.replace(
                layer,
                forward_s=layer.forward_s * slow,
                backward_weight_s=layer.backward_weight_s * slow,
                backward_input_s=layer.backward_input_s * slow,
                param_bytes=math.ceil(layer.param_bytes * factor),
                grad_bytes=math.ceil(layer.grad_bytes * factor),
                optimizer_bytes=math.ceil(layer.optimizer_bytes * factor),
                activation_bytes=math.ceil(layer.activation_bytes * factor),
            )
            for layer in base.layers
        )
        profile = dataclasses.replace(base, layers=layers)
        try:
            build_templates(profile, cluster, max_nodes, 0, total_microbatches=t.global_batch // size)
        except UserError:
            continue
        return profile, f"microbatch {size}"
    return None, (
        f"OOM: model state and activations x{params.bamboo_memory_factor:g}, without activation checkpointing, "
        f"fit no pipeline of up to {max_nodes} nodes even at microbatch 1"
    )


def _powers_of_two_down(limit: int) -> list[int]:
    out, size = [], 1
    while size <= limit:
        out.append(size)
        size *= 2
    return out[::-1]


class BambooSystem(VarunaSystem):
    name = "bamboo"
    recovers_from_checkpoint = False
    saves_on_signal = False

    def __init__(self, job, profile: ModelProfile | None, params: SimParams, max_nodes: int, note: str):
        super().__init__(job, profile, params, max_nodes)
        self.name = BambooSystem.name  # never Varuna's no-checkpoint variant
        self.saves_on_signal = False
        self.checkpoint_every, self.checkpoint_save_s = 0, 0.0
        self.note = f"{note}; {self.note}" if self.note else note

    def change(self, live: list[str], lost: list[str], joined: list[str], noticed: bool, now: float = 0.0) -> Response:
        detect = _detection_phase(self.params, self.job, lost, noticed)
        old = self.grid
        adjacent = old is not None and _adjacent_lost(old, set(lost))
        grid, seconds = self._plan(live)
        self.grid = grid
        if grid is None:
            return Response(self._down(live), detect)
        layout = self._layout_of(grid)
        if adjacent:
            # A stage and its backup lost together: Bamboo restarts from a checkpoint. Its
            # checkpoint frequency is not modelled: the benefit of the doubt, no work rolled back.
            restart = self.params.worker_start_s + seconds + self.params.rendezvous_s + self.load_s
            return Response(layout, detect + (("restart", restart),))
        stage = largest_stage_bytes(self.profile, [grid.template]) / self.params.bamboo_memory_factor
        copy = self.cluster.transfer_s(stage, cross_node=True)
        return Response(
            layout, detect + (("reconfiguration", seconds + self.params.rendezvous_s), ("state_copy", copy))
        )


def _adjacent_lost(grid: Grid, lost: set[str]) -> bool:
    for group in grid.nodes:
        for a, b in zip(group, group[1:]):
            if a in lost and b in lost:
                return True
    return False
