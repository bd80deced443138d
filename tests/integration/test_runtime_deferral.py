"""Entrain's deferral in the runtime: the LLM stages run other microbatches than the encoder stages, and the
update is the same (float64, real gloo processes).

Three pipelines cut every way the seam (``llm.embed``, where encoder outputs become the LLM's input) can fall:
at a stage boundary after two encoder stages, inside a stage that also runs the projector (its encoder
outputs come from another rank), and inside a single stage. Deferred samples' encoder outputs wait a slot
on the seam stage; their gradients reach the encoder stages one slot later (split backward).
"""

from __future__ import annotations

import pytest
import yaml

from oobleck_mm.config import config_from_dict
from oobleck_mm.planning.layout import ExecutionPlan, PipelineLayout, StageLayout
from oobleck_mm.runtime.worker import Phase, run_local
from test_runtime_equivalence import STEPS, max_param_diff, reference

pytestmark = pytest.mark.integration


def deferral_job(steps=STEPS, frozen=(), images_per_sample=2.7, tied=False):
    """Nearly every sample has images (binomial of 3 with mean 2.7), so deferred samples carry encoder work:
    with text-only ones deferred, a lost encoder gradient or a wrong concatenation order would go unseen."""
    with open("configs/tiny_mm.yaml") as f:
        d = yaml.safe_load(f)
    d["training"].update(dtype="float64", steps=steps, global_batch=24)
    d["data"]["mean_images_per_sample"] = images_per_sample
    d["balance"] = {"enabled": True, "fit_every": 2, "threshold": 0.0, "deferral": True}
    d["model"]["frozen"] = list(frozen)
    d["model"]["llm"]["tie_embeddings"] = tied
    return config_from_dict(d)


SEAMS = ExecutionPlan(
    (
        PipelineLayout((StageLayout(0, 0, 2), StageLayout(1, 2, 4), StageLayout(2, 4, 10)), 4),  # at a boundary
        PipelineLayout((StageLayout(3, 0, 3), StageLayout(4, 3, 10)), 4),  # inside a stage fed by another rank
        PipelineLayout((StageLayout(5, 0, 10),), 4),
    ),  # inside the only stage
    10,
    2,
)


def test_deferred_microbatches_equal_the_reference_on_every_seam(tmp_path):
    job = deferral_job()
    trainer, ref_losses = reference(job)  # STEPS steps
    outs = run_local(job, SEAMS, STEPS, tmp_path)
    deferred = [r.deferred for r in outs[0]["results"]]
    assert sum(deferred) > 0, "no step deferred anything: the test would not exercise the regrouping"
    assert max_param_diff(outs, trainer) < 1e-10
    assert outs[0]["losses"] == pytest.approx(ref_losses, abs=1e-12)


def test_deferral_with_a_frozen_tower_tied_embeddings_and_across_a_lost_node(tmp_path):
    """Frozen vision tower (no gradient crosses into it), tied embeddings (summed across stages once the
    second plan splits llm.embed from llm.head), then a reconfiguration to other seams mid-run."""
    job = deferral_job(frozen=["vision"], tied=True)
    trainer, ref_losses = reference(job)
    after = ExecutionPlan(
        (
            PipelineLayout((StageLayout(0, 0, 4), StageLayout(1, 4, 10)), 6),
            PipelineLayout((StageLayout(2, 0, 5), StageLayout(3, 5, 10)), 6),
        ),
        10,
        2,
    )
    outs = run_local(job, SEAMS, 2, tmp_path, phases=[Phase(after, STEPS - 2, {0: 0, 1: 1, 2: 2, 3: 3})])
    assert sum(r.deferred for r in outs[0]["results"]) > 0
    assert max_param_diff(outs, trainer) < 1e-10
    assert outs[0]["losses"] == pytest.approx(ref_losses, abs=1e-12)
