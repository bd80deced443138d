"""The control-plane protocol: ``oobleck.proto`` and the typed messages generated from it.

``oobleck_pb2`` / ``oobleck_pb2_grpc`` are generated (``oobleck_mm/protocol/regen.sh``)
and committed; ``convert`` translates between them and the runtime's dataclasses;
``auth`` holds the per-job token that every gRPC call carries; ``pipe`` frames
the protobuf messages an agent and its workers exchange over a local pipe.
"""

from oobleck_mm.protocol import oobleck_pb2 as pb

MAX_MESSAGE_BYTES = 256 * 2**20
"""The largest control-plane message either side accepts (gRPC's default is 4 MiB). Raised on purpose: the
job's config travels in ``RegisterReply.config_yaml``, and one with a million ``data.excluded_samples``
(which ``--skip-bad-samples`` fills) is about 9 MiB; a master refuses to start with a config past this."""
MESSAGE_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
"""gRPC channel and server options carrying ``MAX_MESSAGE_BYTES``."""

__all__ = ["MAX_MESSAGE_BYTES", "MESSAGE_OPTIONS", "pb"]
