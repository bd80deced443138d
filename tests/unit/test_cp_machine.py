"""The master's state machine under random event orders (hypothesis' stateful testing).

``machine_model.MachineModel`` plays the agents, the workers, the planner, the
clock and the operator around ``oobleck_mm.master.machine.step``; after every event the
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
from oobleck_mm.master.inputs import PlanAnswered
from oobleck_mm.protocol import oobleck_pb2 as pb
from oobleck_mm.master.effects import AskPlanner

EXAMPLES = int(os.environ.get("OOBLECK_MACHINE_EXAMPLES", "150"))
SHRINK = os.environ.get("OOBLECK_MACHINE_SHRINK", "1") != "0"
"""``scripts/bench_machine.py --mutants`` only asks whether a mutant is caught: no shrinking there."""

TestMachine = MachineModel.TestCase
TestMachine.settings = settings(
    max_examples=EXAMPLES,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    phases=list(Phase) if SHRINK else [Phase.explicit, Phase.reuse, Phase.generate],
)


def test_the_fake_planner_uses_every_node_once_in_two_node_pipelines():
    planned = answer(AskPlanner(1, "reconfigure", base=FakePlan(("a", "b", "c", "d")), lost=("b",), joined=("e", "f")))
    assert sorted(n for n, _ in planned.ranks) == ["a", "c", "d", "e", "f"]
    assert [len(p.stages) for p in planned.layout.pipelines] == [2, 3]
    assert type(answer(AskPlanner(2, "fresh", names=("a", "b", "c")))).__name__ == "CannotKeepReplicas"


def test_a_plan_the_membership_overtook_is_superseded_and_the_latest_membership_planned_once():
    """Issue 27 item 5: a second loss while a plan is computed no longer waits for the stale plan."""
    from oobleck_mm.master.effects import CancelPlan
    from oobleck_mm.master.inputs import PlanAnswered

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
    from oobleck_mm.master.inputs import PlanAnswered, Straggler

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
    m.feed(Straggler("n1", 3.5, detected=True, step=7))  # its factor changed, its pipeline's split cannot
    [again] = m.world.asked.values()
    m.feed(PlanAnswered(again.id, answer(m.world.asked.pop(again.id))))
    assert m.state.generation == 2 and m.state.gens[2].slow == (("n1", 3.5),), "the same split: no switch"
    m.time_passes(1.0)
    assert not m.world.asked, "and not asked again"
    m.train_a_step(phases=True)
    m.feed(Straggler("n1", 1.0, detected=False, step=12))
    [back] = m.world.asked.values()
    assert back.slow == (), "cleared: split for the templates' own speeds, not left as it was"

    off = MachineModel()
    off.start(steps=100, recovery="live", interval=0, started=4, resplit=False)
    off.train_a_step(phases=True)
    off.feed(Straggler("n1", 2.0, detected=True, step=3))
    assert not off.world.asked and off.state.generation == 1


def test_a_straggler_still_slow_after_replan_after_is_weighed_once_benched_at_a_boundary_and_taken_back():
    """Issue 29 item 3(b): a node still slow ``straggler_replan_after`` (2 s here) after it was found is
    weighed once (``AskPlanner.bench``); the fake planner predicts the job faster without a 3.5x node, so it
    is planned out at an iteration boundary (nothing abandoned), told ``Bench``, kept out for
    ``straggler_bench`` (10 s) and then taken back like a join once its fresh workers are ready. Benched
    again, it stays out twice as long. A 2x node is weighed, kept, and never weighed again while slow."""
    from oobleck_mm.master.inputs import PlanAnswered, Straggler
    from oobleck_mm.protocol import oobleck_pb2 as pb

    m = MachineModel()
    m.start(steps=1000, recovery="live", interval=0, started=6)
    while len(m.state.current_view().nodes) < 6:
        m.settle_once()
    m.feed(Straggler("n1", 3.5, detected=True, step=3))
    [split] = m.world.asked.values()
    assert split.bench == () and split.slow == (("n1", 3.5),), "found slow: re-split first, not weighed yet"
    m.feed(PlanAnswered(split.id, answer(m.world.asked.pop(split.id))))
    m.train_a_step(phases=True)
    m.time_passes(1.0)
    assert not m.world.asked, "weighed only once straggler_replan_after passed"
    m.time_passes(1.2)
    [weigh] = m.world.asked.values()
    assert weigh.bench == ("n1",) and (weigh.lost, weigh.joined) == ((), ())
    before = m.state.generation
    m.feed(PlanAnswered(weigh.id, answer(m.world.asked.pop(weigh.id))))
    gen = m.state.gens[m.state.generation]
    assert m.state.generation == before + 1 and "n1" not in gen.view.nodes and gen.slow == ()
    assert all(a.assignment.at_boundary for n, a in m.world.agents.items() if n != "n1"), "no iteration abandoned"
    assert m.world.agents["n1"].assignment is None and not m.state.registry.nodes["n1"].all_ready
    assert m.state.benched["n1"].times == 1 and "n1" in m.state.registry.names(), "still registered: not lost"
    # Its fresh workers are ready at once, yet it stays out for the bench's 10 s.
    m.world.agents["n1"].ready = True
    m.report(m.world.agents["n1"], ready=pb.WorkerReady(startup_s=1.0))
    for _ in range(30):
        m.settle_once()
    assert "n1" not in m.state.current_view().nodes, "on the bench for 10 s"
    for _ in range(60):
        m.settle_once()
    assert "n1" in m.state.current_view().nodes, "taken back like a join once the bench ended"
    # Found slow again and still benchable: the second bench is twice as long.
    m.feed(Straggler("n1", 3.5, detected=True, step=m.state.next_step))
    for _ in range(40):
        m.settle_once()
    assert m.state.benched["n1"].times == 2
    assert m.state.benched["n1"].until - m.now > 10.0, "benched again: 20 s, not 10"

    kept = MachineModel()
    kept.start(steps=1000, recovery="live", interval=0, started=6)
    while len(kept.state.current_view().nodes) < 6:
        kept.settle_once()
    kept.feed(Straggler("n2", 2.0, detected=True, step=3))
    for _ in range(20):
        kept.settle_once()
    generation = kept.state.generation
    assert "n2" in kept.state.weighed and "n2" in kept.state.current_view().nodes
    for _ in range(20):
        kept.settle_once()
    assert kept.state.generation == generation, "weighed once and kept: no plan after plan"
    kept.feed(Straggler("n2", 3.5, detected=True, step=40))  # its factor changed: 3.5x now
    for _ in range(20):
        kept.settle_once()
    assert "n2" in kept.state.benched, "much slower than when it was weighed: weighed again, and benched"

    # With 4 nodes (the fewest that keep f + 1 replicas here) nobody is weighed: a bench would stop the job.
    few = MachineModel()
    few.start(steps=1000, recovery="live", interval=0, started=4)
    few.feed(Straggler("n2", 3.5, detected=True, step=3))
    for _ in range(20):
        few.settle_once()
    assert not few.state.weighed and not few.state.benched and len(few.state.current_view().nodes) == 4


def _slowed_without_a_new_split(planned, current, slow_node: str):
    """``planned`` with ``current``'s microbatches, and ``slow_node``'s stage annotated slow: the split a real
    planner returns when a slow node's pipeline cannot be given less work."""
    import dataclasses

    rank = dict(planned.ranks)[(slow_node, 0)]
    pipelines = tuple(
        dataclasses.replace(
            p,
            num_microbatches=c.num_microbatches,
            stages=tuple(dataclasses.replace(s, slowdown=2.0 if s.rank == rank else 1.0) for s in p.stages),
        )
        for p, c in zip(planned.layout.pipelines, current.layout.pipelines)
    )
    return dataclasses.replace(planned, layout=dataclasses.replace(planned.layout, pipelines=pipelines))


