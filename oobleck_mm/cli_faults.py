"""``oobleck-launch``'s fault flags as values: ``--inject``, ``--trace`` and ``--churn`` as one list of
``FaultEvent`` (each checked against the run: a target that is no node, a step past the last, a phase the
run never enters are exit 2 naming the flag), and ``plan --fail-nodes``.
"""

from __future__ import annotations

import argparse
import os
import sys

from oobleck_mm.errors import UserError


def node_names(num_nodes: int) -> list[str]:
    return [f"node{i}" for i in range(num_nodes)]


def parse_fail_nodes(values: list[str], names: list[str]) -> list[str]:
    out: list[str] = []
    for value in values:
        for item in filter(None, (v.strip() for v in value.split(","))):
            name = f"node{item}" if item.isdigit() else item
            if name not in names:
                raise UserError(f"--fail-nodes: unknown node {item!r}; valid nodes are {names[0]}..{names[-1]}")
            if name in out:
                raise UserError(f"--fail-nodes: node {name!r} listed twice")
            out.append(name)
    return out


def trace_file(path: str) -> str:
    """``--trace``'s file, or a UserError saying what is there instead."""
    if not os.path.isfile(path):
        what = "a folder, not a file" if os.path.isdir(path) else "no such file"
        raise UserError(
            f"--trace: {path!r} is {what}; give a trace file (data/traces/, delta_ms,add|remove,node lines)"
        )
    return path


def faults_of(args: argparse.Namespace, num_nodes: int) -> list:
    """``--inject``, ``--trace`` and ``--churn`` as one list of ``FaultEvent`` (UserError names the bad flag)."""
    churn = getattr(args, "churn", None)
    if not args.inject and args.trace is None and churn is None:
        return []
    from oobleck_mm.faults.churn import churn_timeline, parse_churn
    from oobleck_mm.faults.spec import check_targets, parse_inject
    from oobleck_mm.faults.trace import load_timeline, read_trace, starting_nodes

    faults = parse_inject(args.inject) if args.inject else []
    if args.trace is not None:
        start = len(starting_nodes(read_trace(trace_file(args.trace))))
        if start != num_nodes:
            print(
                f"--trace: the trace starts with {start} nodes and this run with {num_nodes} (--nodes / "
                f"cluster.nodes): its later adds and removes are replayed one for one on top of {num_nodes}",
                file=sys.stderr,
                flush=True,
            )
        faults += load_timeline(trace_file(args.trace), node_names(num_nodes), time_scale=args.time_scale)
    if churn is not None:
        timeline = churn_timeline(parse_churn(churn), node_names(num_nodes))
        bursts = len({f.source.split(" event")[0] for f in timeline})
        print(
            f"--churn: {len(timeline)} events in {bursts} bursts over "
            f"{max((f.seconds or 0.0) for f in timeline) if timeline else 0.0:.0f} s after the first step "
            f"({sum(f.kind == 'join' for f in timeline)} joins)",
            file=sys.stderr,
            flush=True,
        )
        faults += timeline
    check_targets(faults, node_names(num_nodes))
    return faults


def check_step_targets(faults: list, steps: int) -> None:
    """A fault at stepN fires once N steps are done: past the job's last step it never would (issue 54: such
    a run ended with exit 0 and not a word about the fault)."""
    for fault in faults:
        if fault.step is not None and fault.step > steps:
            raise UserError(
                f"--inject {fault.source or fault.describe()}: it fires once {fault.step} steps are "
                f"done, and this run trains {steps} (training.steps, --steps): it would never fire; "
                f"aim at a step from 0 to {steps}"
            )


def check_phase_targets(faults: list, job, save_final: bool) -> None:
    """A failure aimed at a phase this run never enters would never fire: refuse it up front."""
    for fault in faults:
        ft = job.fault_tolerance
        periodic = ft.checkpoint_interval > 0  # (checkpoint_every, 30 min by default, may never come)
        if fault.phase == "checkpoint" and ft.recovery == "live" and not (save_final or periodic):
            raise UserError(
                f"--inject {fault.source or fault.describe()}: @phase:checkpoint needs a checkpoint, "
                "and this live-recovery run writes none: set fault_tolerance.checkpoint_interval "
                "(periodic checkpoints, written in the background) or --save-final DIR, or aim at "
                "copy, rendezvous, connect, forming or registered"
            )
