"""Worker entry points that break on purpose (``--worker-target tests.e2e.broken_worker:NAME``).

Each wraps the real worker and makes the engine fail at one step in one way, so
the e2e tests can check how the job ends. The out-of-memory case raises torch's
own ``OutOfMemoryError`` (what a GPU raises): this machine has no GPU to exhaust,
and exhausting its shared host memory would hurt everything else running on it.
"""

from __future__ import annotations

import torch

from oobleck_mm.runtime import agent_worker
from oobleck_mm.runtime.engine import StageEngine

FAIL_AT_STEP = 2


def _breaking(error_factory):
    original = StageEngine.train_step

    def train_step(self, step: int):
        if step == FAIL_AT_STEP and self.rank == 0:
            raise error_factory()
        return original(self, step)

    StageEngine.train_step = train_step


def bug(conn, config_path: str, node: str, local_rank: int) -> None:
    _breaking(lambda: KeyError("a missing key in the engine"))
    agent_worker.worker_main(conn, config_path, node, local_rank)


def out_of_memory(conn, config_path: str, node: str, local_rank: int) -> None:
    _breaking(lambda: torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    agent_worker.worker_main(conn, config_path, node, local_rank)
