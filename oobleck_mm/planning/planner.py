"""The master's planning pipeline in one call: costs -> templates -> plan -> reconfiguration.

``plan_job`` is what ``oobleck-launch plan`` prints and what the master (a later
issue) runs at start-up and on every membership change. It only wires the pure
steps together and times them; every decision lives in the step's own module.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from oobleck_mm.planning.costs import ModelProfile
from oobleck_mm.planning.instantiate import instantiate
from oobleck_mm.planning.plan import Plan
from oobleck_mm.planning.reconfigure import CannotKeepReplicas, Reconfiguration, reconfigure
from oobleck_mm.planning.stage_mapping import build_templates
from oobleck_mm.planning.template import TemplateSet
from oobleck_mm.report import format_plan, format_templates, plan_to_dict, template_to_dict


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
            what = ", ".join(filter(None, [
                f"lost {', '.join(self.lost)}" if self.lost else "",
                f"joined {', '.join(self.joined)}" if self.joined else "",
            ]))
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


def load_profile(job, progress: Callable[[str], None] | None = None) -> ModelProfile:
    """Per-layer costs for the job: the analytical model, or the job's own layers timed on this machine."""
    if job.planning.profile == "measured":
        # Lazy: planning stays importable (and testable) without torch.
        from oobleck_mm.profiling.measure_model import measure_job_profile

        return measure_job_profile(job, progress)
    from oobleck_mm.profiling.analytical import profile_from_config

    return profile_from_config(job)


def plan_job(
    job,
    node_names: Sequence[str],
    lost: Sequence[str] = (),
    joined: Sequence[str] = (),
    solver: str | None = None,
    progress: Callable[[str], None] | None = None,
) -> PlanningResult:
    solver = solver or job.planning.solver
    f = job.fault_tolerance.f
    cluster = job.cluster_spec()
    seconds: dict[str, float] = {}
    say = progress or (lambda line: None)

    start = time.perf_counter()
    profile = load_profile(job, progress)
    seconds["profile"] = time.perf_counter() - start
    say(f"profiled {profile.num_layers} layers ({profile.source}, {profile.device})")

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
