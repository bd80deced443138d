"""The exact 1F1B time of a branched pipeline (``planning.branches``), on a template's plain numbers.

A stage runs DeepSpeed's ``TrainSchedule`` for its distance to the pipeline's end (a branch's stage ``k``
of ``K`` before the LLM's ``S`` stages runs stage ``k`` of ``K + S``; the LLM's stage ``j`` runs ``1 + j``
of ``1 + S``), executed instruction by instruction with blocking rendezvous transfers matched in order on
each directed channel; the LLM's first stage receives from every branch in branch order and sends each its
gradient. Kept apart from ``planning.branches`` (which plans branches with the chain planner) so that
``planning.template`` can time a branched template without importing the planner: the module graph stays
acyclic (``.importlinter``).
"""

from __future__ import annotations

from oobleck_mm.planning.pipeline_time import validate_count

EXTRAPOLATE_AFTER = 2
"""Microbatches per stage beyond which an iteration's time is extrapolated from the schedule's steady state."""
_PERIODS = (1, 2, 3, 4)


def steady_time(time_of, num_microbatches: int, num_stages: int) -> float:
    """``time_of(num_microbatches)``, or for many microbatches its extrapolation: a 1F1B schedule's iteration
    time is eventually periodic in the microbatch count (each ``c`` more microbatches add the same seconds,
    as ``pipeline_time`` finds for chains); found on a few counts past ``EXTRAPOLATE_AFTER`` per stage, and
    computed outright where no period shows."""
    base = EXTRAPOLATE_AFTER * num_stages
    if num_microbatches <= base + 2 * max(_PERIODS):
        return time_of(num_microbatches)
    times = [time_of(base + i) for i in range(3 * max(_PERIODS) + 1)]
    for c in _PERIODS:
        steps = [times[i + c] - times[i] for i in range(len(times) - c)]
        if max(steps) - min(steps) <= 1e-9 * max(times):
            cycles, extra = divmod(num_microbatches - base, c)
            return times[extra] + cycles * steps[0]
    return time_of(num_microbatches)


def iteration_time(template, num_microbatches: int) -> float:
    """Exact seconds of one iteration of a branched ``PipelineTemplate`` (``branches``, ``merge``; boundary k
    is stage k's outgoing transfer); beyond ``EXTRAPOLATE_AFTER`` microbatches per stage, from the schedule's
    steady state (``steady_time``)."""
    return steady_time(lambda m: simulate(template, m), num_microbatches, len(template.stages))


def simulate(template, num_microbatches: int) -> float:
    """Seconds of one iteration of a branched ``PipelineTemplate``; raises ``RuntimeError`` on deadlock."""
    validate_count("num_microbatches", num_microbatches)
    m = int(num_microbatches)
    return simulate_microbatches(
        template.branches,
        template.merge,
        [[st.forward_s] * m for st in template.stages],
        [[st.backward_s] * m for st in template.stages],
        template.send_activation_s,
        template.send_grad_s,
    )


