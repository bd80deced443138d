"""End to end: ``oobleck-launch local`` with real signals, against the single-process reference.

Every test trains the float64 tiny model, injects a fault while it trains and
checks what a user relies on: the job ends as it should, the final parameters
equal a run without failures (1e-9), every replica of each layer is identical,
the event log times the recovery, and no process the run started survives it.
Faults at a given pipeline position are fired once the plan is known (the
nodes' positions depend on registration order); the others use ``--inject``.
"""

from __future__ import annotations

import os
import re
import signal

import pytest

from harness import (
    PACE,
    SMALL_GPU,
    TIMEOUT_S,
    Launch,
    assert_matches_reference,
    assert_replicas_identical,
    assert_resume_equals_reference,
    assert_windows_match_reference,
    position_nodes,
    wait_for,
    write_config,
)
from oobleck_mm.faults.report import format_table, recovery_rows
from oobleck_mm.runtime.checkpoint_meta import read_meta

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def start(launches, tmp_path, config, *args, name="run") -> Launch:
    run = Launch(tmp_path, config, *args, name=name)
    launches.append(run)
    return run


def finish_ok(run: Launch) -> None:
    code = run.wait()
    assert code == 0, f"exit {code}\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    run.assert_all_gone()


def check_final(config: str, steps: int, final) -> None:
    assert_matches_reference(config, steps, final)
    assert_replicas_identical(final)


def recovered_generation(run: Launch, victims: set[str]) -> dict:
    """The plan that replaced the lost nodes, checked against the loss."""
    lost = run.events("lost")
    assert {e["node"] for e in lost} == victims and all(e["in_plan"] for e in lost)
    last = run.events("plan_decided")[-1]
    assert last["generation"] >= 2 and not victims & set(last["nodes"])
    assert last["previous_generation"] >= 1  # survivors kept their states: no restart
    resumed = run.events("resumed", generation=last["generation"])
    assert resumed and resumed[0]["cause"] == "lost"
    return last


def recovery_from(run: Launch, victim: str, timeout: float = 60.0) -> tuple[dict, dict, dict]:
    """(lost, plan_decided, resumed) of the recovery that took ``victim`` out, once it resumed; checks the
    plan against the loss: a generation planned from states the survivors kept (no restart)."""
    lost = run.wait_event("lost", node=victim, timeout=timeout)
    assert lost["in_plan"], lost
    decided = wait_for(
        lambda: next((e for e in run.events("plan_decided") if victim in e.get("lost", [])), None),
        timeout,
        f"the plan without {victim}",
    )
    assert decided["generation"] >= 2 and victim not in decided["nodes"]
    assert decided["previous_generation"] >= 1  # survivors kept their states: no restart
    resumed = run.wait_event("resumed", generation=decided["generation"], timeout=timeout)
    assert resumed["cause"] == "lost"
    return lost, decided, resumed


def test_a_fault_tour_kill_killworker_stop_on_heterogeneous_pipelines(launches, tmp_path):
    """One cluster of 7 nodes, pipelines of 3 + 2 + 2 nodes (float64, memory-capped), three faults in turn,
    each aimed at a pipeline position of the plan in force and each recovered from before the next:

    1. the node in the middle of the deepest pipeline is SIGKILLed: lost on its stream within a second,
       its pipeline re-cut (layer states moved and copied);
    2. the worker at the last stage of a shortest pipeline is SIGKILLed: its agent reports it
       (``worker_exited``, SIGKILL), the pipeline borrows a node (states moved);
    3. the agent and worker at the first stage of the deepest pipeline are SIGSTOPped (a hang: its
       sockets stay open, only silence tells): lost by heartbeat, the peers blocked on it released
       within the group timeout.

    Then the run ends with exit 0, no process left, every replica identical, parameters equal to the
    reference (1e-9). (It replaces three launches of 5 nodes, one fault each, with their assertions.)"""
    steps = 40  # the third fault comes by step ~9 (3 steps after each recovery): room for a loaded machine
    config = write_config(tmp_path, nodes=7, steps=steps, memory=SMALL_GPU)
    final = tmp_path / "final"
    run = start(launches, tmp_path, config, "--save-final", str(final))
    plan = run.wait_event("plan_decided", generation=1)
    assert sorted(len(p) for p in position_nodes(plan)) == [2, 2, 3], position_nodes(plan)
    run.wait_steps(3)

    victims = []
    # 1. kill: the middle of the deepest pipeline
    victim = max(position_nodes(plan), key=len)[1]
    victims.append(victim)
    injected = run.inject("kill", victim)
    lost, decided, resumed = recovery_from(run, victim)
    assert lost["reason"] == "stream_closed" and lost["ts"] - injected["ts"] < 1.0, lost
    assert decided["lost"] == [victim] and decided["layer_states_moved"] > 0  # its pipeline was re-cut
    [copied] = run.events("states_copied", generation=decided["generation"])
    assert copied["bytes"] > 0
    run.wait_steps(resumed["step"] + 3)

    # 2. killworker: the last stage of a shortest pipeline, which must borrow a node to go on
    plan = decided
    victim = min(position_nodes(plan), key=len)[-1]
    victims.append(victim)
    run.inject("killworker", victim)
    lost, decided, resumed = recovery_from(run, victim)
    assert lost["reason"] == "worker_exited" and "SIGKILL" in lost["detail"], lost
    assert decided["lost"] == [victim] and decided["layer_states_moved"] > 0
    run.wait_steps(resumed["step"] + 3)

    # 3. stop: the first stage of the deepest pipeline hangs
    plan = decided
    victim = max(position_nodes(plan), key=len)[0]
    victims.append(victim)
    injected = run.inject("stop", victim)
    lost, decided, resumed = recovery_from(run, victim)
    # The other pipelines wait on the hung one in the gradient all-reduce and say so: half the
    # timeout of silence confirms the hang (the full timeout if no report came in time).
    assert lost["reason"] in ("heartbeat_late_peers_stalled", "heartbeat_timeout"), lost
    half = TIMEOUT_S / 2
    assert half - 0.25 <= lost["ts"] - injected["ts"] < TIMEOUT_S + 1.0
    if lost["reason"] == "heartbeat_late_peers_stalled":
        assert lost["ts"] - injected["ts"] < half + 1.0
    # survivors blocked on the hung peer are released within the group timeout (heartbeat timeout + 5 s)
    assert resumed["ts"] - injected["ts"] < TIMEOUT_S + 5.0 + 3.0

    finish_ok(run)
    assert [e["node"] for e in run.events("lost")] == victims and len(decided["nodes"]) == 4
    assert sorted({e["step"] for e in run.events("step")}) == list(range(steps))
    check_final(config, steps, final)


