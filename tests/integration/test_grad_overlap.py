"""Gradient sums overlapped with the last backward equal the sums after it, and the reference (real gloo).

``training.grad_bucket_mb`` is set tiny here, so every layer is a chunk of its own and the hooks start
most of them while the layers below still compute (at the default 25 MB the tiny model's stage is one
chunk, which starts only once its last layer is done). Every layer has two holders (two pipelines), so
each element is one addition on either path: the overlapped run must equal the other bit for bit, not
just within the reference's 1e-10.
"""

from __future__ import annotations

import pytest
import torch
import yaml

from oobleck_mm.config import config_from_dict
from oobleck_mm.planning.layout import ExecutionPlan, PipelineLayout, StageLayout
from oobleck_mm.runtime.reference import ReferenceTrainer
from oobleck_mm.runtime.worker import Phase, run_local

pytestmark = pytest.mark.integration
STEPS = 3
TINY_BUCKET_MB = 1e-6
"""Every layer a chunk of its own."""


def job(overlap: bool = True, **training):
    with open("configs/tiny_mm.yaml") as f:
        d = yaml.safe_load(f)
    frozen, tied = training.pop("frozen", ()), training.pop("tied", False)
    d["training"].update(
        {"dtype": "float64", "steps": STEPS, "grad_overlap": overlap, "grad_bucket_mb": TINY_BUCKET_MB, **training}
    )
    d["model"]["frozen"] = list(frozen)
    d["model"]["llm"]["tie_embeddings"] = tied
    return config_from_dict(d)


def states(outs) -> dict[tuple[int, str], dict[str, torch.Tensor]]:
    return {(rank, name): state for rank, out in enumerate(outs) for name, state in out["states"].items()}


def worst_against_reference(outs, j, steps: int) -> float:
    trainer = ReferenceTrainer(j)
    for _ in trainer.train(steps):  # (a generator: one step per item)
        pass
    names = [s.name for s in trainer.specs]
    return max(
        (value - trainer.layer_state(names.index(name))[key]).abs().max().item()
        for (_, name), state in states(outs).items()
        for key, value in state.items()
    )


def copied(outs) -> int:
    """Bytes the bucket sums copied into a buffer and back, over every rank and step."""
    return sum(r.grad_bytes_copied for out in outs for r in out["results"])


def overlapped(outs) -> tuple[int, int]:
    """(bytes started during a backward, bytes summed) over every rank and step."""
    results = [r for out in outs for r in out["results"]]
    return sum(r.grad_bytes_overlapped for r in results), sum(r.grad_bytes for r in results)


CASES = {
    "2-stage + 3-stage": ({}, [2, 3]),
    "tied embeddings": ({"tied": True}, [2, 3]),
    "frozen vision encoder": ({"frozen": ("vision",)}, [3, 2]),
    "float32 compute, float64 masters": ({"dtype": "float32", "master_dtype": "float64"}, [2, 3]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_overlapped_sums_equal_the_sums_after_the_backward_and_the_reference(name, tmp_path):
    training, stages = CASES[name]
    on, off = job(True, **dict(training)), job(False, **dict(training))
    plan = ExecutionPlan.even(10, stages, [4, 4], on.training.microbatch_size)
    outs_on = run_local(on, plan, STEPS, tmp_path / "on")
    outs_off = run_local(off, plan, STEPS, tmp_path / "off")
    early, total = overlapped(outs_on)
    assert total > 0 and early > 0, f"no all-reduce started during a backward ({early} of {total} bytes)"
    assert overlapped(outs_off) == (0, total), "without overlap every sum starts after the backward, same bytes"
    # Gradients are views of the buffers summed (GradientSync.attach): nothing copied, on either path.
    assert copied(outs_on) == copied(outs_off) == 0
    a, b = states(outs_on), states(outs_off)
    assert a.keys() == b.keys()
    for key in a:
        for k in a[key]:
            assert torch.equal(a[key][k], b[key][k]), (key, k)
    tolerance = 1e-6 if "float32" in name else 1e-10  # float32 compute rounds the activations
    assert worst_against_reference(outs_on, on, STEPS) < tolerance
    assert [r.loss for r in outs_on[0]["results"]] == [r.loss for r in outs_off[0]["results"]]


def test_overlapped_sums_survive_a_lost_node_and_equal_the_reference(tmp_path):
    """Three pipelines lose the one-stage one: the survivors re-form (new groups, new chunks) and the
    overlapped sums go on equal to the reference."""
    j = job(True)
    before = ExecutionPlan.even(10, [2, 3, 1], [3, 3, 2], j.training.microbatch_size)  # ranks 0-1 | 2-4 | 5
    after = ExecutionPlan(
        (
            PipelineLayout((StageLayout(0, 0, 5), StageLayout(1, 5, 10)), 4),
            PipelineLayout((StageLayout(2, 0, 4), StageLayout(3, 4, 7), StageLayout(4, 7, 10)), 4),
        ),
        10,
        2,
    )
    outs = run_local(j, before, 2, tmp_path, phases=[Phase(after, 2, {r: r for r in range(5)})])
    early, total = overlapped(outs)
    assert early > 0 and total > early
    assert copied(outs) == 0, "the new generation's chunks sum their own buffers too"
    assert worst_against_reference(outs, j, 4) < 1e-10
