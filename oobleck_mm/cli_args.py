"""``oobleck-launch``'s arguments: the parser of every subcommand, its flags and their help.

Kept apart from the commands themselves (``oobleck_mm.cli``) so that reading what a flag means does not
mean reading what each command does; importing it is cheap (argparse only).
"""

from __future__ import annotations

import argparse
import sys

from oobleck_mm.errors import ExitCode

LOG_LEVELS = ("debug", "info", "warning", "error")


class _ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one clear line, exit 2 like every bad input
        self.print_usage(sys.stderr)
        print(f"oobleck-launch: error: {message}", file=sys.stderr)
        raise SystemExit(ExitCode.BAD_INPUT)


def build_parser() -> argparse.ArgumentParser:
    parser = _ArgumentParser(prog="oobleck-launch", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_ArgumentParser)

    plan = sub.add_parser("plan", help="print pipeline templates, the best plan and a reconfiguration plan")
    plan.add_argument("--config", required=True, help="job config YAML (see configs/)")
    plan.add_argument(
        "--deepspeed",
        default=None,
        metavar="FILE",
        help="a DeepSpeed JSON config mapped onto the job's training section (docs/runtime.md)",
    )
    _add_set(plan)
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
    plan.add_argument(
        "--placements",
        action="store_true",
        help="for each pipeline of the plan, time its encoders as branches of their own against the chain "
        "(docs/planning.md, 'Encoder placement')",
    )
    _add_simulate_parser(sub)
    _add_control_plane_parsers(sub)
    from oobleck_mm.verify import build_parser as verify_parser

    verify_parser(
        sub.add_parser(
            "verify",
            help="replay a run on the single-process reference trainer and compare "
            "its parameters (tolerance from the run's dtype)",
        )
    )
    return parser


def _node_range(text: str) -> tuple[int, int | None]:
    """``N`` or torchrun's ``MIN:MAX``."""
    low, sep, high = text.partition(":")
    try:
        first, most = int(low), (int(high) if sep else None)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or MIN:MAX (e.g. 4 or 2:8), got {text!r}") from None
    if first < 1 or (most is not None and most < first):
        raise argparse.ArgumentTypeError(f"expected 1 <= MIN <= MAX, got {text!r}")
    return first, most


def _add_set(parser) -> None:
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        dest="overrides",
        help="override one config field, e.g. --set training.global_batch=64 (repeatable; "
        "the value is read as YAML and checked like the file)",
    )
    parser.add_argument(
        "--skip-bad-samples",
        action="append_const",
        const="data.skip_bad_samples=true",
        dest="overrides",
        help="log and leave out samples whose record or files are bad instead "
        "of stopping (= --set data.skip_bad_samples=true)",
    )


