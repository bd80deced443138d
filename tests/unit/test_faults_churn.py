"""``--churn``: synthetic bursty spot churn as a timeline of kills, preemptions and joins (pure)."""

from __future__ import annotations

import pytest

from oobleck_mm.errors import UserError
from oobleck_mm.faults.churn import churn_timeline, parse_churn
from oobleck_mm.faults.spec import check_targets
from oobleck_mm.faults.trace import parse_trace, starting_nodes

NODES = [f"node{i}" for i in range(6)]


def test_churn_stays_within_its_bounds_hits_only_live_nodes_and_comes_in_bursts():
    spec = parse_churn("30,burst=3,min=4,max=7,seed=5,spread=0.8,preempt=0.25,notice=3,duration=240")
    timeline = churn_timeline(spec, NODES)
    assert len(timeline) >= 60
    live = set(NODES)
    for f in timeline:
        if f.kind == "join":
            assert f.node not in live
            live.add(f.node)
        else:
            assert f.node in live, f"{f.kind} of {f.node}, not live"
            live.remove(f.node)
        assert 4 <= len(live) <= 7
    times = [f.seconds for f in timeline]
    assert times == sorted(times) and max(times) <= spec.start_s + spec.duration_s
    close = sum(1 for a, b in zip(times, times[1:]) if b - a < 1.0)
    assert close >= 20, "bursts: several events within a second of each other"
    kinds = {f.kind for f in timeline}
    assert kinds == {"kill", "preempt", "join"} and all(f.notice_s == 3 for f in timeline if f.kind == "preempt")
    check_targets(timeline, NODES)  # every failure names a node the run will have
    assert churn_timeline(spec, NODES) == timeline, "the same seed, the same churn"
    assert churn_timeline(parse_churn("30,min=4,max=7,seed=6,duration=240"), NODES) != timeline


@pytest.mark.parametrize(
    "text, message",
    [
        ("fast", "RATE must be bursts per minute"),
        ("0", "must be a finite number > 0"),
        ("inf,duration=1", "must be a finite number > 0"),  # issue 54 item 5: accepted, where nan was refused
        ("5,duration=inf", "duration must be a finite number"),
        ("5,bursts=2", "unknown part 'bursts=2'"),
        ("5,burst=two", "burst must be a whole number"),
        ("5,burst=0", "burst must be >= 1"),
        ("5,preempt=2", r"preempt must be a share in \[0, 1\]"),
    ],
)
def test_a_bad_churn_spec_is_refused_naming_the_part(text, message):
    with pytest.raises(UserError, match=message):
        parse_churn(text)


def test_churn_bounds_must_hold_a_node():
    with pytest.raises(UserError, match=r"min \(5\) <= max \(3\)"):
        churn_timeline(parse_churn("5,min=5,max=3"), NODES)


def test_a_trace_says_how_many_nodes_it_starts_with():
    events = parse_trace(["0,add,a", "0,add,b", "0,add,c", "0,remove,c", "1000,add,d"])
    assert starting_nodes(events) == ["a", "b"]


def test_the_simulator_replays_the_same_churn_as_a_trace():
    from oobleck_mm.faults.churn import churn_trace
    from oobleck_mm.simulator import availability as av

    spec = parse_churn("12,min=4,max=7,seed=2,duration=120")
    timeline = churn_timeline(spec, NODES)
    trace = churn_trace(spec, NODES)
    assert [e.node for e in trace[:6]] == NODES and all(e.ms == 0 for e in trace[:6])
    assert [(e.action, e.node) for e in trace[6:]] == [
        ("add" if f.kind == "join" else "remove", f.node) for f in timeline
    ]
    a = av.from_trace(trace, "churn")
    assert a.peak_nodes <= 7 and len(trace) - 6 == len(timeline)


def test_with_a_warmup_failures_never_leave_fewer_warm_nodes_than_min():
    spec = parse_churn("30,burst=3,min=4,max=7,seed=3,duration=240,warmup=12")
    joined_at = {n: float("-inf") for n in NODES}
    for f in churn_timeline(spec, NODES):
        if f.kind == "join":
            joined_at[f.node] = f.seconds
        else:
            joined_at.pop(f.node)
            warm = [n for n, t in joined_at.items() if f.seconds - t >= 12]
            assert len(warm) >= 4 or f.node not in warm, (f, warm)


def test_with_calm_two_failures_are_never_closer_than_it_and_bursts_still_come():
    """calm=2: every pair of failures (kills, preemptions) at least 2 s apart, so each recovery can
    restore f+1 replicas before the next; without it the same seed has failures closer than that."""
    text = "30,burst=3,min=4,max=7,seed=1,duration=240,preempt=0.3"
    for calm, spec in ((2.0, parse_churn(text + ",calm=2")), (0.0, parse_churn(text))):
        failures = [f.seconds for f in churn_timeline(spec, NODES) if f.kind != "join"]
        gaps = [b - a for a, b in zip(failures, failures[1:])]
        if calm:
            assert gaps and min(gaps) >= calm, min(gaps)
            events = churn_timeline(spec, NODES)
            bursts: dict[str, list] = {}
            for f in events:
                bursts.setdefault(f.source.split(" event")[0], []).append(f.seconds)
            assert sum(1 for times in bursts.values() if len(times) >= 2 and times[-1] - times[0] <= 1.0) >= 3
        else:
            assert min(gaps) < 2.0
    with pytest.raises(UserError, match="calm must be >= 0 seconds"):
        parse_churn("10,calm=-1")
