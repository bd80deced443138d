"""The trace-driven simulator (``oobleck_mm.simulator``): invariants, hand-computed cases per system,
and the engine's own planner doing the planning."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from oobleck_mm.cli import main
from oobleck_mm.config import load_config
from oobleck_mm.faults.trace import parse_trace
from oobleck_mm.profiling.analytical import profile_from_config
from oobleck_mm.simulator import systems as systems_module
from oobleck_mm.simulator.availability import Availability, Change, from_trace, parse_duration, periodic
from oobleck_mm.simulator.params import SimParams
from oobleck_mm.simulator.run import simulate
from oobleck_mm.simulator.grid_systems import BambooSystem, VarunaSystem, bamboo_profile
from oobleck_mm.simulator.systems import OobleckSystem, RestartSystem
from oobleck_mm.simulator.timeline import KINDS, Layout, simulate_system

ROOT = Path(__file__).resolve().parents[2]
GPT2 = ROOT / "configs" / "paper" / "gpt2.yaml"  # n0 = 1 on an A40: small plans, fast planning
TRACES = ROOT / "data" / "traces"
FIXED = SimParams(planning_s=0.0, detection_s=1.0, rendezvous_s=2.0, worker_start_s=10.0, varuna_saves_on_signal=False)
NODES8 = [f"node{i + 1}" for i in range(8)]


@pytest.fixture(scope="module")
def job():
    return load_config(GPT2)


@pytest.fixture(scope="module")
def profile(job):
    return profile_from_config(job)


def check_invariants(result, global_batch: int) -> None:
    """Time monotonic and covered once; breakdown sums to wall time; samples only from whole iterations."""
    t = 0.0
    for seg in result.segments:
        assert seg.start == pytest.approx(t, abs=1e-6) and seg.end > seg.start, (seg, t)
        assert seg.kind in KINDS
        assert seg.samples == 0 or seg.kind == "compute"
        assert seg.samples % global_batch == 0
        t = seg.end
    assert t == pytest.approx(result.wall_s)
    assert sum(result.breakdown.values()) == pytest.approx(result.wall_s)
    assert result.samples == sum(s.samples for s in result.segments)
    assert result.samples % global_batch == 0 and result.samples >= 0


# --------------------------------------------------------------------------- availability


def test_a_trace_groups_simultaneous_events_and_starts_with_the_first_timestamp():
    events = parse_trace(
        [
            "5000,add,a",
            "5000,add,b",
            "5000,add,c",
            "65000,remove,b",
            "65000,remove,c",
            "125000,add,d",
            "125000,remove,zzz",
            "185000,remove,a",
        ]
    )
    av = from_trace(events, "t")
    assert av.initial == ("a", "b", "c")
    assert [(c.seconds, c.added, c.removed) for c in av.changes] == [
        (60.0, (), ("b", "c")),
        (120.0, ("d",), ()),
        (180.0, (), ("a",)),
    ]  # the removal of an absent node is dropped
    assert av.end_s == 180.0 and av.peak_nodes == 3
    scaled = from_trace(events, "t", replicas=3)
    assert len(scaled.initial) == 9 and scaled.changes[0].removed == ("b.0", "b.1", "b.2", "c.0", "c.1", "c.2")


def test_the_papers_controlled_failures_remove_one_node_per_interval_until_half_remain():
    av = periodic(30, 600.0)
    assert len(av.initial) == 30 and len(av.changes) == 15 and av.end_s == 15 * 600
    assert av.changes[0].removed == ("node30",) and av.nodes_at(av.end_s) == 15
    shipped = from_trace(parse_trace((TRACES / "10m.csv").read_text().splitlines()), "10m.csv")
    assert [c.seconds for c in shipped.changes] == pytest.approx([c.seconds for c in av.changes], rel=0.01)
    assert parse_duration("10m") == 600 and parse_duration("6h") == 21600 and parse_duration("90") == 90


# --------------------------------------------------------------------------- hand-computed cases


def two_losses() -> Availability:
    return periodic(8, 1000.0, until_nodes=6)  # node8 lost at 1000 s; the run ends at the second loss, 2000 s


def test_oobleck_by_hand(job, profile):
    system = OobleckSystem(job, profile, FIXED)
    result = simulate_system(system, two_losses())
    check_invariants(result, 8192)
    before = system_iteration(job, profile, NODES8)
    after = system_iteration(job, profile, NODES8[:7])
    done_before = math.floor(1000 / before)  # whole iterations; the one in flight is lost
    pause = 1.0 + 2.0  # detection + (planning 0 + rendezvous 2); 1-node pipelines: nothing to copy
    done_after = math.floor((1000 - pause) / after)
    assert result.samples == (done_before + done_after) * 8192
    b = result.breakdown
    assert b["compute"] == pytest.approx(done_before * before + done_after * after)
    assert b["detection"] == 1.0 and b["reconfiguration"] == 2.0 and b["state_copy"] == 0.0
    assert b["fallback"] == pytest.approx(2000 - pause - b["compute"])
    assert result.samples_per_s == pytest.approx(result.samples / 2000)


def system_iteration(job, profile, nodes) -> float:
    layout = OobleckSystem(job, profile, FIXED).start(list(nodes)).next
    assert isinstance(layout, Layout)
    return layout.iteration_s


@pytest.mark.parametrize("name", ["restart", "varuna"])
def test_checkpoint_restart_systems_by_hand(job, profile, name):
    params = SimParams(**{**_fields(FIXED), "restart_checkpoint_every": 3, "varuna_checkpoint_every": 3})

    def make():
        return RestartSystem(job, profile, params) if name == "restart" else VarunaSystem(job, profile, params, 8)

    system = make()
    step = system.start(NODES8).next.iteration_s
    save, load = system.checkpoint_save_s, system.load_s
    step_after = make().start(NODES8[:7]).next.iteration_s
    assert save > 0 and load > 0
    # 8 nodes: three iterations, a save, a fourth iteration; the loss at 1000 s throws away the
    # fourth and the one in flight.
    assert 4 * step + save <= 1000 < 5 * step + save
    restart = 10.0 + 0.0 + 2.0 + load  # worker start, planning, rendezvous, checkpoint load
    t, trained = 1000 + 1.0 + restart, 0  # after detection and the restart
    while True:
        if trained and trained % 3 == 0:
            t += save
        if t + step_after > 2000:
            break
        t += step_after
        trained += 1
    result = simulate_system(system, two_losses())
    check_invariants(result, 8192)
    assert result.samples == (3 + trained) * 8192
    b = result.breakdown
    assert b["restart"] == pytest.approx(restart) and b["detection"] == 1.0
    assert b["checkpoint_save"] == pytest.approx(save * (1 + trained // 3))
    assert result.incidents[0].rollback_s == pytest.approx(1000 - 3 * step - save)  # iteration 4 + the one in flight
    assert b["fallback"] == pytest.approx(1000 - 3 * step - save + (2000 - t))


def _fields(params: SimParams) -> dict:
    return {name: getattr(params, name) for name in params.__slots__}


def test_bamboo_by_hand(job):
    profile, note = bamboo_profile(job, FIXED, 8)
    assert profile is not None and note.startswith("microbatch")
    system = BambooSystem(job, profile, FIXED, 8, note)
    before = system.start(NODES8).next.iteration_s
    response = BambooSystem(job, profile, FIXED, 8, note)
    response.start(NODES8)
    pause = response.change(NODES8[:7], ["node8"], [], False)
    assert [kind for kind, _ in pause.pause] == ["detection", "reconfiguration", "state_copy"]
    after, pause_s = pause.next.iteration_s, sum(s for _, s in pause.pause)
    result = simulate_system(system, two_losses())
    check_invariants(result, 8192)
    assert result.samples == (math.floor(1000 / before) + math.floor((1000 - pause_s) / after)) * 8192
    # Redundant computation: Bamboo's iteration is slower than the same layout's without it.
    assert before > system_iteration(job, profile_from_config(job), NODES8)


def test_bamboo_is_out_of_memory_where_the_doubled_state_fits_no_pipeline():
    job = load_config(ROOT / "configs" / "paper" / "gpt3_6.7b.yaml")
    profile, note = bamboo_profile(job, SimParams(), 30)
    assert profile is None and note.startswith("OOM")
    result = simulate(job, periodic(30, 3600.0), ["bamboo"], SimParams(planning_s=0.0))[0]
    assert result.samples == 0 and result.breakdown["down"] == pytest.approx(result.wall_s)


def test_a_join_waits_for_the_iteration_boundary_and_loses_no_work(job, profile):
    av = Availability(tuple(NODES8), (Change(100.0, ("node9",), ()),), 1000.0, "join")
    system = OobleckSystem(job, profile, FIXED)
    result = simulate_system(system, av)
    check_invariants(result, 8192)
    first = result.incidents[0]
    step = system_iteration(job, profile, NODES8)
    assert first.seconds == pytest.approx(step) and first.rollback_s == 0.0  # at the boundary, nothing thrown
    # The rendezvous only: the joiner is planned once its workers are ready, the survivors train meanwhile.
    assert result.breakdown["reconfiguration"] == pytest.approx(2.0)
    stalled = simulate_system(OobleckSystem(job, profile, dataclasses.replace(FIXED, joiner_start_stalls=True)), av)
    assert stalled.breakdown["reconfiguration"] == pytest.approx(2.0 + 10.0)  # rendezvous + the joiner's start
    assert result.breakdown["state_copy"] > 0  # the new node receives every layer
    compute_before = [s for s in result.segments if s.kind == "compute" and s.end <= step + 1e-9]
    assert sum(s.samples for s in compute_before) == 8192


def test_varuna_saves_on_a_notice_and_keeps_its_work_when_the_save_fits_the_grace(job, profile):
    params = SimParams(**{**_fields(FIXED), "varuna_saves_on_signal": True, "preempt_grace_s": 3600.0})
    result = simulate_system(VarunaSystem(job, profile, params, 8), two_losses(), False, params.preempt_grace_s)
    check_invariants(result, 8192)
    assert result.incidents[0].rollback_s < system_iteration(job, profile, NODES8)  # only the iteration in flight
    tight = SimParams(**{**_fields(params), "preempt_grace_s": 0.001})
    lost = simulate_system(VarunaSystem(job, profile, tight, 8), two_losses(), False, tight.preempt_grace_s)
    assert lost.incidents[0].rollback_s > result.incidents[0].rollback_s  # back to the periodic checkpoint
    assert lost.samples < result.samples


def test_losing_every_replica_ends_the_run_and_a_later_start_begins_from_scratch(job, profile):
    three = ("node1", "node2", "node3")
    av = Availability(
        three, (Change(1000.0, (), ("node2", "node3")), Change(2000.0, ("node4", "node5"), ())), 3000.0, "zone loss"
    )
    system = OobleckSystem(job, profile, FIXED)
    result = simulate_system(system, av)
    check_invariants(result, 8192)
    assert result.incidents[0].outcome.startswith("down:")
    b = result.breakdown
    assert b["down"] == pytest.approx(1000 - 1.0)  # after detection, until the nodes come back
    assert b["restart"] == pytest.approx(10.0 + 0.0 + 2.0)
    restarted = 2000 + 12.0
    assert all(s.kind != "compute" for s in result.segments if s.end <= restarted)  # the first hour is gone
    assert result.samples > 0


# --------------------------------------------------------------------------- the planner is the engine's


class RecordingOobleck(OobleckSystem):
    def __init__(self, *args):
        super().__init__(*args)
        self.adopted = []

    def change(self, live, lost, joined, noticed, now=0.0):
        response = super().change(live, lost, joined, noticed, now)
        self.adopted.append((sorted(live), self.plan))
        return response


def test_every_plan_comes_from_the_engines_planner_and_keeps_the_batch_and_every_layer(job, profile, monkeypatch):
    calls = []

    def spy(real):
        def call(*args):
            outcome = real(*args)
            calls.append(outcome)
            return outcome

        return call

    for name in ("plan_fresh", "plan_reconfiguration"):
        monkeypatch.setattr(systems_module, name, spy(getattr(systems_module, name)))
    av = from_trace(parse_trace((TRACES / "g4dn-trace.csv").read_text().splitlines()), "g4dn")
    system = RecordingOobleck(job, profile, SimParams(planning_s=0.0))
    result = simulate_system(system, av)
    check_invariants(result, 8192)
    assert len(calls) == 1 + len(result.incidents) == 1 + len(system.adopted)  # one planner call per change
    assert sum(plan is not None for _, plan in system.adopted) > 50
    for (live, plan), (outcome, _) in zip(system.adopted, calls[1:]):
        if plan is None:
            continue
        assert plan is outcome.plan  # adopted as the planner returned it
        assert sorted(plan.nodes) == live  # every live node used
        assert sum(p.num_microbatches for p in plan.pipelines) * plan.microbatch_size == 8192
        for p in plan.pipelines:
            assert p.template.stages[0].layer_start == 0 and p.template.num_layers == profile.num_layers


@pytest.mark.parametrize("notice", [False, True], ids=["no-notice", "notice"])
@pytest.mark.parametrize("trace", ["g4dn-trace.csv", "scale_p3-trace.csv"])
@pytest.mark.parametrize("system", ["oobleck", "varuna", "bamboo", "restart", "varuna-no-ckpt"])
def test_invariants_on_spot_traces(job, system, trace, notice):
    av = from_trace(parse_trace((TRACES / trace).read_text().splitlines()), trace).clipped(3)
    result = simulate(job, av, [system], SimParams(planning_s=0.0, preemption_notice=notice))[0]
    check_invariants(result, 8192)
    assert result.samples > 0


# --------------------------------------------------------------------------- the command


def test_simulate_command_prints_the_table_and_writes_json_and_a_plot(tmp_path, capsys):
    out, plot = tmp_path / "sim.json", tmp_path / "sim.png"
    code = main(
        [
            "simulate",
            "--config",
            str(GPT2),
            "--failure-interval",
            "1h",
            "--nodes",
            "8",
            "--system",
            "oobleck",
            "varuna",
            "--param",
            "planning_s=0",
            "--json",
            str(out),
            "--plot",
            str(plot),
        ]
    )
    assert code == 0
    text = capsys.readouterr().out
    assert "| oobleck |" in text and "| varuna |" in text
    doc = json.loads(out.read_text())
    assert [d["system"] for d in doc] == ["oobleck", "varuna"]
    for d in doc:
        assert set(d["breakdown"]) == set(KINDS)
        assert sum(d["breakdown"].values()) == pytest.approx(d["wall_s"]) and d["samples_per_s"] > 0
    assert plot.stat().st_size > 10_000


def test_a_sweep_over_f_repeats_the_simulation_per_value(tmp_path, capsys):
    out = tmp_path / "sweep.json"
    assert (
        main(
            [
                "simulate",
                "--config",
                str(GPT2),
                "--failure-interval",
                "1h",
                "--nodes",
                "8",
                "--system",
                "oobleck",
                "--sweep",
                "f=0,2",
                "--param",
                "planning_s=0",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    doc = json.loads(out.read_text())
    assert [d["sweep"] for d in doc] == ["f=0", "f=2"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--system", "horovod"], "unknown system 'horovod'; valid: oobleck, varuna"),
        (["--param", "rendezvous_s=-1"], "rendezvous_s must be >= 0"),
        (["--param", "warp=9"], "unknown knob 'warp'"),
        (["--sweep", "training.global_batch"], "expected KNOB=v1,v2"),
        (["--until-nodes", "9"], "--until-nodes: must be in [0, 7]"),
        (["--failure-interval", "soon"], "duration 'soon': expected a number with s, m, h or d"),
        (["--trace", "/nonexistent.csv"], "--trace: '/nonexistent.csv' is no such file"),
        (["--hours", "0"], "--hours: must be > 0"),
    ],
)
def test_bad_input_is_exit_2_naming_the_value(capsys, args, message):
    base = ["simulate", "--config", str(GPT2), "--nodes", "8", "--system", "oobleck"]
    if "--trace" not in args and "--failure-interval" not in args:
        base += ["--failure-interval", "1h"]
    assert main(base + args) == 2
    assert message in capsys.readouterr().err


def test_oobleck_with_a_notice_finishes_the_iteration_in_flight_when_it_ends_inside_the_grace(job, profile):
    step = system_iteration(job, profile, NODES8)
    result = simulate_system(OobleckSystem(job, profile, FIXED), two_losses(), True, 3600.0)
    check_invariants(result, 8192)
    first = result.incidents[0]
    assert first.rollback_s == 0.0 and first.seconds == pytest.approx(math.ceil(1000 / step) * step)
    assert result.breakdown["detection"] == 0.0  # the notice named the node: nothing to detect
    short = simulate_system(OobleckSystem(job, profile, FIXED), two_losses(), True, 1.0)
    assert short.incidents[0].seconds == 1000.0 and short.incidents[0].rollback_s > 0  # the boundary is too far


# --------------------------------------------------------------------------- stragglers (issue 29 item 4)


def test_slow_lines_of_a_trace_and_a_straggler_distribution_become_changes_of_speed():
    from oobleck_mm.simulator.availability import parse_stragglers

    events = parse_trace(["0,add,a", "0,add,b", "0,add,c", "10000,slow,b,3,20", "50000,slow,c,2", "60000,remove,a"])
    av = from_trace(events, "t")
    assert [(c.seconds, c.added, c.removed, c.slowed) for c in av.changes] == [
        (10.0, (), (), (("b", 3.0),)),
        (30.0, (), (), (("b", 1.0),)),
        (50.0, (), (), (("c", 2.0),)),
        (60.0, (), ("a",), ()),
    ]
    nodes = periodic(100, 3600.0, 99)
    spec = parse_stragglers("0.05,min=1.5,max=3,seed=4,for=10m")
    slowed = nodes.with_stragglers(spec)
    starts = [c for c in slowed.changes if c.slowed and c.slowed[0][1] != 1.0]
    ends = [c for c in slowed.changes if c.slowed and c.slowed[0][1] == 1.0]
    assert len({c.slowed[0][0] for c in starts}) == 5 and all(1.5 <= c.slowed[0][1] <= 3 for c in starts)
    assert len(ends) == len([c for c in starts if c.seconds + 600 < slowed.end_s]), "each back after 10 minutes"
    assert nodes.with_stragglers(spec) == slowed, "the seed decides"
    for bad, named in [("2", "SHARE"), ("0.1,min=0.5", "min"), ("0.1,speed=2", "speed=2"), ("x", "SHARE")]:
        with pytest.raises(Exception, match=named):
            parse_stragglers(bad)


def _one_slow(nodes: int, factor: float, at: float, end: float, until: float | None = None) -> Availability:
    names = tuple(f"node{i + 1}" for i in range(nodes))
    changes = [Change(at, (), (), (("node2", factor),))]
    if until is not None:
        changes.append(Change(until, (), (), (("node2", 1.0),)))
    return Availability(names, tuple(changes), end, f"node2 x{factor}")


@pytest.mark.parametrize("system", ["oobleck", "varuna", "bamboo", "restart"])
def test_every_system_pays_a_slow_node_and_only_this_engine_acts_on_it(job, system):
    """Every pipeline waits for the slowest at the all-reduce: each system's samples/s drops under a 3x node.
    This engine (live) re-splits after its detector's window and gets some back; the others wait."""
    steady = _one_slow(8, 1.0001, 3600.0, 86400.0)
    slowed = _one_slow(8, 3.0, 600.0, 86400.0)
    before = simulate(job, steady, [system], FIXED)[0]
    after = simulate(job, slowed, [system], FIXED)[0]
    check_invariants(after, job.training.global_batch)
    assert after.samples_per_s < 0.9 * before.samples_per_s, (after.samples_per_s, before.samples_per_s)
    if system == "oobleck":
        assert after.straggler_actions.get("found") == 1
        waits = simulate(job, slowed, [system], dataclasses.replace(FIXED, straggler_mitigation=False))[0]
        assert waits.straggler_actions == {} and after.samples_per_s > 1.2 * waits.samples_per_s
    else:
        assert after.straggler_actions == {}


