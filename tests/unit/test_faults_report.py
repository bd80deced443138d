"""The recovery table and plot, from event logs written by hand (the shapes the master and injector write)."""

from __future__ import annotations

import json

import pytest

from oobleck_mm.events import read_events
from oobleck_mm.faults.figure import plot_run, recovery_spans, throughput_series
from oobleck_mm.faults.report import format_table, recovery_rows, summarize, survivors_pause

STEP_S = 0.25
BATCH = 16


class Log:
    """A run's events with explicit times."""

    def __init__(self) -> None:
        self.events: list[dict] = []
        self.t = 100.0

    def at(self, t: float, event: str, **fields) -> dict:
        record = {"ts": t, "event": event, **fields}
        self.events.append(record)
        return record

    def steps(self, generation: int, first: int, count: int, start: float, step_s: float = STEP_S) -> float:
        t = start
        for step in range(first, first + count):
            t += step_s
            self.at(
                t, "step", generation=generation, step=step, loss=1.0, samples_per_s=BATCH / step_s, step_time_s=step_s
            )
        return t

    def recovery(self, generation: int, plan_t: float, ranks: int = 3, nbytes: int = 2_000_000, copy_s: float = 0.1):
        """plan at plan_t, per-worker rendezvous (+0.3 s), copy (+0.2 s), resumed (+0.3 s)."""
        self.at(plan_t, "plan_decided", generation=generation, nodes=[], seconds=0.05)
        for rank in range(ranks):
            self.at(plan_t + 0.2 + 0.05 * rank, "rendezvous_done", generation=generation, rank=rank, seconds=0.2)
        for rank in range(ranks):
            # each moved byte is counted by its sender and its receiver
            self.at(
                plan_t + 0.45 + 0.025 * rank,
                "states_copied",
                generation=generation,
                rank=rank,
                bytes=nbytes if rank < 2 else 0,
                seconds=copy_s,
            )
        for rank in range(ranks):
            self.at(plan_t + 0.8, "resumed", generation=generation, rank=rank, step=0)


def one_kill() -> tuple[Log, dict]:
    log = Log()
    log.at(100.0, "plan_decided", generation=1, nodes=["node0", "node1", "node2", "node3"])
    end = log.steps(1, 0, 4, 100.0)  # steps 0..3 done at 101.0
    times = {"last_old": end, "fail": end + 0.1, "lost": end + 0.5, "plan": end + 0.7}
    log.at(times["fail"], "injected", kind="kill", node="node1", step=4, pids=[11, 12], batch=1)
    log.at(times["lost"], "lost", node="node1", reason="stream_closed", generation=1)
    log.recovery(2, times["plan"])
    log.steps(2, 4, 3, times["plan"] + 0.8)  # the rerun of step 4 starts when resumed
    times["first_new"] = times["plan"] + 0.8 + STEP_S
    return log, times


def test_one_kill_is_broken_into_its_phases():
    log, t = one_kill()
    [row] = recovery_rows(log.events)
    assert (row.kind, row.nodes, row.step, row.reason, row.generation) == ("kill", ("node1",), 4, "stream_closed", 2)
    assert row.detect_s == pytest.approx(t["lost"] - t["fail"])
    assert row.decide_s == pytest.approx(t["plan"] - t["lost"])
    assert row.rendezvous_s == pytest.approx(0.3), "the last worker's rendezvous ends the phase"
    assert row.copy_s == pytest.approx(0.2)
    assert row.copy_bytes == 2_000_000, "byte counts are halved (each counted by its sender and its receiver)"
    assert row.copy_mb_per_s == pytest.approx(2.0 / 0.1), "MB/s over the slowest worker's copy time"
    assert row.resume_s == pytest.approx(0.3)
    assert row.abandoned_s == pytest.approx(0.1)
    # from the end of step 3 to the start of the rerun of step 4
    assert row.lost_s == pytest.approx(t["first_new"] - STEP_S - t["last_old"])
    assert row.reconfigure_s == pytest.approx(row.decide_s + row.rendezvous_s)
    assert row.outcome == "resumed at step 5", "the console's numbering: step 4 of the log is its 'step 5/N'"


def test_copy_rate_uses_the_transfer_time_when_the_log_has_it():
    """Building the layers a joiner receives into is not the copy: MB/s is over the transfers alone."""
    log, _ = one_kill()
    for e in log.events:
        if e["event"] == "states_copied":
            e["transfer_seconds"] = 0.01
    [row] = recovery_rows(log.events)
    assert row.copy_mb_per_s == pytest.approx(2.0 / 0.01)
    assert row.copy_s == pytest.approx(0.2), "the phase itself still counts in the timeline"


