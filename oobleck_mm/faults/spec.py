"""Fault-injection specs: ``kill:node1@step4,stop:node3@t12.5s`` parsed into ``FaultEvent`` values.

Pure parsing, no processes. One grammar serves ``--inject`` and trace replay
(``oobleck_mm.faults.trace`` builds the same ``FaultEvent`` values), so the
injector has one kind of input.

Forms (one token each; tokens are comma-separated, flags may repeat):

    kill:NODE@WHEN            SIGKILL the node's agent and all its workers (a crashed node)
    killworker:NODE@WHEN      SIGKILL one worker of the node (local rank 0)
    killworker:NODE:gpuK@WHEN SIGKILL the worker of local rank K
    stop:NODE@WHEN            SIGSTOP the agent and all its workers (a hung node)
    preempt:NODE@WHEN[+Ts]    a spot preemption: SIGTERM to the agent (the provider's notice),
                              then SIGKILL of the agent and its workers T seconds later
                              (default 30, GCP's notice) if they are still there
    killmaster@WHEN           SIGKILL the master process (and its planning helper); the launcher
                              restarts it with --resume-master and it re-adopts the running job
    join@WHEN                 start a new agent (named by the launcher)
    join:NODE@WHEN            start a new agent named NODE
    slow:NODE@WHEN[xF][+Ts]   a straggler: the node's workers run F times slower (default 2) for T
                              seconds (no +Ts: for good), then at full speed again; its agent keeps
                              its pace (a slow GPU, not a silent node). ``oobleck_mm.faults.slowdown``

    WHEN = stepN   once N steps are complete (the console printed "step N/..."): the
                   failure hits the next step, which the console and the recovery
                   table call step N+1; step0 = as soon as the first plan is decided
         | tXs     X seconds (a decimal) after the first step completed
         | phase:P the node's worker is inside phase P (failures only), so a failure lands
                   there on purpose instead of by timing luck:
                     copy        a re-formed generation's state copy (after its rendezvous)
                     rendezvous  joining a re-formed generation (before its arrival)
                     checkpoint  a collective checkpoint, its layer files written, before
                                 the agreement (restart mode, --save-final)
                     forming     forming a join's (or a leave's) groups in the background,
                                 before its arrival, while the old generation trains on
                     registered  the node has just registered (a joiner, before admission)
                   For copy, rendezvous, checkpoint and forming the launcher makes the node's worker
                   hold there (``runtime/hold.py``, ``PHASE_HOLD_S``) and report it; the
                   fault fires on that report.

Several events at the same step fire together: simultaneous failures.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable

from oobleck_mm.errors import UserError

KINDS = ("kill", "killworker", "stop", "preempt", "killmaster", "join", "slow")
FAILURE_KINDS = ("kill", "killworker", "stop", "preempt", "killmaster")
MASTER = "master"
"""The ``node`` of a ``killmaster`` event (in the event log and the recovery table)."""
DEFAULT_NOTICE_S = 30.0
"""``preempt`` without ``+Ts``: seconds from the notice to the kill (GCP's spot notice)."""
DEFAULT_SLOWDOWN = 2.0
"""``slow`` without ``xF``: the node runs at half speed."""

NODE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
"""The master's rule for node names (``oobleck_mm/master/coordinator.py``)."""

VALID_FORMS = (
    "kill:NODE@stepN, killworker:NODE[:gpuK]@stepN, stop:NODE@stepN, preempt:NODE@stepN[+Ts], "
    "killmaster@stepN, join[:NODE]@stepN, slow:NODE@stepN[xF][+Ts] (or @tXs for X seconds after the first step, e.g. kill:node1@t12.5s; a failure also "
    "@phase:P, P one of copy, rendezvous, connect, checkpoint, forming, registered)"
)

_STEP = re.compile(r"^step(\d+)$")
_TIME = re.compile(r"^t(\d+(?:\.\d*)?|\.\d+)s$")
_GPU = re.compile(r"^gpu(\d+)$")
_NOTICE = re.compile(r"^(\d+(?:\.\d*)?|\.\d+)s$")
_FACTOR = re.compile(r"^(\d+(?:\.\d*)?|\.\d+)$")
PHASES = ("copy", "rendezvous", "connect", "checkpoint", "forming", "registered")
"""Phases a failure can be aimed at (``@phase:P``)."""
HELD_PHASES = PHASES[:5]
"""Phases the target's worker holds in until the fault lands (the rest are events of the master)."""
PHASE_HOLD_S = 20.0
"""How long the target's worker holds in its phase: the fault lands within milliseconds of the
report; the bound only matters if it never comes (the job ended first)."""


@dataclass(frozen=True, slots=True)
class FaultEvent:
    """One thing to inject. Exactly one of ``step`` and ``seconds`` is set."""

    kind: str
    """``kill`` | ``killworker`` | ``stop`` | ``join``."""
    node: str | None
    """The node to hit; for ``join`` the new node's name, or None to let the launcher name it."""
    step: int | None = None
    """Fire once this many steps are complete."""
    seconds: float | None = None
    """Fire this many seconds after the first step completed."""
    phase: str | None = None
    """Fire once the node is in this phase (``PHASES``)."""
    local_rank: int = 0
    """``killworker`` only: which worker of the node."""
    notice_s: float = DEFAULT_NOTICE_S
    """``preempt`` only: seconds from the notice (SIGTERM) to the kill."""
    factor: float = DEFAULT_SLOWDOWN
    """``slow`` only: how many times slower the node's workers run (> 1)."""
    duration_s: float | None = None
    """``slow`` only: seconds the slowdown lasts; None: until the job ends."""
    source: str = ""
    """Where it came from (the spec token, or the trace line), for the event log."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise UserError(f"fault kind {self.kind!r} is not one of {', '.join(KINDS)}")
        if sum(x is not None for x in (self.step, self.seconds, self.phase)) != 1:
            raise UserError(f"fault {self.source or self.kind!r}: give exactly one of step, seconds and phase")
        if self.phase is not None and (self.phase not in PHASES or self.kind not in FAILURE_KINDS):
            raise UserError(
                f"fault {self.source or self.kind!r}: @phase:P is for failures, P one of {', '.join(PHASES)}"
            )
        if self.kind == "killmaster" and (self.node != MASTER or self.phase is not None):
            raise UserError(f"fault {self.source or self.kind!r}: killmaster takes no node and no @phase")
        if self.node is None and self.kind != "join":
            raise UserError(f"fault {self.source or self.kind!r}: {self.kind} needs a node")
        if self.kind == "slow" and not self.factor > 1:
            raise UserError(
                f"fault {self.source or self.kind!r}: the slowdown factor must be > 1 (x2: half "
                f"speed), got {self.factor:g}"
            )

    @property
    def is_failure(self) -> bool:
        return self.kind in FAILURE_KINDS

    def due(self, steps_done: int | None, elapsed_s: float | None) -> bool:
        """Whether to fire now. ``steps_done``: completed steps (0 once a plan exists, None before);
        ``elapsed_s``: seconds since the first step completed (None before)."""
        if self.phase is not None:
            return False  # fired by the event that says the node is there (``reached``)
        if self.step is not None:
            return steps_done is not None and steps_done >= self.step
        return elapsed_s is not None and elapsed_s >= self.seconds

    def reached(self, event: dict) -> bool:
        """Whether the master's ``event`` says this fault's node is in its phase."""
        if self.phase is None or event.get("node") != self.node:
            return False
        if self.phase == "registered":
            return event.get("event") == "registered"
        return event.get("event") == "holding" and event.get("point") == self.phase

    def describe(self) -> str:
        target = "" if self.kind == "killmaster" else self.node or ""
        if self.kind == "killworker":
            target += f":gpu{self.local_rank}"
        when = (
            f"step{self.step}"
            if self.step is not None
            else f"phase:{self.phase}"
            if self.phase is not None
            else f"t{self.seconds:g}s"
        )
        if self.kind == "preempt":
            when += f"+{self.notice_s:g}s"
        if self.kind == "slow":
            when += f"x{self.factor:g}" + (f"+{self.duration_s:g}s" if self.duration_s is not None else "")
        return f"{self.kind}{':' if target else ''}{target}@{when}"


def parse_inject(specs: str | Iterable[str]) -> list[FaultEvent]:
    """Every event of one ``--inject`` value, or of several (a repeated flag), in the order given."""
    values = [specs] if isinstance(specs, str) else list(specs)
    events = []
    for value in values:
        for token in value.split(","):
            token = token.strip()
            if not token:
                raise UserError(f"--inject {value!r}: empty event (stray comma?); valid forms: {VALID_FORMS}")
            events.append(parse_token(token))
    return events


def parse_token(token: str) -> FaultEvent:
    """One event, e.g. ``killworker:node2:gpu1@step6``; ValueError naming the token otherwise."""
    what, at, when = token.partition("@")
    if not at or not when:
        _bad(token, "missing '@stepN', '@tXs' or '@phase:P'")
    when, plus, notice = when.partition("+")
    kind, *parts = what.split(":")
    if kind not in KINDS:
        _bad(token, f"unknown kind {kind!r}")
    factor = DEFAULT_SLOWDOWN
    if kind == "slow" and not when.startswith("phase:") and "x" in when:
        when, _, times = when.rpartition("x")
        if not (m := _FACTOR.match(times)) or not float(m.group(1)) > 1:
            _bad(token, f"bad slowdown {'x' + times!r}: expected xF with F > 1, e.g. x2 (half speed)")
        factor = float(times)
    step, seconds, phase = _parse_when(token, when)
    if plus and kind not in ("preempt", "slow"):
        _bad(token, f"'+{notice}' (the kill after a notice, how long a slowdown lasts) is for preempt and slow only")
    notice_s, duration_s = DEFAULT_NOTICE_S, None
    if plus:
        if not (m := _NOTICE.match(notice)):
            what = "notice" if kind == "preempt" else "duration"
            _bad(token, f"bad {what} {notice!r}: expected Ts (T seconds >= 0), e.g. +10s")
        if kind == "preempt":
            notice_s = float(m.group(1))
        else:
            duration_s = float(m.group(1))
    node, local_rank = _parse_target(token, kind, parts)
    if phase is not None and kind not in FAILURE_KINDS:
        _bad(token, "@phase:P is for failures (kill, killworker, stop, preempt)")
    return FaultEvent(
        kind=kind,
        node=node,
        step=step,
        seconds=seconds,
        phase=phase,
        local_rank=local_rank,
        notice_s=notice_s,
        factor=factor,
        duration_s=duration_s,
        source=token,
    )


def _parse_when(token: str, when: str) -> tuple[int | None, float | None, str | None]:
    if m := _STEP.match(when):
        return int(m.group(1)), None, None
    if m := _TIME.match(when):
        return None, float(m.group(1)), None
    if when.startswith("phase:"):
        if when[6:] not in PHASES:
            _bad(token, f"unknown phase {when[6:]!r}: one of {', '.join(PHASES)}")
        return None, None, when[6:]
    _bad(token, f"bad time {when!r}: expected stepN (N >= 0), tXs (X seconds >= 0) or phase:P")
    raise AssertionError  # unreachable: _bad raises


def _parse_target(token: str, kind: str, parts: list[str]) -> tuple[str | None, int]:
    if kind == "join":
        if len(parts) > 1:
            _bad(token, "join takes at most a node name")
        node = parts[0] if parts else None
    elif kind == "killmaster":
        if parts:
            _bad(token, "killmaster takes no node")
        return MASTER, 0
    elif kind == "killworker":
        if len(parts) not in (1, 2):
            _bad(token, "killworker takes NODE or NODE:gpuK")
        node = parts[0]
    else:
        if len(parts) != 1:
            _bad(token, f"{kind} takes exactly one node")
        node = parts[0]
    if node is not None and not NODE_NAME.match(node):
        _bad(token, f"bad node name {node!r} (letters, digits, '.', '_', '-'; at most 64)")
    local_rank = 0
    if kind == "killworker" and len(parts) == 2:
        if not (m := _GPU.match(parts[1])):
            _bad(token, f"bad worker {parts[1]!r}: expected gpuK, e.g. gpu0")
        local_rank = int(m.group(1))
    return node, local_rank


def check_targets(faults: Iterable[FaultEvent], nodes: Iterable[str]) -> None:
    """Raises ``UserError`` naming a fault whose node this run will never have.

    A run has its starting ``nodes`` and the nodes its joins add (a join's own name, or
    the launcher's next ``node<K>``); a failure aimed at any other name would be skipped
    silently at run time, leaving the user to wonder why nothing happened.
    """
    faults = list(faults)
    known = list(nodes)
    named = [f.node for f in faults if f.kind == "join" and f.node is not None]
    following = 1 + max((node_number(n) for n in [*known, *named]), default=-1)
    unnamed = sum(1 for f in faults if f.kind == "join" and f.node is None)
    joined = named + [f"node{following + i}" for i in range(unnamed)]
    valid = set(known) | set(joined)
    for fault in faults:
        if (fault.is_failure or fault.kind == "slow") and fault.kind != "killmaster" and fault.node not in valid:
            joins = f"; joins add {', '.join(joined)}" if joined else ""
            raise UserError(
                f"--inject {fault.source or fault.describe()}: node {fault.node!r} is not in this run "
                f"(nodes {', '.join(known)}{joins})"
            )


def hold_points(faults: Iterable[FaultEvent]) -> str:
    """``OOBLECK_HOLD_AT`` entries that make each ``@phase:P`` target's worker wait in P for its fault."""
    return ",".join(f"{f.phase}@{f.node}:{PHASE_HOLD_S:g}" for f in faults if f.phase in HELD_PHASES)


def node_number(node: str) -> int:
    """The trailing number of a node name (``node12`` -> 12), -1 without one: launchers name nodes node<K>."""
    m = _TRAILING_DIGITS.search(node)
    return int(m.group(1)) if m else -1


_TRAILING_DIGITS = re.compile(r"(\d+)$")


def _bad(token: str, why: str) -> None:
    raise UserError(f"--inject: bad event {token!r}: {why}; valid forms: {VALID_FORMS}")
