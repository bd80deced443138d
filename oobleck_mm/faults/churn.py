"""Synthetic bursty spot churn: ``--churn RATE[,burst=K,min=N,max=M,seed=S,...]`` as a timeline of injections.

Pure: a spec and the starting nodes in, ``FaultEvent`` values with ``seconds``
out, like ``faults.trace`` (one injector, one kind of input; the simulator
replays the same availability). Spot capacity is reclaimed and returned in
bursts: bursts arrive as a Poisson process of ``RATE`` per minute of run time;
each holds 1 to ``burst`` events, ``spread`` seconds apart at most (several
within one second: the case the master must plan once for). An event is a
kill, a preemption with notice (``preempt`` share) or a join, chosen so the
live node count stays within ``[min, max]``: a kill at ``min`` becomes a join,
a join at ``max`` a kill. Kills and preemptions hit a random live node
(seeded), joins are named ``node<K>`` one past the highest number used.

Grammar: ``RATE`` bursts per minute (a decimal > 0), then comma-separated
``key=value``: ``burst`` (max events per burst, default 3), ``min`` (default:
the starting count minus 2, at least 1), ``max`` (default: the starting count
plus 2), ``seed`` (default 0), ``spread`` (seconds, default 0.8), ``preempt``
(share of failures that are preemptions with notice, default 0), ``notice``
(seconds of notice, default 5), ``duration`` (seconds of run time to fill,
default 600), ``start`` (seconds before the first burst, default 2),
``warmup`` (seconds after its join before a node counts towards ``min``,
default 0: set it to the workers' start-up for a soak that must not go below
its threshold), ``calm`` (fewest seconds between two failures, default 0: a
failure due sooner becomes a join, or nothing at ``max``).

``calm`` is what separates churn the job must survive from churn that may end
it: with ``f = 1`` every layer has two holders, and two failures inside one
recovery (before the copy restored the second replica) lose every holder of a
layer half the time or so, which ends the job with exit 3 at its last
checkpoint, as it should. A soak that must exit 0 gives each recovery time to
finish (``calm=2`` on the built-in model and the tiny LLaVA); its bursts still
hold 2-3 events within a second (a failure among joins).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Sequence

from oobleck_mm.errors import UserError
from oobleck_mm.faults.spec import FaultEvent, node_number

GRAMMAR = (
    "RATE[,burst=K,min=N,max=M,seed=S,spread=SECONDS,preempt=SHARE,notice=SECONDS,duration=SECONDS,"
    "start=SECONDS,warmup=SECONDS,calm=SECONDS] (RATE: bursts per minute)"
)


@dataclass(frozen=True, slots=True)
class ChurnSpec:
    rate_per_min: float
    burst: int = 3
    min_nodes: int | None = None
    max_nodes: int | None = None
    seed: int = 0
    spread_s: float = 0.8
    preempt_share: float = 0.0
    notice_s: float = 5.0
    duration_s: float = 600.0
    start_s: float = 2.0
    warmup_s: float = 0.0
    """A node counts towards ``min`` only this long after it joined (its workers' start-up: a joiner that is
    not ready yet holds no state, so killing warm nodes while counting it would take the job below its
    threshold though ``min`` nodes live)."""
    calm_s: float = 0.0
    """Fewest seconds between two failures (kills and preemptions); 0: no bound."""


_INT_KEYS = {"burst": "burst", "min": "min_nodes", "max": "max_nodes", "seed": "seed"}
_FLOAT_KEYS = {
    "spread": "spread_s",
    "preempt": "preempt_share",
    "notice": "notice_s",
    "duration": "duration_s",
    "start": "start_s",
    "warmup": "warmup_s",
    "calm": "calm_s",
}


def parse_churn(text: str) -> ChurnSpec:
    """``--churn``'s value; ``UserError`` naming the bad part and the grammar."""
    head, *rest = [p.strip() for p in text.split(",")]
    try:
        rate = float(head)
    except ValueError:
        raise UserError(f"--churn: RATE must be bursts per minute (a number), got {head!r}; form: {GRAMMAR}") from None
    if not 0 < rate < math.inf:
        raise UserError(f"--churn: RATE must be a finite number > 0 of bursts per minute, got {head}")
    fields: dict = {}
    for part in rest:
        key, sep, value = part.partition("=")
        if not sep or key not in {**_INT_KEYS, **_FLOAT_KEYS}:
            raise UserError(f"--churn: unknown part {part!r}; form: {GRAMMAR}")
        try:
            fields[_INT_KEYS.get(key) or _FLOAT_KEYS[key]] = int(value) if key in _INT_KEYS else float(value)
        except ValueError:
            raise UserError(
                f"--churn: {key} must be a {'whole ' if key in _INT_KEYS else ''}number, got {value!r}"
            ) from None
    for key, value in fields.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise UserError(
                f"--churn: {key.removesuffix('_s').removesuffix('_share')} must be a finite number, got {value}"
            )
    spec = ChurnSpec(rate, **fields)
    if spec.burst < 1:
        raise UserError(f"--churn: burst must be >= 1 event, got {spec.burst}")
    if not 0 <= spec.preempt_share <= 1:
        raise UserError(f"--churn: preempt must be a share in [0, 1], got {spec.preempt_share}")
    for name in ("spread_s", "notice_s", "duration_s", "start_s", "warmup_s", "calm_s"):
        if getattr(spec, name) < 0:
            raise UserError(f"--churn: {name.removesuffix('_s')} must be >= 0 seconds, got {getattr(spec, name)}")
    return spec


