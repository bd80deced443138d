"""On a GPU the engine packs the next microbatch while the device runs this one (``StageEngine.prefetch``).

No GPU here: the same code path is forced on the CPU, in one real gloo process, and must change
nothing but when a microbatch is packed (float64, the same losses and parameters bit for bit).
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from oobleck_mm.planning.layout import ExecutionPlan
from oobleck_mm.runtime.engine import StageEngine
from oobleck_mm.runtime.group import join_generation, leave_group
from test_runtime_equivalence import tiny_job

pytestmark = pytest.mark.integration


def run(job, prefetch: bool, steps: int = 3):
    engine = StageEngine(job, ExecutionPlan.even(10, [1], [8], job.training.microbatch_size), 0)
    engine.prefetch = prefetch
    order = []  # ("pack", mb) and ("forward done", mb) as they happen
    pack, forward = engine._batch, engine._dispatch
    engine._batch = lambda mb: (order.append(("pack", mb)) if mb not in engine._batches else None, pack(mb))[1]
    forward_handler = forward[next(t for t in forward if t.__name__ == "ForwardPass")]

    def traced_forward(ins):
        mb = engine._next_forward
        forward_handler(ins)
        order.append(("forward done", mb))

    forward[next(t for t in forward if t.__name__ == "ForwardPass")] = traced_forward
    results = [engine.train_step(step) for step in range(steps)]
    # The stage's 1F1B time is on the device's clock (CUDA events on a GPU), read at the step's end.
    assert all(0 < r.pipeline_s <= r.step_time_s for r in results), [(r.pipeline_s, r.step_time_s) for r in results]
    losses = [r.loss for r in results]
    params = {i: [p.detach().clone() for p in m.parameters()] for i, m in engine.layers.items()}
    return losses, params, order


def test_prefetching_the_next_microbatch_changes_when_it_is_packed_and_nothing_else(tmp_path):
    wait = timedelta(seconds=60)
    join_generation(dist.FileStore(str(tmp_path / "store"), 1), 0, 0, 1, "gloo", collective_timeout=wait,
                    arrival_timeout=wait)  # fmt: skip
    try:
        job = tiny_job()
        assert not StageEngine(job, ExecutionPlan.even(10, [1], [8], 2), 0).prefetch  # CPU: off by default
        plain_losses, plain_params, plain_order = run(job, prefetch=False)
        losses, params, order = run(job, prefetch=True)
    finally:
        leave_group()
    assert losses == plain_losses
    for i in plain_params:
        assert all(torch.equal(a, b) for a, b in zip(params[i], plain_params[i])), i
    first = order[: order.index(("forward done", 7)) + 1]  # the first step's
    # Without prefetch microbatch k + 1 is packed after k's forward, when its own is due; with it,
    # k's forward packs k + 1 before it returns (on a GPU: while k's kernels run).
    for k in range(7):
        assert plain_order.index(("pack", k + 1)) > plain_order.index(("forward done", k)), plain_order
        assert first.index(("pack", k + 1)) < first.index(("forward done", k)), first
