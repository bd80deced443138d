"""Part of the machine (``oobleck_mm.master.machine``): how the job stops with nothing lost, and periodic checkpoints.

A job that cannot go on (too few nodes for f+1 replicas, a stop request,
nodes on notice holding the last copies) stops at a checkpoint: a *round*
(``checkpointing.CheckpointRound``) in which the nodes that hold the state
write it, or the newest complete periodic checkpoint, or, with neither, a
message that says so. Exit 3 and the resume command in every case with a
checkpoint. The decisions about checkpoints are ``oobleck_mm.master.checkpointing``'s,
answered in values; this module turns them into effects.
"""

from __future__ import annotations

import os

from oobleck_mm.master.checkpointing import (
    CheckpointRound,
    RoundFailed,
    RoundPending,
    RoundWritten,
    round_directory,
    round_verdict,
)
from oobleck_mm.master.context import Context, base_held_by_everyone_alive, cancel_planning, finish, write_journal
from oobleck_mm.master.effects import PrepareMeta, PruneCheckpoints, WriteMeta
from oobleck_mm.master.policies import ROUND, SHARES, keep_checkpoints
from oobleck_mm.master.recovery import GenerationView, Request
from oobleck_mm.master.state import TRAINING, JobPhase
from oobleck_mm.errors import ExitCode
from oobleck_mm.planning.layout import Gpu
from oobleck_mm.planning.reconfigure import CannotKeepReplicas
from oobleck_mm.protocol import oobleck_pb2 as pb


def request_stop(ctx: Context, reason: str) -> None:
    """A graceful stop (SIGTERM to the master or to ``local``): the workers write the step they are at
    and the job ends with exit 3 and the resume command (exit 0 would tell a scheduler the run is done).
    Before any step there is nothing to write: the job ends at once."""
    s = ctx.s
    if s.finish is not None or s.phase is JobPhase.CHECKPOINTING:
        ctx.because(f"a stop request while {s.phase.value}: already stopping")
        return
    ctx.record("stop_requested", reason=reason, phase=s.phase.value, next_step=s.next_step)
    base = base_held_by_everyone_alive(ctx) if s.phase in TRAINING else None
    headline = f"stopped on request ({reason})"
    if base is None or base.generation == 0:
        if ctx.cfg.options.resume_dir:  # nothing trained since the resume: it still resumes from there
            stop_below_threshold(ctx, reason, None, headline=headline)
        else:
            finish(ctx, ExitCode.ERROR, f"{headline} before any step: nothing to save")
        return
    _start_round(ctx, s.gens[base.generation].view, base.holding_nodes, headline, headline, requested=True)


def below_threshold(ctx: Context, request: Request, cannot: CannotKeepReplicas) -> None:
    s = ctx.s
    why = f"{cannot.reason} (live nodes {cannot.live_nodes}, need {cannot.needed})"
    ctx.record("below_threshold", live=cannot.live_nodes, needed=cannot.needed, reason=cannot.reason)
    if s.phase is JobPhase.WAITING:
        finish(ctx, ExitCode.BAD_INPUT, f"planning {len(request.live)} nodes failed: {why}")
        return
    base = s.gens.get(request.base)
    if ctx.policy.below_threshold(request) == ROUND and base is not None:
        writers = tuple(n for n in base.view.nodes if n not in request.lost and n in s.registry.nodes)
        _start_round(
            ctx,
            base.view,
            writers,
            why,
            f"only {cannot.live_nodes} nodes left, {cannot.needed} needed for f+1 replicas",
        )
    else:
        stop_below_threshold(ctx, why, s.checkpoints.last, "no worker had completed a step")


def checkpoint_before_leaving(ctx: Context, why: str) -> bool:
    """Nodes on notice hold the last copies of some layers: they and the others write a checkpoint of
    the step they are at while they still can, and the job stops there (exit 3, nothing lost)."""
    s = ctx.s
    leaving = s.registry.leaving()
    if not leaving or s.phase is not JobPhase.RUNNING:
        return False
    base = base_held_by_everyone_alive(ctx)
    if base is None or base.generation == 0:
        return False
    detail = why.removeprefix("the model state is gone: ")
    reason = f"{', '.join(leaving)} leave on notice with the last copies of some layers ({detail})"
    _start_round(
        ctx,
        s.gens[base.generation].view,
        base.holding_nodes,
        reason,
        f"{', '.join(leaving)} leave on notice holding the last copies of some layers",
    )
    return True


