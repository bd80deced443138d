"""Part of the machine (``oobleck_mm.master.machine``): a restarted master (``--resume-master``) re-adopts the
journal's generation while its nodes' agents register again, then counts the missing ones lost.
"""

from __future__ import annotations

from oobleck_mm.master import slow_nodes, stopping
from oobleck_mm.master.context import Context, add_to_incident
from oobleck_mm.master.effects import StartProgress, WarmPlanner
from oobleck_mm.master.generations import SETTLE_S
from oobleck_mm.master.journal import Journal
from oobleck_mm.master.state import Generation, JobPhase
from oobleck_mm.master.stragglers import expected_compute


def adopt(ctx: Context, journal: Journal, seconds_since_start: float) -> None:
    """A restarted master (``--resume-master``): the journal's generations, as if this master had sent
    them; the nodes' agents register again and their workers train on (``ADOPTING``)."""
    s = ctx.s
    if s.phase is not JobPhase.WAITING or s.generation != 0:
        ctx.record("adopt_refused", phase=s.phase.value, generation=s.generation)
        ctx.because("a journal is adopted only by a master that has planned nothing")
        return
    for view in journal.views:
        plan = journal.plan if view.number == journal.generation else None
        s.gens[view.number] = Generation(view, plan, journal.template_nodes)
        ctx.effects.append(StartProgress(view, None, expected_compute(plan, view.layout)))
        slow_nodes.keep_only(ctx, view.nodes)
    s.generation = journal.generation
    s.checkpoints.last = journal.last_checkpoint
    s.pin = journal.pin
    s.adopting = (ctx.now, ctx.now + ctx.cfg.timeouts.adopt_window.total_seconds())
    s.last_progress = ctx.now
    s.started_at = ctx.now - max(0.0, seconds_since_start)  # the run is timed from the lost master's first plan
    s.phase = JobPhase.ADOPTING
    # This master's planning helper is new: it builds the templates while the agents come
    # back, so the first failure after the restart is planned as fast as any other.
    ctx.effects.append(WarmPlanner(journal.template_nodes))
    nodes = list(journal.current.nodes)
    window = ctx.cfg.timeouts.adopt_window.total_seconds()
    ctx.record("adopting", generation=journal.generation, nodes=nodes, window_s=window)
    ctx.say(
        f"re-adopting generation {journal.generation} on {len(nodes)} nodes ({', '.join(nodes)}): "
        f"waiting up to {window:.0f} s for their agents"
    )


ADOPT_QUIET_INTERVALS = 3
"""A restarted master whose adopted generation is broken stops waiting for the nodes still missing once
none came back for this many ``heartbeat_interval`` (the agents' retry period: a live agent is back
within one or two; measured under churn, the longest gap between two was 0.48 s of 0.5 s intervals)."""


def _broken_and_quiet(ctx: Context, back: list[str], began: float) -> bool:
    """Whether adoption may end before every node is back: a worker of the generation aborted (a peer it
    needs is gone, so the generation trains no more and waits for a plan), and no node came back for
    ``ADOPT_QUIET_INTERVALS`` heartbeat intervals. The rest of the window was all loss then: a kill
    during a master's absence held soak (c)'s survivors idle 4 s (``adopt_window``) for a dead node. A
    live node later than that registers again as a joiner, its state copied back."""
    s = ctx.s
    if s.abandoned is None:
        return False  # the workers still train: the window costs nothing, and every node back is kept
    quiet = ADOPT_QUIET_INTERVALS * ctx.cfg.timeouts.heartbeat_interval.total_seconds()
    last = max([began] + [s.registry.nodes[n].registered_at for n in back])
    return ctx.now >= last + quiet


def check_adopted(ctx: Context) -> None:
    """Every node of the journal's generation is back, or the window passed, or the generation broke and
    the nodes stopped coming back (``_broken_and_quiet``): running again. Nodes not back are lost (the
    usual recovery follows); nodes back with workers of another generation (the lost master died while
    sending it) make the generation re-form, from the states they hold."""
    s, now = ctx.s, ctx.now
    current = s.current_view()
    began, deadline = s.adopting or (now, now)
    if current is None:  # no event order leads here: adopt() sets both
        s.phase, s.adopting = JobPhase.RUNNING, None
        return
    back = [n for n in current.nodes if n in s.registry.nodes and s.registry.nodes[n].stream == "open"]
    if len(back) < len(current.nodes) and now < deadline and not _broken_and_quiet(ctx, back, began):
        return
    missing = [n for n in current.nodes if n not in back]
    other = [n for n in back if s.registry.nodes[n].adopt_generation != s.generation]
    s.adopting = None
    s.phase = JobPhase.RUNNING
    s.last_progress = now
    ctx.record(
        "adopted",
        generation=s.generation,
        nodes=back,
        missing=missing,
        other_generation=other,
        next_step=s.next_step,
        seconds=now - began,
    )
    window = ctx.cfg.timeouts.adopt_window.total_seconds()
    if not back:  # the job ended, or its agents gave up waiting (master_timeout) and wrote a checkpoint
        why = f"none of generation {s.generation}'s nodes came back within {window:g} s (fault_tolerance.adopt_window)"
        stopping.state_lost(
            ctx,
            why,
            f"{why}: nothing runs to re-adopt (the job ended, or its agents stopped: "
            "their logs name the checkpoint their workers wrote)",
        )
        return
    ctx.say(
        f"re-adopted generation {s.generation} on {len(back)} of {len(current.nodes)} nodes in "
        f"{now - began:.2f} s: training goes on at step {s.next_step + 1}"
        + (f"; not back: {', '.join(missing)}" if missing else "")
    )
    for name in missing:
        add_to_incident(ctx, "lost", name)
    if missing:
        s.settle_until = now + SETTLE_S
    if other:
        s.abandoned = (
            now - ctx.cfg.timeouts.reform_after.total_seconds(),
            f"{', '.join(other)} came back running another generation than {s.generation}",
        )
