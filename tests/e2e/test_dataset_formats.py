"""A ``datasets`` folder and WebDataset shards on the local cluster: a node killed, another joining, the
result equal to the reference.

Every rank, the joiner's included, builds the same records from the data (positions in the folder's row
order, or the shards' index in the pattern's order), so the balancer's split and the sampler's order are
the reference's whatever the membership: float64 parameters within 1e-9 after a kill and a join. (A resume
from a checkpoint: ``tests/integration/test_dataset_formats_training.py``.)"""

from __future__ import annotations

import pytest
from harness import Launch, assert_matches_reference, write_config

pytest.importorskip("braceexpand")
pytest.importorskip("datasets")
pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.mark.parametrize("kind", ["webdataset", "hf_datasets"])
def test_the_data_formats_train_through_a_kill_and_a_join_equal_to_the_reference(launches, tmp_path, kind):
    from tests.unit.test_hf_datasets import hf_dataset, records
    from tests.unit.test_webdataset import one_image_records, write_shards

    if kind == "webdataset":
        path = write_shards(tmp_path / "shards", one_image_records(48, seed=10), per_shard=16)
    else:
        path = str(tmp_path / "folder")
        hf_dataset(records(48, seed=10)).save_to_disk(path)
    steps = 10
    data = {"kind": kind, "path": path, "image_size": 32, "max_seq_len": 256, "cache_dir": None}
    config = write_config(tmp_path, nodes=3, steps=steps, data=data)
    final = tmp_path / "final"
    run = Launch(tmp_path, config, "--save-final", str(final), "--inject", "kill:node1@step3,join@step6")
    launches.append(run)
    assert run.wait(timeout=180) == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert [e["node"] for e in run.events("lost")] == ["node1"]
    assert any(p["joined"] and p["cause"] == "joined" for p in run.events("plan_decided")), "the join was planned"
    assert sorted({e["step"] for e in run.events("step")}) == list(range(steps))
    assert_matches_reference(config, steps, final)
