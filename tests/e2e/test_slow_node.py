"""End to end: a slow node (``--inject slow:...``) is named, its pipeline gets fewer microbatches, and back.

The float64 tiny model on four one-stage pipelines; node2's workers are frozen three quarters of the time
(``faults/slowdown.py``) for a few seconds. What a user relies on: only that node is named a straggler, the
batch split gives its pipeline less without a step abandoned or a node lost, the split returns once it is
cleared, and the parameters equal a run without any of it (the same samples every step).
"""

from __future__ import annotations

import pytest

from harness import Launch, assert_matches_reference, write_config
from oobleck_mm.faults.slowdown import SignalFreezer, freezer_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _microbatches_by_node(plan: dict) -> dict[str, int]:
    """One GPU per node: rank r is ``plan["nodes"][r]``."""
    return {plan["nodes"][stage[0]]: p["num_microbatches"] for p in plan["layout"]["pipelines"] for stage in p["stages"]}


def test_a_slowed_node_is_named_its_pipeline_gets_fewer_microbatches_and_the_run_equals_the_reference(
        launches, tmp_path):  # fmt: skip
    probe = freezer_for()
    probe.close()
    if isinstance(probe, SignalFreezer):
        pytest.skip("no writable cgroup freezer here: a SIGSTOPped worker would be reported as failed")
    steps = 140
    config = write_config(tmp_path, nodes=4, steps=steps, fault_tolerance={"straggler_factor": 1.5})
    final = tmp_path / "final"
    run = Launch(tmp_path, config, "--nodes", "4", "--steps", str(steps), "--save-final", str(final),
                 "--inject", "slow:node2@step20x4+6s")  # fmt: skip
    launches.append(run)
    code = run.wait(timeout=150)
    assert code == 0, f"exit {code}\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    run.assert_all_gone()
    assert [e["node"] for e in run.events("straggler_detected")] == ["node2"], "the slow node, and no other"
    assert [e["node"] for e in run.events("straggler_cleared")] == ["node2"]
    assert "node node2 is a straggler" in run.stdout
    [slowed_split, even_again] = [p for p in run.events("plan_decided") if p["cause"] == "straggler"]
    slowed, even = _microbatches_by_node(slowed_split), _microbatches_by_node(even_again)
    assert slowed["node2"] < min(q for n, q in slowed.items() if n != "node2"), slowed
    assert len(set(even.values())) == 1, f"back to the even split once cleared: {even}"
    # The plan carries the factor to the workers' balancer (``StageLayout.slowdown``), and no more once cleared.
    carried = {slowed_split["nodes"][s[0]]: s[3] for p in slowed_split["layout"]["pipelines"] for s in p["stages"]
               if len(s) > 3}  # fmt: skip
    assert list(carried) == ["node2"] and carried["node2"] > 1.5, carried
    assert all(len(s) == 3 for p in even_again["layout"]["pipelines"] for s in p["stages"])
    for plan in (slowed_split, even_again):
        assert sum(p["num_microbatches"] for p in plan["layout"]["pipelines"]) * plan["layout"]["microbatch_size"] == 16
        assert sorted(plan["nodes"]) == ["node0", "node1", "node2", "node3"] and plan["layer_states_moved"] == 0
    assert not run.events("lost") and not run.events("aborted"), "switched at iteration boundaries, nothing lost"
    assert run.events("slowed") and run.events("slow_restored")
    assert_matches_reference(config, steps, final)