def _start_round(
    ctx: Context, gen: GenerationView, writers: tuple[str, ...], why: str, headline: str, requested: bool = False
) -> None:
    s = ctx.s
    if s.planning is not None:  # no plan is applied while the round runs; the job ends with it
        cancel_planning(ctx)
    directory = round_directory(
        ctx.cfg.options.checkpoint_root, s.generation, s.next_step, avoid=ctx.cfg.options.resume_dir
    )
    deadline = ctx.now + ctx.cfg.timeouts.checkpoint_round_timeout.total_seconds()
    s.round = CheckpointRound(directory, gen, writers, why, ctx.now, deadline, requested=requested)
    s.phase = JobPhase.CHECKPOINTING
    ctx.effects.append(PrepareMeta())  # while the workers write their layers
    _send_round(ctx, s.round)
    held = f" (held as generation {gen.number})" if gen.number != s.generation else ""
    ctx.say(
        f"{headline}: checkpointing the state after step {s.next_step}{held} (or after the step in flight, "
        f"if it completes first) to {os.path.dirname(directory)}"
    )


def _send_round(ctx: Context, r: CheckpointRound) -> None:
    ctx.record(
        "checkpoint_requested",
        dir=r.directory,
        generation=r.gen.number,
        writers=list(r.writers),
        surviving_ranks=r.surviving,
    )
    for node in r.writers:
        ctx.send(node, r.command())


def round_lost(ctx: Context, nodes: list[str]) -> None:
    """Writers of the round were lost: the others take over their layers, or the state is gone."""
    s = ctx.s
    r = s.round
    if r is None or not set(nodes) & set(r.writers):
        return
    for node in nodes:
        again = r.without(node)
        if again is None:
            why = f"node {node} was lost while checkpointing and took the last copy of some layers with it"
            s.round = None
            state_lost(ctx, why, f"{why}; the model state is gone")
            return
        r = again
    s.round = r
    _send_round(ctx, r)  # the remaining writers now own the lost nodes' layers


def check_round(ctx: Context) -> None:
    s = ctx.s
    r = s.round
    if r is None:  # no event order leads here (a round and the phase are set together): nothing to wait for
        finish(ctx, ExitCode.ERROR, "checkpointing with no checkpoint round (a bug)")
        return
    verdict = round_verdict(r, ctx.now)
    if isinstance(verdict, RoundPending):
        return
    if isinstance(verdict, RoundFailed):
        if r.complete() and _round_left_behind(ctx, r):
            return
        finish(ctx, ExitCode.ERROR, verdict.message)
        return
    assert isinstance(verdict, RoundWritten)
    # Named by the step the workers wrote: the round began at ``next_step``, and an iteration in flight may have
    # completed before the writes (the folder is renamed then, ``WriteMeta.written_to``).
    directory = round_directory(
        ctx.cfg.options.checkpoint_root, s.generation, verdict.step, avoid=ctx.cfg.options.resume_dir
    )
    ctx.effects.append(WriteMeta(directory, verdict.step, written_to=r.directory if directory != r.directory else ""))
    ctx.record(
        "checkpoint_written",
        dir=directory,
        step=verdict.step,
        layers=verdict.layers,
        seconds=verdict.seconds,
        generation=r.gen.number,
    )
    stop_below_threshold(ctx, r.reason, (directory, verdict.step), headline=r.reason if r.requested else None)


def _round_left_behind(ctx: Context, r: CheckpointRound) -> bool:
    """Writers that answered -1 (not holding the round's generation) had left it for one the master sent
    before the round began: a switch in flight (a join, a re-split) when the stop came, which they made at
    the step's boundary before they read the round's command. The round is asked again of the newest
    generation everyone alive holds once their reports say so; until the round's deadline it waits for
    them. True: asked again, or waiting; False: no such switch, the round has failed."""
    s = ctx.s
    if s.generation <= r.gen.number or all(d.step >= 0 for d in r.reports.values()):
        return False
    base = base_held_by_everyone_alive(ctx)
    if base is None or base.generation <= r.gen.number:
        return ctx.now <= r.deadline  # their reports of the new generation are still to come
    ctx.record(
        "checkpoint_round_again",
        generation=base.generation,
        previous_generation=r.gen.number,
        reason=f"the writers left generation {r.gen.number} for {base.generation} before they read the round",
    )
    _start_round(ctx, s.gens[base.generation].view, base.holding_nodes, r.reason, r.reason, requested=r.requested)
    return True


