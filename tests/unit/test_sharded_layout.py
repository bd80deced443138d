"""Execution plans with stages of several GPUs: pieces of a microbatch, who sends whom, the sums' groups (issue 28)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oobleck_mm.planning.layout import ExecutionPlan, PipelineLayout, StageLayout, piece_samples, rank_table
from oobleck_mm.planning.shards import chunk_rows
from oobleck_mm.protocol.convert import plan_from_proto, plan_to_proto
from oobleck_mm.runtime.grad_sync import piece_sums, sharded_layers, stage_meshes, subgroup_ranks


def _plan() -> ExecutionPlan:
    """Pipeline 0: a 2-GPU stage (ranks 0, 1; layers 0-4) then rank 2; pipeline 1: ranks 3, 4, 5, one GPU each."""
    return ExecutionPlan.even(10, [2, 3], [4, 4], 2, widths=[[2, 1], [1, 1, 1]])


def test_a_wide_stage_has_its_ranks_in_shard_order_and_every_rank_is_counted_once():
    plan = _plan()
    first = plan.pipelines[0].stages[0]
    assert first.ranks == (0, 1) and first.width == 2 and plan.world_size == 6 and plan.sharded
    assert plan.position(1) == (0, 0) and plan.stage(1) is first
    assert plan.holders(0) == (0, 3)  # a stage's first rank per pipeline
    assert plan.shard_holders(0) == ((0, 1), (3,)) and plan.shard_holders(9) == ((2,), (5,))
    assert plan.pipelines[0].ranks == (0, 1, 2)
    assert "r0+1:0-4" in plan.describe()
    assert not ExecutionPlan.even(10, [2], [8], 2).sharded


def test_a_wide_plan_survives_json_and_protobuf():
    plan = ExecutionPlan.even(10, [2, 2], [2, 2], 4, widths=[[4, 1], [2, 2]])
    assert ExecutionPlan.from_dict(plan.to_dict()) == plan
    assert plan_from_proto(plan_to_proto(plan)) == plan


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(0, 50), min_size=1, max_size=20).map(lambda xs: list(dict.fromkeys(xs))),
    st.sampled_from([1, 2, 4, 8]),
)
def test_the_pieces_in_order_are_the_microbatch(samples, pieces):
    parts = [piece_samples(samples, pieces, k) for k in range(pieces)]
    assert [s for part in parts for s in part] == samples
    assert max(map(len, parts)) - min(map(len, parts)) <= 1


def test_every_rank_of_a_stage_runs_as_many_pieces_and_each_piece_has_one_sender_and_one_receiver():
    pipeline = ExecutionPlan.even(10, [3], [4], 4, widths=[[1, 4, 2]]).pipelines[0]
    assert pipeline.pieces == 4
    assert [list(pipeline.pieces_of(0, 0))] == [[0, 1, 2, 3]]
    assert [list(pipeline.pieces_of(1, r)) for r in (1, 2, 3, 4)] == [[0], [1], [2], [3]]
    assert [list(pipeline.pieces_of(2, r)) for r in (5, 6)] == [[0, 1], [2, 3]]
    assert [pipeline.piece_rank(2, k) for k in range(4)] == [5, 5, 6, 6]
    for stage in range(3):  # every piece is run by exactly one rank of every stage
        runs = sorted(k for r in pipeline.stages[stage].ranks for k in pipeline.pieces_of(stage, r))
        assert runs == [0, 1, 2, 3]


def test_widths_that_do_not_divide_the_widest_or_exceed_the_microbatch_are_refused_naming_them():
    with pytest.raises(ValueError, match=r"stages of \[2, 3\] GPUs"):
        ExecutionPlan(
            (PipelineLayout((StageLayout(0, 0, 5, shards=(1,)), StageLayout(2, 5, 10, shards=(3, 4))), 8),), 10, 8
        )
    with pytest.raises(ValueError, match=r"training.microbatch_size\); raise it to at least 4"):
        ExecutionPlan.even(10, [2], [8], 2, widths=[[4, 1]])
    with pytest.raises(ValueError, match="each once"):
        ExecutionPlan((PipelineLayout((StageLayout(0, 0, 5, shards=(1,)), StageLayout(1, 5, 10)), 8),), 10, 2)


def test_a_planning_plans_multi_gpu_stage_maps_to_its_gpus_ranks():
    from oobleck_mm.planning.plan import PipelineInstance, Plan
    from oobleck_mm.planning.template import PipelineTemplate, StageSpec

    def stage(start, end, node, gpus):
        return StageSpec(start, end, node, gpus, 1.0, 2.0, 1e6)

    # a 2-node template: node 0's two GPUs one stage, node 1's GPU 0 alone, then its GPU 1
    wide = PipelineTemplate(
        2, 2, (stage(0, 4, 0, (0, 1)), stage(4, 7, 1, (0,)), stage(7, 10, 1, (1,))), (0.1, 0.1), (0.1, 0.1)
    )
    narrow = PipelineTemplate(1, 2, (stage(0, 5, 0, (0,)), stage(5, 10, 0, (1,))), (0.1,), (0.1,))
    plan = Plan((PipelineInstance(wide, ("b", "c"), 4), PipelineInstance(narrow, ("a",), 4)), 16, 2, 0.0)
    table = rank_table(plan)
    layout = ExecutionPlan.from_plan(plan, table, slow={"b": 2.0})
    assert [s.ranks for s in layout.pipelines[0].stages] == [
        (table[("b", 0)], table[("b", 1)]),
        (table[("c", 0)],),
        (table[("c", 1)],),
    ]
    assert layout.pipelines[0].stages[0].slowdown == 2.0 and layout.world_size == 6
    assert layout.describe().startswith("[r0+1:0-3(slow x2.00)|r2:4-6|r3:7-9]x4mb")


def test_the_sums_over_pieces_name_one_rank_per_pipeline_and_the_meshes_come_after_the_buckets():
    plan = _plan()
    trainable = (True,) * 10
    rows = {layer: (5, 3) for layer in sharded_layers(plan, trainable)}  # two parameters of 5 and 3 rows
    assert sharded_layers(plan, trainable) == (0, 1, 2, 3, 4)
    sums = piece_sums(plan, trainable, rows)
    # rank 0 holds rows 0-2 of the 5 (0-1 of the 3), rank 1 the rest; pipeline 1 holds layers 0-2 whole on
    # rank 3 and 3-4 on rank 4
    assert [s.ranks for s in sums] == [(0, 3), (1, 3), (0, 4), (1, 4)]
    assert sums[0].rows[:2] == ((0, 0, 0, 3), (0, 1, 0, 2)) and sums[1].rows[:2] == ((0, 0, 3, 5), (0, 1, 2, 3))
    for s, layers in zip(sums, ([0, 1, 2], [0, 1, 2], [3, 4], [3, 4])):  # every parameter once per rank set
        assert [(layer, k) for layer, k, *_ in s.rows] == [(layer, k) for layer in layers for k in range(2)]
    assert chunk_rows(5, 2) == [(0, 3), (3, 5)]
    assert stage_meshes(plan) == [(0, 1)]
    groups = subgroup_ranks(plan, trainable, rows=rows)
    # buckets of the one-GPU layers (5-6 on ranks 2 and 4, 7-9 on 2 and 5), the pieces' groups, the mesh, the step
    assert groups == [(2, 4), (2, 5), (0, 3), (1, 3), (0, 4), (1, 4), (0, 1), (0, 1, 2, 3, 4, 5)]
    with pytest.raises(ValueError, match="rows"):
        subgroup_ranks(plan, trainable)


def test_a_frozen_sharded_layer_has_no_sum_but_its_stage_keeps_its_mesh():
    plan = _plan()
    trainable = (False,) * 5 + (True,) * 5
    assert sharded_layers(plan, trainable) == () and piece_sums(plan, trainable, {}) == []
    assert subgroup_ranks(plan, trainable, rows={}) == [(2, 4), (2, 5), (0, 1), (0, 1, 2, 3, 4, 5)]


def test_a_custom_layer_that_cannot_be_sharded_is_refused_before_anything_starts(tmp_path):
    """A ``model.builder`` layer with a scalar parameter (FSDP2 refuses 0-dimensional ones): refused at start,
    naming the layer, the parameter and what to change; the same model with one GPU per stage runs."""
    from oobleck_mm.config import config_from_dict
    from oobleck_mm.errors import UserError
    from oobleck_mm.runtime.limits import check_runnable

    (tmp_path / "scaled_model.py").write_text(
        "import torch\n"
        "from examples.custom_model import build as base\n"
        "from oobleck_mm.config.shape import CustomLayer\n"
        "def build(model, data):\n"
        "    layers = base(model, data)\n"
        "    make = layers[1].build\n"
        "    def scaled():\n"
        "        block = make()\n"
        "        block.scale = torch.nn.Parameter(torch.tensor(1.0))\n"
        "        return block\n"
        "    layers[1] = CustomLayer(layers[1].spec, scaled)\n"
        "    return layers\n"
    )

    def job(max_gpus: int):
        return config_from_dict(
            {
                "model": {
                    "name": "conv_lm",
                    "builder": f"{tmp_path / 'scaled_model.py'}:build",
                    "llm": {"num_layers": 2, "hidden": 32, "num_heads": 1, "vocab_size": 256},
                },
                "data": {"mean_text_tokens": 16, "max_seq_len": 96},
                "cluster": {"gpus_per_node": 2, "max_gpus_per_stage": max_gpus, "nodes": 2},
            }
        )

    with pytest.raises(
        UserError,
        match=r"layer 'llm.block0' has a scalar parameter 'scale'.*1-D tensor of one "
        r"element.*cluster.max_gpus_per_stage: 1",
    ):
        check_runnable(job(2), workers_here=False)
    check_runnable(job(1), workers_here=False)


def test_a_copy_to_a_gpu_of_a_wide_stage_carries_only_its_rows():
    """Copies in shard units: what a GPU of a 2-GPU stage receives of a layer is its chunk of every parameter
    and AdamW moment (buffers and steps whole); the two chunks together are the whole layer's bytes, each about
    half, and a sender cuts the same rows (``_rows`` on both sides)."""
    import yaml

    from oobleck_mm.config import config_from_dict
    from oobleck_mm.runtime.engine import fresh_layer
    from oobleck_mm.runtime.state_transfer import Receiver, _rows, _sharded, _tensors

    job = config_from_dict(yaml.safe_load(open("configs/tiny_mm.yaml")))
    layer = fresh_layer(job, 5, device="cpu")  # llm.block0
    whole = Receiver.for_layer(fresh_layer(job, 5, device="cpu"), "cpu").buffer.numel()
    halves = [Receiver.for_layer(fresh_layer(job, 5, device="cpu"), "cpu", (k, 2)).buffer.numel() for k in (0, 1)]
    assert all(0.45 * whole <= h <= 0.55 * whole for h in halves), (halves, whole)
    assert abs(sum(halves) - whole) <= 64 * len(_tensors(layer))  # alignment padding and the whole steps only
    sent = _rows(_tensors(layer), _sharded(layer), (1, 2))
    kept = [t for t, cut in zip(_tensors(layer), _sharded(layer)) if cut]
    assert [tuple(t.shape) for t, cut in zip(sent, _sharded(layer)) if cut] == [
        (t.shape[0] - (t.shape[0] + 1) // 2, *t.shape[1:]) for t in kept
    ]
