"""Planning for the master, in a helper process so that the gRPC server never waits for it.

``plan_job`` is CPU-bound Python (model building, the MILP): run in the master's
own process it would hold the GIL for seconds, heartbeats would go unanswered
and agents would give the master up for dead. ``PlannerPool`` runs it in one
long-lived process (forked from ``oobleck-launch master`` as it starts: imports
paid once) that dies with the master. Inputs and outputs are plain data: the
job's YAML, node names, and the planning ``Plan`` dataclass the previous call
returned (pickled only between the master and its own helper, never on the
network).

Two calls:

- ``plan_nodes(config_yaml, names)``: a fresh plan (start, restart mode, or a
  generation that starts afresh; ``planning.planner.plan_fresh``). Keeps the
  pipeline templates built for ``len(names)`` nodes in the helper.
- ``replan_nodes(config_yaml, template_nodes, base, lost, joined)``: the
  incremental reconfiguration of ``base`` (§2.5) with the templates built
  once for ``template_nodes`` nodes (``planning.planner.plan_reconfiguration``,
  which falls back to a fresh plan when the nodes cannot be placed); with
  ``bench``, the same nodes or the plan without those stragglers, whichever
  is predicted faster (issue 29).

Results are ``planning.planner.PlanOutcome`` dataclasses: ``Planned``,
``CannotKeepReplicas`` (the nodes cannot keep f+1 replicas) or ``Failed`` (a
``UserError`` the user must fix). Any other exception is a bug: it reaches the
master as the future's exception and ends the job with exit 1.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
from concurrent.futures import Future, ProcessPoolExecutor
from typing import Any, Optional, Sequence


from oobleck_mm.config import config_from_dict, parse_config_text
from oobleck_mm.lifetime import die_with_parent
from oobleck_mm.planning.planner import (
    Planned,
    plan_as_is,
    plan_fresh,
    plan_job,
    plan_reconfiguration,
    plan_without_stragglers,
    split_for_speeds,
)
from oobleck_mm.profiling.load import load_profile

_TEMPLATES: dict[tuple[str, int], Any] = {}
"""(config YAML, node count) -> TemplateSet, in the process that plans (the helper)."""
_PROFILES: dict[str, Any] = {}
"""config YAML -> the job's ModelProfile (a measured one is timed once per helper)."""
Slow = Optional[Sequence[tuple[str, float]]]
"""Slow nodes and their factors for the batch split; None: split as planned (no speed ever measured)."""


def plan_nodes(config_yaml: str, names: Sequence[str], slow: Slow = None):
    """The plan of the job on ``names`` from scratch: a ``planning.planner.PlanOutcome``; with ``slow``
    (node -> factor), its batch split for those speeds."""
    job = _job(config_yaml)
    profile = _profile(config_yaml, job)
    outcome, templates = plan_fresh(job, profile, names)
    if templates is not None:
        _TEMPLATES[(config_yaml, len(names))] = templates
    return split_for_speeds(job, outcome, _speeds(slow), profile, templates)


def replan_nodes(
    config_yaml: str,
    template_nodes: int,
    base,
    lost: Sequence[str],
    joined: Sequence[str],
    slow: Slow = None,
    bench: Sequence[str] = (),
):
    """The reconfiguration of planning ``Plan`` ``base`` after ``lost`` leave and ``joined`` arrive (nobody:
    ``base`` as it is); with ``slow``, its batch split for those speeds (``()``: the templates' own). With
    ``bench`` (slow nodes of an unchanged membership), that plan or the one without them, whichever is
    predicted faster (``planning.planner.weigh_bench``)."""
    job = _job(config_yaml)
    templates = _template_set(config_yaml, job, template_nodes)
    if not lost and not joined:
        if not bench:
            return split_for_speeds(
                job,
                plan_as_is(job, templates, template_nodes, base),
                _speeds(slow),
                _profile(config_yaml, job),
                templates,
            )
        chosen, fresh_templates = plan_without_stragglers(
            job, _profile(config_yaml, job), templates, template_nodes, base, _speeds(slow) or {}, list(bench)
        )
    else:
        chosen, fresh_templates = plan_reconfiguration(
            job, _profile(config_yaml, job), templates, template_nodes, base, lost, joined
        )
        chosen = split_for_speeds(job, chosen, _speeds(slow), _profile(config_yaml, job), fresh_templates or templates)
    if fresh_templates is not None and isinstance(chosen, Planned):
        _TEMPLATES[(config_yaml, chosen.template_nodes)] = fresh_templates
    return chosen