def churn_timeline(spec: ChurnSpec, nodes: Sequence[str]) -> list[FaultEvent]:
    """Kills, preemptions and joins for a local cluster that starts as ``nodes``, in firing order."""
    low = spec.min_nodes if spec.min_nodes is not None else max(1, len(nodes) - 2)
    high = spec.max_nodes if spec.max_nodes is not None else len(nodes) + 2
    if not 1 <= low <= high:
        raise UserError(f"--churn: need 1 <= min ({low}) <= max ({high}) nodes")
    rng = random.Random(spec.seed)
    live = list(nodes)
    joined_at = {name: float("-inf") for name in nodes}
    next_index = 1 + max((node_number(n) for n in nodes), default=-1)
    out: list[FaultEvent] = []
    last_failure = float("-inf")
    t = spec.start_s
    burst_index = 0
    while True:
        burst_index += 1
        at = t
        for k in range(rng.randint(1, spec.burst)):
            if at > spec.start_s + spec.duration_s:
                break
            source = f"churn burst {burst_index} event {k + 1}"
            join = rng.random() < 0.5
            warm = [n for n in live if at - joined_at[n] >= spec.warmup_s]
            if join and len(live) >= high:
                join = False
            if not join and (len(live) <= low or len(warm) <= low or at - last_failure < spec.calm_s):
                join = len(live) < high
                if not join:
                    continue  # at max, and too few warm nodes to take one away: nothing this time
            if join:
                name = f"node{next_index}"
                next_index += 1
                live.append(name)
                joined_at[name] = at
                out.append(FaultEvent(kind="join", node=name, seconds=round(at, 3), source=source))
            else:
                victim = rng.choice(sorted(live))
                live.remove(victim)
                last_failure = at
                kind = "preempt" if rng.random() < spec.preempt_share else "kill"
                out.append(
                    FaultEvent(kind=kind, node=victim, seconds=round(at, 3), notice_s=spec.notice_s, source=source)
                )
            at += rng.uniform(0.05, spec.spread_s) if spec.spread_s > 0 else 0.0
        t = max(t + rng.expovariate(spec.rate_per_min / 60.0), at)  # bursts never overlap
        if t > spec.start_s + spec.duration_s:
            return out


def churn_trace(spec: ChurnSpec, nodes: Sequence[str]):
    """The same churn as a node-availability trace (``faults.trace.TraceEvent``): what the simulator
    replays (``oobleck-launch simulate --churn``), so a burst pattern is judged the same way on real
    processes and in the model. Notices are not kept (the simulator's ``--notice`` says that)."""
    from oobleck_mm.faults.trace import TraceEvent

    events = [TraceEvent(0, "add", name, 0) for name in nodes]
    for i, f in enumerate(churn_timeline(spec, nodes), start=1):
        ms = round((f.seconds or 0.0) * 1000)
        events.append(TraceEvent(ms, "add" if f.kind == "join" else "remove", str(f.node), i))
    return events
