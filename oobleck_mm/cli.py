"""``oobleck-launch``: the one command-line entry point.

Subcommands: ``plan`` (templates, the best plan for N nodes and, with
``--fail-nodes``, the reconfiguration after losing them), ``master`` (the job's
coordinator), ``agent`` (one per node), ``local`` (master + N agents and
their workers on this machine), ``verify`` (a run against the reference
trainer), ``export`` (a checkpoint as a HuggingFace directory) and
``simulate`` (hours of node churn, per system). Exit codes (``oobleck_mm.errors.ExitCode``): 0
done, 2 a ``UserError`` (bad config, flag or checkpoint: one line on stderr
naming the field), 3 the job could not keep f+1 replicas, 1 a failed run or a
bug (any other exception: its traceback goes to the log).

The entry point is the one library module allowed to import ``master`` and
``agent`` (see ``.importlinter``).
"""

from __future__ import annotations

import argparse
import glob
import json
import logging
import os
import shlex
import signal
import socket
import sys
import time
import traceback
from typing import NoReturn, Sequence

from oobleck_mm.cli_args import build_parser
from oobleck_mm.cli_faults import (
    check_phase_targets,
    check_step_targets,
    faults_of,
    node_names,
    parse_fail_nodes,
    trace_file,
)
from oobleck_mm.errors import ExitCode, UserError
from oobleck_mm.lifetime import end_now


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "plan":
            return _cmd_plan(args)
        if args.command == "master":
            return _cmd_master(args)
        if args.command == "agent":
            return _cmd_agent(args)
        if args.command == "local":
            return _cmd_local(args)
        if args.command == "export":
            return _cmd_export(args)
        if args.command == "simulate":
            return _cmd_simulate(args)
        if args.command == "verify":
            from oobleck_mm.verify import main as verify

            return verify(args=args)
    except UserError as err:  # ConfigError, InfeasiblePlan, a bad flag or checkpoint: the user's to fix
        print(f"oobleck-launch: error: {err}", file=sys.stderr)
        return ExitCode.BAD_INPUT
    except Exception as err:  # a bug: say so, with the traceback, never as the user's mistake
        traceback.print_exc(file=sys.stderr)
        print(
            f"oobleck-launch: internal error (a bug, not your input): {err!r}; traceback above",
            file=sys.stderr,
            flush=True,
        )
        return ExitCode.ERROR
    raise AssertionError(f"unhandled command {args.command}")


def _cmd_plan(args: argparse.Namespace) -> int:
    from oobleck_mm.config import load_config
    from oobleck_mm.planning.planner import plan_job
    from oobleck_mm.profiling.load import load_profile

    from oobleck_mm.data.check import ensure_shape

    job = load_config(args.config, args.deepspeed, args.overrides)
    ensure_shape(job, lambda line: print(line, file=sys.stderr, flush=True))
    num_nodes = job.cluster.nodes if args.nodes is None else args.nodes
    if num_nodes < 1:
        raise UserError(f"--nodes: must be >= 1, got {num_nodes}")
    names = node_names(num_nodes)
    lost = parse_fail_nodes(args.fail_nodes, names)
    if args.join_nodes < 0:
        raise UserError(f"--join-nodes: must be >= 0, got {args.join_nodes}")
    joined = [f"node{num_nodes + i}" for i in range(args.join_nodes)]

    progress = None if args.json else (lambda line: print(line, file=sys.stderr, flush=True))
    start = time.perf_counter()
    profile = load_profile(job, progress)
    profile_s = time.perf_counter() - start
    if progress is not None:
        progress(f"profiled {profile.num_layers} layers ({profile.source}, {profile.device})")
    result = plan_job(job, profile, names, lost=lost, joined=joined, solver=args.solver, progress=progress)
    result.seconds = {"profile": profile_s, **result.seconds}
    placements = _placements(job, profile, result.plan, progress) if args.placements else None
    if args.json:
        out = result.to_dict()
        if placements is not None:
            out["placements"] = placements
        print(json.dumps(out, indent=2))
    else:
        print(result.format())
        for row in placements or ():
            print(row["line"])
    return ExitCode.OK