def _speeds(slow) -> dict[str, float] | None:
    return None if slow is None else {str(n): float(f) for n, f in slow}


def warm_templates(config_yaml: str, template_nodes: int) -> None:
    """Build the templates for ``template_nodes`` nodes now, in a helper that has none (a restarted
    master's): its first reconfiguration then takes milliseconds, not the ~0.2 s of building them."""
    _template_set(config_yaml, _job(config_yaml), template_nodes)


def _job(config_yaml: str):
    return config_from_dict(parse_config_text(config_yaml))


def _profile(config_yaml: str, job):
    if config_yaml not in _PROFILES:
        _PROFILES[config_yaml] = load_profile(job)
    return _PROFILES[config_yaml]


def _template_set(config_yaml: str, job, num_nodes: int):
    """The templates built for ``num_nodes`` nodes, built again if this helper has not got them (restarted)."""
    key = (config_yaml, num_nodes)
    if key not in _TEMPLATES:
        names = [f"_template{i}" for i in range(num_nodes)]
        _TEMPLATES[key] = plan_job(job, _profile(config_yaml, job), names).template_set
    return _TEMPLATES[key]


class InlinePlanner:
    """The planning calls in the caller's thread, as already finished futures (tests)."""

    def fresh(self, config_yaml: str, names: Sequence[str], slow=None) -> Future:
        return _done(plan_nodes, config_yaml, list(names), slow)

    def reconfigure(self, config_yaml: str, template_nodes: int, base, lost, joined, slow=None, bench=()) -> Future:
        return _done(replan_nodes, config_yaml, template_nodes, base, list(lost), list(joined), slow, tuple(bench))

    def warm(self, config_yaml: str, template_nodes: int) -> Future:
        return _done(warm_templates, config_yaml, template_nodes)

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
    """One planning process for the master's lifetime.

    ``fork`` (what ``oobleck-launch master`` asks for): the master has imported the planner already (this
    module does), so the helper starts with it, where a spawned one pays an interpreter and the planner's
    imports again (~1 CPU-s on a 2-core machine, at every master start). Only where nothing runs gRPC yet:
    a fork copies just the forking thread, and a process whose other threads were inside gRPC forked a
    helper that never planned (a master embedded in a test's process). ``spawn`` otherwise."""

    def __init__(self, start_method: str = "spawn") -> None:
        if start_method not in ("fork", "spawn"):
            raise ValueError(f"planner start method {start_method!r}: 'fork' or 'spawn'")
        if start_method not in multiprocessing.get_all_start_methods():
            start_method = "spawn"
        self._pool = ProcessPoolExecutor(
            max_workers=1,
            mp_context=multiprocessing.get_context(start_method),
            initializer=_init_helper,
            initargs=(os.getpid(),),
        )
        # Start it now (a fork pool starts its process at the first submit), not at the first plan.
        self._submitted = [self._pool.submit(_warm_up)]

    def fresh(self, config_yaml: str, names: Sequence[str], slow=None) -> Future:
        return self._submit(plan_nodes, config_yaml, list(names), slow)

    def reconfigure(self, config_yaml: str, template_nodes: int, base, lost, joined, slow=None, bench=()) -> Future:
        return self._submit(
            replan_nodes, config_yaml, template_nodes, base, list(lost), list(joined), slow, tuple(bench)
        )

    def warm(self, config_yaml: str, template_nodes: int) -> Future:
        """Build the templates a reconfiguration will need, ahead of it (``warm_templates``)."""
        return self._submit(warm_templates, config_yaml, template_nodes)

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
    # A scheduler's stop signals every process of the job step, this helper too (SLURM's ``scancel
    # --signal=TERM``, a terminal's Ctrl-C): the master stops gracefully and may still plan (the nodes
    # leaving on that notice), so the helper must outlive the signal. It ends with the master.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent(master_pid)


def _warm_up() -> None:
    """Nothing to do: importing this module (the helper's first task) paid every import."""