def test_a_node_joins_and_receives_every_layer_state(launches, tmp_path, monkeypatch):
    # The joiner is admitted once its worker has started (seconds: imports), while the others train on:
    # the job must still be training then, on a loaded machine too.
    # The standby agent's worker template is warm: the join comes within a few steps. Paced (PACE): 24 steps
    # last 4.8 s or more.
    steps = 24
    config = write_config(tmp_path, nodes=3, steps=steps)
    final = tmp_path / "final"
    monkeypatch.setenv("OOBLECK_HOLD_AT", PACE)
    run = start(launches, tmp_path, config, "--save-final", str(final), "--inject", "join@step2")
    finish_ok(run)
    [joined] = run.events("injected", kind="join")
    decided = run.events("plan_decided")[-1]
    assert decided["cause"] == "joined" and decided["joined"] == [joined["node"]]
    # The launcher's standby took the join: its agent (and worker template) started before training did.
    assert joined["agent_started"] < run.events("step")[0]["ts"], joined
    assert decided["previous_generation"] == 1 and len(decided["nodes"]) == 4
    [sent] = run.events("assignment_sent", generation=decided["generation"], node=joined["node"])
    assert sent["previous_rank"] == -1  # a joiner holds nothing: it receives every layer
    [copied] = run.events("states_copied", generation=decided["generation"])
    assert copied["bytes"] > 0
    # Every rank's groups of the join generation were formed while the old one trained (PreparedGroup):
    # the switch only installed them.
    [met] = run.events("rendezvous_done", generation=decided["generation"])
    assert met["formed_ahead"] == len(decided["nodes"]), met
    steps_logged = [e["step"] for e in run.events("step")]
    assert sorted(set(steps_logged)) == list(range(steps))  # a join loses no step
    [ready] = run.events("node_ready", node=joined["node"])
    assert ready["joining"] and ready["ts"] <= decided["ts"]  # admitted once its worker was up
    # The survivors paused only for the switch (groups formed ahead, the copy), never for the joiner's
    # group formation (issue 31: 2.9-5.4 s freezes) nor a group timeout: under a heartbeat timeout even on
    # a loaded machine (1.16 s measured beside two `yes` and another test). The joiner's start-up from the
    # standby's warm template no longer makes a yardstick (0.1-0.6 s).
    [row] = [r for r in recovery_rows(run.events()) if r.kind == "join"]
    assert row.lost_s is not None and row.lost_s < TIMEOUT_S, (row.lost_s, ready["startup_s"])
    # --no-figure (the harness's default): the recovery table printed, no run.png drawn
    table = format_table(recovery_rows(run.events()))
    assert table in run.stdout and not (run.run_dir / "run.png").exists(), run.stdout[-2000:]
    check_final(config, steps, final)


