"""Whether an emulated run measured the engine or the host: its verdict, from its steps and the host's CPU.

Two guards (``docs/emulation.md``, "Guards that make it a measurement"):

1. Lateness: the ops the workers judged (``emulation.clock``) may be late by more
   than ``LATE_FRACTION`` of their duration at most ``LATE_SHARE`` of the time
   (p99 lateness within 5% of the op).
2. CPU: the host's busy share over the run (every process, ours and others')
   under ``CPU_LIMIT`` of its cores. Above it, processes wait for a core, and a
   deadline met is luck.

A run that fails either is *invalid*: its figures must not be printed as results.

``judge`` is pure: plain numbers in, a verdict out; ``HostCpu`` reads the host's CPU counters.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
import math
import threading
import time
from dataclasses import dataclass
from typing import Any

import psutil

from oobleck_mm.emulation.clock import LATE_FRACTION, LATE_SHARE

CPU_LIMIT = 0.6
"""The most of the host's cores an emulated run may keep busy."""


@dataclass(frozen=True, slots=True)
class Verdict:
    valid: bool
    reason: str
    ops: int
    late_ops: int
    worst_lateness: float
    cpu_share: float | None
    workers: WorkerDemand | None = None
    late_ranks: dict[int, int] | None = None
    """Late ops per rank over the judged steps, the most first (ranks with none left out)."""

    def to_dict(self) -> dict:
        return {
            "valid": self.valid,
            "reason": self.reason,
            "ops": self.ops,
            "late_ops": self.late_ops,
            "worst_lateness": self.worst_lateness,
            "cpu_share": self.cpu_share,
            "workers": self.workers.to_dict() if self.workers is not None else None,
            "late_ranks": {str(rank): n for rank, n in (self.late_ranks or {}).items()},
        }


@dataclass(frozen=True, slots=True)
class WorkerDemand:
    """What the workers' processes asked of the host, per judged step (``StepResult.host_cpu_s``): an invalid
    run says with it how many cores its workers alone would need, which a user can act on (fewer nodes, a
    narrower compute copy, a larger host)."""

    cpu_s: float
    """CPU seconds of every worker's process in a step, summed (mean over the judged steps)."""
    busiest_rank_cpu_s: float
    """The most CPU seconds one worker spent in a step."""
    step_s: float
    """Wall seconds of a step (mean over the judged steps)."""

    @property
    def cores(self) -> float:
        """Cores the workers kept busy: their CPU seconds over the step's wall seconds."""
        return self.cpu_s / self.step_s

    @property
    def cores_needed(self) -> int:
        """The fewest cores on which the workers alone stay under ``CPU_LIMIT``."""
        return max(1, math.ceil(self.cores / CPU_LIMIT - 1e-9))

    def describe(self) -> str:
        return (
            f"the workers took {self.cpu_s:.2f} CPU-s a step (busiest rank {self.busiest_rank_cpu_s:.2f}) in "
            f"{self.step_s:.2f} s steps: {self.cores:.2f} cores, {self.cores_needed} for them alone at "
            f"{100 * CPU_LIMIT:.0f}%"
        )

    def to_dict(self) -> dict:
        return {
            "cpu_s": self.cpu_s,
            "busiest_rank_cpu_s": self.busiest_rank_cpu_s,
            "step_s": self.step_s,
            "cores": self.cores,
            "cores_needed": self.cores_needed,
        }


def judge(steps: Iterable[Mapping], cpu_share: float | None) -> Verdict:
    """The verdict of a run whose ``step`` rows (``master/progress.step_row``) and host CPU share are given.

    The first step of each generation is left out: its workers allocate their buffers and warm their
    caches in it (a process's first step lagged its device by up to 20x an op), which a long run pays once
    per reconfiguration and which is in its throughput all the same."""
    ops = late = 0
    worst = 0.0
    seen: set = set()
    cpu_s = step_s = busiest = 0.0  # the workers' demand, over the judged steps that reported it
    reported = 0
    by_rank: Counter = Counter()
    for row in steps:
        generation = row.get("generation")
        if generation is not None and generation not in seen:
            seen.add(generation)
            continue
        ops += int(row.get("emulated_ops") or 0)
        late += int(row.get("emulated_late_ops") or 0)
        worst = max(worst, float(row.get("emulated_worst_lateness") or 0.0))
        by_rank.update({int(rank): int(n) for rank, n in (row.get("emulated_late_ranks") or {}).items()})
        if row.get("emulated_host_cpu_s") and row.get("step_time_s"):
            reported += 1
            cpu_s += float(row["emulated_host_cpu_s"])
            step_s += float(row["step_time_s"])
            busiest = max(busiest, float(row.get("emulated_busiest_rank_cpu_s") or 0.0))
    workers = WorkerDemand(cpu_s / reported, busiest, step_s / reported) if reported else None
    problems = []
    if ops == 0:
        problems.append("no emulated op was judged (no step ran, or every op was under the judged length)")
    elif late > LATE_SHARE * ops:
        where = ", ".join(f"{rank} ({n})" for rank, n in by_rank.most_common(4))
        problems.append(
            f"{late} of {ops} ops ({100 * late / ops:.1f}%) ended more than {100 * LATE_FRACTION:.0f}% "
            f"of their duration late (at most {100 * LATE_SHARE:.0f}% may)"
            + (f", most on ranks {where}" if where else "")
        )
    if cpu_share is not None and cpu_share > CPU_LIMIT:
        problems.append(f"the host's CPU was {100 * cpu_share:.0f}% busy (at most {100 * CPU_LIMIT:.0f}%)")
    late_ranks = dict(by_rank.most_common())
    cpu = f", host CPU {100 * cpu_share:.0f}% busy" if cpu_share is not None else ""
    cpu += f"; {workers.describe()}" if workers is not None else ""
    reason = (
        "INVALID: " + "; ".join(problems) + cpu
        if problems
        else f"valid: {late} of {ops} ops late, worst {100 * worst:.1f}% of its op{cpu}"
    )
    return Verdict(not problems, reason, ops, late, worst, cpu_share, workers, late_ranks)


class HostCpu:
    """The host's busy share of its cores (every process: ``psutil.cpu_times``) over a window of wall time,
    from samples taken every ``SAMPLE_S`` by a thread of its own. The window is the training's (first to
    last step): the start-up's imports are not what an emulated op competes with."""

    SAMPLE_S = 0.5

    def __init__(self) -> None:
        self._samples: list[tuple[float, Any]] = [(time.time(), psutil.cpu_times())]
        self._halt = threading.Event()
        self._thread = threading.Thread(target=self._run, name="host-cpu", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._halt.wait(self.SAMPLE_S):
            self._samples.append((time.time(), psutil.cpu_times()))

    def stop(self) -> None:
        self._halt.set()
        self._thread.join(2 * self.SAMPLE_S)
        self._samples.append((time.time(), psutil.cpu_times()))

    def share(self, since: float | None = None, until: float | None = None) -> float:
        """Busy share between the samples nearest ``since`` and ``until`` (wall seconds; default: all)."""
        samples = list(self._samples)
        first = min(samples, key=lambda s: abs(s[0] - since)) if since is not None else samples[0]
        last = min(samples, key=lambda s: abs(s[0] - until)) if until is not None else samples[-1]
        if last[0] <= first[0]:
            first, last = samples[0], samples[-1]
        a, b = first[1], last[1]
        total = sum(b) - sum(a)
        idle = (b.idle - a.idle) + (getattr(b, "iowait", 0.0) - getattr(a, "iowait", 0.0))
        return (total - idle) / total if total > 0 else 0.0
