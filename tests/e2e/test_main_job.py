"""``make run``'s job, exactly as the Makefile runs it: pipelines of different depths, a kill and a join."""

from __future__ import annotations

import csv
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest
import yaml
from harness import ROOT

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_make_run_shows_heterogeneous_pipelines_surviving_a_kill_and_taking_a_join(tmp_path):
    """Also the live status page (issue 51 item 4), in a real headless Chromium while the job runs: it
    shows the kill's node lost and the generation that replaced it, and refuses a request without the
    token (a new scenario joins this launch instead of starting a cluster of its own)."""
    [args] = re.findall(r"^RUN_ARGS := (.+)$", (ROOT / "Makefile").read_text(), re.M)
    command = [sys.executable, "-m", "oobleck_mm.cli", *shlex.split(args), "--run-dir", str(tmp_path / "run")]
    with open(tmp_path / "stderr.txt", "w") as stderr:
        proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=stderr, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    try:
        reader.start()
        page = _status_page_checked(lines, tmp_path)
        proc.wait(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(10)
    out = "".join(lines)
    assert proc.returncode == 0, (tmp_path / "stderr.txt").read_text()[-3000:]
    assert page is None or "node4" in page, page
    assert "generation 1: 2 pipelines (stages 3,2;" in out, out[:2000]  # heterogeneous depths
    assert re.search(r"^1\s+kill\s+node4\s+1\d\s.*resumed at step", out, re.M), out[
        -2000:
    ]  # step 11 or after (1-based)
    assert re.search(r"^2\s+join\s+node5\s.*resumed at step", out, re.M), out[-2000:]
    steps = yaml.safe_load((ROOT / "configs" / "mission.yaml").read_text())["training"]["steps"]
    assert re.search(rf"done: {steps} steps in", out)
    # Start-up says what it waits for; the layout is printed when it changes, not on every step.
    for line in ("agent node0 registered", "planning pipelines for 5 nodes", "starting 5 workers", "workers ready"):
        assert line in out, out[:2000]
    step_lines = [line for line in out.splitlines() if line.startswith("step ")]
    assert len(step_lines) == steps and not any("pipelines" in line for line in step_lines)
    assert all(re.search(r"loss \S+  lr \S+  gnorm \S+ .* tok/s .*, eta \d+:\d\d\]$", line) for line in step_lines[1:])
    # It ends by saying where the figure, the metrics and the logs are.
    run = tmp_path / "run"
    tail = out.splitlines()[-5:]
    assert tail[0] == f"figure:      {run / 'run.png'}" and (run / "run.png").stat().st_size > 10_000
    assert tail[2] == f"tensorboard: tensorboard --logdir {run / 'tensorboard'}"
    with open(run / "metrics.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert [int(r["step"]) for r in rows] == list(range(1, steps + 1))  # one row per step, none twice after the kill
    nodes = [int(r["live_nodes"]) for r in rows]
    # The kill once 10 steps are done (a busy machine may fire it a step late), the join once node5 is up.
    assert nodes[0] == 5 and 10 <= nodes.index(4) <= 12 and nodes[-1] == 5, nodes
    assert all(float(r["measured_max_s"]) >= float(r["measured_mean_s"]) > 0 for r in rows)
    assert all(float(r["predicted_max_s"]) > 0 and 0 < float(r["mfu"]) < 1 for r in rows)  # the balancer is on
    # Entrain's deferral (mission.yaml) ran on the plan after the join too: the decoupled microbatches survive
    # a kill and a join (their float64 equality with the reference: tests/integration/test_runtime_deferral.py).
    joined = nodes.index(4) + nodes[nodes.index(4) :].index(5)
    after_join = rows[joined:]
    assert sum(int(r["deferred"]) for r in after_join) > 0, [r["deferred"] for r in rows]
    assert all(
        1 + float(r["prediction_error"])
        == pytest.approx(float(r["measured_max_s"]) / float(r["predicted_max_s"]), rel=1e-4)
        for r in rows
    )


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def _status_page_checked(lines: list[str], tmp_path) -> str | None:
    """Once the launcher prints the page's address: refused without the token; then, in headless Chromium,
    the page shows node4 lost and a later generation. Its text (None where Chromium is missing: the page's
    HTTP answers are still checked)."""
    deadline = time.monotonic() + 60
    while not any(line.startswith("status page: ") for line in lines):
        assert time.monotonic() < deadline, "no status page address printed:\n" + "".join(lines)[-2000:]
        time.sleep(0.1)
    url = next(line for line in lines if line.startswith("status page: ")).split(": ", 1)[1].strip()
    bare = url.split("?")[0]
    for address in (bare, bare + "status.json", bare + "status.json?token=wrong"):
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(address, timeout=10)
        assert refused.value.code == 401 and b"token" in refused.value.read(), address
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        playwright = None
    else:
        playwright = sync_playwright
    if CHROMIUM is None or playwright is None:
        return None
    with playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            tab = browser.new_page()
            tab.goto(url)
            # The kill fires at step 10; the page polls every second.
            tab.wait_for_function(
                "() => document.querySelector('#nodes').innerText.includes('lost') && "
                "/generation [2-9]/.test(document.querySelector('#generation').innerText)",
                timeout=120_000,
            )
            tab.screenshot(path=str(tmp_path / "status.png"), full_page=True)
            text = tab.inner_text("body")
        finally:
            browser.close()
    assert re.search(r"node4\s+lost", text), text
    return text


def test_set_overrides_reach_the_master_and_the_workers(tmp_path, launches):
    from harness import Launch

    run = Launch(
        tmp_path,
        str(ROOT / "configs" / "tiny_mm.yaml"),
        "--nodes",
        "2",
        "--set",
        "training.global_batch=32",
        "--set",
        "training.steps=3",
    )
    launches.append(run)
    assert run.wait(timeout=120) == 0, run.stderr[-3000:]
    [plan] = run.events("plan_decided")
    layout = plan["layout"]
    assert sum(p["num_microbatches"] for p in layout["pipelines"]) * layout["microbatch_size"] == 32
    assert sorted(e["step"] for e in run.events("step")) == [0, 1, 2]  # training.steps=3, not the file's 20


RECORDING_BUILDER = '''
import importlib.util, json, os
from oobleck_mm.config.shape import CustomLayer

_spec = importlib.util.spec_from_file_location("custom_model_example", {example!r})
base = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(base)
NAMES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class Recording(base.Embed):
    """User code reading torchrun's variables while it trains."""

    def forward(self, acts, batch):
        path = os.path.join({out!r}, "rank%s-pid%d.json" % (os.environ.get("RANK"), os.getpid()))
        with open(path, "w") as fh:
            json.dump({{name: os.environ.get(name) for name in NAMES}}, fh)
        return super().forward(acts, batch)


def build(model, data):
    layers = base.build(model, data)
    llm = model.llm
    return [CustomLayer(layers[0].spec, lambda: Recording(llm.vocab_size, llm.hidden))] + layers[1:]
'''


def test_workers_see_torchruns_variables_for_their_generation(tmp_path, launches):
    import json

    import yaml
    from harness import Launch

    out = tmp_path / "env"
    out.mkdir()
    builder = tmp_path / "recording_model.py"
    builder.write_text(RECORDING_BUILDER.format(example=str(ROOT / "examples" / "custom_model.py"), out=str(out)))
    config = tmp_path / "job.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "model": {
                    "name": "conv_lm",
                    "builder": f"{builder}:build",
                    "llm": {"num_layers": 2, "hidden": 32, "num_heads": 1, "vocab_size": 256},
                },
                "data": {"mean_text_tokens": 16, "max_seq_len": 96, "num_samples": 256},
                "training": {"global_batch": 8, "microbatch_size": 2, "steps": 2},
                "cluster": {"nodes": 2},
            }
        )
    )
    run = Launch(tmp_path, str(config))
    launches.append(run)
    assert run.wait(timeout=120) == 0, run.stderr[-3000:]
    [started] = run.events("master_started")
    [plan] = run.events("plan_decided")
    seen = [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]
    first_stage_ranks = {p["stages"][0][0] for p in plan["layout"]["pipelines"]}
    assert {int(env["RANK"]) for env in seen} == first_stage_ranks  # every worker holding the embedding
    for env in seen:
        assert env["WORLD_SIZE"] == "2" and env["LOCAL_RANK"] == "0" and env["LOCAL_WORLD_SIZE"] == "1"
        assert env["MASTER_ADDR"] == "127.0.0.1" and env["MASTER_PORT"] == started["address"].rsplit(":", 1)[1]