def test_missing_phases_are_dashes_and_the_chain_skips_them():
    log, t = one_kill()
    log.events = [e for e in log.events if e["event"] not in ("rendezvous_done", "states_copied", "resumed")]
    [row] = recovery_rows(log.events)
    assert row.rendezvous_s is None and row.copy_s is None and row.copy_bytes is None
    assert row.resume_s == pytest.approx(t["first_new"] - t["plan"]), "measured from the last phase present"
    table = format_table([row])
    header, line = table.splitlines()
    assert "rdv s" in header and "MB/s" in header
    assert line.split()[:4] == ["1", "kill", "node1", "5"], "the console's numbering (the log's step 4)"
    assert line.count(" - ") >= 3


def test_simultaneous_failures_are_one_incident_detected_when_the_last_one_is():
    log = Log()
    log.at(100.0, "plan_decided", generation=1)
    end = log.steps(1, 0, 2, 100.0)
    log.at(end + 0.1, "injected", kind="kill", node="node1", batch=1)
    log.at(end + 0.1, "injected", kind="stop", node="node2", batch=1)
    log.at(end + 0.6, "lost", node="node1", reason="stream_closed")
    log.at(end + 2.2, "lost", node="node2", reason="heartbeat_timeout")
    log.at(end + 2.3, "plan_decided", generation=2)
    log.steps(2, 2, 2, end + 2.5)
    [row] = recovery_rows(log.events)
    assert row.kind == "kill+stop" and set(row.nodes) == {"node1", "node2"}
    assert row.detect_s == pytest.approx(2.1)
    assert row.reason == "heartbeat_timeout+stream_closed"
    assert row.lost_s == pytest.approx(2.5 - 0.0)


def test_a_failure_during_recovery_is_charged_to_the_same_incident_and_its_final_generation():
    log = Log()
    log.at(100.0, "plan_decided", generation=1)
    end = log.steps(1, 0, 3, 100.0)
    log.at(end + 0.1, "injected", kind="kill", node="node1", batch=1)
    log.at(end + 0.4, "lost", node="node1", reason="stream_closed")
    log.at(end + 0.5, "plan_decided", generation=2)
    log.at(end + 0.9, "injected", kind="kill", node="node2", batch=2)  # while states are copied
    log.at(end + 1.2, "lost", node="node2", reason="stream_closed")
    log.recovery(3, end + 1.4)
    log.steps(3, 3, 2, end + 2.2)
    first, second = recovery_rows(log.events)
    assert first.generation == 3 and second.generation == 3
    assert first.decide_s == pytest.approx(1.0), "detection to the plan that actually resumed"
    assert first.lost_s == pytest.approx(2.2)
    assert second.lost_s == pytest.approx(2.2), "same interrupted step: the same wait, seen from each failure"


def test_checkpoint_restart_counts_the_redone_steps_as_lost():
    log = Log()
    log.at(100.0, "plan_decided", generation=1)
    end = log.steps(1, 0, 6, 100.0)  # steps 0..5; checkpoint at step 4
    log.at(end + 0.1, "injected", kind="kill", node="node3", batch=1)
    log.at(end + 0.5, "lost", node="node3", reason="stream_closed")
    log.at(end + 5.0, "plan_decided", generation=2)  # everything restarted, loaded step 4
    log.steps(2, 4, 4, end + 8.0)  # redo 4, 5, then 6, 7
    [row] = recovery_rows(log.events)
    assert row.step == 6
    assert row.lost_s == pytest.approx(8.0 + 2 * STEP_S), "restart, then steps 4 and 5 again"
    assert row.outcome == "resumed at step 7"


