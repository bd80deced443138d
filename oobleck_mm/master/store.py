"""The workers' rendezvous store, served by the master over the authenticated control plane.

torch.distributed needs a key-value store to form its groups (gloo's addresses,
NCCL's unique id, the generation's arrival counter). torch's own ``TCPStore``
answers any client that reaches its port: ``set``, ``get`` and ``list_keys``
with no authentication, so anyone on the network could disturb or observe a
rendezvous. The same few operations are served here as the ``RendezvousStore``
gRPC service, on the master's port and behind the token check every call
passes; the workers' side is ``oobleck_mm.runtime.store.ControlPlaneStore``, a
``torch.distributed.Store`` that torch uses like any other.

A ``get`` of a key not yet set may wait on the server for it (a long poll: the
client asks with ``wait_s``, at most ``LONG_POLL_S``), woken the moment another
worker sets it, instead of the client asking again every few milliseconds. Only
while the server has threads to spare: at most ``max_waiters`` calls wait at once
(the master's pool also serves every registration and report: ``server.UNARY_THREADS`` beside them), and
the others are answered at once and poll as before (``StoreReply.held`` tells
which). So a large job's rendezvous degrades to polling, never to a master too
busy to hear heartbeats.

A ``get`` may also ask for the key's *siblings*, the other keys already set
under its parent (the path up to its last ``/``), answered with it: gloo's
connect waits for every rank's address of a group in turn, all siblings, so the
first reply brings those already there and the client waits for them without a
call (``ControlPlaneStore.wait``): 88 -> 23 calls and 26.7 -> 4.7 ms for 8
survivors forming a group within 20 ms (``scripts/bench_control_plane.py
--store-only --store-ranks 8 --store-spread 0.02``).
"""

from __future__ import annotations

import secrets
import threading
from concurrent import futures

import grpc

from oobleck_mm.protocol import oobleck_pb2 as pb
from oobleck_mm.protocol import oobleck_pb2_grpc as pb_grpc

LONG_POLL_S = 0.25
"""Longest a ``get`` waits on the server: the client checks between two calls whether its worker gave the
rendezvous up (the master re-planned), so this bounds how late it notices."""


class KeyValueStore:
    """c10d's store semantics over a dict, safe for the server's threads."""

    def __init__(self) -> None:
        self._data: dict[str, bytes] = {}
        self._by_parent: dict[str, dict[str, bytes]] = {}
        """The same keys by parent (path up to the last '/'): a get's ``siblings``."""
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self.instance = secrets.token_hex(8)
        """Told with every reply: a restarted master's store is another instance, and starts empty."""

    def set(self, key: str, value: bytes) -> None:
        with self._lock:
            self._put(key, value)
            self._changed.notify_all()

    def siblings(self, key: str) -> dict[str, bytes]:
        """The other keys set under ``key``'s parent, with their values."""
        with self._lock:
            return {k: v for k, v in self._by_parent.get(_parent(key), {}).items() if k != key}

    def _put(self, key: str, value: bytes) -> None:
        self._data[key] = value
        self._by_parent.setdefault(_parent(key), {})[key] = value

    def _drop(self, key: str) -> bytes | None:
        value = self._data.pop(key, None)
        if value is not None:
            children = self._by_parent.get(_parent(key), {})
            children.pop(key, None)
            if not children:
                self._by_parent.pop(_parent(key), None)
        return value

    def wait_get(self, key: str, seconds: float) -> bytes | None:
        """``key``'s value, waiting up to ``seconds`` for another thread to set it; None if it did not."""
        with self._lock:
            self._changed.wait_for(lambda: key in self._data, timeout=seconds)
            return self._data.get(key)

    def get(self, key: str) -> bytes | None:
        with self._lock:
            return self._data.get(key)

    def add(self, key: str, amount: int) -> int:
        """The key as a decimal integer (0 when absent) plus ``amount``, stored and returned (as TCPStore)."""
        with self._lock:
            value = int(self._data.get(key, b"0")) + amount
            self._put(key, str(value).encode())
            self._changed.notify_all()
            return value

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        """``desired`` if the key held ``expected`` (or was absent and ``expected`` is empty); the value after."""
        with self._lock:
            current = self._data.get(key)
            if (current is None and not expected) or current == expected:
                self._put(key, desired)
                self._changed.notify_all()
                return desired
            return expected if current is None else current

    def check(self, keys) -> bool:
        with self._lock:
            return all(k in self._data for k in keys)

    def delete(self, key: str) -> bool:
        with self._lock:
            return self._drop(key) is not None

    def __len__(self) -> int:
        with self._lock:
            return len(self._data)

    def forget_generations_before(self, generation: int) -> int:
        """Drops the keys of generations older than ``generation`` (prefix ``gen{g}/``); how many went.

        No worker of an older generation rendezvouses any more once a newer one is decided.
        """
        with self._lock:
            stale = [k for k in self._data if _generation_of(k) is not None and _generation_of(k) < generation]
            for key in stale:
                self._drop(key)
            return len(stale)