def _add_simulate_parser(sub) -> None:
    sim = sub.add_parser("simulate", help="what-if: the job over hours of node churn, per system (docs/simulator.md)")
    sim.add_argument("--config", required=True, help="job config YAML (see configs/)")
    sim.add_argument("--deepspeed", default=None, metavar="FILE", help="a DeepSpeed JSON config (docs/runtime.md)")
    _add_set(sim)
    source = sim.add_mutually_exclusive_group(required=True)
    source.add_argument("--trace", default=None, metavar="FILE", help="node-availability trace (data/traces/)")
    source.add_argument(
        "--failure-interval",
        default=None,
        metavar="DURATION",
        help="remove one node every DURATION (10m, 1h, 6h) until --until-nodes remain",
    )
    source.add_argument(
        "--churn",
        default=None,
        metavar="SPEC",
        help="synthetic bursty churn, as local's --churn (RATE bursts per minute[,burst=K,min=N,"
        "max=M,seed=S,duration=S,...]) on --nodes (default cluster.nodes)",
    )
    sim.add_argument(
        "--until-nodes",
        type=int,
        default=None,
        metavar="N",
        help="with --failure-interval: stop when N nodes remain (default half)",
    )
    sim.add_argument(
        "--nodes",
        type=int,
        default=None,
        metavar="N",
        help="nodes at the start (--failure-interval; default cluster.nodes) or, with --trace, "
        "the trace scaled up to about N nodes at its peak (each node becomes k that come and go together)",
    )
    sim.add_argument(
        "--system",
        nargs="+",
        default=["oobleck", "varuna", "bamboo", "restart"],
        metavar="NAME",
        help="oobleck, varuna, varuna-no-ckpt, bamboo, restart (default: all but varuna-no-ckpt)",
    )
    sim.add_argument("--hours", type=float, default=None, help="simulate only the first H hours")
    sim.add_argument(
        "--stragglers",
        default=None,
        metavar="SPEC",
        help="slow nodes: SHARE of the starting nodes[,min=1.5,max=3,seed=S,at=T,for=T], each slowed "
        "by a factor drawn from [min, max] at a random time (at=T: then), for good (for=T: that "
        "long); trace files may also have delta_ms,slow,node,F[,T] lines",
    )
    sim.add_argument("--notice", action="store_true", help="preemption notices: the cloud warns before a removal")
    sim.add_argument("--grace", default="30s", metavar="DURATION", help="preemption notice lead time (default 30s)")
    sim.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a simulator parameter (docs/simulator.md), e.g. --param rendezvous_s=5; repeatable",
    )
    sim.add_argument(
        "--sweep",
        default=None,
        metavar="KNOB=V1,V2",
        help="repeat for each value of a knob: f, a simulator parameter or a dotted config path",
    )
    sim.add_argument("--json", default=None, metavar="OUT", help="write the results as JSON to OUT (- for stdout)")
    sim.add_argument("--plot", default=None, metavar="OUT.png", help="throughput over time per system")


