"""A run's figure: loss and samples/s against wall time, with its incidents and each recovery phase shaded.

Drawn from the same event log and recovery rows as the table (``oobleck_mm.faults.recovery_rows``).
"""

from __future__ import annotations

from typing import Iterable

from oobleck_mm.faults.recovery_rows import Event, RecoveryRow, _sorted, _steps, incidents, phase_name, recovery_rows

WALL_WINDOW_STEPS = 4
"""Steps the wall-clock rate is averaged over: the master logs a step when its last rank reports,
so two steps can land milliseconds apart and a one-step rate would spike."""


def throughput_series(events: Iterable[Event], window: int = WALL_WINDOW_STEPS) -> tuple[list[float], ...]:
    """(seconds since the first step's start, reported samples/s, wall-clock samples/s) per step.

    Reported: the step's own rate. Wall clock: the samples of the last ``window``
    steps over the time since the step before them was logged, so downtime shows
    as a dip (which lasts ``window`` steps).
    """
    steps = _steps(_sorted(events))
    if not steps:
        return [], [], []
    t0 = steps[0]["ts"] - float(steps[0].get("step_time_s", 0.0) or 0.0)
    ends = [t0] + [e["ts"] for e in steps]
    samples = [0.0]  # running total, each step's samples = its rate x its time
    for e in steps:
        samples.append(samples[-1] + float(e.get("samples_per_s", 0) or 0) * float(e.get("step_time_s", 0) or 0))
    xs, reported, wall = [], [], []
    for i, e in enumerate(steps, start=1):
        j = max(0, i - window)
        span = ends[i] - ends[j]
        xs.append(e["ts"] - t0)
        reported.append(float(e.get("samples_per_s", 0.0) or 0.0))
        wall.append((samples[i] - samples[j]) / span if span > 0 else reported[-1])
    return xs, reported, wall


PHASE_SPANS = (
    ("detect", "detection", "tab:purple"),
    ("decide", "planning", "tab:orange"),
    ("rendezvous", "rendezvous", "gold"),
    ("copy", "state copy", "tab:cyan"),
    ("resume", "first step", "tab:gray"),
)
"""RecoveryRow durations shaded on the run's figure: (field, legend, colour), in the order they happen."""
JOINER_STARTUP_SPAN = ("joiner start-up", "tab:green")
"""A join's "detection" is its joiner starting while the others train: shaded as that, not as detection."""


def recovery_spans(row: RecoveryRow) -> list[tuple[str, str, float, float]]:
    """(legend, colour, start ts, end ts) of each recovery phase of one incident that happened."""
    spans, at = [], row.at_ts
    for field, label, color in PHASE_SPANS:
        seconds = getattr(row, f"{field}_s")
        if seconds is None:
            continue
        if field == "detect" and row.kind.startswith("join"):  # the others train on meanwhile
            label, color = JOINER_STARTUP_SPAN
        spans.append((label, color, at, at + seconds))
        at += seconds
    return spans


def plot_run(events: Iterable[Event], path: str, title: str = "") -> str:
    """Saves the run's figure: loss and samples/s against wall time, one above the other, with
    failures (red), detections (purple, dotted), joins (green) and each recovery phase shaded."""
    import matplotlib

    matplotlib.use("Agg")  # no display: runs and CI have none
    import matplotlib.pyplot as plt

    ordered = _sorted(events)
    xs, reported, wall = throughput_series(ordered)
    steps = _steps(ordered)
    t0 = steps[0]["ts"] - float(steps[0].get("step_time_s", 0.0) or 0.0) if steps else 0.0
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6.5), sharex=True, gridspec_kw={"height_ratios": [1, 1]})
    top.plot(xs, [float(e.get("loss", float("nan"))) for e in steps], lw=1.2, color="tab:red", label="loss")
    top.set_ylabel("loss")
    # Wall clock: samples over the time since the previous step, so downtime shows; the step's own
    # rate as dots only, since a line joining the dots across a failure would hide the gap.
    bottom.step(
        xs, wall, where="pre", lw=1.2, color="tab:blue", label=f"samples/s (wall clock, {WALL_WINDOW_STEPS} steps)"
    )
    bottom.plot(xs, reported, ".", ms=4, color="black", label="samples/s (step time)")
    bottom.set_ylabel("samples/s")
    bottom.set_ylim(bottom=0)
    marked: set[str] = set()

    def once(label: str) -> str | None:
        first = label not in marked
        marked.add(label)
        return label if first else None

    for row in recovery_rows(ordered):
        for label, color, start, end in recovery_spans(row):
            for ax in (top, bottom):
                ax.axvspan(
                    start - t0, end - t0, color=color, alpha=0.25, lw=0, label=once(label) if ax is bottom else None
                )
    for incident in incidents(ordered):
        color, label = ("green", "join") if incident.join else ("red", "failure")
        for ax in (top, bottom):
            ax.axvline(incident.ts - t0, color=color, lw=1.2, label=once(label) if ax is bottom else None)
        top.annotate(
            f"{incident.kind}:{','.join(incident.nodes)}",
            (incident.ts - t0, 1),
            xycoords=("data", "axes fraction"),
            rotation=90,
            va="top",
            ha="right",
            fontsize=7,
            color=color,
        )
    for e in ordered:
        if phase_name(e) == "lost":
            for ax in (top, bottom):
                ax.axvline(
                    e["ts"] - t0, color="tab:purple", ls=":", lw=1, label=once("detected") if ax is bottom else None
                )
    bottom.set_xlabel("seconds since training started")
    top.set_title(title or "training run")
    bottom.legend(loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=5, fontsize=8, frameon=False)  # off the data
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
