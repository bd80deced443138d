"""The job's per-layer costs from the source its config names (``planning.profile``).

``analytical``: the roofline model of ``profiling.analytical`` (no hardware);
``measured``: the job's own layers timed on this machine (``measure_model``,
imported only then: it needs torch). Planning takes the result as an argument,
so it stays pure.
"""

from __future__ import annotations

from collections.abc import Callable

from oobleck_mm.planning.costs import ModelProfile
from oobleck_mm.profiling.analytical import profile_from_config


def load_profile(job, progress: Callable[[str], None] | None = None) -> ModelProfile:
    """Per-layer costs for the job: the analytical model, or the job's own layers timed on this machine."""
    if job.planning.profile == "measured":
        from oobleck_mm.profiling.measure_model import measure_job_profile  # torch: only when measuring

        return measure_job_profile(job, progress)
    return profile_from_config(job)
