#!/usr/bin/env python
"""The simulator against the dissertation (issue 16): Tables 2.2 and 2.4, spot traces, scale.

    python scripts/bench_simulator.py [--json OUT] [--parts paper,spot,scale] [--scale-nodes 100,1000]
                                      [--plot-dir DIR]

- paper: every cell of Table 2.2 (30 A40 nodes, one removed every 6 h / 1 h / 10 min
  until 15 remain; BERT-Large, GPT-2, GPT-3 Medium, 2.7B, 6.7B; Bamboo, Varuna,
  Oobleck) and Table 2.4's Varuna without checkpoint overhead, simulated with
  ``configs/paper/*.yaml`` at the simulator's default parameters, next to the
  paper's figure and their ratio. Bamboo's microbatch is Table 2.1's where the
  paper ran it (BERT-Large 4, GPT-2 1): an input, the memory limit the paper hit.
- spot: the p3 (scaled onto 15..30 nodes, as the paper replayed it) and g4dn
  traces, average samples/s per system (Fig. 2.10), with a plot per trace when
  ``--plot-dir`` is given.
- scale: the p3 trace scaled up to N nodes (each node becomes N/32 that come and
  go together), Oobleck only: seconds to simulate the 11.4 h, and changes acted on.
- stragglers (issue 29): 100 nodes (GPT-3 2.7B on A40s), 5% of them slowed 1.5-3x
  at random times for good, 6 h, no node lost (and the same on the p3 trace scaled
  to about 100 nodes): samples/s of this engine with its straggler policy on and off,
  Varuna and restart mode, each against its own run without stragglers.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from oobleck_mm.config import load_config  # noqa: E402
from oobleck_mm.faults.trace import read_trace  # noqa: E402
from oobleck_mm.simulator.availability import from_trace  # noqa: E402
from oobleck_mm.simulator.params import SimParams  # noqa: E402
from oobleck_mm.simulator.run import plot_results, simulate  # noqa: E402

TRACES = ROOT / "data" / "traces"
MODELS = ("bert_large", "gpt2", "gpt3_medium", "gpt3_2.7b", "gpt3_6.7b")
FREQUENCIES = ("6h", "1h", "10m")

# Dissertation Table 2.2 (samples/s); None: Bamboo out of memory.
TABLE_2_2 = {
    "bamboo": {
        "6h": (77.04, 17.47, None, None, None),
        "1h": (75.60, 17.13, None, None, None),
        "10m": (69.84, 16.01, None, None, None),
    },
    "varuna": {
        "6h": (260.11, 86.51, 29.50, 7.27, 4.14),
        "1h": (246.03, 85.17, 28.49, 6.53, 2.69),
        "10m": (173.52, 76.39, 20.19, 1.76, 0.26),
    },
    "oobleck": {
        "6h": (287.10, 85.59, 29.30, 7.29, 4.33),
        "1h": (286.28, 85.42, 29.21, 7.23, 4.22),
        "10m": (282.11, 84.80, 28.70, 6.89, 3.55),
    },
}
# Table 2.4's middle row: Varuna with no checkpointing overhead (BERT-Large and GPT-3 6.7B only).
TABLE_2_4 = {
    "bert_large": {"6h": 275.88, "1h": 273.85, "10m": 264.16},
    "gpt3_6.7b": {"6h": 4.61, "1h": 4.29, "10m": 1.98},
}
BAMBOO_MICROBATCH = {"bert_large": 4, "gpt2": 1}  # Table 2.1: the largest the paper could run


def paper_part(say) -> list[dict]:
    rows = []
    for m, model in enumerate(MODELS):
        job = load_config(ROOT / "configs" / "paper" / f"{model}.yaml")
        for freq in FREQUENCIES:
            availability = from_trace(read_trace(TRACES / f"{freq}.csv"), f"{freq}.csv")
            systems = ["bamboo", "varuna", "oobleck"] + (["varuna-no-ckpt"] if model in TABLE_2_4 else [])
            for result in simulate(
                job, availability, systems, SimParams(bamboo_microbatch=BAMBOO_MICROBATCH.get(model))
            ):
                if result.system == "varuna-no-ckpt":
                    paper = TABLE_2_4[model][freq]
                else:
                    paper = TABLE_2_2[result.system][freq][m]
                ours = result.samples_per_s
                rows.append(
                    {
                        "model": model,
                        "failures": freq,
                        "system": result.system,
                        "samples_per_s": round(ours, 3),
                        "paper": paper,
                        "ratio": round(ours / paper, 3) if paper else None,
                        "breakdown": {k: round(v / result.wall_s, 4) for k, v in result.breakdown.items()},
                        "note": result.note,
                    }
                )
                shown = f"{paper:.2f}" if paper else "OOM"
                ratio = f"{ours / paper:.2f}x" if paper else ("OOM too" if ours == 0 else "runs (paper: OOM)")
                say(f"{model:11s} {freq:>3s} {result.system:15s} {ours:9.3f}  paper {shown:>7s}  {ratio}")
    return rows


def spot_part(say, plot_dir: Path | None) -> list[dict]:
    rows = []
    for trace in ("scale_p3-trace.csv", "g4dn-trace.csv"):
        availability = from_trace(read_trace(TRACES / trace), trace)
        for model in ("bert_large", "gpt3_2.7b", "gpt3_6.7b"):
            job = load_config(ROOT / "configs" / "paper" / f"{model}.yaml")
            params = SimParams(preemption_notice=True, bamboo_microbatch=BAMBOO_MICROBATCH.get(model))
            results = simulate(job, availability, ["bamboo", "varuna", "oobleck"], params)
            for r in results:
                rows.append(
                    {
                        "trace": trace,
                        "model": model,
                        "system": r.system,
                        "samples_per_s": round(r.samples_per_s, 3),
                        "breakdown": {k: round(v / r.wall_s, 4) for k, v in r.breakdown.items()},
                    }
                )
                say(f"{trace:18s} {model:11s} {r.system:8s} {r.samples_per_s:9.3f} samples/s")
            if plot_dir is not None:
                path = plot_dir / f"sim_{trace.split('.')[0]}_{model}.png"
                plot_results(results, availability, str(path), f"{model}: {trace}, preemption notices")
                say(f"wrote {path}")
    return rows


def scale_part(say, sizes: list[int]) -> list[dict]:
    rows = []
    job = load_config(ROOT / "configs" / "paper" / "gpt3_6.7b.yaml")
    events = read_trace(TRACES / "p3-trace.csv")
    peak = from_trace(events, "p3").peak_nodes
    for nodes in sizes:
        availability = from_trace(events, "p3-trace.csv", max(1, round(nodes / peak)))
        start = time.perf_counter()
        result = simulate(job, availability, ["oobleck"], SimParams())[0]
        seconds = time.perf_counter() - start
        rows.append(
            {
                "nodes": availability.peak_nodes,
                "changes": len(availability.changes),
                "simulate_s": round(seconds, 2),
                "samples_per_s": round(result.samples_per_s, 3),
            }
        )
        say(
            f"p3 x{round(nodes / peak)}: {availability.peak_nodes} nodes peak, {len(availability.changes)} changes: "
            f"simulated 11.4 h in {seconds:.1f} s ({result.samples_per_s:.2f} samples/s)"
        )
    return rows


def straggler_part(say) -> list[dict]:
    from oobleck_mm.simulator.availability import parse_stragglers, periodic

    rows = []
    job = load_config(ROOT / "configs" / "paper" / "gpt3_2.7b.yaml")
    events = read_trace(TRACES / "p3-trace.csv")
    scaled = max(1, round(100 / from_trace(events, "p3").peak_nodes))
    clusters = {
        "100 steady nodes": periodic(100, 1e9, 99).clipped(6.0),
        "p3 trace x3": from_trace(events, "p3-trace.csv", scaled).clipped(6.0),
    }
    spec = parse_stragglers("0.05,min=1.5,max=3,seed=1")
    for label, base in clusters.items():
        slowed = base.with_stragglers(spec)
        for system, params in (
            ("oobleck", SimParams()),
            ("oobleck, policy off", SimParams(straggler_mitigation=False)),
            ("varuna", SimParams()),
            ("restart", SimParams()),
        ):
            name = system.split(",")[0]
            clean = simulate(job, base, [name], params)[0].samples_per_s
            result = simulate(job, slowed, [name], params)[0]
            rows.append(
                {
                    "cluster": label,
                    "system": system,
                    "samples_per_s": round(result.samples_per_s, 3),
                    "without_stragglers": round(clean, 3),
                    "ratio": round(result.samples_per_s / clean, 3),
                    "actions": result.straggler_actions,
                }
            )
            say(
                f"{label:17s} {system:20s} {result.samples_per_s:8.3f} samples/s, {result.samples_per_s / clean:6.1%} "
                f"of {clean:.3f} without stragglers  {result.straggler_actions or ''}"
            )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None, metavar="OUT")
    parser.add_argument("--parts", default="paper,spot,scale,stragglers")
    parser.add_argument("--scale-nodes", default="100,1000")
    parser.add_argument("--plot-dir", default=None)
    args = parser.parse_args()
    say = lambda line: print(line, flush=True)  # noqa: E731
    out: dict = {}
    parts = args.parts.split(",")
    if "paper" in parts:
        out["paper"] = paper_part(say)
    if "spot" in parts:
        out["spot"] = spot_part(say, Path(args.plot_dir) if args.plot_dir else None)
    if "scale" in parts:
        out["scale"] = scale_part(say, [int(n) for n in args.scale_nodes.split(",")])
    if "stragglers" in parts:
        out["stragglers"] = straggler_part(say)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
        say(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
