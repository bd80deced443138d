"""``oobleck_mm.local`` / ``launch``: how Python objects become the job the command line runs (no cluster)."""

from __future__ import annotations

import os
import sys

import pytest

import oobleck_mm
from oobleck_mm import api
from oobleck_mm.errors import UserError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def top_level_builder(model, data):  # a builder the workers can import by name
    return []


def test_the_package_exposes_the_api_lazily_and_imports_nothing_for_it():
    code = "import sys, oobleck_mm; print(sorted(m for m in sys.modules if m.startswith('oobleck_mm')))"
    import subprocess

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert out.strip() == "['oobleck_mm']"
    assert oobleck_mm.local is api.local and oobleck_mm.launch is api.launch
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        oobleck_mm.nope  # noqa: B018


def test_a_builder_is_named_so_a_worker_can_import_it():
    assert api.builder_name(top_level_builder) == f"{__name__}:top_level_builder"
    assert api.builder_name(api.builder_name) == "oobleck_mm.api:builder_name"

    def nested(model, data):
        return []

    for bad in (nested, lambda m, d: []):
        with pytest.raises(UserError, match=r"model=: .* is not a top-level function; the workers import it"):
            api.builder_name(bad)


def test_a_dict_configs_paths_are_taken_from_the_current_folder_and_objects_go_where_files_would(tmp_path):
    config = {"model": {"builder": "examples/custom_model.py:build", "name": "x"}, "data": {"path": "d.json"}}
    raw, built = api._raw(config)
    assert not built and config["model"]["builder"] == "examples/custom_model.py:build", "the caller's dict is kept"
    assert raw["model"]["builder"] == os.path.abspath("examples/custom_model.py") + ":build"
    assert raw["data"]["path"] == os.path.abspath("d.json")
    api._put_model(raw, top_level_builder)
    assert raw["model"]["builder"] == f"{__name__}:top_level_builder"
    api._put_model(raw, tmp_path / "llava")
    assert raw["model"] == {"name": "x", "huggingface": str(tmp_path / "llava")}
    api._put_dataset(raw, tmp_path / "pairs.json", None, str(tmp_path), False)
    assert raw["data"] == {"path": str(tmp_path / "pairs.json"), "kind": "llava_json"}
    api._put_dataset(raw, tmp_path / "folder", {"text": "caption"}, str(tmp_path), False)
    assert raw["data"]["kind"] == "hf_datasets" and raw["data"]["columns"] == {"text": "caption"}
    with pytest.raises(UserError, match=r"dataset=: expected a datasets.Dataset, a DatasetDict or a path, got list"):
        api._put_dataset(raw, [{"text": "a"}], None, str(tmp_path), False)
    with pytest.raises(UserError, match=r"config: expected a YAML path, a dict or a JobConfig, got int"):
        api._raw(3)


def test_a_bad_value_is_refused_before_anything_starts(tmp_path, capsys):
    """A bad value in the dict raises here; one in ``overrides`` is the command line's exit 2, one line."""
    tiny = os.path.join(ROOT, "configs", "tiny_mm.yaml")
    bad = {"model": {"huggingface": "/nowhere"}, "training": {"microbatch_size": -2}}
    with pytest.raises(UserError, match=r"model.huggingface|training.microbatch_size"):
        api.local(bad, run_dir=tmp_path / "a")
    run = api.local(tiny, run_dir=tmp_path / "b", overrides=["training.microbatch_size=-2"])
    assert run.exit_code == 2 and not run.ok and run.events() == []
    assert "training.microbatch_size" in capsys.readouterr().err
