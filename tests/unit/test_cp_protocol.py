"""The wire format: execution plans survive protobuf, the token file and the event log behave."""

from __future__ import annotations

import os
import stat

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oobleck_mm.events import EventLog, read_events
from oobleck_mm.protocol import oobleck_pb2 as pb
from oobleck_mm.protocol.auth import read_token, resolve_token, token_matches, write_token
from oobleck_mm.protocol.convert import plan_from_proto, plan_to_proto
from oobleck_mm.planning.layout import ExecutionPlan


@settings(max_examples=40, deadline=None)
@given(
    num_layers=st.integers(1, 12),
    pipelines=st.lists(st.tuples(st.integers(1, 12), st.integers(1, 9)), min_size=1, max_size=5),
    microbatch_size=st.integers(1, 8),
)
def test_execution_plan_round_trips_through_bytes(num_layers, pipelines, microbatch_size):
    stages = [min(s, num_layers) for s, _ in pipelines]
    plan = ExecutionPlan.even(num_layers, stages, [m for _, m in pipelines], microbatch_size)
    wire = pb.Assignment(plan=plan_to_proto(plan)).SerializeToString()
    back = plan_from_proto(pb.Assignment.FromString(wire).plan)
    assert back == plan
    assert back.holders(num_layers - 1) == plan.holders(num_layers - 1)


def test_an_inconsistent_plan_message_is_refused():
    msg = plan_to_proto(ExecutionPlan.even(4, [2, 2], [1, 1], 1))
    msg.pipelines[1].stages[0].rank = 0  # rank 0 twice
    with pytest.raises(ValueError, match="ranks must be"):
        plan_from_proto(msg)


def test_token_file_is_private_and_checked(tmp_path, monkeypatch):
    path = str(tmp_path / "token")
    write_token(path, "s3cret")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert read_token(path) == "s3cret"
    with pytest.raises(FileExistsError):
        write_token(path, "other")  # never overwrite a job's token
    os.chmod(path, 0o644)
    with pytest.raises(ValueError, match="accessible by other users"):
        read_token(path)
    monkeypatch.delenv("OOBLECK_TOKEN", raising=False)
    with pytest.raises(ValueError, match="--token-file"):
        resolve_token(None)
    monkeypatch.setenv("OOBLECK_TOKEN", "from-env")
    assert resolve_token(None) == "from-env"
    assert token_matches("abc", "abc") and not token_matches("abc", "abd") and not token_matches("abc", None)


def test_event_log_writes_one_json_object_per_line(tmp_path):
    path = tmp_path / "run" / "events.jsonl"
    with EventLog(path) as log:
        log.write("registered", node="node0", gpus=1)
        log.write("lost", node="node0", reason="stream_closed")
        with pytest.raises(ValueError, match="reserved"):
            log.write("bad", ts=1.0)
    with open(path, "a") as fh:
        fh.write('{"ts": 1, "event": "torn')  # a writer killed mid-line
    events = read_events(path)
    assert [e["event"] for e in events] == ["registered", "lost"]
    assert events[0]["ts"] <= events[1]["ts"] and events[1]["reason"] == "stream_closed"
    assert read_events(path, "lost") == events[1:]