def simulate_microbatches(branches, merge: int, forward, backward, send_activation_s=None, send_grad_s=None) -> float:
    """Seconds of one iteration of a branched pipeline whose microbatches differ: ``forward[s][j]`` and
    ``backward[s][j]`` are stage ``s``'s seconds of microbatch ``j`` (its ``j``-th forward and backward, as
    DeepSpeed's schedule runs them in order); ``send_activation_s[s]``/``send_grad_s[s]``: stage ``s``'s
    outgoing transfers (default free). The balancer's exact time of a branched pipeline
    (``balance.problem.BalanceProblem.predicted_times``); raises ``RuntimeError`` on deadlock."""
    from deepspeed.runtime.pipe import schedule as ds

    n = len(forward)
    m = len(forward[0]) if n else 0
    validate_count("num_microbatches", m)
    ends = (*branches[1:], merge)
    depth = n - merge
    nexts: list[int | None] = []
    prevs: list[list[int]] = []
    schedules = []
    act_s, grad_s = {}, {}
    for start, end in zip(branches, ends):
        for s in range(start, end):
            nexts.append(s + 1 if s + 1 < end else merge)
            prevs.append([] if s == start else [s - 1])
            schedules.append(ds.TrainSchedule(micro_batches=m, stages=end - start + depth, stage_id=s - start))
    for s in range(merge, n):
        nexts.append(s + 1 if s + 1 < n else None)
        prevs.append([end - 1 for end in ends] if s == merge else [s - 1])
        schedules.append(ds.TrainSchedule(micro_batches=m, stages=1 + depth, stage_id=1 + s - merge))
    for s in range(n - 1):
        act_s[(s, nexts[s])] = send_activation_s[s] if send_activation_s is not None else 0.0
        grad_s[(nexts[s], s)] = send_grad_s[s] if send_grad_s is not None else 0.0

    # Each stage's instructions as primitive operations: seconds of compute, or one end of a transfer on a
    # directed channel (kind, sender, receiver). A stage's forwards (and backwards) run its microbatches in order.
    ops: list[list[tuple]] = []
    for s, schedule in enumerate(schedules):
        stream = []
        forwards = backwards = 0
        for step in schedule:
            for cmd in step:
                if isinstance(cmd, ds.ForwardPass):
                    stream.append(("compute", forward[s][forwards]))
                    forwards += 1
                elif isinstance(cmd, ds.BackwardPass):
                    stream.append(("compute", backward[s][backwards]))
                    backwards += 1
                elif isinstance(cmd, ds.SendActivation):
                    stream.append(("send", ("act", s, nexts[s])))
                elif isinstance(cmd, ds.RecvActivation):
                    stream.extend(("recv", ("act", p, s)) for p in prevs[s])
                elif isinstance(cmd, ds.SendGrad):
                    stream.extend(("send", ("grad", s, p)) for p in prevs[s])
                elif isinstance(cmd, ds.RecvGrad):
                    stream.append(("recv", ("grad", nexts[s], s)))
                elif not isinstance(cmd, (ds.LoadMicroBatch, ds.ReduceTiedGrads, ds.ReduceGrads, ds.OptimizerStep)):
                    raise ValueError(f"stage {s}: no handling for instruction {cmd!r}")
        ops.append(stream)
    seconds = {
        **{("act", a, b): t for (a, b), t in act_s.items()},
        **{("grad", a, b): t for (a, b), t in grad_s.items()},
    }
    return _execute(ops, seconds)


def _execute(ops: list[list[tuple]], seconds: dict) -> float:
    """Runs every stage's operations; a transfer completes when both ends have reached it (the later
    arrival plus its seconds), so the n-th send on a channel pairs with its n-th receive."""
    pc = [0] * len(ops)
    clock = [0.0] * len(ops)
    waiting: dict[tuple, tuple[int, float]] = {}  # (channel, side) -> (stage, arrival)
    while True:
        progressed = False
        for s in range(len(ops)):
            while pc[s] < len(ops[s]):
                kind, what = ops[s][pc[s]]
                if kind == "compute":
                    clock[s] += what
                    pc[s] += 1
                    progressed = True
                    continue
                peer_side = (what, "recv" if kind == "send" else "send")
                if peer_side not in waiting:
                    waiting.setdefault((what, kind), (s, clock[s]))
                    break
                peer, peer_arrival = waiting.pop(peer_side)
                arrival = waiting.pop((what, kind), (s, clock[s]))[1]
                done = max(arrival, peer_arrival) + seconds[what]
                clock[s] = clock[peer] = done
                pc[s] += 1
                pc[peer] += 1
                progressed = True
        if all(pc[s] == len(ops[s]) for s in range(len(ops))):
            return max(clock)
        if not progressed:
            blocked = {s: ops[s][pc[s]] for s in range(len(ops)) if pc[s] < len(ops[s])}
            raise RuntimeError(f"branched pipeline deadlock: stages blocked at {blocked}")
