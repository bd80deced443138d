"""What a worker reports of one step (``pb.StepMetrics``): the master logs it (metrics.csv, TensorBoard, console)."""

from __future__ import annotations

import time

from oobleck_mm.planning.layout import ExecutionPlan
from oobleck_mm.protocol import oobleck_pb2 as pb
from oobleck_mm.runtime.engine import StageEngine
from oobleck_mm.runtime.timing import peak_memory_bytes


def step_metrics(a, plan: ExecutionPlan, engine: StageEngine, result) -> pb.StepMetrics:
    """What the master logs of one step on this rank (metrics.csv, TensorBoard, the console)."""
    predicted = engine.balancer.last_metrics if engine.balancer is not None else {}
    return pb.StepMetrics(
        generation=a.generation,
        step=result.step,
        rank=a.rank,
        loss=result.loss,
        samples_per_s=plan.global_batch / result.step_time_s,
        step_time_s=result.step_time_s,
        forward_s=result.forward_s,
        backward_s=result.backward_s,
        comm_s=result.comm_s,
        lr=result.lr,
        expected_compute_s=result.expected_compute_s,
        grad_norm=result.grad_norm,
        tokens=result.tokens,
        peak_memory_bytes=peak_memory_bytes(engine.device),
        pipeline_s=result.pipeline_s,
        skipped=result.skipped,
        loss_scale=result.loss_scale,
        predicted_max_s=predicted.get("predicted_max_s", 0.0),
        predicted_mean_s=predicted.get("predicted_mean_s", 0.0),
        predicted_contiguous_max_s=predicted.get("predicted_contiguous_max_s", 0.0),
        finished_at=time.time(),
        deferred=result.deferred,
        host_cpu_s=result.host_cpu_s,
        **_lateness_fields(result.lateness),
    )


def _lateness_fields(lateness) -> dict:
    """An emulated step's ``emulation.clock.Lateness`` as ``StepMetrics`` fields (none when not emulated)."""
    if lateness is None:
        return {}
    return dict(
        emulated_ops=lateness.ops,
        emulated_late_ops=lateness.late_ops,
        emulated_worst_lateness=lateness.worst,
        emulated_s=lateness.emulated_s,
        emulated_late_s=lateness.late_s,
    )
