"""The master's gRPC face: the Coordinator service and the token check on every call.

Handlers translate messages to ``Coordinator`` calls and ``Refused`` to status
codes; they decide nothing. The token interceptor runs before any handler, so
no method (not even Register) is reachable without the job token.

The master serves them on an asyncio gRPC server (``grpc.aio``, ``oobleck_mm/master/server.py``):
every node holds a ``Subscribe`` stream for the whole job, and on gRPC's
synchronous server each stream held a thread of its pool; at 4,000 nodes the
master could not keep 4,000 streams and their heartbeats going. A stream is a
coroutine here, and so is the heartbeat (it takes no lock). The other unary
calls (registration, reports, the rendezvous store) stay plain functions, which the aio server runs in its
``migration_thread_pool`` with a context whose ``abort`` raises as the
synchronous one does.
"""

from __future__ import annotations

import asyncio
import logging
import queue
from collections.abc import AsyncIterator
from typing import Callable

import grpc

from oobleck_mm.master.coordinator import END_OF_STREAM, Coordinator
from oobleck_mm.master.registry import Refused
from oobleck_mm.protocol import oobleck_pb2 as pb
from oobleck_mm.protocol import oobleck_pb2_grpc as pb_grpc
from oobleck_mm.protocol.auth import TOKEN_HEADER, token_matches
from oobleck_mm.protocol.encoded import serialize_event

log = logging.getLogger(__name__)

# The enum's names, lower-cased, are the detector's reasons (worker_exited, ...).
_FAILURES = {
    kind: pb.WorkerFailure.Name(kind).lower() for kind in (pb.WORKER_EXITED, pb.WORKER_ZOMBIE, pb.WORKER_STOPPED)
}


class TokenInterceptor(grpc.ServerInterceptor):
    """Refuses every call whose ``x-oobleck-token`` header is missing or wrong (UNAUTHENTICATED)."""

    def __init__(self, token: str, on_refused: Callable[[str, str, str], None]) -> None:
        self._token = token
        self._on_refused = on_refused

    def intercept_service(self, continuation, handler_call_details):
        return _checked(self._token, self._on_refused, continuation(handler_call_details), handler_call_details)


class AioTokenInterceptor(grpc.aio.ServerInterceptor):
    """``TokenInterceptor`` for the master's asyncio server (``grpc.aio`` takes only its own interceptors)."""

    def __init__(self, token: str, on_refused: Callable[[str, str, str], None]) -> None:
        self._token = token
        self._on_refused = on_refused

    async def intercept_service(self, continuation, handler_call_details):
        return _checked(self._token, self._on_refused, await continuation(handler_call_details), handler_call_details)


def _checked(token: str, on_refused, handler, handler_call_details):
    """``handler`` when the call carries the job's token, else one that refuses it (UNAUTHENTICATED)."""
    metadata = dict(handler_call_details.invocation_metadata or ())
    given = metadata.get(TOKEN_HEADER)
    if token_matches(token, given):
        return handler
    reason = "missing token" if given is None else "wrong token"
    method = handler_call_details.method.rsplit("/", 1)[-1]
    return _denying_handler(handler, method, reason, on_refused)


def _denying_handler(handler, method: str, reason: str, on_refused):
    def deny(request, context):
        on_refused(context.peer(), method, reason)
        context.abort(grpc.StatusCode.UNAUTHENTICATED, f"{reason} (header {TOKEN_HEADER})")

    if handler is None:
        return None  # unknown method: gRPC answers UNIMPLEMENTED

    def deny_stream(request, context):
        deny(request, context)
        yield  # never reached; a generator, as the aio server runs a streaming handler

    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(
            deny_stream, handler.request_deserializer, handler.response_serializer
        )
    return grpc.unary_unary_rpc_method_handler(deny, handler.request_deserializer, handler.response_serializer)


def add_coordinator_service(service: CoordinatorService, server) -> None:
    """Registers ``service`` on ``server`` as the generated ``add_CoordinatorServicer_to_server`` does, with
    one change: ``Subscribe`` serializes each event with its own ``SerializeToString``, so a generation's
    assignments go out as parts encoded once (``oobleck_mm.protocol.encoded``); the generated handler
    takes ``AgentEvent`` messages only."""
    pb_grpc.add_CoordinatorServicer_to_server(service, _EncodedEvents(server))


