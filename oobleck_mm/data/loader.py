"""The training data of a job as the engine and the reference trainer see it.

``build_dataset`` (``data/build.py``) makes the dataset ``data.kind`` names. ``TrainingData`` joins
the dataset, the deterministic global-batch sampler and packing: step -> global
batch ids -> (metadata, loss-token count) -> packed microbatches. Every rank of
every pipeline builds the same one from the config.
"""

from __future__ import annotations

from collections.abc import Sequence

from oobleck_mm.config.shape import layer_specs
from oobleck_mm.data.build import build_dataset
from oobleck_mm.data.dataset import ModelInputs
from oobleck_mm.data.packing import PackedBatch, PackingSpec, pack
from oobleck_mm.data.sample import SampleMeta
from oobleck_mm.data.sampler import GlobalBatchSampler
from oobleck_mm.precision import compute_dtype


class TrainingData:
    def __init__(self, job, dataset=None):
        self.dataset = dataset if dataset is not None else build_dataset(job)
        self.sampler = GlobalBatchSampler(len(self.dataset), job.training.global_batch, job.training.seed)
        self.microbatch_size = job.training.microbatch_size
        self.spec = PackingSpec.from_model(job.model)
        self.inputs = ModelInputs.from_model(job.model)
        self.dtype = compute_dtype(job.training)
        widths = {s.name: s.in_features for s in layer_specs(job.model, job.data)}
        self.vision_in = widths.get("vision.embed", 0)
        self.audio_in = widths.get("audio.embed", 0)

    def global_batch(self, step: int) -> tuple[int, ...]:
        return self.sampler.batch(step)

    def metas(self, ids: Sequence[int]) -> list[SampleMeta]:
        return [self.dataset.meta(i) for i in ids]

    def loss_tokens(self, ids: Sequence[int]) -> int:
        """Loss tokens of the whole global batch: the normaliser every microbatch's loss shares."""
        total = sum(m.loss_tokens for m in self.metas(ids))
        if total <= 0:
            raise ValueError(f"global batch {list(ids)[:8]}... has no text targets to train on")
        return total

    def llm_tokens(self, ids: Sequence[int]) -> int:
        """Tokens the LLM runs over for these samples (text plus every medium's tokens): tokens/s."""
        return sum(self.inputs.llm_tokens(m) for m in self.metas(ids))

    def microbatch(self, ids: Sequence[int], media: bool = True) -> PackedBatch:
        """The packed microbatch of samples ``ids``. ``media=False``: its layout without the pixels and frames
        (``pack``), read through the dataset's ``layout`` where it has one: what a stage without an encoder
        input layer needs, at a fraction of the cost (rendering or decoding the media is most of it)."""
        if media:
            samples = [self.dataset[i] for i in ids]
        else:
            load = getattr(self.dataset, "layout", self.dataset.__getitem__)
            samples = [load(i) for i in ids]
        return pack(samples, self.spec, self.dtype, self.vision_in, self.audio_in, media=media)