def test_a_speed_change_that_only_marks_a_stage_slow_switches_only_when_the_balancer_weighs_speeds():
    """A stage's ``slowdown`` is read by the workers' balancer alone: without it, a plan with the current
    microbatches is the current plan, and a switch to it is a rendezvous for nothing (on two shared cores a
    healthy node's factor wandered past 1.5x and back, re-planning 8 times in 150 steps)."""
    import dataclasses

    from oobleck_mm.master.inputs import PlanAnswered, Straggler

    for balanced in (False, True):
        m = MachineModel()
        m.start(steps=100, recovery="live", interval=0, started=4)
        job = m.settings.job
        m.settings = dataclasses.replace(
            m.settings, job=dataclasses.replace(job, balance=dataclasses.replace(job.balance, enabled=balanced))
        )
        m.train_a_step(phases=True)
        m.feed(Straggler("n1", 2.0, detected=True, step=3))
        [ask] = m.world.asked.values()
        planned = _slowed_without_a_new_split(answer(m.world.asked.pop(ask.id)), m.state.current_view(), "n1")
        m.feed(PlanAnswered(ask.id, planned))
        if balanced:
            assert m.state.generation == 2, "the balancer weighs the slowed stage: a new generation"
        else:
            assert m.state.generation == 1, "no balancer: the same microbatches are the same plan, no switch"
        assert m.state.gens[m.state.generation].slow == (("n1", 2.0),), "the speeds are the generation's either way"
        m.time_passes(1.0)
        assert not m.world.asked, "and not asked again"