class _EncodedEvents:
    """The server as the generated registration sees it: the method handlers pass through with
    ``Subscribe``'s serializer replaced (the generated code builds them in one dict, then hands it over)."""

    def __init__(self, server) -> None:
        self._server = server

    def add_generic_rpc_handlers(self, handlers) -> None:
        pass  # made again below from the changed handlers

    def add_registered_method_handlers(self, service: str, handlers: dict) -> None:
        handlers = dict(handlers, Subscribe=handlers["Subscribe"]._replace(response_serializer=serialize_event))
        self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
        self._server.add_registered_method_handlers(service, handlers)


class CoordinatorService(pb_grpc.CoordinatorServicer):
    def __init__(self, coordinator: Coordinator) -> None:
        self.c = coordinator

    def Register(self, request: pb.RegisterRequest, context) -> pb.RegisterReply:
        with _refusals(context):
            session, gpus, adopted = self.c.register(
                request.node, request.gpus, request.memory_bytes, request.pid, context.peer(), request.adopt_generation
            )
        # The agent reads its timeouts from the config's fault_tolerance section, like everyone.
        return pb.RegisterReply(
            node=request.node,
            session=session,
            gpus=gpus,
            config_yaml=self.c.config_yaml,
            resume_command=self.c.options.resume_command,
            adopted=adopted,
        )

    async def Heartbeat(self, request: pb.HeartbeatRequest, context) -> pb.HeartbeatReply:
        # On the event loop itself, not the unary pool: ``Coordinator.heartbeat`` takes no lock and does
        # not block, and the pool's hop (a thread wake-up, then ``call_soon_threadsafe`` back) cost more
        # than the beat. Every node beats every interval: the master's most frequent call by far.
        try:
            generation = self.c.heartbeat(request.node.node, request.node.session)
        except Refused as refusal:
            await _abort(context, refusal)
        return pb.HeartbeatReply(generation=generation)

    async def Subscribe(self, request: pb.NodeRef, context) -> AsyncIterator[pb.AgentEvent]:
        try:
            outbox = self.c.open_stream(request.node, request.session)
        except Refused as refusal:
            await _abort(context, refusal)
        loop, woken = asyncio.get_running_loop(), asyncio.Event()
        outbox.listen(lambda: loop.call_soon_threadsafe(woken.set))
        try:
            while True:
                try:
                    event = outbox.get_nowait()
                except queue.Empty:
                    woken.clear()  # a put before this wakes it again: its set runs on this loop, after
                    if outbox.empty():
                        await woken.wait()
                    continue
                if event is END_OF_STREAM:
                    return
                yield event
        finally:
            # However the RPC ends, the agent's socket reset included (the task is cancelled): that is
            # how a killed agent is seen at once.
            self.c.stream_ended(request.node, request.session)

    def ReportWorker(self, request: pb.WorkerReportRequest, context) -> pb.Ack:
        with _refusals(context):
            self.c.worker_report(
                request.node.node, request.node.session, request.local_rank, request.report, request.replayed
            )
        return pb.Ack()

    def ReportWorkerFailure(self, request: pb.WorkerFailureRequest, context) -> pb.Ack:
        reason = _FAILURES.get(request.failure)
        if reason is None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"failure: unknown kind {request.failure}")
        with _refusals(context):
            self.c.worker_failure(request.node.node, request.node.session, request.local_rank, reason, request.message)
        return pb.Ack()

    def Leave(self, request: pb.LeaveRequest, context) -> pb.Ack:
        with _refusals(context):
            self.c.leave(request.node.node, request.node.session, request.reason)
        return pb.Ack()


async def _abort(context, refusal: Refused) -> None:
    """Ends a coroutine handler's call with the gRPC status ``refusal`` names (``_refusals``, asynchronously)."""
    await context.abort(getattr(grpc.StatusCode, refusal.code), str(refusal))


class _refusals:
    """Turns ``Refused`` into the gRPC status it names."""

    def __init__(self, context) -> None:
        self.context = context

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type, exc, tb) -> bool:
        if isinstance(exc, Refused):
            self.context.abort(getattr(grpc.StatusCode, exc.code), str(exc))
        return False
