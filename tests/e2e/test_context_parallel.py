"""Context parallelism on the local cluster: two simulated GPUs per node split every sample's tokens, a kill and a
join, equal to the reference trainer in float64 (issue 50 items 2 and 4), for the built-in text model (a
HuggingFace LLaVA does the same in tests/e2e/test_huggingface.py, in that file's launch).

Real launcher, agents and workers (two per node), real gloo groups. ``cluster.context_parallel: 2``: every stage
spans a node's two GPUs, each holding the stage's layers whole and its LPT share of each microbatch's 128-token
blocks; attention gathers the other lane's keys and values. A node is killed at step 2 (the survivors re-form
from the templates and copy its layers from a replica: every lane of a context-parallel stage holds them whole)
and a node joins at step 3. The final checkpoint equals the reference trainer, every replica the same, and
resumes without context parallelism.
"""

from __future__ import annotations

import pytest
import yaml
from harness import (
    INTERVAL,
    ROOT,
    TIMEOUT,
    Launch,
    assert_matches_reference,
    assert_replicas_identical,
    assert_resume_equals_reference,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STEPS = 10


def text_config(tmp_path) -> str:
    raw = yaml.safe_load((ROOT / "configs" / "tiny_mm.yaml").read_text())
    for part in ("vision", "projector"):
        raw["model"].pop(part)
    # ~140-token samples: a microbatch of two spans two or three blocks (a short one is cut finer).
    raw["data"].update(mean_text_tokens=140, max_seq_len=512, mean_images_per_sample=0, max_images_per_sample=0)
    raw["training"].update(dtype="float64", steps=STEPS)
    raw["cluster"].update(nodes=3, gpus_per_node=2, context_parallel=2)
    raw["fault_tolerance"].update(heartbeat_interval=INTERVAL, heartbeat_timeout=TIMEOUT, straggler_factor=0)
    path = tmp_path / "text_cp.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def test_a_context_parallel_job_trains_through_a_kill_and_a_join_equal_to_the_reference(launches, tmp_path):
    config = text_config(tmp_path)
    final = tmp_path / "final"
    # The join early (step 3 of 10): a joiner takes a few steps to come in, more on a loaded machine.
    run = Launch(tmp_path, config, "--inject", "kill:node2@step2,join@step3", "--save-final", str(final))
    launches.append(run)
    assert run.wait(timeout=300) == 0, run.stderr[-3000:]
    layouts = [p["describe"] for p in run.events("plan_decided")]
    assert len(layouts) >= 3, layouts  # the first plan, the kill's, the join's
    assert all("(cp)" in layout for layout in layouts), f"every plan is context-parallel: {layouts}"
    assert [e["node"] for e in run.events("lost")] == ["node2"]
    assert_matches_reference(config, STEPS, final)
    assert_replicas_identical(final)
    # The checkpoint holds every layer whole: it resumes without context parallelism (the reference trainer,
    # one process) and trains on equal to the uninterrupted run.
    assert assert_resume_equals_reference(config, STEPS + 3, final) == STEPS
