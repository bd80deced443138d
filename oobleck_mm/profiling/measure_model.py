"""Measured profile of a job's own model: its runtime layers timed on one representative microbatch.

Bridges the runtime model (layers called as ``layer(acts, batch)``) and the
generic profiler (a chain of modules called with the previous outputs): each
layer is bound to the microbatch it runs on. The microbatch is the first
``microbatch_size`` samples of global step 0, i.e. the data the job trains on.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, replace

from torch import nn

from oobleck_mm.planning.costs import ModelProfile, recompute_policy


class _BoundLayer(nn.Module):
    def __init__(self, layer: nn.Module, batch, first: bool):
        super().__init__()
        self.layer, self.batch, self.first = layer, batch, first

    def forward(self, *acts):
        # The first layer reads its input from the batch; the profiler still needs a tensor to feed it.
        return self.layer(() if self.first else tuple(acts), self.batch)


def measure_job_profile(job, progress: Callable[[str], None] | None = None) -> ModelProfile:
    from oobleck_mm.data.loader import TrainingData
    from oobleck_mm.model.layers import build_layer, frozen_layers, model_layer_specs
    from oobleck_mm.profiling.profiler import profile_layers

    specs = model_layer_specs(job)
    data = TrainingData(job)
    batch = data.microbatch(data.global_batch(0)[: job.training.microbatch_size])
    layers = [(s.name, s.modality, _BoundLayer(build_layer(job, i, specs), batch, i == 0)) for i, s in enumerate(specs)]
    profile = profile_layers(
        layers,
        (batch.tokens.to(data.dtype),),  # ignored by the first layer
        microbatch_size=job.training.microbatch_size,
        model_name=job.model.name,
        device="cpu" if job.cluster.device == "cpu" else "cuda",
        cache_dir=job.planning.profile_cache_dir,
        config_key={"data": _plain(job.data), "training": _plain(job.training), "sample_ids": list(batch.sample_ids)},
        progress=progress,
    )
    # Exact layer names (the profiler's frozen entries are prefixes: "llm.block1" would catch "llm.block10").
    frozen = frozen_layers(job, specs)
    # The keys and values a text block's attention makes over this microbatch's sequence (what context
    # parallelism gathers): the profiler times modules, it does not see inside their attention.
    width = batch.tokens.new_empty(0, dtype=data.dtype).element_size()
    kv = {
        s.name: 2 * batch.tokens.numel() * s.kv_hidden * width
        for s in specs
        if s.modality == "text" and s.attention_len
    }
    return replace(
        profile,
        layers=tuple(
            replace(c, trainable=c.trainable and c.name not in frozen, kv_bytes=kv.get(c.name, 0))
            for c in profile.layers
        ),
        recompute=recompute_policy(job.training.activation_checkpointing),
    )


def _plain(section) -> dict:
    return {k: str(v) for k, v in asdict(section).items()}
