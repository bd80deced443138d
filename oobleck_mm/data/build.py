"""The dataset a job's ``data.kind`` names (``build_dataset``), importable without torch.

The master checks the data (``data/check.py``) before it listens; for generated
samples that check needs only the config, and importing torch for it (~1 s, more
on a busy host) delayed every job's start. The JSON datasets, which need torch to
read images, are imported only when one is built.
"""

from __future__ import annotations

from oobleck_mm.data.dataset import Dataset, ModelInputs
from oobleck_mm.data.synthetic import SyntheticDataset
from oobleck_mm.errors import UserError


def build_dataset(job) -> Dataset:
    """The dataset ``job.data.kind`` names, shaped for ``job.model``."""
    inputs = ModelInputs.from_model(job.model)
    if job.data.kind == "synthetic":
        return SyntheticDataset(job.data, inputs)
    if job.data.kind == "hf_datasets":  # the same records, from a datasets folder or Parquet files
        from oobleck_mm.data.hf_datasets import DatasetsHFLlavaDataset, DatasetsLlavaDataset

        cls = DatasetsHFLlavaDataset if job.model.huggingface is not None else DatasetsLlavaDataset
        return cls(job.data, inputs)
    if job.data.kind == "webdataset":  # the same records, from tar shards through their index
        from oobleck_mm.data.webdataset import ShardsHFLlavaDataset, ShardsLlavaDataset

        cls = ShardsHFLlavaDataset if job.model.huggingface is not None else ShardsLlavaDataset
        return cls(job.data, inputs)
    if job.data.kind == "llava_json":
        if job.model.huggingface is not None:  # the model's own tokenizer and image processor
            from oobleck_mm.data.hf_llava import HFLlavaJsonDataset

            return HFLlavaJsonDataset(job.data, inputs)
        from oobleck_mm.data.llava import LlavaJsonDataset

        return LlavaJsonDataset(job.data, inputs)
    raise UserError(f"data.kind: must be one of synthetic, llava_json, hf_datasets, webdataset; got {job.data.kind!r}")