def _placements(job, profile, plan, progress) -> list[dict]:
    """Per distinct (nodes, microbatches) pipeline of ``plan``: the chain against the encoders as branches."""
    from oobleck_mm.planning.branches import place
    from oobleck_mm.planning.stage_mapping import planning_cluster

    cluster = planning_cluster(job, profile)
    rows = []
    for nodes, microbatches in sorted({(p.template.num_nodes, p.num_microbatches) for p in plan.pipelines}):
        if progress is not None:
            progress(f"placements: {nodes} node(s), {microbatches} microbatches")
        chosen = place(profile, cluster, nodes, microbatches)
        rows.append(
            {
                "nodes": nodes,
                "microbatches": microbatches,
                "chain_s": chosen.chain_s,
                "branches_s": chosen.branched_s,
                "faster": chosen.faster,
                "reason": chosen.reason,
                "branches": chosen.branched.describe() if chosen.branched is not None else None,
                "line": f"placement, {nodes} node(s) x {microbatches} microbatches: {chosen.faster} faster ("
                f"{chosen.reason}); planning.placement: auto plans the faster (one-GPU stages), chain keeps the chain"
                + (f"\n  branches: {chosen.branched.describe()}" if chosen.branched is not None else ""),
            }
        )
    return rows


def _cmd_simulate(args: argparse.Namespace) -> int:
    from oobleck_mm.config import load_config
    from oobleck_mm.faults.trace import read_trace
    from oobleck_mm.simulator import availability as av
    from oobleck_mm.simulator.params import SimParams
    from oobleck_mm.simulator.run import (
        apply_knob,
        format_results,
        parse_sweep,
        plot_results,
        results_to_json,
        simulate,
    )

    from oobleck_mm.data.check import ensure_shape

    job = load_config(args.config, args.deepspeed, args.overrides)
    ensure_shape(job, lambda line: print(line, file=sys.stderr, flush=True))
    if args.trace:
        events = read_trace(trace_file(args.trace))
        name = os.path.basename(args.trace)
        peak = av.from_trace(events, name).peak_nodes
        replicas = 1 if args.nodes is None else max(1, round(args.nodes / peak))
        availability = av.from_trace(events, name, replicas)
    elif args.churn:
        from oobleck_mm.faults.churn import churn_trace, parse_churn

        nodes = job.cluster.nodes if args.nodes is None else args.nodes
        availability = av.from_trace(churn_trace(parse_churn(args.churn), node_names(nodes)), f"churn {args.churn}")
    else:
        nodes = job.cluster.nodes if args.nodes is None else args.nodes
        availability = av.periodic(nodes, av.parse_duration(args.failure_interval), args.until_nodes)
    availability = availability.clipped(args.hours)
    if args.stragglers:
        availability = availability.with_stragglers(av.parse_stragglers(args.stragglers))
    params = SimParams(preemption_notice=args.notice, preempt_grace_s=av.parse_duration(args.grace))
    for item in args.param:
        key, _, value = item.partition("=")
        if not value:
            raise UserError(f"--param: expected NAME=VALUE, got {item!r}")
        job, params = apply_knob(job, params, key.strip(), value.strip())
    say = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    runs = [("", job, params)]
    if args.sweep:
        key, values = parse_sweep(args.sweep)
        runs = [(f"{key}={v}", *apply_knob(job, params, key, v)) for v in values]
    documents, last = [], []
    for label, run_job, run_params in runs:
        if label:
            print(f"\n## {label}")
        skew = None
        if run_params.skew_batches:
            from oobleck_mm.data.skew_samples import sampled_batches

            skew = sampled_batches(run_job, run_params.skew_batches)
        results = simulate(run_job, availability, args.system, run_params, progress=say, skew_samples=skew)
        print(format_results(results, availability))
        documents += results_to_json(results, availability, {"sweep": label} if label else None)
        last = results
    if args.json:
        text = json.dumps(documents, indent=2)
        if args.json == "-":
            print(text)
        else:
            with open(args.json, "w", encoding="utf-8") as fh:
                fh.write(text + "\n")
            say(f"wrote {args.json}")
    if args.plot:
        plot_results(last, availability, args.plot, f"{job.model.name}: {availability.source}")
        say(f"wrote {args.plot}")
    return ExitCode.OK


def _cmd_export(args: argparse.Namespace) -> int:
    from oobleck_mm.export import export_checkpoint

    print(f"exporting {args.checkpoint} to {args.to}", file=sys.stderr, flush=True)
    export_checkpoint(
        args.checkpoint,
        args.to,
        args.dtype,
        args.max_shard_size,
        progress=lambda line: print(line, file=sys.stderr, flush=True),
    )
    return ExitCode.OK


# --------------------------------------------------------------------------- control plane


def _setup_logging(prefix: str, level: int = logging.INFO) -> None:
    # Our processes log at ``level``; libraries (the MILP solver's chatter) only warnings.
    logging.basicConfig(
        level=logging.WARNING,
        format=f"%(asctime)s {prefix} %(levelname)s %(message)s",
        datefmt="%H:%M:%S",
        force=True,
    )
    for name in ("oobleck_mm.master", "oobleck_mm.agent"):
        logging.getLogger(name).setLevel(level)


