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

from hypothesis import HealthCheck, settings

from machine_model import FakePlan, MachineModel, answer
from master.effects import AskPlanner

EXAMPLES = int(os.environ.get("OOBLECK_MACHINE_EXAMPLES", "150"))

TestMachine = MachineModel.TestCase
TestMachine.settings = settings(max_examples=EXAMPLES, stateful_step_count=50, deadline=None,
                                suppress_health_check=[HealthCheck.too_slow])


def test_the_fake_planner_uses_every_node_once_in_two_node_pipelines():
    planned = answer(AskPlanner(1, "reconfigure", base=FakePlan(("a", "b", "c", "d")), lost=("b",), joined=("e", "f")))
    assert sorted(n for n, _ in planned.ranks) == ["a", "c", "d", "e", "f"]
    assert [len(p.stages) for p in planned.layout.pipelines] == [2, 3]
    assert type(answer(AskPlanner(2, "fresh", names=("a", "b", "c")))).__name__ == "CannotKeepReplicas"
