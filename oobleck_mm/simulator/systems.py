"""The four systems a simulation compares, each a ``timeline.SystemModel`` over the engine's planner.

- ``oobleck``: this engine in live mode. Start: ``planner.plan_fresh``; every
  change: ``planner.plan_reconfiguration`` (templates reused, §2.5), whose layer
  copies come from ``transfers.plan_transfers``, the rule the workers run. More
  losses than the replicas cover (``CannotKeepReplicas``) end the run; live mode
  has no checkpoint today (issue 13), so the restart (at once when the live nodes
  can hold a plan, else when enough come back) begins from scratch.
- ``restart``: this engine's ``--recovery restart``: a checkpoint every k steps
  (synchronous), every loss restarts every worker from it on a fresh plan; joined
  nodes wait for the next restart.
- ``varuna`` (Athlur et al., EuroSys '22): one pipeline depth for all replicas (a
  P x D grid, the rest of the nodes idle), a synchronous checkpoint every 10
  iterations, and a full restart ("job morphing": re-plan, reload the checkpoint)
  on every change, joins included.
- ``bamboo`` (Thorpe et al., NSDI '23): redundant computation: every stage also
  holds its successor's model state (x2 memory, no activation checkpointing, so
  a smaller microbatch or OOM) and computes its forward, at a slowdown the
  dissertation measured (``SimParams.bamboo_rc_slowdown``); a loss fails over to
  the backup (lose the iteration in flight, re-form, copy a stage); two adjacent
  stages lost together force a full restart.

The first two are here; ``varuna`` and ``bamboo`` are in ``oobleck_mm.simulator.grid_systems``.
Varuna's and Bamboo's grids are chosen with this repository's planner too
(``stage_mapping.build_templates`` for f = 0, then the best P x D), on costs
from the same analytical model: only their policies differ, not their cost
arithmetic.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from typing import Any

from oobleck_mm.errors import UserError
from oobleck_mm.faults.spec import node_number
from oobleck_mm.planning.costs import ClusterSpec
from oobleck_mm.planning.stage_mapping import planning_cluster, ModelProfile
from oobleck_mm.planning.plan import Plan
from oobleck_mm.planning.planner import Planned, plan_fresh, plan_reconfiguration, plan_without_stragglers
from oobleck_mm.planning.speed import speed_aware_plan
from oobleck_mm.planning.stage_mapping import recut_for_speeds
from oobleck_mm.planning.template import PipelineTemplate, TemplateSet
from oobleck_mm.planning.transfers import plan_transfers
from oobleck_mm.simulator.params import SimParams
from oobleck_mm.simulator.stragglers import StragglerState, slowed_iteration_s
from oobleck_mm.simulator.timeline import Down, Layout, Response


def node_order(nodes: Sequence[str]) -> list[str]:
    return sorted(nodes, key=lambda n: (node_number(n), n))


def checkpoint_bytes(profile: ModelProfile) -> int:
    """What a checkpoint holds: every layer's parameters and optimizer state (no gradients)."""
    return sum(layer.param_bytes + layer.optimizer_bytes for layer in profile.layers)


def checkpoint_io_s(profile: ModelProfile, stage_bytes: float, cluster: ClusterSpec, bandwidth: float) -> float:
    """Seconds to save (or load) one replica's state: the store's bandwidth, or the busiest
    stage's link when one stage holds more than its share."""
    return max(checkpoint_bytes(profile) / bandwidth, stage_bytes / cluster.inter_node_bandwidth)


def largest_stage_bytes(profile: ModelProfile, templates: Sequence[PipelineTemplate]) -> float:
    out = 0.0
    for template in templates:
        for stage in template.stages:
            out = max(out, sum(profile.layers[i].param_bytes + profile.layers[i].optimizer_bytes for i in stage.layers))
    return out


def copy_seconds(
    old: Plan, new: Plan, live: Sequence[str], profile: ModelProfile, cluster: ClusterSpec
) -> tuple[float, int]:
    """Seconds and bytes of the layer-state copies from ``old`` to ``new``: ``plan_transfers``
    decides who sends what (the workers' rule); each GPU sends and receives at once (full
    duplex), NVLink inside a node, the node's link across nodes; copies run in parallel, so
    the busiest GPU bounds the phase."""
    alive = set(live)
    held = {gpu: layers for p in old.pipelines for gpu, layers in p.layers_on().items() if gpu[0] in alive}
    needed = {gpu: layers for p in new.pipelines for gpu, layers in p.layers_on().items()}
    moves = plan_transfers(held, needed, node_of=lambda gpu: gpu[0])
    traffic: dict[tuple[Any, bool], list[float]] = defaultdict(lambda: [0.0, 0.0])
    total = 0
    for move in moves:
        size = profile.layers[move.layer].state_bytes
        cross = move.src[0] != move.dst[0]
        traffic[(move.src, cross)][0] += size
        traffic[(move.dst, cross)][1] += size
        total += size
    per_gpu: dict[Any, float] = defaultdict(float)
    for (gpu, cross), (sent, received) in traffic.items():
        per_gpu[gpu] += cluster.transfer_s(max(sent, received), cross)
    return max(per_gpu.values(), default=0.0), total