def _add_control_plane_parsers(sub) -> None:
    # Flags follow torchrun where they overlap; its spellings are accepted as aliases.
    master = sub.add_parser("master", help="run the job's master (one per job)")
    master.add_argument(
        "--config", default=None, help="job config YAML (see configs/); required unless --resume-master"
    )
    master.add_argument(
        "--resume-master",
        default=None,
        metavar="RUN_DIR",
        help="restart a master that died: re-adopt the agents and workers still running its job, "
        "from the journal in its run dir (same config, token, address; docs/recovery.md)",
    )
    master.add_argument(
        "--deepspeed",
        default=None,
        metavar="FILE",
        help="a DeepSpeed JSON config mapped onto the job's training section (docs/runtime.md)",
    )
    _add_set(master)
    master.add_argument(
        "--host",
        "--master-addr",
        default=None,
        help="address to listen on (default 127.0.0.1, or the journal's with --resume-master; "
        "0.0.0.0 for every interface)",
    )
    master.add_argument(
        "--port",
        "--master-port",
        type=int,
        default=None,
        help="gRPC port (default 29400, or the journal's with --resume-master; 0: any free port)",
    )
    master.add_argument(
        "--nodes",
        "--nnodes",
        type=_node_range,
        default=None,
        metavar="N|MIN:MAX",
        help="agents to wait for before planning (default cluster.nodes); MIN:MAX also refuses "
        "agents beyond MAX (cluster.max_nodes)",
    )
    master.add_argument("--steps", type=int, default=None, help="training steps (default training.steps)")
    master.add_argument(
        "--status-port",
        type=int,
        default=0,
        help="port of the live status page, behind the job's token (default 0: a free one; -1: no page)",
    )
    master.add_argument(
        "--status-host",
        default="127.0.0.1",
        help="address of the status page (default 127.0.0.1: this machine only; 0.0.0.0 for every interface)",
    )
    master.add_argument("--run-dir", default="", help="token and event log folder (default runs/<model>-<time>-<pid>)")
    master.add_argument("--token-file", default=None, help="job token file: read if it exists, else written (0600)")
    master.add_argument("--event-log", default=None, help="JSONL event log (default <run-dir>/events.jsonl)")
    # Set by ``oobleck-launch local`` for the master it runs: its resume command, and no banner or
    # closing lines (the launcher prints them).
    master.add_argument("--launched-by", default=None, help=argparse.SUPPRESS)
    _add_run_flags(master)
    _add_log_level(master, "info")

    agent = sub.add_parser("agent", help="run a node agent (one per node)")
    agent.add_argument("--master", "--rdzv-endpoint", required=True, metavar="HOST:PORT", help="the master's address")
    agent.add_argument(
        "--gpus",
        "--nproc-per-node",
        type=int,
        default=0,
        help="workers (GPUs) on this node (default: the job's cluster.gpus_per_node)",
    )
    agent.add_argument(
        "--node",
        default=None,
        help="node name, unique in the job (default: the host name); '-': a standby, which starts "
        "its worker template, then reads its name from stdin and only then registers (the "
        "local launcher keeps one for the next join); end of input: it exits",
    )
    agent.add_argument("--token-file", default=None, help="job token file (default: $OOBLECK_TOKEN)")
    agent.add_argument("--connect-timeout", type=float, default=60.0, help="seconds to wait for the master")
    agent.add_argument(
        "--left-exit-code",
        type=_exit_code,
        default=0,
        metavar="N",
        help="exit code after the node was planned out on its preemption notice while the job "
        "goes on (default 0; a Kubernetes Job needs a code its podFailurePolicy ignores, "
        "or it counts the pod as completed and never replaces it)",
    )
    agent.add_argument("--worker-target", default=None, help=argparse.SUPPRESS)  # module:function, development only
    _add_worker_start(agent)
    _add_log_level(agent, "info")

    export = sub.add_parser("export", help="write a checkpoint as a HuggingFace model directory (from_pretrained)")
    export.add_argument("--checkpoint", required=True, metavar="DIR", help="a checkpoint the engine wrote")
    export.add_argument("--to", required=True, metavar="OUT", help="new directory to write")
    export.add_argument(
        "--dtype",
        default=None,
        choices=("float32", "float64", "bfloat16", "float16"),
        help="weights' dtype (default: the source model's weights' dtype)",
    )
    export.add_argument("--max-shard-size", default="5GB", help="largest safetensors file (default 5GB)")

    local = sub.add_parser("local", help="master, N agents and their workers on this machine")
    local.add_argument("--config", required=True, help="job config YAML (see configs/)")
    local.add_argument(
        "--deepspeed",
        default=None,
        metavar="FILE",
        help="a DeepSpeed JSON config mapped onto the job's training section (docs/runtime.md)",
    )
    _add_set(local)
    local.add_argument(
        "--nodes",
        "--nnodes",
        type=_node_range,
        default=None,
        metavar="N|MIN:MAX",
        help="simulated nodes to start (default cluster.nodes); MIN:MAX starts MIN and accepts "
        "joins up to MAX (cluster.max_nodes)",
    )
    local.add_argument(
        "--gpus-per-node",
        "--nproc-per-node",
        type=int,
        default=None,
        help="CPU worker processes per node (default cluster.gpus_per_node)",
    )
    local.add_argument("--steps", type=int, default=None, help="training steps (default training.steps)")
    local.add_argument("--run-dir", default="", help="logs folder (default runs/<model>-<time>-<pid>)")
    local.add_argument("--event-log", default=None, help="JSONL event log (default <run-dir>/events.jsonl)")
    _add_run_flags(local)
    local.add_argument(
        "--log-level",
        choices=LOG_LEVELS,
        default=None,
        help="log detail of the console and the agents' logs (default: warning on the console, info in agent-*.log)",
    )
    local.add_argument(
        "--inject",
        action="append",
        default=[],
        metavar="SPEC",
        help="faults to inject, e.g. kill:node1@step4,stop:node2@t10s,join@step6 (repeatable)",
    )
    local.add_argument(
        "--no-figure",
        dest="figure",
        action="store_false",
        help="no run.png at the end (drawing it takes ~1 s of CPU; the recovery table is still printed)",
    )
    local.add_argument("--trace", default=None, metavar="FILE", help="replay a spot-instance trace (kills, joins)")
    local.add_argument("--time-scale", type=float, default=1.0, help="trace seconds -> run seconds (default 1)")
    local.add_argument(
        "--churn",
        default=None,
        metavar="SPEC",
        help="synthetic bursty spot churn, RATE[,burst=K,min=N,max=M,seed=S,spread=S,preempt=SHARE,"
        "notice=S,duration=S,start=S] (RATE: bursts per minute of run time; oobleck_mm.faults.churn)",
    )
    local.add_argument("--worker-target", default=None, help=argparse.SUPPRESS)
    _add_worker_start(local, local=True)


