"""The worker's end of the agent's pipe: commands read in a thread, so training can poll between iterations."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

from oobleck_mm.protocol.pipe import recv_command
from oobleck_mm.runtime.worker_machine import drops_peers

log = logging.getLogger(__name__)

NOT_ARRIVED = object()
"""``CommandReader.get_within`` timed out."""


class CommandReader:
    """Reads the agent's pipe in a thread so training can poll for commands between iterations."""

    def __init__(self, conn, on_arrival: Callable[[Any], Any] | None = None):
        """``on_arrival(command)``: called as each command arrives (before it is queued); what it
        returns for a command, if not None, is something being prepared for it in the background
        (``PreparedGroup``): until it is ready the command does not count as ``waiting``."""
        self.conn = conn
        self.on_arrival = on_arrival
        self.preparing: dict[int, Any] = {}
        """id(command) -> what ``on_arrival`` prepares for it, while the command is queued."""
        self._handed: tuple[Any, Any] = (None, None)
        """The command taken last from the queue and what was prepared for it (``prepared_for``)."""
        self.queue: queue.Queue = queue.Queue()
        self.replanned = threading.Event()
        """Set when a queued command means a peer is gone: waits on collectives give up at once."""
        threading.Thread(target=self._run, daemon=True, name="commands").start()

    def _run(self) -> None:
        while True:
            try:
                command = recv_command(self.conn)
            except (EOFError, OSError):
                self.queue.put(None)  # the agent is gone
                self.replanned.set()
                return
            if self.on_arrival is not None:
                try:
                    prepared = self.on_arrival(command)
                except Exception:  # noqa: BLE001 - only an optimisation: the switch forms the groups then
                    log.exception("could not start forming the next generation's groups ahead")
                    prepared = None
                if prepared is not None:
                    self.preparing[id(command)] = prepared
            self.queue.put(command)  # before the flag: get() clears it only once the queue is empty
            if drops_peers(command):
                self.replanned.set()

    def get(self):
        command = self.queue.get()
        if self.queue.empty():
            self.replanned.clear()
        return self._taken(command)

    def poll(self):
        try:
            command = self.queue.get_nowait()
        except queue.Empty:
            return None
        if self.queue.empty():
            self.replanned.clear()
        return self._taken(command)

    def _taken(self, command):
        # Out of ``preparing`` as it leaves the queue: an id is unique only among live objects.
        self._handed = (command, self.preparing.pop(id(command), None))
        return command

    def waiting(self) -> bool:
        """A command (or the agent's end) is queued, and ready to act on: a plan whose group is still
        being formed in the background waits for it (the old generation trains on meanwhile), unless
        another command came after it."""
        with self.queue.mutex:
            queued = list(self.queue.queue)
        if len(queued) != 1 or queued[0] is None:
            return bool(queued)
        prepared = self.preparing.get(id(queued[0]))
        return prepared is None or prepared.ready()

    def prepared_for(self, command):
        """What ``on_arrival`` prepared for ``command``, the command taken last (None: nothing), handed over once."""
        taken, prepared = self._handed
        if taken is not command:
            return None
        self._handed = (None, None)
        return prepared

    def get_within(self, seconds: float):
        """The next command, or ``NOT_ARRIVED`` after ``seconds``."""
        try:
            command = self.queue.get(timeout=seconds)
        except queue.Empty:
            return NOT_ARRIVED
        if self.queue.empty():
            self.replanned.clear()
        return self._taken(command)
