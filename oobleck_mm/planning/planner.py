"""The planning pipeline in one call: templates -> plan -> reconfiguration, and its typed outcomes.

``plan_job`` is what ``oobleck-launch plan`` prints. ``plan_fresh`` and
``plan_reconfiguration`` are what the master's planning helper runs at start-up
and on every membership change; they answer with one of three dataclasses,
never an exception for a request no plan can meet:

- ``Planned``: the plan, its execution layout and the rank of every GPU;
- ``CannotKeepReplicas`` (from ``reconfigure``): fewer live nodes than f + 1
  replicas need, or a layer lost every replica;
- ``Failed``: a ``UserError`` the user must fix (the model fits no device...).

Anything else raised here is a bug and propagates. The per-layer costs come in
as an argument (``profiling.load.load_profile``): planning stays pure. This
module only wires the pure steps together and times them; every decision lives
in the step's own module.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from oobleck_mm.errors import UserError
from oobleck_mm.planning.costs import ModelProfile
from oobleck_mm.planning.branches import with_branches
from oobleck_mm.planning.errors import TooFewNodes
from oobleck_mm.planning.instantiate import instantiate
from oobleck_mm.planning.layout import ExecutionPlan, Gpu, rank_table
from oobleck_mm.planning.plan import Plan
from oobleck_mm.planning.reconfigure import CannotKeepReplicas, Reconfiguration, reconfigure
from oobleck_mm.planning.speed import predicted_samples_per_s, speed_aware_plan, with_own_templates
from oobleck_mm.planning.report import format_plan, format_templates, plan_to_dict, template_to_dict
from oobleck_mm.planning.stage_mapping import build_templates, planning_cluster, recut_for_speeds
from oobleck_mm.planning.template import TemplateSet


@dataclass
class PlanningResult:
    job_name: str
    profile: ModelProfile
    template_set: TemplateSet
    plan: Plan
    fault_tolerance: int
    microbatches_hint: int
    lost: list[str] = field(default_factory=list)
    joined: list[str] = field(default_factory=list)
    reconfiguration: Reconfiguration | CannotKeepReplicas | None = None
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def layer_names(self) -> list[str]:
        return [layer.name for layer in self.profile.layers]

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "job": self.job_name,
            "profile": {
                "source": self.profile.source,
                "device": self.profile.device,
                "microbatch_size": self.profile.microbatch_size,
                "layers": self.layer_names,
            },
            "fault_tolerance": self.fault_tolerance,
            "min_nodes": self.template_set.min_nodes,
            "templates": [template_to_dict(t, self.microbatches_hint) for t in self.template_set.templates],
            "plan": plan_to_dict(self.plan),
            "seconds": self.seconds,
        }
        if self.reconfiguration is not None:
            out["reconfiguration"] = _reconfiguration_to_dict(self)
        return out

    def format(self) -> str:
        parts = [
            f"job {self.job_name}: {len(self.layer_names)} layers, {self.profile.source} costs on "
            f"{self.profile.device}, f = {self.fault_tolerance}",
            format_templates(self.template_set, self.layer_names, self.microbatches_hint),
            format_plan(self.plan, self.layer_names, "plan"),
        ]
        rec = self.reconfiguration
        if isinstance(rec, Reconfiguration):
            what = ", ".join(
                filter(
                    None,
                    [
                        f"lost {', '.join(self.lost)}" if self.lost else "",
                        f"joined {', '.join(self.joined)}" if self.joined else "",
                    ],
                )
            )
            parts.append(
                f"reconfiguration after {what}: {len(rec.actions)} actions, "
                f"{rec.layer_states_moved} layer states to copy\n"
                + "\n".join(f"  - {a}" for a in rec.actions)
                + "\n"
                + format_plan(rec.plan, self.layer_names, "new plan")
            )
        elif isinstance(rec, CannotKeepReplicas):
            parts.append(f"reconfiguration: cannot keep f+1 replicas: {rec.reason}")
        timing = ", ".join(f"{k} {v:.3f} s" for k, v in self.seconds.items())
        parts.append(f"planning time: {timing}")
        return "\n\n".join(parts)


def _reconfiguration_to_dict(result: PlanningResult) -> dict[str, Any]:
    rec = result.reconfiguration
    base: dict[str, Any] = {"lost": result.lost, "joined": result.joined}
    if isinstance(rec, CannotKeepReplicas):
        base.update(ok=False, live_nodes=rec.live_nodes, needed=rec.needed, reason=rec.reason)
        return base
    assert isinstance(rec, Reconfiguration)
    base.update(
        ok=True,
        actions=list(rec.actions),
        layer_states_moved=rec.layer_states_moved,
        reason=rec.reason,
        plan=plan_to_dict(rec.plan),
    )
    return base


def plan_job(
    job,
    profile: ModelProfile,
    node_names: Sequence[str],
    lost: Sequence[str] = (),
    joined: Sequence[str] = (),
    solver: str | None = None,
    progress: Callable[[str], None] | None = None,
) -> PlanningResult:
    """Templates for ``len(node_names)`` nodes, the best plan on them and, with ``lost`` or ``joined``,
    its reconfiguration. ``profile``: the job's per-layer costs (``profiling.load.load_profile``).

    Raises ``TooFewNodes`` below ``(f + 1) * n0`` nodes and other ``UserError``s when no
    plan exists (the model fits no device, the batch cannot be split).
    """
    solver = solver or job.planning.solver
    f = job.fault_tolerance.f
    cluster = planning_cluster(job, profile)
    seconds: dict[str, float] = {}
    say = progress or (lambda line: None)
    if job.cluster.context_parallel == "auto":
        say(
            f"cluster.context_parallel: auto chose {cluster.context_parallel}"
            + (" (the model fits without)" if cluster.context_parallel == 1 else "")
        )

    start = time.perf_counter()
    template_set = build_templates(
        profile,
        cluster,
        len(node_names),
        f,
        microbatches_hint=job.planning.microbatches_hint,
        progress=progress,
        total_microbatches=job.training.global_batch // job.training.microbatch_size,
    )
    if cluster.placement == "auto":  # encoders as branches wherever faster (planning.branches)
        template_set = with_branches(
            template_set,
            profile,
            cluster,
            len(node_names),
            job.planning.microbatches_hint,
            job.training.global_batch // job.training.microbatch_size,
        )
        for t in template_set.templates:
            if t.branched:
                say(f"template {t.num_nodes} nodes: encoder branches ({t.describe()})")
    seconds["templates"] = time.perf_counter() - start

    start = time.perf_counter()
    plan = instantiate(
        template_set, node_names, f, job.training.global_batch, job.training.microbatch_size, cluster, solver=solver
    )
    seconds["instantiate"] = time.perf_counter() - start
    say(f"plan: {plan.num_pipelines} pipelines, {plan.samples_per_s:.2f} samples/s predicted")

    hint = job.planning.microbatches_hint or max(p.num_microbatches for p in plan.pipelines)
    result = PlanningResult(
        job_name=job.model.name,
        profile=profile,
        template_set=template_set,
        plan=plan,
        fault_tolerance=f,
        microbatches_hint=hint,
        lost=list(lost),
        joined=list(joined),
        seconds=seconds,
    )
    if lost or joined:
        start = time.perf_counter()
        gain = job.planning.replan_gain
        result.reconfiguration = reconfigure(
            plan, lost, joined, template_set, f, cluster, solver=solver, replan_gain=math.inf if gain is None else gain
        )
        seconds["reconfigure"] = time.perf_counter() - start
    return result


# --------------------------------------------------------------------------- the master's outcomes


@dataclass(frozen=True, slots=True)
class Planned:
    """A plan the workers can run."""

    plan: Plan
    """The planning ``Plan``: the next reconfiguration starts from it."""
    layout: ExecutionPlan
    ranks: dict[Gpu, int]
    """(node, local GPU) -> rank in the new generation."""
    template_nodes: int
    """Node count the templates were built for (the next reconfiguration reuses them)."""
    fresh: bool
    """Instantiated afresh (not by the incremental steps of a reconfiguration)."""
    actions: tuple[str, ...]
    reason: str
    seconds: float
    """Planning time."""
    keeps_replicas_from: int = 0
    """(f + 1) * n0: the fewest nodes that keep f + 1 replicas and the global batch (0: not known)."""
    benched: tuple[str, ...] = ()
    """Slow nodes this plan leaves out because it is predicted faster without them (``weigh_bench``)."""

    @property
    def samples_per_s(self) -> float:
        return self.plan.samples_per_s


@dataclass(frozen=True, slots=True)
class Failed:
    """No plan: the user must change the config (the message names what and how)."""

    message: str


PlanOutcome = Planned | CannotKeepReplicas | Failed


def plan_fresh(job, profile: ModelProfile, names: Sequence[str]) -> tuple[PlanOutcome, TemplateSet | None]:
    """A plan on ``names`` from scratch, with the templates built for ``len(names)`` nodes."""
    start = time.perf_counter()
    try:
        result = plan_job(job, profile, list(names))
        planned = _planned(
            result.plan,
            len(names),
            True,
            (),
            f"instantiated on {len(names)} nodes",
            start,
            _keeps_replicas_from(job, result.template_set),
        )
    except TooFewNodes as exc:
        return CannotKeepReplicas(live_nodes=exc.live_nodes, needed=exc.needed, reason=str(exc)), None
    except UserError as exc:
        return Failed(str(exc)), None
    return planned, result.template_set


def plan_reconfiguration(
    job,
    profile: ModelProfile,
    template_set: TemplateSet,
    template_nodes: int,
    base: Plan,
    lost: Sequence[str],
    joined: Sequence[str],
) -> tuple[PlanOutcome, TemplateSet | None]:
    """The reconfiguration of ``base`` (§2.5) with ``template_set``, built for ``template_nodes`` nodes;
    a fresh plan when the incremental steps cannot place the nodes.

    Joins past the node count the templates were built for (or a batch the new
    pipelines cannot split) leave the incremental steps nothing to place; the live
    nodes are then planned afresh, which the workers adopt just as well: they derive
    the state copies from any pair of plans. The second value holds the new
    templates when that happened.
    """
    start = time.perf_counter()
    gain = job.planning.replan_gain
    base = with_own_templates(base, template_set.for_nodes)  # a pipeline re-cut for a straggler: its template
    try:
        rec = reconfigure(
            base,
            lost,
            joined,
            template_set,
            job.fault_tolerance.f,
            planning_cluster(job, profile),
            solver=job.planning.solver,
            replan_gain=math.inf if gain is None else gain,
        )
    except UserError as exc:
        live = [n for n in base.nodes if n not in set(lost)] + [n for n in joined if n not in base.nodes or n in lost]
        outcome, templates = plan_fresh(job, profile, live)
        if isinstance(outcome, Planned):
            reason = f"incremental reconfiguration impossible ({exc}); {outcome.reason}"
            outcome = dataclasses.replace(outcome, reason=reason)
        return outcome, templates
    if isinstance(rec, CannotKeepReplicas):
        return rec, None
    return _planned(
        rec.plan, template_nodes, False, rec.actions, rec.reason, start, _keeps_replicas_from(job, template_set)
    ), None


def split_for_speeds(
    job,
    outcome: PlanOutcome,
    slow: Mapping[str, float] | None,
    profile: ModelProfile | None = None,
    template_set: TemplateSet | None = None,
) -> PlanOutcome:
    """``outcome``'s plan with its batch re-split for the slow nodes' speeds (``planning.speed``): the same
    pipelines and ranks, fewer microbatches for the pipelines of slow nodes; ``{}``: the split for the
    templates' own speeds (a straggler recovered). ``None``, or anything but a ``Planned``, passes through.
    With the job's ``profile``, a slow node's pipeline may also be re-cut (its stage given fewer layers) where
    that is predicted faster (``speed_aware_plan``); with ``template_set``, a pipeline re-cut before and no longer
    slow gets its template back."""
    if slow is None or not isinstance(outcome, Planned):
        return outcome
    nodes = set(outcome.plan.nodes)
    slow = {n: f for n, f in slow.items() if n in nodes}
    start = time.perf_counter()
    recut = None
    if profile is not None and job.fault_tolerance.straggler_recut:
        cluster = planning_cluster(job, profile)
        recut = lambda template, factors, m: recut_for_speeds(profile, cluster, template, factors, m)  # noqa: E731
    restore = template_set.for_nodes if template_set is not None else None
    plan, split, cut = speed_aware_plan(outcome.plan, slow, job.planning.solver, recut, restore)
    if plan == outcome.plan and not slow:
        return outcome
    described = ", ".join(f"{n} x{f:.2f}" for n, f in sorted(slow.items())) or "every node at its templates' speed"
    reason = f"{outcome.reason}; batch split for the measured speeds ({described}): microbatches {split.microbatches}"
    if cut:
        cuts = "; ".join(
            " | ".join(f"{st.layer_start}-{st.layer_end - 1}" for st in p.template.stages)
            for p in plan.pipelines
            if any(n in slow for n in p.nodes)
        )
        reason += f", the slow nodes' pipelines re-cut for their speeds (layers {cuts})"
    actions = (*outcome.actions, "speed split", *(("speed cut",) if cut else ()))
    return dataclasses.replace(
        _planned(
            plan, outcome.template_nodes, outcome.fresh, actions, reason, start, outcome.keeps_replicas_from, slow
        ),
        seconds=outcome.seconds + time.perf_counter() - start,
    )


BENCH_GAIN = 0.05
"""A straggler is planned out only when the plan without it is predicted this much faster than keeping it
with its pipeline re-split: a near tie is not worth a state copy and a later join."""


def weigh_bench(keep: Planned, without: PlanOutcome, slow: Mapping[str, float], bench: Sequence[str]) -> Planned:
    """Keep the slow nodes ``bench`` (``keep``: the same pipelines, the batch split for their speeds) or plan
    them out (``without``: the survivors' plan, split for the speeds of the slow nodes left), whichever the
    cost model predicts faster by ``BENCH_GAIN``; the reason gives both predictions."""
    names = ", ".join(bench)
    kept = predicted_samples_per_s(keep.plan, slow)
    if not isinstance(without, Planned):
        why = without.message if isinstance(without, Failed) else without.reason
        return dataclasses.replace(keep, reason=f"{keep.reason}; {names} kept: without them, {why}")
    rest = {n: f for n, f in slow.items() if n not in bench}
    alone = predicted_samples_per_s(without.plan, rest)
    compared = (
        f"predicted {alone:.3g} samples/s without {names}, {kept:.3g} with "
        f"{'them' if len(bench) > 1 else 'it'} re-split"
    )
    if alone >= kept * (1 + BENCH_GAIN):
        return dataclasses.replace(
            without,
            benched=tuple(bench),
            actions=("bench", *without.actions),
            reason=f"{names} benched ({compared}): {without.reason}",
        )
    return dataclasses.replace(
        keep, reason=f"{keep.reason}; {names} kept: {compared} (a bench needs {BENCH_GAIN:.0%} more)"
    )


def plan_without_stragglers(
    job,
    profile: ModelProfile,
    template_set: TemplateSet,
    template_nodes: int,
    base: Plan,
    slow: Mapping[str, float],
    bench: Sequence[str],
) -> tuple[Planned, TemplateSet | None]:
    """``base``'s nodes with slow ``bench`` kept (its batch split for ``slow``) or planned out, whichever
    ``weigh_bench`` predicts faster; the second value holds new templates when the plan without them
    needed a fresh plan (as ``plan_reconfiguration``'s). The master's planning helper and the simulator
    both weigh a straggler with it."""
    keep = split_for_speeds(job, plan_as_is(job, template_set, template_nodes, base), dict(slow), profile, template_set)
    without, templates = plan_reconfiguration(job, profile, template_set, template_nodes, base, list(bench), [])
    rest = {n: f for n, f in slow.items() if n not in set(bench)}
    chosen = weigh_bench(
        keep, split_for_speeds(job, without, rest, profile, templates or template_set), slow, list(bench)
    )
    return chosen, templates if chosen.benched else None


def plan_as_is(job, template_set: TemplateSet, template_nodes: int, base: Plan) -> Planned:
    """``base`` again, nodes and pipelines unchanged (a change of the nodes' speeds re-splits it next)."""
    return _planned(
        base,
        template_nodes,
        False,
        (),
        "the same nodes and pipelines",
        time.perf_counter(),
        _keeps_replicas_from(job, template_set),
    )


def _keeps_replicas_from(job, template_set: TemplateSet) -> int:
    return (job.fault_tolerance.f + 1) * template_set.min_nodes


def _planned(
    plan: Plan,
    template_nodes: int,
    fresh: bool,
    actions,
    reason: str,
    start: float,
    keeps_replicas_from: int,
    slow: Mapping[str, float] | None = None,
) -> Planned:
    ranks = rank_table(plan)
    return Planned(
        plan=plan,
        layout=ExecutionPlan.from_plan(plan, ranks, slow),
        ranks=ranks,
        template_nodes=template_nodes,
        fresh=fresh,
        actions=tuple(actions),
        reason=reason,
        seconds=time.perf_counter() - start,
        keeps_replicas_from=keeps_replicas_from,
    )
