"""What the simulation assumes beyond the job config: every overhead, with its source.

The engine's own mechanisms set the phases' shape (which phases a recovery has,
what a state copy moves); these numbers set their length on the config's
hardware. Each default says where it comes from: a measurement in this
repository, the Oobleck dissertation's setup (§2.7.1), or the baseline's paper.
A number calibrated against a published result says which one, so the cells it
was fitted to are not mistaken for predictions (docs/simulator.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from oobleck_mm.errors import UserError

SYSTEMS = ("oobleck", "varuna", "bamboo", "restart")


@dataclass(frozen=True, slots=True)
class SimParams:
    detection_s: float | None = None
    """Seconds from a node's loss to the master knowing it. None: the config's
    ``fault_tolerance.heartbeat_timeout``: a reclaimed VM vanishes without closing its
    TCP stream, so the engine's heartbeat timeout decides (docs/recovery.md: a crash that
    resets the stream is seen in 0.01 s). The same for every system."""
    planning_s: float | None = None
    """Seconds of planning per change. None: measured, by timing the real planner call the
    simulation makes (the master runs it on a CPU, as here)."""
    rendezvous_s: float = 2.0
    """New communicators for a generation: NCCL initialisation across the cluster. Estimate;
    gloo on this machine measures 0.02–0.12 s (docs/recovery.md), NCCL bootstraps take seconds."""
    worker_start_s: float = 60.0
    """A fresh worker process on a GPU node: interpreter, torch and CUDA initialisation, the model
    built on the device. Estimate; every full restart (Varuna's morph, restart mode, Bamboo's
    fallback) pays it, and so does the engine's join today (survivors wait for it, issue 13)."""
    storage_write_bandwidth: float = 0.75e9
    """Bytes/s a checkpoint is saved at (the paper's MinIO cluster, 6 nodes with NVMe, §2.7.1).
    Calibrated: the gap between Varuna and Varuna without checkpoint overhead at 6 h for
    GPT-3 6.7B (Table 2.4: 4.14 vs 4.61 samples/s, checkpoints every 10 iterations)."""
    storage_read_bandwidth: float = 0.75e9
    """Bytes/s a restart loads the checkpoint at; the same store, assumed symmetric."""
    varuna_checkpoint_every: int = 10
    """Varuna's synchronous checkpoint interval in iterations (§2.7.1, its continuous policy)."""
    varuna_saves_on_signal: bool = True
    """Varuna catches a removed node's termination signal and saves a checkpoint before it morphs
    (its design relies on the cloud's notice, Athlur et al. §4); the save keeps the work when it
    finishes inside ``preempt_grace_s``, else the job falls back to the last periodic checkpoint.
    The dissertation's controlled removals reached it this way: Table 2.2's GPT-2 at 10 min (76
    samples/s, a 10-iteration interval there is 16 min) is impossible without it."""
    varuna_no_checkpoint_cost: bool = False
    """Table 2.4's "Varuna (no ckpt)": saves cost nothing and happen every 2 iterations."""
    bamboo_rc_slowdown: float = 2.0
    """Bamboo's iteration time over the same layout's without redundant computation. The
    dissertation's Fig. 2.11 puts redundant computation at more than 50% of Bamboo's time
    (the next stage's forward on every stage, the deeper pipelines its doubled state needs,
    stages imbalanced to balance memory), hence 2.0, a lower bound."""
    bamboo_memory_factor: float = 2.0
    """Memory Bamboo holds per GPU relative to one replica, model state and activations alike (its
    own stage + its successor's, whose forward it also runs and keeps for a fast failover)."""
    bamboo_microbatch: int | None = None
    """Bamboo's microbatch size. None: the largest power of two up to the config's that fits,
    as the dissertation's Table 2.1 chose (Bamboo runs without activation checkpointing)."""
    restart_checkpoint_every: int | None = None
    """The engine's restart mode: checkpoint every this many steps (None: the config's
    ``fault_tolerance.checkpoint_interval``, or Varuna's 10 when that is 0)."""
    preemption_notice: bool = False
    """The cloud warns ``preempt_grace_s`` before reclaiming a node (all systems use it,
    as in the paper's spot experiments, §2.7.1)."""
    preempt_grace_s: float = 30.0
    """Warning time of a preemption notice: GCP gives 30 s, EC2 two minutes."""
    straggler_mitigation: bool = True
    """``oobleck``: act on stragglers as the engine does (``fault_tolerance.straggler_*``: found after
    ``straggler_steps`` iterations, the batch re-split for the nodes' speeds, a bench weighed
    ``straggler_replan_after`` later). false: found and reported only, every pipeline waits for the
    slowest, as the baselines do."""
    joiner_start_stalls: bool = False
    """Survivors wait for a joining node's worker to start. The engine does not: the master plans a
    joiner only once its workers report ready (``oobleck_mm/master/generations.py``), and the survivors train
    meanwhile (``scripts/bench_join.py`` measures their pause from that point). true: simulate a system
    that waits (the engine before issue 13 item 5)."""
    skew_batches: int = 0
    """Data skew (``simulator/skew.py``): price every plan on this many sampled global batches of the job's
    (synthetic) data with the balancer's cost model, in the mode its ``balance`` section names (off, the
    data-parallel balancer, or with Entrain's deferral: sweep ``balance.deferral``). 0: every sample
    costs the profile's mean sample, as the planner assumes (the paper's simulator)."""

    def __post_init__(self) -> None:
        if not (isinstance(self.skew_batches, int) and self.skew_batches >= 0):
            raise UserError(f"simulator: skew_batches must be an integer >= 0, got {self.skew_batches!r}")
        for name in ("rendezvous_s", "worker_start_s", "preempt_grace_s"):
            if not getattr(self, name) >= 0:
                raise UserError(f"simulator: {name} must be >= 0, got {getattr(self, name)}")
        for name in ("detection_s", "planning_s"):
            value = getattr(self, name)
            if value is not None and not value >= 0:
                raise UserError(f"simulator: {name} must be >= 0 or unset, got {value}")
        for name in ("storage_write_bandwidth", "storage_read_bandwidth"):
            if not getattr(self, name) > 0:
                raise UserError(f"simulator: {name} must be > 0 bytes/s, got {getattr(self, name)}")
        if self.varuna_checkpoint_every < 1:
            raise UserError(f"simulator: varuna_checkpoint_every must be >= 1, got {self.varuna_checkpoint_every}")
        if self.restart_checkpoint_every is not None and self.restart_checkpoint_every < 1:
            raise UserError(f"simulator: restart_checkpoint_every must be >= 1, got {self.restart_checkpoint_every}")
        if self.bamboo_microbatch is not None and self.bamboo_microbatch < 1:
            raise UserError(f"simulator: bamboo_microbatch must be >= 1, got {self.bamboo_microbatch}")
        if not self.bamboo_memory_factor >= 1:
            raise UserError(f"simulator: bamboo_memory_factor must be >= 1, got {self.bamboo_memory_factor}")
        if not self.bamboo_rc_slowdown >= 1:
            raise UserError(f"simulator: bamboo_rc_slowdown must be >= 1, got {self.bamboo_rc_slowdown}")
