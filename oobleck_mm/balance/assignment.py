"""Where each sample of a global batch runs: pipeline -> microbatches -> sample ids.

The deterministic sampler gives every rank the same global batch; an
``Assignment`` says which pipeline and which of its microbatches processes each
sample. Every rank computes the same assignment from metadata alone, so no data
moves between ranks. The update does not depend on it: losses are normalised by
the global number of loss tokens, wherever a sample runs.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class Assignment:
    pipelines: tuple[tuple[tuple[int, ...], ...], ...]
    """``pipelines[p][m]``: sample ids of microbatch ``m`` of pipeline ``p``, in packing order."""
    reason: str = ""
    deferred: tuple[tuple[tuple[int, ...], ...], ...] = ()
    """``deferred[p][m]``: ids of microbatch ``m`` of pipeline ``p`` whose LLM work runs in microbatch
    ``m + 1`` (Entrain's deferral, ``balance/deferral.py``); empty: none anywhere."""

    def llm_microbatches(self, pipeline: int) -> tuple[tuple[int, ...], ...]:
        """The samples each microbatch of ``pipeline`` runs through the LLM's layers, in packing order."""
        from oobleck_mm.balance.deferral import llm_microbatches

        encoder = self.pipelines[pipeline]
        if not self.deferred or not any(self.deferred[pipeline]):
            return encoder
        return tuple(llm_microbatches(list(encoder), list(self.deferred[pipeline])))

    def digest(self) -> int:
        """A 31-bit CRC of every microbatch and deferred set, in order: ranks compare it in the step's last
        collective (``StageEngine``), since every rank derives the assignment apart and one that differs would
        run other samples than its peers expect (a crash at best, a wrong update at worst)."""
        parts: list[int] = []
        for p, microbatches in enumerate(self.pipelines):
            for mb in microbatches:
                parts += [*mb, -1]
            for gone in self.deferred[p] if self.deferred else ():
                parts += [*gone, -3]
            parts.append(-2)
        return zlib.crc32(np.asarray(parts, dtype=np.int64).tobytes()) & 0x7FFFFFFF

    def sample_ids(self) -> list[int]:
        return [i for p in self.pipelines for mb in p for i in mb]

    def check_covers(self, global_batch: Sequence[int], microbatches_per_pipeline: Sequence[int]) -> None:
        """Raise unless every sample of the batch appears exactly once, with the plan's microbatch counts."""
        counts = [len(p) for p in self.pipelines]
        if counts != list(microbatches_per_pipeline):
            raise ValueError(
                f"assignment has {counts} microbatches per pipeline, the plan {list(microbatches_per_pipeline)}"
            )
        if sorted(self.sample_ids()) != sorted(global_batch):
            raise ValueError("assignment does not hold every sample of the global batch exactly once")


def contiguous_assignment(
    global_batch: Sequence[int], microbatches_per_pipeline: Sequence[int], microbatch_size: int
) -> Assignment:
    """The unbalanced default: fixed-size microbatches taken in sampler order, pipeline by pipeline."""
    need = sum(microbatches_per_pipeline) * microbatch_size
    if need != len(global_batch):
        raise ValueError(
            f"global batch of {len(global_batch)} samples does not fill {sum(microbatches_per_pipeline)} "
            f"microbatches of {microbatch_size}"
        )
    pipelines, pos = [], 0
    for count in microbatches_per_pipeline:
        mbs = []
        for _ in range(count):
            mbs.append(tuple(global_batch[pos : pos + microbatch_size]))
            pos += microbatch_size
        pipelines.append(tuple(mbs))
    return Assignment(tuple(pipelines), reason="contiguous (balancer off)")
