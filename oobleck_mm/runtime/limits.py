"""What the runtime can run, checked before any process starts (``oobleck-launch master`` and ``local``).

``plan`` plans what the dissertation's setups describe (stages of up to 8 GPUs);
the engine trains such stages, but recovery and checkpoints handle one GPU per stage. A job the workers would refuse after
minutes of start-up is refused here instead, naming the field and what to set.
"""

from __future__ import annotations

import torch

from oobleck_mm.errors import UserError


def check_runnable(job, workers_here: bool) -> None:
    """``workers_here``: the workers run on this machine (``local``), so its GPUs can be counted."""
    c = job.cluster
    if c.max_gpus_per_stage > 1:
        raise UserError(
            f"cluster.max_gpus_per_stage: {c.max_gpus_per_stage}, but recovery and checkpoints handle one GPU per "
            "pipeline stage only (the engine trains wider stages, docs/runtime.md); set it to 1 to train this job "
            "(plan still plans with it)"
        )
    if workers_here and c.device == "cuda":
        needed = c.gpus_per_node
        if torch.cuda.device_count() < needed:
            raise UserError(
                f"cluster.device: 'cuda' with cluster.gpus_per_node {needed}, but this machine's torch sees "
                f"{torch.cuda.device_count()} GPU(s); set cluster.device: cpu to run the job on the cpu"
            )
