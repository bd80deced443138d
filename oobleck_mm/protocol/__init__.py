"""The control-plane protocol: ``oobleck.proto`` and the typed messages generated from it.

``oobleck_pb2`` / ``oobleck_pb2_grpc`` are generated (``oobleck_mm/protocol/regen.sh``)
and committed; ``convert`` translates between them and the runtime's dataclasses;
``auth`` holds the per-job token that every gRPC call carries; ``pipe`` frames
the protobuf messages an agent and its workers exchange over a local pipe.
"""

from oobleck_mm.protocol import oobleck_pb2 as pb

__all__ = ["pb"]
