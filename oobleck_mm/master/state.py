"""The master's whole state as plain data: what ``oobleck_mm.master.machine.step`` reads and changes, and nothing else.

No locks, queues, clocks, files or sockets here: the shell (``oobleck_mm.master.coordinator``)
owns those and feeds the machine events. A test (``tests/unit/test_cp_machine.py``)
builds a ``JobState``, drives it with thousands of event orders and reads it back.

Phases (``JobPhase``): ``waiting`` (for ``num_nodes`` agents with open
streams), or ``adopting`` (a restarted master waits for the nodes of its
journal: ``oobleck_mm.master.journal``) -> ``running`` (generation 1 and every later one)
-> ``checkpointing`` (a round of ``oobleck_mm.master.checkpointing``: the survivors write
their layers, then the job stops) -> ``finished`` (exit code decided).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


from oobleck_mm.master.assignments import Sending
from oobleck_mm.master.checkpointing import CheckpointBook, CheckpointRound
from oobleck_mm.master.progress import Incident
from oobleck_mm.master.recovery import GenerationView, Holdings, Request
from oobleck_mm.master.registry import Registry
from oobleck_mm.master.stragglers import StragglerDetector
from oobleck_mm.config import config_text
from oobleck_mm.planning.layout import ExecutionPlan, Gpu


class JobPhase(enum.Enum):
    WAITING = "waiting"
    """For ``num_nodes`` agents with open event streams."""
    RUNNING = "running"
    """Generation 1 and every later one."""
    ADOPTING = "adopting"
    """A master restarted with ``--resume-master``: waiting for the journal's nodes to register again
    (their workers train on meanwhile), at most ``fault_tolerance.adopt_window``."""
    CHECKPOINTING = "checkpointing"
    """A checkpoint round before the job stops (too few nodes, a stop request, notices with the last copies)."""
    FINISHED = "finished"
    """The exit code is decided."""


TRAINING = (JobPhase.RUNNING, JobPhase.ADOPTING)
"""The workers train: a node leaving, lost or a stop request is handled as in a running job (a restarted
master only waits for its nodes before it plans)."""


@dataclass(frozen=True, slots=True)
class Finish:
    exit_code: int
    message: str


@dataclass(frozen=True, slots=True)
class RunOptions:
    """How this run starts, saves and recovers (``oobleck-launch master|local`` flags)."""

    resume_dir: str = ""
    """Absolute checkpoint directory the first generation loads (``--resume``)."""
    resume_step: int = 0
    save_final_dir: str = ""
    checkpoint_root: str = "."
    """Where below-threshold checkpoints (and restart mode's) are written."""
    recovery: str = "live"
    """``live`` or ``restart`` (``oobleck_mm.master.policies``)."""
    checkpoint_interval: int = 0
    """Steps between periodic checkpoints."""
    resume_command: str = "oobleck-launch local --config CONFIG"
    """Printed, followed by ``--resume DIR``, when the job stops below the threshold."""
    log_every: int = 1
    """Console lines every N steps (``--log-every``); the event log and metrics get every step."""


@dataclass(frozen=True, slots=True)
class Settings:
    """What the machine knows of the job and never changes while it runs."""

    job: Any
    """The validated ``JobConfig`` (overrides applied)."""
    num_nodes: int
    steps: int
    options: RunOptions
    sending: Sending
    config_yaml: str
    """The job as the workers and the planner read it (absolute paths, overrides applied)."""

    @classmethod
    def of(cls, job, *, num_nodes: int, steps: int, store_host: str, store_port: int, options: RunOptions) -> Settings:
        from oobleck_mm.master.policies import policy_for

        policy = policy_for(options.recovery)
        periodic = policy.periodic_checkpoints
        sending = Sending(
            store_host=store_host,
            store_port=store_port,
            steps=steps,
            save_final_dir=options.save_final_dir,
            checkpoint_interval=options.checkpoint_interval if periodic else 0,
            checkpoint_dir=f"{options.checkpoint_root}/checkpoints" if periodic else "",
            checkpoint_async=policy.asynchronous_checkpoints,
        )
        # What the workers read: the job with its overrides and absolute paths, whatever their file system.
        config_yaml = config_text(job)  # JSON, which is YAML too: parse_config_text reads it ~50x faster
        return cls(job, num_nodes, steps, options, sending, config_yaml)

    @property
    def timeouts(self):
        return self.job.fault_tolerance


@dataclass(frozen=True, slots=True)
class Generation:
    view: GenerationView
    plan: Any
    """The planning ``Plan`` (the next reconfiguration starts from it); None for the older generations
    a restarted master read from its journal (a plan from one of them is planned afresh)."""
    template_nodes: int
    """Node count the planner's templates were built for."""
    keeps_replicas_from: int = 0
    """(f + 1) * n0, the fewest nodes that keep f + 1 replicas (``Planned``); 0: not known (a journal's)."""
    slow: tuple[tuple[str, float], ...] = ()
    """The slow nodes (and factors) its batch split was planned for (``planning.speed``)."""
    base: int = 0
    """The generation its survivors take their states from (0: none, or not known: a journal's)."""


@dataclass(frozen=True, slots=True)
class Bench:
    """A straggler planned out (``fault_tolerance.straggler_bench``)."""

    until: float
    """Clock from which it may join again."""
    times: int
    """How many times this node was benched: the next bench lasts longer (``MAX_BENCH_DOUBLINGS``)."""
    returned: bool = False
    """Its bench ended and that was said."""


@dataclass(frozen=True, slots=True)
class PendingPlan:
    """A planning call on its way: its answer is applied only while it still answers ``request``."""

    id: int
    request: Request
    asked_at: float


@dataclass(slots=True)
class JobState:
    """Everything the master's decisions depend on. Changed only by ``oobleck_mm.master.machine.step``."""

    phase: JobPhase = JobPhase.WAITING
    generation: int = 0
    gens: dict[int, Generation] = field(default_factory=dict)
    finish: Finish | None = None
    registry: Registry = field(default_factory=Registry)
    holdings: dict[Gpu, Holdings] = field(default_factory=dict)
    """(node, gpu) -> the generations its worker's states follow, as its reports say."""
    next_step: int = 0
    """First step no worker has reported done."""
    done: dict[Gpu, tuple[int, int]] = field(default_factory=dict)
    """(node, gpu) -> (generation, last step) of its WorkerDone."""
    reported: dict[Gpu, int] = field(default_factory=dict)
    """(node, gpu) -> generation of its latest metrics or phase report."""
    stalls: dict[str, float] = field(default_factory=dict)
    """node -> clock reading of its workers' latest report of a stalled collective."""
    latest_step: dict[Gpu, tuple[int, int]] = field(default_factory=dict)
    """(node, gpu) -> (generation, step) of its newest metrics or done report (``detector.silent_reporters``)."""
    step_seen: dict[tuple[int, int], float] = field(default_factory=dict)
    """(generation, step) -> clock of the first report of that step, kept while some rank of the current
    generation has not reported it."""
    running: int = 0
    """The newest generation every rank of which reported from: its workers run, and on its nodes the workers
    of older generations are gone (an agent stops them before it starts fresh ones)."""
    pin: tuple[int, str, int] | None = None
    """(generation, directory, step) of the checkpoint the newest generation that starts afresh was told to
    load (a resume, a restart): kept from pruning until some rank completed a step of that generation
    (every rank loaded it then). Restart mode re-plans when a newer checkpoint completes first."""
    recent_step_s: list[float] = field(default_factory=list)
    """The latest ``RECENT_STEPS`` step times reported (seconds): their median paces ``reports_silence_limit``."""
    planning: PendingPlan | None = None
    plans_asked: int = 0
    """Planning calls made: the next one's id."""
    incident: Incident | None = None
    round: CheckpointRound | None = None
    """The checkpoint round while ``CHECKPOINTING``."""
    checkpoints: CheckpointBook = field(default_factory=CheckpointBook)
    restarted_for: int = 0
    """Restart mode: the generation whose workers were last restarted (once per failure)."""
    started_at: float = 0.0
    """Clock when generation 1 was planned (a restarted master: when the lost master planned it)."""
    last_detect: float | None = None
    """Clock of the previous detection pass (``losses._forgive_own_stall`` measures the master's own stalls)."""
    next_detection: float = float("-inf")
    """Clock from which a tick detects again (``Tick.detect``): ``detector_tick`` after the last detection,
    or at once after a node's health changed."""
    settle_until: float = 0.0
    abandoned: tuple[float, str] | None = None
    """(clock, message) of the first report that a worker abandoned an iteration of the current
    generation; a re-form follows once ``reform_after`` passed with no node lost."""
    reforms: int = 0
    """Re-forms since the last completed step (``machine.MAX_REFORMS``)."""
    slow: dict[str, float] = field(default_factory=dict)
    """Nodes ``oobleck_mm.master.stragglers`` found slow, with their factor: the batch split gives their pipelines less."""
    slow_since: dict[str, float] = field(default_factory=dict)
    """Clock when each node of ``slow`` was found slow: it is weighed for a bench ``straggler_replan_after`` later."""
    stragglers: StragglerDetector | None = None
    """The job's straggler detection (``oobleck_mm.master.slow_nodes``: made at its first use)."""
    weighed: set[str] = field(default_factory=set)
    """Slow nodes the planner already weighed benching (once per time a node is found slow: no flapping)."""
    benched: dict[str, Bench] = field(default_factory=dict)
    """Stragglers planned out for a while, and the ones back from a bench (their count of benches)."""
    failed_checkpoints: set[str] = field(default_factory=set)
    """Periodic checkpoint directories some worker could not write (said once each)."""
    last_progress: float = 0.0
    """Clock of the last step, recovery phase or plan: ``fault_tolerance.stall_timeout`` counts from it."""
    adopting: tuple[float, float] | None = None
    """(clock when adoption began, its deadline) while ``ADOPTING``."""

    @property
    def plan(self) -> ExecutionPlan | None:
        """The current generation's layout."""
        current = self.gens.get(self.generation)
        return current.view.layout if current is not None else None

    def views(self) -> dict[int, GenerationView]:
        return {number: g.view for number, g in self.gens.items()}

    def current_view(self) -> GenerationView | None:
        current = self.gens.get(self.generation)
        return current.view if current is not None else None

    def in_plan(self, node: str) -> bool:
        current = self.current_view()
        return current is not None and node in current.nodes

    def progress(self) -> int:
        """The newest step a rank of the current generation reported (-1: none yet)."""
        return max((step for gen, step in self.latest_step.values() if gen == self.generation), default=-1)

    def pinned(self) -> tuple[str, ...]:
        """Checkpoints pruning must keep: the newest this master knows complete (what it would restart from),
        and the one the current generation loads, until it completed a step. Pruning keeps the newest on
        disk, and a restart-mode checkpoint is complete on disk (its rank 0 writes meta.json) before its
        report reaches the master: a newer one not reported yet made pruning delete the one the master
        then chose (seen in the restart-mode fault tour, after a killmaster)."""
        out = [self.checkpoints.last[0]] if self.checkpoints.last is not None else []
        if self.pin is not None and self.pin[0] == self.generation and self.progress() < 0:
            out.append(self.pin[1])
        return tuple(dict.fromkeys(out))

    def newer_checkpoint(self) -> tuple[str, int] | None:
        """A complete checkpoint newer than the one the current generation loads and than anything it trained,
        written by an older generation after the plan (its workers ran until their agents had the restart):
        restart mode restarts from it, once every rank of the current generation reported from it. Only then
        are the old workers surely gone (an agent kills them before it starts the fresh ones), so no newer
        one can follow: one restart, not one per checkpoint they wrote meanwhile (seen: four, 0.6 s apart,
        while the master's sends waited behind its disk). A checkpoint's step is the next one to run."""
        last, pin, writer = self.checkpoints.last, self.pin, self.checkpoints.last_generation
        current = self.current_view()
        if last is None or pin is None or current is None or pin[0] != self.generation or not 0 < writer < pin[0]:
            return None
        if self.running != self.generation:
            return None  # an old worker may still run and write
        return last if last[1] > pin[2] and last[1] > self.progress() + 1 else None

    def out_on_bench(self, now: float) -> set[str]:
        """Registered nodes benched until after ``now``: no plan takes them."""
        return {n for n, b in self.benched.items() if now < b.until}

    def forget(self, name: str) -> None:
        """Its state is gone with it; a node coming back under this name starts empty."""
        self.slow.pop(name, None)  # and is measured afresh
        self.slow_since.pop(name, None)
        self.weighed.discard(name)
        for table in (self.holdings, self.done, self.reported, self.latest_step):
            for gpu in [g for g in table if g[0] == name]:
                del table[gpu]
