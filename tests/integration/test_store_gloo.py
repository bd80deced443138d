"""gloo forms its groups through the master's store as the store expects: a wait for each key, then its get.

``ControlPlaneStore`` answers a get that follows the wait for its key from what the
wait read (half the calls of a rendezvous). That pays only while gloo's connect
keeps the pattern it has today; a torch upgrade that changed it would silently
double the calls again, so this test forms real gloo groups (threads of one
process, each rank its own store client, as each worker has) and asserts every
peer's address was read once.
"""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from oobleck_mm.master.store import serve_store_only
from oobleck_mm.runtime.store import ControlPlaneStore

pytestmark = pytest.mark.integration

WORLD = 3


def test_gloos_connect_reads_each_peers_address_once_and_the_group_works(monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    server, port = serve_store_only("tok")
    stores = [ControlPlaneStore("127.0.0.1", port, "tok", timedelta(seconds=20)) for _ in range(WORLD)]
    sums, errors = [None] * WORLD, []

    def rank(r: int) -> None:
        try:
            group = dist.ProcessGroupGloo(dist.PrefixStore("gen3", stores[r]), r, WORLD, timedelta(seconds=20))
            x = torch.tensor([float(r + 1)], dtype=torch.float64)
            group.allreduce([x]).wait()
            sums[r] = float(x[0])
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    try:
        threads = [threading.Thread(target=rank, args=(r,)) for r in range(WORLD)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
        assert sums == [6.0] * WORLD
        # gloo reads every rank's address (its own included), each right after waiting for it.
        assert [s.reused for s in stores] == [WORLD] * WORLD, [s.reused for s in stores]
    finally:
        for s in stores:
            s.close()
        server.stop(0)
