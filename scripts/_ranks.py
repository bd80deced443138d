"""One spawned process per rank around a TCPStore on a free port, for the benchmarks that play a job by hand.

Shared by ``bench_balancer.py --real`` and ``bench_deferral.py``: start every rank, wait for all, and kill
any still running when one fails or the wait ends (none is left behind).
"""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist


def run_ranks(
    target: Callable,
    args_of: Callable[[int, int], tuple],
    world: int,
    timeout_s: float,
    store_timeout: timedelta = timedelta(seconds=120),
) -> None:
    """``target(*args_of(rank, port))`` in ``world`` spawned processes; raises if any exits non-zero."""
    from oobleck_mm.runtime.worker import free_port

    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=store_timeout)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=args_of(rank, port), daemon=True) for rank in range(world)]
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout_s)
        if any(p.exitcode != 0 for p in procs):
            raise RuntimeError(f"workers exited with {[p.exitcode for p in procs]}")
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        del store