def test_a_restarted_master_stops_waiting_for_a_missing_node_once_the_generation_broke_and_nobody_came_back():
    """A node killed while the master was away never registers again. The adoption window
    (``adopt_window``) waits for it, which costs nothing while the workers train, but once a worker of the
    generation aborted (its peer is gone) every survivor waits idle for a plan: soak (c) lost 4 s so.
    Adoption then ends ``ADOPT_QUIET_INTERVALS`` heartbeat intervals after the last node came back."""
    from oobleck_mm.master.adoption import ADOPT_QUIET_INTERVALS
    from oobleck_mm.master.inputs import PlanAnswered
    from oobleck_mm.master.state import JobPhase
    from oobleck_mm.protocol import oobleck_pb2 as pb

    for broken in (False, True):
        m = MachineModel()
        m.start(steps=100, recovery="live", interval=0, started=6)
        while len(m.state.current_view().nodes) < 6:
            m.settle_once()
        m.train_a_step(phases=True)
        quiet = ADOPT_QUIET_INTERVALS * m.settings.timeouts.heartbeat_interval.total_seconds()
        window = m.settings.timeouts.adopt_window.total_seconds()
        assert window > quiet + 1.0, "the window is longer than the quiet period"
        m.world.agents.pop("n5")  # killed while the master was away: it never registers again
        m.master_restarts(now=0)  # the five others register again at once
        restarted = m.now
        m.time_passes(0.3)
        assert m.state.phase is JobPhase.ADOPTING
        if broken:
            generation = m.state.generation
            m.report(
                m.world.agents["n0"],
                phase=pb.PhaseDone(
                    generation=generation, phase="aborted", step=1, message="receive from rank 5: connection reset"
                ),
            )
        m.time_passes(quiet)
        if not broken:
            assert m.state.phase is JobPhase.ADOPTING, "the workers train on: the window runs its course"
            continue
        assert m.state.phase is not JobPhase.ADOPTING and m.now - restarted < window, (
            f"still adopting {m.now - restarted:.1f} s after the restart (window {window:g} s)"
        )
        m.time_passes(0.1)  # the settle window of the loss, then its plan
        [ask] = m.world.asked.values()
        assert ask.lost == ("n5",), ask
        m.feed(PlanAnswered(ask.id, answer(m.world.asked.pop(ask.id))))
        assert m.state.generation == generation + 1 and "n5" not in m.state.current_view().nodes


