"""Failure detection as a pure function of the node states and the clock.

A node is the failure unit. It is lost when
- its agent reported a worker that exited, turned zombie or stopped (``worker_*``),
- its Subscribe stream ended (``stream_closed``: a dead agent's sockets are reset
  by the kernel, so this fires at once), or
- no heartbeat arrived for longer than the timeout (``heartbeat_timeout``: the
  hung node, e.g. a SIGSTOPped agent whose sockets stay open), or
- where ``fault_tolerance.confirmed_silence`` is set (it is off by default),
  no heartbeat arrived for longer than it while a worker of another node
  reported waiting on a collective since (``heartbeat_late_peers_stalled``):
  a hung node stalls the job at once, so its peers' waits confirm its silence.
  Off by default because a slow *link* gives the same evidence: a healthy
  node's heartbeats queue behind its bulk transfers while its peers wait for
  those transfers (a real 2 Mbit/s link in a network namespace, measured in
  ``tests/e2e/test_partition.py``'s making: 2.4 s late heartbeats, declared lost
  at 1.5 s).

Apart from those signs of the node itself, ``silent_reporters`` finds a node
whose agent heartbeats but whose workers' reports stopped (``reports_silent``):
every rank of a generation reports every step, and a step needs every rank, so a
step of the current generation that some rank reported proves that the others
did it too; a rank whose report of it has not come within
``fault_tolerance.reports_silence_limit`` is being kept from the master (its
agent's report thread died under it, issue 55), and the job would wait for it
until ``stall_timeout``. Lost, the node registers again and joins as new.

Silence alone never takes *every* node at once before ``ALL_SILENT_GRACE``
times the timeout: when no node heartbeats and none closed its stream or
reported a failure, the likelier cause is on the master's side (its host or
network busy, the agents' host starved while workers import), and declaring
them all lost could only end the job, so waiting longer costs nothing.
The master feeds this function snapshots; it keeps no state and reads no clock,
so every rule is tested by building the states by hand.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from oobleck_mm.config import FaultToleranceConfig
from oobleck_mm.planning.layout import Gpu

STREAM_CLOSED = "stream_closed"
HEARTBEAT_TIMEOUT = "heartbeat_timeout"
HEARTBEAT_LATE_PEERS_STALLED = "heartbeat_late_peers_stalled"
WORKER_EXITED = "worker_exited"
WORKER_STOPPED = "worker_stopped"
WORKER_ZOMBIE = "worker_zombie"
REPORTS_SILENT = "reports_silent"
WORKER_FAILED = "worker_failed"
"""The worker itself reported an error (``WorkerFailed``) before exiting."""
WORKER_REASONS = (WORKER_EXITED, WORKER_STOPPED, WORKER_ZOMBIE, WORKER_FAILED)
LATE_HEARTBEAT_SHARE = 0.5
"""A heartbeat that arrives more than this share of ``heartbeat_timeout`` after the node's previous one
is recorded (event ``heartbeat_late``, with the gap): the node is alive, but its link or its host is
slow enough that a little more would lose it."""
ALL_SILENT_GRACE = 2.0
"""Times ``heartbeat_timeout`` that silence must last before it takes every node of the job at once
(measured: under CPU load at start-up, all 7 agents of a replay went 3.09 s without a heartbeat against
a 3 s timeout, and the job ended with exit 3 though every node was healthy)."""


@dataclass(frozen=True, slots=True)
class NodeHealth:
    last_heartbeat: float
    """Clock reading (monotonic seconds) of the last heartbeat, or of the registration."""
    stream_closed: bool = False
    """The node's Subscribe stream ended without the master closing it."""
    worker_failure: str | None = None
    """One of ``WORKER_REASONS`` when the agent or a worker reported a failure."""
    detail: str = ""
    """Human-readable detail of ``worker_failure`` (exit code, status)."""

    def __post_init__(self) -> None:
        if self.worker_failure is not None and self.worker_failure not in WORKER_REASONS:
            raise ValueError(f"worker_failure: {self.worker_failure!r} is not one of {WORKER_REASONS}")


@dataclass(frozen=True, slots=True)
class Failure:
    node: str
    reason: str
    detail: str