def test_losses_nobody_injected_joins_and_a_job_that_ended_below_threshold():
    log = Log()
    log.at(100.0, "plan_decided", generation=1, nodes=["node0", "node1"])
    end = log.steps(1, 0, 2, 100.0)
    log.at(end + 0.1, "injected", kind="join", node="node2", batch=1)
    log.at(end + 2.0, "registered", node="node2", spare=True)
    log.at(end + 2.3, "plan_decided", generation=2, nodes=["node0", "node1", "node2"])
    log.at(end + 2.9, "states_copied", generation=2, bytes_transferred=5_000_000, bytes=10_000_000)
    end2 = log.steps(2, 2, 2, end + 3.0)
    log.at(end2 + 0.2, "lost", node="node0", reason="worker_exited", generation=2)
    log.at(end2 + 0.4, "lost", node="node1", reason="worker_exited", generation=2)
    log.at(end2 + 1.0, "shutdown", exit_code=3, reason="below threshold; checkpoint in runs/x/ckpt")
    join, lost0, lost1 = recovery_rows(log.events)
    assert (join.kind, join.nodes, join.reason) == ("join", ("node2",), "registered"), "a log without node_ready"
    assert join.detect_s == pytest.approx(1.9) and join.decide_s == pytest.approx(0.3)
    assert join.copy_bytes == 5_000_000 and join.step == 2
    assert join.lost_s == pytest.approx(end + 3.0 - end), "from the last old step to the new generation's start"
    assert join.abandoned_s is None
    assert (lost0.kind, lost0.nodes, lost0.detect_s) == ("lost", ("node0",), 0.0)
    assert lost0.lost_s is None and lost0.generation is None
    assert lost0.outcome == "job ended (exit 3)" and lost1.outcome == "job ended (exit 3)"


def test_a_run_without_failures_has_no_rows():
    log = Log()
    log.at(100.0, "plan_decided", generation=1)
    log.steps(1, 0, 5, 100.0)
    assert recovery_rows(log.events) == []
    assert "no failures" in format_table([])


def test_throughput_dips_over_downtime_and_the_plot_is_a_png(tmp_path):
    log, t = one_kill()
    xs, reported, wall = throughput_series(log.events, window=1)
    assert reported == [pytest.approx(BATCH / STEP_S)] * 7
    assert wall[:4] == [pytest.approx(BATCH / STEP_S)] * 4
    gap = t["first_new"] - t["last_old"]
    assert wall[4] == pytest.approx(BATCH / gap), "the first step after the failure carries the downtime"
    assert xs[0] == pytest.approx(STEP_S) and xs == sorted(xs)
    _, _, smooth = throughput_series(log.events, window=2)
    assert smooth[4] == pytest.approx(2 * BATCH / (gap + STEP_S)), "averaged over the window"
    path = plot_run(log.events, str(tmp_path / "t.png"))
    assert open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    # The figure shades each phase from where the previous one ended up to the first step after it.
    [row] = recovery_rows(log.events)
    spans = recovery_spans(row)
    assert [s[0] for s in spans] == ["detection", "planning", "rendezvous", "state copy", "first step"]
    assert spans[0][2] == row.at_ts and all(a[3] == pytest.approx(b[2]) for a, b in zip(spans, spans[1:]))
    assert spans[-1][3] == pytest.approx(
        row.at_ts + sum(getattr(row, f"{k}_s") for k in ("detect", "decide", "rendezvous", "copy", "resume"))
    )


def test_steps_logged_together_do_not_spike_the_wall_clock_rate():
    log = Log()
    log.steps(1, 0, 4, 100.0)
    log.events[1]["ts"] = log.events[2]["ts"] - 0.001  # step 1's last report arrives with step 2's
    assert max(throughput_series(log.events, window=1)[2]) > 10 * BATCH / STEP_S
    _, _, wall = throughput_series(log.events)
    assert max(wall) <= BATCH / STEP_S * (1 + 1e-9)


def test_summarize_reads_a_real_event_log_file(tmp_path):
    log, _ = one_kill()
    path = tmp_path / "events.jsonl"
    with open(path, "w") as fh:
        for e in log.events:
            fh.write(json.dumps(e) + "\n")
        fh.write('{"ts": 1, "event": "st')  # a torn last line
    assert len(read_events(path)) == len(log.events)
    text = summarize(str(path))
    assert "kill" in text and "node1" in text and "stream_closed" in text


def test_the_masters_one_event_per_phase_is_read_like_per_worker_events():
    log, _ = one_kill()
    per_worker = recovery_rows(log.events)[0]
    merged = [e for e in log.events if e["event"] not in ("rendezvous_done", "states_copied", "resumed")]
    copies = [e for e in log.events if e["event"] == "states_copied"]
    last = {
        name: max((e for e in log.events if e["event"] == name), key=lambda e: e["ts"])
        for name in ("rendezvous_done", "states_copied", "resumed")
    }
    for name, e in last.items():
        fields = {"generation": 2, "seconds": 0.1, "cause": "lost"}
        if name == "states_copied":
            fields["bytes"] = sum(c["bytes"] for c in copies)  # progress.py sums the workers' counts
        merged.append({"ts": e["ts"], "event": name, **fields})
    [row] = recovery_rows(merged)
    assert row == per_worker


