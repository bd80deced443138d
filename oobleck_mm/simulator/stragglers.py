"""Stragglers in the simulation (issue 29): what a slow node costs each system, and this engine's policy.

Every system pays a slow node the same way: its pipeline's stages run that many
times longer (``planning.speed.slowed_template``) and every pipeline waits for
the slowest at the all-reduce, so a layout's iteration is priced at the nodes'
true speeds (``slowed_iteration_s``, ``grid_iteration_s``). The baselines (and
this engine with ``SimParams.straggler_mitigation`` off, or in restart mode)
stop there: they wait.

This engine in live mode also acts, on the same rules and the same planner
calls as the master (``oobleck_mm/master/stragglers.py``, ``oobleck_mm/master/benching.py``):

- a node slower than ``fault_tolerance.straggler_factor`` is found
  ``straggler_steps`` iterations after it slowed (the detector's window), and a
  node back under ``straggler_clear_factor`` is cleared as late; a found
  node's factor is taken at its true value (the real detector measures it
  against the other nodes' median);
- found or cleared, the batch is re-split for the known speeds
  (``planning.speed.speed_aware_split``), switched at an iteration boundary
  with a new generation's rendezvous;
- ``straggler_replan_after`` after it was found, still slow, it is weighed once
  (``planning.planner.plan_without_stragglers``) and benched when the plan of
  the others is predicted faster: a reconfiguration and the state copy it
  needs, and the node back like a join after ``straggler_bench`` (doubled for
  each bench of the same node), found slow again if it still is.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from oobleck_mm.config.fault_tolerance import MAX_BENCH_DOUBLINGS
from oobleck_mm.planning.plan import PipelineInstance, Plan
from oobleck_mm.planning.speed import predicted_samples_per_s, slowed_template

FACTOR_CHANGE = 1.25
"""As the master's (``oobleck_mm.master.stragglers.FACTOR_CHANGE``): a known factor is updated when it moved this much."""


def slowed_iteration_s(plan: Plan, nominal_s: float, speeds: Mapping[str, float]) -> float:
    """``plan``'s iteration at the nodes' speeds, given its iteration at full speed ``nominal_s`` (the
    planner's prediction, or a measured time): scaled by the ratio the cost model predicts."""
    slow = {n: f for n, f in speeds.items() if f != 1.0}
    if not slow or not set(slow) & set(plan.nodes):
        return nominal_s
    return nominal_s * (plan.global_batch / predicted_samples_per_s(plan, slow)) / plan.iteration_time_s


def grid_iteration_s(
    template, groups: Sequence[Sequence[str]], per_pipeline: int, nominal_s: float, speeds: Mapping[str, float]
) -> float:
    """A P x D grid's iteration (every pipeline ``per_pipeline`` microbatches) at the nodes' speeds."""
    full = template.iteration_time(per_pipeline)
    slowest = max(
        slowed_template(PipelineInstance(template, tuple(g), per_pipeline), speeds).iteration_time(per_pipeline)
        for g in groups
    )
    return nominal_s - full + slowest


