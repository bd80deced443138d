"""Training on audio records (``llava_json`` with ``<audio>`` markers and 16 kHz WAV clips, images beside them)
equals the single-process reference in float64 on two heterogeneous pipelines (real gloo processes), with
``data.mean_audio_seconds`` measured from the clips' headers as the master measures it."""

from __future__ import annotations

import json
import os
import random

import pytest
import yaml
from PIL import Image

from tests.integration.test_grad_overlap import worst_against_reference
from tests.unit.test_audio_records import write_wav

from oobleck_mm.config import config_from_dict
from oobleck_mm.config.shape import layer_specs
from oobleck_mm.data.check import ensure_shape
from oobleck_mm.planning.layout import ExecutionPlan
from oobleck_mm.runtime.worker import run_local

pytestmark = pytest.mark.integration
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORDS = "a tone rises falls hum beep low high note long short".split()


def audio_records(folder, count: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    entries = []
    for i in range(count):
        clips = [f"c{i}_{k}.wav" for k in range(rng.choice((0, 1, 1, 2)))]
        for k, name in enumerate(clips):
            write_wav(os.path.join(folder, name), rng.uniform(0.1, 0.5), seed=seed * 1000 + i * 10 + k)
        images = [f"i{i}.png"] if rng.random() < 0.5 else []
        for name in images:
            Image.new("RGB", (rng.choice((16, 32)), 32), (rng.randrange(256), 40, 90)).save(os.path.join(folder, name))
        question = " ".join(["<image>"] * len(images) + ["<audio>"] * len(clips) + rng.sample(WORDS, 3))
        answer = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 8)))
        entries.append(
            {
                "id": f"s{i}",
                **({"image": images} if images else {}),
                **({"audio": clips} if clips else {}),
                "conversations": [{"from": "human", "value": question}, {"from": "gpt", "value": answer}],
            }
        )
    path = os.path.join(folder, "data.json")
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(entries, fh)
    return path


def test_audio_records_train_on_two_pipelines_equal_to_the_reference(tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    path = audio_records(str(folder), 32)
    with open(os.path.join(ROOT, "configs", "tiny_mm_audio.yaml"), encoding="utf-8") as fh:
        raw = yaml.safe_load(fh)
    raw["data"] = {"kind": "llava_json", "path": path, "image_size": 32, "max_seq_len": 128}
    raw["training"].update(dtype="float64", steps=3)
    j = config_from_dict(raw)
    assert j.data.mean_audio_seconds is None, "left to be measured over the clips"
    ensure_shape(j, progress=lambda _: None)
    assert 0.1 < j.data.mean_audio_seconds < 0.6
    layers = len(layer_specs(j.model, j.data))
    plan = ExecutionPlan.even(layers, [2, 3], [4, 4], j.training.microbatch_size)
    outs = run_local(j, plan, 3, tmp_path / "run")
    assert worst_against_reference(outs, j, 3) < 1e-10
