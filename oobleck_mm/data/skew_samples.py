"""Sampled global batches of the job's data, for the simulator's data-skew pricing (``simulator/skew.py``).

Here and not in the simulator: the synthetic generator lives with the data pipeline, which imports torch;
the simulator stays pure and receives the samples' metadata.
"""

from __future__ import annotations

import numpy as np

from oobleck_mm.errors import UserError


def sampled_batches(job, batches: int, seed: int = 0):
    """``batches`` global batches of the job's synthetic data (metadata only: nothing is rendered), as
    ``(batches of SampleMeta, the model's ModelInputs)``: what ``balance.work.sample_features`` reads."""
    from oobleck_mm.data.dataset import ModelInputs
    from oobleck_mm.data.synthetic import SyntheticDataset

    if job.data.kind != "synthetic":
        raise UserError(
            f"pricing data skew (skew_batches) needs data.kind: synthetic, whose generator gives sample "
            f"shapes without files; got {job.data.kind!r}"
        )
    inputs = ModelInputs.from_model(job.model)
    dataset = SyntheticDataset(job.data, inputs)
    rng = np.random.default_rng(seed)
    size = job.training.global_batch
    out = []
    for _ in range(batches):
        ids = rng.choice(len(dataset), size=size, replace=size > len(dataset))
        out.append([dataset.meta(int(i)) for i in ids])
    return out, inputs
