"""``scripts/bench_deferral.py``'s layouts: every pipeline of ``--layout`` holds every layer once, in stages cut at
block boundaries, on ranks of its own, and the contiguous split hands out exactly the batch's microbatches."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(ROOT / "scripts"))
    spec = importlib.util.spec_from_file_location("bench_deferral", ROOT / "scripts" / "bench_deferral.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def specs(bench):
    from oobleck_mm.config import config_from_dict
    from oobleck_mm.model.layers import model_layer_specs

    return model_layer_specs(config_from_dict(bench.CONFIG))


@pytest.mark.parametrize("layout", ["2", "2+1", "4", "3+3", "4+3+2+1", "2+2+1+1"])
def test_every_pipeline_holds_every_layer_once_on_ranks_of_its_own(bench, specs, layout):
    plan = bench._plan(layout, specs, 24, 2)
    depths = [int(d) for d in layout.split("+")]
    assert [len(p.stages) for p in plan.pipelines] == depths
    ranks = [s.rank for p in plan.pipelines for s in p.stages]
    assert ranks == list(range(sum(depths)))  # one process a stage, in order
    for pipeline in plan.pipelines:
        assert [i for s in pipeline.stages for i in s.layers] == list(range(len(specs)))
        assert all(s.layer_end > s.layer_start for s in pipeline.stages)
    assert sum(p.num_microbatches for p in plan.pipelines) == 24


def test_deeper_pipelines_cut_at_the_encoder_llm_seam(bench, specs):
    seam = next(i for i, s in enumerate(specs) if s.kind == "token_embed")
    for depth in (2, 3, 4):
        assert seam in bench._cuts(specs, depth)  # no stage mixes encoder and LLM layers


def test_microbatches_go_to_pipelines_by_their_depth_and_a_layout_too_wide_for_the_batch_is_refused(bench):
    assert bench._counts([4, 3, 2, 1], 24) == [10, 7, 5, 2]
    assert bench._counts([2, 1], 16) == [11, 5]  # the old 2+1 split: 16 - 16 // 3, 16 // 3
    with pytest.raises(SystemExit, match="leave a pipeline none; raise --global-batch"):
        bench._counts([2] * 17, 16)
    with pytest.raises(SystemExit, match="pipelines of 1 to 4 stages"):
        bench._depths("5+1")
