"""A mistake in the user's input stops the job once, within a bound, naming the culprit: never a hang or a cascade.

Real launcher, real workers: the failing worker reports a ``UserError`` (the same
on every replica, so not a node failure) and the master ends the job with exit 2
and the worker's message, instead of recovering from it node by node.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from harness import ROOT, Launch, write_config

pytestmark = [pytest.mark.integration, pytest.mark.slow]

FIXTURE = ROOT / "tests" / "fixtures" / "llava"
BOUND_S = 90.0
"""Start-up (planning, workers importing torch) plus the failure; the old behaviour never ended."""


def test_a_resume_from_a_truncated_shard_exits_2_naming_the_file_before_any_worker_starts(launches, tmp_path):
    from oobleck_mm.config import load_config
    from oobleck_mm.model.layers import model_layer_specs
    from oobleck_mm.runtime.checkpoint import save_layers
    from oobleck_mm.runtime.checkpoint_meta import save_meta
    from oobleck_mm.runtime.engine import fresh_layer

    config = write_config(tmp_path, nodes=2, steps=3)
    # A complete checkpoint as a run's final save writes it (every layer's file, then meta.json), written
    # here: what is tested is the resume that reads it, not a run that trains for it.
    final, job = tmp_path / "final", load_config(config)
    specs = model_layer_specs(job)
    save_layers(final, {i: fresh_layer(job, i, specs) for i in range(len(specs))}, range(len(specs)), specs)
    save_meta(final, job, 3, specs)
    shard = final / "layers" / "llm.block0.pt"
    assert shard.exists(), sorted(p.name for p in (final / "layers").iterdir())
    os.truncate(shard, shard.stat().st_size // 2)

    resumed = Launch(tmp_path, config, "--steps", "6", "--resume", str(final), name="resumed")
    launches.append(resumed)
    code = resumed.wait(timeout=BOUND_S)
    assert code == 2, f"exit {code}\n{resumed.stderr[-3000:]}"
    [error] = [line for line in resumed.stderr.splitlines() if "error:" in line]
    assert error.startswith("oobleck-launch: error: --resume:") and str(shard) in error and "truncated" in error
    assert not resumed.events("plan_decided"), "the checkpoint is checked before any worker loads it"
    assert not resumed.started_below_the_master(), "no agent, no worker, no planner: the master refused at once"


def bad_llava_config(tmp_path, break_image, at=(3,), **data) -> tuple[str, list[str]]:
    """A LLaVA-style dataset of 24 samples; ``break_image(images_dir)`` spoils the image of the samples at
    positions ``at``; ``data``: more fields of the config's data section. Returns (config, their ids)."""
    images = tmp_path / "images"
    shutil.copytree(FIXTURE / "images", images)
    entries = json.loads((FIXTURE / "llava.json").read_text())
    samples = [dict(entry, id=f"{entry['id']}-{k}") for k in range(8) for entry in entries]
    for position in at:
        assert "image" in samples[position], "a sample with one image"
        samples[position]["image"] = break_image(images)
    (tmp_path / "data.json").write_text(json.dumps(samples))
    config = write_config(tmp_path, nodes=2, steps=3)
    raw = yaml.safe_load(open(config))
    raw["data"].update(kind="llava_json", path=str(tmp_path / "data.json"), **data)
    for key in ("mean_text_tokens", "mean_images_per_sample", "max_images_per_sample"):  # measured by the master
        raw["data"].pop(key)
    Path(config).write_text(yaml.safe_dump(raw))
    return config, [samples[p]["id"] for p in at]