class _Timed:
    """Planner calls timed on this machine (``SimParams.planning_s`` None), or a fixed figure."""

    def __init__(self, params: SimParams):
        self.fixed = params.planning_s

    def __call__(self, fn: Callable[..., Any], *args: Any) -> tuple[Any, float]:
        start = time.perf_counter()
        out = fn(*args)
        elapsed = time.perf_counter() - start
        return out, (self.fixed if self.fixed is not None else elapsed)


def _detection_phase(params: SimParams, job, lost: Sequence[str], noticed: bool) -> tuple[tuple[str, float], ...]:
    """The detection phase a loss costs: none for a join or a noticed removal (the notice names the
    node), else ``detection_s`` or the config's heartbeat timeout."""
    if not lost or noticed:
        return ()
    seconds = params.detection_s
    return (("detection", job.fault_tolerance.heartbeat_timeout.total_seconds() if seconds is None else seconds),)


def _plan_label(plan: Plan) -> str:
    sizes = Counter(p.template.num_nodes for p in plan.pipelines)
    shape = " + ".join(f"{count}x{n}" if count > 1 else f"{n}" for n, count in sorted(sizes.items(), reverse=True))
    return f"{plan.num_pipelines} pipelines ({shape} nodes), {plan.iteration_time_s:.2f} s/iteration"


# --------------------------------------------------------------------------- oobleck (live)


