#!/usr/bin/env python
"""The control plane at 100 to 4,000 nodes (issue 30 item 3): the real master against emulated agents.

    python scripts/bench_control_plane.py [--nodes 100,1000] [--kill 10] [--heartbeat 1] [--store-ranks 16,64] [--json OUT]

For each node count, one ``oobleck-launch master`` (tiny_mm, heartbeats every 1 s, a 3 s timeout) and
that many emulated agents in a few processes: each registers with the job's token, opens its event
stream and heartbeats every interval, as ``oobleck_mm/agent/agent.py`` does, but starts no worker (no torch: what is
measured is the master, not the workers). Printed per size:

- registration: seconds until every node is registered and subscribed;
- the first plan's fan-out: from ``plan_decided`` to the last emulated agent holding its assignment;
- the master's CPU while every node heartbeats (its process' user + system seconds per wall second,
  over ``--window`` seconds: target under half a core at 1,000 nodes);
- detection: ``--kill`` agents stop heartbeating at once with their streams left open (a hung host, the
  slow case: only ``heartbeat_timeout`` tells), and the seconds from there to each ``lost`` event (target:
  at most ``heartbeat_timeout`` + 1 s);
- the first plan without any stopped node: seconds after the last loss, and its fan-out to the survivors;
- with ``--store-ranks``: one rendezvous of that many ranks (threads in a few processes) against the
  master's store server, polling only and with server-side long polls, side by side: calls, the
  server's CPU, and the wake-up latency after the last arrival.

The emulated agents share this machine's two cores with the master, so the figures are an upper bound.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CONFIG = ROOT / "configs" / "tiny_mm.yaml"
HEARTBEAT_S, TIMEOUT_S = 1.0, 3.0
AGENT_PROCESSES = 4


def emulated_agents(address: str, token: str, names: list[str], interval: float, out, control) -> None:
    """One process' share of the agents: register, subscribe, heartbeat; report each assignment's arrival
    (node, generation, wall time) on ``out``; on ``("stop", names)`` from ``control`` those stop heartbeating.

    With asyncio (``grpc.aio``): one task per node's stream instead of a thread. A thousand threads per
    process, each blocked in a stream, starved the heartbeat thread of the GIL on two cores: at 4,000
    nodes no heartbeat of the first nodes reached the master, and it (rightly) declared them all lost."""
    import asyncio

    import grpc

    from oobleck_mm.protocol import MESSAGE_OPTIONS
    from oobleck_mm.protocol import oobleck_pb2 as pb
    from oobleck_mm.protocol import oobleck_pb2_grpc as pb_grpc
    from oobleck_mm.protocol.auth import call_metadata

    metadata = call_metadata(token)
    refs: dict = {}
    stopped: set[str] = set()

    async def heartbeats(stub) -> None:  # from the first registration on, as a real agent does
        while True:
            began = time.monotonic()
            calls = [
                stub.Heartbeat(pb.HeartbeatRequest(node=ref), metadata=metadata, timeout=10)
                for name, ref in list(refs.items())
                if name not in stopped
            ]
            await asyncio.gather(*calls, return_exceptions=True)
            await asyncio.sleep(max(0.0, interval - (time.monotonic() - began)))

    async def listen(stub, ref) -> None:
        try:
            async for event in stub.Subscribe(ref, metadata=metadata):
                if event.WhichOneof("event") == "assignment":
                    out.put(("assigned", ref.node, event.assignment.assignment.generation, time.time()))
        except grpc.RpcError:
            pass

    async def main() -> None:
        loop = asyncio.get_running_loop()
        async with grpc.aio.insecure_channel(address, options=MESSAGE_OPTIONS) as channel:
            stub = pb_grpc.CoordinatorStub(channel)
            beating = asyncio.create_task(heartbeats(stub))
            for name in names:
                reply = await stub.Register(
                    pb.RegisterRequest(node=name, gpus=1, pid=os.getpid()), metadata=metadata, timeout=60
                )
                refs[name] = pb.NodeRef(node=name, session=reply.session)
            streams = [asyncio.create_task(listen(stub, ref)) for ref in refs.values()]
            out.put(("subscribed", len(refs), 0, time.time()))
            while True:
                kind, which = await loop.run_in_executor(None, control.get)
                if kind == "stop":
                    stopped.update(which)
                elif kind == "exit":
                    os._exit(0)
            del beating, streams

    try:
        asyncio.run(main())
    except grpc.RpcError:
        pass  # the master went away: the run ended (or failed, and the parent says why)


class NotHeld(RuntimeError):
    """The master lost nodes that were never stopped: too many for it (or for this machine) at that rate."""


class EventTail:
    """The master's event log, read as it grows: each call parses only the lines written since the last.
    Re-reading the whole log on every 50 ms poll (tens of thousands of lines at 4,000 nodes) took CPU
    from the master being measured on the same two cores."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.partial = path, 0, b""
        self.by_name: dict[str, list[dict]] = {}

    def __call__(self, name: str) -> list[dict]:
        """Every event called ``name`` so far, in order."""
        if self.path.exists():
            with open(self.path, "rb") as fh:
                fh.seek(self.offset)
                chunk = fh.read()
            self.offset += len(chunk)
            *lines, self.partial = (self.partial + chunk).split(b"\n")  # the last may be half written
            for line in lines:
                try:
                    e = json.loads(line)
                except json.JSONDecodeError:
                    continue
                self.by_name.setdefault(e.get("event"), []).append(e)
        return self.by_name.get(name, [])


