"""Part of the machine (``oobleck_mm.master.machine``): a straggler that stays slow is planned out for a while (issue 29).

A node ``oobleck_mm.master.stragglers`` found slow first gets a batch split priced for its
speed (``generations._with_speeds``). If it is still slow
``fault_tolerance.straggler_replan_after`` later, the planner weighs it once
(``planning.planner.weigh_bench``): the job's samples/s with the node kept and
re-split against the plan of the others. When the others are predicted faster,
the node is *benched*: left out of the next generation, switched at an
iteration boundary like a leave on notice (nothing lost: only nodes whose
layers the others also hold are weighed, and only while the others keep f + 1
replicas), its workers replaced by fresh ones, and taken back like a join once
``fault_tolerance.straggler_bench`` passed, when its speed is measured afresh.
A node benched again stays out twice as long (up to ``MAX_BENCH_DOUBLINGS``):
hysteresis, so that a node slow for good costs a plan per long bench, never a
plan every few steps.
"""

from __future__ import annotations

from dataclasses import replace

from oobleck_mm.master.context import Context
from oobleck_mm.master.recovery import GenerationView, orphan_layers, surviving_ranks
from oobleck_mm.master.state import Bench
from oobleck_mm.config.fault_tolerance import MAX_BENCH_DOUBLINGS
from oobleck_mm.protocol import oobleck_pb2 as pb


def bench_candidates(ctx: Context, current: GenerationView, keeps_replicas_from: int) -> tuple[str, ...]:
    """Slow nodes of ``current`` due to be weighed for a bench (``fault_tolerance.straggler_replan_after``
    passed since they were found slow, not weighed since), as many as the others can do without: they keep
    f + 1 replicas and hold every layer, so benching never stops the job or loses a state."""
    s, after = ctx.s, ctx.cfg.timeouts.straggler_replan_after
    if after is None or not ctx.cfg.timeouts.straggler_resplit or keeps_replicas_from <= 0:
        return ()
    due = sorted(
        (
            n
            for n in current.nodes
            if n in s.slow and n not in s.weighed and ctx.now - s.slow_since.get(n, ctx.now) >= after.total_seconds()
        ),
        key=lambda n: (-s.slow[n], n),
    )
    out: list[str] = []
    for node in due:  # the slowest first
        others = [n for n in current.nodes if n != node and n not in out]
        if len(others) >= keeps_replicas_from and not orphan_layers(current.layout, surviving_ranks(current, others)):
            out.append(node)
    return tuple(sorted(out))


def bench(ctx: Context, node: str, why: str) -> None:
    """Plans straggler ``node`` out for ``fault_tolerance.straggler_bench`` (doubled each time it is benched
    again): its workers finish the iteration in flight and make way for fresh ones (``pb.Bench``), and it
    joins again once the bench ended and they are ready, its speed measured afresh."""
    s = ctx.s
    entry = s.registry.nodes.get(node)
    if entry is None:  # no event order leads here: a lost node is never in a plan's request
        return
    times = s.benched[node].times + 1 if node in s.benched else 1
    seconds = ctx.cfg.timeouts.straggler_bench.total_seconds() * 2 ** min(times - 1, MAX_BENCH_DOUBLINGS)
    factor = s.slow.get(node, float("nan"))
    s.benched[node] = Bench(ctx.now + seconds, times)
    s.forget(node)  # what its workers hold is of no later generation; its speed is measured again on return
    entry.ready.clear()  # fresh workers report ready again
    ctx.send(
        node,
        pb.AgentEvent(
            bench=pb.Bench(
                reason=f"node {node} is slow ({factor:.2f}x): planned out for {seconds:.0f} s", seconds=seconds
            )
        ),
    )
    ctx.record(
        "straggler_benched", node=node, factor=factor, seconds=seconds, times=times, generation=s.generation, reason=why
    )
    ctx.say(
        f"node {node} is slow ({factor:.2f}x) and the job is predicted faster without it: benched for "
        f"{seconds:.0f} s from generation {s.generation}, then taken back like a join"
    )


def check_bench_returns(ctx: Context) -> None:
    """Says (once) that a bench ended: the node joins as soon as its fresh workers are ready."""
    s = ctx.s
    for node, b in sorted(s.benched.items()):
        if not b.returned and ctx.now >= b.until:
            s.benched[node] = replace(b, returned=True)
            if node in s.registry.nodes:
                ctx.record("straggler_returns", node=node, times=b.times, generation=s.generation)
                ctx.say(f"node {node}'s bench ended: it joins again once its workers are ready")