def test_a_notice_planned_before_a_join_is_switched_to_and_sent_after_it_is_planned_again_from_the_join(
    launches, tmp_path, monkeypatch
):
    """The order that stopped a churned job at exit 3 with 9 nodes live (issue 27): the master planned a join
    (generation 2), then a notice's generation 3 from generation 1 (no report of 2 had come), and sent 3 late;
    the workers had switched to 2 meanwhile, and each survivor that 3 named as one of generation 1 raised.
    Here 3's journal write is held 4 s (``OOBLECK_MASTER_HOLD_AT``: its assignments queue behind it) while the
    join's groups form 1.5 s late. Such a survivor now abandons generation 3 like a broken iteration, the
    master plans again from 2, and the job ends equal to the reference."""
    # Paced (PACE): 40 steps last 8 s or more, past generation 3's 4 s hold and 4's switch on any host (at the
    # tiny model's ~0.05 s a step unpaced, generation 3 went out at step ~75 of the 120 it took).
    steps = 40
    config = write_config(tmp_path, nodes=3, steps=steps)
    final = tmp_path / "final"
    monkeypatch.setenv("OOBLECK_HOLD_AT", f"forming:1.5,{PACE}")  # in the background: generation 1 trains on
    monkeypatch.setenv("OOBLECK_MASTER_HOLD_AT", "journal3:4")
    run = start(launches, tmp_path, config, "--save-final", str(final), "--inject", "join@step2")
    joining = run.wait_event("plan_decided", generation=2)
    assert joining["cause"] == "joined"
    os.kill(run.agent_pids()["node0"], signal.SIGTERM)  # a spot notice to a survivor
    finish_ok(run)
    notice = run.wait_event("plan_decided", generation=3, timeout=5)
    assert notice["previous_generation"] == 1 and "node0" not in notice["nodes"], notice
    assert run.events("step", generation=2), "the workers never switched to the join"
    assert run.events("resumed", generation=2)[0]["cause"] == "joined"  # logged, though 3 was planned after it
    assert not run.events("step", generation=3)
    [dropped] = run.events("base_dropped")[:1]
    assert (dropped["generation"], dropped["base"], dropped["holds"]) == (3, 1, [2]), dropped
    # Planned again from the join as soon as a worker's step of it showed generation 3 dead (not after
    # reform_after), the joiner kept as the survivor it is (not made to join again and receive every layer).
    again = run.events("plan_decided", generation=4)[0]
    assert again["previous_generation"] == 2 and sorted(again["nodes"]) == ["node1", "node2", "node3"], again
    assert again["joined"] == [] and not [e for e in run.events("plan_decided") if e["generation"] > 4]
    # Generation 4's assignments went out right behind 3's (both queued behind 3's held journal; the log's
    # lines too): resumed within reform_after (TIMEOUT_S) of node0's dismissal, logged with them; waiting out
    # reform_after from the abandoned step, which comes after the dismissal, would take longer. (Not a tighter
    # bound: 1.79 s in a suite run on a 2-core host 2x slower than the one that measured 1.2 s.)
    [left] = run.events("left", node="node0")
    resumed = run.events("resumed", generation=4)[0]
    assert resumed["ts"] - left["ts"] < TIMEOUT_S, (left, resumed)
    assert sorted({e["step"] for e in run.events("step")}) == list(range(steps))
    check_final(config, steps, final)


def test_two_nodes_killed_at_once_and_one_inside_the_final_save(launches, tmp_path):
    """Two kills at once, then a third inside the final save (``@phase:checkpoint``: issue 54 item 1, it
    never fired there, the final save held no hold point of its node): the next generation, with no step
    left, saves again, equal to the reference."""
    config = write_config(tmp_path, nodes=5)  # five one-node pipelines; 2 are enough for f + 1 = 2
    final = tmp_path / "final"
    run = start(
        launches,
        tmp_path,
        config,
        "--save-final",
        str(final),
        "--inject",
        "kill:node1@step3,kill:node2@step3",
        "--inject",
        "kill:node3@phase:checkpoint",
    )
    finish_ok(run)
    lost = {e["node"]: e for e in run.events("lost")}
    assert sorted(lost) == ["node1", "node2", "node3"] and all(e["in_plan"] for e in lost.values())
    [late] = run.events("injected", node="node3")
    assert late["phase"] == "checkpoint" and late["step"] >= 7, late  # fired in the final save, after step 7
    decided = run.events("plan_decided")
    assert sorted(decided[1]["nodes"]) == ["node0", "node3", "node4"] and decided[1]["previous_generation"] >= 1
    assert sorted(decided[-1]["nodes"]) == ["node0", "node4"] and decided[-1]["previous_generation"] >= 1
    # The run dir's copy of the job is owner-only, as the journal holding it is (issue 54 item 8)
    assert {oct((run.run_dir / f).stat().st_mode & 0o777) for f in ("job.yaml", "master-journal.json")} == {"0o600"}
    check_final(config, 8, final)


def test_below_threshold_checkpoint_then_resume_on_another_node_count(launches, tmp_path):
    config = write_config(tmp_path, nodes=2)  # f = 1, n0 = 1: one node left cannot keep 2 replicas
    run = start(launches, tmp_path, config, "--inject", "kill:node1@step3", name="first")
    code = run.wait()
    assert code == 3, f"exit {code}\n{run.stderr[-3000:]}"
    run.assert_all_gone()
    found = re.search(r"resume with: (oobleck-launch local --config .+?) --resume (\S+)", run.stderr)
    assert found, run.stderr
    checkpoint = found.group(2)
    stopped_at = read_meta(checkpoint)["step"]
    assert 3 <= stopped_at < 8
    [written] = run.events("checkpoint_written")
    assert written["dir"] == checkpoint and written["step"] == stopped_at and written["layers"] == 10

    final = tmp_path / "final"
    again = start(
        launches, tmp_path, config, "--nodes", "3", "--resume", checkpoint, "--save-final", str(final), name="resumed"
    )
    finish_ok(again)
    assert [e["step"] for e in again.events("step")] == list(range(stopped_at, 8))
    check_final(config, 8, final)


