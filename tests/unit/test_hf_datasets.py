"""``data.kind: hf_datasets``: a ``datasets`` folder or Parquet files read as the LLaVA JSON it holds.

The property: the same records written as a LLaVA JSON file with image files, as a ``save_to_disk``
folder with the images' bytes inside, and as Parquet, give equal samples (metadata, tokens, loss targets,
pixels) at every index. Bad input is refused naming the column, the sample and the file.
"""

from __future__ import annotations

import io
import json
import os
import random

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

datasets = pytest.importorskip("datasets")

from oobleck_mm.config import config_from_dict  # noqa: E402
from oobleck_mm.data.check import check_samples  # noqa: E402
from oobleck_mm.data.hf_datasets import DatasetsLlavaDataset, _turns  # noqa: E402
from oobleck_mm.data.loader import build_dataset  # noqa: E402
from oobleck_mm.errors import UserError  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORDS = ("cat", "dog", "red", "square", "what", "is", "this", "a", "picture", "of", "two")


def png(rng: random.Random) -> bytes:
    height, width = rng.randint(12, 40), rng.randint(12, 40)
    pixels = np.random.default_rng(rng.randint(0, 2**31)).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return out.getvalue()


def records(count: int = 24, seed: int = 0) -> list[dict]:
    """LLaVA entries with their images' bytes: 0..2 images, a question and an answer of random words."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        images = [png(rng) for _ in range(rng.choice((0, 1, 1, 2)))]
        question = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 12)))
        answer = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 20)))
        turns = [
            {"from": "human", "value": "<image>\n" * len(images) + question},
            {"from": "gpt", "value": answer},
        ]
        out.append({"id": f"s{i}", "conversations": turns, "images": images})
    return out


def write_json(folder, entries) -> str:
    os.makedirs(os.path.join(folder, "images"), exist_ok=True)
    rows = []
    for e in entries:
        names = []
        for k, data in enumerate(e["images"]):
            names.append(f"images/{e['id']}_{k}.png")
            with open(os.path.join(folder, names[-1]), "wb") as fh:
                fh.write(data)
        rows.append({"id": e["id"], "conversations": e["conversations"], "image": names})
    path = os.path.join(folder, "data.json")
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(rows, fh)
    return path


def hf_dataset(entries, **columns):
    features = datasets.Features(
        {
            "id": datasets.Value("string"),
            "conversations": datasets.List({"from": datasets.Value("string"), "value": datasets.Value("string")}),
            "image": datasets.List(datasets.Image()),
        }
    )
    table = {
        "id": [e["id"] for e in entries],
        "conversations": [e["conversations"] for e in entries],
        "image": [[{"bytes": b, "path": None} for b in e["images"]] for e in entries],
    }
    return datasets.Dataset.from_dict(table, features=features)


def job(**data):
    with open(os.path.join(ROOT, "configs", "tiny_mm.yaml"), encoding="utf-8") as fh:
        raw = yaml.safe_load(fh)
    raw["data"].update({"image_size": 32, "max_seq_len": 256, **data})
    return config_from_dict(raw)


def assert_same_samples(a, b) -> None:
    assert len(a) == len(b)
    for i in range(len(a)):
        x, y = a[i], b[i]
        assert a.sample_id(i) == b.sample_id(i) and x.meta == y.meta, i
        assert torch.equal(x.tokens, y.tokens) and len(x.images) == len(y.images), i
        assert all(torch.equal(p, q) for p, q in zip(x.images, y.images)), i
        assert (x.targets is None) == (y.targets is None) and (x.targets is None or torch.equal(x.targets, y.targets))


def test_a_datasets_folder_and_parquet_read_as_the_json_they_hold(tmp_path):
    entries = records()
    reference = build_dataset(job(kind="llava_json", path=write_json(tmp_path / "json", entries)))
    hf_dataset(entries).save_to_disk(str(tmp_path / "folder"))
    folder = build_dataset(job(kind="hf_datasets", path=str(tmp_path / "folder")))
    assert isinstance(folder, DatasetsLlavaDataset)
    assert_same_samples(reference, folder)
    assert sum(folder.meta(i).num_images for i in range(len(folder))) > len(folder) // 2, "images were read"
    hf_dataset(entries).to_parquet(str(tmp_path / "data.parquet"))
    parquet = build_dataset(job(kind="hf_datasets", path=str(tmp_path / "data.parquet"), loss_on="all"))
    reference_all = build_dataset(job(kind="llava_json", path=write_json(tmp_path / "json", entries), loss_on="all"))
    assert_same_samples(reference_all, parquet)


def test_a_split_captions_and_paths_are_read_through_the_column_mapping(tmp_path):
    """A ``DatasetDict`` folder, captions in a ``text`` column, image paths relative to the folder."""
    entries = records(6, seed=1)
    write_json(tmp_path / "folder", entries)  # the image files, beside the dataset
    table = {
        "name": [e["id"] for e in entries],
        "caption": [e["conversations"][1]["value"] for e in entries],
        "files": [[f"images/{e['id']}_{k}.png" for k in range(len(e["images"]))] for e in entries],
    }
    datasets.DatasetDict({"validation": datasets.Dataset.from_dict(table)}).save_to_disk(str(tmp_path / "folder"))
    columns = {"id": "name", "text": "caption", "image": "files"}
    ds = build_dataset(job(kind="hf_datasets", path=str(tmp_path / "folder"), split="validation", columns=columns))
    assert [ds.sample_id(i) for i in range(len(ds))] == [e["id"] for e in entries]
    for i, e in enumerate(entries):
        assert ds.meta(i).num_images == len(e["images"]) and len(ds[i].images) == len(e["images"])
    with pytest.raises(UserError, match=r"data.split: .* has splits \['validation'\], not 'train'"):
        build_dataset(job(kind="hf_datasets", path=str(tmp_path / "folder"), columns=columns))


def test_chat_messages_and_their_image_parts_become_llava_turns():
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]},
        {"role": "assistant", "content": "A cat."},
    ]
    assert _turns(messages) == [
        {"from": "user", "value": "<image>What is it?"},
        {"from": "assistant", "value": "A cat."},
    ]


def test_bad_columns_rows_and_images_are_named(tmp_path):
    entries = records(4, seed=2)
    hf_dataset(entries).save_to_disk(str(tmp_path / "ok"))
    with pytest.raises(UserError, match=r"data.columns.image: .* has no column 'pictures'; its columns: .*image"):
        build_dataset(job(kind="hf_datasets", path=str(tmp_path / "ok"), columns={"image": "pictures"}))
    datasets.Dataset.from_dict({"id": ["a"], "words": ["x"]}).save_to_disk(str(tmp_path / "no_text"))
    with pytest.raises(UserError, match=r"no column 'conversations' or 'text' \(its columns: id, words\)"):
        build_dataset(job(kind="hf_datasets", path=str(tmp_path / "no_text")))
    (tmp_path / "not_data").mkdir()
    (tmp_path / "not_data" / "notes.txt").write_text("hello")
    with pytest.raises(UserError, match=r"data.path: cannot read .*not_data as a datasets folder or Parquet"):
        build_dataset(job(kind="hf_datasets", path=str(tmp_path / "not_data")))
    # An image whose bytes do not decode: the master's check names the sample; each row is read once.
    broken = [dict(e) for e in records(40, seed=3) if e["images"]]  # more than one global batch (16)
    broken[0]["images"] = [b"\x89PNG\r\n\x1a\n" + b"\0" * 40] + broken[0]["images"][1:]
    hf_dataset(broken).save_to_disk(str(tmp_path / "broken"))
    bad_job = job(kind="hf_datasets", path=str(tmp_path / "broken"), skip_bad_samples=True)
    bad = check_samples(bad_job, progress=lambda _: None)
    assert [b.position for b in bad] == [0] and broken[0]["id"] in bad[0].reason, bad
    with pytest.raises(UserError, match=rf"sample '{broken[0]['id']}'"):
        check_samples(job(kind="hf_datasets", path=str(tmp_path / "broken")), progress=lambda _: None)


def test_columns_that_are_not_roles_are_refused():
    with pytest.raises(Exception, match=r"data.columns: unknown role 'caption'; valid: id, conversations, text"):
        job(kind="synthetic", columns={"caption": "x"})
    with pytest.raises(Exception, match=r"data.columns: name either 'conversations' or 'text'"):
        job(kind="synthetic", columns={"conversations": "a", "text": "b"})


def test_an_hf_model_reads_chat_messages_with_its_own_tokenizer_and_the_nodes_record_cache(tmp_path):
    """With ``model.huggingface`` the records go through the model's tokenizer, chat template and image
    processor: chat messages (``user`` / ``assistant``) give the samples LLaVA turns (``human`` / ``gpt``)
    give, and the second reader of a node maps the cache the first wrote (both equal)."""
    from oobleck_mm.data.hf_datasets import DatasetsHFLlavaDataset
    from oobleck_mm.model.tiny_hf import make_tiny_model

    directory = make_tiny_model(tmp_path / "llava", "llama", "clip")
    entries = records(10, seed=4)

    def hf_job(**data):
        raw = {
            "model": {"huggingface": str(directory)},
            "data": {"max_seq_len": 128, "mean_text_tokens": 16, "mean_images_per_sample": 1, **data},
            "training": {"global_batch": 2, "microbatch_size": 2, "dtype": "float64"},
        }
        return config_from_dict(raw)

    reference = build_dataset(hf_job(kind="llava_json", path=write_json(tmp_path / "json", entries), cache_dir=None))
    roles = {"human": "user", "gpt": "assistant"}
    table = {
        "messages": [[{"role": roles[t["from"]], "content": t["value"]} for t in e["conversations"]] for e in entries],
        "image": [[{"bytes": b, "path": None} for b in e["images"]] for e in entries],
        "id": [e["id"] for e in entries],
    }
    features = datasets.Features(
        {
            "messages": datasets.List({"role": datasets.Value("string"), "content": datasets.Value("string")}),
            "image": datasets.List(datasets.Image()),
            "id": datasets.Value("string"),
        }
    )
    datasets.Dataset.from_dict(table, features=features).save_to_disk(str(tmp_path / "chat"))
    data = {"kind": "hf_datasets", "path": str(tmp_path / "chat"), "columns": {"conversations": "messages"}}
    first = build_dataset(hf_job(**data, cache_dir=str(tmp_path / "cache")))
    second = build_dataset(hf_job(**data, cache_dir=str(tmp_path / "cache")))
    assert isinstance(first, DatasetsHFLlavaDataset) and first.built and not second.built
    assert_same_samples(reference, first)
    assert_same_samples(reference, second)