def test_a_loss_logged_just_before_its_injection_is_still_its_detection():
    log, _ = one_kill()
    injected = next(e for e in log.events if e["event"] == "injected")
    lost = next(e for e in log.events if e["event"] == "lost")
    lost["ts"] = injected["ts"] - 0.001
    [row] = recovery_rows(log.events)
    assert (row.kind, row.reason, row.detect_s) == ("kill", "stream_closed", 0.0)


def test_a_join_the_job_ended_before_is_not_reported_as_resumed():
    """The joiner's agent was still starting when training finished: no plan took it in."""
    log = Log()
    log.at(100.0, "plan_decided", generation=1, nodes=["node0", "node1"])
    end = log.steps(1, 0, 3, 100.0)
    log.at(end - 0.2, "injected", kind="join", node="node2", batch=1)
    log.at(end + 0.01, "shutdown", exit_code=0, reason="done: 3 steps")
    [join] = recovery_rows(log.events)
    assert join.kind == "join" and join.generation is None and join.lost_s is None
    assert join.outcome == "job ended (exit 0)" and join.step is None


def test_a_killed_master_costs_what_the_workers_clocks_say_not_when_a_restarted_master_logged_their_steps():
    """The workers train on without a master; a restarted master logs those steps late (at the replay): the
    row counts the gap in the workers' own step completions (``finished_at``), and no abandoned work."""
    log = Log()
    log.at(100.0, "plan_decided", generation=1, nodes=["node0", "node1"])
    end = log.steps(1, 0, 4, 100.0)  # steps 0..3 done at 101.0
    log.at(end + 0.1, "injected", kind="killmaster", node="master", step=4, pids=[7], batch=1)
    replay_t = end + 3.0
    for step in range(4, 10):  # trained at the usual pace while no master ran, logged at the replay
        log.at(
            replay_t,
            "step",
            generation=1,
            step=step,
            loss=1.0,
            step_time_s=STEP_S,
            finished_at=end + STEP_S * (step - 3),
        )
    log.at(replay_t + 0.1, "adopted", generation=1, nodes=["node0", "node1"], missing=[], next_step=10)
    log.steps(1, 10, 2, replay_t + 0.1)
    [row] = recovery_rows(log.events)
    assert (row.kind, row.nodes, row.step, row.reason) == ("killmaster", ("master",), 4, "re-adopted")
    assert row.detect_s == pytest.approx(3.0) and row.lost_s == pytest.approx(0.0) and row.abandoned_s == 0.0
    assert row.outcome == "resumed at step 5"


def test_a_join_is_usable_once_its_workers_are_ready_and_planning_is_timed_from_then():
    """The joiner's start-up (its workers building their layers) runs while the others train: it is the
    join's detection, not planning (the mission printed "plan s 4.89" for a plan made in 0.02 s)."""
    log = Log()
    log.at(100.0, "plan_decided", generation=1, nodes=["node0", "node1"])
    end = log.steps(1, 0, 2, 100.0)
    log.at(end + 0.1, "injected", kind="join", node="node2", batch=1)
    log.at(end + 0.4, "registered", node="node2", spare=True)
    log.at(end + 0.5, "node_ready", node="node0", joining=False)  # another node's: not this join's
    log.at(end + 5.4, "node_ready", node="node2", startup_s=5.0, joining=True)
    log.at(end + 5.45, "plan_decided", generation=2, nodes=["node0", "node1", "node2"])
    log.steps(2, 2, 2, end + 5.6)
    [join] = recovery_rows(log.events)
    assert (join.kind, join.reason) == ("join", "ready")
    assert join.detect_s == pytest.approx(5.3) and join.decide_s == pytest.approx(0.05)
    assert format_table([join]).splitlines()[1].split()[4:6] == ["5.30", "ready"]


