"""What the master sends each worker of a generation: one ``Assignment`` per (node, GPU).

Pure: the generation, its base and the job's options in, protobuf messages
out. Every worker of a generation gets the same plan, base plan,
``previous_ranks`` and ``rank_nodes``, so every rank derives the same
layer-state transfers (``planning.transfers.rank_transfers``).
"""

from __future__ import annotations

from dataclasses import dataclass

from master.recovery import GenerationView
from oobleck_mm.planning.layout import Gpu
from oobleck_mm.protocol import oobleck_pb2 as pb
from oobleck_mm.protocol.convert import plan_to_proto


@dataclass(frozen=True, slots=True)
class Sending:
    """Job-wide fields of every assignment."""

    store_host: str
    store_port: int
    steps: int
    save_final_dir: str = ""
    checkpoint_interval: int = 0
    """A periodic checkpoint every K steps (0: never)."""
    checkpoint_dir: str = ""
    checkpoint_async: bool = False
    """Live mode: workers snapshot and write in the background; restart mode: at a barrier."""


def build_assignments(
    gen: GenerationView,
    sending: Sending,
    *,
    start_step: int,
    base: GenerationView | None = None,
    previous_ranks: list[int] | None = None,
    resume_dir: str = "",
    at_boundary: bool = False,
    checkpoint_after_first_step: bool = False,
) -> list[tuple[Gpu, pb.Assignment]]:
    """(node, gpu) -> Assignment of ``gen``, in rank order.

    ``base`` and ``previous_ranks`` make it a reconfiguration (survivors keep
    their states); without them the workers start afresh, from ``resume_dir``
    when given. ``at_boundary``: the ranks it drops left on notice and finish the
    iteration in flight, so the workers switch at the boundary. ``checkpoint_after_first_step``: a
    periodic checkpoint was cut short by the loss ``gen`` recovers from: take the next one at once.
    """
    plan_msg = plan_to_proto(gen.layout)
    rank_nodes = gen.rank_nodes
    base_msg = plan_to_proto(base.layout) if base is not None else None
    out = []
    for gpu, rank in sorted(gen.ranks.items(), key=lambda kv: kv[1]):
        a = pb.Assignment(
            generation=gen.number, rank=rank, world_size=gen.layout.world_size, store_host=sending.store_host,
            store_port=sending.store_port, start_step=start_step, steps=sending.steps, plan=plan_msg,
            resume_dir=resume_dir, save_final_dir=sending.save_final_dir,
            checkpoint_interval=sending.checkpoint_interval, checkpoint_dir=sending.checkpoint_dir,
            checkpoint_async=sending.checkpoint_async, rank_nodes=rank_nodes,
            checkpoint_after_first_step=checkpoint_after_first_step,
        )  # fmt: skip
        if base is not None:
            assert previous_ranks is not None and len(previous_ranks) == gen.layout.world_size
            a.previous_generation = base.number
            a.previous_plan.CopyFrom(base_msg)
            a.previous_ranks.extend(previous_ranks)
            a.at_boundary = at_boundary
        out.append((gpu, a))
    return out
