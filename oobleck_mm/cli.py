"""``oobleck-launch``: the one command-line entry point.

Subcommands that exist today: ``plan`` (templates, the best plan for N nodes
and, with ``--fail-nodes``, the reconfiguration after losing them). The
control-plane subcommands (``master``, ``agent``, ``local``) come with the
control-plane issue. Exit codes: 0 done, 2 bad config or arguments (one line on
stderr naming the field), 1 anything else.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Sequence

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_BAD_INPUT = 2


class _ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one clear line, exit 2 like every bad input
        self.print_usage(sys.stderr)
        print(f"oobleck-launch: error: {message}", file=sys.stderr)
        raise SystemExit(EXIT_BAD_INPUT)


def build_parser() -> argparse.ArgumentParser:
    parser = _ArgumentParser(prog="oobleck-launch", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_ArgumentParser)

    plan = sub.add_parser("plan", help="print pipeline templates, the best plan and a reconfiguration plan")
    plan.add_argument("--config", required=True, help="job config YAML (see configs/)")
    plan.add_argument("--nodes", type=int, default=None, help="number of nodes (default: cluster.nodes)")
    plan.add_argument(
        "--fail-nodes",
        nargs="+",
        default=[],
        metavar="NODE",
        help="nodes to lose (names node0..nodeN-1, or indices; comma-separated lists are accepted)",
    )
    plan.add_argument("--join-nodes", type=int, default=0, metavar="K", help="nodes that join after the failures")
    plan.add_argument("--solver", choices=("highs", "mindtpy", "python"), default=None, help="override planning.solver")
    plan.add_argument("--json", action="store_true", help="print one JSON document instead of tables")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "plan":
            return _cmd_plan(args)
    except ValueError as err:  # user mistakes: ConfigError, BatchSplitError, impossible requests
        print(f"oobleck-launch: error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    raise AssertionError(f"unhandled command {args.command}")


def _node_names(num_nodes: int) -> list[str]:
    return [f"node{i}" for i in range(num_nodes)]


def _parse_fail_nodes(values: list[str], names: list[str]) -> list[str]:
    out: list[str] = []
    for value in values:
        for item in filter(None, (v.strip() for v in value.split(","))):
            name = f"node{item}" if item.isdigit() else item
            if name not in names:
                raise ValueError(f"--fail-nodes: unknown node {item!r}; valid nodes are {names[0]}..{names[-1]}")
            if name in out:
                raise ValueError(f"--fail-nodes: node {name!r} listed twice")
            out.append(name)
    return out


def _cmd_plan(args: argparse.Namespace) -> int:
    from oobleck_mm.config import load_config
    from oobleck_mm.planning.planner import plan_job

    job = load_config(args.config)
    num_nodes = job.cluster.nodes if args.nodes is None else args.nodes
    if num_nodes < 1:
        raise ValueError(f"--nodes: must be >= 1, got {num_nodes}")
    names = _node_names(num_nodes)
    lost = _parse_fail_nodes(args.fail_nodes, names)
    if args.join_nodes < 0:
        raise ValueError(f"--join-nodes: must be >= 0, got {args.join_nodes}")
    joined = [f"node{num_nodes + i}" for i in range(args.join_nodes)]

    progress = None if args.json else (lambda line: print(line, file=sys.stderr, flush=True))
    result = plan_job(
        job, names, lost=lost, joined=joined, solver=args.solver, progress=progress
    )
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        print(result.format())
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
