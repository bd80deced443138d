"""The run dir: where a run keeps its event log, token, journal and checkpoints, and whether a master that
ran there died mid-job (``running_job``: the launcher's restart asks it).

Its own module because ``oobleck-launch local`` needs just this of the master: importing the master's
server and journal (the coordinator, the planner's modules, numpy, grpc) cost each launcher ~0.5 CPU-s
on a 2-core machine."""

from __future__ import annotations

import json
import os
import time

from oobleck_mm.errors import UserError

JOURNAL_FILE = "master-journal.json"
"""The master's journal (``master.journal``), in the run dir."""


def default_run_dir(job_name: str) -> str:
    return os.path.join("runs", f"{job_name}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")


def make_run_dir(path: str) -> None:
    if os.path.exists(path) and not os.path.isdir(path):
        raise UserError(f"--run-dir: {path!r} is a file; give a folder (created if missing)")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise UserError(f"--run-dir: cannot create {path!r}: {exc.strerror}") from None


def running_job(run_dir: str) -> int | None:
    """The generation of the job a master ran in ``run_dir`` and never ended (it died), else None."""
    try:
        with open(os.path.join(run_dir, JOURNAL_FILE), encoding="utf-8") as fh:
            record = json.load(fh)
    except (OSError, ValueError):
        return None
    return None if "ended" in record else int(record.get("generation", 0)) or None
