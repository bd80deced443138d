"""Failure detection is a pure function of node states and the clock: every rule, built by hand."""

from __future__ import annotations

from datetime import timedelta

import pytest

from oobleck_mm.master.detector import (
    HEARTBEAT_LATE_PEERS_STALLED,
    HEARTBEAT_TIMEOUT,
    REPORTS_SILENT,
    STREAM_CLOSED,
    WORKER_EXITED,
    WORKER_STOPPED,
    Failure,
    NodeHealth,
    detect_failures,
    silent_reporters,
)
from oobleck_mm.config import FaultToleranceConfig

TIMEOUT = FaultToleranceConfig(heartbeat_timeout=timedelta(seconds=3), confirmed_silence=timedelta(seconds=1.5))
"""Peer-confirmed detection on, at half the timeout (it is off by default: see the test below)."""


def test_fresh_heartbeats_are_healthy_up_to_the_timeout_itself():
    nodes = {"a": NodeHealth(last_heartbeat=100.0), "b": NodeHealth(last_heartbeat=97.0)}
    assert detect_failures(100.0, nodes, TIMEOUT) == []  # b is silent exactly 3 s: not yet past


def test_silence_past_the_timeout_is_a_hung_node():
    nodes = {"a": NodeHealth(last_heartbeat=100.0), "b": NodeHealth(last_heartbeat=96.9)}
    [failure] = detect_failures(100.0, nodes, TIMEOUT)
    assert (failure.node, failure.reason) == ("b", HEARTBEAT_TIMEOUT)
    assert "3.10s" in failure.detail


def test_half_the_timeout_of_silence_suffices_when_a_peer_stalled_since():
    nodes = {"a": NodeHealth(last_heartbeat=100.0), "b": NodeHealth(last_heartbeat=98.4)}
    # b silent 1.6 s (> 1.5 s, half the timeout); a's worker waited on a collective, reported at 99.0
    [failure] = detect_failures(100.0, nodes, TIMEOUT, stalls={"a": 99.0})
    assert (failure.node, failure.reason) == ("b", HEARTBEAT_LATE_PEERS_STALLED)
    assert "a waited" in failure.detail and "1.60s" in failure.detail


@pytest.mark.parametrize(
    "stalls, why",
    [
        ({}, "nobody is waiting"),
        ({"a": 98.0}, "the stall was reported before b's last heartbeat: b was not silent then"),
        ({"b": 99.0}, "a node's own stall says nothing about its silence"),
        ({"a": 96.5}, "the stall is older than the timeout"),
    ],
)
def test_a_stall_only_confirms_a_silence_that_covers_it(stalls, why):
    nodes = {"a": NodeHealth(last_heartbeat=100.0), "b": NodeHealth(last_heartbeat=98.4)}
    assert detect_failures(100.0, nodes, TIMEOUT, stalls=stalls) == [], why


def test_by_default_a_stalled_peer_never_shortens_the_timeout():
    """A slow link: the node's heartbeats queue behind its transfers while its peers wait for them."""
    nodes = {"a": NodeHealth(last_heartbeat=100.0), "b": NodeHealth(last_heartbeat=97.5)}  # silent 2.5 s
    assert (
        detect_failures(100.0, nodes, FaultToleranceConfig(heartbeat_timeout=timedelta(seconds=3)), stalls={"a": 99.9})
        == []
    )


def test_a_stalled_peer_never_shortens_silence_below_half_the_timeout():
    nodes = {"a": NodeHealth(last_heartbeat=100.0), "b": NodeHealth(last_heartbeat=98.6)}  # silent 1.4 s
    assert detect_failures(100.0, nodes, TIMEOUT, stalls={"a": 99.9}) == []


def test_a_closed_stream_is_lost_at_once_even_with_a_fresh_heartbeat():
    nodes = {"a": NodeHealth(last_heartbeat=100.0, stream_closed=True)}
    assert detect_failures(100.0, nodes, TIMEOUT) == [Failure("a", STREAM_CLOSED, "event stream to the agent ended")]


def test_a_worker_failure_is_the_reason_given_over_the_other_signs():
    # The agent reported a stopped worker, then its stream broke and it went silent:
    # the worker's state is what explains the loss.
    nodes = {"a": NodeHealth(last_heartbeat=0.0, stream_closed=True, worker_failure=WORKER_STOPPED, detail="pid 7")}
    assert detect_failures(100.0, nodes, TIMEOUT) == [Failure("a", WORKER_STOPPED, "pid 7")]