def _level(name: str) -> int:
    return getattr(logging, name.upper())


def _load_job(args: argparse.Namespace):
    from oobleck_mm.config import apply_overrides, load_config

    for flag in ("steps", "gpus_per_node"):
        value = getattr(args, flag, None)
        if value is not None and value < 1:
            raise UserError(f"--{flag.replace('_', '-')}: must be >= 1, got {value}")
    if args.log_every < 1:
        raise UserError(f"--log-every: must be >= 1, got {args.log_every}")
    if args.checkpoint_interval is not None and args.checkpoint_interval < 0:
        raise UserError(f"--checkpoint-interval: must be >= 0, got {args.checkpoint_interval}")
    nodes, most = args.nodes if args.nodes is not None else (None, None)
    return apply_overrides(
        load_config(args.config, args.deepspeed, args.overrides),
        nodes=nodes,
        max_nodes=most,
        gpus_per_node=getattr(args, "gpus_per_node", None),
        steps=args.steps,
        recovery=args.recovery,
        checkpoint_interval=args.checkpoint_interval,
    )


def _resume_command(command: str, args: argparse.Namespace) -> str:
    """How to start this job again (``--resume DIR`` is appended where it is printed)."""
    ds = f" --deepspeed {os.path.abspath(args.deepspeed)}" if getattr(args, "deepspeed", None) else ""
    sets = "".join(f" --set {shlex.quote(item)}" for item in getattr(args, "overrides", []))
    # The named flags that change the job come along: a resumed --steps 3000 run stopped at the file's steps.
    named = ""
    nodes = getattr(args, "nodes", None)
    if nodes is not None:
        named += f" --nodes {nodes[0]}" + (f":{nodes[1]}" if nodes[1] is not None else "")
    for flag, attr in (
        ("--gpus-per-node", "gpus_per_node"),
        ("--steps", "steps"),
        ("--recovery", "recovery"),
        ("--checkpoint-interval", "checkpoint_interval"),
    ):
        if (value := getattr(args, attr, None)) is not None:
            named += f" {flag} {shlex.quote(str(value))}"
    # Where the results go come along too: a user who copies the command gets the final model where the
    # first run would have written it (issue 54). The logs go beside the first run's, not into them (its
    # event log, metrics and journal would mix two runs' steps).
    if save_final := getattr(args, "save_final", None):
        named += f" --save-final {shlex.quote(os.path.abspath(save_final))}"
    if run_dir := getattr(args, "run_dir", None):
        named += f" --run-dir {shlex.quote(resumed_run_dir(run_dir))}"
    return f"oobleck-launch {command} --config {os.path.abspath(args.config)}{ds}{sets}{named}"


def resumed_run_dir(run_dir: str) -> str:
    """The run dir the resume command gives a resumed run: beside the first one, ``-resumed`` (then
    ``-resumed2``, ...: a run resumed twice keeps each run's logs)."""
    path = os.path.abspath(run_dir).rstrip(os.sep)
    base, _, count = path.rpartition("-resumed")
    if base and (count == "" or count.isdigit()):
        return f"{base}-resumed{int(count or 1) + 1}"
    return f"{path}-resumed"


