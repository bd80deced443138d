"""The master's journal: what a restarted master needs to re-adopt the running job (``--resume-master``).

The workers hold the job's state (layers, optimizer, sampler position) and train
on without a master: only the generation's plan lives in the master alone. So
the master writes, before it sends a generation's assignments (write-ahead: no
worker ever runs a generation the journal does not name), the job config it
resolved, its run options and address, the generations whose states workers
may still hold, and the planning ``Plan`` the next reconfiguration starts
from. ``oobleck-launch master --resume-master RUN_DIR`` reads it back, listens
on the same address, and the agents, which keep retrying, register again
naming the generation they run (``RegisterRequest.adopt_generation``).

The step is not journaled: the agents replay their workers' latest reports
(``WorkerReportRequest.replayed``), which say it, and every step trained while
no master ran.

One file in the run dir, ``master-journal.json``, owner-only (0600): data, never
code. Run dirs live on shared storage (NFS, a ReadWriteMany volume), so the
journal is JSON all through, the planning ``Plan`` included
(``planning.plan.plan_to_dict``): a file planted there can at worst be refused
(exit 2 naming it), never run. Version 1 journals named a pickled plan beside
them; this master refuses them rather than unpickle.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from typing import Any

from oobleck_mm.master.recovery import GenerationView
from oobleck_mm.errors import UserError
from oobleck_mm.planning.layout import ExecutionPlan
from oobleck_mm.planning.plan import plan_from_dict, plan_to_dict
from oobleck_mm.master.run_dir import JOURNAL_FILE

VERSION = 2
"""2: the plan inside the JSON (1 named a pickle beside it: refused, never unpickled)."""
KEEP_GENERATIONS = 3
"""Generations journaled: the current one and the two before it (a worker may still hold the one it
came from while a recovery is under way: ``oobleck_mm.master.recovery``'s *base*)."""


@dataclass(frozen=True, slots=True)
class Journal:
    config_yaml: str
    """The job as the first master resolved it (overrides applied, absolute paths)."""
    host: str
    port: int
    options: dict[str, Any]
    """``oobleck_mm.master.coordinator.RunOptions`` as a dict."""
    generation: int
    template_nodes: int
    views: tuple[GenerationView, ...]
    """The journaled generations, oldest first; the last is ``generation``."""
    plan: Any
    """The planning ``Plan`` of ``generation`` (the next reconfiguration starts from it)."""
    last_checkpoint: tuple[str, int] | None = None
    """(directory, step) of the newest complete periodic checkpoint."""
    pin: tuple[int, str, int] | None = None
    """``JobState.pin``: the checkpoint a generation that starts afresh was told to load, kept from pruning
    until it trained a step; a restarted master must keep it too."""
    started_wall: float = 0.0
    """Unix time the first generation was planned: a restarted master times the run from it."""

    @property
    def current(self) -> GenerationView:
        return self.views[-1]


def write_journal(run_dir: str, journal: Journal) -> None:
    """Atomically (temp file, rename): a master killed while writing leaves the previous journal."""
    record = {
        "version": VERSION,
        "config_yaml": journal.config_yaml,
        "host": journal.host,
        "port": journal.port,
        "options": journal.options,
        "generation": journal.generation,
        "template_nodes": journal.template_nodes,
        "views": [_view_to_dict(v) for v in journal.views[-KEEP_GENERATIONS:]],
        "plan": plan_to_dict(journal.plan) if journal.plan is not None else None,
        "last_checkpoint": list(journal.last_checkpoint) if journal.last_checkpoint else None,
        "pin": list(journal.pin) if journal.pin else None,
        "started_wall": journal.started_wall,
    }
    _write_atomically(os.path.join(run_dir, JOURNAL_FILE), json.dumps(record, indent=1).encode())


def end_journal(run_dir: str, exit_code: int) -> None:
    """Marks the journal of a job that ended (its agents were told): nothing runs to re-adopt any more, and
    the same ``oobleck-launch master`` command started again begins a new job instead of waiting for one."""
    path = os.path.join(run_dir, JOURNAL_FILE)
    try:
        with open(path, encoding="utf-8") as fh:
            record = json.load(fh)
        record["ended"] = int(exit_code)
        _write_atomically(path, json.dumps(record, indent=1).encode())
    except (OSError, ValueError):
        pass  # no journal (the job never planned), or a disk that refuses: nothing to mark


def read_journal(run_dir: str) -> Journal:
    """The journal of the master that ran in ``run_dir``; ``UserError`` naming what is missing or wrong."""
    path = os.path.join(run_dir, JOURNAL_FILE)
    if not os.path.isdir(run_dir):
        raise UserError(f"--resume-master: {run_dir!r} is not a folder; give the run dir of the master to resume")
    if not os.path.exists(path):
        raise UserError(
            f"--resume-master: no {JOURNAL_FILE} in {run_dir!r}: its master never sent a plan "
            "(nothing runs to re-adopt; start the job again, with --resume DIR if it checkpointed)"
        )
    try:
        with open(path, encoding="utf-8") as fh:
            record = json.load(fh)
        if not isinstance(record, dict) or record.get("version") != VERSION:
            version = record.get("version") if isinstance(record, dict) else None
            raise ValueError(
                f"version {version!r}, this master reads {VERSION}"
                + (" (version 1 kept the plan in a pickle, which this master never loads)" if version == 1 else "")
            )
        if "ended" in record:
            if record["ended"] == 0:
                raise UserError(
                    f"--resume-master: the job in {run_dir!r} finished (exit 0): no master is to be "
                    "resumed and nothing runs to re-adopt; to train on, start a new job with --resume "
                    "DIR, DIR its final save (--save-final) or a checkpoint it wrote"
                )
            raise UserError(
                f"--resume-master: the job in {run_dir!r} ended (exit {record['ended']}): nothing runs "
                "to re-adopt; a checkpoint it wrote resumes with --resume DIR"
            )
        plan = plan_from_dict(record["plan"]) if record.get("plan") is not None else None
        views = tuple(_view_from_dict(v) for v in record["views"])
        checkpoint = record.get("last_checkpoint")
        return Journal(
            config_yaml=record["config_yaml"],
            host=record["host"],
            port=int(record["port"]),
            options=dict(record["options"]),
            generation=int(record["generation"]),
            template_nodes=int(record["template_nodes"]),
            views=views,
            plan=plan,
            last_checkpoint=(checkpoint[0], int(checkpoint[1])) if checkpoint else None,
            pin=(int(pin[0]), str(pin[1]), int(pin[2])) if (pin := record.get("pin")) else None,
            started_wall=float(record.get("started_wall") or 0.0),
        )
    except UserError:
        raise  # said as it is (a UserError is a ValueError: it was re-wrapped as unreadable, issue 54 item 6)
    except (OSError, ValueError, KeyError, TypeError, IndexError) as exc:
        raise UserError(f"--resume-master: cannot read the journal {path}: {exc}") from None


def options_dict(options) -> dict[str, Any]:
    return asdict(options)


def _view_to_dict(view: GenerationView) -> dict[str, Any]:
    return {
        "number": view.number,
        "layout": view.layout.to_dict(),
        "ranks": [[node, gpu, rank] for (node, gpu), rank in sorted(view.ranks.items(), key=lambda kv: kv[1])],
    }


def _view_from_dict(d: dict[str, Any]) -> GenerationView:
    ranks = {(str(node), int(gpu)): int(rank) for node, gpu, rank in d["ranks"]}
    return GenerationView(int(d["number"]), ExecutionPlan.from_dict(d["layout"]), ranks)


def _write_atomically(path: str, data: bytes) -> None:
    """Owner-only (0600): the journal names the job's nodes, paths and config.

    No fsync. The journal is read by a master started again after the last one's *process* died (killed,
    out of memory, a bug), and a dead process's writes are in the OS's page cache, which outlives it; the
    rename makes the new journal appear whole or not at all. fsync added durability only against the
    master's machine crashing, after which a run dir on its local disk is out of reach anyway, and shared
    storage (NFS) writes through at close. What it cost: the journal is written in the control thread
    before every generation's assignments, and under churn, with the workers' periodic checkpoints
    filling the disk's queue, one fsync held the master 1.9-2.1 s (``master_stalled``, its stack then
    printed by a stall dump, ``oobleck_mm/master/stalls.py``): no failure was detected and no plan sent meanwhile."""
    tmp = f"{path}.tmp"
    with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as fh:
        fh.write(data)
    os.replace(tmp, path)
