"""A worker's emulated accelerator (``cluster.emulate``): what its stage's ops would take on the real GPU.

The worker computes the shrunk compute copy (``config.emulation.compute_job``); this
object knows the *real* job: its truth (``emulation.truth``), its data's sample
metadata (every sample's real image patches, audio frames and text tokens) and a
deadline clock (``emulation.clock``). The engine asks it, op by op:

- a forward or backward of a microbatch ends at start + the true seconds of the
  stage's layers over that microbatch's real samples, times the node's speed
  factor (a straggler, ``slow:NODE@...xF``);
- a stage-to-stage message arrives at send time + alpha + bytes/beta of the real
  activation's bytes (the sender writes that time into the message's header,
  ``runtime/p2p.py``); the receiver waits for it;
- the layer-wise gradient all-reduce and a recovery's state copy take their ring
  and link times of the real model's bytes, after the real (tiny) ones.

What stays real time: every control-plane step (heartbeats, detection, planning,
rendezvous, checkpoint writes) and the host work between ops.

The speed factor of a slowed node: ``emulation.speed``, read before each step.
"""

from __future__ import annotations

from collections.abc import Sequence

from oobleck_mm.data.loader import TrainingData
from oobleck_mm.emulation.clock import DeadlineClock, Lateness
from oobleck_mm.emulation.speed import SpeedFile
from oobleck_mm.emulation.truth import Truth

class Emulation:
    """One worker's emulated accelerator, shared by its engines across generations."""

    def __init__(self, job, node: str, speed: SpeedFile | None = None) -> None:
        self.job = job
        """The real job: what is planned, balanced and timed."""
        self.truth = Truth(job)
        self.data = TrainingData(job)
        """The real data: only its sample metadata is read."""
        self.clock = DeadlineClock()
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

    def begin_step(self) -> None:
        self.factor = self.speed.read()

    def take(self) -> Lateness:
        return self.clock.take()

    def stage(self, layers: Sequence[int], seam: int | None, pipelines: int) -> StageTimer:
        return StageTimer(self, layers, seam, pipelines)


class StageTimer:
    """One stage's ops on the emulated device: forward, backward, sends, receives, the all-reduce."""

    def __init__(self, emulation: Emulation, layers: Sequence[int], seam: int | None, pipelines: int) -> None:
        self.emulation, self.truth, self.clock = emulation, emulation.truth, emulation.clock
        self.layers = list(layers)
        self.encoder = self.truth.groups([i for i in layers if seam is not None and i < seam])
        self.llm = self.truth.groups([i for i in layers if seam is None or i >= seam])
        self.everything = self.truth.groups(self.layers)
        self.pipelines = pipelines
        self.seam = seam

    def forward(self, start: float, encoder_ids: Sequence[int], llm_ids: Sequence[int]) -> None:
        """A microbatch's forward began at ``start``: its encoder layers ran ``encoder_ids``, its LLM layers
        ``llm_ids`` (the same samples unless Entrain's deferral decoupled them)."""
        metas = self.emulation.metas
        seconds = self.truth.stage_seconds(self.encoder, metas(encoder_ids))[0] + \
            self.truth.stage_seconds(self.llm, metas(llm_ids))[0]  # fmt: skip
        self.clock.finish(start, seconds * self.emulation.factor, "forward")

    def backward(self, start: float, ids: Sequence[int]) -> None:
        """A microbatch's backward over ``ids`` (its LLM samples: with deferral, the encoder groups it reaches
        are exactly those) began at ``start``."""
        seconds = self.truth.stage_seconds(self.everything, self.emulation.metas(ids))[1]
        self.clock.finish(start, seconds * self.emulation.factor, "backward")

    def arrival(self, last_layer: int, ids: Sequence[int], now: float) -> float:
        """When a message sent at ``now`` with layer ``last_layer``'s output (or its gradient) over ``ids``
        arrives on the emulated network."""
        num_bytes = self.truth.output_bytes(last_layer, self.emulation.metas(ids))
        return now + self.truth.transfer_s(num_bytes)

    def received(self, arrival: float, now: float) -> None:
        """A message whose emulated arrival is ``arrival`` was received at ``now``: waits for it."""
        if arrival > 0:
            self.clock.until(max(arrival, now), max(0.0, arrival - now), "transfer")

    def allreduce(self, start: float) -> None:
        """The stage's layer-wise gradient all-reduce across the pipelines, after the real one ended."""
        self.clock.finish(start, self.truth.allreduce_s(self.layers, self.pipelines), "all-reduce")


def copy_wait(emulation: Emulation | None, layers: Sequence[int], start: float) -> None:
    """A recovery's copy of ``layers``' states into this rank, on its one link, after the real copy."""
    if emulation is not None and layers:
        emulation.clock.finish(start, emulation.truth.copy_s(layers), "state copy")