def _exit_code(text: str) -> int:
    try:
        code = int(text)
    except ValueError:
        code = -1
    if not 0 <= code <= 255 or code in (1, 2, 3):
        raise argparse.ArgumentTypeError(
            f"expected an exit code 0 or 4-255 (1, 2 and 3 mean a failure, a bad "
            f"input and a checkpoint to resume from), got {text!r}"
        )
    return code


def _add_worker_start(parser, local: bool = False) -> None:
    from oobleck_mm.agent.workers import DEFAULT_WORKER_START, WORKER_START_METHODS

    from oobleck_mm.runtime.template import SHARED_TEMPLATE

    if local:
        parser.add_argument(
            "--worker-start",
            choices=(SHARED_TEMPLATE, *WORKER_START_METHODS),
            default=SHARED_TEMPLATE,
            help="how the agents start their workers: forks of one worker template for all the "
            "simulated nodes, which imported torch and the engine once (shared), of a "
            "template per agent, as on a cluster (forkserver), or fresh interpreters (spawn) "
            f"(default {SHARED_TEMPLATE})",
        )
        return
    parser.add_argument(
        "--worker-start",
        choices=WORKER_START_METHODS,
        default=DEFAULT_WORKER_START,
        help="how an agent starts its workers: forks of a worker template that imported torch and "
        "the engine once (forkserver), or fresh interpreters (spawn) (default "
        f"{DEFAULT_WORKER_START})",
    )


def _add_log_level(parser, default: str) -> None:
    parser.add_argument(
        "--log-level",
        choices=LOG_LEVELS,
        default=default,
        help=f"log detail of this process (and its agents' in local) (default {default})",
    )


def _add_run_flags(parser) -> None:
    parser.add_argument(
        "--log-every",
        type=int,
        default=1,
        metavar="N",
        help="a console line every N steps (default 1); metrics.csv, TensorBoard and the event log get every step",
    )
    parser.add_argument(
        "--no-tensorboard",
        dest="tensorboard",
        action="store_false",
        help="no TensorBoard files (metrics.csv is always written in the run dir)",
    )
    parser.add_argument(
        "--resume",
        default=None,
        metavar="DIR|latest",
        help="continue from this checkpoint (any node count; the same results as never stopping); "
        "a run dir: its newest complete checkpoint; latest: the newest of --run-dir, else of "
        "runs/<model>-*",
    )
    parser.add_argument(
        "--save-final",
        default=None,
        metavar="DIR",
        help="write the final model and optimizer states here (python -m oobleck_mm.verify reads it)",
    )
    parser.add_argument(
        "--recovery",
        choices=("live", "restart"),
        default=None,
        help="on a failure: reconfigure the survivors (live) or restart from the last checkpoint "
        "(default fault_tolerance.recovery)",
    )
    parser.add_argument(
        "--checkpoint-interval",
        type=int,
        default=None,
        metavar="K",
        help="a periodic checkpoint every K steps, 0 for none (live mode writes it in the "
        "background; default fault_tolerance.checkpoint_interval)",
    )