def test_a_join_costs_the_survivors_pause_including_a_slow_step_before_the_switch():
    """Issue 31 item 3: the survivors' last step before a join took 4.69 s (they waited for the joiner's
    groups) and the old measure, from the last step before the plan, did not see it. The pause is every
    completion-to-completion gap from the joiner ready to the new generation's first step, less the
    median gap: the table's "lost s" and the benches' figure. The joiner's start-up, when it slowed the
    survivors on a shared machine, is counted apart."""
    log = Log()
    log.at(100.0, "plan_decided", generation=1, nodes=["node0", "node1"])
    end = log.steps(1, 0, 6, 100.0)
    log.at(end + 0.05, "injected", kind="join", node="node2", batch=1)
    log.at(end + 0.1, "registered", node="node2", spare=True)
    end = log.steps(1, 6, 2, end)  # the survivors train on while the joiner starts, one step slowed by it
    end = log.steps(1, 8, 1, end, step_s=STEP_S + 0.5)
    log.at(end + 0.2, "node_ready", node="node2", startup_s=0.3, joining=True)
    end = log.steps(1, 9, 1, end, step_s=4.7)  # the step before the switch stalls
    log.at(end + 0.01, "plan_decided", generation=2, nodes=["node0", "node1", "node2"])
    end = log.steps(2, 10, 1, end + 0.05, step_s=STEP_S + 0.2)  # the switch, then steady
    log.steps(2, 11, 6, end)
    [join] = recovery_rows(log.events)
    assert join.kind == "join" and join.step == 10
    expected = (4.7 - STEP_S) + (0.05 + 0.2)  # the stalled step, then the switch's extra
    assert join.lost_s == pytest.approx(expected)
    assert join.startup_pause_s == pytest.approx(0.5)
    assert survivors_pause(log.events, 0.0, None) is None
    assert [label for label, *_ in recovery_spans(join)][0] == "joiner start-up"


def test_a_joiner_killed_before_it_registered_never_joined_and_its_kill_cost_nothing():
    """Issue 54 item 7: node6 was started as a joiner and killed before it registered. The table said "join
    node6 ... resumed" and "kill node6 ... lost 2.12 s" (both read an unrelated plan): it never joined, and
    killing a node that was not training cost the job nothing."""
    log = Log()
    log.at(100.0, "plan_decided", generation=1, nodes=["node0", "node1"])
    end = log.steps(1, 0, 4, 100.0)
    log.at(end + 0.05, "injected", kind="join", node="node6", batch=1)
    log.at(end + 0.3, "injected", kind="kill", node="node6", pids=[66], batch=2)
    end = log.steps(1, 4, 4, end)
    log.at(end + 0.1, "injected", kind="kill", node="node1", pids=[11], batch=3)  # a real loss later
    log.at(end + 0.2, "lost", node="node1", reason="stream_closed", generation=1)
    log.recovery(2, end + 0.4, ranks=1)
    log.steps(2, 8, 3, end + 1.2)
    join, kill6, kill1 = recovery_rows(log.events)
    assert (join.kind, join.nodes, kill6.kind, kill6.nodes, kill1.nodes) == (
        "join",
        ("node6",),
        "kill",
        ("node6",),
        ("node1",),
    )
    assert join.generation is None and join.lost_s is None and join.step is None
    assert join.outcome == "never joined (killed before it was ready)", join.outcome
    assert kill6.generation is None and kill6.lost_s == 0.0 and kill6.abandoned_s is None
    assert kill6.outcome == "not training: nothing lost", kill6.outcome
    assert kill1.generation == 2 and kill1.lost_s > 0, "the real loss keeps its plan"


def test_a_preemption_whose_step_in_flight_completed_abandoned_nothing():
    """Issue 54 item 7: a node left on notice at the boundary; the step in flight completed (the leaving
    node's own worker then stopped, ``aborted`` of a step that was not lost) and the table said "abandoned
    0.10 s"."""
    log = Log()
    log.at(100.0, "plan_decided", generation=1, nodes=["node0", "node1", "node2"])
    end = log.steps(1, 0, 4, 100.0)
    log.at(end + 0.1, "injected", kind="preempt", node="node2", pids=[22], batch=1)
    log.at(end + 0.15, "leaving", node="node2", reason="preemption notice", generation=1)
    # planned at once, applied at the boundary: step 4, in flight at the notice and the plan, completed
    log.at(end + 0.17, "plan_decided", generation=2, nodes=["node0", "node1"], lost=["node2"])
    end = log.steps(1, 4, 1, end)
    log.at(end + 0.05, "aborted", generation=1, node="node2", step=5, message="shut down at the boundary")
    log.steps(2, 5, 3, end + 0.3)
    [row] = recovery_rows(log.events)
    assert row.kind == "preempt" and row.abandoned_s == 0.0, row
    log.at(end + 0.06, "aborted", generation=1, node="node0", step=4, message="gave up step 4")
    # Had a worker given up a step that never completed, that would be work thrown away:
    log2 = Log()
    log2.events = [e for e in log.events if not (e["event"] == "step" and e.get("step") == 4)]
    [row2] = recovery_rows(log2.events)
    assert row2.abandoned_s > 0
