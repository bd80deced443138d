"""``data.kind: webdataset``: tar shards read through their index as the LLaVA records they hold.

The property: the same records as WebDataset shards (a ``.json`` of turns and a ``.png`` per sample, split
over three shards named by a brace pattern) and as a LLaVA JSON file with image files give equal samples
at every position, in the pattern's order. A truncated shard, a pattern matching nothing and a sample
without its text are refused by name; the index is kept in the cache for the next reader.
"""

from __future__ import annotations

import io
import json
import os
import tarfile

import pytest
import torch

pytest.importorskip("braceexpand")

from tests.unit.test_hf_datasets import assert_same_samples, job, records, write_json  # noqa: E402

from oobleck_mm.data.check import check_samples  # noqa: E402
from oobleck_mm.data.loader import build_dataset  # noqa: E402
from oobleck_mm.data.webdataset import ShardsLlavaDataset, index_shard  # noqa: E402
from oobleck_mm.errors import UserError  # noqa: E402


def one_image_records(count: int, seed: int) -> list[dict]:
    return [e for e in records(count * 2, seed=seed) if len(e["images"]) <= 1][:count]


def add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def write_shards(folder, entries, per_shard: int, caption: bool = False) -> str:
    os.makedirs(folder, exist_ok=True)
    shards = [entries[i : i + per_shard] for i in range(0, len(entries), per_shard)]
    for k, shard in enumerate(shards):
        with tarfile.open(os.path.join(folder, f"part-{k:03d}.tar"), "w") as tar:
            for e in shard:
                if caption:
                    add(tar, f"{e['id']}.txt", e["conversations"][1]["value"].encode())
                else:
                    add(tar, f"{e['id']}.json", json.dumps({"conversations": e["conversations"]}).encode())
                for data in e["images"]:
                    add(tar, f"{e['id']}.png", data)
    return os.path.join(folder, "part-{000..%03d}.tar" % (len(shards) - 1))


def test_shards_read_in_the_patterns_order_as_the_json_they_hold(tmp_path):
    entries = one_image_records(30, seed=6)
    reference = build_dataset(job(kind="llava_json", path=write_json(tmp_path / "json", entries)))
    pattern = write_shards(tmp_path / "shards", entries, per_shard=11)
    shards = build_dataset(job(kind="webdataset", path=pattern, cache_dir=str(tmp_path / "cache")))
    assert isinstance(shards, ShardsLlavaDataset) and len(shards) == 30
    for i in range(len(shards)):  # (ids name the shard: the rest is the JSON's sample)
        assert shards.sample_id(i) == f"part-{i // 11:03d}.tar:{entries[i]['id']}"
        x, y = reference[i], shards[i]
        assert x.meta == y.meta and torch.equal(x.tokens, y.tokens) and torch.equal(x.targets, y.targets), i
        assert all(torch.equal(p, q) for p, q in zip(x.images, y.images, strict=True)), i
    assert sum(shards.meta(i).num_images for i in range(30)) > 15
    assert len(list((tmp_path / "cache" / "webdataset-index").glob("*.json"))) == 3, "one index per shard, kept"
    again = build_dataset(job(kind="webdataset", path=pattern, cache_dir=str(tmp_path / "cache")))
    assert_same_samples(shards, again)


def test_captions_in_txt_members_and_a_folder_of_shards(tmp_path):
    entries = one_image_records(8, seed=7)
    write_shards(tmp_path / "caps", entries, per_shard=8, caption=True)
    ds = build_dataset(job(kind="webdataset", path=str(tmp_path / "caps"), cache_dir=None))
    assert len(ds) == 8
    for i, e in enumerate(entries):
        assert ds.meta(i).num_images == len(e["images"])


def test_a_truncated_shard_a_pattern_of_nothing_and_a_sample_without_text_are_named(tmp_path):
    entries = one_image_records(20, seed=8)
    pattern = write_shards(tmp_path / "ok", entries, per_shard=10)
    with pytest.raises(UserError, match=r"data.path: '.*nothing-\{0..3\}.tar' matches no shard|does not exist"):
        build_dataset(job(kind="webdataset", path=str(tmp_path / "nothing-{0..3}.tar")))
    whole = (tmp_path / "ok" / "part-001.tar").read_bytes()
    (tmp_path / "ok" / "part-001.tar").write_bytes(whole[: len(whole) // 2])
    with pytest.raises(UserError, match=r"shard .*part-001.tar cannot be read.*truncated, or not a tar"):
        build_dataset(job(kind="webdataset", path=pattern, cache_dir=None))
    with pytest.raises(UserError, match=r"truncated, or not a tar"):
        index_shard(str(tmp_path / "ok" / "part-001.tar"))
    # A sample with an image and no text: the check names it (shard and key) and, asked to, leaves it out.
    rows = one_image_records(20, seed=9)
    gap = next(e["id"] for e in rows if e["images"])
    with tarfile.open(tmp_path / "gap.tar", "w") as tar:
        for e in rows:
            if e["id"] != gap:
                add(tar, f"{e['id']}.json", json.dumps(e["conversations"]).encode())
            for data in e["images"]:
                add(tar, f"{e['id']}.png", data)
    quiet = job(kind="webdataset", path=str(tmp_path / "gap.tar"), skip_bad_samples=True, cache_dir=None)
    bad = check_samples(quiet, progress=lambda _: None)
    assert [b.reason for b in bad] == [
        f"{tmp_path / 'gap.tar'}: sample 'gap.tar:{gap}' has no '.json' member (data.columns.conversations)"
    ], bad
    with pytest.raises(UserError, match=rf"sample 'gap.tar:{gap}' has no '.json' member"):
        check_samples(job(kind="webdataset", path=str(tmp_path / "gap.tar"), cache_dir=None), progress=lambda _: None)