def test_restart_mode_under_the_fault_tour_redoes_the_steps_since_the_last_checkpoint(launches, tmp_path, monkeypatch):
    """Restart mode (the checkpoint-restart baseline) under the events of ``scripts/bench_recovery.py``, in
    short: a join, a kill, the master killed, a preemption notice, a SIGSTOPped node. Each loss restarts
    every worker from the newest checkpoint (the kill's restart takes the joiner in); the steps since it run
    again; the run ends with exit 0 equal to the reference. Issue 56: this tour once ended with exit 2, the
    checkpoint the restart chose pruned before the fresh workers opened it; issue 55: once it never ended,
    an agent's report thread dead after a restart replaced its workers."""
    # node1's worker waits before step 5 until the kill lands: on a loaded machine the kill could
    # otherwise land two steps late, after the checkpoint of step 6 (seen: the restart began at 8).
    monkeypatch.setenv("OOBLECK_HOLD_AT", "step5@node1:20")
    steps = 24
    config = write_config(tmp_path, nodes=4, steps=steps)
    final = tmp_path / "final"
    run = start(
        launches,
        tmp_path,
        config,
        "--save-final",
        str(final),
        "--recovery",
        "restart",
        "--checkpoint-interval",
        "2",
        "--inject",
        "join:node4@step1",
        "--inject",
        "kill:node1@step5",
        "--inject",
        "killmaster@step9",
        "--inject",
        "preempt:node3@step13+300s",
        "--inject",
        "stop:node2@step17",
    )
    finish_ok(run)
    assert len(run.events("master_started")) == 2 and run.events("adopted")
    assert {e["node"]: e["reason"] for e in run.events("lost")} == {
        "node1": "stream_closed",
        "node2": "heartbeat_timeout",
    }
    assert [e["node"] for e in run.events("left")] == ["node3"]
    # The kill's restart, then the notice's and the hang's: one restart for both when they come while the
    # restarted master re-adopts (seen under load)
    assert len(run.events("restart")) >= 2
    assert not run.events("worker_failed") and not run.events("checkpoint_unreadable")
    saved = [e["step"] for e in run.events("checkpoint_saved")]
    assert saved[:2] == [2, 4]
    after_kill = next(e for e in run.events("plan_decided") if "node1" not in e["nodes"])
    assert after_kill["previous_generation"] == 0 and "node4" in after_kill["nodes"]  # the joiner taken in
    after = [e["step"] for e in run.events("step", generation=after_kill["generation"])]
    assert after[0] == 4  # step 4 ran twice: restart pays for the lost work
    # Steps the workers trained while the restarted master re-adopted them are logged once every rank's report
    # came; a stopped node's and a leaver's may never come (seen: 18-23 trained, checkpointed, not logged). The
    # reference equality below is what says no step was lost or run twice. (The injector fired the stop once
    # the log had 17 steps.)
    assert set(range(17)) <= {e["step"] for e in run.events("step")}
    last = run.events("plan_decided")[-1]
    assert sorted(last["nodes"]) == ["node0", "node4"] and last["previous_generation"] == 0
    check_final(config, steps, final)


def test_restart_mode_survives_a_node_lost_inside_a_checkpoint(launches, tmp_path, monkeypatch):
    """Deterministic: node1's worker holds 3 s in each checkpoint (runtime/hold.py), so the kill fired by
    step 4 lands while the survivors wait for it in the barrier of the checkpoint of step 4, its layer
    files already written: the restart must load the complete checkpoint of step 2, not a mix."""
    monkeypatch.setenv("OOBLECK_HOLD_AT", "checkpoint@node1:3")
    config = write_config(tmp_path, nodes=3)
    final = tmp_path / "final"
    run = start(
        launches,
        tmp_path,
        config,
        "--save-final",
        str(final),
        "--recovery",
        "restart",
        "--checkpoint-interval",
        "2",
        "--inject",
        "kill:node1@step4",
    )
    finish_ok(run)
    # The kill landed inside the checkpoint of step 4: fired once step 4 was done, before that checkpoint was
    # complete (node1 writing its layer files, or holding after them, while the survivors wait in the agreement).
    [killed] = run.events("injected", node="node1")
    [first] = [e for e in run.events("checkpoint_saved") if e["step"] == 4]
    assert killed["step"] == 4 and first["generation"] > 1 and first["ts"] > killed["ts"], (killed, first)
    # A survivor that reports before its agent's restart kill says it gave the checkpoint up; restart mode kills
    # the workers as soon as the loss is planned, so under load the kill may come first and no report at all.
    aborted = run.events("aborted")
    assert all("checkpoint" in e["message"] for e in aborted), aborted
    assert not run.events("worker_failed"), "a peer lost mid-checkpoint is a recovery, not a worker's failure"
    assert [e["step"] for e in run.events("checkpoint_saved")][:2] == [2, 4]  # the one at 4 was redone
    decided = run.events("plan_decided")[-1]
    assert decided["previous_generation"] == 0 and "node1" not in decided["nodes"]
    assert [e["step"] for e in run.events("step", generation=decided["generation"])][0] == 2
    check_final(config, 8, final)


def test_restart_mode_a_checkpoint_the_disk_refuses_is_said_as_such_and_training_goes_on(launches, tmp_path):
    """The periodic checkpoint of step 2 cannot be written (its layer file's temporary name is /dev/full,
    which answers every write with ENOSPC): no rank crashes, no node is taken for lost, no meta.json makes
    the partial checkpoint loadable, and the one of step 4 is written as usual."""
    config = write_config(tmp_path, nodes=3, steps=6)
    step2 = tmp_path / "run" / "checkpoints" / "step00000002" / "layers"
    step2.mkdir(parents=True)
    (step2 / "llm.block0.tmp").symlink_to("/dev/full")
    final = tmp_path / "final"
    run = start(
        launches, tmp_path, config, "--save-final", str(final), "--recovery", "restart", "--checkpoint-interval", "2"
    )
    finish_ok(run)
    [failed] = run.events("checkpoint_failed")
    assert (
        failed["step"] == 2
        and failed["error"].startswith("No space left on device: ")
        and str(step2.parent) in failed["error"]
    ), failed
    assert [e["step"] for e in run.events("checkpoint_saved")] == [4, 6]
    assert not (step2.parent / "meta.json").exists()
    assert not run.events("worker_failed") and not run.events("lost") and not run.events("aborted")
    assert "checkpoint of step 2 could not be written" in run.stdout + run.stderr
    check_final(config, 6, final)


