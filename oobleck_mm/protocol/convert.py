"""Conversions between protocol messages and the runtime's plain dataclasses.

The runtime never touches protobuf types beyond these functions, so the wire
format can evolve in one place.
"""

from __future__ import annotations

from oobleck_mm.protocol import oobleck_pb2 as pb
from oobleck_mm.planning.layout import ExecutionPlan, PipelineLayout, StageLayout


def plan_to_proto(plan: ExecutionPlan) -> pb.ExecutionPlan:
    return pb.ExecutionPlan(
        num_layers=plan.num_layers,
        microbatch_size=plan.microbatch_size,
        pipelines=[
            pb.Pipeline(
                num_microbatches=p.num_microbatches,
                stages=[
                    pb.Stage(
                        rank=s.rank,
                        layer_start=s.layer_start,
                        layer_end=s.layer_end,
                        slowdown=s.slowdown,
                        shards=list(s.shards),
                        recompute=s.recompute,
                        context_parallel=s.context_parallel,
                    )
                    for s in p.stages
                ],
                branches=list(p.branches),
                merge=p.merge,
            )
            for p in plan.pipelines
        ],
    )


def plan_from_proto(msg: pb.ExecutionPlan) -> ExecutionPlan:
    """The plan a message carries; raises ValueError (from ``ExecutionPlan``) if it is inconsistent."""
    pipelines = tuple(
        PipelineLayout(
            tuple(
                StageLayout(
                    s.rank,
                    s.layer_start,
                    s.layer_end,
                    s.slowdown or 1.0,
                    tuple(s.shards),
                    s.recompute,
                    s.context_parallel,
                )
                for s in p.stages
            ),
            p.num_microbatches,
            tuple(p.branches),
            p.merge,
        )
        for p in msg.pipelines
    )
    return ExecutionPlan(pipelines, msg.num_layers, msg.microbatch_size)