def _cmd_master(args: argparse.Namespace) -> int:
    from oobleck_mm.master.metrics import where_things_are
    from oobleck_mm.master.server import MasterOptions, MasterServer
    from oobleck_mm.runtime.limits import check_runnable

    journal = None
    if not args.resume_master and args.run_dir and not args.launched_by:
        from oobleck_mm.master.run_dir import running_job

        if (generation := running_job(args.run_dir)) is not None:
            # The same command started again (a scheduler restarting a master that died): starting a new
            # job would train the agents that wait for it from step 0.
            print(
                f"{args.run_dir} has the journal of a job its master never ended (generation {generation}): "
                f"re-adopting it as with --resume-master {args.run_dir}, with the journal's config; give "
                "another --run-dir for a new job",
                flush=True,
            )
            args.resume_master, args.config, args.run_dir, args.steps, args.nodes = args.run_dir, None, "", None, None
            args.overrides, args.resume, args.save_final, args.deepspeed = [], None, None, None
            args.port = args.port or None  # "any free port" would hide it from the agents: the journal's
    if args.resume_master:
        job, journal = _journaled_job(args)
    elif not args.config:
        raise UserError("master: --config FILE is required (or --resume-master RUN_DIR to restart a master)")
    else:
        job = _load_job(args)
        _resolve_resume(args, job)
    check_runnable(job, workers_here=False)
    _setup_logging("master", _level(args.log_level))
    host = args.host if args.host is not None else journal.host if journal else "127.0.0.1"
    port = args.port if args.port is not None else journal.port if journal else 29400
    resume_command = (
        journal.options["resume_command"] if journal else args.launched_by or _resume_command("master", args)
    )
    options = MasterOptions(
        host=host,
        port=port,
        run_dir=args.resume_master or args.run_dir,
        token_file=args.token_file,
        event_log=args.event_log,
        resume_dir=args.resume or "",
        save_final_dir=args.save_final or "",
        resume_command=resume_command,
        log_every=args.log_every,
        tensorboard=args.tensorboard,
        status_host=args.status_host,
        status_port=args.status_port,
        planner_start="fork",  # this process: nothing of gRPC's runs before the server starts
    )
    server = MasterServer(job, options, journal=journal)
    interrupted: list[int] = []
    # The handler only records the signal: the main loop ends the job (never from inside a handler).
    old = {s: signal.signal(s, lambda signum, _: interrupted.append(signum)) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.start()
        if not args.launched_by:
            print(
                f"master listening on {server.address} for {job.cluster.nodes} nodes, {job.training.steps} "
                f"steps\n  token file: {server.token_file}\n  event log:  {server.event_log_path}\n"
                f"  start each node with: oobleck-launch agent --master {_dial_address(server)} "
                f"--token-file {server.token_file}"
                + (f"\n  status page: {server.status.url()}?token=<the token file's>" if server.status else ""),
                flush=True,
            )
        stop_requested = False
        while (code := server.wait(0.2)) is None:
            if interrupted:
                signum = interrupted.pop()
                name = signal.Signals(signum).name
                if signum == signal.SIGTERM and not stop_requested:  # a scheduler's stop: checkpoint, exit 3
                    stop_requested = True
                    print(
                        f"{name}: stopping after a checkpoint of the current step ({name} again: at once)", flush=True
                    )
                    server.request_stop(name)
                else:
                    server.finish(ExitCode.ERROR, f"master interrupted by {name}")
    finally:
        server.stop()
        for sig, handler in old.items():
            signal.signal(sig, handler)
    agent_logs = os.path.join(server.run_dir, "agent-*.log")
    logs = server.event_log_path + (f", {agent_logs}" if glob.glob(agent_logs) else "")
    code = _report_exit(code, server.message, logs)
    if not args.launched_by:
        print(where_things_are(server.run_dir, server.event_log_path, server.options.tensorboard), flush=True)
    return code


def _journaled_job(args: argparse.Namespace):
    """(job, journal) of ``--resume-master RUN_DIR``: the job exactly as the lost master ran it."""
    from oobleck_mm.master.journal import read_journal
    from oobleck_mm.config import config_from_dict, parse_config_text

    given = [
        flag
        for flag, value in (
            ("--config", args.config),
            ("--resume", args.resume),
            ("--steps", args.steps),
            ("--nodes", args.nodes),
            ("--set", args.overrides),
            ("--run-dir", args.run_dir),
            ("--save-final", args.save_final),
            ("--deepspeed", args.deepspeed),
        )
        if value
    ]
    if given:
        raise UserError(
            f"--resume-master: {', '.join(given)} cannot change the job it re-adopts; the journal in "
            f"{args.resume_master} has its config and options"
        )
    journal = read_journal(args.resume_master)
    return config_from_dict(parse_config_text(journal.config_yaml)), journal


def _dial_address(server) -> str:
    """Where agents reach the master: its address, or this host's name when it listens on every interface."""
    from oobleck_mm.master.server import format_address

    if server.options.host in ("", "0.0.0.0", "::", "[::]"):
        return format_address(socket.getfqdn(), server.port)
    return server.address


def _cmd_agent(args: argparse.Namespace) -> int:
    from oobleck_mm.agent.agent import Agent
    from oobleck_mm.agent.options import AgentOptions
    from oobleck_mm.agent.workers import DEFAULT_WORKER_TARGET
    from oobleck_mm.protocol.auth import resolve_token

    if args.gpus < 0:
        raise UserError(f"--gpus: must be >= 0, got {args.gpus}")
    token = resolve_token(args.token_file)
    os.environ["OOBLECK_LOG_LEVEL"] = args.log_level  # its workers log at the same level
    # Workers inherit this: one torch thread each unless the user chose (torchrun does the same).
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    node = args.node or socket.gethostname().split(".")[0]
    if node == "-":  # a standby: the imports now, the name (and registration) when a join needs it
        from oobleck_mm.agent.workers import start_worker_template

        start_worker_template(args.worker_start, args.worker_target or DEFAULT_WORKER_TARGET)
        node = sys.stdin.readline().strip()
        if not node:
            return ExitCode.OK  # the launcher ended without needing this node
    _setup_logging(f"agent {node}", _level(args.log_level))
    options = AgentOptions(
        master=args.master,
        token=token,
        node=node,
        gpus=args.gpus,
        worker_target=args.worker_target or DEFAULT_WORKER_TARGET,
        connect_timeout_s=args.connect_timeout,
        worker_start=args.worker_start,
        left_exit_code=args.left_exit_code,
    )
    return Agent(options).run()


def _resolve_resume(args: argparse.Namespace, job) -> None:
    """``--resume latest`` (the newest complete checkpoint of this job's runs: ``--run-dir``, else every
    ``runs/<model>-*``) or ``--resume RUN_DIR`` (the newest one inside it) becomes that checkpoint's folder;
    a checkpoint's own folder is kept as given. ``UserError`` says where it looked."""
    if not getattr(args, "resume", None):
        return
    from oobleck_mm.runtime.checkpoint_meta import newest_checkpoint

    if args.resume == "latest":
        roots = [args.run_dir] if args.run_dir else sorted(glob.glob(os.path.join("runs", f"{job.model.name}-*")))
        where = args.run_dir or os.path.join("runs", f"{job.model.name}-*")
    elif os.path.isdir(args.resume) and not os.path.exists(os.path.join(args.resume, "meta.json")):
        roots, where = [args.resume], args.resume
    else:
        return
    found = newest_checkpoint(roots)
    if found is None:
        raise UserError(
            f"--resume {args.resume}: no complete checkpoint (a folder with meta.json) under {where}; "
            "give a checkpoint folder, a run dir that has one, or --run-dir with latest"
        )
    print(f"--resume {args.resume}: the newest complete checkpoint is {found[0]} (step {found[1]})", flush=True)
    args.resume = found[0]


def _cmd_local(args: argparse.Namespace) -> int:
    from oobleck_mm.master.local import LocalCluster, LocalOptions
    from oobleck_mm.master.metrics import where_things_are

    from oobleck_mm.runtime.limits import check_runnable

    job = _load_job(args)
    _resolve_resume(args, job)
    check_runnable(job, workers_here=True)
    faults = faults_of(args, job.cluster.nodes)
    check_phase_targets(faults, job, bool(args.save_final))
    check_step_targets(faults, job.training.steps)
    # Warnings by default: the console shows progress; details are in the event log.
    _setup_logging("local", _level(args.log_level or "warning"))
    options = LocalOptions(
        run_dir=args.run_dir,
        event_log=args.event_log,
        worker_target=args.worker_target,
        worker_start=args.worker_start,
        resume_dir=args.resume or "",
        save_final_dir=args.save_final or "",
        resume_command=_resume_command("local", args),
        faults=faults,
        log_every=args.log_every,
        tensorboard=args.tensorboard,
        figure=args.figure,
        log_level=args.log_level or "info",
        master_log_level=args.log_level or "warning",
    )
    cluster = LocalCluster(job, options)
    code = cluster.run()
    if cluster.message:  # the launcher ended the run; otherwise its master said why, on this console
        _report_exit(code, cluster.message, ", ".join([cluster.event_log_path, *cluster.log_paths()]))
    print(where_things_are(cluster.run_dir, cluster.event_log_path, args.tensorboard), flush=True)
    return code


def _report_exit(code: int, message: str, logs: str) -> int:
    if code == ExitCode.OK:
        print(message, flush=True)
    elif code == ExitCode.NO_REPLICAS:  # not a crash: the job saved itself and says how to go on
        print(f"oobleck-launch: stopped: {message}\nlogs: {logs}", file=sys.stderr, flush=True)
    else:
        print(f"oobleck-launch: error: {message}; logs: {logs}", file=sys.stderr, flush=True)
    return code


ENDS_AT_ONCE = ("verify", "export")
"""Commands whose process ends at once when done (``lifetime.end_now``): they load torch and hold nothing
to release after their last line, and Python's teardown of torch took 1.3 s more."""


def entry() -> NoReturn:
    """The ``oobleck-launch`` command (``main`` is the same from Python, which never ends its caller)."""
    argv = sys.argv[1:]
    code = main(argv)
    if argv[:1] and argv[0] in ENDS_AT_ONCE:
        end_now(int(code))
    sys.exit(code)


if __name__ == "__main__":
    entry()
