"""The master's node registry: who is registered, under which session, and what each node's agent said.

Part of the job's state (``oobleck_mm.master.state``): the machine (``oobleck_mm.master.machine``)
owns the decisions (who is lost, what to plan); this module only keeps the
facts it decides on: a node's session, its event-stream state, its last
heartbeat and a reported worker failure. Plain data, no I/O: the outboxes the
Subscribe streams drain live in the shell (``oobleck_mm.master.coordinator``), and the
session number comes in with the registration event. Calls that name an
unknown node or a stale session are refused (``Refused`` carries the gRPC
status name), so a node declared lost cannot act under its old registration.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

from oobleck_mm.master.detector import NodeHealth

NODE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


class Refused(Exception):
    """A call the master rejects; ``code`` names the gRPC status (``INVALID_ARGUMENT``, ``NOT_FOUND``...)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(slots=True)
class Node:
    name: str
    session: int
    gpus: int
    order: int
    """Registration order: live nodes are planned in it."""
    last_heartbeat: float
    stream: str = "pending"
    """pending (not subscribed yet) | open | closed."""
    closing: bool = False
    """The master ended the stream itself (shutdown, declared lost): its end is no failure."""
    worker_failure: str | None = None
    detail: str = ""
    leaving: str = ""
    """Why the node leaves on notice (a preemption): planned out while it still holds its state."""
    dismissed: bool = False
    """Planned out after its notice and sent its Shutdown: its silence and hang-up are no failure."""
    adopt_generation: int = 0
    """The generation its workers ran when it registered again with a restarted master (0: a new agent)."""
    ready: set[int] = field(default_factory=set)
    """Local ranks whose worker reported ``WorkerReady`` (started, imported, warmed up)."""
    registered_at: float = 0.0
    """The master's clock when this registration came."""

    @property
    def all_ready(self) -> bool:
        """Every worker of the node can join a generation at once: a joining node is admitted then."""
        return len(self.ready) >= self.gpus

    def health(self) -> NodeHealth:
        closed = self.stream == "closed" and not self.closing
        return NodeHealth(self.last_heartbeat, closed, self.worker_failure, self.detail)

    def end_stream(self) -> None:
        """The master hangs up on this node (a shutdown, or the node was declared lost): its end is no failure."""
        self.closing = True


class Registry:
    """Live nodes by name; a node leaves it when it is declared lost."""

    def __init__(self) -> None:
        self.nodes: dict[str, Node] = {}
        self._registrations = 0

    def check_new(self, node: str, gpus: int, gpus_per_node: int) -> None:
        """Raises ``Refused`` if ``node`` cannot register (a bad name, a GPU count the job does not run, taken)."""
        if not NODE_NAME.match(node):
            raise Refused("INVALID_ARGUMENT", f"node name {node!r} must match {NODE_NAME.pattern}")
        if gpus not in (0, gpus_per_node):
            raise Refused(
                "INVALID_ARGUMENT",
                f"node {node} offers {gpus} GPUs; this job runs cluster.gpus_per_node = {gpus_per_node} per node",
            )
        if node in self.nodes:
            raise Refused("ALREADY_EXISTS", f"node name {node!r} is already registered")

    def add(self, node: str, session: int, gpus: int, now: float) -> Node:
        entry = Node(node, session, gpus, self._registrations, now, registered_at=now)
        self._registrations += 1
        self.nodes[node] = entry
        return entry

    def live(self, node: str, session: int) -> Node:
        """The node's entry if ``session`` is its current registration; else ``Refused(NOT_FOUND)``."""
        entry = self.nodes.get(node)
        if entry is None or entry.session != session:
            raise Refused("NOT_FOUND", f"node {node} (session {session}) is not registered; it may have been lost")
        return entry

    def names(self) -> list[str]:
        """Nodes that can take part in the next plan (stream open, no notice to leave), in registration order."""
        return [
            n.name for n in sorted(self.nodes.values(), key=lambda n: n.order) if n.stream == "open" and not n.leaving
        ]

    def leaving(self) -> list[str]:
        """Nodes that gave notice, are not dismissed yet and can still hand over their state."""
        return [
            n.name
            for n in sorted(self.nodes.values(), key=lambda n: n.order)
            if n.stream == "open" and n.leaving and not n.dismissed
        ]

    def health(self) -> dict[str, NodeHealth]:
        """Every node the detector watches: a dismissed one owes the job nothing."""
        return {name: n.health() for name, n in self.nodes.items() if not n.dismissed}

    def forgive(self, gap: float, now: float) -> None:
        """Move every heartbeat ``gap`` seconds later (never past ``now``): the master, not the nodes, was silent."""
        for entry in self.nodes.values():
            entry.last_heartbeat = min(now, entry.last_heartbeat + gap)

    def pop(self, node: str) -> Node:
        return self.nodes.pop(node)

    def any_stream_open(self) -> bool:
        return any(n.stream == "open" for n in self.nodes.values())


REFUSALS_LOGGED_PER_PEER = 5
"""Refused calls of one peer host that are logged one by one; later ones only at powers of ten."""
PEERS_REMEMBERED = 1024
"""Peer hosts whose refusal counts are kept (least recently refused forgotten first)."""


class RefusalCounter:
    """Decides which refused calls reach the log: a client retrying a wrong token must not fill the disk."""

    def __init__(self) -> None:
        self._counts: OrderedDict[str, int] = OrderedDict()
        self._lock = threading.Lock()  # the token check calls it from gRPC's handler threads

    def count(self, peer: str) -> tuple[int, bool]:
        """(refusals of ``peer``'s host so far, whether to log this one)."""
        host = peer_host(peer)
        with self._lock:
            n = self._counts.pop(host, 0) + 1
            self._counts[host] = n
            while len(self._counts) > PEERS_REMEMBERED:
                self._counts.popitem(last=False)
        return n, n <= REFUSALS_LOGGED_PER_PEER or _power_of_ten(n)


def peer_host(peer: str) -> str:
    """gRPC's ``ipv4:10.0.0.1:53412`` -> ``ipv4:10.0.0.1`` (a reconnecting client gets a new port)."""
    head, sep, port = peer.rpartition(":")
    return head if sep and port.isdigit() else peer


def _power_of_ten(n: int) -> bool:
    while n % 10 == 0 and n > 1:
        n //= 10
    return n == 1