def state_lost(ctx: Context, why: str, without_checkpoint: str) -> None:
    """Some layer has no copy left: stop at the newest periodic checkpoint (exit 3, never 1 while one
    exists), else end the job as failed."""
    if ctx.s.checkpoints.last is not None:
        stop_below_threshold(ctx, why, ctx.s.checkpoints.last)
    else:
        finish(ctx, ExitCode.ERROR, without_checkpoint)


def stop_below_threshold(
    ctx: Context, why: str, checkpoint: tuple[str, int] | None, detail: str = "", headline: str | None = None
) -> None:
    """Ends the job with exit 3, saying how to resume (from ``checkpoint``, or the run's own resume point)."""
    options = ctx.cfg.options
    headline = headline or f"cannot keep f+1 replicas: {why}"
    if checkpoint is not None:
        directory, step = checkpoint
        message = (
            f"{headline}.\nCheckpoint of step {step} written to {directory}\n"
            f"resume with: {options.resume_command} --resume {directory}"
        )
    elif options.resume_dir:
        message = (
            f"{headline}.\nNo step was completed since the resume\n"
            f"resume with: {options.resume_command} --resume {options.resume_dir}"
        )
    else:
        message = f"{headline}. No checkpoint to resume from{': ' + detail if detail else ''}"
    finish(ctx, ExitCode.NO_REPLICAS, message)


# ---------------------------------------------------------------------- checkpoint reports
def on_checkpoint_done(ctx: Context, gpu: Gpu, done: pb.CheckpointDone) -> None:
    s = ctx.s
    if done.error:
        _checkpoint_failed(ctx, gpu, done)
        return
    if s.phase is JobPhase.CHECKPOINTING and s.round is not None and done.dir == s.round.directory:
        s.round.record(gpu, done)
        return
    if not done.dir:
        ctx.because(f"a checkpoint report from {gpu[0]}/gpu{gpu[1]} naming no directory: ignored")
        return
    completed = (
        s.checkpoints.record_share(s.views(), gpu, done)
        if ctx.policy.checkpoint_complete_by == SHARES
        else s.checkpoints.record_barrier_checkpoint(done)
    )
    if completed:  # a periodic checkpoint completed
        ctx.effects.append(WriteMeta(done.dir, done.step))
        # The journal names it before any older one is pruned (the shell's disk queue keeps this order): a
        # master restarted from a journal naming a pruned checkpoint restarted from it.
        write_journal(ctx)
        keep = keep_checkpoints(ctx.cfg.options.recovery, ctx.cfg.timeouts.keep_checkpoints)
        if keep:
            ctx.effects.append(PruneCheckpoints(done.dir, keep, s.pinned()))
        ctx.record(
            "checkpoint_saved", dir=done.dir, step=done.step, generation=s.generation, **s.checkpoints.last_timing
        )
        write_journal(ctx)


def _checkpoint_failed(ctx: Context, gpu: Gpu, done: pb.CheckpointDone) -> None:
    """A worker could not write its share (a full disk): said as such, never taken for a lost node."""
    s = ctx.s
    ctx.record("checkpoint_failed", dir=done.dir, step=done.step, node=gpu[0], local_rank=gpu[1], error=done.error)
    where = f"{gpu[0]}/gpu{gpu[1]}"
    r = s.round
    if s.phase is JobPhase.CHECKPOINTING and r is not None and done.dir == r.directory:
        finish(ctx, ExitCode.ERROR, f"the checkpoint to {r.directory} could not be written on {where}: {done.error}")
        return
    if done.dir in s.failed_checkpoints:
        return  # said once per checkpoint, not once per worker
    s.failed_checkpoints.add(done.dir)
    last = s.checkpoints.last
    ctx.say(
        f"checkpoint of step {done.step} could not be written on {where}: {done.error}; training goes on"
        f" (the last complete checkpoint: {f'step {last[1]} in {last[0]}' if last else 'none'})"
    )
