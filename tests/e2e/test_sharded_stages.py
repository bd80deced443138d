"""Stages of several GPUs on the local cluster: two simulated GPUs per node, a kill and a join (issue 28).

Real launcher, real agents and workers (two per node), real gloo groups. The
device memory is set so the planner puts the last layers on a 2-GPU stage (FSDP2
over the node's two workers) and one-GPU stages elsewhere. A node is killed at
step 8 (its pipeline re-forms; the survivors of a 2-GPU stage gather their shards
in the new generation and the copies run), a node joins at step 16, and the final
checkpoint equals the reference trainer in float64 (every layer written whole from
its shards), each replica (gathered) the same.
"""

from __future__ import annotations

import pytest
from harness import Launch, assert_matches_reference, assert_replicas_identical, write_config

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STEPS = 24
WIDE = dict(gpus_per_node=2, max_gpus_per_stage=2, device_memory=5_000_000)
"""Two GPUs per node; at 5 MB of device memory the float64 tiny model's plans on 5 and 6 nodes have 2-GPU stages."""


def test_two_gpu_stages_train_through_a_kill_and_a_join_equal_to_the_reference(launches, tmp_path):
    config = write_config(tmp_path, nodes=6, steps=STEPS, cluster=WIDE)
    final = tmp_path / "final"
    run = Launch(tmp_path, config, "--inject", "kill:node1@step8,join@step16", "--save-final", str(final))
    launches.append(run)
    assert run.wait(timeout=240) == 0, run.stderr[-3000:]
    plans = run.events("plan_decided")
    assert len(plans) >= 3, [p["describe"] for p in plans]  # the first plan, the kill's, the join's
    layouts = [p["describe"] for p in plans]
    assert all("+" in layout for layout in layouts), f"every plan has a 2-GPU stage: {layouts}"
    assert [e["node"] for e in run.events("lost")] == ["node1"]
    assert_matches_reference(config, STEPS, final)
    assert_replicas_identical(final)