def test_every_lost_node_is_reported_once_in_name_order():
    nodes = {
        "n2": NodeHealth(last_heartbeat=0.0),
        "n0": NodeHealth(last_heartbeat=100.0, worker_failure=WORKER_EXITED),
        "n1": NodeHealth(last_heartbeat=100.0),
        "n3": NodeHealth(last_heartbeat=100.0, stream_closed=True),
    }
    failures = detect_failures(100.0, nodes, TIMEOUT)
    assert [(f.node, f.reason) for f in failures] == [
        ("n0", WORKER_EXITED),
        ("n2", HEARTBEAT_TIMEOUT),
        ("n3", STREAM_CLOSED),
    ]


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="worker_failure"):
        NodeHealth(last_heartbeat=0.0, worker_failure="tired")
    with pytest.raises(ValueError, match="timeout"):  # the detector's timeouts come from a checked config
        FaultToleranceConfig(heartbeat_timeout=timedelta(0))


def test_silence_takes_every_node_at_once_only_after_twice_the_timeout():
    """Under load at start-up every agent of a replay went 3.09 s silent against 3 s: all lost, exit 3."""
    from oobleck_mm.master.detector import ALL_SILENT_GRACE

    nodes = {name: NodeHealth(last_heartbeat=96.9) for name in ("a", "b", "c")}
    assert detect_failures(100.0, nodes, TIMEOUT) == []  # all silent 3.1 s: not all lost yet
    late = 96.9 + ALL_SILENT_GRACE * 3 + 0.01
    assert [f.node for f in detect_failures(late, nodes, TIMEOUT)] == ["a", "b", "c"]
    nodes["d"] = NodeHealth(last_heartbeat=100.0)  # one still heartbeats: the others are hung, as always
    assert [f.node for f in detect_failures(100.0, nodes, TIMEOUT)] == ["a", "b", "c"]
    nodes = {"a": NodeHealth(last_heartbeat=96.9), "b": NodeHealth(last_heartbeat=96.9, stream_closed=True)}
    assert [f.reason for f in detect_failures(100.0, nodes, TIMEOUT)] == [HEARTBEAT_TIMEOUT, STREAM_CLOSED]
    single = {"a": NodeHealth(last_heartbeat=96.9)}  # a one-node job: its only node hung
    assert [f.node for f in detect_failures(100.0, single, TIMEOUT)] == ["a"]


# ---------------------------------------------------------------------- reports that stop (issue 55)
GPUS = [("a", 0), ("a", 1), ("b", 0)]


def test_a_rank_whose_reports_lag_a_step_the_job_reported_past_the_limit_loses_its_node_once():
    latest = {("a", 0): (2, 10), ("a", 1): (2, 4), ("b", 0): (2, 10)}
    seen = {(2, s): 100.0 + s for s in range(3, 11)}  # step s first reported at 100 + s
    assert silent_reporters(120.0, 2, GPUS, latest, seen, limit=15.0) == []  # step 5 seen 15.0 s ago: not past
    lost = silent_reporters(120.01, 2, GPUS, latest, seen, limit=15.0)
    assert [(f.node, f.reason) for f in lost] == [("a", REPORTS_SILENT)]
    assert "local rank 1 after step 4" in lost[0].detail and "step 5" in lost[0].detail
    # Two silent ranks of one node: the node is lost once.
    latest[("a", 0)] = (2, 4)
    assert len(silent_reporters(130.0, 2, GPUS, latest, seen, limit=15.0)) == 1


def test_without_a_step_some_other_rank_reported_nobody_is_silent():
    latest = {gpu: (3, 7) for gpu in GPUS}
    seen = {(3, s): 0.0 for s in range(8)}
    assert silent_reporters(1e6, 3, GPUS, latest, seen, limit=1.0) == []  # all level: a slow step, not a lag
    assert silent_reporters(1e6, 3, GPUS, {}, {}, limit=1.0) == []  # nobody reported: no evidence either


def test_a_rank_that_reported_only_in_older_generations_lags_every_step_of_the_new_one():
    latest = {("a", 0): (4, 70), ("a", 1): (4, 70), ("b", 0): (3, 69)}  # b's workers were replaced: silent since
    seen = {(4, 66): 10.0, (4, 70): 30.0, (3, 69): 5.0}
    lost = silent_reporters(10.0 + 20.5, 4, GPUS, latest, seen, limit=20.0)
    assert [f.node for f in lost] == ["b"] and "of generation 4" in lost[0].detail and "step 66" in lost[0].detail


def test_the_limit_follows_the_step_time_above_two_collective_timeouts():
    ft = FaultToleranceConfig(heartbeat_timeout=timedelta(seconds=3))
    assert ft.reports_silence_limit(0.1) == 2 * ft.collective_timeout == timedelta(seconds=16)
    assert ft.reports_silence_limit(5.0) == timedelta(seconds=100)  # 20 steps