def test_a_transient_straggler_is_found_re_split_cleared_and_split_back(job):
    """Detected ``straggler_steps`` iterations after it slowed, re-split at a boundary (no copy), cleared as
    late after it recovered, and the last plan's split is the first's again; weighed, and kept: on eight
    one-node pipelines a 3x node's one microbatch costs less than its absence."""
    profile = profile_from_config(job)
    system = OobleckSystem(job, profile, FIXED)
    result = simulate_system(system, _one_slow(8, 3.0, 600.0, 86400.0, until=4 * 3600.0))
    check_invariants(result, job.training.global_batch)
    acted = result.straggler_actions
    assert (acted["found"], acted["cleared"], acted.get("benched", 0)) == (1, 1, 0), acted
    first = [p.num_microbatches for p in OobleckSystem(job, profile, FIXED).start(NODES8).next.state.pipelines]
    assert [p.num_microbatches for p in system.plan.pipelines] == first
    splits = [i for i in result.incidents if i.pause == (("reconfiguration", 2.0),)]
    assert len(splits) == 2 and 600 < splits[0].seconds < 4 * 3600 < splits[1].seconds


def test_a_node_slow_for_good_is_weighed_benched_and_taken_back_after_its_bench(job):
    """Nine one-node pipelines (GPT-2 on A40s): ``straggler_replan_after`` (60 s) after a 10x node was found,
    the plan of the eight others is predicted faster, so it is benched for ``straggler_bench`` (5 min) and
    then taken back like a join (the planner puts it in a two-node pipeline, where a re-split hides it: kept
    when weighed again); a second bench of the same node would last 10 min. Without the re-cut: with it, node2's
    two-node pipeline gives node2 2 of its 26 layers, predicted as fast as the plan without node2, so it stays."""
    recut_on = job
    job = dataclasses.replace(job, fault_tolerance=dataclasses.replace(job.fault_tolerance, straggler_recut=False))
    profile = profile_from_config(job)
    system = OobleckSystem(job, profile, FIXED)
    names = tuple(f"node{i + 1}" for i in range(9))
    av = Availability(names, (Change(300.0, (), (), (("node2", 10.0),)),), 24 * 3600.0, "node2 x10")
    result = simulate_system(system, av)
    check_invariants(result, job.training.global_batch)
    acted = [(what, round(t)) for t, n, what in system.st.actions if n == "node2"]
    assert [w for w, _ in acted] == ["found", "benched", "back", "found", "kept"], acted
    assert acted[2][1] - acted[1][1] == 300 and acted[1][1] - acted[0][1] == 60
    assert system.st.bench(0.0, "node2") == 600.0, "benched again: twice as long"
    waits = simulate_system(OobleckSystem(job, profile, dataclasses.replace(FIXED, straggler_mitigation=False)), av)
    assert result.samples_per_s > waits.samples_per_s
    cut = OobleckSystem(recut_on, profile, FIXED)
    cut_result = simulate_system(cut, av)
    check_invariants(cut_result, job.training.global_batch)
    assert [what for _, n, what in cut.st.actions if n == "node2"] == ["found", "kept"]
    assert cut_result.samples_per_s >= result.samples_per_s


