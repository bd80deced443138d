"""The master's state machine under random event orders (hypothesis' stateful testing).

``machine_model.MachineModel`` plays the agents, the workers, the planner, the
clock and the operator around ``master.machine.step``; after every event the
invariants hold (no exception, generations only grow, no plan uses a node
that is not live, a finish is stated and its exit code fits the state), and
when the chaos stops the job settles: every live node in the plan, or a stated
finish. The suite runs a shallow profile; ``scripts/bench_machine.py`` runs
20,000 sequences. Failing sequences that hypothesis found are kept below as
plain tests.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, Phase, settings

from machine_model import FakePlan, MachineModel, answer
from master.effects import AskPlanner

EXAMPLES = int(os.environ.get("OOBLECK_MACHINE_EXAMPLES", "150"))
SHRINK = os.environ.get("OOBLECK_MACHINE_SHRINK", "1") != "0"
"""``scripts/bench_machine.py --mutants`` only asks whether a mutant is caught: no shrinking there."""

TestMachine = MachineModel.TestCase
TestMachine.settings = settings(max_examples=EXAMPLES, stateful_step_count=50, deadline=None,
                                suppress_health_check=[HealthCheck.too_slow],
                                phases=list(Phase) if SHRINK else [Phase.explicit, Phase.reuse, Phase.generate])


def test_the_fake_planner_uses_every_node_once_in_two_node_pipelines():
    planned = answer(AskPlanner(1, "reconfigure", base=FakePlan(("a", "b", "c", "d")), lost=("b",), joined=("e", "f")))
    assert sorted(n for n, _ in planned.ranks) == ["a", "c", "d", "e", "f"]
    assert [len(p.stages) for p in planned.layout.pipelines] == [2, 3]
    assert type(answer(AskPlanner(2, "fresh", names=("a", "b", "c")))).__name__ == "CannotKeepReplicas"


def test_a_plan_the_membership_overtook_is_superseded_and_the_latest_membership_planned_once():
    """Issue 27 item 5: a second loss while a plan is computed no longer waits for the stale plan."""
    from master.effects import CancelPlan
    from master.inputs import PlanAnswered

    m = MachineModel()
    m.start(steps=100, recovery="live", interval=0, started=6)  # 4 planned, 2 joining
    while len(m.state.current_view().nodes) < 6:
        m.time_passes(0.3)
        for plan_id in sorted(m.world.asked):
            m.feed(PlanAnswered(plan_id, answer(m.world.asked.pop(plan_id))))
        m.train_a_step(phases=True)
    before = m.state.generation
    m.kill_named("n5")
    m.time_passes(0.3)  # past the settle window: a plan asked for n0..n4
    [first] = m.world.asked.values()
    m.kill_named("n4")
    effects = m.feed_tick(0.05)  # the loss is seen: the stale plan is dropped at once...
    assert [e.id for e in effects if isinstance(e, CancelPlan)] == [first.id]
    assert not [e for e in effects if type(e).__name__ == "AskPlanner"]  # ...the next waits for the settle window
    m.feed_tick(0.1)
    [second] = [a for a in m.world.asked.values() if a.id != first.id]
    assert set(second.lost) == {"n4", "n5"}, second  # the latest membership, in one plan
    # the stale answer comes anyway (it was running): dropped, never applied
    m.feed(PlanAnswered(first.id, answer(m.world.asked.pop(first.id))))
    assert m.state.generation == before
    m.feed(PlanAnswered(second.id, answer(m.world.asked.pop(second.id))))
    assert m.state.generation == before + 1 and set(m.state.current_view().nodes) == {"n0", "n1", "n2", "n3"}
