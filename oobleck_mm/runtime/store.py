"""The workers' side of the master's rendezvous store: a ``torch.distributed.Store`` over gRPC.

torch forms a generation's groups through a c10d store (``init_process_group(store=...)``,
gloo's and NCCL's rendezvous). torch's ``TCPStore`` has no authentication, so the
master serves the keys as its ``RendezvousStore`` service instead (``oobleck_mm/master/store.py``),
behind the job token like every control-plane call, and this class speaks it.
torch accepts a Python subclass of ``dist.Store`` anywhere it takes a store
(``PrefixStore`` included); the operations below are the ones c10d's rendezvous
and ``join_generation`` use.

Blocking operations (``get`` of a key not yet set, ``wait``) ask the server to
hold the call until the key is set (a long poll of up to ``oobleck_mm.master.store.
LONG_POLL_S``), and ask again at once when it did; a server with no thread to
spare answers at once, and then the client polls: the first polls quick (a
rendezvous is usually complete within milliseconds), later ones backing off.
Every operation ends within the store's timeout with ``DistStoreError``, as
torch's stores do. A master that does not answer (killed, restarting, its
network away for a moment) is waited for like the agents wait for it: calls
are retried until the operation's deadline. A master that answers again but
is another process (restarted with ``--resume-master``) has an empty store:
the keys this rendezvous set are gone, so the operation fails at once with
``DistStoreError`` naming that (``StoreReply.instance`` changed), and the
worker abandons the iteration instead of waiting out the arrival timeout.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta

import grpc
import torch.distributed as dist

from oobleck_mm.protocol import oobleck_pb2 as pb
from oobleck_mm.protocol import oobleck_pb2_grpc as pb_grpc
from oobleck_mm.protocol.auth import call_metadata

FIRST_POLL_S = 0.001
"""First pause between two reads of a key not yet set."""
LONGEST_POLL_S = 0.01
"""Pauses double up to this."""
LONG_POLL_ASK_S = 0.25
"""How long a ``get`` asks the server to hold it (the server caps it: ``oobleck_mm.master.store.LONG_POLL_S``)."""
CALL_TIMEOUT_S = 10.0
"""Longest one store call may take (a master that stopped answering)."""
RETRY_S = 0.2
"""Pause between two tries to reach a master that did not answer."""
INTERRUPT_CHECK_S = 0.01
"""How often a held read (``read_within``) looks at ``interrupt`` while the server holds it."""
_UNREACHABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
"""Codes of a master that is away (retried), as opposed to one that refused the call (not retried)."""


class ControlPlaneStore(dist.Store):
    """c10d's store operations as ``RendezvousStore.Call`` RPCs to ``host:port``, with ``token``."""

    def __init__(
        self,
        host: str,
        port: int,
        token: str,
        timeout: timedelta,
        interrupt: Callable[[], bool] | None = None,
        long_poll: bool = True,
        reuse_waited: bool = True,
        siblings: bool = True,
    ) -> None:
        """``interrupt``: asked between two reads of a key not yet set; True ends the wait with
        ``DistStoreError`` (the worker's master re-planned: the peer it waits for is gone). ``long_poll``:
        False polls only; ``reuse_waited``: False reads again what a wait read; ``siblings``: False asks
        for every waited key (all three: the benchmark's comparisons)."""
        super().__init__()
        self._ask_s = LONG_POLL_ASK_S if long_poll else 0.0
        self.calls = 0
        self.reused = 0
        """Gets answered from the wait before them (no call)."""
        self._interrupt = interrupt
        address = f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"
        self.address = address
        # Reconnect within a second of a master coming back (gRPC's default backoff grows to 2 minutes).
        self._channel = grpc.insecure_channel(
            address,
            options=[
                ("grpc.initial_reconnect_backoff_ms", 100),
                ("grpc.min_reconnect_backoff_ms", 100),
                ("grpc.max_reconnect_backoff_ms", 1000),
            ],
        )
        self._stub = pb_grpc.RendezvousStoreStub(self._channel)
        self._metadata = call_metadata(token)
        self._timeout = timeout
        self._instance = ""
        """The store instance this client has talked to (the first reply's)."""
        self._reuse_waited = reuse_waited
        self._just_waited: dict[str, bytes] = {}
        """The values the last ``wait`` read, for the ``get`` that follows it (see ``get``)."""
        self._siblings = siblings and reuse_waited
        self._known: dict[str, bytes] = {}
        """Keys a wait's reply brought beside the one it asked for (``StoreRequest.siblings``), for the waits
        that follow it; forgotten at this client's next write (see ``wait``)."""
        self.prefetched = 0
        """Waits answered from an earlier wait's siblings (no call)."""

    # ------------------------------------------------------------------ c10d's operations
    def set(self, key: str, value) -> None:
        self._forget()
        self._call(pb.StoreRequest(op=pb.STORE_SET, key=key, value=_bytes(value)))

    def get(self, key: str) -> bytes:
        # gloo's connect waits for each peer's key and then gets it: two calls where the wait's own read
        # already had the value. A get that follows the wait for its key, with no other operation of this
        # client between, returns what the wait read (as if it ran then, a moment earlier): gloo's keys are
        # written once. Half the calls of a group's formation, on the master and on the survivors' cores.
        value = self._just_waited.pop(key, None)
        self._just_waited.clear()
        if value is None:
            return self._wait_for(key)
        self.reused += 1
        return value

    def add(self, key: str, amount: int) -> int:
        self._forget()
        return self._call(pb.StoreRequest(op=pb.STORE_ADD, key=key, amount=int(amount))).number

    def compare_set(self, key: str, expected, desired) -> bytes:
        self._forget()
        request = pb.StoreRequest(op=pb.STORE_COMPARE_SET, key=key, expected=_bytes(expected), value=_bytes(desired))
        return self._call(request).value

    def check(self, keys) -> bool:
        return self._call(pb.StoreRequest(op=pb.STORE_CHECK, keys=list(keys))).found

    def wait(self, keys, timeout: timedelta | None = None) -> None:
        # gloo's connect sets this rank's address, then waits for every rank's in turn: keys of one parent
        # (``<prefix>/<group>//cpu//0/<rank>``). The first wait's reply brings the ones already set beside
        # it, and the waits for those need no call: a group of k ranks costs each ~1-2 calls instead of k,
        # on the master and in the survivors' rendezvous (sequential calls). Like the reuse in ``get``,
        # this reads a key as it was a moment earlier, right for gloo's and NCCL's keys (written once);
        # the prefetched values are forgotten at this client's next write.
        timeout = timeout or self._timeout  # gloo's connect passes the group's timeout
        deadline = time.monotonic() + timeout.total_seconds()
        self._just_waited.clear()
        read = {}
        for key in keys:
            if key in self._known:
                read[key] = self._known[key]
                self.prefetched += 1
            else:
                read[key] = self._wait_for(key, deadline, timeout)
        if self._reuse_waited:
            self._just_waited.update(read)

    def _forget(self) -> None:
        self._just_waited.clear()
        self._known.clear()

    def delete_key(self, key: str) -> bool:
        self._forget()
        return self._call(pb.StoreRequest(op=pb.STORE_DELETE, key=key)).found

    def num_keys(self) -> int:
        return self._call(pb.StoreRequest(op=pb.STORE_NUM_KEYS)).number

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = timeout

    def close(self) -> None:
        self._channel.close()

    # ------------------------------------------------------------------ plumbing
    def _wait_for(self, key: str, deadline: float | None = None, timeout: timedelta | None = None) -> bytes:
        """``key``'s value once set; ``DistStoreError`` naming ``timeout`` (the wait's bound) at ``deadline``."""
        timeout = timeout or self._timeout
        if deadline is None:
            deadline = time.monotonic() + timeout.total_seconds()
        pause = FIRST_POLL_S
        while True:
            ask = min(self._ask_s, max(0.0, deadline - time.monotonic() - 0.05))
            try:
                reply = self._call(
                    pb.StoreRequest(op=pb.STORE_GET, key=key, wait_s=ask, siblings=self._siblings), deadline
                )
            except _Unanswered as error:
                # The wait's bound passed while the call was out (a busy server answered after the RPC's
                # deadline): the same timeout as a wait the server ended, naming the bound the caller set.
                raise dist.DistStoreError(
                    f"store {self.address}: timed out after {timeout} waiting for key {key!r} ({error})"
                ) from None
            if reply.found:
                self._known.update(reply.siblings)
                return reply.value
            if time.monotonic() + pause > deadline:
                raise dist.DistStoreError(f"store {self.address}: timed out after {timeout} waiting for key {key!r}")
            if self._interrupt is not None and self._interrupt():
                raise dist.DistStoreError(
                    f"store {self.address}: waiting for key {key!r} abandoned: the master re-planned"
                )
            if not reply.held:  # the server had no thread to spare: poll
                time.sleep(pause)
                pause = min(2 * pause, LONGEST_POLL_S)

    def read_within(self, key: str, seconds: float) -> bytes | None:
        """One read of ``key`` that the server holds until the key is set, up to ``seconds`` (capped by
        ``oobleck_mm.master.store.LONG_POLL_S``): its value, or None when it was not set by then, the master did not
        answer, or ``interrupt`` said the master re-planned (looked at every ``INTERRUPT_CHECK_S`` while
        the call is held, so a newer command ends the wait at once). Not a c10d operation: the arrival
        barrier's wait (``runtime.group._await_arrivals``), one call where reading its counter took ~100
        a second from every waiting worker (3,038 of a churn soak's 10,500 store calls)."""
        request = pb.StoreRequest(op=pb.STORE_GET, key=key, wait_s=seconds)
        self.calls += 1
        future = self._stub.Call.future(request, metadata=self._metadata, timeout=seconds + CALL_TIMEOUT_S)
        while True:
            try:
                reply = future.result(timeout=INTERRUPT_CHECK_S)
                break
            except grpc.FutureTimeoutError:
                if self._interrupt is not None and self._interrupt():
                    future.cancel()
                    return None
            except grpc.RpcError as err:
                if err.code() in _UNREACHABLE:
                    time.sleep(RETRY_S)  # the master is away: the caller's deadline decides, as for a poll
                    return None
                raise self._failed(request, err) from None
        self._check_instance(reply, request)
        if reply.found:
            return reply.value
        if not reply.held:  # the server had no thread to spare: an ordinary read, so space the next one
            time.sleep(min(seconds, LONGEST_POLL_S))
        return None

    def _check_instance(self, reply: pb.StoreReply, request: pb.StoreRequest) -> None:
        if reply.instance and self._instance and reply.instance != self._instance:
            raise dist.DistStoreError(
                f"store {self.address}: the master restarted and its rendezvous store "
                f"with it: the keys this rendezvous set are gone "
                f"({pb.StoreOp.Name(request.op)} {request.key!r})"
            )
        self._instance = self._instance or reply.instance

    def _call(self, request: pb.StoreRequest, deadline: float | None = None) -> pb.StoreReply:
        if deadline is None:
            deadline = time.monotonic() + self._timeout.total_seconds()
        while True:
            left = max(0.001, min(CALL_TIMEOUT_S, deadline - time.monotonic()))
            try:
                self.calls += 1
                reply = self._stub.Call(request, metadata=self._metadata, timeout=left + request.wait_s)
            except grpc.RpcError as err:
                if err.code() in _UNREACHABLE and time.monotonic() + RETRY_S < deadline:
                    time.sleep(RETRY_S)  # the master is away: wait for it, as the agents do
                    continue
                raise self._failed(request, err) from None
            self._check_instance(reply, request)
            return reply

    def _failed(self, request: pb.StoreRequest, err: grpc.RpcError) -> dist.DistStoreError:
        """The error of a call that failed for good: ``_Unanswered`` when the master was away, else refused."""
        kind = _Unanswered if err.code() in _UNREACHABLE else dist.DistStoreError
        return kind(
            f"store {self.address}: {pb.StoreOp.Name(request.op)} {request.key!r} failed: "
            f"{err.code().name} {err.details() or ''}".rstrip()
        )


class _Unanswered(dist.DistStoreError):
    """A call the store did not answer before the operation's deadline (unreachable, or too busy)."""


def _bytes(value) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)
