"""What the engine does on a GPU for speed, checked without one, in one real gloo process.

- It packs the next microbatch while the device runs this one (``StageEngine.prefetch``). No GPU
  here: the same code path is forced on the CPU and must change nothing but when a microbatch is
  packed (float64, the same losses and parameters bit for bit).
- It waits for the device (``.item()``, ``.cpu()``, ``.tolist()``, ``bool(tensor)``) a fixed number
  of times a step, never once per microbatch: counted on the CPU, where every such call is visible
  to a ``TorchFunctionMode``, and compared between 4 and 16 microbatches.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import sys
import warnings
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

import oobleck_mm

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
    engine._batch = lambda mb, piece=0: (
        order.append(("pack", mb)) if (mb, piece) not in engine._batches else None,
        pack(mb, piece),
    )[1]
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


def join_one_rank(tmp_path, backend: str) -> None:
    wait = timedelta(seconds=60)
    join_generation(
        dist.FileStore(str(tmp_path / "store"), 1), 0, 0, 1, backend, collective_timeout=wait, arrival_timeout=wait
    )


@pytest.fixture
def one_rank(tmp_path):
    """A real one-rank gloo group (what a one-stage, one-pipeline plan trains in)."""
    join_one_rank(tmp_path, "gloo")
    yield
    leave_group()


needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA device (the CPU suite checks the same with prefetch forced on the CPU)",
)


def test_prefetching_the_next_microbatch_changes_when_it_is_packed_and_nothing_else(one_rank):
    job = tiny_job()
    assert not StageEngine(job, ExecutionPlan.even(10, [1], [8], 2), 0).prefetch  # CPU: off by default
    plain_losses, plain_params, plain_order = run(job, prefetch=False)
    losses, params, order = run(job, prefetch=True)
    assert losses == plain_losses
    for i in plain_params:
        assert all(torch.equal(a, b) for a, b in zip(params[i], plain_params[i])), i
    first = order[: order.index(("forward done", 7)) + 1]  # the first step's
    # Without prefetch microbatch k + 1 is packed after k's forward, when its own is due; with it,
    # k's forward packs k + 1 before it returns (on a GPU: while k's kernels run).
    for k in range(7):
        assert plain_order.index(("pack", k + 1)) > plain_order.index(("forward done", k)), plain_order
        assert first.index(("pack", k + 1)) < first.index(("forward done", k)), first


# Calls that make the host wait for a device tensor's value (on a GPU: a stream synchronisation).
HOST_WAITS = {
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.cpu,
    torch.Tensor.numpy,
    torch.Tensor.__bool__,
    torch.Tensor.__float__,
    torch.Tensor.__int__,
    torch.Tensor.__index__,
}
PACKAGE = os.path.dirname(oobleck_mm.__file__) + os.sep
# Where the device's tensors are used: the runtime and the model. (``data/`` works on the host by
# design: it packs microbatches, and their spans, before one asynchronous copy to the device.)
DEVICE_CODE = tuple(PACKAGE + d + os.sep for d in ("runtime", "model"))


class HostWaits(TorchFunctionMode):
    """Counts host waits by the package's line that asked (file, line, call): the innermost frame of
    ``oobleck_mm`` (torch's own frames, e.g. the optimizer's, count for the line that called them)."""

    def __init__(self):
        super().__init__()
        self.sites: collections.Counter = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in HOST_WAITS:
            frame = sys._getframe(1)
            while frame is not None and not frame.f_code.co_filename.startswith(PACKAGE):
                frame = frame.f_back
            if frame is not None and frame.f_code.co_filename.startswith(DEVICE_CODE):
                self.sites[(os.path.basename(frame.f_code.co_filename), frame.f_lineno, func.__name__)] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_the_engine_waits_for_the_device_per_step_not_per_microbatch(one_rank, dtype):
    """The same global batch as 4 microbatches of 4 and as 16 of 1: the same host waits, at the same lines.

    float16 adds the loss scaler's overflow check (it must ride on the step's one norm all-reduce)."""
    job = tiny_job(dtype)
    waits = {}
    for count, size in ((4, 4), (16, 1)):
        sized = dataclasses.replace(job, training=dataclasses.replace(job.training, microbatch_size=size))
        engine = StageEngine(sized, ExecutionPlan.even(10, [1], [count], size), 0)
        engine.train_step(0)  # the optimizers' state is created in the first step
        with HostWaits() as counter:
            engine.train_step(1)
        waits[count] = counter.sites
    assert waits[16] == waits[4], f"host waits that grow with the microbatches: {waits[16] - waits[4]}"
    # Guard the guard: the counter sees the step's one read of the all-reduced norm and loss.
    assert any(site[0] == "grad_sync.py" for site in waits[4]), waits[4]


@needs_cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_on_one_gpu_the_engine_synchronises_per_step_not_per_microbatch(tmp_path, dtype):
    """One GPU, NCCL: the same check with the device's own word for it (``torch.cuda.set_sync_debug_mode``
    warns at every operation that waits for the GPU), prefetch on, and the same loss as the CPU.

        .venv/bin/python -m pytest tests/integration/test_engine_prefetch.py   # on a machine with a GPU
    """
    from oobleck_mm.runtime.worker import device_for

    job = tiny_job(dtype)
    job = dataclasses.replace(
        job, cluster=dataclasses.replace(job.cluster, device="cuda", accelerator="h100", backend="auto")
    )
    device = device_for(job, 0)  # torch.cuda.set_device(0), before NCCL binds to it
    join_one_rank(tmp_path, job.cluster.resolved_backend)
    try:
        waits, losses = {}, {}
        for count, size in ((4, 4), (16, 1)):
            sized = dataclasses.replace(job, training=dataclasses.replace(job.training, microbatch_size=size))
            engine = StageEngine(sized, ExecutionPlan.even(10, [1], [count], size), 0, device=device)
            assert engine.prefetch and all(p.device == device for m in engine.layers.values() for p in m.parameters())
            losses[count] = [engine.train_step(0).loss]
            torch.cuda.set_sync_debug_mode("warn")
            try:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    losses[count].append(engine.train_step(1).loss)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            waits[count] = collections.Counter((w.filename, w.lineno) for w in caught if "synchroniz" in str(w.message))
    finally:
        leave_group()
    assert waits[16] == waits[4], f"synchronisations that grow with the microbatches: {waits[16] - waits[4]}"
    cpu = tiny_job(dtype)  # the reference on the CPU, with the GPU run's microbatches of 4
    cpu = dataclasses.replace(cpu, training=dataclasses.replace(cpu.training, microbatch_size=4))
    from oobleck_mm.runtime.reference import ReferenceTrainer

    reference = [loss for _, loss in ReferenceTrainer(cpu).train(2)]
    assert losses[4] == pytest.approx(reference, abs=1e-3 if dtype == "bfloat16" else 1e-4)