class OobleckSystem:
    name = "oobleck"
    checkpoint_every = 0
    checkpoint_save_s = 0.0
    recovers_from_checkpoint = False
    joins_at_boundary = True
    saves_on_signal = False
    acts_on_stragglers = True
    """Live mode re-splits for a straggler and may bench it (``simulator.stragglers``); restart mode waits."""

    def __init__(
        self,
        job,
        profile: ModelProfile,
        params: SimParams,
        iteration_of: Callable[[Plan], float] | None = None,
        skew_samples=None,
    ):
        self.job, self.profile, self.params = job, profile, params
        self.iteration_of = iteration_of
        """Measured seconds per iteration of a plan (a calibrated cluster); None: the planner's prediction."""
        self.skew = None
        """Prices plans on skewed batches (``params.skew_batches``); None: mean samples."""
        if params.skew_batches > 0:
            from oobleck_mm.simulator.skew import SkewPricer, mode_of

            if not skew_samples:
                raise UserError(
                    "skew_batches > 0 needs the sampled batches (oobleck_mm.data.skew_samples.sampled_batches; "
                    "`oobleck-launch simulate` samples them)"
                )
            self.skew, self.skew_mode = SkewPricer(job, profile, skew_samples), mode_of(job.balance)
        self.cluster = planning_cluster(job, profile)
        self.timed = _Timed(params)
        self.plan: Plan | None = None
        self.templates: TemplateSet | None = None
        self.template_nodes = 0
        self.note = ""
        self.planner_calls = 0
        self.st = StragglerState(job.fault_tolerance, params.straggler_mitigation and self.acts_on_stragglers)

    def _layout(self, planned: Planned) -> Layout:
        return self._layout_of(planned.plan)

    def _layout_of(self, plan: Plan) -> Layout:
        """``plan`` at the nodes' true speeds: a slow node's pipeline is slower, and every one waits for it."""
        nominal = plan.iteration_time_s if self.iteration_of is None else self.iteration_of(plan)
        if self.skew is not None and self.iteration_of is None:
            # The 1F1B part slows with the batch's skew (as the balancer's mode leaves it); the all-reduce does not.
            nominal = (nominal - plan.allreduce_s) * self.skew.factor(plan, self.skew_mode) + plan.allreduce_s
        seconds = slowed_iteration_s(plan, nominal, self.st.speeds)
        return Layout(seconds, plan.global_batch, frozenset(plan.nodes), _plan_label(plan), plan)

    def _split(self, plan: Plan, again: bool = False) -> Plan:
        """``plan``'s batch split for the stragglers the job knows of (the master's ``split_for_speeds``); with
        none among its nodes, the planner's split as it is, unless ``again`` (a straggler cleared: the split
        for the templates' own speeds)."""
        known = {n: f for n, f in self.st.known.items() if n in set(plan.nodes)}
        if not self.st.enabled or not (known or again):
            return plan
        recut = None
        if self.job.fault_tolerance.straggler_recut:  # as the master's planner does (``split_for_speeds``)
            recut = lambda t, factors, m: recut_for_speeds(self.profile, self.cluster, t, factors, m)  # noqa: E731
        restore = self.templates.for_nodes if self.templates is not None else None
        return speed_aware_plan(plan, known, self.job.planning.solver, recut, restore)[0]

    def _fresh(self, live: list[str]) -> tuple[Any, float]:
        self.planner_calls += 1
        (outcome, templates), seconds = self.timed(plan_fresh, self.job, self.profile, node_order(live))
        if isinstance(outcome, Planned):
            self.plan, self.templates, self.template_nodes = self._split(outcome.plan), templates, len(live)
            outcome = dataclasses.replace(outcome, plan=self.plan)
        return outcome, seconds

    # ------------------------------------------------------------------ stragglers (simulator.stragglers)
    def speeds_changed(self, now: float, live: list[str], slowed: dict[str, float]) -> Response | None:
        self.st.set_speeds(slowed)
        if self.plan is None:
            return None
        layout = self._layout_of(self.plan)
        return Response(layout, timers=tuple(self.st.watch(now, self.plan.nodes, layout.iteration_s)))

    def on_timer(self, now: float, live: list[str]) -> Response | None:
        """Straggler verdicts due, weighings due, benches ended: what the master would do at this time."""
        if self.plan is None or not self.st.enabled:
            return None
        st, pause, timers = self.st, [], []
        back = st.returning(now, live, self.plan.nodes)
        if back:  # like a join: its fresh workers have been ready since the bench began
            self.planner_calls += 1
            (outcome, templates), seconds = self.timed(
                plan_reconfiguration, self.job, self.profile, self.templates, self.template_nodes, self.plan, [], back
            )
            if isinstance(outcome, Planned):
                pause += self._replace(outcome.plan, templates, live, seconds)
        if st.detect(now, self.plan.nodes):  # found, changed or cleared: the batch split again
            old = self.plan
            self.plan = self._split(self.plan, again=True)
            pause.append(("reconfiguration", self.params.rendezvous_s))
            if [p.template for p in old.pipelines] != [p.template for p in self.plan.pipelines]:
                # A pipeline re-cut for its speeds (or back): the layer states its stages gained move.
                pause.append(("state_copy", copy_seconds(old, self.plan, live, self.profile, self.cluster)[0]))
        for node in st.to_weigh(now, self.plan.nodes):
            st.weighed.add(node)
            known = {n: f for n, f in st.known.items() if n in set(self.plan.nodes)}
            self.planner_calls += 1
            (chosen, templates), seconds = self.timed(
                plan_without_stragglers,
                self.job,
                self.profile,
                self.templates,
                self.template_nodes,
                self.plan,
                known,
                [node],
            )
            if chosen.benched:
                timers.append(st.bench(now, node))
                pause += self._replace(chosen.plan, templates, live, seconds)
            else:
                st.actions.append((now, node, "kept"))
        layout = self._layout_of(self.plan)
        timers += st.watch(now, self.plan.nodes, layout.iteration_s)
        if (delay := st.next_weigh(now)) is not None:
            timers.append(delay)
        return Response(layout, tuple(pause), timers=tuple(timers), at_boundary=True)

    def _replace(self, plan: Plan, templates, live: list[str], seconds: float) -> list[tuple[str, float]]:
        """The job moves to ``plan`` (split for the known speeds) at a boundary: planning, a rendezvous and
        the layer copies it needs."""
        if templates is not None:
            self.templates, self.template_nodes = templates, len(plan.nodes)
        new = self._split(plan)
        copy_s, _ = copy_seconds(self.plan, new, live, self.profile, self.cluster)
        self.plan = new
        return [("reconfiguration", seconds + self.params.rendezvous_s), ("state_copy", copy_s)]

    def start(self, live: list[str]) -> Response:
        outcome, _ = self._fresh(live)
        if isinstance(outcome, Planned):
            return Response(self._layout(outcome))
        self.plan = None
        return Response(Down(_reason(outcome)))

    def change(self, live: list[str], lost: list[str], joined: list[str], noticed: bool, now: float = 0.0) -> Response:
        self.st.forget(lost)
        live = [n for n in live if n not in self.st.out(now)]  # benched: not planned until the bench ends
        response = self._change(live, lost, joined, noticed)
        if isinstance(response.next, Layout) and self.plan is not None:
            timers = self.st.watch(now, self.plan.nodes, response.next.iteration_s)
            response = dataclasses.replace(response, timers=response.timers + tuple(timers))
        return response

    def _change(self, live: list[str], lost: list[str], joined: list[str], noticed: bool) -> Response:
        detect = _detection_phase(self.params, self.job, lost, noticed)
        stall = self.params.worker_start_s if joined and self.params.joiner_start_stalls else 0.0
        if self.plan is None:
            # The run ended (no replica of some layer, or too few nodes); live mode keeps no
            # checkpoint, so a new start trains from step 0.
            outcome, seconds = self._fresh(live)
            if not isinstance(outcome, Planned):
                return Response(Down(_reason(outcome)), detect)
            start = self.params.worker_start_s + seconds + self.params.rendezvous_s
            return Response(
                self._layout(outcome),
                detect + (("restart", start),),
                restart_from_scratch=True,
                note="started again from scratch",
            )
        old = self.plan
        self.planner_calls += 1
        (outcome, templates), seconds = self.timed(
            plan_reconfiguration,
            self.job,
            self.profile,
            self.templates,
            self.template_nodes,
            old,
            node_order(lost),
            node_order(joined),
        )
        if not isinstance(outcome, Planned):
            # The run ends (exit 3). With no checkpoint in live mode, the best a supervisor can
            # do is start it again at once, from scratch, when the live nodes can hold a plan.
            self.plan = None
            lost_run = self._change(live, [], [], True)
            if isinstance(lost_run.next, Layout):
                return dataclasses.replace(lost_run, pause=detect + lost_run.pause)
            return Response(Down(_reason(outcome)), detect, note="run lost")
        if templates is not None:
            self.templates, self.template_nodes = templates, len(live)
        self.plan = self._split(outcome.plan)
        copy_s, _ = copy_seconds(old, self.plan, live, self.profile, self.cluster)
        pause = detect + (("reconfiguration", seconds + self.params.rendezvous_s + stall), ("state_copy", copy_s))
        return Response(self._layout_of(self.plan), pause)


