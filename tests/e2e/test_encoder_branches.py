"""Encoder branches planned and run on the local cluster, through a kill and a join (issue 49 items 2 and 3).

``planning.placement: auto``: per node count the planner keeps the chain or the template whose vision and
audio encoders run on stages of their own, concurrently, feeding the LLM's first stage, whichever its exact
1F1B time says is faster (tuned for one microbatch per pipeline here, where depth weighs most: the 3-node
template is ``vision || audio => LLM``). Real launcher, agents and workers, gloo. A node of the branched
pipeline is killed at step 2 (its layers are copied from a replica into the survivors' new plan) and a node
joins at step 3; the final checkpoint equals the reference trainer (one process, the layer list in order)
in float64, every replica the same, and resumes without branches.
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

STEPS = 8


def branched_config(tmp_path) -> str:
    raw = yaml.safe_load((ROOT / "configs" / "tiny_mm_audio.yaml").read_text())
    raw["model"]["vision"]["num_layers"] = raw["model"]["audio"]["num_layers"] = 4
    raw["model"]["llm"]["num_layers"] = 2
    # Two microbatches on 4 nodes: a 3-node branched pipeline and a 1-node one (the planner's choice).
    raw["training"].update(dtype="float64", steps=STEPS, global_batch=4, microbatch_size=2)
    raw["cluster"].update(nodes=4, device_memory="64MB")
    raw["planning"] = {**raw.get("planning", {}), "placement": "auto", "microbatches_hint": 1}
    raw["fault_tolerance"].update(heartbeat_interval=INTERVAL, heartbeat_timeout=TIMEOUT, straggler_factor=0)
    path = tmp_path / "branches.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def test_a_branched_pipeline_trains_through_a_kill_and_a_join_equal_to_the_reference(launches, tmp_path):
    config = branched_config(tmp_path)
    final = tmp_path / "final"
    run = Launch(tmp_path, config, "--inject", "kill:node1@step2,join@step3", "--save-final", str(final))
    launches.append(run)
    assert run.wait(timeout=240) == 0, run.stderr[-3000:]
    run.assert_all_gone()
    plans = run.events("plan_decided")
    first = plans[0]["describe"]
    assert " || " in first and " => " in first, f"the first plan runs encoder branches: {first}"
    assert [e["node"] for e in run.events("lost")] == ["node1"]
    # The survivors meet at once: the merge stage, which gave up the step when its branch died, tells the other
    # branch waiting on its gradients (a gloo receive cannot be interrupted: it waited out collective_timeout,
    # 8 s here, before ``p2p.send_abandoned``).
    [rendezvous] = [e["seconds"] for e in run.events("rendezvous_done") if e["generation"] == 2]
    assert rendezvous < 5.0, f"the recovery's rendezvous took {rendezvous:.2f} s"
    assert len(plans) >= 3, [p["describe"] for p in plans]  # the start, the kill's, the join's
    assert_matches_reference(config, STEPS, final)
    assert_replicas_identical(final)
    # The checkpoint of a run whose generations were branched resumes on another layout (one process, the
    # layers in order) and trains on equal to the uninterrupted run.
    assert assert_resume_equals_reference(config, STEPS + 2, final) == STEPS
