"""Part of the machine (``oobleck_mm.master.machine``): straggler verdicts and what follows from them.

Each completed step (``StepCompleted``: every rank's compute against the cost model's prediction) goes
through the job's ``StragglerDetector`` (``oobleck_mm.master.stragglers``, kept in the machine's state), so
the verdicts are a function of the events: replaying them gives the same ones. A verdict is logged
(``straggler_detected`` / ``_changed`` / ``_cleared`` events, a console line) and applied: a node found slow
gets a batch split priced for its speed (``generations.wanted``), one still slow ``straggler_replan_after``
later is weighed for a bench (``oobleck_mm.master.benching``); a node cleared gets its share back. A node
no longer in the plan is forgotten (cleared, "no longer in the plan") when a generation starts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from oobleck_mm.master.context import Context
from oobleck_mm.master.effects import LogStep
from oobleck_mm.master.inputs import StepCompleted
from oobleck_mm.master.stragglers import FACTOR_CHANGE, StragglerDetector, StragglerRule, Verdict


def detector(ctx: Context) -> StragglerDetector:
    """The job's detector (made at its first use, from ``fault_tolerance.straggler_*``)."""
    if ctx.s.stragglers is None:
        ctx.s.stragglers = StragglerDetector(StragglerRule.of(ctx.cfg.job.fault_tolerance))
    return ctx.s.stragglers


def step_completed(ctx: Context, ev: StepCompleted) -> bool:
    """Judges one completed step, has its row logged (with the judgement), then applies the verdicts; whether
    a node's speed changed (the split may follow: the caller plans)."""
    judge = detector(ctx)
    verdicts = judge.observe(ev.step, ev.ranks)
    flagged = len(judge.flagged) if judge.rule.enabled else None
    ctx.effects.append(LogStep(ev.generation, ev.step, flagged, dict(judge.latest)))
    changed = False
    for verdict in verdicts:
        changed = apply_verdict(ctx, verdict) or changed
    return changed


def keep_only(ctx: Context, nodes: Sequence[str]) -> None:
    """A generation starts on ``nodes``: every other node is forgotten (cleared if it was flagged)."""
    for verdict in detector(ctx).keep_only(nodes, ctx.s.next_step - 1):
        apply_verdict(ctx, verdict)  # (nothing to plan for: the node is not in the generation starting)


def apply_verdict(ctx: Context, v: Verdict) -> bool:
    factor = round(v.factor, 3) if not math.isnan(v.factor) else None
    evidence = [round(f, 3) for f in v.evidence]
    ctx.record(f"straggler_{v.kind}", node=v.node, step=v.step, factor=factor, evidence=evidence, reason=v.reason)
    if v.kind == "detected":
        ctx.say(
            f"node {v.node} is a straggler: its compute ran a median {v.factor:.2f}x the other nodes' "
            f"(per unit of predicted work) over the last {len(v.evidence)} steps, up to step {v.step + 1}"
        )
    elif v.kind == "changed":
        ctx.say(f"straggler {v.node} now runs {v.reason}")
    else:
        ctx.say(f"node {v.node} is no longer a straggler ({v.reason})")
    return apply(ctx, v.node, v.factor, v.kind != "cleared")


def apply(ctx: Context, node: str, factor: float, detected: bool) -> bool:
    """A node found slow (or no longer): the batch split follows its speed (``generations.wanted``, once the
    caller plans: true is returned); one still slow ``straggler_replan_after`` later is weighed for a bench
    (``oobleck_mm.master.benching``)."""
    s = ctx.s
    if detected and s.registry.nodes.get(node) is not None and factor > 1:
        weighed_at = s.slow.get(node, factor)
        s.slow[node] = float(factor)
        s.slow_since.setdefault(node, ctx.now)
        if factor >= FACTOR_CHANGE * weighed_at:
            s.weighed.discard(node)  # much slower than last measured: a bench is weighed again
    elif not detected:
        s.slow.pop(node, None)
        s.slow_since.pop(node, None)
        s.weighed.discard(node)  # found slow again later: weighed again
    else:
        ctx.because(f"straggler verdict on {node} (factor {factor}) ignored: not a live node, or not slower")
        return False
    return True