def _reason(outcome: Any) -> str:
    return getattr(outcome, "reason", None) or getattr(outcome, "message", None) or str(outcome)


# --------------------------------------------------------------------------- restart mode


class RestartSystem(OobleckSystem):
    name = "restart"
    recovers_from_checkpoint = True
    joins_at_boundary = False
    acts_on_stragglers = False

    def __init__(
        self,
        job,
        profile: ModelProfile,
        params: SimParams,
        iteration_of: Callable[[Plan], float] | None = None,
        skew_samples=None,
    ):
        super().__init__(job, profile, params, iteration_of, skew_samples)
        every = (
            params.restart_checkpoint_every or job.fault_tolerance.checkpoint_interval or params.varuna_checkpoint_every
        )
        self.checkpoint_every = every
        self.save_s = 0.0
        self.load_s = 0.0

    def start(self, live: list[str]) -> Response:
        response = super().start(live)
        self._io()
        return response

    def _io(self) -> None:
        if self.plan is not None:
            stage = largest_stage_bytes(self.profile, [p.template for p in self.plan.pipelines])
            self.checkpoint_save_s = checkpoint_io_s(
                self.profile, stage, self.cluster, self.params.storage_write_bandwidth
            )
            self.load_s = checkpoint_io_s(self.profile, stage, self.cluster, self.params.storage_read_bandwidth)

    def change(self, live: list[str], lost: list[str], joined: list[str], noticed: bool, now: float = 0.0) -> Response:
        self.st.forget(lost)
        detect = _detection_phase(self.params, self.job, lost, noticed)
        outcome, seconds = self._fresh(live)
        if not isinstance(outcome, Planned):
            self.plan = None
            return Response(Down(_reason(outcome)), detect, rollback=True)
        self._io()
        restart = self.params.worker_start_s + seconds + self.params.rendezvous_s + self.load_s
        return Response(self._layout(outcome), detect + (("restart", restart),), rollback=True)


# --------------------------------------------------------------------------- P x D grids (Varuna, Bamboo)