def test_restart_mode_keeps_the_checkpoint_it_planned_from_and_restarts_once_from_a_newer_one():
    """Issue 56: generation 2 (restart mode, after a loss) was told to load step 4's checkpoint; then the
    shares of steps 6, 8 and 10, written by generation 1 before it stopped, completed. Pruning (one kept)
    deleted step 4 under the restarted workers, which stopped the job with exit 2. Now step 4 stays pinned
    until generation 2 completes a step, and once generation 2's fresh workers report (generation 1's are gone
    then, and no newer checkpoint can follow) one restart takes the newest (step 10)."""
    from oobleck_mm.master.effects import PruneCheckpoints, Send

    m = MachineModel()
    m.start(steps=100, recovery="restart", interval=2, started=5)
    for _ in range(3):  # steps 1-3 after the start's step 0
        m.train_a_step(phases=True)
        m.periodic_checkpoint()
    assert m.state.checkpoints.last == ("/run/checkpoints/step00000004", 4)
    m.kill_named(sorted(m.state.current_view().nodes)[-1])
    m.time_passes(0.3)
    for plan_id in sorted(m.world.asked):  # planned: generation 2 loads step 4
        m.feed(PlanAnswered(plan_id, answer(m.world.asked.pop(plan_id))))
    assert m.state.generation == 2 and m.state.pin == (2, "/run/checkpoints/step00000004", 4)
    pins, restarts = [], []
    original = m.carry_out

    def watch(effect):
        if isinstance(effect, PruneCheckpoints):
            pins.append(effect.pinned)
        event = pb.AgentEvent.FromString(effect.event.SerializeToString()) if isinstance(effect, Send) else None
        if event is not None and event.WhichOneof("event") == "restart":
            restarts.append(event.restart.reason)
        return original(effect)

    m.carry_out = watch
    agent = next(a for a in m.world.agents.values() if not a.hung)
    for step in (6, 8, 10):  # generation 1's shares, written while its agents had no restart yet
        m.report(
            agent,
            checkpoint_done=pb.CheckpointDone(
                dir=f"/run/checkpoints/step{step:08d}", generation=1, step=step, layers=1
            ),
        )
        m.time_passes(0.6)
    assert pins and all("/run/checkpoints/step00000004" in p for p in pins), pins
    assert "/run/checkpoints/step00000004" in m.world.disk and m.state.generation == 2, "kept; no restart yet"
    for a in [a for a in m.world.agents.values() if a.assignment is not None]:  # generation 2's fresh workers
        m.report(a, phase=pb.PhaseDone(generation=2, phase="rendezvous", step=4))
    m.time_passes(0.3)  # one restart
    for plan_id in sorted(m.world.asked):
        m.feed(PlanAnswered(plan_id, answer(m.world.asked.pop(plan_id))))
    live = len(m.state.current_view().nodes)
    assert len(restarts) == live and set(restarts) == {restarts[0]}, restarts  # one restart, told to each node
    assert "newer checkpoint of step 10" in restarts[0], restarts
    assert m.state.generation == 3 and m.state.pin == (3, "/run/checkpoints/step00000010", 10)
    assert {a.assignment.resume_dir for a in m.world.agents.values() if a.assignment} == {
        "/run/checkpoints/step00000010"
    }
    m.train_a_step(phases=True)
    # A step of generation 3 completed (every rank loaded it): only the newest complete one stays pinned
    assert m.state.pinned() == (m.state.checkpoints.last[0],)


def test_pruning_for_a_checkpoint_never_removes_a_newer_one_the_master_has_not_heard_of():
    """Restart mode, a fault tour under load: the workers wrote steps 6, 8 and 10 (rank 0 writes meta.json)
    while their reports waited (a master that re-adopted them hears of them in a burst). The prune for step
    6 counted step 10 on disk and removed step 8; step 8's report then made it the master's newest, a loss
    restarted from it, and its layers were gone (exit 3, "checkpoint has no layer"). Now a prune counts and
    removes nothing newer than the checkpoint it completes."""
    m = MachineModel()
    m.start(steps=100, recovery="restart", interval=2, started=5)
    for _ in range(3):
        m.train_a_step(phases=True)
        m.periodic_checkpoint()
    assert m.state.checkpoints.last == ("/run/checkpoints/step00000004", 4)
    for step in (6, 8, 10):  # complete on disk, not reported yet
        m.world.disk.add(f"/run/checkpoints/step{step:08d}")
    for step in (6, 8):  # the reports of steps 6, then 8, arrive
        while m.state.next_step < step:
            m.train_a_step(phases=True)
        m.periodic_checkpoint()
    assert m.state.checkpoints.last == ("/run/checkpoints/step00000008", 8)
    assert {"/run/checkpoints/step00000008", "/run/checkpoints/step00000010"} <= m.world.disk, sorted(m.world.disk)
    m.kill_named(sorted(m.state.current_view().nodes)[-1])
    m.time_passes(0.3)
    for plan_id in sorted(m.world.asked):  # the restart loads step 8: the model asserts it is on disk
        m.feed(PlanAnswered(plan_id, answer(m.world.asked.pop(plan_id))))
    m.generation_workers()
    assert m.state.pin is not None and m.state.pin[1] in m.world.disk


