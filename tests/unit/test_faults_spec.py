"""``--inject`` specs and trace replay: pure parsing into the injector's ``FaultEvent`` timeline."""

from __future__ import annotations

from pathlib import Path

import re

import pytest

from oobleck_mm.errors import UserError
from oobleck_mm.faults.spec import FaultEvent, check_targets, parse_inject, parse_token
from oobleck_mm.faults.trace import load_timeline, parse_trace, read_trace, starting_nodes, trace_timeline

# The public spot-availability traces the repository ships (data/traces/README.md).
TRACES = Path(__file__).resolve().parents[2] / "data" / "traces"
NODES4 = [f"node{i}" for i in range(4)]


# ---------------------------------------------------------------------- specs
def test_every_form_parses_to_its_kind_target_and_time():
    events = parse_inject(
        [
            "kill:node1@step4,killworker:node2@step6",
            "killworker:node2:gpu3@t1.5s",
            "stop:node3@step8",
            "join@step10",
            "join:node9@t0s",
        ]
    )
    assert [(e.kind, e.node, e.local_rank, e.step, e.seconds) for e in events] == [
        ("kill", "node1", 0, 4, None),
        ("killworker", "node2", 0, 6, None),
        ("killworker", "node2", 3, None, 1.5),
        ("stop", "node3", 0, 8, None),
        ("join", None, 0, 10, None),
        ("join", "node9", 0, None, 0.0),
    ]
    assert [e.is_failure for e in events] == [True, True, True, True, False, False]


def test_a_preemption_is_a_notice_then_a_kill_after_its_seconds():
    a, b = parse_inject("preempt:node1@step4+12.5s,preempt:node2@t3s")
    assert (a.kind, a.node, a.step, a.notice_s, a.is_failure) == ("preempt", "node1", 4, 12.5, True)
    assert (b.seconds, b.notice_s) == (3.0, 30.0)  # GCP's 30 s notice unless told
    for bad, names in (
        ("kill:node1@step4+5s", "for preempt and slow only"),
        ("preempt:node1@step4+5", "bad notice '5'"),
    ):
        with pytest.raises(ValueError, match=names):
            parse_token(bad)


def test_a_slowdown_has_a_factor_and_a_duration_and_is_neither_a_failure_nor_a_join():
    a, b, c = parse_inject("slow:node1@step50x2.5+20s,slow:node2@t3s,slow:node3@step4+1.5s")
    assert (a.kind, a.node, a.step, a.factor, a.duration_s, a.is_failure) == ("slow", "node1", 50, 2.5, 20.0, False)
    assert (b.seconds, b.factor, b.duration_s) == (3.0, 2.0, None)  # half speed, for good, unless told
    assert (c.factor, c.duration_s) == (2.0, 1.5)
    for bad, names in (
        ("slow:node1@step4x1", "bad slowdown 'x1'"),
        ("slow:node1@step4x0.5", "F > 1"),
        ("slow:node1@step4+5", "bad duration '5'"),
        ("slow:node1@phase:copy", "for failures"),
        ("kill:node1@step4x2", "bad time 'step4x2'"),
        ("slow@step3", "slow takes exactly one node"),
    ):
        with pytest.raises(ValueError, match=re.escape(names)):
            parse_token(bad)
    with pytest.raises(ValueError, match="node 'node5' is not in this run"):
        check_targets(parse_inject("slow:node5@step3"), NODES4)


def test_describe_round_trips():
    for token in (
        "kill:node1@step4",
        "killworker:node2:gpu1@step6",
        "stop:n-3.a@t12.5s",
        "join@step0",
        "join:node7@t3s",
        "preempt:node3@step2+7.5s",
        "slow:node1@step3x3+4s",
        "slow:node2@t1sx1.5",
    ):
        event = parse_token(token)
        assert parse_token(event.describe()) == FaultEvent(
            kind=event.kind,
            node=event.node,
            step=event.step,
            seconds=event.seconds,
            local_rank=event.local_rank,
            notice_s=event.notice_s,
            factor=event.factor,
            duration_s=event.duration_s,
            source=event.describe(),
        )


def test_same_step_events_are_due_together_and_time_events_wait_for_the_first_step():
    a, b, c = parse_inject("kill:node1@step3,stop:node2@step3,kill:node0@t2s")
    assert not a.due(None, None) and not a.due(2, 10.0)
    assert a.due(3, None) and b.due(3, None)
    assert not c.due(10, None), "time events count from the first completed step"
    assert not c.due(10, 1.99) and c.due(0, 2.0)
    assert parse_token("join@step0").due(0, None), "step0 fires once a plan exists"


