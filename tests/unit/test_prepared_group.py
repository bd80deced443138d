"""A joiner's group formed ahead arrives only once the joiner can adopt (``PreparedGroup``'s gate)."""

from __future__ import annotations

import threading
from datetime import timedelta

from oobleck_mm.runtime.group import PreparedGroup


def _prepared(gated: bool, connected: threading.Event) -> PreparedGroup:
    def connect():
        connected.set()
        raise ConnectionError("no store in this test")  # ends the background thread here

    return PreparedGroup(
        connect, 2, 3, 4, collective_timeout=timedelta(seconds=5), arrival_timeout=timedelta(seconds=5), gated=gated
    )


def test_a_gated_group_arrives_only_after_may_arrive():
    connected = threading.Event()
    prepared = _prepared(True, connected)
    assert not connected.wait(0.3), "a joiner arrived before what it receives into was built"
    assert not prepared.ready()
    prepared.may_arrive()
    assert connected.wait(5) and prepared.done.wait(5)
    assert isinstance(prepared.error, ConnectionError)  # said at the switch, as a peer's failure


def test_an_ungated_group_arrives_at_once_and_may_arrive_is_harmless():
    connected = threading.Event()
    prepared = _prepared(False, connected)
    assert connected.wait(5)
    prepared.may_arrive()