def truncated_image(images: Path) -> str:
    """A PNG cut in half: its header reads, its pixels do not decode."""
    data = (images / "red_square.png").read_bytes()
    (images / "broken.png").write_bytes(data[: len(data) // 2])
    return "images/broken.png"


def test_a_missing_image_is_refused_before_any_worker_starts(launches, tmp_path):
    config, [sample] = bad_llava_config(tmp_path, lambda images: "images/missing.png")
    run = Launch(tmp_path, config, name="missing")
    launches.append(run)
    assert run.wait(timeout=BOUND_S) == 2, run.stderr[-3000:]
    [error] = [line for line in run.stderr.splitlines() if "error:" in line]
    assert "missing.png" in error and sample in error and "data.skip_bad_samples" in error, run.stderr[-3000:]
    assert not run.started_below_the_master(), "the master checks the data before starting agents and workers"


def test_an_image_that_does_not_decode_is_refused_before_any_worker_starts(launches, tmp_path):
    """Its header reads; the master's decode pass (data.check_images: decode, the default) finds it."""
    config, [sample] = bad_llava_config(tmp_path, truncated_image)
    run = Launch(tmp_path, config, name="undecodable")
    launches.append(run)
    assert run.wait(timeout=BOUND_S) == 2, run.stderr[-3000:]
    [error] = [line for line in run.stderr.splitlines() if "error:" in line]
    assert "broken.png" in error and sample in error and "cannot decode image" in error, run.stderr[-3000:]
    assert not run.started_below_the_master(), "the master checks the data before starting agents and workers"


def test_skip_bad_samples_leaves_them_out_on_every_rank_and_the_run_equals_the_reference(launches, tmp_path):
    """--skip-bad-samples: a missing and an undecodable image are left out by the master, every worker and
    verify's reference alike (data.excluded_samples in the config they get); the global batch keeps its size."""
    config, _ = bad_llava_config(tmp_path, truncated_image, at=(3,))
    raw = json.loads((tmp_path / "data.json").read_text())
    raw[6]["image"] = "images/missing.png"
    (tmp_path / "data.json").write_text(json.dumps(raw))
    final = tmp_path / "final"
    run = Launch(tmp_path, config, "--skip-bad-samples", "--save-final", str(final), name="skipping")
    launches.append(run)
    assert run.wait(timeout=BOUND_S) == 0, run.stderr[-3000:]
    said = run.stdout + run.stderr
    assert "left out sample #3" in said and "left out sample #6" in said and "broken.png" in said, said[-3000:]
    meta = json.loads((final / "meta.json").read_text())
    assert meta["config"]["data"]["excluded_samples"] == [3, 6] and meta["step"] == 3
    # Issue 30 item 4: the planning shape the config left out, measured over the 22 good samples (8 copies
    # of the fixture's 1, 0 and 2 images, less #3's and #6's one image each), shipped to every rank.
    assert "data: measured over 22 samples for the planner" in said, said[-3000:]
    assert meta["config"]["data"]["mean_images_per_sample"] == round(22 / 22, 4)
    assert meta["config"]["data"]["mean_text_tokens"] > 0
    done = subprocess.run(
        [sys.executable, "-m", "oobleck_mm.cli", "verify", "--config", config, "--steps", "3", "--against", str(final)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    run.assert_all_gone()


def test_an_image_that_breaks_mid_file_stops_the_job_once_with_exit_2_naming_it(launches, tmp_path):
    """With data.check_images: header the master reads headers only: decoding fails in a worker, as it would
    on every replica, and that is a user error, not a node failure."""
    config, [sample] = bad_llava_config(tmp_path, truncated_image, check_images="header")
    run = Launch(tmp_path, config, name="broken")
    launches.append(run)
    code = run.wait(timeout=BOUND_S)
    assert code == 2, f"exit {code}\n{run.stderr[-3000:]}"
    [error] = [line for line in run.stderr.splitlines() if line.startswith("oobleck-launch: error:")]
    assert "broken.png" in error and sample in error and "cannot decode image" in error, run.stderr[-3000:]
    failed = run.events("worker_failed")
    assert failed and all(e["user_error"] for e in failed)
    assert not run.events("plan_decided", generation=2), "a user error is not a node failure to recover from"
    assert [e["exit_code"] for e in run.events("shutdown")] == [2]
    run.assert_all_gone()


@pytest.mark.parametrize(
    "target, code, words",
    [
        (
            "bug",
            1,
            ["{node}/gpu0 stopped the job: KeyError: 'a missing key in the engine'", "traceback in {node}'s log"],
        ),
        ("out_of_memory", 2, ["out of memory on {node}/gpu0 in step 2", "lower training.microbatch_size"]),
    ],
)
def test_a_bug_or_an_out_of_memory_stops_the_job_once_instead_of_recovering_from_it(
    launches, tmp_path, target, code, words
):
    """Recovery would meet it again on the next replica: the job ends at once, with the cause."""
    config = write_config(tmp_path, nodes=2, steps=5)
    run = Launch(tmp_path, config, "--worker-target", f"tests.e2e.broken_worker:{target}", name=target)
    launches.append(run)
    assert run.wait(timeout=BOUND_S) == code, run.stderr[-3000:]
    [error] = [line for line in run.stderr.splitlines() if line.startswith("oobleck-launch: error:")]
    [rank0] = run.events("assignment_sent", rank=0)  # the worker that breaks (agents register in any order)
    assert all(w.format(node=rank0["node"]) in error for w in words), error
    [failed] = run.events("worker_failed")
    assert failed["node"] == rank0["node"] and failed["bug" if code == 1 else "user_error"]
    assert not run.events("lost") and not run.events("plan_decided", generation=2)
    run.assert_all_gone()