def test_nnodes_2_to_4_starts_2_accepts_2_joins_and_refuses_the_third(tmp_path, launches):
    from harness import Launch

    # Three joiners for two free places; steps enough that every joiner's workers start under load (a joiner
    # is admitted once they are ready; the second starts a fresh agent: step 71 of 400 in CI, next to another
    # test). Once the third is refused the job is stopped (SIGTERM: it checkpoints and exits 3): the steps
    # after it would train for nothing.
    run = Launch(
        tmp_path,
        str(ROOT / "configs" / "tiny_mm.yaml"),
        "--nnodes",
        "2:4",
        "--steps",
        "400",
        "--log-every",
        "50",
        "--inject",
        "join@step3",
        "--inject",
        "join@step5",
        "--inject",
        "join@step7",
    )
    launches.append(run)
    refused = run.wait_event("refused", timeout=180)
    assert "already runs on 4 nodes, its maximum" in refused["reason"], refused

    def four_nodes_trained() -> bool:
        """The second join's generation (the refusal may come before it is planned) trained a step: a stop
        inside its switch is another scenario (test_slow_node.py says which)."""
        four = [p["generation"] for p in run.events("plan_decided") if len(p["nodes"]) == 4]
        return bool(four) and bool(run.events("step", generation=four[0]))

    assert run.stop_when(four_nodes_trained, "a step on 4 nodes", timeout=120) == 3, run.stderr[-3000:]
    plans = run.events("plan_decided")
    assert len(plans[0]["nodes"]) == 2  # started at MIN
    assert max(len(p["nodes"]) for p in plans) == 4  # two joins taken, up to MAX
    assert len(run.events("refused")) == 1
