"""The workers' rendezvous store, served by the master over the authenticated control plane.

torch.distributed needs a key-value store to form its groups (gloo's addresses,
NCCL's unique id, the generation's arrival counter). torch's own ``TCPStore``
answers any client that reaches its port: ``set``, ``get`` and ``list_keys``
with no authentication, so anyone on the network could disturb or observe a
rendezvous. The same few operations are served here as the ``RendezvousStore``
gRPC service, on the master's port and behind the token check every call
passes; the workers' side is ``oobleck_mm.runtime.store.ControlPlaneStore``, a
``torch.distributed.Store`` that torch uses like any other.

Every operation answers at once (a blocking ``get`` is the client polling), so a
waiting worker never holds one of the server's threads.
"""

from __future__ import annotations

import threading
from concurrent import futures

import secrets

import grpc

from oobleck_mm.protocol import oobleck_pb2 as pb
from oobleck_mm.protocol import oobleck_pb2_grpc as pb_grpc


class KeyValueStore:
    """c10d's store semantics over a dict, safe for the server's threads."""

    def __init__(self) -> None:
        self._data: dict[str, bytes] = {}
        self._lock = threading.Lock()
        self.instance = secrets.token_hex(8)
        """Told with every reply: a restarted master's store is another instance, and starts empty."""

    def set(self, key: str, value: bytes) -> None:
        with self._lock:
            self._data[key] = value

    def get(self, key: str) -> bytes | None:
        with self._lock:
            return self._data.get(key)

    def add(self, key: str, amount: int) -> int:
        """The key as a decimal integer (0 when absent) plus ``amount``, stored and returned (as TCPStore)."""
        with self._lock:
            value = int(self._data.get(key, b"0")) + amount
            self._data[key] = str(value).encode()
            return value

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        """``desired`` if the key held ``expected`` (or was absent and ``expected`` is empty); the value after."""
        with self._lock:
            current = self._data.get(key)
            if (current is None and not expected) or current == expected:
                self._data[key] = desired
                return desired
            return expected if current is None else current

    def check(self, keys) -> bool:
        with self._lock:
            return all(k in self._data for k in keys)

    def delete(self, key: str) -> bool:
        with self._lock:
            return self._data.pop(key, None) is not None

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
                del self._data[key]
            return len(stale)


def _generation_of(key: str) -> int | None:
    head, sep, _ = key.partition("/")
    return int(head[3:]) if sep and head.startswith("gen") and head[3:].isdigit() else None


class RendezvousStoreService(pb_grpc.RendezvousStoreServicer):
    """The gRPC face of a ``KeyValueStore``; the server's token interceptor has checked the caller."""

    def __init__(self, store: KeyValueStore) -> None:
        self.store = store

    def Call(self, request: pb.StoreRequest, context) -> pb.StoreReply:
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
            return pb.StoreReply(found=value is not None, value=value or b"")
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


def serve_store_only(token: str, host: str = "127.0.0.1") -> tuple[grpc.Server, int]:
    """A gRPC server with just the rendezvous store (tests that play the master): (server, port)."""
    from master.service import TokenInterceptor

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix="store"),
                         interceptors=[TokenInterceptor(token, lambda *_: None)])  # fmt: skip
    pb_grpc.add_RendezvousStoreServicer_to_server(RendezvousStoreService(KeyValueStore()), server)
    port = server.add_insecure_port(f"{host}:0")
    server.start()
    return server, port
