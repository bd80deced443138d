"""The master's gRPC server at thousands of nodes: every event stream opened at once is kept.

gRPC's core cancels calls that arrive while more than ``grpc.server.max_pending_requests_hard_limit``
(3,000 by default) wait for the server to pick them up. When 4,000 agents started at once, the master
kept 2,740-2,979 event streams and the rest were cancelled (``scripts/bench_control_plane.py``); the
same happened to a bare ``grpc.aio`` server. This test opens more streams than that default at once
against the server the master builds (``oobleck_mm.master.server.aio_server``), with a servicer whose streams
stay open, and asserts every one reached the servicer and none was cancelled; with gRPC's default
options (the control) calls are cancelled or the count falls short, which shows the test can fail.
"""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest

from oobleck_mm.master.server import _quiet_poller_at_exit, aio_server
from oobleck_mm.protocol import oobleck_pb2 as pb
from oobleck_mm.protocol import oobleck_pb2_grpc as pb_grpc

pytestmark = pytest.mark.integration

STREAMS = 3600
"""More than gRPC's default hard limit of pending calls (3,000)."""
SETTLE_S = 60.0
"""Longest the test waits for every stream to open or fail (a busy CI machine)."""


class _Holding(pb_grpc.CoordinatorServicer):
    def __init__(self) -> None:
        self.opened = 0

    async def Subscribe(self, request, context):  # noqa: N802 (gRPC's name)
        self.opened += 1
        yield pb.AgentEvent()  # the client counts a stream as open once this arrives
        await asyncio.Event().wait()  # held open, as a node's stream is for the whole job


def _serve(make_server) -> tuple[asyncio.AbstractEventLoop, grpc.aio.Server, _Holding, int]:
    loop = asyncio.new_event_loop()
    # As the master's own loop: gRPC's poller reading its closed socket after this test (two loops in one
    # process, grpc/grpc#25364) is not logged into a later test's closed output ("--- Logging error ---").
    loop.set_exception_handler(_quiet_poller_at_exit)
    threading.Thread(target=loop.run_forever, daemon=True).start()
    servicer = _Holding()

    async def start():
        server = make_server()
        pb_grpc.add_CoordinatorServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port

    server, port = asyncio.run_coroutine_threadsafe(start(), loop).result(30)
    return loop, server, servicer, port


async def _open_streams(port: int, count: int) -> tuple[int, dict[str, int]]:
    """Opens ``count`` streams at once; (streams that delivered their first event, failures by status)."""
    opened, failed = 0, {}
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        calls = [stub.Subscribe(pb.NodeRef(node=f"node{i}")) for i in range(count)]

        async def first(call) -> None:
            nonlocal opened
            try:
                await call.read()
                opened += 1
            except grpc.RpcError as err:
                failed[err.code().name] = failed.get(err.code().name, 0) + 1

        await asyncio.wait_for(asyncio.gather(*(first(c) for c in calls)), SETTLE_S)
        for call in calls:
            call.cancel()
    return opened, failed


def _run(make_server) -> tuple[int, dict[str, int], int]:
    loop, server, servicer, port = _serve(make_server)
    try:
        opened, failed = asyncio.run(_open_streams(port, STREAMS))
        return opened, failed, servicer.opened
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(None), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)


def test_the_masters_server_keeps_every_stream_opened_at_once_past_grpcs_pending_call_limit():
    opened, failed, seen = _run(lambda: aio_server(4, []))
    assert failed == {} and opened == STREAMS == seen, (opened, failed, seen)


def test_grpcs_default_server_options_cancel_streams_opened_at_once_the_control():
    opened, failed, seen = _run(lambda: grpc.aio.server())
    if opened == STREAMS:
        pytest.skip(
            "gRPC's defaults kept every stream this time (its server picked them up as fast as they "
            "came): the control could not show the limit on this run"
        )
    assert failed.get("CANCELLED", 0) > 0 and seen < STREAMS, (opened, failed, seen)
