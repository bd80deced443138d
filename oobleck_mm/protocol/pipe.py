"""Agent <-> worker messages over a ``multiprocessing`` pipe: serialized protobuf bytes only.

The pipe never carries pickles, so a worker and its agent agree on nothing but
``oobleck.proto`` (the same rule as the network).
"""

from __future__ import annotations

from multiprocessing.connection import Connection

from oobleck_mm.protocol import oobleck_pb2 as pb


def send_command(conn: Connection, command: pb.WorkerCommand) -> None:
    conn.send_bytes(command.SerializeToString())


def recv_command(conn: Connection) -> pb.WorkerCommand:
    """Blocks for the next command; raises EOFError when the agent is gone."""
    return pb.WorkerCommand.FromString(conn.recv_bytes())


def send_report(conn: Connection, report: pb.WorkerReport) -> None:
    conn.send_bytes(report.SerializeToString())


def recv_report(conn: Connection) -> pb.WorkerReport:
    """The next report; raises EOFError when the worker is gone."""
    return pb.WorkerReport.FromString(conn.recv_bytes())
