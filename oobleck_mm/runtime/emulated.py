"""A worker's emulated accelerator (``cluster.emulate``): what its stage's ops would take on the real GPU.

The worker computes the shrunk compute copy (``config.emulation.compute_job``); this
object knows the *real* job: its truth (``emulation.truth``), its data's sample
metadata (every sample's real image patches, audio frames and text tokens) and a
deadline clock (``emulation.clock``). The engine asks it, op by op:

- a forward or backward of a microbatch takes the true seconds of the stage's
  layers over that microbatch's real samples, times the node's speed factor (a
  straggler, ``slow:NODE@...xF``), on the device's timeline (a stream: the host
  runs ahead and waits for the device only before a collective and at a step's
  end, as a GPU's host does; ``emulation.clock.DeviceClock``);
- a stage-to-stage message arrives when the device produced it + alpha +
  bytes/beta of the real activation's bytes (the sender writes that time into
  the message's header, ``runtime/p2p.py``); the receiver's device waits for it;
- the layer-wise gradient all-reduce and a recovery's state copy take their ring
  and link times of the real model's bytes, after the real (tiny) ones.

What stays real time: every control-plane step (heartbeats, detection, planning,
rendezvous, checkpoint writes) and the host work between ops.

The speed factor of a slowed node: ``emulation.speed``, read before each step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
import torch.distributed as dist

from oobleck_mm.data.loader import TrainingData
from oobleck_mm.emulation.clock import DeviceClock, Interrupted, Lateness
from oobleck_mm.emulation.speed import SpeedFile
from oobleck_mm.emulation.truth import Truth
from oobleck_mm.runtime.waiting import PeerFailure


class Emulation:
    """One worker's emulated accelerator, shared by its engines across generations."""

    def __init__(self, job, node: str, speed: SpeedFile | None = None) -> None:
        self.job = job
        """The real job: what is planned, balanced and timed."""
        self.truth = Truth(job)
        self.data = TrainingData(job)
        """The real data: only its sample metadata is read."""
        self.clock = DeviceClock()
        self.speed = speed if speed is not None else SpeedFile(node)
        self.factor = 1.0
        self._metas: dict[int, object] = {}

    @classmethod
    def for_job(cls, job, node: str) -> Emulation | None:
        return cls(job, node) if job.cluster.emulate is not None else None

    def metas(self, ids: Sequence[int]) -> list:
        missing = [i for i in ids if i not in self._metas]
        if missing:
            self._metas.update(zip(missing, self.data.metas(missing)))
        return [self._metas[i] for i in ids]

    def begin_step(self, step: int, interrupt=None) -> None:
        """Global step ``step`` begins: this node's speed as the injector left it, the step's true durations,
        the host in step with its device."""
        self.factor = self.speed.read()
        self.truth.at_step(step)
        with _abandoned():
            self.clock.begin_step(interrupt)

    def take(self) -> Lateness:
        return self.clock.take()

    def stage(self, layers: Sequence[int], seam: int | None, pipelines: int, recompute: bool = False) -> StageTimer:
        return StageTimer(self, layers, seam, pipelines, recompute)