class StragglerState:
    """What this engine knows of its nodes' speeds and what it did about it (one simulated job)."""

    def __init__(self, fault_tolerance, enabled: bool) -> None:
        ft = fault_tolerance
        self.enabled = enabled and ft.straggler_factor > 0 and ft.straggler_resplit
        self.factor, self.clear = ft.straggler_factor, ft.straggler_clear_factor
        self.steps = ft.straggler_steps
        self.replan_after = ft.straggler_replan_after.total_seconds() if ft.straggler_replan_after else None
        self.bench_s = ft.straggler_bench.total_seconds()
        self.speeds: dict[str, float] = {}
        """The truth: node -> how many times slower (absent: full speed)."""
        self.known: dict[str, float] = {}
        """What the job acts on: the found stragglers and their factors."""
        self.found_at: dict[str, float] = {}
        self.due: dict[str, float] = {}
        """node -> when the detector's window has seen its change of speed."""
        self.weighed: set[str] = set()
        self.benched: dict[str, tuple[float, int]] = {}
        """node -> (until, how many times benched)."""
        self.actions: list[tuple[float, str, str]] = []
        """(time, node, what): found, changed, cleared, kept, benched, back."""

    def set_speeds(self, slowed: Mapping[str, float]) -> None:
        for node, factor in slowed.items():
            if factor == 1.0:
                self.speeds.pop(node, None)
            else:
                self.speeds[node] = factor

    def forget(self, nodes: Sequence[str]) -> None:
        for node in nodes:
            for table in (self.speeds, self.known, self.found_at, self.due):
                table.pop(node, None)
            self.weighed.discard(node)

    def out(self, now: float) -> set[str]:
        """Nodes on the bench now."""
        return {n for n, (until, _) in self.benched.items() if now < until}

    def watch(self, now: float, nodes: Sequence[str], iteration_s: float) -> list[float]:
        """Nodes of the plan whose speed differs from what the job knows: the detector sees it after its
        window (``straggler_steps`` iterations at the present pace). The delays to be called back after."""
        if not self.enabled:
            return []
        out = []
        for node in nodes:
            if self._verdict(node) is not None and node not in self.due:
                self.due[node] = now + self.steps * iteration_s
                out.append(self.steps * iteration_s)
        return out

    def _verdict(self, node: str) -> str | None:
        """What the detector would say of ``node`` at its true speed: found, changed, cleared, or nothing."""
        truth, known = self.speeds.get(node, 1.0), self.known.get(node)
        if known is None:
            return "found" if truth >= self.factor else None
        if truth < self.clear:
            return "cleared"
        return "changed" if max(truth / known, known / truth) >= FACTOR_CHANGE else None

    def detect(self, now: float, nodes: Sequence[str]) -> bool:
        """The verdicts due by ``now``: the known speeds updated; whether they changed."""
        changed = False
        for node in [n for n, t in self.due.items() if t <= now]:
            del self.due[node]
            verdict = self._verdict(node) if node in nodes else None
            if verdict is None:
                continue
            changed = True
            self.actions.append((now, node, verdict))
            if verdict == "cleared":
                self.known.pop(node, None)
                self.found_at.pop(node, None)
                self.weighed.discard(node)
                continue
            if verdict == "changed" and self.speeds[node] >= FACTOR_CHANGE * self.known[node]:
                self.weighed.discard(node)  # much slower than when it was weighed: weighed again
            self.known[node] = self.speeds[node]
            self.found_at.setdefault(node, now)
        return changed

    def to_weigh(self, now: float, nodes: Sequence[str]) -> list[str]:
        if self.replan_after is None:
            return []
        return sorted(
            n
            for n in nodes
            if n in self.known and n not in self.weighed and now - self.found_at[n] >= self.replan_after
        )

    def next_weigh(self, now: float) -> float | None:
        """Delay to the next weighing of a found node not weighed yet."""
        if self.replan_after is None:
            return None
        times = [self.found_at[n] + self.replan_after for n in self.known if n not in self.weighed]
        return max(0.0, min(times) - now) if times else None

    def bench(self, now: float, node: str) -> float:
        """Benches ``node``; the seconds it stays out."""
        times = self.benched[node][1] + 1 if node in self.benched else 1
        seconds = self.bench_s * 2 ** min(times - 1, MAX_BENCH_DOUBLINGS)
        self.benched[node] = (now + seconds, times)
        for table in (self.known, self.found_at, self.due):
            table.pop(node, None)
        self.weighed.discard(node)
        self.actions.append((now, node, "benched"))
        return seconds

    def returning(self, now: float, live: Sequence[str], used: Sequence[str]) -> list[str]:
        """Benched nodes whose bench ended, still live and not planned: they join again."""
        out = [n for n, (until, _) in sorted(self.benched.items()) if until <= now and n in live and n not in used]
        for node in out:
            self.actions.append((now, node, "back"))
        return out