def test_a_checkpoint_the_run_chose_and_cannot_read_is_never_exit_2():
    """Issue 56 item 2: the workers of a restart generation cannot read the checkpoint the master chose (they
    abandon the iteration naming it). With a newer complete one the restart takes that one; with none left the
    job stops with exit 3 and a true message, never exit 2 (the code for the user's mistake)."""
    from oobleck_mm.errors import ExitCode

    def restarted_from_step_4(newer: bool) -> MachineModel:
        m = MachineModel()
        m.start(steps=100, recovery="restart", interval=2, started=5)
        for _ in range(3):
            m.train_a_step(phases=True)
            m.periodic_checkpoint()
        m.kill_named(sorted(m.state.current_view().nodes)[-1])
        m.time_passes(0.3)
        for plan_id in sorted(m.world.asked):
            m.feed(PlanAnswered(plan_id, answer(m.world.asked.pop(plan_id))))
        assert m.state.pin == (2, "/run/checkpoints/step00000004", 4)
        if newer:  # a late share of generation 1 completes step 6
            m.report(
                m.world.agents["n0"],
                checkpoint_done=pb.CheckpointDone(dir="/run/checkpoints/step00000006", generation=1, step=6, layers=1),
            )
        for agent in [a for a in m.world.agents.values() if a.assignment is not None]:
            assert agent.assignment.resume_chosen, "the master says the checkpoint is its own choice"
            m.report(
                agent,
                phase=pb.PhaseDone(
                    generation=2,
                    phase="aborted",
                    bad_checkpoint="/run/checkpoints/step00000004",
                    message="not a complete checkpoint (no meta.json)",
                ),
            )
        return m

    m = restarted_from_step_4(newer=False)
    assert m.state.finish is not None and m.state.finish.exit_code == ExitCode.NO_REPLICAS
    assert "step00000004" in m.state.finish.message and "cannot be read" in m.state.finish.message

    m = restarted_from_step_4(newer=True)
    assert m.state.finish is None
    m.settle()
    assert m.state.pin == (3, "/run/checkpoints/step00000006", 6), m.state.pin  # restarted from the newer one
    assert m.state.finish is not None and m.state.finish.exit_code == ExitCode.OK, m.state.finish


def test_pruning_never_removes_the_checkpoint_the_master_would_restart_from():
    """Seen in the restart-mode fault tour after a killmaster: the workers trained on and wrote the checkpoint of
    step 8 (complete on disk: restart mode's rank 0 writes meta.json) while the report of step 6 reached the
    restarted master first. Pruning keeps the newest complete on disk, so completing step 6 deleted it, and the
    restart after the next loss was told to load a folder that was gone. Found by the model at 4,000 examples."""
    m = MachineModel()
    m.start(steps=100, recovery="restart", interval=2, started=5)
    for _ in range(5):
        m.train_a_step(phases=True)
    m.checkpoint_on_disk_unreported(ahead=2)  # step 8, on disk only
    m.periodic_checkpoint()  # step 6, reported: the master's newest
    assert m.state.checkpoints.last == ("/run/checkpoints/step00000006", 6)
    assert "/run/checkpoints/step00000006" in m.world.disk, "kept: it is what the master restarts from"
    m.kill_named(sorted(m.state.current_view().nodes)[-1])
    m.settle()
    assert m.state.pin is not None and m.state.pin[1] == "/run/checkpoints/step00000006"


def test_the_machine_detects_every_detector_tick_and_at_once_after_a_stream_ended():
    """Issue 53 item 2: the detection cadence is the machine's (it was the shell's): a tick detects once
    ``detector_tick`` passed since the last detection, or at the first tick after a node's health changed."""
    from oobleck_mm.master.inputs import StreamEnded, Tick

    m = MachineModel()
    m.start(steps=100, recovery="live", interval=0, started=4)
    tick = m.settings.timeouts.detector_tick.total_seconds()
    m.feed(Tick())
    assert m.state.next_detection == m.now + tick
    m.now += tick / 2
    m.feed(Tick())
    assert m.state.next_detection == m.now - tick / 2 + tick, "half a tick later: no detection"
    victim = m.world.agents.pop("n2")
    m.feed(StreamEnded(victim.name, victim.session))
    assert m.state.next_detection == float("-inf")
    m.now += 0.001
    m.feed(Tick())
    assert m.state.next_detection == m.now + tick, "the first tick after a stream ended detects"
