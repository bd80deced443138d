"""Planning for the master, in a helper process so that the gRPC server never waits for it.

``plan_job`` is CPU-bound Python (model building, the MILP): run in the master's
own process it would hold the GIL for seconds, heartbeats would go unanswered
and agents would give the master up for dead. ``PlannerPool`` runs it in one
long-lived spawned process (imports paid once, at start-up) that dies with the
master. Inputs and outputs are plain data: the job's YAML, node names, and the
planning ``Plan`` dataclass the previous call returned (pickled only between the
master and its own helper, never on the network).

Two calls:

- ``plan_nodes(config_yaml, names)``: a fresh plan (start, restart mode, or a
  generation that starts afresh). Builds the pipeline templates for
  ``len(names)`` nodes and keeps them in the helper.
- ``replan_nodes(config_yaml, template_nodes, base, lost, joined)``: the
  incremental reconfiguration of ``base`` (§2.5) with the templates built
  once for ``template_nodes`` nodes. When it cannot place the nodes (joins past
  the node count the templates were built for) it falls back to a fresh plan on
  the live nodes, which the workers can adopt just as well: they derive the
  state copies from any pair of plans.

Results are dicts: ``layout``/``ranks``/``plan``/``template_nodes``/``seconds``...
for a plan, ``{"cannot": reason, "live": n, "needed": m}`` when the nodes cannot
keep f+1 replicas, ``{"error": message}`` for anything else the user must fix.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import time
from concurrent.futures import Future, ProcessPoolExecutor
from typing import Any, Sequence

from oobleck_mm.lifetime import die_with_parent

_TEMPLATES: dict[tuple[str, int], Any] = {}
"""(config YAML, node count) -> TemplateSet, in the process that plans (the helper)."""


def plan_nodes(config_yaml: str, names: Sequence[str]) -> dict[str, Any]:
    """The execution plan of the job on ``names`` from scratch; see the module docstring for the keys."""
    from oobleck_mm.planning.planner import plan_job

    start = time.perf_counter()
    job = _job(config_yaml)
    try:
        result = plan_job(job, list(names))
    except ValueError as exc:  # errors travel as text: exception classes need not pickle
        return _cannot_or_error(config_yaml, job, len(names), str(exc))
    _TEMPLATES[(config_yaml, len(names))] = result.template_set
    out = _result(result.plan, len(names), start)
    out.update(fresh=True, actions=[], reason=f"instantiated on {len(names)} nodes")
    return out


def replan_nodes(
    config_yaml: str, template_nodes: int, base, lost: Sequence[str], joined: Sequence[str]
) -> dict[str, Any]:
    """The reconfiguration of planning ``Plan`` ``base`` after ``lost`` leave and ``joined`` arrive."""
    from oobleck_mm.planning.reconfigure import CannotKeepReplicas, reconfigure

    start = time.perf_counter()
    job = _job(config_yaml)
    templates = _template_set(config_yaml, job, template_nodes)
    gain = job.planning.replan_gain
    try:
        rec = reconfigure(
            base, lost, joined, templates, job.fault_tolerance.f, job.cluster_spec(), solver=job.planning.solver,
            replan_gain=math.inf if gain is None else gain,
        )  # fmt: skip
    except ValueError as exc:
        # Joins past the templates' node range (or a batch the new pipelines cannot split):
        # plan the live nodes afresh; the workers copy whatever the new layout needs.
        live = [n for n in base.nodes if n not in set(lost)] + [n for n in joined if n not in base.nodes or n in lost]
        out = plan_nodes(config_yaml, live)
        if "layout" in out:
            out["reason"] = f"incremental reconfiguration impossible ({exc}); {out['reason']}"
        return out
    if isinstance(rec, CannotKeepReplicas):
        return {"cannot": rec.reason, "live": rec.live_nodes, "needed": rec.needed}
    out = _result(rec.plan, template_nodes, start)
    out.update(fresh=False, actions=list(rec.actions), reason=rec.reason)
    return out


def _job(config_yaml: str):
    import yaml

    from oobleck_mm.config import config_from_dict

    return config_from_dict(yaml.safe_load(config_yaml))


def _template_set(config_yaml: str, job, num_nodes: int):
    """The templates built for ``num_nodes`` nodes, built again if this helper has not got them (restarted)."""
    key = (config_yaml, num_nodes)
    if key not in _TEMPLATES:
        from oobleck_mm.planning.planner import plan_job

        _TEMPLATES[key] = plan_job(job, [f"_template{i}" for i in range(num_nodes)]).template_set
    return _TEMPLATES[key]


def _cannot_or_error(config_yaml: str, job, live: int, message: str) -> dict[str, Any]:
    """Below (f+1)*n0 nodes is the job's end (exit 3); any other planning error is the user's to fix."""
    known = [t for (yaml_text, _), t in _TEMPLATES.items() if yaml_text == config_yaml]
    if known:
        needed = (job.fault_tolerance.f + 1) * known[0].min_nodes
        if live < needed:
            return {"cannot": message, "live": live, "needed": needed}
    return {"error": message}


def _result(plan, template_nodes: int, start: float) -> dict[str, Any]:
    from oobleck_mm.runtime.layout import ExecutionPlan

    ranks = rank_table(plan)
    execution = ExecutionPlan.from_plan(plan, ranks)
    return {
        "layout": execution.to_dict(),
        "ranks": [[node, gpu, rank] for (node, gpu), rank in ranks.items()],
        "plan": plan,
        "template_nodes": template_nodes,
        "samples_per_s": plan.samples_per_s,
        "seconds": time.perf_counter() - start,
    }


def rank_table(plan) -> dict[tuple[str, int], int]:
    """(node, local gpu) -> global rank, numbered pipeline by pipeline, stage by stage."""
    ranks: dict[tuple[str, int], int] = {}
    for instance in plan.pipelines:
        for spec in instance.template.stages:
            for gpu in spec.gpus:
                ranks[(instance.nodes[spec.node], gpu)] = len(ranks)
    return ranks


class InlinePlanner:
    """The planning calls in the caller's thread, as already finished futures (tests)."""

    def fresh(self, config_yaml: str, names: Sequence[str]) -> Future:
        return _done(plan_nodes, config_yaml, list(names))

    def reconfigure(self, config_yaml: str, template_nodes: int, base, lost, joined) -> Future:
        return _done(replan_nodes, config_yaml, template_nodes, base, list(lost), list(joined))

    def close(self) -> None:
        pass


