"""``oobleck-launch simulate``: systems x scenarios -> samples/s, time breakdowns, plots, JSON.

The job's costs come from the analytical model for the config's accelerator
(``profiling.analytical.profile_from_config``), the same the planner uses; each
system then replays the availability (``simulator.availability``) in
``simulator.timeline``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

from oobleck_mm.errors import UserError
from oobleck_mm.profiling.analytical import profile_from_config
from oobleck_mm.simulator.availability import Availability
from oobleck_mm.simulator.params import SYSTEMS, SimParams
from oobleck_mm.simulator.grid_systems import BambooSystem, VarunaSystem, bamboo_profile
from oobleck_mm.simulator.systems import OobleckSystem, RestartSystem
from oobleck_mm.simulator.timeline import KINDS, SimResult, simulate_system


def make_system(name: str, job, profile, params: SimParams, max_nodes: int, iteration_of=None, skew_samples=None):
    if name == "oobleck":
        return OobleckSystem(job, profile, params, iteration_of, skew_samples)
    if name == "restart":
        return RestartSystem(job, profile, params, iteration_of, skew_samples)
    if iteration_of is not None:
        raise UserError(f"measured iteration times are for this engine's systems (oobleck, restart), not {name!r}")
    if name == "varuna":
        return VarunaSystem(job, profile, params, max_nodes)
    if name == "varuna-no-ckpt":
        return VarunaSystem(job, profile, dataclasses.replace(params, varuna_no_checkpoint_cost=True), max_nodes)
    if name == "bamboo":
        bamboo, note = bamboo_profile(job, params, max_nodes)
        return BambooSystem(job, bamboo, params, max_nodes, note)
    raise UserError(f"--system: unknown system {name!r}; valid: {', '.join(SYSTEMS + ('varuna-no-ckpt',))}")


def simulate(
    job,
    availability: Availability,
    systems: Sequence[str],
    params: SimParams,
    progress: Callable[[str], None] | None = None,
    profile=None,
    iteration_of=None,
    skew_samples=None,
) -> list[SimResult]:
    """One ``SimResult`` per system, in the order given. ``profile``: the job's layer costs (default:
    the analytical model); ``iteration_of(plan)``: measured seconds per iteration (a calibrated cluster);
    ``skew_samples``: sampled batches for ``params.skew_batches`` (``data.skew_samples.sampled_batches``)."""
    say = progress or (lambda line: None)
    profile = profile or profile_from_config(job)
    peak = availability.peak_nodes
    out = []
    for name in systems:
        start = time.perf_counter()
        system = make_system(name, job, profile, params, peak, iteration_of, skew_samples)
        result = simulate_system(system, availability, params.preemption_notice, params.preempt_grace_s)
        acted = ", ".join(f"{k} {v}" for k, v in result.straggler_actions.items())
        say(
            f"{result.system}: {result.samples_per_s:.3f} samples/s over {result.wall_s / 3600:.2f} h, "
            f"{len(result.incidents)} changes acted on{f' (stragglers: {acted})' if acted else ''}, simulated in "
            f"{time.perf_counter() - start:.2f} s"
        )
        out.append(result)
    return out


def format_results(results: Sequence[SimResult], availability: Availability) -> str:
    lines = [
        f"availability: {availability.source}; {len(availability.initial)} nodes at start, peak "
        f"{availability.peak_nodes}, {len(availability.changes)} changes over {availability.end_s / 3600:.2f} h",
        "",
        "| system | samples/s | " + " | ".join(KINDS) + " |",
        "|---" * (len(KINDS) + 2) + "|",
    ]
    for r in results:
        shares = r.breakdown
        cells = " | ".join(f"{100 * shares[k] / r.wall_s:.1f}%" if r.wall_s else "-" for k in KINDS)
        lines.append(f"| {r.system} | {r.samples_per_s:.3f} | {cells} |")
    lines.append("")
    for r in results:
        note = f" ({r.note})" if r.note and r.note not in r.start_layout else ""
        lines.append(f"{r.system}: starts on {r.start_layout}{note}")
    return "\n".join(lines)


def results_to_json(
    results: Sequence[SimResult], availability: Availability, extra: dict[str, Any] | None = None
) -> list[dict[str, Any]]:
    base = {"availability": availability.source, **(extra or {})}
    return [{**r.to_dict(), **base} for r in results]


# --------------------------------------------------------------------------- sweeps


def apply_knob(job, params: SimParams, key: str, value: str):
    """``f``, a ``SimParams`` field, or a dotted config path (``training.global_batch``) set to ``value``."""
    if key == "f":
        key = "fault_tolerance.f"
    fields = {f.name: f for f in dataclasses.fields(SimParams)}
    if key in fields:
        current = getattr(params, key)
        return job, dataclasses.replace(params, **{key: _coerce(key, value, current)})
    if "." not in key:
        raise UserError(
            f"--sweep: unknown knob {key!r}; use f, a simulator parameter ({', '.join(fields)}) "
            "or a dotted config path such as fault_tolerance.f"
        )
    section, name = key.split(".", 1)
    part = getattr(job, section, None)
    if part is None or not hasattr(part, name):
        raise UserError(f"--sweep: the config has no field {key!r}")
    updated = dataclasses.replace(part, **{name: _coerce(key, value, getattr(part, name))})
    return dataclasses.replace(job, **{section: updated}), params


def _coerce(key: str, value: str, current: Any) -> Any:
    try:
        if isinstance(current, bool):
            if value.lower() not in ("true", "false"):
                raise ValueError(value)
            return value.lower() == "true"
        if isinstance(current, int):
            return int(value)
        if current is None:  # an unset optional number: an integer when written as one
            return int(value) if value.lstrip("-").isdigit() else float(value)
        if isinstance(current, float):
            return float(value)
    except ValueError:
        raise UserError(f"--sweep: {key}={value!r} is not a {type(current).__name__}") from None
    return value


def parse_sweep(text: str) -> tuple[str, list[str]]:
    if "=" not in text:
        raise UserError(f"--sweep: expected KNOB=v1,v2,..., got {text!r}")
    key, values = text.split("=", 1)
    items = [v.strip() for v in values.split(",") if v.strip()]
    if not items:
        raise UserError(f"--sweep: no values for {key!r}")
    return key.strip(), items


# --------------------------------------------------------------------------- plot


def plot_results(results: Sequence[SimResult], availability: Availability, path: str, title: str) -> None:
    """Fig. 2.10: samples/s over time per system (a smoothed window), dotted averages, and the
    live node count on a second axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    window = max(availability.end_s / 200, 60.0)
    fig, ax = plt.subplots(figsize=(9, 4))
    for r in results:
        series = r.throughput_series(window)
        (line,) = ax.plot([t / 3600 for t, _ in series], [v for _, v in series], label=r.system)
        ax.axhline(r.samples_per_s, linestyle=":", color=line.get_color())
    ax.set_xlabel("hours")
    ax.set_ylabel("samples/s")
    ax.set_title(title)
    nodes = ax.twinx()
    times = [0.0] + [c.seconds for c in availability.changes] + [availability.end_s]
    counts = [availability.nodes_at(t) for t in times]
    nodes.step([t / 3600 for t in times], counts, where="post", color="grey", alpha=0.4, label="live nodes")
    nodes.set_ylabel("live nodes")
    ax.legend(loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