def assert_killed_in_phase(run, node: str, phase: str) -> dict:
    """``node``'s worker said it held in ``phase`` and the injected kill came after: it landed there.
    Returns the ``holding`` event."""
    [holding] = run.events("holding", node=node)
    assert holding["point"] == phase
    [killed] = run.events("injected", node=node)
    assert killed["phase"] == phase and killed["ts"] >= holding["ts"]
    return holding


def _second_loss_inside_the_recovery(launches, tmp_path, phase: str):
    """4 nodes, 10 steps: node0 killed at step 3, then node1 killed while its worker holds in ``phase`` of
    generation 2 (the recovery from node0). Returns (run, config, steps, final dir) of the finished run."""
    steps = 10
    config = write_config(tmp_path, nodes=4, steps=steps)
    final = tmp_path / "final"
    run = start(
        launches,
        tmp_path,
        config,
        "--save-final",
        str(final),
        "--inject",
        "kill:node0@step3",
        "--inject",
        f"kill:node1@phase:{phase}",
    )
    finish_ok(run)
    holding = assert_killed_in_phase(run, "node1", phase)
    assert holding["generation"] == 2
    return run, config, steps, final


def test_a_peer_killed_inside_the_state_copy_on_purpose_is_a_second_recovery(launches, tmp_path):
    """--inject kill:node1@phase:copy: node1's worker holds in generation 2's state copy (after its
    rendezvous) and says so; the kill lands there, not by timing luck. Generation 2 never completes a
    step; generation 3 is planned from what everyone still holds (generation 1) and the run equals the
    reference."""
    run, config, steps, final = _second_loss_inside_the_recovery(launches, tmp_path, "copy")
    assert not run.events("resumed", generation=2), "generation 2 lost node1 inside its copy"
    last = run.events("plan_decided")[-1]
    assert last["generation"] == 3 and last["previous_generation"] == 1 and "node1" not in last["nodes"]
    assert sorted({e["step"] for e in run.events("step")}) == list(range(steps))
    check_final(config, steps, final)


def test_a_peer_killed_after_the_arrival_before_it_connected_costs_no_group_timeout(launches, tmp_path):
    """Issue 27 item 8: --inject kill:node1@phase:connect: every worker of generation 2 arrived, node1's
    holds before it publishes its address, and the kill lands there. Its peers wait inside gloo's
    construction for that address; the master's re-plan ends the wait (not the group's 8 s timeout,
    whose message named the store's 5-minute one), and generation 3 equals the reference."""
    run, config, steps, final = _second_loss_inside_the_recovery(launches, tmp_path, "connect")
    [killed] = run.events("injected", node="node1")
    aborted = run.events("aborted", generation=2)
    assert aborted, "the survivors never left generation 2"
    for e in aborted:
        assert "re-planned" in e["message"] and "timed out" not in e["message"], e["message"]
        assert e["ts"] - killed["ts"] < TIMEOUT_S + 5, f"{e['node']} waited out the group's timeout"
    assert not run.events("resumed", generation=2)
    assert sorted({e["step"] for e in run.events("step")}) == list(range(steps))
    check_final(config, steps, final)


def test_a_survivor_killed_while_a_joins_groups_form_in_the_background(launches, tmp_path, monkeypatch):
    """--inject join@step2 and kill:node1@phase:forming: node1's thread that forms the join generation's
    groups ahead holds there (its training thread steps on), the kill lands, and the join generation,
    never switched to, is dropped for one planned from what everyone holds; nobody waits for it. The
    joiner holds nothing of that base and the two survivors keep f + 1 replicas: it waits out the loss
    (its workers in the dropped generation's rendezvous) and joins the generation after."""
    # The job still trains when the joiner's worker is ready (the standby's: warm), after the loss and the join
    # after it: paced (PACE), 30 steps last 6 s or more.
    steps = 30
    config = write_config(tmp_path, nodes=3, steps=steps)
    final = tmp_path / "final"
    monkeypatch.setenv("OOBLECK_HOLD_AT", PACE)
    run = start(
        launches,
        tmp_path,
        config,
        "--save-final",
        str(final),
        "--inject",
        "join@step2",
        "--inject",
        "kill:node1@phase:forming",
    )
    finish_ok(run)
    assert_killed_in_phase(run, "node1", "forming")
    joining = run.events("plan_decided", generation=2)[0]
    assert joining["joined"] and "node1" in joining["nodes"]
    assert not run.events("resumed", generation=2), "generation 2 lost node1 before the switch"
    loss, *later = [e for e in run.events("plan_decided") if e["generation"] > 2]
    assert loss["previous_generation"] == 1 and "node1" in loss["lost"] and "node1" not in loss["nodes"]
    assert not set(joining["joined"]) & set(loss["nodes"]), "the joiner waits out the loss"
    assert later and later[-1]["joined"] == joining["joined"]  # ... and is taken in right after
    assert set(joining["joined"]) <= set(later[-1]["nodes"])
    assert sorted({e["step"] for e in run.events("step")}) == list(range(steps))
    check_final(config, steps, final)


def test_a_joiner_killed_right_after_it_registered_costs_the_survivors_nothing(launches, tmp_path):
    """--inject join:node3@step2 and kill:node3@phase:registered: the joiner dies before it is admitted;
    the job never plans it in, no survivor aborts an iteration."""
    steps = 12
    config = write_config(tmp_path, nodes=3, steps=steps)
    final = tmp_path / "final"
    run = start(
        launches,
        tmp_path,
        config,
        "--save-final",
        str(final),
        "--inject",
        "join:node3@step2",
        "--inject",
        "kill:node3@phase:registered",
    )
    finish_ok(run)
    [registered] = run.events("registered", node="node3")
    [killed] = run.events("injected", node="node3", kind="kill")
    assert killed["phase"] == "registered" and killed["ts"] >= registered["ts"]
    assert all("node3" not in e["nodes"] for e in run.events("plan_decided"))
    assert not run.events("aborted")
    assert sorted({e["step"] for e in run.events("step")}) == list(range(steps))
    check_final(config, steps, final)


