"""Part of the machine (``oobleck_mm.master.machine``): deciding what to plan, applying plans, the journal.

A restarted master's re-adoption of the journal's generation is ``oobleck_mm.master.adoption``.

While waiting or running, whenever the live nodes differ from the current
generation's (a node lost, a node joined), the machine asks its recovery
policy (``oobleck_mm.master.policies``) what to plan and asks the planner (an
``AskPlanner`` effect). A plan the membership has overtaken while it was
computed is superseded at once: the latest membership is asked for, the old
call cancelled if it has not started, and its answer dropped when it comes
(``plan_superseded``). An answer that still fits becomes the next generation:
journaled first, then every worker gets its ``Assignment``.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from oobleck_mm.master.assignments import build_assignments
from oobleck_mm.master.checkpointing import cut_short
from oobleck_mm.master import slow_nodes, stopping
from oobleck_mm.master.benching import bench, bench_candidates
from oobleck_mm.master.context import Context, finish, write_journal
from oobleck_mm.master.effects import AskPlanner, CancelPlan, StartProgress
from oobleck_mm.master.stragglers import expected_compute
from oobleck_mm.master.inputs import PlanAnswered
from oobleck_mm.master.progress import Incident, layout_summary
from oobleck_mm.master.recovery import GenerationView, Request, StateLost, committed, previous_ranks
from oobleck_mm.master.state import Generation, JobPhase, PendingPlan
from oobleck_mm.errors import ExitCode
from oobleck_mm.planning.planner import Failed, Planned
from oobleck_mm.planning.reconfigure import CannotKeepReplicas
from oobleck_mm.planning.transfers import missing_states, rank_transfers
from oobleck_mm.protocol import oobleck_pb2 as pb

log = logging.getLogger(__name__)

MAX_REFORMS = 3
"""Re-forms of the same nodes in a row without a completed step before the job gives up: a
collective that times out again and again with every node alive is not the load of a moment
but a bug (collectives out of order) or a network that cannot carry the job."""
SETTLE_S = 0.03
"""After a loss, wait this long for others before planning: nodes that fail together (a rack, a
preemption wave) are seen milliseconds apart (their streams end together; a hung node's heartbeats
are judged at the same detector tick), and one plan for all beats a plan thrown away. It was 0.1 s:
under bursty churn (``scripts/soak_churn.py``, losses >= 1.5 s apart) that wait came on top of every
recovery, ~30 of them a run, while a later loss supersedes a plan anyway (``plan_superseded``)."""


# ---------------------------------------------------------------------- what to plan
def abandoned(ctx: Context) -> bool:
    """A worker of the current generation abandoned an iteration, and ``reform_after`` passed
    with no node lost: the generation cannot go on, and no loss will make the master plan."""
    a = ctx.s.abandoned
    return a is not None and ctx.now - a[0] >= ctx.cfg.timeouts.reform_after.total_seconds()


def wanted(ctx: Context) -> Request | StateLost | None:
    """What the next plan must account for now (None: nothing to plan)."""
    s = ctx.s
    live = s.registry.names()
    if s.phase is JobPhase.WAITING:
        if len(live) < ctx.cfg.num_nodes:
            return None
        names = tuple(live[: ctx.cfg.num_nodes])
        return Request(base=0, plan_from=0, lost=(), joined=names, live=names, failure=False)
    current = s.current_view()
    if current is None:
        return None  # running with no generation: no event order leads here, and there is nothing to plan from
    # A node joins once its workers are up: admitting it earlier would hold the survivors at the
    # rendezvous for its start-up (imports, warm-up: seconds) instead of only for the state copy.
    # A straggler on the bench joins once its bench ended.
    benched, planned = s.out_on_bench(ctx.now), set(current.nodes)
    live = [n for n in live if n in planned or (s.registry.nodes[n].all_ready and n not in benched)]
    return _with_speeds(ctx, current, ctx.policy.wanted(ctx.facts(abandoned(ctx)), current, live))


def _slow_of(ctx: Context, nodes) -> tuple[tuple[str, float], ...]:
    """The slow nodes among ``nodes`` and their factors, for the batch split (none with the action off)."""
    if not ctx.cfg.timeouts.straggler_resplit:
        return ()
    return tuple(sorted((n, f) for n, f in ctx.s.slow.items() if n in nodes))


def _with_speeds(ctx: Context, current: GenerationView, want: Request | StateLost | None):
    """Every plan is split for the nodes' speeds; with nothing else to plan, a change of speeds (a straggler
    found, or cleared) is a plan of its own: the same nodes and pipelines, the batch split again, switched at
    an iteration boundary once the current generation completed a step (like a join, nothing is abandoned)."""
    if isinstance(want, Request):
        return replace(want, slow=_slow_of(ctx, want.live))
    s = ctx.s
    source = s.gens.get(current.number)
    if want is not None or ctx.policy.name != "live" or source is None or source.plan is None:
        return want
    slow = _slow_of(ctx, current.nodes)
    bench = bench_candidates(ctx, current, source.keeps_replicas_from)
    if (slow == source.slow and not bench) or not committed(current, s.holdings) or s.next_step >= ctx.cfg.steps:
        return None
    return Request(current.number, current.number, (), (), current.nodes, failure=False, slow=slow, bench=bench)


def maybe_plan(ctx: Context) -> None:
    s = ctx.s
    want = wanted(ctx)
    pending = s.planning
    if pending is not None:
        if want == pending.request:
            return  # still the right question: wait for its answer
        # The membership (or the survivors' states) changed while it was planned: its answer could
        # only be thrown away. Drop it now, and ask for the latest membership once it settled.
        ctx.effects.append(CancelPlan(pending.id))
        ctx.record(
            "plan_superseded",
            id=pending.id,
            nodes=list(pending.request.live),
            asked_s=ctx.now - pending.asked_at,
            reason="the job changed while planning",
        )
        ctx.because(f"plan {pending.id} superseded")
        s.planning = None
    if ctx.now < s.settle_until:
        return  # other nodes of the same failure may still be on their way out
    if want is None:
        if s.phase is JobPhase.RUNNING and s.incident is not None and s.incident.cause == "lost" and s.planning is None:
            empty = [
                n
                for n in s.incident.nodes
                if (e := s.registry.nodes.get(n)) is not None and e.adopt_generation != s.generation
            ]
            if empty and s.abandoned is None:
                # Back, but as a new agent whose workers run nothing of this generation (a rebooted
                # machine under the same name): the generation cannot go on with it. It re-forms from
                # the states the others hold, and the node starts empty (found by the model test).
                s.abandoned = (
                    ctx.now - ctx.cfg.timeouts.reform_after.total_seconds(),
                    f"{', '.join(empty)} came back without workers of generation {s.generation}",
                )
                ctx.because(f"{', '.join(empty)} back without this generation's workers: re-form")
                maybe_plan(ctx)
                return
            # Declared lost, and back (registered again, its workers still in this generation and saying
            # so) before anything was planned without it: the generation goes on as it was.
            ctx.record(
                "incident_closed",
                cause=s.incident.cause,
                nodes=list(s.incident.nodes),
                generation=s.generation,
                reason="the nodes are back before a plan was needed",
            )
            ctx.say(
                f"{', '.join(s.incident.nodes)} back before a new generation was needed: generation "
                f"{s.generation} goes on"
            )
            s.incident = None
        return
    if isinstance(want, StateLost):
        if not stopping.checkpoint_before_leaving(ctx, want.reason):
            stopping.state_lost(ctx, want.reason, f"cannot recover: {want.reason}")
        return
    current = s.current_view()
    lost_now = current is not None and any(n not in want.live for n in current.nodes)
    counted = want.reform and not lost_now and s.abandoned is not None
    if counted and not _may_reform(ctx):
        return
    if s.phase is JobPhase.RUNNING:
        if s.incident is None:
            nodes = want.joined or want.live
            speeds = not want.failure and not want.joined and not want.lost
            if speeds:  # the nodes whose speed changed (found slow, or no longer), or weighed for a bench
                previous = s.gens.get(s.generation)
                changed = set(want.slow) ^ set(previous.slow if previous is not None else ())
                nodes = tuple(sorted({n for n, _ in changed} | set(want.bench))) or want.live
            cause = "abandoned" if counted else ("lost" if lost_now else "straggler" if speeds else "joined")
            if cause == "joined" and want.failure and not want.joined and s.newer_checkpoint() is not None:
                cause = "checkpoint"  # restart mode: a newer checkpoint than the one being loaded completed
            s.incident = Incident(cause, nodes, ctx.now)
        if ctx.policy.restarts_workers:
            _restart_workers(ctx, want)
    s.plans_asked += 1
    pending = PendingPlan(s.plans_asked, want, ctx.now)
    s.planning = pending
    source = s.gens.get(want.plan_from)
    if want.reform and source is not None and source.plan is not None:
        # The same nodes, the same plan: only a new generation (group, store prefix). Answered here.
        why = (
            (f"generation {s.generation} abandoned step {s.next_step} with no node lost: the same nodes and plan again")
            if counted
            # lost_now: a node of the current generation is not in this plan: a joiner that is gone, or
            # one left to join again once the survivors completed a step (``recovery._defer``)
            else (
                f"generation {s.generation}'s joiners are out of this plan (gone, or joining again once it "
                f"completed a step): the nodes of generation {want.plan_from} again, with its plan"
            )
        )
        if not counted and (s.incident is not None and s.incident.cause == "checkpoint"):
            why = "a newer checkpoint completed: the same nodes and plan again, from it"
        answer = Planned(
            source.plan,
            source.view.layout,
            dict(source.view.ranks),
            source.template_nodes,
            fresh=False,
            actions=("re-form",),
            seconds=0.0,
            reason=why,
            keeps_replicas_from=source.keeps_replicas_from,
        )
        apply(ctx, PlanAnswered(pending.id, answer))
        return
    if want.plan_from == 0 or source is None or source.plan is None:  # start, or journaled without its plan
        if s.phase is JobPhase.WAITING:
            ctx.say(f"planning pipelines for {len(want.live)} nodes")
        ctx.effects.append(AskPlanner(pending.id, "fresh", names=want.live, slow=want.slow or None))
    else:
        # The source's split was for slow nodes: a plan without any is split for the templates' speeds again.
        slow = want.slow if want.slow or source.slow else None
        ctx.effects.append(
            AskPlanner(
                pending.id,
                "reconfigure",
                template_nodes=source.template_nodes,
                base=source.plan,
                lost=want.lost,
                joined=want.joined,
                slow=slow,
                bench=want.bench,
            )
        )
    ctx.because(f"plan {pending.id} asked for {len(want.live)} nodes")


def _restart_workers(ctx: Context, request: Request) -> None:
    """Restart mode: every surviving agent kills its workers; fresh ones start on the next assignment."""
    s = ctx.s
    if s.restarted_for == s.generation:
        return  # already restarted for a failure of this generation
    s.restarted_for = s.generation
    newer = s.newer_checkpoint()
    if request.lost:
        reason = f"restart recovery after losing {', '.join(request.lost)}"
    elif newer is not None and s.abandoned is None:
        reason = (
            f"restart from the newer checkpoint of step {newer[1]}, completed after generation {s.generation} "
            f"was told to load step {s.pin[2] if s.pin else '?'}"
        )
    else:
        reason = "restart recovery after an iteration abandoned with no node lost"
    for node in request.live:
        ctx.send(node, pb.AgentEvent(restart=pb.RestartWorkers(reason=reason)))
    s.holdings.clear()  # every worker restarts empty: no holdings, no reports to wait for
    s.reported.clear()
    ctx.record("restart", generation=s.generation, nodes=list(request.live), reason=reason)


def _may_reform(ctx: Context) -> bool:
    """Counts a re-form; ends the job (exit 1) when ``MAX_REFORMS`` in a row completed no step."""
    s = ctx.s
    message = s.abandoned[1] if s.abandoned is not None else "no message"
    if s.reforms >= MAX_REFORMS:
        finish(
            ctx,
            ExitCode.ERROR,
            f"step {s.next_step} was abandoned in {s.reforms + 1} generations in a row "
            f"with every node alive (the last: {message}); {_abandoned_hint(message, ctx.cfg.timeouts)}",
        )
        return False
    s.reforms += 1
    ctx.record("reform", generation=s.generation, step=s.next_step, attempt=s.reforms, message=message)
    ctx.say(
        f"generation {s.generation} abandoned step {s.next_step + 1} with every node alive ({message}); "
        "the same nodes re-form"
    )
    return True


def _abandoned_hint(message: str, timeouts) -> str:
    """What a user can do when the same step keeps being abandoned with every node alive. A wait that timed
    out with no node lost waited on a live peer for longer than ``collective_timeout``: that peer's work
    between two transfers (long samples, a slow or overloaded host) takes longer than the bound."""
    if "timed out" not in message.lower() and "timeout" not in message.lower():
        return "see the agents' logs"
    bound = timeouts.collective_timeout.total_seconds()
    return (
        f"a wait on a live peer ran past collective_timeout ({bound:g} s: fault_tolerance.heartbeat_timeout "
        f"{timeouts.heartbeat_timeout.total_seconds():g} s + {bound - timeouts.heartbeat_timeout.total_seconds():g} s): "
        "a stage whose work between two transfers takes longer (long samples, a slow or overloaded host) needs "
        "a larger fault_tolerance.heartbeat_timeout; see the agents' logs"
    )


# ---------------------------------------------------------------------- applying a plan
def apply(ctx: Context, ev: PlanAnswered) -> None:
    s = ctx.s
    pending = s.planning
    if pending is None or pending.id != ev.id:
        ctx.because(f"the answer to plan {ev.id} comes after it was superseded or the job ended: dropped")
        return
    s.planning = None
    if s.phase not in (JobPhase.WAITING, JobPhase.RUNNING):
        ctx.because(f"plan {ev.id} answered while {s.phase.value}: dropped")
        return
    if ev.error:  # a bug in planning, or the helper process died: nothing the user can fix
        finish(ctx, ExitCode.ERROR, f"the planner failed: {ev.error}")
        return
    request = pending.request
    if wanted(ctx) != request:  # holdings changed while planning: the next tick plans again
        ctx.record("plan_discarded", nodes=list(request.live), reason="the job changed while planning")
        return
    outcome = ev.outcome
    if isinstance(outcome, Failed):
        code = ExitCode.BAD_INPUT if s.phase is JobPhase.WAITING else ExitCode.ERROR
        finish(ctx, code, f"planning {len(request.live)} nodes failed: {outcome.message}")
    elif isinstance(outcome, CannotKeepReplicas):
        stopping.below_threshold(ctx, request, outcome)
    elif isinstance(outcome, Planned):
        s.weighed.update(request.bench)  # once per time found slow, whatever the answer: no flapping
        benched = tuple(n for n in outcome.benched if n in request.bench)
        if request.bench and not benched:
            ctx.record("straggler_kept", nodes=list(request.bench), generation=s.generation, reason=outcome.reason)
            ctx.say(
                f"{', '.join(request.bench)} stay{'s' if len(request.bench) == 1 else ''} in the job, "
                f"slow: {outcome.reason.rsplit('; ', 1)[-1]}"
            )
        if not benched and _same_split(ctx, request, outcome):
            return
        _start_generation(ctx, request, replace(outcome, benched=benched))
    else:
        finish(ctx, ExitCode.ERROR, f"the planner answered {type(outcome).__name__}, not a plan (a bug)")


def _same_split(ctx: Context, request: Request, planned: Planned) -> bool:
    """A change of speeds whose plan is the current one (the same ranks, microbatches and, with the balancer
    on, slowed stages: a straggler's pipeline already has one microbatch, or its factor moved little) starts
    no generation: a switch for nothing costs a rendezvous (a 16x node's factor, read noisily, re-planned 24
    times in 350 steps). The current generation takes the new speeds as its own, so they are not asked for again; its
    workers' balancer keeps the factor it was sent (``StageLayout.slowdown``) until the next switch."""
    s = ctx.s
    current = s.gens.get(s.generation)
    if (
        current is None
        or request.failure
        or request.lost
        or request.joined
        or request.plan_from != s.generation
        or dict(planned.ranks) != dict(current.view.ranks)
    ):
        return False
    weighs_speeds = ctx.cfg.job.balance.enabled
    if _shape(planned.layout, weighs_speeds) != _shape(current.view.layout, weighs_speeds):
        return False
    split = [p.num_microbatches for p in planned.layout.pipelines]
    s.gens[s.generation] = replace(current, slow=request.slow)
    s.incident = None
    ctx.record(
        "speed_split_unchanged", generation=s.generation, slow=[list(x) for x in request.slow], microbatches=split
    )
    ctx.because(f"the split for the speeds {request.slow} is generation {s.generation}'s: no switch")
    return True


def _shape(layout, weighs_speeds: bool) -> list:
    """Per pipeline: its microbatches, and (when the workers' balancer weighs stages by their speed,
    ``StageLayout.slowdown``) which of its stages are slowed, not by how much. Without the balancer a
    stage's slowdown changes no work: the same microbatches are the same plan (on shared cores, a node whose
    factor wandered past 1.5x and back re-planned 8 times in 150 steps, each a switch for nothing)."""
    return [
        (
            p.num_microbatches,
            tuple(s.slowdown != 1.0 for s in p.stages) if weighs_speeds else (),
            tuple((s.layer_start, s.layer_end) for s in p.stages),
        )  # a re-cut for the speeds moves layers
        for p in layout.pipelines
    ]


def _start_generation(ctx: Context, request: Request, planned: Planned) -> None:
    s = ctx.s
    number = s.generation + 1
    layout = planned.layout
    view = GenerationView(number, layout, dict(planned.ranks))
    base_gen = s.gens.get(request.base) if request.base else None
    base = base_gen.view if base_gen is not None else None
    holding = [n for n in base.nodes if n not in request.lost] if base else []
    previous = previous_ranks(view.ranks, base, holding)
    if base is not None:  # the copies the workers will make: the same function, the same inputs
        transfers = rank_transfers(base.layout, layout, previous, view.rank_nodes)
        moved = len(transfers)
    else:
        transfers, moved = (), missing_states(None, layout, previous)
    source = s.gens.get(request.plan_from)
    # A re-form reuses its source's plan as it is: its split is the one planned for the source's speeds.
    slow = source.slow if request.reform and source is not None else request.slow
    slow = tuple((n, f) for n, f in slow if n not in planned.benched)
    s.gens[number] = Generation(
        view, planned.plan, planned.template_nodes, planned.keeps_replicas_from, slow, base=request.base
    )
    incident = s.incident if s.phase is JobPhase.RUNNING else None
    # This plan answers the incident: the next loss or join is a new one, timed from itself.
    s.incident = None
    s.abandoned = None
    s.generation, s.phase = number, JobPhase.RUNNING
    s.last_progress = ctx.now
    if number == 1:
        s.started_at = ctx.now
    ctx.record(
        "plan_decided",
        generation=number,
        nodes=list(view.nodes),
        layout=layout.to_dict(),
        describe=layout.describe(),
        predicted_samples_per_s=planned.samples_per_s,
        seconds=planned.seconds,
        previous_generation=request.base,
        lost=list(request.lost),
        joined=list(request.joined),
        layer_states_moved=moved,
        transfers=[[t.layer, t.src, t.dst] for t in transfers],
        fresh=planned.fresh,
        reason=planned.reason,
        actions=list(planned.actions),
        cause=incident.cause if incident else "start",
        since_detected_s=ctx.now - incident.detected_at if incident else None,
    )
    ctx.say(
        f"generation {number}: {layout_summary(layout)} on {len(view.nodes)} nodes, planned in "
        f"{planned.seconds:.2f} s"
        + (f" ({moved} layer states to move from generation {request.base})" if base else "")
        + f": {layout.describe()}"
    )
    ctx.effects.append(StartProgress(view, incident, expected_compute(planned.plan, layout)))
    slow_nodes.keep_only(ctx, view.nodes)
    fresh = _fresh_start(ctx, view) if base is None else None  # its pin journaled with it
    write_journal(ctx)  # before any worker may run the generation: a restarted master knows it
    # Only nodes that left on notice (alive until the iteration in flight ends) are dropped: the
    # workers switch at the boundary instead of abandoning that iteration.
    leaving = set(s.registry.leaving())
    at_boundary = base is not None and request.base == number - 1 and set(request.lost) <= leaving
    again = _checkpoint_cut_short(ctx, request) if base is not None else None
    _send_assignments(ctx, view, base, previous, at_boundary, checkpoint_again=again is not None, fresh=fresh)
    for name in sorted(leaving - set(view.nodes)):
        dismiss(ctx, name, "was planned out after its notice", at_boundary=at_boundary)
    for name in planned.benched:
        bench(ctx, name, planned.reason)
    if number == 1:
        ctx.say(
            f"starting {view.layout.world_size} workers: each builds its layers, then they meet "
            "(the first step follows)"
        )
    ctx.because(f"generation {number} started on {len(view.nodes)} nodes")


def _checkpoint_cut_short(ctx: Context, request: Request) -> int | None:
    """The periodic checkpoint (its step) that this generation's losses leave incomplete, said and
    recorded: the new generation checkpoints after its first step instead (``checkpointing.cut_short``)."""
    sending = ctx.cfg.sending
    if not (sending.checkpoint_async and request.lost):
        return None
    s = ctx.s
    step = cut_short(s.checkpoints, s.views(), sending.checkpoint_interval, s.next_step, request.lost)
    if step is not None:
        ctx.record(
            "checkpoint_cut_short",
            step=step,
            lost=list(request.lost),
            generation=s.generation,
            again_after_step=s.next_step,
        )
        ctx.say(
            f"the checkpoint of step {step} lost a writer ({', '.join(request.lost)}): generation "
            f"{s.generation} checkpoints again after its first step"
        )
    return step


def _fresh_start(ctx: Context, view: GenerationView) -> tuple[str, int]:
    """Where a generation nobody inherits state in starts (the job's start, a resume, or (restart mode) the
    last checkpoint), pinned against pruning until it trained a step."""
    resume_dir, start = ctx.policy.fresh_start(ctx.facts())
    ctx.s.pin = (view.number, resume_dir, start) if resume_dir else None
    return resume_dir, start


def _send_assignments(
    ctx: Context,
    view: GenerationView,
    base: GenerationView | None,
    previous: list[int],
    at_boundary: bool,
    checkpoint_again: bool = False,
    fresh: tuple[str, int] | None = None,
) -> None:
    if base is not None:
        resume_dir, start = "", ctx.s.next_step  # survivors carry the state (and agree on the step)
    else:
        resume_dir, start = fresh if fresh is not None else _fresh_start(ctx, view)
    for gpu, rank, event in build_assignments(
        view,
        ctx.cfg.sending,
        start_step=start,
        base=base,
        previous_ranks=previous if base else None,
        resume_dir=resume_dir,
        resume_chosen=bool(resume_dir) and resume_dir != ctx.cfg.options.resume_dir,
        at_boundary=at_boundary,
        checkpoint_after_first_step=checkpoint_again,
    ):
        ctx.send(gpu[0], event)
        ctx.record(
            "assignment_sent",
            generation=view.number,
            node=gpu[0],
            local_rank=gpu[1],
            rank=rank,
            previous_rank=previous[rank] if base else -1,
        )


def dismiss(ctx: Context, node: str, why: str, at_boundary: bool = True) -> None:
    """Tells a leaving node it may go: its workers finish the iteration in flight first
    (``at_boundary``), or, when the new generation abandons that iteration anyway (the survivors
    do not switch at a boundary: a loss came with the leave, or the generation in flight never
    started), stop at once. Staying would keep their sockets open, and a collective the survivors
    abandoned with this node absent (a join switch's start-step agreement) would hold each
    survivor's leave of the old group until the node's kill (the notice's end): 2.9-3.9 s
    under churn."""
    entry = ctx.s.registry.nodes[node]
    entry.dismissed = True
    # The stream stays open until the agent hangs up: its workers' reports of the iteration in
    # flight still count. Its hang-up then removes it (``StreamEnded``).
    ctx.send(node, pb.AgentEvent(shutdown=pb.Shutdown(reason=f"node {node} {why}", at_boundary=at_boundary)))
    ctx.record("left", node=node, reason=entry.leaving, why=why, generation=ctx.s.generation)


def check_done(ctx: Context) -> None:
    s = ctx.s
    current = s.current_view()
    if current is None or wanted(ctx) is not None:
        return  # a new generation is due: whoever finished will run it
    finished = (s.generation, ctx.cfg.steps - 1)
    if all(s.done.get(gpu, (0, -1)) >= finished for gpu in current.ranks):
        seconds = ctx.now - s.started_at
        ctx.record("done", generation=s.generation, steps=ctx.cfg.steps, last_step=ctx.cfg.steps - 1, seconds=seconds)
        first = ctx.cfg.options.resume_step
        if first > 0:  # a resumed run: what it trained, and the step the job reached
            finish(
                ctx,
                ExitCode.OK,
                f"done: {ctx.cfg.steps - first} steps trained in {seconds:.1f} s, steps "
                f"{first + 1}-{ctx.cfg.steps} (resumed at step {first}): the job reached "
                f"step {ctx.cfg.steps} of {ctx.cfg.steps}",
            )
        else:
            finish(ctx, ExitCode.OK, f"done: {ctx.cfg.steps} steps in {seconds:.1f} s")
