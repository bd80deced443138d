"""Recovery breakdown from an event log: a per-failure table of phases and the run's figure.

    python -m oobleck_mm.faults.report RUN/events.jsonl [--plot out.png] [--json]

The rows (one per incident, each phase timed; ``oobleck_mm.faults.recovery_rows`` says how they are read
from the events) as a table; the figure is ``oobleck_mm.faults.figure``.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

from oobleck_mm.events import read_events
from oobleck_mm.faults.figure import plot_run
from oobleck_mm.faults.recovery_rows import (  # noqa: F401 - the report's names, read from here by its users
    RecoveryRow,
    incidents,
    median_step_gap,
    phase_name,
    recovery_rows,
    step_gaps,
    survivors_pause,
)

COLUMNS = (
    ("#", None),
    ("kind", "kind"),
    ("nodes", "nodes"),
    ("step", "step"),
    ("detect s", "detect_s"),
    ("reason", "reason"),
    ("plan s", "decide_s"),
    ("rdv s", "rendezvous_s"),
    ("copy s", "copy_s"),
    ("MB", "copy_bytes"),
    ("MB/s", "copy_mb_per_s"),
    ("resume s", "resume_s"),
    ("abandoned s", "abandoned_s"),
    ("lost s", "lost_s"),
    ("outcome", "outcome"),
)


def _cell(field: str | None, row: RecoveryRow, index: int) -> str:
    if field is None:
        return str(index)
    value = getattr(row, field)
    if value is None or value == "":
        return "-"
    if field == "nodes":
        return ",".join(value)
    if field == "step":
        return str(value + 1)  # the console's numbering: "step 5/60" is the step logged as 4
    if field == "copy_bytes":
        return f"{value / 1e6:.2f}"
    if isinstance(value, float):
        return f"{value:.2f}" if field != "copy_mb_per_s" else f"{value:.1f}"
    return str(value)


def format_table(rows: Sequence[RecoveryRow]) -> str:
    """The recovery table as aligned text (``-`` for a phase that did not happen or was not logged).

    Steps are numbered as on the console (1-based): ``kill:node1@step4`` fires once 4 steps are
    complete and interrupts step 5, the table's "step 5"."""
    if not rows:
        return "no failures or joins in the event log"
    cells = [[title for title, _ in COLUMNS]]
    cells += [[_cell(field, row, i) for _, field in COLUMNS] for i, row in enumerate(rows, start=1)]
    widths = [max(len(r[c]) for r in cells) for c in range(len(COLUMNS))]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in cells)


# ---------------------------------------------------------------------- command line
def summarize(event_log: str, plot: str | None = None) -> str:
    """The table for one event log (and the PNG when ``plot`` names a path): what ``local`` prints at the end."""
    events = read_events(event_log)
    text = format_table(recovery_rows(events))
    if plot:
        plot_run(events, plot)
        text += f"\nrun figure (loss, samples/s, incidents): {plot}"
    return text


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m oobleck_mm.faults.report", description=__doc__.splitlines()[0])
    parser.add_argument("event_log", help="a run's events.jsonl")
    parser.add_argument(
        "--plot", default=None, help="write the run's figure (loss and samples/s over time, incidents marked) here"
    )
    parser.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    args = parser.parse_args(argv)
    if args.json:
        rows = recovery_rows(read_events(args.event_log))
        print(json.dumps([r.to_dict() for r in rows], indent=2))
        if args.plot:
            plot_run(read_events(args.event_log), args.plot)
    else:
        print(summarize(args.event_log, args.plot))
    return 0


if __name__ == "__main__":
    sys.exit(main())
