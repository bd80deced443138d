"""The master's live status page: the board is the event log's view; the server answers only the token."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from oobleck_mm.master.status import STEPS_KEPT, StatusBoard, StatusServer

TOKEN = "s3cret-token"


def job_events() -> list[dict]:
    """Three nodes, node2 lost at step 5, generation 2 resumes at step 5; a checkpoint; node1 found slow."""
    out = [{"ts": 0.0, "event": "master_started"}]
    out += [{"ts": 0.1, "event": "registered", "node": f"node{i}"} for i in range(3)]
    layout = "[r0:0-6|r1:7-9]x2mb [r2:0-9]x2mb"
    out.append({"ts": 0.5, "event": "plan_decided", "generation": 1, "nodes": ["node0", "node1", "node2"],
                "describe": layout, "cause": "start", "reason": "instantiated on 3 nodes"})  # fmt: skip
    t = 1.0
    for step in range(5):
        t += 0.1
        out.append({"ts": t, "event": "step", "generation": 1, "step": step, "loss": 5.0 - step / 10,
                    "samples_per_s": 100.0, "finished_at": t})  # fmt: skip
    out.append({"ts": t + 0.05, "event": "lost", "node": "node2", "reason": "stream_closed", "in_plan": True})
    out.append({"ts": t + 0.1, "event": "plan_decided", "generation": 2, "nodes": ["node0", "node1"],
                "describe": "[r0:0-9]x2mb [r1:0-9]x2mb", "cause": "lost", "reason": "1 lost", "lost": ["node2"],
                "previous_generation": 1})  # fmt: skip
    out.append({"ts": t + 0.2, "event": "resumed", "generation": 2, "cause": "lost", "step": 5})
    for step in range(5, 9):
        t += 0.1
        out.append({"ts": t + 0.3, "event": "step", "generation": 2, "step": step, "loss": 4.0,
                    "samples_per_s": 80.0, "finished_at": t + 0.3})  # fmt: skip
    out.append({"ts": t + 0.4, "event": "checkpoint_saved", "step": 8, "dir": "/ck/8", "generation": 2})
    out.append({"ts": t + 0.5, "event": "straggler_detected", "node": "node1", "factor": 1.9})
    return out


def test_the_board_shows_the_nodes_the_generation_the_recovery_and_the_curves():
    board = StatusBoard("tiny_mm", 20, clock=lambda: 10.0)
    for record in job_events():
        board(record)
    s = board.snapshot()
    assert json.loads(json.dumps(s)) == s, "plain JSON"
    assert {n["name"]: n["state"] for n in s["nodes"]} == {"node0": "training", "node1": "training", "node2": "lost"}
    assert s["generation"]["number"] == 2 and s["generation"]["pipelines"] == "[r0:0-9]x2mb [r1:0-9]x2mb"
    assert s["step"] == 9 and s["loss"] == 4.0 and [c[0] for c in s["curve"]] == list(range(9))
    [row] = s["recoveries"]
    assert row["nodes"] == ["node2"] and row["generation"] == 2, row
    assert s["checkpoints"][0]["dir"] == "/ck/8" and s["stragglers"] == {"node1": 1.9}


def test_a_long_job_keeps_the_last_steps_and_the_steps_around_each_event():
    board = StatusBoard("tiny_mm", 10**6)
    for step in range(3 * STEPS_KEPT):
        board({"ts": float(step), "event": "step", "generation": 1, "step": step, "loss": 1.0})
        if step == 10:
            board({"ts": 10.5, "event": "lost", "node": "node3", "reason": "heartbeat"})
    kept = [e for e in board._events if e["event"] == "step"]
    assert [e["step"] for e in kept] == [10, 11], "the steps just before and after the loss"
    assert len(board._steps) == STEPS_KEPT and board.snapshot()["step"] == 3 * STEPS_KEPT


@pytest.fixture
def server():
    board = StatusBoard("tiny_mm", 20)
    for record in job_events():
        board(record)
    running = StatusServer(board, TOKEN).start()
    yield running
    running.stop()


def test_the_server_answers_the_token_only(server):
    base = server.url()
    for url, headers in ((base, {}), (base + "status.json", {}), (base + "status.json?token=nope", {}),
                         (base + "status.json", {"Authorization": "Bearer nope"})):  # fmt: skip
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10)
        answer = refused.value.read()
        assert refused.value.code == 401 and b"tiny_mm" not in answer and b"node" not in answer, url
    page = urllib.request.urlopen(server.url(with_token=True), timeout=10).read().decode()
    assert "<script>" in page and "status.json" in page
    request = urllib.request.Request(base + "status.json", headers={"Authorization": f"Bearer {TOKEN}"})
    data = json.loads(urllib.request.urlopen(request, timeout=10).read())
    assert data["generation"]["number"] == 2
    with pytest.raises(urllib.error.HTTPError) as missing:
        urllib.request.urlopen(base + f"nothing?token={TOKEN}", timeout=10)
    assert missing.value.code == 404
