"""Seconds of work on the stage's device, read once per step; the worker's peak memory.

On the CPU work is done when the call returns: ``perf_counter`` around it is its
time. On a GPU a call only queues kernels, so a host clock measures launches;
CUDA events recorded on the stream around the work measure the kernels, and
reading them needs the events to have completed, which the engine does once at
the end of a step (one synchronisation, not one per microbatch). The balancer's
cost model is fitted to these per-microbatch times.
"""

from __future__ import annotations

import time

import torch


class Stopwatch:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._latest = None
        """The latest event recorded: once it completed, every earlier one on the stream has."""

    def start(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._latest = event
            return event
        return time.perf_counter()

    def stop(self, start):
        """An interval to read later with ``seconds``."""
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._latest = end
            return start, end
        return time.perf_counter() - start

    def seconds(self, interval) -> float:
        if interval is None:
            return 0.0
        if self.cuda:
            start, end = interval
            if not end.query():  # not done yet: wait once for everything recorded so far, so the
                self._latest.synchronize()  # step's other intervals read without another wait
            return start.elapsed_time(end) / 1000.0
        return interval


def peak_memory_bytes(device: torch.device) -> int:
    """This worker's memory high-water mark: the CUDA caching allocator's peak on a GPU (what a
    stage's plan must fit), the process's peak resident set on the CPU (``ru_maxrss``, KiB on Linux)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
