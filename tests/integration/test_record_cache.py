"""A node's ranks start together: one tokenizes the records, the others wait for it and map its arrays.

Real processes (forked, as a node's workers are separate processes) building the
same HF ``llava_json`` dataset at the same moment on one cache folder. Before the
cache each of them tokenized the whole file itself (8 at once on an 8-GPU node).
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import shutil

import pytest

from oobleck_mm.config import config_from_dict
from oobleck_mm.model.tiny_hf import make_tiny_model

pytestmark = pytest.mark.integration

RANKS = 4
FIXTURE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "llava")


def _rank(raw: dict, start, out) -> None:
    from oobleck_mm.data.loader import build_dataset

    start.wait()
    dataset = build_dataset(config_from_dict(raw))
    digest = hashlib.sha256()
    for i in range(len(dataset)):
        sample = dataset[i]
        digest.update(sample.tokens.numpy().tobytes() + sample.targets.numpy().tobytes())
    out.put((dataset.built, dataset.cache_folder, len(dataset), digest.hexdigest()))


def test_ranks_starting_together_tokenize_once_and_read_the_same_records(tmp_path):
    directory = make_tiny_model(tmp_path / "model", text="llama", vision="clip")
    entries = json.loads(open(os.path.join(FIXTURE, "llava.json")).read())
    (tmp_path / "data.json").write_text(json.dumps([dict(e, id=f"{e['id']}-{k}") for k in range(200) for e in entries]))
    shutil.copytree(os.path.join(FIXTURE, "images"), tmp_path / "images")
    raw = {
        "model": {"huggingface": str(directory)},
        "data": {
            "kind": "llava_json",
            "path": str(tmp_path / "data.json"),
            "max_seq_len": 128,
            "mean_text_tokens": 20,
            "mean_images_per_sample": 1,
            "cache_dir": str(tmp_path / "cache"),
        },
        "training": {"global_batch": 4, "microbatch_size": 2},
    }
    ctx = mp.get_context("fork")
    start, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(raw, start, out)) for _ in range(RANKS)]
    try:
        for p in procs:
            p.start()
        start.set()
        results = [out.get(timeout=120) for _ in procs]
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    assert sorted(built for built, *_ in results) == [False] * (RANKS - 1) + [True], results
    assert len({(folder, n, digest) for _, folder, n, digest in results}) == 1, results
    assert results[0][2] == 600
    assert all(p.exitcode == 0 for p in procs)
