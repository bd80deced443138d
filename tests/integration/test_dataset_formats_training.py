"""Training from a ``datasets`` folder (images as bytes inside it) or from WebDataset shards equals the
reference, through a lost node and a resume from a checkpoint (float64, real gloo processes)."""

from __future__ import annotations

import os

import pytest
import torch
import yaml

pytest.importorskip("datasets")
pytest.importorskip("braceexpand")

from tests.integration.test_grad_overlap import worst_against_reference  # noqa: E402

from oobleck_mm.config import config_from_dict  # noqa: E402
from oobleck_mm.data.check import ensure_shape  # noqa: E402
from oobleck_mm.planning.layout import ExecutionPlan, PipelineLayout, StageLayout  # noqa: E402
from oobleck_mm.runtime.worker import Phase, run_local  # noqa: E402

pytestmark = pytest.mark.integration
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def job(folder: str, steps: int, kind: str):
    from tests.unit.test_hf_datasets import hf_dataset, records
    from tests.unit.test_webdataset import one_image_records, write_shards

    path = folder
    if kind == "hf_datasets":
        hf_dataset(records(48, seed=5)).save_to_disk(folder)
    else:
        path = write_shards(folder, one_image_records(48, seed=5), per_shard=20)
    with open(os.path.join(ROOT, "configs", "tiny_mm.yaml"), encoding="utf-8") as fh:
        raw = yaml.safe_load(fh)
    raw["data"] = {"kind": kind, "path": path, "image_size": 32, "max_seq_len": 256}
    raw["training"].update(dtype="float64", steps=steps)
    j = config_from_dict(raw)
    ensure_shape(j, progress=lambda _: None)  # as the master measures the data before it plans
    return j


@pytest.mark.parametrize("kind", ["hf_datasets", "webdataset"])
def test_a_datasets_folder_or_shards_train_through_a_lost_node_and_a_resume_equal_to_the_reference(tmp_path, kind):
    j = job(str(tmp_path / "data"), 6, kind)
    assert j.data.mean_images_per_sample > 0.5, "the rows' images are read"
    before = ExecutionPlan.even(10, [2, 3, 1], [3, 3, 2], j.training.microbatch_size)  # ranks 0-1 | 2-4 | 5
    after = ExecutionPlan(
        (
            PipelineLayout((StageLayout(0, 0, 5), StageLayout(1, 5, 10)), 4),
            PipelineLayout((StageLayout(2, 0, 4), StageLayout(3, 4, 7), StageLayout(4, 7, 10)), 4),
        ),
        10,
        2,
    )
    at4 = str(tmp_path / "at4")
    outs = run_local(j, before, 2, tmp_path / "a", phases=[Phase(after, 2, {r: r for r in range(5)})], save_final=at4)
    assert worst_against_reference(outs, j, 4) < 1e-10
    resumed = run_local(j, after, 2, tmp_path / "b", resume=at4)
    assert worst_against_reference(resumed, j, 6) < 1e-10
    assert all(torch.isfinite(torch.tensor(out["losses"])).all() for out in resumed)
