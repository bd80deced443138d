"""A shipped wide config on the local cluster: two simulated GPUs per node, a kill and a join (issue 28 item 6).

Real launcher, real agents and workers (two per node), real gloo groups. The
device memory is set so the planner puts LLM blocks on 2-GPU stages (FSDP2 over
the node's two workers) and one-GPU stages elsewhere. A node is killed at step 6
(its pipeline re-forms; the survivors of a 2-GPU stage gather their shards in the
new generation and the copies run), a node joins at step 12, and the final
checkpoint equals the reference trainer in float64 (every layer written whole from
its shards), each replica (gathered) the same.
"""

from __future__ import annotations

import pytest
import yaml
from harness import INTERVAL, ROOT, TIMEOUT, Launch, assert_matches_reference, assert_replicas_identical

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STEPS = 20
SCALED = {
    "model": {
        "vision": dict(num_layers=2, hidden=32, ffn_hidden=64, num_heads=2),
        "audio": dict(num_layers=2, hidden=32, ffn_hidden=64, num_heads=2),
        "llm": dict(num_layers=4, hidden=64, ffn_hidden=128, num_heads=4, num_kv_heads=2, vocab_size=256),
    },
    "data": dict(image_size=56, mean_text_tokens=16, mean_audio_seconds=0.5, max_seq_len=256),
    "training": dict(global_batch=16, microbatch_size=2, dtype="float64", activation_checkpointing=False, steps=STEPS),
    "cluster": dict(
        device="cpu", backend="gloo", gpus_per_node=2, max_gpus_per_stage=2, nodes=8, device_memory=3_500_000
    ),
}
"""``configs/mllm_10b.yaml`` scaled down (its structure: vision, audio and a GQA, gated LLM; every layer trained)
to two simulated GPUs per node and CPU sizes; at 3.5 MB of device memory its plans on 7 and 8 nodes put LLM
blocks on 2-GPU stages. Float64 (mixed precision does not run on wide stages yet) and microbatches of 2 (a
2-GPU stage splits each microbatch's samples)."""


def scaled_mllm_10b(tmp_path) -> str:
    raw = yaml.safe_load((ROOT / "configs" / "mllm_10b.yaml").read_text())
    for section, fields in SCALED.items():
        for key, value in fields.items():
            if isinstance(value, dict):
                raw[section][key].update(value)
            else:
                raw[section][key] = value
    raw["fault_tolerance"].update(heartbeat_interval=INTERVAL, heartbeat_timeout=TIMEOUT, straggler_factor=0)
    path = tmp_path / "mllm_10b_scaled.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def test_scaled_mllm_10b_on_2_gpu_stages_trains_through_a_kill_and_a_join_equal_to_the_reference(launches, tmp_path):
    config = scaled_mllm_10b(tmp_path)
    final = tmp_path / "final"
    run = Launch(tmp_path, config, "--inject", "kill:node3@step6,join@step12", "--save-final", str(final))
    launches.append(run)
    assert run.wait(timeout=300) == 0, run.stderr[-3000:]
    layouts = [p["describe"] for p in run.events("plan_decided")]
    assert len(layouts) >= 3, layouts  # the first plan, the kill's, the join's
    assert all("+" in layout for layout in layouts), f"every plan has a 2-GPU stage: {layouts}"
    assert [e["node"] for e in run.events("lost")] == ["node3"]
    assert_matches_reference(config, STEPS, final)
    assert_replicas_identical(final)
