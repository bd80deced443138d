"""An emulated node's speed factor: how a straggler (``slow:NODE@...xF``) reaches its workers.

The fault injector writes ``<OOBLECK_EMULATE_DIR>/<node>.speed`` (``write_speed``;
the launcher sets the variable for its agents, their workers inherit it); a worker
reads it before each step (``SpeedFile``: one ``stat`` when unchanged) and multiplies
its compute deadlines by it. A file and not a control-plane message: the speed is a
property of the (emulated) hardware the harness injects, like the cgroup freezer of
a real-compute slowdown, not something the master decides.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

SPEED_DIR_ENV = "OOBLECK_EMULATE_DIR"
"""Where a launcher's fault injector writes the emulated nodes' speed factors (set for its agents and
inherited by their workers)."""


def write_speed(directory: str, node: str, factor: float) -> None:
    """Makes ``node``'s emulated device ``factor`` times slower (1: full speed), atomically."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"{node}.speed")
    with open(path + ".tmp", "w") as fh:
        fh.write(repr(float(factor)))
    os.replace(path + ".tmp", path)


class SpeedFile:
    """This node's speed factor as the injector last wrote it (1.0 without one)."""

    def __init__(self, node: str, directory: str | None = None) -> None:
        directory = directory if directory is not None else os.environ.get(SPEED_DIR_ENV)
        self.path = os.path.join(directory, f"{node}.speed") if directory else None
        self.factor = 1.0
        self._stamp: float | None = None

    def read(self) -> float:
        if self.path is None:
            return self.factor
        try:
            stamp = os.stat(self.path).st_mtime_ns
        except FileNotFoundError:
            self.factor, self._stamp = 1.0, None
            return self.factor
        if stamp != self._stamp:
            try:
                with open(self.path) as fh:
                    factor = float(fh.read())
            except (OSError, ValueError):  # mid-write elsewhere: keep the last value, read again next step
                return self.factor
            if factor != self.factor:
                log.warning("emulated device now %gx slower", factor)
            self.factor, self._stamp = factor, stamp
        return self.factor
