"""Planning for the master, in a helper process so that the gRPC server never waits for it.

``plan_job`` is CPU-bound Python (model building, the MILP): run in the master's
own process it would hold the GIL for seconds, heartbeats would go unanswered
and agents would give the master up for dead. ``PlannerPool`` runs it in one
long-lived spawned process (imports paid once, at start-up) that dies with the
master. Inputs and outputs are plain data: the job's YAML and a dict.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from concurrent.futures import Future, ProcessPoolExecutor
from typing import Any, Sequence

from oobleck_mm.lifetime import die_with_parent


def plan_nodes(config_yaml: str, names: Sequence[str]) -> dict[str, Any]:
    """The execution plan of the job on ``names``, as plain data, or ``{"error": message}`` for a user error.

    Keys: ``layout`` (``ExecutionPlan.to_dict``), ``ranks`` ([node, gpu, rank] in
    rank order), ``samples_per_s`` (predicted), ``seconds`` (planning time).
    """
    import yaml

    from oobleck_mm.config import config_from_dict
    from oobleck_mm.planning.planner import plan_job
    from oobleck_mm.runtime.layout import ExecutionPlan

    start = time.perf_counter()
    try:
        job = config_from_dict(yaml.safe_load(config_yaml))
        plan = plan_job(job, list(names)).plan
        ranks = rank_table(plan)
        execution = ExecutionPlan.from_plan(plan, ranks)
    except ValueError as exc:  # errors travel as text: exception classes need not pickle
        return {"error": str(exc)}
    return {
        "layout": execution.to_dict(),
        "ranks": [[node, gpu, rank] for (node, gpu), rank in ranks.items()],
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


def plan_inline(config_yaml: str, names: Sequence[str]) -> Future:
    """``plan_nodes`` in the caller's thread, as an already finished future (tests)."""
    future: Future = Future()
    future.set_result(plan_nodes(config_yaml, names))
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

    def submit(self, config_yaml: str, names: Sequence[str]) -> Future:
        future = self._pool.submit(plan_nodes, config_yaml, list(names))
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
