"""Deterministic global-batch sampler: (seed, epoch, step) -> the sample ids of one global batch.

The batch of a global step is a pure function of (num_samples, global_batch,
seed, step): epoch ``e`` is a permutation of all sample ids drawn from a
generator seeded by (seed, e), cut into ``steps_per_epoch`` consecutive slices.
Nothing depends on how many pipelines or ranks consume the batch, or on which
steps were run before, so any rank of any generation can resume at any step
and sees the same batches an uninterrupted run would (the original Oobleck
sampler restarted from iteration 0 after a reconfiguration).

Within an epoch no sample repeats; the ``num_samples % global_batch`` ids left
at the end of an epoch's permutation are skipped in that epoch (different ones
each epoch), because a global batch never changes size.
"""

from __future__ import annotations

import numpy as np

from oobleck_mm.errors import UserError

# Separates the sampler's random stream from the datasets' (seed, index) streams,
# so a data seed equal to the training seed does not correlate the two.
_STREAM_TAG = 0x5A3D1E


class GlobalBatchSampler:
    """Global batches of a fixed size over ``num_samples`` ids, reshuffled every epoch."""

    __slots__ = ("num_samples", "global_batch", "seed", "_cached_epoch", "_cached_perm")

    def __init__(self, num_samples: int, global_batch: int, seed: int) -> None:
        for name, value in (("num_samples", num_samples), ("global_batch", global_batch)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be an integer >= 0, got {seed!r}")
        if num_samples < global_batch:
            raise UserError(
                f"global_batch ({global_batch}) exceeds num_samples ({num_samples}): an epoch would hold no "
                f"step; use at least {global_batch} samples or a global batch of at most {num_samples}"
            )
        self.num_samples = num_samples
        self.global_batch = global_batch
        self.seed = seed
        self._cached_epoch = -1
        self._cached_perm = np.empty(0, dtype=np.int64)

    @property
    def steps_per_epoch(self) -> int:
        return self.num_samples // self.global_batch

    def position(self, step: int) -> tuple[int, int]:
        """(epoch, step within the epoch) of 0-based global step ``step``."""
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
            raise ValueError(f"step must be an integer >= 0, got {step!r}")
        return divmod(int(step), self.steps_per_epoch)

    def epoch_of(self, step: int) -> int:
        return self.position(step)[0]

    def permutation(self, epoch: int) -> np.ndarray:
        """All sample ids in the order epoch ``epoch`` visits them (read-only)."""
        if epoch != self._cached_epoch:
            perm = np.random.default_rng([self.seed, epoch, _STREAM_TAG]).permutation(self.num_samples)
            perm.flags.writeable = False
            self._cached_epoch, self._cached_perm = epoch, perm
        return self._cached_perm

    def batch(self, step: int) -> tuple[int, ...]:
        """Sample ids of the global batch of step ``step``, in a fixed order."""
        epoch, k = self.position(step)
        start = k * self.global_batch
        return tuple(self.permutation(epoch)[start : start + self.global_batch].tolist())
