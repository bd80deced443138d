"""End to end: a slow node (``--inject slow:...``) is named, its pipeline gets fewer microbatches, and back.

The float64 tiny model on four one-stage pipelines; node2's workers are frozen three quarters of the time
(``faults/slowdown.py``) for a few seconds. What a user relies on: only that node is named a straggler, the
batch split gives its pipeline less without a step abandoned or a node lost, the split returns once it is
cleared, and the parameters equal a run without any of it (the same samples every step).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from harness import Launch, assert_matches_reference, write_config
from oobleck_mm.faults.slowdown import SignalFreezer, freezer_for
from oobleck_mm.runtime.checkpoint_meta import read_meta

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _needs_a_freezer() -> None:
    probe = freezer_for()
    probe.close()
    if isinstance(probe, SignalFreezer):
        pytest.skip("no writable cgroup freezer here: a SIGSTOPped worker would be reported as failed")


def _stop_when(run: Launch, done, what: str) -> int:
    """``Launch.stop_when``, checked: exit 3 and every process gone. Returns the step of the stop's checkpoint."""
    code = run.stop_when(done, what)
    assert code == 3, f"exit {code}\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    run.assert_all_gone()
    return read_meta(_stop_checkpoint(run))["step"]


def _aborted_before_the_stop(run: Launch) -> list[dict]:
    """Iterations abandoned before the test stopped the job: a switch the stop lands in may break its first
    collective (an ``aborted`` record; the stop's checkpoint is exact all the same), which is not the
    scenario's."""
    [stop] = run.events("stop_requested")
    return [e for e in run.events("aborted") if e["ts"] < stop["ts"]]


def _stop_checkpoint(run: Launch) -> Path:
    """The checkpoint the stop wrote (periodic ones are off)."""
    [written] = run.events("checkpoint_written")
    return Path(written["dir"])


def _microbatches_by_node(plan: dict) -> dict[str, int]:
    """One GPU per node: rank r is ``plan["nodes"][r]``."""
    return {
        plan["nodes"][stage[0]]: p["num_microbatches"] for p in plan["layout"]["pipelines"] for stage in p["stages"]
    }


def test_a_slowed_node_is_named_its_pipeline_gets_fewer_microbatches_and_the_run_equals_the_reference(
    launches, tmp_path
):
    _needs_a_freezer()
    steps = 140
    # Threshold 2, node2 slowed 8x: on two shared cores a node beside other load reads 1.4-2.2 on single
    # steps, and in CI (two test workers) once read a median of 1.5 over 8 steps; a node frozen 7/8 of the
    # time reads 2-4 there, since the others take the core it leaves.
    config = write_config(tmp_path, nodes=4, steps=steps, fault_tolerance={"straggler_factor": 2.0})
    run = Launch(
        tmp_path,
        config,
        "--nodes",
        "4",
        "--steps",
        str(steps),
        "--inject",
        "slow:node2@step20x8+6s",
    )
    launches.append(run)

    def settled() -> bool:
        """node2 found, cleared and its split undone (or left even), and every node found slow cleared."""
        detected, cleared = run.events("straggler_detected"), run.events("straggler_cleared")
        if not cleared or sorted(e["node"] for e in cleared) != sorted(e["node"] for e in detected):
            return False
        after = cleared[0]["ts"]
        # The split undone and a step trained on it (a stop inside that switch is another scenario: its
        # checkpoint round asked the generation the workers had just left, and the job exited 1, a bug
        # left open; see the issue tracker's notes), or no switch at all.
        undone = [p["generation"] for p in run.events("plan_decided") if p["cause"] == "straggler" and p["ts"] >= after]
        return bool(undone and run.events("step", generation=undone[-1])) or any(
            e["ts"] >= after for e in run.events("speed_split_unchanged")
        )

    steps = _stop_when(run, settled, "node2 found slow, then cleared")
    # The slow node first. Another node may read slow too for a while on a loaded host (a suite run at 2 xdist
    # workers once read node1 >= 2 over 8 steps, after node2: its core was the busiest): it must be cleared
    # again by the end, as node2 is once restored; a real cluster's nodes do not share cores.
    detected = [e["node"] for e in run.events("straggler_detected")]
    assert detected[0] == "node2" and detected.count("node2") == 1, detected
    assert sorted(e["node"] for e in run.events("straggler_cleared")) == sorted(detected), "every one cleared"
    assert "node node2 is a straggler" in run.stdout
    # Found slow, maybe re-split again as its measured factor moved (``changed``), then cleared.
    *slowed_splits, even_again = [p for p in run.events("plan_decided") if p["cause"] == "straggler"]
    assert slowed_splits, "found slow: a re-split before the one that undoes it"
    slowed_split = slowed_splits[0]
    slowed, even = _microbatches_by_node(slowed_split), _microbatches_by_node(even_again)
    assert slowed["node2"] < min(q for n, q in slowed.items() if n != "node2"), slowed
    assert len(set(even.values())) == 1, f"back to the even split once cleared: {even}"
    # The plan carries the factor to the workers' balancer (``StageLayout.slowdown``), and no more once cleared.
    carried = {
        slowed_split["nodes"][s[0]]: s[3]
        for p in slowed_split["layout"]["pipelines"]
        for s in p["stages"]
        if len(s) > 3
    }
    assert list(carried) == ["node2"] and carried["node2"] >= 2.0, carried
    # Once cleared, the split is for the templates' own speeds: a plan without the factor, or, when the split
    # was even already (a "changed" factor near 1 re-split it first), no switch at all: without the balancer
    # the factor alone changes no work (``generations._same_split``), and the generation's speeds are emptied.
    cleared_ts = run.events("straggler_cleared")[0]["ts"]
    kept = [e for e in run.events("speed_split_unchanged") if e["ts"] >= cleared_ts]
    assert (
        even_again["ts"] >= cleared_ts
        and all(len(s) == 3 for p in even_again["layout"]["pipelines"] for s in p["stages"])
    ) or (kept and kept[0]["slow"] == []), (even_again, kept)
    for plan in (*slowed_splits, even_again):
        assert sum(p["num_microbatches"] for p in plan["layout"]["pipelines"]) * plan["layout"]["microbatch_size"] == 16
        assert sorted(plan["nodes"]) == ["node0", "node1", "node2", "node3"] and plan["layer_states_moved"] == 0
    assert not run.events("lost") and not _aborted_before_the_stop(run), (
        "switched at iteration boundaries, nothing lost"
    )
    assert run.events("slowed") and run.events("slow_restored")
    assert_matches_reference(config, steps, _stop_checkpoint(run))