def _done(fn, *args) -> Future:
    future: Future = Future()
    try:
        future.set_result(fn(*args))
    except Exception as exc:  # like a helper process that failed
        future.set_exception(exc)
    return future


class PlannerPool:
    """One planning process for the master's lifetime."""

    def __init__(self) -> None:
        self._pool = ProcessPoolExecutor(
            max_workers=1,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_init_helper,
            initargs=(os.getpid(),),
        )
        # Start it and pay the planner's imports now, not at the first plan.
        self._submitted = [self._pool.submit(_warm_up)]

    def fresh(self, config_yaml: str, names: Sequence[str]) -> Future:
        return self._submit(plan_nodes, config_yaml, list(names))

    def reconfigure(self, config_yaml: str, template_nodes: int, base, lost, joined) -> Future:
        return self._submit(replan_nodes, config_yaml, template_nodes, base, list(lost), list(joined))

    def _submit(self, fn, *args) -> Future:
        future = self._pool.submit(fn, *args)
        self._submitted = [f for f in self._submitted if not f.done()] + [future]
        return future

    def close(self) -> None:
        # The executor offers no kill: take its processes before shutdown forgets them.
        processes = list((getattr(self._pool, "_processes", None) or {}).values())
        for proc in processes:
            if self._busy():
                proc.kill()  # an unfinished plan is of no use to anyone
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _busy(self) -> bool:
        return any(not f.done() for f in self._submitted)


def _init_helper(master_pid: int) -> None:
    die_with_parent(master_pid)


def _warm_up() -> None:
    import oobleck_mm.planning.planner  # noqa: F401
    import oobleck_mm.planning.reconfigure  # noqa: F401