def test_a_failure_during_recovery_replans_from_the_generation_everyone_still_holds(launches, tmp_path, monkeypatch):
    # The job still trains when the joiner's worker is ready (the standby's: warm) and when the generation after
    # the loss takes it in: paced (PACE), 30 steps train 6 s or more besides the holds.
    steps = 30
    config = write_config(tmp_path, nodes=3, steps=steps)
    final = tmp_path / "final"
    # Every worker holds 3 s before a new generation's state copy (runtime/hold.py): generation 2,
    # which takes the joiner in, cannot complete a step before the kill below lands, however fast
    # the joiner's worker starts.
    monkeypatch.setenv("OOBLECK_HOLD_AT", f"copy:3,{PACE}")
    run = start(launches, tmp_path, config, "--save-final", str(final), "--inject", "join@step2")
    # A survivor dies during generation 2's rendezvous or copy: generation 2 never completes a step.
    joining = run.wait_event("plan_decided", generation=2)
    victim = next(n for n in joining["nodes"] if n not in joining["joined"])
    run.inject("kill", victim)
    code = run.wait(timeout=60)
    assert code == 0, f"exit {code}\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    run.assert_all_gone()
    loss, *later = [e for e in run.events("plan_decided") if e["generation"] > 2]
    assert loss["generation"] == 3 and loss["previous_generation"] == 1  # generation 2 held by nobody
    # The joiner holds nothing of generation 1 and the two survivors keep f + 1 replicas: it waits out
    # the loss, and the generation after takes it in.
    assert loss["lost"] == [victim] and loss["joined"] == []
    assert later and later[-1]["joined"] == joining["joined"]
    assert not run.events("resumed", generation=2)
    assert sorted({e["step"] for e in run.events("step")}) == list(range(steps))
    check_final(config, steps, final)


def test_an_iteration_every_worker_abandons_with_no_node_lost_is_rerun_by_the_same_nodes(
    launches, tmp_path, monkeypatch
):
    """node1's worker stops before step 3 for longer than the collective timeout while its agent
    heartbeats (runtime/hold.py): every peer's collective times out, every worker abandons step 3, and
    no node is lost. The same nodes re-form (no wait for a plan that never comes) and the run equals
    the reference: an abandoned iteration changed no parameter."""
    collective_s = TIMEOUT_S + 5.0  # fault_tolerance.collective_timeout
    monkeypatch.setenv("OOBLECK_HOLD_AT", f"step3@node1:{collective_s + 2}")
    config = write_config(tmp_path, nodes=3)
    final = tmp_path / "final"
    run = start(launches, tmp_path, config, "--save-final", str(final))
    finish_ok(run)
    assert not run.events("lost")
    aborted = run.events("aborted")
    assert {e["node"] for e in aborted} == {"node0", "node1", "node2"} and {e["step"] for e in aborted} == {3}
    [reform] = run.events("reform")
    assert reform["step"] == 3 and reform["attempt"] == 1
    [_, decided] = run.events("plan_decided")
    assert decided["cause"] == "abandoned" and decided["actions"] == ["re-form"]
    assert decided["previous_generation"] == 1 and decided["layer_states_moved"] == 0
    # The re-form follows the first abort by reform_after (the heartbeat timeout), not by a stall_timeout.
    assert decided["ts"] - min(e["ts"] for e in aborted) < TIMEOUT_S + 3.0
    assert [e["step"] for e in run.events("step", generation=2)] == list(range(3, 8))
    assert "re-form" in run.stdout
    check_final(config, 8, final)


def test_a_preempted_node_leaves_at_a_step_boundary_and_nothing_is_lost(launches, tmp_path, monkeypatch):
    """A spot notice (SIGTERM to node1's agent, the kill 30 s later): the master plans node1 out at the
    next iteration boundary while it still holds its layers; no iteration is abandoned, no node is
    lost, node1's agent exits by itself before the kill, and the run equals the reference.

    That boundary is a periodic checkpoint's step, and node1's share of it is still being written
    when node1 is told to go: the checkpoint completes all the same (node1 finishes its write and
    its agent forwards the report before hanging up), and resumes to the reference. Before, node1's
    worker returned at once and the checkpoint never got its meta.json."""
    steps = 16  # the notice's switch comes at step 10
    config = write_config(
        tmp_path,
        nodes=5,
        steps=steps,
        memory=SMALL_GPU,  # pipelines of 3 + 2 nodes
        fault_tolerance={"checkpoint_interval": 10, "keep_checkpoints": 0},
    )
    final = tmp_path / "final"
    # node1 holds 3 s before step 9 (0-based; the notice fires once steps 0-8 are done): the notice is
    # planned while every rank is in step 9, so the switch follows step 9, after which (10 steps done) a
    # checkpoint is due; node1's writer then holds 0.5 s with its files written, before its report (a
    # share that comes after the next checkpoint completed is dropped: that one supersedes it).
    monkeypatch.setenv("OOBLECK_HOLD_AT", "step9@node1:3,checkpoint@node1:0.5")
    run = start(launches, tmp_path, config, "--save-final", str(final), "--inject", "preempt:node1@step9+30s")
    finish_ok(run)
    assert run.events("resumed", generation=2)[0]["step"] == 10  # the switch came at the checkpoint's step
    assert 10 in [e["step"] for e in run.events("checkpoint_saved")], run.events("checkpoint_saved")
    checkpoint = run.run_dir / "checkpoints" / "step00000010"
    assert (checkpoint / "meta.json").exists()
    assert not run.events("lost")
    [leaving] = run.events("leaving")
    [left] = run.events("left")
    assert leaving["node"] == left["node"] == "node1" and leaving["in_plan"]
    decided = run.events("plan_decided")[-1]
    assert decided["generation"] == 2 and decided["cause"] == "left" and "node1" not in decided["nodes"]
    assert decided["previous_generation"] == 1 and decided["layer_states_moved"] > 0
    assert all(e["node"] == "node1" for e in run.events("aborted")), run.events("aborted")  # survivors: none
    # Every step ran once: the leave waited for the iteration in flight instead of abandoning it.
    assert sorted(e["step"] for e in run.events("step")) == list(range(steps))
    [row] = recovery_rows(run.events())
    assert row.kind == "preempt" and row.reason == "notice" and row.abandoned_s == 0.0
    agent = run.seen[run.agent_pids()["node1"]]
    assert not agent.is_running() or agent.status() == "zombie"
    assert not [e for e in run.events("preempt_kill") if e["ts"] < run.events("done")[0]["ts"]]
    check_final(config, steps, final)
    assert assert_resume_equals_reference(config, steps, checkpoint) == 10