def test_data_skew_slows_the_contiguous_split_and_the_balancer_buys_it_back():
    """``skew_batches``: plans priced on sampled batches of the job's data with the balancer's cost model. The
    contiguous split runs slower than mean samples would; the data-parallel balancer recovers part of it;
    Entrain's deferral is kept only where predicted faster, so never slower than the balancer alone."""
    from oobleck_mm.data.skew_samples import sampled_batches

    base = load_config(ROOT / "configs" / "tiny_mm.yaml")
    av = periodic(4, 1800.0, 3)
    samples = sampled_batches(base, 3)
    rates = {}
    for name, skew, enabled, deferral in (
        ("mean", 0, False, False),
        ("off", 3, False, False),
        ("dp", 3, True, False),
        ("dp+deferral", 3, True, True),
    ):
        job = dataclasses.replace(base, balance=dataclasses.replace(base.balance, enabled=enabled, deferral=deferral))
        result = simulate(job, av, ["oobleck"], dataclasses.replace(FIXED, skew_batches=skew), skew_samples=samples)[0]
        check_invariants(result, job.training.global_batch)
        rates[name] = result.samples_per_s
    assert rates["off"] < rates["dp"] <= rates["dp+deferral"] * (1 + 1e-9), rates
    assert rates["off"] < 0.95 * rates["mean"], rates  # skew costs the contiguous split


def test_a_negative_skew_batch_count_is_refused_naming_it():
    from oobleck_mm.errors import UserError

    with pytest.raises(UserError, match="skew_batches must be an integer >= 0, got -1"):
        SimParams(skew_batches=-1)
