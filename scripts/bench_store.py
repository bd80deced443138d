#!/usr/bin/env python
"""Rendezvous cost of the master's authenticated store against torch's TCPStore, side by side.

    python scripts/bench_store.py [--ranks 4] [--rounds 10] [--json OUT]

The workers of a generation form their groups through a c10d store: the arrival
barrier, ``init_process_group`` (gloo's full mesh) and the subgroups the engine
makes (one ``new_group`` per layer-holder set). Since issue 14 the store is the
master's ``RendezvousStore`` gRPC service behind the job token
(``runtime/store.py``), not torch's unauthenticated TCPStore. This measures what
that costs a recovery: ``--ranks`` processes on this machine each run
``--rounds`` generations through ``runtime.group.join_generation`` plus two
``new_group`` calls and one all-reduce, once against each store (a fresh server
per store, the order alternating per round so machine noise hits both alike),
and prints the median and worst seconds per generation (the slowest rank's) and
their ratio.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TOKEN = "bench-token"
TIMEOUT = timedelta(seconds=60)


def _rank_main(kind: str, port: int, rank: int, world: int, generations: list[int], out) -> None:
    import torch
    import torch.distributed as dist

    from oobleck_mm.runtime.group import join_generation, leave_group

    if kind == "grpc":
        from oobleck_mm.runtime.store import ControlPlaneStore

        store = ControlPlaneStore("127.0.0.1", port, TOKEN, TIMEOUT)
    else:
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=TIMEOUT)
    times = []
    for generation in generations:
        started = time.perf_counter()
        join_generation(store, generation, rank, world, "gloo", collective_timeout=TIMEOUT, arrival_timeout=TIMEOUT)
        halves = [dist.new_group(list(range(0, world, 2))), dist.new_group(list(range(1, world, 2)))]
        value = torch.ones(1)
        dist.all_reduce(value)
        assert value.item() == world and halves
        times.append(time.perf_counter() - started)
        dist.barrier()
    leave_group()
    out.put((rank, times))


def run(kind: str, world: int, generations: list[int]) -> list[float]:
    """Seconds per generation (the slowest rank's) of ``world`` processes on a fresh ``kind`` store."""
    import torch.distributed as dist

    if kind == "grpc":
        from oobleck_mm.master.store import serve_store_only

        server, port = serve_store_only(TOKEN)
    else:
        from oobleck_mm.runtime.worker import free_port

        port = free_port()
        server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(kind, port, r, world, generations, out)) for r in range(world)]
    try:
        for p in procs:
            p.start()
        results = dict(out.get(timeout=300) for _ in procs)
        for p in procs:
            p.join(30)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        if kind == "grpc":
            server.stop(grace=0)
    return [max(results[r][i] for r in results) for i in range(len(generations))]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=10, help="generations per store and round")
    parser.add_argument("--json", default=None, metavar="OUT")
    args = parser.parse_args(argv)
    seconds: dict[str, list[float]] = {"tcpstore": [], "grpc": []}
    for round_ in range(2):  # alternate the order so that machine noise hits both stores alike
        for kind in ("tcpstore", "grpc") if round_ == 0 else ("grpc", "tcpstore"):
            # generation numbers from 2: the first generation of a process also pays gloo's warm-up
            seconds[kind] += run(kind, args.ranks, list(range(2, 2 + args.rounds)))[1:]
    result = {
        kind: {"median_s": statistics.median(v), "max_s": max(v), "generations": len(v)} for kind, v in seconds.items()
    }
    result["ratio_median"] = result["grpc"]["median_s"] / result["tcpstore"]["median_s"]
    result["ranks"] = args.ranks
    for kind in ("tcpstore", "grpc"):
        r = result[kind]
        print(
            f"{kind:9s} rendezvous + 2 subgroups + all-reduce, {args.ranks} ranks: median {r['median_s'] * 1e3:.1f} ms, "
            f"worst {r['max_s'] * 1e3:.1f} ms over {r['generations']} generations"
        )
    print(f"authenticated store / TCPStore (median): {result['ratio_median']:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
