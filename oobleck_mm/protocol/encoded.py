"""A control-plane message sent in parts that were serialized once: the shared plan of a generation.

Every worker of a generation gets the same plan, base plan, ``previous_ranks`` and
``rank_nodes`` (``oobleck_mm/master/assignments.py``): at 4,000 single-GPU nodes about 180 KB that
differs between two workers only in its ``rank`` and ``local_rank``. Built as one message
per worker, the master copied it into 4,000 protobuf objects (each ``Assignment`` into its
``AgentEvent`` again) on its control thread, which stalled for 13-22 s at every plan
(``docs/benchmarks.md``). Protobuf's wire format merges concatenated messages field by
field (a singular field: the last one wins; a sub-message: merged; a repeated field:
appended), so the shared part is serialized once and each worker's event is that part
followed by a few bytes of its own. The agent parses one ordinary message.

Nothing in protobuf's Python API shares a serialized sub-message between messages, hence
this small class; gRPC's serializer only calls ``SerializeToString``.
"""

from __future__ import annotations

from dataclasses import dataclass

from oobleck_mm.protocol import oobleck_pb2 as pb


@dataclass(frozen=True, slots=True)
class EncodedEvent:
    """An ``AgentEvent`` in wire form: the concatenation of ``parts``, each a serialized ``AgentEvent``.

    Correct only where no two parts set the same repeated field (those would be appended); the
    caller keeps what differs per worker out of the shared part."""

    parts: tuple[bytes, ...]

    def SerializeToString(self) -> bytes:  # noqa: N802 (protobuf's name: gRPC's serializer calls it)
        return b"".join(self.parts)

    def decoded(self) -> pb.AgentEvent:
        return pb.AgentEvent.FromString(self.SerializeToString())


def serialize_event(event: pb.AgentEvent | EncodedEvent) -> bytes:
    """gRPC's response serializer for the event stream: a message or one already encoded."""
    return event.SerializeToString()