@pytest.mark.parametrize(
    "value, names",
    [
        ("kill:node1", "missing '@stepN'"),
        ("kill:node1@4", "bad time '4'"),
        ("kill:node1@step-1", "bad time"),
        ("kill:node1@t5", "bad time 't5'"),
        ("explode:node1@step2", "unknown kind 'explode'"),
        ("kill@step2", "kill takes exactly one node"),
        ("kill:a:b@step2", "kill takes exactly one node"),
        ("killworker:node2:cpu1@step2", "bad worker 'cpu1'"),
        ("join:a:b@step1", "join takes at most a node name"),
        ("stop:no/de@step1", "bad node name 'no/de'"),
        ("kill:node1@step1,,stop:node2@step2", "empty event"),
    ],
)
def test_bad_tokens_name_the_token_and_the_valid_forms(value, names):
    with pytest.raises(ValueError) as err:
        parse_inject(value)
    message = str(err.value)
    assert names in message
    assert "valid forms" in message and "kill:NODE@stepN" in message
    if "," not in value:
        assert repr(value) in message


# ---------------------------------------------------------------------- traces
def test_trace_lines_are_validated_with_file_and_line():
    with pytest.raises(ValueError, match=r"t\.csv:2: .*add or remove"):
        parse_trace(["0,add,node1", "5,boom,node2"], name="t.csv")
    with pytest.raises(ValueError, match=r"t\.csv:1: .*non-negative integer"):
        parse_trace(["-5,add,node1"], name="t.csv")
    with pytest.raises(ValueError, match="no events"):
        parse_trace(["", "  "], name="t.csv")


def test_simultaneous_trace_events_keep_file_order_after_sorting():
    events = parse_trace(["20,remove,b", "10,add,a", "20,remove,a", "10,add,b"])
    assert [(e.ms, e.action, e.node) for e in events] == [
        (10, "add", "a"),
        (10, "add", "b"),
        (20, "remove", "b"),
        (20, "remove", "a"),
    ]


def test_timeline_kills_the_newest_live_node_and_names_joins_after_the_highest():
    events = parse_trace(
        ["0,add,x1", "0,add,x2", "1000,remove,x1", "1000,remove,x2", "3000,add,x3", "4000,remove,x3", "5000,add,x4"]
    )
    timeline = trace_timeline(events, ["node0", "node1", "node2", "node10"], time_scale=0.5)
    assert [(e.kind, e.node, e.seconds) for e in timeline] == [
        ("kill", "node10", 0.5),
        ("kill", "node2", 0.5),  # node10 sorts after node2 (numbers, not text)
        ("join", "node11", 1.5),
        ("kill", "node11", 2.0),
        ("join", "node12", 2.5),
    ]
    assert all(e.seconds is not None and e.step is None for e in timeline)


def test_a_trace_slows_the_newest_live_node_for_its_scaled_duration():
    events = parse_trace(["0,add,x1", "0,add,x2", "1000,slow,x1,3,20", "2000,slow,x2,1.5", "3000,remove,x2"])
    timeline = trace_timeline(events, ["node0", "node1"], time_scale=0.5)
    assert [(e.kind, e.node, e.seconds, e.factor, e.duration_s) for e in timeline] == [
        ("slow", "node1", 0.5, 3.0, 10.0),
        ("slow", "node1", 1.0, 1.5, None),
        ("kill", "node1", 1.5, 2.0, None),
    ]
    assert starting_nodes(events) == ["x1", "x2"], "a slowdown is no member of the population"
    for bad, words in (
        ("5,slow,x1", "F[,T]"),
        ("5,slow,x1,0.5", "F > 1"),
        ("5,slow,x1,abc", "must be numbers"),
        ("5,slow,x1,2,-1", "T >= 0"),
    ):
        with pytest.raises(ValueError, match=re.escape(words)):
            parse_trace([bad], name="t.csv")


def test_timeline_never_kills_more_nodes_than_are_live():
    events = parse_trace(["0,add,a", *(f"{t},remove,n{t}" for t in range(1, 6))])
    timeline = trace_timeline(events, ["node0", "node1"])
    assert [e.node for e in timeline] == ["node1", "node0"]


def test_timeline_window_and_scale_are_checked():
    events = parse_trace(["0,add,a", "1000,remove,a", "2000,add,b", "3000,remove,b"])
    timeline = trace_timeline(events, ["node0", "node1"], time_scale=2.0, start_s=1.0, end_s=2.5)
    assert [(e.kind, e.node, e.seconds) for e in timeline] == [("join", "node2", 2.0)]
    with pytest.raises(ValueError, match="--time-scale"):
        trace_timeline(events, ["node0"], time_scale=0)
    with pytest.raises(ValueError, match="end"):
        trace_timeline(events, ["node0"], start_s=3, end_s=1)


def test_the_shared_synthetic_trace_replays_one_removal_per_period():
    timeline = load_timeline(TRACES / "10m.csv", NODES4, time_scale=0.01)
    # 30 nodes at t=0 are the starting cluster; then a removal every ~10 min, one-for-one.
    assert [e.node for e in timeline] == ["node3", "node2", "node1", "node0"]
    gaps = [b.seconds - a.seconds for a, b in zip(timeline, timeline[1:])]
    assert all(abs(g - 6.012) < 1e-9 for g in gaps), gaps
    assert timeline[0].source.startswith("10m.csv:")


