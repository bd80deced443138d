"""The ``fault_tolerance`` section: failure detection, recovery and stragglers, and every timeout derived from them.

Its own module because its derived timeouts are read all over the engine (the master's detector, the
agents, the workers' collectives): one home for each wait of the job and the formula behind it.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import ClassVar

from oobleck_mm.config.values import (
    ConfigError,
    as_bool,
    as_choice,
    as_duration,
    as_float,
    as_int,
    check,
    check_optional,
)


@dataclass(kw_only=True, slots=True)
class FaultToleranceConfig:
    """Failure detection and recovery settings, and every timeout derived from them.

    Two settings, ``heartbeat_interval`` and ``heartbeat_timeout``, drive every wait
    of the job. The waits that follow from them are the properties below, each
    saying what it bounds and why its formula; code elsewhere reads a property,
    never multiplies a setting.
    """

    _PATH: ClassVar[str] = "fault_tolerance"
    f: int = 1
    """Simultaneous node failures the job must survive (f + 1 pipelines are kept)."""
    heartbeat_interval: timedelta = timedelta(milliseconds=500)
    """How often agents report to the master (and check their workers). The master takes about 2,000
    heartbeats a second (``oobleck_mm/master/server.py::HEARTBEATS_PER_S_BUDGET``; it warns at start past that):
    past 1,000 nodes, raise it."""
    heartbeat_timeout: timedelta = timedelta(seconds=3)
    """Silence after which a node is declared failed (a hung node whose sockets stay open); longer
    than the interval. A dead agent is detected sooner, by its closed event stream."""
    confirmed_silence: timedelta | None = None
    """Peer-confirmed hang detection: a node silent this long is lost once a worker of another node
    reported waiting on a collective since the node's last heartbeat (``heartbeat_late_peers_stalled``),
    without waiting for ``heartbeat_timeout``. null (the default): off. On a link that queues (a
    congested or rate-limited uplink) a healthy node's heartbeats wait behind its bulk transfers while
    its peers wait for those transfers, which is exactly this evidence: measured, a 2 Mbit/s link
    delayed heartbeats by up to 2.4 s and this rule at 1.5 s declared the node lost, where the 3 s
    timeout did not. Set it (e.g. half the timeout) only where no link queues that long; it must be
    shorter than ``heartbeat_timeout``."""
    rendezvous_timeout: timedelta = timedelta(minutes=5)
    """Longest wait for every worker of a new generation to arrive at its rendezvous. Long on
    purpose: survivors of a hang arrive up to a ``collective_timeout`` apart and a joining node's
    workers start from nothing (imports, model build); raise it for very slow node start-up."""
    stall_timeout: timedelta = timedelta(minutes=30)
    """The master ends a running job that made no progress (no step, no recovery phase, no new
    plan) for this long, saying where it stopped: a last resort against a hang that no other bound
    catches. Longer than any step or state copy of the job should take."""
    preempt_grace: timedelta = timedelta(seconds=25)
    """How long an agent keeps its node in the job after a preemption notice (a SIGTERM) while the
    master plans it out at the next iteration boundary; past it the agent stops its workers as if
    the node failed. Keep it below the provider's notice (30 s on GCP, 2 min on AWS) minus one step."""
    master_timeout: timedelta | None = timedelta(minutes=5)
    """How long agents keep their workers training without a master (it died, or cannot be reached)
    while they wait for it, or for one restarted with ``oobleck-launch master --resume-master RUN_DIR``,
    to re-adopt them; past it the workers write the step they are at and the agents exit 3 with the
    resume command. null: write that checkpoint at once. Generous: restarting a master takes minutes."""
    recovery: str = "live"
    """``live`` (reconfigure the surviving pipelines in place) or ``restart`` (from checkpoint)."""
    checkpoint_interval: int = 100
    """Steps between periodic checkpoints (``<run dir>/checkpoints/stepN``); 0: no step-based ones. Live
    mode snapshots each layer once to host memory and writes it in the background, keeping the last
    two; it is where the job stops (exit 3) when a loss takes every copy of some layer."""
    checkpoint_every: timedelta | None = timedelta(minutes=30)
    """Also checkpoint once this much time passed since the last checkpoint (whichever of the two
    comes first); null: by steps only. Every rank's clock is asked in the step's last collective, so
    all checkpoint after the same step."""
    keep_checkpoints: int = 2
    """Complete periodic checkpoints live mode keeps (the newest, and one in case it is damaged); 0: every
    one, so that ``verify --windows`` can judge a long run window by window."""
    straggler_factor: float = 1.5
    """A node is a straggler when its stages' compute, per unit of work the cost model predicts for
    them, is a median of at least this many times the other nodes' over the last ``straggler_steps``
    steps (``oobleck_mm/master/stragglers.py``); 0: no detection. Compute times, not waits: a peer's slowness
    does not count against a node."""
    straggler_clear_factor: float = 1.2
    """A straggler is cleared once that median is below this: below ``straggler_factor``, so a node
    hovering at the threshold does not flap."""
    straggler_steps: int = 8
    """Steps the median is taken over: one slow step (a page fault, a busy neighbour for a moment) is
    noise."""
    straggler_resplit: bool = True
    """Act on a straggler: a new generation with the same pipelines whose batch split prices the slow
    node's stages at its measured factor (its pipeline gets fewer microbatches), switched at an iteration
    boundary, and the split of before once it is cleared. false: detect and report only."""
    straggler_recut: bool = True
    """With the re-split, a slow node's pipeline may also be re-cut: its stages keep their nodes and the
    slow node's stage gives layers to the others (``planning.stage_mapping.recut_for_speeds``), when
    that is predicted ``planning.speed.RECUT_GAIN`` faster than the re-split alone; the layer states move
    at the switch, and back once the node is cleared. false: the re-split alone."""
    straggler_replan_after: timedelta | None = timedelta(seconds=60)
    """A straggler still slow this long after it was found is weighed once: the planner predicts the
    job's samples/s with the node kept (its pipeline re-split) and without it (the survivors'
    pipelines re-planned from the templates), and plans it out (*benches* it, at an iteration
    boundary, nothing lost) when that is ``planning.planner.BENCH_GAIN`` faster. null: never."""
    straggler_bench: timedelta = timedelta(minutes=5)
    """How long a benched straggler stays out before it is taken back like a join (its speed measured
    afresh). Doubled each time the same node is benched again, up to ``MAX_BENCH_DOUBLINGS`` times:
    a node slow for good costs one weighing per long bench, not a plan every few minutes."""

    def __post_init__(self) -> None:
        check(self, "f", as_int, minimum=0)
        check(self, "heartbeat_interval", as_duration)
        check(self, "heartbeat_timeout", as_duration)
        check_optional(self, "confirmed_silence", as_duration)
        if self.confirmed_silence is not None and not timedelta(0) < self.confirmed_silence < self.heartbeat_timeout:
            raise ConfigError(
                f"fault_tolerance.confirmed_silence: must be > 0 and < heartbeat_timeout "
                f"({self.heartbeat_timeout.total_seconds():g}s), or null to turn peer-confirmed "
                f"detection off, got {self.confirmed_silence.total_seconds():g}s"
            )
        check(self, "rendezvous_timeout", as_duration)
        check(self, "stall_timeout", as_duration)
        check(self, "preempt_grace", as_duration)
        check_optional(self, "master_timeout", as_duration)
        check(self, "recovery", as_choice, ("live", "restart"))
        check(self, "checkpoint_interval", as_int, minimum=0)
        check_optional(self, "checkpoint_every", as_duration)
        check(self, "keep_checkpoints", as_int, minimum=0)
        check(self, "straggler_factor", as_float, minimum=0.0)
        if 0 < self.straggler_factor <= 1:
            raise ConfigError(
                f"fault_tolerance.straggler_factor: must be > 1 (how many times slower than the "
                f"median), or 0 to turn detection off, got {self.straggler_factor}"
            )
        check(self, "straggler_clear_factor", as_float, minimum=1.0)
        if self.straggler_factor and self.straggler_clear_factor >= self.straggler_factor:
            raise ConfigError(
                f"fault_tolerance.straggler_clear_factor: must be < straggler_factor "
                f"({self.straggler_factor}), got {self.straggler_clear_factor}"
            )
        check(self, "straggler_steps", as_int, minimum=1)
        check(self, "straggler_resplit", as_bool)
        check(self, "straggler_recut", as_bool)
        check_optional(self, "straggler_replan_after", as_duration)
        check(self, "straggler_bench", as_duration)

    # ------------------------------------------------------------------ workers
    @property
    def collective_timeout(self) -> timedelta:
        """Longest wait of a worker on one collective or point-to-point transfer (the process
        group's timeout): ``heartbeat_timeout + 5 s``. The master declares a hung peer lost after
        ``heartbeat_timeout`` and its new plan interrupts the wait; the 5 s cover the plan's way to
        the worker, so this bound only fires when the master cannot help (gloo's point-to-point
        waits, which cannot be interrupted)."""
        return self.heartbeat_timeout + COLLECTIVE_TIMEOUT_MARGIN

    @property
    def stall_report_after(self) -> timedelta:
        """A worker waiting this long on a collective tells the master (``Stalled``), and again
        every as long: ``2 * heartbeat_interval``, so a healthy step's jitter never reports, and a
        report still reaches the master well inside ``heartbeat_timeout``."""
        return 2 * self.heartbeat_interval

    # ------------------------------------------------------------------ the master
    @property
    def reform_after(self) -> timedelta:
        """After a worker abandoned an iteration (its collective failed) and no node was lost for
        this long, the same nodes re-form as a new generation: ``heartbeat_timeout``. A peer that
        died is detected within that bound (at once when its sockets reset); past it, the failed
        collective had no lost node behind it (a peer starved of CPU past ``collective_timeout``),
        and waiting longer would only wait for a plan that never comes."""
        return self.heartbeat_timeout

    def reports_silence_limit(self, step_s: float) -> timedelta:
        """How long after some rank reported a step of the current generation a rank of that generation
        may go without reporting it before its node is lost (``reports_silent``, ``oobleck_mm.master.detector``):
        ``max(REPORTS_SILENCE_STEPS * step_s, 2 * collective_timeout)``, ``step_s`` the job's median step
        time. Every rank reports every step and no step ends without every rank, so a rank that lags
        the job's reports by many steps is a node whose reports are kept from the master (its agent's
        report thread died: issue 55), where the job would otherwise wait out ``stall_timeout``. Many
        steps, because an agent forwards reports one call at a time and a busy host delays them; never
        under two collective timeouts, the longest a rank can sit in one step's waits."""
        return max(REPORTS_SILENCE_STEPS * timedelta(seconds=step_s), 2 * self.collective_timeout)

    @property
    def master_stall_threshold(self) -> timedelta:
        """A gap this long between two detection ticks means the master itself did not run (starved
        of CPU, paused), and the gap is forgiven to every node: ``heartbeat_timeout / 2``. The
        master ticks every ``detector_tick``, so a gap this long is the master's, not the nodes'."""
        return self.heartbeat_timeout / 2

    @property
    def detector_tick(self) -> timedelta:
        """Longest pause of the master's control loop between two detections: ``min(0.1 s,
        heartbeat_timeout / 10)``. A silent node is declared lost at most one tick late."""
        return min(timedelta(milliseconds=100), self.heartbeat_timeout / 10)

    @property
    def shutdown_grace(self) -> timedelta:
        """How long the master waits for the agents to read their Shutdown and hang up before it
        stops serving: ``max(2 s, heartbeat_timeout)``, the time an agent may take to notice."""
        return max(timedelta(seconds=2), self.heartbeat_timeout)

    @property
    def checkpoint_round_timeout(self) -> timedelta:
        """Longest wait for the survivors' below-threshold checkpoint: ``2 * heartbeat_timeout +
        60 s``. Survivors may first wait out a hung peer's collective (``collective_timeout``), then
        write their layers; the 60 s are for the disk."""
        return 2 * self.heartbeat_timeout + timedelta(seconds=60)

    # ------------------------------------------------------------------ agents
    @property
    def heartbeat_rpc_timeout(self) -> timedelta:
        """Deadline of one Heartbeat call: ``heartbeat_timeout / 2``. A slow answer still counts on
        the master's side, so the agent gives a busy master more than one interval."""
        return self.heartbeat_timeout / 2

    @property
    def report_rpc_timeout(self) -> timedelta:
        """Deadline of forwarding one worker report or failure to the master: ``heartbeat_timeout``."""
        return self.heartbeat_timeout

    @property
    def adopt_window(self) -> timedelta:
        """How long a master restarted with ``--resume-master`` waits for the nodes of its journal to
        register again before it counts the missing ones lost: ``master_silence_limit``. The agents
        retry every ``heartbeat_interval`` once they miss the master; a node not back by then went
        down with it."""
        return self.master_silence_limit

    @property
    def master_silence_limit(self) -> timedelta:
        """An agent whose heartbeats go unanswered this long gives the master up and stops its
        workers: ``2 * heartbeat_timeout``. A dead master is seen at once (its sockets reset);
        silence only means a hung or starved one, and the master forgives its own stalls
        (``master_stall_threshold``), so the agent waits longer than the master would."""
        return 2 * self.heartbeat_timeout

    @property
    def worker_stop_timeout(self) -> timedelta:
        """How long an agent lets its workers exit after a Shutdown before killing them:
        ``heartbeat_timeout``."""
        return self.heartbeat_timeout

    @property
    def agent_exit_timeout(self) -> timedelta:
        """How long ``oobleck-launch local`` waits for its agents to exit after the job finished:
        ``heartbeat_timeout + 2 s`` (an agent that missed the Shutdown notices the master is gone
        within ``heartbeat_timeout``; 2 s to stop its workers)."""
        return self.heartbeat_timeout + timedelta(seconds=2)


MAX_BENCH_DOUBLINGS = 3
"""A node benched again stays out ``straggler_bench * 2**k`` for its k-th return, k at most this (8x)."""

COLLECTIVE_TIMEOUT_MARGIN = timedelta(seconds=5)
REPORTS_SILENCE_STEPS = 20
"""Steps a rank's reports may lag the job's before its node is lost (``reports_silence_limit``)."""
"""``collective_timeout`` minus ``heartbeat_timeout``: the master's verdict's way to a waiting worker."""
