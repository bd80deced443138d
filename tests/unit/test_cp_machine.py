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


def test_a_node_back_after_re_adoption_as_a_new_agent_makes_the_generation_re_form_without_its_states():
    """Found by the model (with the straggler rule's new invariant): a restarted master re-adopted generation 1
    without n0 (its agent hung); n0 then registered again as a *new* agent (``adopt_generation`` 0: its workers
    run nothing). It was taken as "back before a plan was needed" and generation 1 went on waiting for n0's
    steps until ``stall_timeout``. Now the generation re-forms, n0 starting empty."""
    m = MachineModel()
    m.start(steps=30, recovery="live", interval=0, started=4)
    m.world.agents["n0"].hung = True
    m.master_restarts(now=0)
    m.register(name="n0")
    m.time_passes(0.01)
    m.master_frozen(seconds=5.0)  # the adoption window ends: n0's stream is not open yet
    assert m.state.generation == 1 and m.state.incident is not None and m.state.incident.cause == "lost"
    m.settle()
    plans = [a for a in m.state.gens.values() if a.view.number > 1]
    assert plans and m.state.finish is None or m.state.finish.exit_code == 0
    later = m.state.gens[2]
    assert set(later.view.nodes) == {"n0", "n1", "n2", "n3"} and m.state.next_step > 1, "n0 rejoined, training went on"


def test_a_straggler_verdict_re_splits_the_batch_at_a_boundary_and_its_clearing_splits_it_back():
    """Issue 29: the machine plans the same nodes again with the slow node's factor (``AskPlanner.slow``), not a
    failure (the assignments go out ``at_boundary``); when the node is cleared, the split for the templates'
    own speeds (``slow=()``); with ``straggler_resplit`` off, nothing is planned."""
    from master.inputs import PlanAnswered, Straggler

    m = MachineModel()
    m.start(steps=100, recovery="live", interval=0, started=4)
    m.train_a_step(phases=True)
    m.feed(Straggler("n1", 2.0, detected=True, step=3))
    [ask] = m.world.asked.values()
    assert (ask.call, ask.lost, ask.joined, ask.slow) == ("reconfigure", (), (), (("n1", 2.0),))
    m.feed(PlanAnswered(ask.id, answer(m.world.asked.pop(ask.id))))
    assert m.state.generation == 2 and m.state.gens[2].slow == (("n1", 2.0),)
    assert all(a.assignment.at_boundary for a in m.world.agents.values()), "no iteration is abandoned"
    assert m.state.gens[2].view.nodes == m.state.gens[1].view.nodes
    m.feed(Straggler("n1", 2.0, detected=True, step=5))  # the same verdict again: nothing new to plan
    assert not m.world.asked
    m.train_a_step(phases=True)
    m.feed(Straggler("n1", 1.0, detected=False, step=12))
    [back] = m.world.asked.values()
    assert back.slow == (), "cleared: split for the templates' own speeds, not left as it was"

    off = MachineModel()
    off.start(steps=100, recovery="live", interval=0, started=4, resplit=False)
    off.train_a_step(phases=True)
    off.feed(Straggler("n1", 2.0, detected=True, step=3))
    assert not off.world.asked and off.state.generation == 1