def test_preempted_nodes_holding_the_last_copies_checkpoint_the_step_they_are_at(launches, tmp_path):
    """Notices to 4 of 5 nodes at once, no periodic checkpoint: one node cannot hold the model, so
    everyone, the leaving nodes too, writes the step they are at before leaving (exit 3); resumed from
    there (in this process) it loses no step and equals the reference."""
    steps = 30
    config = write_config(tmp_path, nodes=5, steps=steps, memory=SMALL_GPU, fault_tolerance={"checkpoint_interval": 0})
    run = start(
        launches,
        tmp_path,
        config,
        "--inject",
        ",".join(f"preempt:node{i}@step6+30s" for i in range(1, 5)),
        name="first",
    )
    code = run.wait(timeout=240)
    assert code == 3, f"exit {code}\n{run.stderr[-3000:]}"
    run.assert_all_gone()
    assert not run.events("lost")
    [written] = run.events("checkpoint_written")
    last_step = max(e["step"] for e in run.events("step"))
    assert written["step"] == last_step + 1  # the step they were at: nothing lost
    found = re.search(r"resume with: (oobleck-launch local --config .+?) --resume (\S+)", run.stderr)
    assert found and found.group(2) == written["dir"], run.stderr[-3000:]
    assert "leave on notice with the last copies of some layers" in run.stderr
    # Resumed and trained 3 steps on (Adam's moments and the step count show by then), not to the job's end.
    assert assert_resume_equals_reference(config, written["step"] + 3, written["dir"]) == written["step"]


def test_a_killed_master_is_restarted_by_local_and_re_adopts_the_workers_that_trained_on(launches, tmp_path):
    """SIGKILL of the master process (``--inject killmaster@step3``): the workers train on, ``local`` restarts
    the master with ``--resume-master``, it re-adopts every node; the same worker processes finish, no step is
    lost or run twice, the workers lost less time than the master was away, and the run equals the reference."""
    steps = 30
    config = write_config(tmp_path, nodes=3, steps=steps)
    final = tmp_path / "final"
    run = start(launches, tmp_path, config, "--save-final", str(final), "--inject", "killmaster@step3")
    finish_ok(run)
    assert "the master died (SIGKILL); restarting it" in run.stdout, run.stdout[-3000:]
    [injected] = run.events("injected")
    assert injected["kind"] == "killmaster" and len(run.events("master_started")) == 2
    [adopted] = run.events("adopted")
    assert sorted(adopted["nodes"]) == ["node0", "node1", "node2"] and not adopted["missing"]
    assert len(run.events("plan_decided")) == 1  # nothing was re-planned: the workers never stopped
    assert sorted(e["step"] for e in run.events("step")) == list(range(steps))
    for node in ("node0", "node1", "node2"):  # one worker process per node for the whole run
        text = (run.run_dir / f"agent-{node}.log").read_text()
        assert len(re.findall(r"started worker 0 \(pid \d+\)", text)) == 1 and "re-adopted" in text
    [row] = recovery_rows(run.events())
    assert row.kind == "killmaster" and row.reason == "re-adopted" and row.abandoned_s == 0.0
    assert row.lost_s is not None and row.lost_s < row.detect_s, row  # they trained while it was away
    check_final(config, steps, final)


def test_sigterm_to_local_checkpoints_the_current_step_and_the_resume_equals_the_reference(launches, tmp_path):
    """A scheduler stopping the job (SIGTERM to the launcher): the workers write the step they are at,
    exit 3 with the resume command; resumed from there (in this process) no step is rerun and the
    result equals the reference."""
    steps = 30
    config = write_config(tmp_path, nodes=5, steps=steps, memory=SMALL_GPU, fault_tolerance={"checkpoint_interval": 0})
    run = start(launches, tmp_path, config, name="first")
    run.wait_steps(4)
    run.proc.send_signal(signal.SIGTERM)
    code = run.wait(timeout=120)
    assert code == 3, f"exit {code}\n{run.stderr[-3000:]}"
    run.assert_all_gone()
    [written] = run.events("checkpoint_written")
    assert written["step"] == max(e["step"] for e in run.events("step")) + 1  # nothing trained is lost
    found = re.search(r"resume with: (oobleck-launch local --config .+?) --resume (\S+)", run.stderr)
    assert found and found.group(2) == written["dir"] and "stopped on request (SIGTERM)" in run.stderr
    # Resumed and trained 3 steps on (Adam's moments and the step count show by then), not to the job's end.
    assert assert_resume_equals_reference(config, written["step"] + 3, written["dir"]) == written["step"]


