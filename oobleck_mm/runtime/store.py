"""The workers' side of the master's rendezvous store: a ``torch.distributed.Store`` over gRPC.

torch forms a generation's groups through a c10d store (``init_process_group(store=...)``,
gloo's and NCCL's rendezvous). torch's ``TCPStore`` has no authentication, so the
master serves the keys as its ``RendezvousStore`` service instead (``master/store.py``),
behind the job token like every control-plane call, and this class speaks it.
torch accepts a Python subclass of ``dist.Store`` anywhere it takes a store
(``PrefixStore`` included); the operations below are the ones c10d's rendezvous
and ``join_generation`` use.

Blocking operations (``get`` of a key not yet set, ``wait``) poll: the server
answers at once, so waiting workers never hold its threads. The first polls are
quick (a rendezvous is usually complete within milliseconds), later ones back off.
Every operation ends within the store's timeout with ``DistStoreError``, as
torch's stores do, and so does a master that does not answer.
"""

from __future__ import annotations

import time
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
CALL_TIMEOUT_S = 10.0
"""Longest one store call may take (a master that stopped answering)."""


class ControlPlaneStore(dist.Store):
    """c10d's store operations as ``RendezvousStore.Call`` RPCs to ``host:port``, with ``token``."""

    def __init__(self, host: str, port: int, token: str, timeout: timedelta) -> None:
        super().__init__()
        address = f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"
        self.address = address
        self._channel = grpc.insecure_channel(address)
        self._stub = pb_grpc.RendezvousStoreStub(self._channel)
        self._metadata = call_metadata(token)
        self._timeout = timeout

    # ------------------------------------------------------------------ c10d's operations
    def set(self, key: str, value) -> None:
        self._call(pb.StoreRequest(op=pb.STORE_SET, key=key, value=_bytes(value)))

    def get(self, key: str) -> bytes:
        return self._wait_for(key)

    def add(self, key: str, amount: int) -> int:
        return self._call(pb.StoreRequest(op=pb.STORE_ADD, key=key, amount=int(amount))).number

    def compare_set(self, key: str, expected, desired) -> bytes:
        request = pb.StoreRequest(op=pb.STORE_COMPARE_SET, key=key, expected=_bytes(expected), value=_bytes(desired))
        return self._call(request).value

    def check(self, keys) -> bool:
        return self._call(pb.StoreRequest(op=pb.STORE_CHECK, keys=list(keys))).found

    def wait(self, keys, timeout: timedelta | None = None) -> None:
        deadline = time.monotonic() + (timeout or self._timeout).total_seconds()
        for key in keys:
            self._wait_for(key, deadline)

    def delete_key(self, key: str) -> bool:
        return self._call(pb.StoreRequest(op=pb.STORE_DELETE, key=key)).found

    def num_keys(self) -> int:
        return self._call(pb.StoreRequest(op=pb.STORE_NUM_KEYS)).number

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = timeout

    def close(self) -> None:
        self._channel.close()

    # ------------------------------------------------------------------ plumbing
    def _wait_for(self, key: str, deadline: float | None = None) -> bytes:
        if deadline is None:
            deadline = time.monotonic() + self._timeout.total_seconds()
        pause = FIRST_POLL_S
        while True:
            reply = self._call(pb.StoreRequest(op=pb.STORE_GET, key=key), deadline)
            if reply.found:
                return reply.value
            if time.monotonic() + pause > deadline:
                raise dist.DistStoreError(f"store {self.address}: timed out after {self._timeout} waiting for key "
                                          f"{key!r}")  # fmt: skip
            time.sleep(pause)
            pause = min(2 * pause, LONGEST_POLL_S)

    def _call(self, request: pb.StoreRequest, deadline: float | None = None) -> pb.StoreReply:
        left = CALL_TIMEOUT_S if deadline is None else max(0.001, min(CALL_TIMEOUT_S, deadline - time.monotonic()))
        try:
            return self._stub.Call(request, metadata=self._metadata, timeout=left)
        except grpc.RpcError as err:
            raise dist.DistStoreError(f"store {self.address}: {pb.StoreOp.Name(request.op)} {request.key!r} "
                                      f"failed: {err.code().name} {err.details() or ''}".rstrip()) from None


def _bytes(value) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)

