"""oobleck-launch plan: what a user sees, as text, as JSON, and on bad input (exit 2, one line)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from oobleck_mm.cli import main

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny_mm.yaml")


def run_json(capsys, *args: str) -> dict:
    assert main(["plan", "--config", TINY, "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


def assert_plan_valid(plan: dict, live_nodes: set[str]) -> None:
    used = [n for p in plan["pipelines"] for n in p["nodes"]]
    assert sorted(used) == sorted(live_nodes)  # every live node used exactly once
    assert plan["num_pipelines"] >= 2  # f + 1 replicas (tiny_mm has f = 1)
    assert sum(p["num_microbatches"] for p in plan["pipelines"]) * plan["microbatch_size"] == plan["global_batch"]
    assert all(p["num_microbatches"] >= 1 for p in plan["pipelines"])
    for p in plan["pipelines"]:  # stages cover every layer in order
        bounds = [s["layers"] for s in p["stages"]]
        assert bounds[0][0] == 0 and all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))


def test_plan_json_is_complete_and_consistent(capsys):
    doc = run_json(capsys, "--nodes", "5", "--fail-nodes", "node1", "3")
    num_layers = len(doc["profile"]["layers"])
    assert [t["nodes"] for t in doc["templates"]] == list(
        range(doc["min_nodes"], doc["min_nodes"] + len(doc["templates"]))
    )
    assert all(t["stages"][-1]["layers"][1] == num_layers for t in doc["templates"])
    assert_plan_valid(doc["plan"], {f"node{i}" for i in range(5)})
    rec = doc["reconfiguration"]
    assert rec["ok"] and rec["lost"] == ["node1", "node3"]
    assert_plan_valid(rec["plan"], {"node0", "node2", "node4"})
    assert doc["plan"]["samples_per_s"] == pytest.approx(doc["plan"]["global_batch"] / doc["plan"]["iteration_time_s"])


def test_plan_with_joins_uses_the_new_nodes(capsys):
    doc = run_json(capsys, "--nodes", "4", "--fail-nodes", "0", "--join-nodes", "2")
    assert_plan_valid(doc["reconfiguration"]["plan"], {"node1", "node2", "node3", "node4", "node5"})


def test_losing_too_many_nodes_reports_cannot_keep_replicas(capsys):
    doc = run_json(capsys, "--nodes", "4", "--fail-nodes", "0", "1", "2")
    assert doc["reconfiguration"]["ok"] is False
    assert doc["reconfiguration"]["live_nodes"] == 1 and doc["reconfiguration"]["needed"] == 2


def test_text_output_names_templates_plan_and_reconfiguration(capsys):
    assert main(["plan", "--config", TINY, "--fail-nodes", "node3"]) == 0
    out = capsys.readouterr().out
    for expected in (
        "pipeline templates:",
        "plan: 4 pipelines on 4 nodes",
        "samples/s",
        "microbatches",
        "reconfiguration after lost node3",
        "new plan: 3 pipelines on 3 nodes",
    ):
        assert expected in out


@pytest.mark.parametrize(
    "args, message",
    [
        (["--fail-nodes", "node9"], "--fail-nodes: unknown node 'node9'; valid nodes are node0..node3"),
        (["--fail-nodes", "node1", "1"], "--fail-nodes: node 'node1' listed twice"),
        (["--nodes", "0"], "--nodes: must be >= 1, got 0"),
        (["--nodes", "1"], "need at least 2 nodes; use cluster.nodes >= 2 or fault_tolerance.f <= 0"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(capsys, args, message):
    assert main(["plan", "--config", TINY, *args]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and message in errors[0]  # progress lines may precede it


def test_missing_config_file_exits_2(capsys, tmp_path):
    assert main(["plan", "--config", str(tmp_path / "nope.yaml")]) == 2
    assert "nope.yaml" in capsys.readouterr().err


def test_a_bug_exits_1_with_its_traceback_never_as_bad_input(capsys, monkeypatch):
    """Only a UserError is the user's mistake (exit 2); any other exception is a bug: exit 1, traceback."""
    import oobleck_mm.planning.planner as planner

    def broken(*args, **kwargs):
        raise ValueError("an internal invariant failed")  # a plain ValueError is not a UserError

    monkeypatch.setattr(planner, "plan_job", broken)
    assert main(["plan", "--config", TINY]) == 1
    err = capsys.readouterr().err
    assert "internal error (a bug, not your input)" in err and "an internal invariant failed" in err
    assert "Traceback (most recent call last)" in err and "in broken" in err


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--inject", "kill:node9@step2"],
            "--inject kill:node9@step2: node 'node9' is not in this run (nodes node0, node1, node2)",
        ),
        (
            ["--inject", "join@step1,kill:node4@step2"],
            "node 'node4' is not in this run (nodes node0, node1, node2; joins add node3)",
        ),
        (["--trace", "TMP"], "is a folder, not a file"),
        (["--run-dir", "TMP/file"], "--run-dir: 'TMP/file' is a file; give a folder"),
        (
            ["--inject", "kill:node1@phase:checkpoint"],
            "@phase:checkpoint needs a checkpoint, and this "
            "live-recovery run writes none: set "
            "fault_tolerance.checkpoint_interval",
        ),
        (["--churn", "5,burst=0"], "--churn: burst must be >= 1"),
        # issue 54 item 5: a fault past the last step never fires; such a run said nothing of it
        (
            ["--inject", "kill:node1@step50"],
            "--inject kill:node1@step50: it fires once 50 steps are done, and "
            "this run trains 2 (training.steps, --steps): it would never fire",
        ),
    ],
)
def test_local_refuses_bad_flags_before_starting_anything(capsys, tmp_path, args, message):
    (tmp_path / "file").write_text("not a folder")
    args = [a.replace("TMP", str(tmp_path)) for a in args]
    assert main(["local", "--config", TINY, "--nodes", "3", "--steps", "2", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message.replace("TMP", str(tmp_path)) in err, err
    assert not list(Path(".").glob("runs/*-" + str(os.getpid())))  # no run dir was created


def test_verify_exits_2_on_an_unreadable_checkpoint(tmp_path, capsys):
    import json

    from oobleck_mm.config import load_config
    from oobleck_mm.config.shape import layer_specs
    from oobleck_mm.verify import main as verify

    names = [s.name for s in layer_specs(load_config(TINY).model, load_config(TINY).data)]
    (tmp_path / "layers").mkdir()
    (tmp_path / "layers" / f"{names[0]}.pt").write_bytes(b"PK\x03\x04 truncated")
    (tmp_path / "meta.json").write_text(
        json.dumps({"format": 1, "step": 0, "num_layers": len(names), "layer_names": names})
    )
    assert verify(["--config", TINY, "--steps", "0", "--against", str(tmp_path)]) == 2
    assert "not a readable layer shard" in capsys.readouterr().err  # the manifest check, before any tensor
    (tmp_path / "meta.json").write_text(json.dumps({"format": 1, "step": 0}))
    assert verify(["--config", TINY, "--steps", "0", "--against", str(tmp_path)]) == 2
    assert "lacks num_layers, layer_names" in capsys.readouterr().err


@pytest.mark.parametrize(
    "config,message",
    [
        (
            "configs/mllm_10b.yaml",
            "cluster.max_gpus_per_stage: 8 (stages of up to 8 GPUs on nodes of 8), but training.microbatch_size is 1",
        ),
        (
            "configs/gpt3_2.7b.yaml",
            "cluster.device: 'cuda' with cluster.gpus_per_node 1, but this machine's torch sees",
        ),
    ],
)
def test_local_refuses_what_the_workers_could_not_run_before_starting_anything(capsys, config, message):
    if "gpt3" in config:
        import torch

        if torch.cuda.device_count() >= 1:
            pytest.skip("this machine has a GPU")
    assert main(["local", "--config", config]) == 2
    assert message in capsys.readouterr().err
    assert main(["plan", "--config", config]) == 0  # planning it is fine


def test_set_overrides_a_field_and_is_checked_like_the_yaml(capsys):
    doc = run_json(capsys, "--set", "training.global_batch=32", "--set", "balance.enabled=true")
    assert doc["plan"]["global_batch"] == 32
    cases = [
        ("training.global_bach=32", "unknown key 'training.global_bach' (did you mean 'global_batch'?)"),
        ("training.global_batch=-3", "training.global_batch: must be >= 1, got -3"),
        ("training.global_batch.x=3", "--set training.global_batch.x: training.global_batch is 16, not a section"),
        ("training", "--set: expected KEY=VALUE"),
        ("training.dtype=[unclosed", "--set training.dtype: '[unclosed' is not a YAML value"),
    ]
    for item, message in cases:
        assert main(["plan", "--config", TINY, "--set", item]) == 2
        err = capsys.readouterr().err
        assert message in err, (item, err)


def test_the_resume_command_repeats_the_set_overrides():
    from oobleck_mm.cli import _resume_command, build_parser

    args = build_parser().parse_args(
        ["local", "--config", TINY, "--set", "training.global_batch=32", "--set", "data.path=my data.json"]
    )
    command = _resume_command("local", args)
    assert command.endswith("--set training.global_batch=32 --set 'data.path=my data.json'")


def test_the_resume_command_keeps_the_named_flags_that_change_the_job():
    """Issue 30: a resumed ``--steps 3000`` run stopped at the file's 20 steps."""
    from oobleck_mm.cli import _resume_command, build_parser

    args = build_parser().parse_args(
        [
            "local",
            "--config",
            TINY,
            "--steps",
            "3000",
            "--nodes",
            "2:6",
            "--recovery",
            "restart",
            "--checkpoint-interval",
            "50",
        ]
    )
    command = _resume_command("local", args)
    assert command.endswith(f"--config {TINY} --nodes 2:6 --steps 3000 --recovery restart --checkpoint-interval 50")
    master = build_parser().parse_args(["master", "--config", TINY, "--steps", "3000", "--nodes", "4"])
    assert _resume_command("master", master).endswith("--nodes 4 --steps 3000")


def test_the_resume_command_keeps_where_the_final_model_and_the_logs_go(tmp_path):
    """Issue 54 item 8: the command printed at exit 3 dropped ``--save-final`` and ``--run-dir``: a user who
    copied it got no final model. The resumed run's logs go beside the first run's, not into them."""
    from oobleck_mm.cli import _resume_command, build_parser, resumed_run_dir

    args = build_parser().parse_args(
        ["local", "--config", TINY, "--save-final", "out/final", "--run-dir", str(tmp_path / "my run")]
    )
    command = _resume_command("local", args)
    final = os.path.abspath("out/final")
    assert f" --save-final {final}" in command
    assert f" --run-dir '{tmp_path / 'my run'}-resumed'" in command, command
    assert resumed_run_dir(str(tmp_path / "r-resumed")) == str(tmp_path / "r-resumed2")
    assert resumed_run_dir(str(tmp_path / "r-resumed2") + "/") == str(tmp_path / "r-resumed3")
    assert resumed_run_dir(str(tmp_path / "not-resumed-x")) == str(tmp_path / "not-resumed-x-resumed")


@pytest.mark.parametrize("command", ["local", "master"])
def test_log_every_below_one_exits_2_naming_the_flag(capsys, command, tmp_path):
    assert main([command, "--config", TINY, "--log-every", "0", "--run-dir", str(tmp_path)]) == 2
    assert "--log-every: must be >= 1, got 0" in capsys.readouterr().err


def test_log_level_is_one_of_the_named_levels(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["local", "--config", TINY, "--log-level", "chatty"])
    assert exit_.value.code == 2 and "invalid choice: 'chatty'" in capsys.readouterr().err


def test_verify_windows_judges_every_window_with_the_given_tolerance(monkeypatch, capsys, tmp_path):
    """`verify --windows DIR --tolerance T` judged each window with its default bound and ignored T."""
    import oobleck_mm.verify as verify

    seen = []
    monkeypatch.setattr(verify, "checkpoint_windows", lambda folder, final: [(None, "w1", 2), ("w1", "w2", 4)])
    monkeypatch.setattr("oobleck_mm.runtime.checkpoint_meta.read_meta", lambda directory: {"step": 2, "config": {}})

    def compare(job, step, end, progress=None, start_dir=None, tolerance=None):
        from types import SimpleNamespace

        seen.append(tolerance)
        return SimpleNamespace(ok=True, tolerance=tolerance, worst=SimpleNamespace(abs_diff=2e-7))

    monkeypatch.setattr(verify, "compare", compare)
    code = verify.main(
        [
            "--config",
            TINY,
            "--steps",
            "4",
            "--against",
            str(tmp_path),
            "--windows",
            str(tmp_path),
            "--tolerance",
            "1e-6",
        ]
    )
    assert seen == [1e-6, 1e-6], seen
    assert code == 0 and "2 windows, all within tolerance" in capsys.readouterr().out


def test_resume_latest_or_a_run_dir_picks_the_newest_complete_checkpoint(tmp_path, monkeypatch, capsys):
    """Issue 30: ``--resume`` took only an exact step folder. ``latest`` searches this job's runs, a run dir
    its own checkpoints; a folder of ``.tmp`` files (a write cut short) is never picked."""
    import argparse
    import json

    from oobleck_mm.cli import _resolve_resume
    from oobleck_mm.config import load_config
    from oobleck_mm.errors import UserError
    from oobleck_mm.runtime.checkpoint_meta import FORMAT

    def checkpoint(path, step):
        path.mkdir(parents=True)
        meta = {"format": FORMAT, "step": step, "num_layers": 1, "layer_names": ["x"]}
        (path / "meta.json").write_text(json.dumps(meta))

    job = load_config(TINY)
    monkeypatch.chdir(tmp_path)
    name = job.model.name
    checkpoint(tmp_path / "runs" / f"{name}-a" / "checkpoints" / "step00000004", 4)
    checkpoint(tmp_path / "runs" / f"{name}-b" / "checkpoint-g3-step00000009", 9)
    cut = tmp_path / "runs" / f"{name}-b" / "checkpoints" / "step00000012"
    cut.mkdir(parents=True)
    (cut / "layer0.pt.tmp").write_text("")
    checkpoint(tmp_path / "runs" / "other-model" / "checkpoints" / "step00000099", 99)

    def resolved(resume, run_dir=""):
        args = argparse.Namespace(resume=resume, run_dir=run_dir)
        _resolve_resume(args, job)
        return args.resume

    assert resolved("latest").endswith(f"runs/{name}-b/checkpoint-g3-step00000009")
    assert resolved(f"runs/{name}-a").endswith("checkpoints/step00000004")
    assert resolved("latest", run_dir=f"runs/{name}-a").endswith("step00000004")
    exact = f"runs/{name}-a/checkpoints/step00000004"
    assert resolved(exact) == exact
    assert "the newest complete checkpoint is" in capsys.readouterr().out
    with pytest.raises(UserError, match="no complete checkpoint .* under empty"):
        (tmp_path / "empty").mkdir()
        resolved("empty")


def test_verify_replays_the_schedule_the_run_had_not_the_files_steps(monkeypatch, capsys, tmp_path):
    """A run launched with --steps 6 on a file of 20 decays its LR over 6 steps; verify replays that (read from
    the checkpoint's recorded config), unless the user sets training.steps herself."""
    import oobleck_mm.verify as verify

    seen = []
    monkeypatch.setattr(
        "oobleck_mm.runtime.checkpoint_meta.read_meta",
        lambda directory: {"step": 6, "config": {"training": {"steps": 6}}},
    )

    def compare(job, step, end, progress=None, start_dir=None, tolerance=None):
        from types import SimpleNamespace

        seen.append(job.training.steps)
        return SimpleNamespace(ok=True, format=lambda: "ok")

    monkeypatch.setattr(verify, "compare", compare)
    assert verify.main(["--config", TINY, "--steps", "6", "--against", str(tmp_path)]) == 0
    assert "the run's schedule is over 6 steps (its checkpoint's training.steps), not the file's 20" in (
        capsys.readouterr().err
    )
    assert verify.main(["--config", TINY, "--steps", "6", "--against", str(tmp_path), "--set", "training.steps=9"]) == 0
    assert seen == [6, 9]


def test_local_refuses_a_cluster_the_templates_cannot_cover_before_anything_starts(capsys, tmp_path):
    """Issue 54 item 8: ``llava_tiny`` on 4 nodes (n0 = 2, f = 1: one template size, two needed) failed only
    after 17 s of start-up. Now ``local`` says it at once, exit 2, before a master or an agent starts."""
    import time

    began = time.perf_counter()
    code = main(
        [
            "local",
            "--config",
            TINY,
            "--nodes",
            "4",
            "--set",
            "cluster.device_memory=4MB",
            "--run-dir",
            str(tmp_path / "run"),
        ]
    )
    err = capsys.readouterr().err
    assert code == 2, err
    assert "no pipeline templates for 4 nodes (cluster.nodes)" in err and "consecutive counts" in err, err
    assert "use cluster.nodes >= 5" in err
    assert not (tmp_path / "run" / "events.jsonl").exists(), "nothing started"
    assert time.perf_counter() - began < 10


def test_plan_placements_prints_both_times_and_the_branches_gpus(capsys):
    """``--placements``: per pipeline, the chain's and the branches' exact times and the faster; on one node of
    Cornstarch's SSS the three parts share the node's four GPUs (units smaller than a node)."""
    config = str(Path(__file__).resolve().parents[2] / "configs" / "cornstarch_mllm_sss.yaml")
    assert main(["plan", "--config", config, "--placements"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("placement, 1 node(s)"))
    assert "chain" in line and "branches" in line and "faster" in line
    branches = out.splitlines()[out.splitlines().index(line) + 1]
    assert "vision [" in branches and "audio [" in branches and "-> llm [" in branches
    used = re.findall(r"@n(\d+)g(\d+)", branches)
    assert len(used) == len(set(used)) and {n for n, _ in used} == {"0"}


def test_plan_exits_2_naming_an_unsupported_architecture_and_profiles_hf_layers(tmp_path, capsys):
    import yaml

    from oobleck_mm.model.tiny_hf import make_tiny_model

    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"model": {"huggingface": "gpt2"}}))
    assert main(["plan", "--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "'GPT2LMHeadModel'; supported architectures" in err, err
    good = tmp_path / "good.yaml"  # the measured profiler runs transformers' modules
    model = make_tiny_model(tmp_path / "qwen2-siglip", text="qwen2", vision="siglip", tie=False)
    good.write_text(
        yaml.safe_dump(
            {
                "model": {"huggingface": model},
                "data": {"mean_images_per_sample": 1, "image_size": 32, "max_seq_len": 96, "mean_text_tokens": 16},
                "planning": {"profile": "measured"},
                "cluster": {"nodes": 2},
            }
        )
    )
    assert main(["plan", "--config", str(good)]) == 0
    err = capsys.readouterr().err
    assert "profiled 11 layers (measured" in err, err[-2000:]