def test_losing_every_copy_stops_at_the_last_live_checkpoint_and_the_resume_equals_the_reference(launches, tmp_path):
    """4 of 5 nodes at once in live mode, periodic checkpoints every 4 steps: exit 3 at the newest one
    (never 1 while a checkpoint exists); resumed from it (in this process) it equals the reference."""
    # 30 steps after the kill: it lands before training ends even when a busy machine stalls the launcher.
    config = write_config(tmp_path, nodes=5, steps=40, memory=SMALL_GPU, fault_tolerance={"checkpoint_interval": 4})
    run = start(
        launches,
        tmp_path,
        config,
        "--inject",
        "kill:node1@step10,kill:node2@step10,kill:node3@step10,kill:node4@step10",
        name="first",
    )
    code = run.wait(timeout=240)
    assert code == 3, f"exit {code}\n{run.stderr[-3000:]}"
    run.assert_all_gone()
    saved = [e["step"] for e in run.events("checkpoint_saved")]
    # Written in the background while training went on (one may be skipped while the last is written).
    assert saved and saved == sorted(saved) and all(s % 4 == 0 for s in saved) and 4 in saved, saved
    found = re.search(r"resume with: (oobleck-launch local --config .+?) --resume (\S+)", run.stderr)
    assert found, run.stderr
    checkpoint = found.group(2)
    assert read_meta(checkpoint)["step"] == saved[-1] and checkpoint.endswith(f"step{saved[-1]:08d}")
    plan = run.events("plan_decided")[0]["layout"]
    assert sorted(len(p["stages"]) for p in plan["pipelines"]) == [2, 3]  # one holder per pipeline of each layer
    complete = [p.name for p in (run.run_dir / "checkpoints").iterdir() if (p / "meta.json").exists()]
    assert len(complete) <= 2  # the last two complete ones are kept
    assert assert_resume_equals_reference(config, saved[-1] + 3, checkpoint) == saved[-1]  # 3 steps on


def test_a_writer_killed_inside_a_periodic_checkpoint_is_made_up_after_the_next_first_step(launches, tmp_path):
    """Issue 27 9(iii): --inject kill:node1@phase:checkpoint in live mode: node1's background writer
    holds with its files written but not reported, and the kill lands there. The checkpoint of step 4
    never completes; generation 2 checkpoints after its first step instead of 4 steps later, and every
    window between the complete checkpoints equals the reference (verify --windows)."""
    from oobleck_mm.verify import checkpoint_windows

    steps = 14
    config = write_config(
        tmp_path, nodes=4, steps=steps, fault_tolerance={"checkpoint_interval": 4, "keep_checkpoints": 0}
    )
    final = tmp_path / "final"
    run = start(launches, tmp_path, config, "--save-final", str(final), "--inject", "kill:node1@phase:checkpoint")
    finish_ok(run)
    assert_killed_in_phase(run, "node1", "checkpoint")
    [cut] = run.events("checkpoint_cut_short")
    assert cut["step"] == 4 and cut["lost"] == ["node1"], cut
    [resumed] = run.events("resumed", generation=2)[:1]
    saved = [e["step"] for e in run.events("checkpoint_saved")]
    assert 4 not in saved and resumed["step"] + 1 in saved, (saved, resumed)
    assert not (run.run_dir / "checkpoints" / "step00000004" / "meta.json").exists()
    check_final(config, steps, final)
    windows = checkpoint_windows(str(run.run_dir / "checkpoints"), str(final))
    assert [w[2] for w in windows][-1] == steps and resumed["step"] + 1 in [w[2] for w in windows]
    assert_windows_match_reference(config, windows)


def test_time_based_checkpoints_every_rank_at_the_same_step_and_the_resume_equals_the_reference(
    launches, tmp_path, monkeypatch
):
    """fault_tolerance.checkpoint_every (no step interval): each worker's clock is asked in the step's
    last collective, so every owner snapshots after the same step and the checkpoints complete; the
    newest, resumed (in this process), equals the reference."""
    steps = 20  # paced (PACE): 4 s or more, a few checkpoints a second apart
    config = write_config(
        tmp_path, nodes=3, steps=steps, fault_tolerance={"checkpoint_interval": 0, "checkpoint_every": "1s"}
    )
    monkeypatch.setenv("OOBLECK_HOLD_AT", PACE)
    run = start(launches, tmp_path, config, name="timed")
    finish_ok(run)
    saved = [e["step"] for e in run.events("checkpoint_saved")]
    assert len(saved) >= 1 and saved == sorted(set(saved)), saved
    # About one a second, not one a step: bounded by the run's length (the master's step timestamps come
    # late under load, so single gaps between them say little).
    step_ts = [e["ts"] for e in run.events("step")]
    assert len(saved) <= (step_ts[-1] - step_ts[0]) / 1.0 + 2 < steps, (saved, step_ts[-1] - step_ts[0])
    last = run.run_dir / "checkpoints" / f"step{saved[-1]:08d}"
    assert assert_resume_equals_reference(config, steps, last) == saved[-1]