def test_a_node_slow_for_good_is_benched_at_a_boundary_taken_back_later_and_the_run_equals_the_reference(
    launches, tmp_path
):
    """Issue 29 item 3(b). Three one-stage pipelines of two one-sample microbatches each: a re-split cannot
    give node2's pipeline less than one microbatch, so once node2 (frozen 15/16 of the time from step 10, for good) is
    still slow ``straggler_replan_after`` (1 s) after it was found, the planner predicts the job faster on
    the two others and it is benched for ``straggler_bench`` (3 s): planned out at an iteration boundary with
    nothing lost, taken back like a join when the bench ends, and benched for twice as long when found slow
    again. The parameters equal a run without any of it.

    Benched, the two others run three microbatches each: an even split, so neither reads slower than the other
    from sharing this host's cores. Split 2 + 1 (two-sample microbatches), the pipeline of one microbatch read
    1.25-1.6x the other's per unit of work (its only microbatch always ran beside the other's first, the
    other's second alone), was found a straggler, and once, on a busy CI machine, benched."""
    _needs_a_freezer()
    steps = 150
    config = write_config(
        tmp_path,
        nodes=3,
        steps=steps,
        training={"global_batch": 6, "microbatch_size": 1},
        fault_tolerance={"straggler_factor": 1.5, "straggler_replan_after": "1s", "straggler_bench": "3s"},
    )
    run = Launch(
        tmp_path,
        config,
        "--nodes",
        "3",
        "--steps",
        str(steps),
        "--inject",
        "slow:node2@step10x16",
    )
    launches.append(run)

    def taken_back() -> bool:
        """node2 benched, then back and trained a step with: a stop inside the switch that takes it back is
        another scenario (the joiner's start-step agreement breaks, an ``aborted`` record, and the stop's
        checkpoint is still exact)."""
        benched = run.events("straggler_benched")
        back = [
            p["generation"]
            for p in run.events("plan_decided")
            if benched and p["generation"] > benched[0]["generation"] and "node2" in p["joined"]
        ]
        return bool(back) and bool(run.events("step", generation=back[0]))

    steps = _stop_when(run, taken_back, "node2 benched, then taken back")
    # node2 first, each of its benches twice as long as the one before. Another node may be benched as well
    # after it: on two shared cores a node can read slow for a while (a suite run at 2 xdist workers benched
    # node1 after node2: the three shared the cores the test beside them left); a real cluster's nodes do
    # not share cores (the emulated cluster measures that case: scripts/bench_emulated.py straggler).
    benched_all = run.events("straggler_benched")
    benched = [e for e in benched_all if e["node"] == "node2"]
    assert benched_all and benched_all[0]["node"] == "node2", benched_all
    assert [e["seconds"] for e in benched] == [3.0 * 2**i for i in range(len(benched))], "each bench twice as long"
    assert "benched for 3 s" in run.stdout
    plans = run.events("plan_decided")
    out = next(p for p in plans if p["generation"] == benched[0]["generation"])
    assert sorted(out["nodes"]) == ["node0", "node1"] and out["cause"] == "straggler", out
    assert [p["num_microbatches"] for p in out["layout"]["pipelines"]] == [3, 3], "the global batch is kept, even"
    back = [p for p in plans if p["generation"] > out["generation"] and "node2" in p["joined"]]
    # Taken back like a join once the bench ended. A straggler verdict on another node in the same moment
    # (seen beside two `yes` and three other tests: node1 read 1.65x against node0, the only other node
    # then) folds the return into its plan, whose cause is then that verdict's: one switch for both.
    assert back and back[0]["cause"] in ("joined", "straggler"), back[:1]
    assert [e["node"] for e in run.events("straggler_returns")][:1] == ["node2"]
    assert not run.events("lost") and not _aborted_before_the_stop(run), "benched at a boundary, nothing lost"
    assert_matches_reference(config, steps, _stop_checkpoint(run))
