"""What the master sends each worker of a generation: one ``Assignment`` per (node, GPU).

Pure: the generation, its base and the job's options in, encoded events out.
Every worker of a generation gets the same plan, base plan, ``previous_ranks``
and ``rank_nodes``, so every rank derives the same layer-state transfers
(``planning.transfers.rank_transfers``). That shared part is serialized once
per generation and each worker's event is it plus its rank
(``oobleck_mm.protocol.encoded``): at 4,000 nodes, building 4,000 full
messages stalled the master for 13-22 s.
"""

from __future__ import annotations

from dataclasses import dataclass

from oobleck_mm.master.recovery import GenerationView
from oobleck_mm.planning.layout import Gpu
from oobleck_mm.protocol import oobleck_pb2 as pb
from oobleck_mm.protocol.convert import plan_to_proto
from oobleck_mm.protocol.encoded import EncodedEvent


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
    resume_chosen: bool = False,
    at_boundary: bool = False,
    checkpoint_after_first_step: bool = False,
) -> list[tuple[Gpu, int, EncodedEvent]]:
    """(node, gpu), rank and the ``AgentEvent`` carrying its ``WorkerAssignment``, for every worker of
    ``gen`` in rank order.

    ``base`` and ``previous_ranks`` make it a reconfiguration (survivors keep
    their states); without them the workers start afresh, from ``resume_dir``
    when given (``resume_chosen``: one of the run's own periodic checkpoints, not the user's
    ``--resume``). ``at_boundary``: the ranks it drops left on notice and finish the
    iteration in flight, so the workers switch at the boundary. ``checkpoint_after_first_step``: a
    periodic checkpoint was cut short by the loss ``gen`` recovers from: take the next one at once.
    """
    shared = pb.Assignment(
        generation=gen.number,
        world_size=gen.layout.world_size,
        store_host=sending.store_host,
        store_port=sending.store_port,
        start_step=start_step,
        steps=sending.steps,
        plan=plan_to_proto(gen.layout),
        resume_dir=resume_dir,
        resume_chosen=resume_chosen,
        save_final_dir=sending.save_final_dir,
        checkpoint_interval=sending.checkpoint_interval,
        checkpoint_dir=sending.checkpoint_dir,
        checkpoint_async=sending.checkpoint_async,
        rank_nodes=gen.rank_nodes,
        checkpoint_after_first_step=checkpoint_after_first_step,
    )
    if base is not None:
        if previous_ranks is None or len(previous_ranks) != gen.layout.world_size:
            raise ValueError(
                f"previous_ranks: expected one per rank of generation {gen.number} "
                f"({gen.layout.world_size}), got {previous_ranks!r}"
            )
        shared.previous_generation = base.number
        shared.previous_plan.CopyFrom(plan_to_proto(base.layout))
        shared.previous_ranks.extend(previous_ranks)
        shared.at_boundary = at_boundary
    # Only ``rank`` and ``local_rank`` differ per worker, and neither is set in the shared part.
    common = pb.AgentEvent(assignment=pb.WorkerAssignment(assignment=shared)).SerializeToString()
    out = []
    for gpu, rank in sorted(gen.ranks.items(), key=lambda kv: kv[1]):
        own = pb.AgentEvent(assignment=pb.WorkerAssignment(local_rank=gpu[1], assignment=pb.Assignment(rank=rank)))
        out.append((gpu, rank, EncodedEvent((common, own.SerializeToString()))))
    return out
