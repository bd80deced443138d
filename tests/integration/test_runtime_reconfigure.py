"""Survivors re-form into a new plan without restarting and end equal to a run without failures.

The engine-side half of live reconfiguration: workers leave (their node is
gone), the rest join a new generation's group, receive the layer states they
now need (parameters *and* optimizer state) from surviving replicas, and
continue at the same global step with the global batch re-split. The control
plane that detects the failure and decides the plan is tested elsewhere.
"""

from __future__ import annotations

import pytest
import torch

from oobleck_mm.planning.layout import ExecutionPlan, PipelineLayout, StageLayout
from oobleck_mm.runtime.worker import Phase, run_local
from test_runtime_equivalence import max_param_diff, reference, tiny_job

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("prepared", [False, True], ids=["formed-at-the-switch", "formed-in-the-background"])
def test_lose_a_node_mid_pipeline_then_continue(tmp_path, prepared):
    """``prepared``: the new generation's groups (the default one and both subgroups: layers 0-4 on
    ranks 0 and 2, 5-9 on 1 and 2) are formed while the old one trains, as for a leave on notice."""
    job = tiny_job()
    trainer, ref_losses = reference(job)  # 5 steps without failure
    # generation 0: two 2-stage pipelines (ranks 0,1 | 2,3)
    before = ExecutionPlan.even(10, [2, 2], [4, 4], 2)
    # rank 3 (last stage of pipeline 1) is lost: rank 2 now runs a whole 1-stage pipeline, which needs
    # layers 5-9 from rank 1; the batch is re-split 5 + 3
    after = ExecutionPlan(
        (PipelineLayout((StageLayout(0, 0, 5), StageLayout(1, 5, 10)), 5), PipelineLayout((StageLayout(2, 0, 10),), 3)),
        10,
        2,
    )
    outs = run_local(job, before, 2, tmp_path, phases=[Phase(after, 3, {0: 0, 1: 1, 2: 2}, prepared=prepared)])
    assert max_param_diff(outs, trainer) < 1e-10
    for out in outs:
        assert out["losses"] == pytest.approx(ref_losses, abs=1e-12)
        assert out["backends"] == ["gloo", "gloo_prepared" if prepared else "gloo"]
    moved = {(t.layer, t.src, t.dst) for t in outs[2]["transfers"][0]}
    assert moved == {(layer, 1, 2) for layer in range(5, 10)}
    # the moved layers' Adam state equals the sender's (moments and step), not a fresh one
    for name, state in outs[2]["optimizer_states"].items():
        if name in outs[1]["optimizer_states"]:
            for key, value in state.items():
                assert torch.equal(value, outs[1]["optimizer_states"][name][key]), (name, key)
    assert all(float(v) == 5 for k, v in outs[2]["optimizer_states"]["llm.head"].items() if k.endswith("step"))


def test_first_stage_lost_and_survivors_renumbered(tmp_path):
    """Rank 0 (a whole 1-stage pipeline) is lost; the others are renumbered 0..2 and keep training."""
    job = tiny_job()
    trainer, ref_losses = reference(job)
    before = ExecutionPlan.even(10, [1, 1, 2], [3, 3, 2], 2)  # ranks 0 | 1 | 2,3
    after = ExecutionPlan(  # old 1 -> 0, old 2 -> 1, old 3 -> 2
        (PipelineLayout((StageLayout(0, 0, 10),), 4), PipelineLayout((StageLayout(1, 0, 4), StageLayout(2, 4, 10)), 4)),
        10,
        2,
    )
    outs = run_local(job, before, 3, tmp_path, phases=[Phase(after, 2, {1: 0, 2: 1, 3: 2})])
    assert max_param_diff(outs, trainer) < 1e-10
    assert outs[0]["losses"] == pytest.approx(ref_losses, abs=1e-12)
    moved = outs[0]["transfers"][0]
    assert {t.layer for t in moved} == {4}  # old rank 2 held 0-4, now keeps 0-3 and rank 2 needs 4


def test_a_layer_is_copied_from_the_receivers_own_node(tmp_path):
    """Two holders of layers 5-9 survive; the one on the receiver's node sends them all (planning.transfers)."""
    job = tiny_job()
    trainer, ref_losses = reference(job)
    before = ExecutionPlan.even(10, [2, 2, 2], [3, 3, 2], 2)  # ranks 0,1 | 2,3 | 4,5
    # rank 5 is lost: rank 4 runs a whole 1-stage pipeline and needs layers 5-9, held by ranks 1 and 3
    after = ExecutionPlan(
        (
            PipelineLayout((StageLayout(0, 0, 5), StageLayout(1, 5, 10)), 3),
            PipelineLayout((StageLayout(2, 0, 5), StageLayout(3, 5, 10)), 3),
            PipelineLayout((StageLayout(4, 0, 10),), 2),
        ),
        10,
        2,
    )
    nodes = ("nodeA", "nodeA", "nodeB", "nodeC", "nodeC")  # ranks 3 and 4 share a node
    outs = run_local(job, before, 2, tmp_path, phases=[Phase(after, 3, {r: r for r in range(5)}, nodes)])
    assert max_param_diff(outs, trainer) < 1e-10
    assert outs[4]["losses"] == pytest.approx(ref_losses, abs=1e-12)
    moved = {(t.layer, t.src, t.dst) for t in outs[4]["transfers"][0]}
    # without the node names the copies alternate between ranks 1 and 3
    assert moved == {(layer, 3, 4) for layer in range(5, 10)}