def wait(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}")


def run_size(nodes: int, kill: int, window: float, say, heartbeat_s: float = HEARTBEAT_S) -> dict:
    timeout_s = TIMEOUT_S / HEARTBEAT_S * heartbeat_s  # the same 3 intervals
    work = Path(tempfile.mkdtemp(prefix=f"oobleck-cp-{nodes}-"))
    cmd = [
        sys.executable,
        "-m",
        "oobleck_mm.cli",
        "master",
        "--config",
        str(CONFIG),
        "--nodes",
        str(nodes),
        "--port",
        "0",
        "--run-dir",
        str(work / "run"),
        "--steps",
        "100000",
        "--log-level",
        "warning",
        "--set",
        f"fault_tolerance.heartbeat_interval={heartbeat_s}s",
        "--set",
        f"fault_tolerance.heartbeat_timeout={timeout_s}s",
        "--set",
        f"cluster.max_nodes={max(nodes, 16)}",
        "--set",
        "fault_tolerance.straggler_factor=0",
        "--set",
        f"training.global_batch={4 * nodes}",
    ]  # every pipeline (at most one per node) a microbatch
    log = open(work / "master.log", "w")
    master = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    agents, controls = [], []
    try:
        found = wait(
            lambda: re.search(r"master listening on (\S+) ", (work / "master.log").read_text()), 60, "the master"
        )
        address, token = found.group(1), (work / "run" / "token").read_text().strip()
        events = EventTail(work / "run" / "events.jsonl")
        out = mp.get_context("spawn").Queue()
        names = [f"node{i}" for i in range(nodes)]
        shares = [names[k::AGENT_PROCESSES] for k in range(AGENT_PROCESSES)]
        began = time.time()
        for share in shares:
            control = mp.get_context("spawn").Queue()
            p = mp.get_context("spawn").Process(
                target=emulated_agents, args=(address, token, share, heartbeat_s, out, control), daemon=True
            )
            p.start()
            agents.append(p)
            controls.append(control)
        assigned: dict[tuple[str, int], float] = {}
        subscribed = 0

        def drain() -> None:
            nonlocal subscribed
            while not out.empty():
                kind, node, generation, at = out.get()
                if kind == "subscribed":
                    subscribed += 1
                else:
                    assigned[(node, generation)] = at

        def held(what: str) -> None:
            """Nobody was stopped yet: a loss means this master (on this machine) did not hold ``nodes``."""
            lost = events("lost")
            if lost:
                late = len(events("heartbeat_late"))
                raise NotHeld(
                    f"{nodes} nodes heartbeating every {heartbeat_s:g} s not held: {len(lost)} lost "
                    f"({lost[0]['reason']}: {lost[0]['detail']}) before any was stopped, {late} "
                    f"heartbeat_late, while waiting for {what}"
                )

        def all_subscribed():
            drain()
            held("every agent subscribed")
            return subscribed == len(shares)

        wait(all_subscribed, 600, "every agent subscribed")
        registered_s = time.time() - began
        first = wait(lambda: held("the first plan") or events("plan_decided"), 600, "the first plan")[0]
        planned = set(first["nodes"])
        wait(
            lambda: held("generation 1's assignments") or drain() or all((n, 1) in assigned for n in planned),
            300,
            "every assignment of generation 1",
        )
        fan_out_1 = max(assigned[(n, 1)] for n in planned) - first["ts"]
        say(
            f"{nodes} nodes: registered and subscribed in {registered_s:.1f} s; generation 1 planned on "
            f"{len(planned)} nodes, every assignment received {fan_out_1:.3f} s after plan_decided"
        )
        proc = psutil.Process(master.pid)
        cpu0, t0 = proc.cpu_times(), time.monotonic()
        time.sleep(window)
        cpu1, t1 = proc.cpu_times(), time.monotonic()
        held("the CPU window to end")
        cores = ((cpu1.user + cpu1.system) - (cpu0.user + cpu0.system)) / (t1 - t0)
        threads = proc.num_threads()
        say(
            f"{nodes} nodes heartbeating every {heartbeat_s:g} s: the master used {cores:.2f} cores ({threads} threads)"
        )
        victims = names[-kill:]
        stop_at = time.time()
        for control, share in zip(controls, shares):
            control.put(("stop", [n for n in victims if n in set(share)]))
        lost = wait(
            lambda: (found := {e["node"]: e for e in events("lost")}) and all(v in found for v in victims) and found,
            timeout_s * 10 + 60,
            "every stopped node lost",
        )
        detection = sorted(lost[v]["ts"] - stop_at for v in victims)
        # What the master saw: each node's silence when it was declared lost. Above, from the stop: that
        # also counts a beat an emulating process had in flight when the stop reached it (busy: one interval).
        silence = sorted(
            float(m.group(1))
            for v in victims
            if (m := re.search(r"no heartbeat for ([\d.]+)s", lost[v].get("detail", "")))
        )
        last_loss = max(lost[v]["ts"] for v in victims)
        # The first plan without any stopped node (a loss detected alone may be planned before the others).
        second = wait(
            lambda: [e for e in events("plan_decided") if e["generation"] > 1 and not set(victims) & set(e["nodes"])],
            300,
            "the recovery plan",
        )[0]
        survivors = set(second["nodes"])
        gen = second["generation"]
        wait(lambda: drain() or all((n, gen) in assigned for n in survivors), 300, "every recovery assignment")
        fan_out_2 = max(assigned[(n, gen)] for n in survivors) - second["ts"]
        say(
            f"{nodes} nodes: {kill} stopped (heartbeats only), lost after {detection[0]:.2f}-{detection[-1]:.2f} s "
            f"(silent {silence[0]:.2f}-{silence[-1]:.2f} s when declared lost; heartbeat_timeout {timeout_s:g} s); "
            f"generation {gen} on {len(survivors)} nodes planned "
            f"{second['ts'] - last_loss:.2f} s after the last loss, every assignment received "
            f"{fan_out_2:.3f} s after plan_decided"
        )
        return {
            "nodes": nodes,
            "held": True,
            "heartbeat_s": heartbeat_s,
            "heartbeat_timeout_s": timeout_s,
            "registered_s": round(registered_s, 2),
            "fan_out_1_s": round(fan_out_1, 4),
            "master_cores": round(cores, 3),
            "master_threads": threads,
            "killed": kill,
            "detection_s": [round(d, 3) for d in (detection[0], detection[len(detection) // 2], detection[-1])],
            "silence_at_loss_s": [round(silence[0], 3), round(silence[-1], 3)],
            "plan_after_last_loss_s": round(second["ts"] - last_loss, 3),
            "fan_out_recovery_s": round(fan_out_2, 4),
            "survivors": len(survivors),
        }
    finally:
        for control in controls:
            control.put(("exit", None))
        master.kill()
        master.wait()
        for p in agents:
            p.join(5)
            if p.is_alive():
                p.kill()


STORE_SERVER = """
import sys, time
sys.path.insert(0, sys.argv[1])
from oobleck_mm.master.store import serve_store_only
server, port = serve_store_only(sys.argv[2], max_waiters=int(sys.argv[3]))
print(port, flush=True)
sys.stdin.read()
"""


def store_ranks(
    port: int,
    token: str,
    ranks: list[int],
    world: int,
    long_poll: bool,
    reuse_waited: bool,
    spread_s: float,
    out,
    siblings: bool = False,
) -> None:
    """A share of one rendezvous' ranks, a thread each: arrive at a random moment within ``spread_s``, set
    its key, then read every rank's key as gloo's connect reads its peers' addresses (``wait([key])`` then
    ``get(key)``, its own included: logged from ``ProcessGroupGloo``'s construction on a store that records
    its calls); report (calls made, the time its last key arrived, the time it was done)."""
    import random
    from datetime import timedelta

    from oobleck_mm.runtime.store import ControlPlaneStore

    def rank(i: int) -> None:
        store = ControlPlaneStore(
            "127.0.0.1",
            port,
            token,
            timedelta(seconds=60),
            long_poll=long_poll,
            reuse_waited=reuse_waited,
            siblings=siblings,
        )
        time.sleep(random.Random(i).uniform(0, spread_s))
        store.set(f"group/rank/{i}", b"x")
        set_at = time.time()
        for j in range(world):
            store.wait([f"group/rank/{j}"])
            store.get(f"group/rank/{j}")
        out.put((store.calls, set_at, time.time()))
        store.close()

    threads = [threading.Thread(target=rank, args=(i,)) for i in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def run_store(
    world: int, long_poll: bool, spread_s: float, say, reuse_waited: bool = True, siblings: bool = False
) -> dict:
    """One rendezvous of ``world`` ranks against the master's store server (``oobleck_mm.master.store``, a process of
    its own): the store calls it took, the server's CPU seconds, and how long after the last rank arrived
    the last one was done (the wake-up latency that polling trades against calls)."""
    import secrets

    token = secrets.token_hex(16)
    # As many long polls at once as the master allows a job of ``world`` one-GPU nodes (oobleck_mm/master/server.py).
    waiters = max(4, world // 2)
    server = subprocess.Popen(
        [sys.executable, "-c", STORE_SERVER, str(ROOT), token, str(waiters)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        port = int(server.stdout.readline())
        cpu = psutil.Process(server.pid)
        before = cpu.cpu_times()
        out = mp.get_context("fork").Queue()
        shares = [list(range(world))[k::AGENT_PROCESSES] for k in range(AGENT_PROCESSES)]
        procs = [
            mp.get_context("fork").Process(
                target=store_ranks, args=(port, token, share, world, long_poll, reuse_waited, spread_s, out, siblings)
            )
            for share in shares
        ]
        for p in procs:
            p.start()
        results = [out.get(timeout=120) for _ in range(world)]
        for p in procs:
            p.join(30)
        after = cpu.cpu_times()
    finally:
        server.stdin.close()
        server.wait(10)
    calls = sum(r[0] for r in results)
    last_set, last_done = max(r[1] for r in results), max(r[2] for r in results)
    row = {
        "part": "store",
        "ranks": world,
        "long_poll": long_poll,
        "reuse_waited": reuse_waited,
        "siblings": siblings,
        "server_long_polls": waiters,
        "arrivals_spread_s": spread_s,
        "calls": calls,
        "calls_per_rank": round(calls / world, 1),
        "server_cpu_s": round(after.user + after.system - before.user - before.system, 3),
        "last_arrival_to_done_s": round(last_done - last_set, 4),
    }
    say(
        f"store, {world} ranks arriving within {spread_s:g} s, {'long poll' if long_poll else 'polling only'}"
        f"{', a wait read once' if reuse_waited else ', a wait read twice'}"
        f"{', siblings prefetched' if siblings else ''}: "
        f"{calls} calls ({row['calls_per_rank']} per rank), server CPU {row['server_cpu_s']:.2f} s, last rank "
        f"done {row['last_arrival_to_done_s'] * 1000:.1f} ms after the last arrival"
    )
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", default="100,1000")
    parser.add_argument("--kill", type=int, default=10)
    parser.add_argument("--window", type=float, default=10.0, help="seconds the master's CPU is measured over")
    parser.add_argument(
        "--store-ranks",
        default="",
        help="also one rendezvous of this many ranks (e.g. 16,64) "
        "against the store: polling only, long polls, long polls with a wait's read reused, and "
        "with a wait's siblings prefetched",
    )
    parser.add_argument("--store-only", action="store_true", help="only the store part")
    parser.add_argument(
        "--store-spread",
        type=float,
        default=0.5,
        help="seconds over which the rendezvous' ranks arrive (0.02: the survivors of a loss)",
    )
    parser.add_argument(
        "--heartbeat",
        type=float,
        default=HEARTBEAT_S,
        help=f"heartbeat interval in seconds, the timeout 3 of them (default {HEARTBEAT_S:g})",
    )
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    say = lambda line: print(line, flush=True)  # noqa: E731
    rows, failed = [], False
    for n in [] if args.store_only else [int(n) for n in args.nodes.split(",")]:
        try:
            rows.append(run_size(n, args.kill, args.window, say, args.heartbeat))
        except NotHeld as err:  # a figure too: printed, kept in the JSON, and the exit code says so
            say(str(err))
            rows.append({"nodes": n, "heartbeat_s": args.heartbeat, "held": False, "why": str(err)})
            failed = True
    for world in [int(n) for n in args.store_ranks.split(",") if n]:
        for long_poll, reuse, siblings in (
            (False, False, False),
            (True, False, False),
            (True, True, False),
            (True, True, True),
        ):  # side by side, in one run
            rows.append(
                run_store(world, long_poll, spread_s=args.store_spread, say=say, reuse_waited=reuse, siblings=siblings)
            )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