def _parent(key: str) -> str:
    return key.rpartition("/")[0]


def _generation_of(key: str) -> int | None:
    head, sep, _ = key.partition("/")
    return int(head[3:]) if sep and head.startswith("gen") and head[3:].isdigit() else None


class RendezvousStoreService(pb_grpc.RendezvousStoreServicer):
    """The gRPC face of a ``KeyValueStore``; the server's token interceptor has checked the caller."""

    def __init__(self, store: KeyValueStore, max_waiters: int = 8) -> None:
        self.store = store
        self.max_waiters = max_waiters
        self._waiters = threading.BoundedSemaphore(max_waiters) if max_waiters > 0 else None
        self.calls = 0
        """Calls answered (a benchmark's count; ``+=`` under the GIL is close enough for a rate)."""

    def Call(self, request: pb.StoreRequest, context) -> pb.StoreReply:
        self.calls += 1
        reply = self._answer(request, context)
        reply.instance = self.store.instance
        return reply

    def _answer(self, request: pb.StoreRequest, context) -> pb.StoreReply:
        s, op = self.store, request.op
        if op == pb.STORE_SET:
            s.set(request.key, request.value)
            return pb.StoreReply()
        if op == pb.STORE_GET:
            value = s.get(request.key)
            if value is None and request.wait_s > 0 and self._waiters is not None and self._waiters.acquire(False):
                try:
                    value = s.wait_get(request.key, min(request.wait_s, LONG_POLL_S))
                finally:
                    self._waiters.release()
                return self._got(request, value, held=True)
            return self._got(request, value)
        if op == pb.STORE_ADD:
            return pb.StoreReply(number=s.add(request.key, request.amount))
        if op == pb.STORE_COMPARE_SET:
            return pb.StoreReply(value=s.compare_set(request.key, request.expected, request.value))
        if op == pb.STORE_CHECK:
            return pb.StoreReply(found=s.check(request.keys))
        if op == pb.STORE_DELETE:
            return pb.StoreReply(found=s.delete(request.key))
        if op == pb.STORE_NUM_KEYS:
            return pb.StoreReply(number=len(s))
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"op: unknown store operation {op}")

    def _got(self, request: pb.StoreRequest, value: bytes | None, held: bool = False) -> pb.StoreReply:
        reply = pb.StoreReply(found=value is not None, value=value or b"", held=held)
        if value is not None and request.siblings:
            reply.siblings.update(self.store.siblings(request.key))
        return reply


def serve_store_only(token: str, host: str = "127.0.0.1", max_waiters: int = 8) -> tuple[grpc.Server, int]:
    """A gRPC server with just the rendezvous store (tests and benchmarks that play the master): (server, port)."""
    from oobleck_mm.master.service import TokenInterceptor

    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=2 * max_waiters + 8, thread_name_prefix="store"),
        interceptors=[TokenInterceptor(token, lambda *_: None)],
    )
    pb_grpc.add_RendezvousStoreServicer_to_server(RendezvousStoreService(KeyValueStore(), max_waiters), server)
    port = server.add_insecure_port(f"{host}:0")
    server.start()
    return server, port
