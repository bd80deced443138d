"""Fuzzed user input: every config field and every LLaVA record either works or is refused naming the culprit.

What a user can get wrong is the config (any field, any type) and the data (any
record shape). The launcher's contract: exit 0, or exit 2 with one line that
names the field or the file; never a traceback (exit 1 means a bug) and never a
hang. ``oobleck-launch plan`` runs in-process here (the same ``cli.main`` the
console script runs: config, DeepSpeed mapping, profile, planner, the checks
``local`` and ``master`` make before starting anything); the records go through
the master's data check and then every kept sample is loaded and packed, as a
worker would.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil

import pytest
import yaml
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from oobleck_mm.cli import main
from oobleck_mm.config import config_from_dict
from oobleck_mm.errors import UserError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = yaml.safe_load(open(os.path.join(ROOT, "configs", "tiny_mm.yaml")))
FIXTURE = os.path.join(ROOT, "tests", "fixtures", "llava")
SECTIONS = ("model", "data", "training", "fault_tolerance", "cluster", "planning")
NAMES_A_FIELD = re.compile(r"\b(" + "|".join(SECTIONS) + r")(\.\w+)+|--[a-z-]+|\.(json|yaml|png)\b")


def _leaves(tree, prefix=()):
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _leaves(value, prefix + (key,))
        else:
            yield prefix + (key,)


FIELDS = sorted(_leaves(TINY)) + [
    ("data", "skip_bad_samples"),
    ("data", "excluded_samples"),
    ("data", "check_images"),
    ("training", "grad_reduce_dtype"),
]
JUNK = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**40), 2**40),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(["1h", "5ms", "-3s", "64MiB", "bfloat16", "cuda", "a100", "", "nan"]),
    st.lists(st.integers(-3, 50), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(changes=st.lists(st.tuples(st.sampled_from(FIELDS), JUNK), min_size=1, max_size=3))
def test_any_config_plans_or_exits_2_with_one_line_naming_the_field(tmp_path_factory, capsys, changes):
    raw = copy.deepcopy(TINY)
    for path, value in changes:
        section = raw
        for key in path[:-1]:
            section = section.setdefault(key, {})
        section[path[-1]] = value
    config = tmp_path_factory.mktemp("fuzz") / "job.yaml"
    config.write_text(yaml.safe_dump(raw))
    capsys.readouterr()
    code = main(["plan", "--config", str(config), "--nodes", "4"])
    err = capsys.readouterr().err
    assert code in (0, 2), f"{changes}: exit {code} (a bug)\n{err[-3000:]}"
    if code == 2:
        errors = [line for line in err.strip().splitlines() if "error" in line]  # progress lines may precede it
        assert len(errors) == 1 and errors[0].startswith("oobleck-launch: error:"), (changes, err)
        assert err.strip().splitlines()[-1] == errors[0], f"{changes}: the error is not the last word\n{err}"
        assert NAMES_A_FIELD.search(errors[0]), f"{changes}: the message names no field or file: {errors[0]}"


def test_a_global_batch_past_a_million_samples_is_refused_naming_it_instead_of_exhausting_host_memory(capsys, tmp_path):
    """Found by the test above in CI: ``training.global_batch: 2**30`` made ``plan`` allocate until the kernel
    killed it (23.5 GB); under a memory limit it was an internal error (a MemoryError)."""
    raw = copy.deepcopy(TINY)
    raw["training"]["global_batch"] = 2**30
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump(raw))
    assert main(["plan", "--config", str(config), "--nodes", "4"]) == 2
    assert "training.global_batch" in capsys.readouterr().err


TEXT = st.one_of(
    st.text(max_size=30), st.sampled_from(["<image>\nWhat?", "Red.", "<image><image>", "", "\u00e9\u4e2d"])
)
TURN = st.fixed_dictionaries({"from": st.sampled_from(["human", "gpt", "human", "gpt", "system", "x"]), "value": TEXT})
IMAGE = st.one_of(
    st.none(),
    st.sampled_from(
        ["images/red_square.png", "images/blue_circle.png", "missing.png", "cut.png", "notes.txt", "", "images"]
    ),
    st.lists(st.sampled_from(["images/red_square.png", "images/green_triangle.png", "cut.png"]), max_size=3),
)
WELL_FORMED = st.fixed_dictionaries(
    {"id": st.text(max_size=6), "conversations": st.lists(TURN, min_size=1, max_size=3)}, optional={"image": IMAGE}
)
JUNK_RECORD = st.one_of(
    st.fixed_dictionaries(
        {},
        optional={
            "id": st.integers(),
            "image": st.one_of(IMAGE, st.integers()),
            "conversations": st.one_of(
                st.lists(st.one_of(TURN, st.integers()), max_size=2), st.text(max_size=3), st.none()
            ),
        },
    ),
    st.integers(),
    st.text(max_size=5),
    st.lists(st.integers(), max_size=2),
)
RECORD = st.one_of(WELL_FORMED, WELL_FORMED, WELL_FORMED, JUNK_RECORD)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llava")
    shutil.copytree(os.path.join(FIXTURE, "images"), folder / "images")
    data = (folder / "images" / "red_square.png").read_bytes()
    (folder / "cut.png").write_bytes(data[: len(data) // 2])  # a header that reads, pixels that do not
    (folder / "notes.txt").write_text("not an image")
    return folder


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(records=st.lists(RECORD, max_size=8), skip=st.booleans(), seq=st.sampled_from([20, 64, 128]))
def test_any_llava_records_load_or_are_refused_naming_the_file_and_sample(data_dir, records, skip, seq):
    from oobleck_mm.data.check import check_samples
    from oobleck_mm.data.loader import TrainingData
    from test_packing import assert_layout_is_the_packed_batch_without_media

    good = {
        "id": "good",
        "image": "images/red_square.png",
        "conversations": [{"from": "human", "value": "<image>\nWhat?"}, {"from": "gpt", "value": "Red."}],
    }
    path = data_dir / "data.json"
    path.write_text(json.dumps([good] * 4 + records))
    raw = copy.deepcopy(TINY)
    raw["data"].update(kind="llava_json", path=str(path), max_seq_len=seq, skip_bad_samples=skip, mean_text_tokens=8)
    raw["training"].update(global_batch=4, microbatch_size=2)
    job = config_from_dict(raw)
    try:
        check_samples(job, progress=lambda line: None)
    except UserError as error:
        assert str(path) in str(error) or "data." in str(error), str(error)
        assert not skip or "good samples left" in str(error) or "is not valid JSON" in str(error), str(error)
        event("refused")
        return
    training = TrainingData(config_from_dict(job.to_dict()))  # what a worker builds from the master's config
    for index in range(len(training.dataset)):
        training.microbatch([index])  # loads, decodes and packs: no error may be left for a worker
        # and the stages after the encoders' inputs pack the same layout without the pixels
        assert_layout_is_the_packed_batch_without_media(training, [index])
    event(f"trained on {len(training.dataset) - 4} fuzzed samples, {len(job.data.excluded_samples)} left out")