def detect_failures(
    now: float,
    nodes: Mapping[str, NodeHealth],
    timeouts: FaultToleranceConfig,
    stalls: Mapping[str, float] | None = None,
) -> list[Failure]:
    """The lost nodes among ``nodes`` at clock ``now``, sorted by name, each with its reason.

    ``timeouts``: the job's fault-tolerance section (``heartbeat_timeout`` and
    ``confirmed_silence``). ``stalls[node]``: clock reading of the latest report that a worker
    of ``node`` waited on a collective for longer than ``stall_report_after``. When several
    signs hold, the most specific wins: a worker report says why, a closed stream says the
    agent is gone, a silent node only that it hangs.
    """
    limit = timeouts.heartbeat_timeout.total_seconds()
    confirmed = math.inf if timeouts.confirmed_silence is None else timeouts.confirmed_silence.total_seconds()
    out = []
    for name in sorted(nodes):
        health = nodes[name]
        if health.worker_failure is not None:
            out.append(Failure(name, health.worker_failure, health.detail))
        elif health.stream_closed:
            out.append(Failure(name, STREAM_CLOSED, "event stream to the agent ended"))
        elif now - health.last_heartbeat > limit:
            silent = now - health.last_heartbeat
            out.append(Failure(name, HEARTBEAT_TIMEOUT, f"no heartbeat for {silent:.2f}s (timeout {limit:g}s)"))
        elif now - health.last_heartbeat > confirmed:
            # A stall reported after this node's last heartbeat, and recently: the job waits while it is silent.
            witnesses = sorted(
                peer
                for peer, at in (stalls or {}).items()
                if peer != name and health.last_heartbeat < at and now - at <= limit
            )
            if witnesses:
                silent = now - health.last_heartbeat
                out.append(
                    Failure(
                        name,
                        HEARTBEAT_LATE_PEERS_STALLED,
                        f"no heartbeat for {silent:.2f}s while {', '.join(witnesses)} waited on a "
                        f"collective (timeout {limit:g}s, {confirmed:g}s with a stalled peer)",
                    )
                )
    silent_only = all(f.reason == HEARTBEAT_TIMEOUT for f in out)
    if out and silent_only and len(out) == len(nodes) > 1:
        quietest = min(now - nodes[f.node].last_heartbeat for f in out)
        if quietest <= ALL_SILENT_GRACE * limit:
            return []  # every node silent at once: more likely our side; the grace costs nothing (see above)
    return out


def recent_stalls(
    now: float, stalls: Mapping[str, float], nodes: Collection[str], timeouts: FaultToleranceConfig
) -> dict[str, float]:
    """The stall reports ``detect_failures`` may still use: of live ``nodes``, no older than the timeout."""
    limit = timeouts.heartbeat_timeout.total_seconds()
    return {node: at for node, at in stalls.items() if node in nodes and now - at <= limit}


def silent_reporters(
    now: float,
    generation: int,
    gpus: Collection[Gpu],
    latest: Mapping[Gpu, tuple[int, int]],
    first_seen: Mapping[tuple[int, int], float],
    limit: float,
) -> list[Failure]:
    """Nodes of generation ``generation`` (its ranks: ``gpus``) whose reports lag the job's: some rank
    reported a step that one of theirs has not, and the first report of that step came over ``limit``
    seconds ago.

    ``latest[gpu]``: (generation, step) of the rank's newest step report (a metrics or done report);
    ``first_seen[(generation, step)]``: clock when any rank first reported that step.
    """
    steps = sorted((step, at) for (gen, step), at in first_seen.items() if gen == generation)
    out: dict[str, Failure] = {}
    for gpu in sorted(gpus):
        gen, own = latest.get(gpu, (generation, -1))
        own = own if gen == generation else -1
        missed = next(((step, at) for step, at in steps if step > own), None)
        if missed is None or now - missed[1] <= limit or gpu[0] in out:
            continue
        step, at = missed
        said = f"after step {own}" if own >= 0 else f"of generation {generation}"
        out[gpu[0]] = Failure(
            gpu[0],
            REPORTS_SILENT,
            f"no report from local rank {gpu[1]} {said}, while the job reported step {step} "
            f"{now - at:.1f}s ago (limit {limit:.1f}s): its agent heartbeats, but its workers' "
            f"reports do not reach the master",
        )
    return [out[name] for name in sorted(out)]