def test_every_shared_trace_parses_and_replays_in_time_order():
    paths = sorted(TRACES.glob("*.csv"))
    assert len(paths) >= 2
    for path in paths:
        events = read_trace(path)
        timeline = load_timeline(path, NODES4, time_scale=0.001)
        times = [e.seconds for e in timeline]
        assert times == sorted(times), path.name
        later = [e for e in events if e.ms > events[0].ms]
        assert len(timeline) <= len(later), path.name


def test_hold_points_parse_per_node_and_refuse_unknown_points():
    from oobleck_mm.runtime.hold import holds

    assert holds("checkpoint@node1:3, copy:0.5") == {("checkpoint", "node1"): 3.0, ("copy", None): 0.5}
    assert holds("") == {}
    with pytest.raises(ValueError, match="the point must be one of checkpoint, copy, rendezvous"):
        holds("barrier:1")
    with pytest.raises(ValueError, match="expected point\\[@node\\]:seconds"):
        holds("checkpoint@node1")


def test_the_pace_starts_steps_no_closer_than_it_says_and_holds_no_slower_step(monkeypatch):
    """``pace:S``: a step that took less than S is made up to S by sleeping; one that took longer is not
    held at all; ``pace@node2`` paces node2 only."""
    import time

    from oobleck_mm.runtime import hold

    monkeypatch.setattr(hold, "_last_step_start", None)
    monkeypatch.setenv(hold.ENV, "pace@node1:0.2")
    starts = []
    for step in range(3):
        hold.hold_step(step, "node1")
        starts.append(time.monotonic())
    assert all(b - a >= 0.2 for a, b in zip(starts, starts[1:])), starts
    time.sleep(0.25)  # a step slower than the pace
    before = time.monotonic()
    hold.hold_step(3, "node1")
    assert time.monotonic() - before < 0.05
    before = time.monotonic()
    hold.hold_step(4, "node2")  # not paced
    assert time.monotonic() - before < 0.05
    assert hold.holds("pace:0.1") == {("pace", None): 0.1}


def test_phase_triggers_parse_for_failures_and_say_which_workers_hold():
    from oobleck_mm.faults.spec import PHASE_HOLD_S, hold_points
    from oobleck_mm.runtime.hold import holds

    faults = parse_inject(
        "kill:node1@phase:copy,stop:node2@phase:rendezvous,kill:node3@phase:registered,"
        "preempt:node0@phase:checkpoint+5s"
    )
    assert [(f.kind, f.node, f.phase) for f in faults] == [
        ("kill", "node1", "copy"),
        ("stop", "node2", "rendezvous"),
        ("kill", "node3", "registered"),
        ("preempt", "node0", "checkpoint"),
    ]
    assert [f.describe() for f in faults][:3] == [
        "kill:node1@phase:copy",
        "stop:node2@phase:rendezvous",
        "kill:node3@phase:registered",
    ]
    assert not any(f.due(100, 100.0) for f in faults), "never by steps or time"
    # The node's worker holds in its phase (registered is the master's event: nothing to hold).
    assert holds(hold_points(faults)) == {
        ("copy", "node1"): PHASE_HOLD_S,
        ("rendezvous", "node2"): PHASE_HOLD_S,
        ("checkpoint", "node0"): PHASE_HOLD_S,
    }
    copy, _, registered, _ = faults
    assert copy.reached({"event": "holding", "node": "node1", "point": "copy"})
    assert not copy.reached({"event": "holding", "node": "node2", "point": "copy"})
    assert not copy.reached({"event": "holding", "node": "node1", "point": "checkpoint"})
    assert registered.reached({"event": "registered", "node": "node3"})


@pytest.mark.parametrize(
    "token, words",
    [
        ("join:node4@phase:copy", "@phase:P is for failures"),
        (
            "kill:node1@phase:barrier",
            "unknown phase 'barrier': one of copy, rendezvous, connect, checkpoint, forming, registered",
        ),
        ("kill:node1@phase:", "unknown phase ''"),
    ],
)
def test_bad_phase_triggers_name_the_token(token, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        parse_inject(token)


def test_killmaster_takes_no_node_and_is_never_checked_against_the_nodes():
    [fault] = parse_inject("killmaster@step5")
    assert (fault.kind, fault.node, fault.step, fault.is_failure) == ("killmaster", "master", 5, True)
    assert fault.describe() == "killmaster@step5"
    check_targets([fault], ["node0", "node1"])
    for bad, why in [("killmaster:node1@step2", "takes no node"), ("killmaster@phase:copy", "no @phase")]:
        with pytest.raises(UserError, match=why):
            parse_inject(bad)
