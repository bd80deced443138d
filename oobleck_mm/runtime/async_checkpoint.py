"""Periodic checkpoints in live mode that training does not wait for.

At an iteration boundary every worker copies the layers it *owns*
(``ExecutionPlan.checkpoint_owner``: one replica per layer, the replicas taking
turns so every worker copies a share) to host memory: parameters, optimizer moments and the loss scaler. That
copy is the only work on the training thread. A background thread then writes
one file per layer (a temporary file, fsync, rename, as ``save_layers`` does)
and reports ``CheckpointDone`` with the generation; the master writes
``meta.json`` once every rank of that generation reported, which is what makes
the checkpoint complete (``oobleck_mm/master/policies.py``). No process group is involved:
a failure while files are written costs that checkpoint, never the training.

Why not ``torch.distributed.checkpoint``: its save plans collectively over the
process group (a gather of every rank's plan to a coordinator, a scatter back,
and a barrier around the metadata), and its async save keeps using that group
while the write proceeds. This engine tears its group down at every failure and
join, which is exactly when a checkpoint may be in flight; a save here must not
depend on any peer. Its resharding on load is not needed either: a layer is the
unit of placement, and every layout reads whole layer files (``load_layer``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from oobleck_mm.runtime.checkpoint import layer_payload, write_error, write_layer_file
from oobleck_mm.runtime.hold import hold

log = logging.getLogger(__name__)


class AsyncCheckpointer:
    """One background writer per worker; a snapshot while the previous write runs is skipped."""

    def __init__(
        self,
        on_written: Callable[[str, int, int, int, float], None],
        on_failed: Callable[[str, int, int, str], None] | None = None,
        node: str = "",
    ) -> None:
        """``node``: this worker's, for the ``checkpoint`` hold point (after the files, before the report)."""
        self.node = node
        self.on_written = on_written
        """``(directory, step, layers, generation, write seconds)`` once this worker's files are on disk."""
        self.on_failed = on_failed
        """``(directory, step, generation, error)`` when a write failed (a full disk): the master says so."""
        self._thread: threading.Thread | None = None
        self.snapshot_s = 0.0
        """Seconds the latest snapshot held the training thread."""

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def save(
        self,
        directory: str,
        held: Mapping,
        owned: list[int],
        specs,
        step: int,
        generation: int,
        shared: dict | None = None,
    ) -> bool:
        """Snapshot ``owned`` layers now and write them in the background; False if still writing the last."""
        if self.busy:
            log.warning("checkpoint of step %d skipped: the previous one is still being written", step)
            return False
        start = time.perf_counter()
        payloads = {specs[i].name: layer_payload(held[i], shared, copy=True) for i in owned}
        self.snapshot_s = time.perf_counter() - start
        self._thread = threading.Thread(
            target=self._write, args=(directory, payloads, step, generation), name=f"checkpoint-{step}", daemon=True
        )
        self._thread.start()
        return True

    def _write(self, directory: str, payloads: dict[str, dict], step: int, generation: int) -> None:
        start = time.perf_counter()
        try:
            for name, payload in payloads.items():
                write_layer_file(Path(directory), name, payload)
        except (OSError, RuntimeError) as exc:  # a full disk (torch's writer may wrap it): this checkpoint is lost
            error = write_error(exc, directory)
            log.error("checkpoint of step %d: %s; training continues without it", step, error)
            if self.on_failed is not None:
                self.on_failed(directory, step, generation, error)
            return
        seconds = time.perf_counter() - start
        hold("checkpoint", self.node)  # a writer lost here cuts the checkpoint short (tests, @phase:checkpoint)
        self.on_written(directory, step, len(payloads), generation, seconds)

    def wait(self, timeout: float | None = None) -> bool:
        """Waits for the write in flight (before the process exits); True if none is left."""
        if self._thread is not None:
            self._thread.join(timeout)
        return not self.busy
