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

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

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

    def to_dict(self) -> dict:
        return {"valid": self.valid, "reason": self.reason, "ops": self.ops, "late_ops": self.late_ops,
                "worst_lateness": self.worst_lateness, "cpu_share": self.cpu_share}  # fmt: skip


def judge(steps: Iterable[Mapping], cpu_share: float | None) -> Verdict:
    """The verdict of a run whose ``step`` rows (``master/progress.step_row``) and host CPU share are given."""
    ops = late = 0
    worst = 0.0
    for row in steps:
        ops += int(row.get("emulated_ops") or 0)
        late += int(row.get("emulated_late_ops") or 0)
        worst = max(worst, float(row.get("emulated_worst_lateness") or 0.0))
    problems = []
    if ops == 0:
        problems.append("no emulated op was judged (no step ran, or every op was under the judged length)")
    elif late > LATE_SHARE * ops:
        problems.append(f"{late} of {ops} ops ({100 * late / ops:.1f}%) ended more than {100 * LATE_FRACTION:.0f}% "
                        f"of their duration late (at most {100 * LATE_SHARE:.0f}% may)")
    if cpu_share is not None and cpu_share > CPU_LIMIT:
        problems.append(f"the host's CPU was {100 * cpu_share:.0f}% busy (at most {100 * CPU_LIMIT:.0f}%)")
    cpu = f", host CPU {100 * cpu_share:.0f}% busy" if cpu_share is not None else ""
    if problems:
        return Verdict(False, "INVALID: " + "; ".join(problems) + cpu, ops, late, worst, cpu_share)
    return Verdict(True, f"valid: {late} of {ops} ops late, worst {100 * worst:.1f}% of its op{cpu}", ops, late,
                   worst, cpu_share)


class HostCpu:
    """The host's busy share of its cores since this object was made (every process: ``psutil.cpu_times``)."""

    def __init__(self) -> None:
        self._start = psutil.cpu_times()

    def share(self) -> float:
        end = psutil.cpu_times()
        total = sum(end) - sum(self._start)
        idle = (end.idle - self._start.idle) + (getattr(end, "iowait", 0.0) - getattr(self._start, "iowait", 0.0))
        return (total - idle) / total if total > 0 else 0.0