class StageTimer:
    """One stage's ops on the emulated device (``emulation.clock.DeviceClock``): forward, backward, sends,
    receives, the all-reduce, and the syncs where the host waits for the device."""

    def __init__(
        self, emulation: Emulation, layers: Sequence[int], seam: int | None, pipelines: int, recompute: bool = False
    ) -> None:
        self.recompute = recompute
        """The plan's ``StageSpec.recompute``: the real device would run the stage's forward again in backward."""
        self.emulation, self.truth, self.clock = emulation, emulation.truth, emulation.clock
        self.layers = list(layers)
        self.encoder = self.truth.groups([i for i in layers if seam is not None and i < seam])
        self.llm = self.truth.groups([i for i in layers if seam is None or i >= seam])
        self.everything = self.truth.groups(self.layers)
        self.pipelines = pipelines

    def forward(self, issued: float, encoder_ids: Sequence[int], llm_ids: Sequence[int]) -> float:
        """A microbatch's forward, issued by the host at ``issued``: its encoder layers ran ``encoder_ids``, its
        LLM layers ``llm_ids`` (the same samples unless Entrain's deferral decoupled them). Returns its seconds
        on the device (what a CUDA event pair would measure)."""
        metas = self.emulation.metas
        seconds = (
            self.truth.stage_seconds(self.encoder, metas(encoder_ids))[0]
            + self.truth.stage_seconds(self.llm, metas(llm_ids))[0]
        )
        start, end = self.clock.run(issued, seconds * self.emulation.factor, "forward")
        return end - start

    def backward(self, issued: float, ids: Sequence[int]) -> float:
        """A microbatch's backward over ``ids`` (its LLM samples: with deferral, the encoder groups it reaches
        are exactly those), issued at ``issued``; returns its seconds on the device."""
        seconds = self.truth.stage_seconds(self.everything, self.emulation.metas(ids), self.recompute)[1]
        start, end = self.clock.run(issued, seconds * self.emulation.factor, "backward")
        return end - start

    def arrival(self, last_layer: int, ids: Sequence[int]) -> float:
        """When a message sent once the device has produced it (layer ``last_layer``'s output over ``ids``, or
        its gradient) arrives on the emulated network: not before the host sends it."""
        num_bytes = self.truth.output_bytes(last_layer, self.emulation.metas(ids))
        return max(self.clock.free_at, self.clock.now()) + self.truth.transfer_s(num_bytes)

    def received(self, arrival: float) -> None:
        """A message whose emulated arrival is ``arrival`` (0: none) reached the host: the device's next op
        waits for it."""
        if arrival > 0:
            self.clock.arrive(arrival)

    def sync(self, what: str, interrupt=None) -> float:
        """The host waits for the device (before a collective: every rank's gradients are done on the device
        when the real collective starts). Returns the host's time after; ``PeerFailure`` when ``interrupt``
        says the master re-planned meanwhile."""
        with _abandoned():
            return self.clock.sync(what, interrupt)

    def ready_for_allreduce(self, sync, waiter) -> list[tuple[float, list[int], int]]:
        """Before the real gradient all-reduce (the host synced with its device): for each of this rank's buckets
        (``GradientSync.buckets``: layers of one holder set), when the last of its holders' devices had its
        gradients (a MAX over the bucket's group), its layers and its holder count. The true all-reduce of a
        bucket starts then, not when the real one (tiny, but on shared cores tens of ms for 32 ranks) ends."""
        out = []
        for bucket in sync.buckets:
            if sync.rank not in bucket.holders or len(bucket.holders) == 1:
                continue
            ready = torch.tensor([self.clock.free_at], dtype=torch.float64)
            work = dist.all_reduce(ready, op=dist.ReduceOp.MAX, group=sync.groups[bucket.holders], async_op=True)
            waiter.wait(work, f"emulated device times over ranks {bucket.holders}")
            out.append((float(ready[0]), list(bucket.layers), len(bucket.holders)))
        return out

    def allreduce(self, ready: Sequence[tuple[float, Sequence[int], int]]) -> None:
        """The layer-wise gradient all-reduces of this rank's buckets (``ready_for_allreduce``), one after the
        other on its device, each from when its holders were all ready; the real ones ran meanwhile."""
        for when, layers, holders in ready:
            self.clock.run(
                max(when, self.clock.free_at), self.truth.allreduce_s(layers, holders), "all-reduce", judged=False
            )


@contextlib.contextmanager
def _abandoned():
    """A device wait the master's re-plan interrupted ends the iteration like an abandoned collective."""
    try:
        yield
    except Interrupted as stop:
        raise PeerFailure(str(stop)) from None


def copy_wait(emulation: Emulation | None, layers: Sequence[int], start: float, interrupt=None) -> None:
    """A recovery's copy of ``layers``' states into this rank, on its one link, begun at ``start``: the worker
    waits for it (training resumes once every rank holds its layers); ``PeerFailure`` when ``interrupt`` says
    the master re-planned meanwhile (a loss during a 10 s copy of MLLM-10B's layers)."""
    if emulation is not None and layers:
        emulation.clock.run(start, emulation.truth.copy_s(layers), "state copy", judged=False)
        with _abandoned():
            emulation.clock.sync("state copy", interrupt)
