"""Worker process entry points: join a generation's process group and train a stage.

Two ways in, one engine:

- ``agent_worker.worker_main(conn, config_path, node, local_rank)``: what an
  agent starts, one per GPU. It waits for ``Assignment`` messages (protobuf
  bytes on ``conn``), rendezvouses on the master's store under the
  generation's prefix, trains and reports ``StepMetrics`` after every step.
- ``run_local(job, plan, steps, out_dir)``: starts one process per rank of an
  ``ExecutionPlan`` on this machine with a private store (tests, benchmarks),
  each saving its layers' final states and per-step losses.

Both join their groups through ``runtime.group.join_generation``, the one path.
"""

from __future__ import annotations

import logging
import os
import socket
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from oobleck_mm.config.emulation import compute_job
from oobleck_mm.errors import UserError
from oobleck_mm.planning.layout import ExecutionPlan
from oobleck_mm.runtime.checkpoint import load_layer, save_layers, write_error
from oobleck_mm.runtime.checkpoint_meta import read_meta, save_meta
from oobleck_mm.runtime.emulated import Emulation
from oobleck_mm.runtime.engine import StageEngine, StepResult, engine_subgroups
from oobleck_mm.model.layers import model_layer_specs
from oobleck_mm.runtime.group import PreparedGroup, join_generation
from oobleck_mm.runtime.hold import hold
from oobleck_mm.runtime.optim import optimizer_state
from oobleck_mm.runtime.state_transfer import adopt_plan
from oobleck_mm.runtime.template import warm_process

log = logging.getLogger(__name__)


def device_for(job, local_rank: int) -> torch.device:
    """This worker's device: the cpu, or GPU ``local_rank`` made the process's current CUDA device (so
    NCCL and every tensor created without a device land on it)."""
    if job.cluster.device == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available() or local_rank >= torch.cuda.device_count():
        raise UserError(
            f"cluster.device: 'cuda', but this machine's torch sees {torch.cuda.device_count()} GPU(s) "
            f"and worker {local_rank} needs GPU {local_rank} (set cluster.device: cpu to run on the cpu)"
        )
    torch.cuda.set_device(local_rank)
    set_float32_precision(job)
    return torch.device("cuda", local_rank)


def set_float32_precision(job) -> None:
    """float32 matmuls and convolutions on a GPU: TF32 tensor cores with ``training.tf32``, else full
    FP32 ("ieee"), as the cost model priced them (``compute_device``). Both set, so cuDNN's own
    default (TF32 convolutions) cannot make the run differ from the plan."""
    precision = "tf32" if job.training.tf32 else "ieee"
    torch.backends.cuda.matmul.fp32_precision = precision
    torch.backends.cudnn.fp32_precision = precision


def train(
    job,
    plan: ExecutionPlan,
    rank: int,
    start_step: int,
    steps: int,
    device: torch.device,
    on_step: Callable[[StepResult], None] | None = None,
    held=None,
) -> StageEngine:
    """Build this rank's stage (``held``: layers it starts from, e.g. a checkpoint's) and run ``steps``
    iterations from ``start_step``."""
    emulation = Emulation.for_job(job, f"rank{rank}")  # an emulated job: its compute copy runs, timed as the real
    engine = StageEngine(compute_job(job), plan, rank, device=device, held=held, emulation=emulation)
    for step in range(start_step, start_step + steps):
        result = engine.train_step(step)
        if on_step is not None:
            on_step(result)
    return engine


@dataclass(frozen=True, slots=True)
class SaveOutcome:
    """How a collective checkpoint went: complete (meta.json written) or not, and this rank's own disk error."""

    complete: bool
    error: str = ""
    """This rank's write that failed ("No space left on device: PATH"); empty when its share was written."""


def save_checkpoint(directory: str, engine: StageEngine, step: int, node: str = "") -> SaveOutcome:
    """Collective: every rank writes the layers it owns (first holder), then rank 0 writes meta.json.

    A write the disk refuses (a full disk, a read-only mount) is not a failure of the run: every
    rank learns of it in the agreement that replaces the first barrier, no meta.json is written (a
    restart never loads a partial checkpoint) and the rank whose write failed returns the reason;
    training state stays in memory. ``node``: this worker's node, for the ``checkpoint`` hold point
    (``runtime/hold.py``), which sits between its layer files and the agreement.
    """
    plan, rank = engine.plan, engine.rank
    owned = [i for i in engine.layers if plan.holders(i)[0] == rank]
    error = ""
    try:
        save_layers(directory, engine.held(), owned, engine.specs, engine.shared_state())
    except OSError as exc:
        error = write_error(exc, directory)
    hold("checkpoint", node)
    if not _all_wrote(not error, engine.device):
        return SaveOutcome(False, error)
    if rank == 0:
        try:
            save_meta(directory, engine.job, step, engine.specs, engine.data.sampler)
        except OSError as exc:
            error = write_error(exc, directory)
    return SaveOutcome(_all_wrote(not error, engine.device), error)


def _all_wrote(wrote: bool, device: torch.device) -> bool:
    """Collective: did every rank write its part? (A MIN all-reduce doubling as the barrier.)"""
    flag = torch.tensor([1.0 if wrote else 0.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def write_replica_hashes(directory: str, engine: StageEngine) -> None:
    """``replicas/rank{r}.json``: sha256 of every layer this rank holds, to check replicas are identical (a
    sharded layer whole, so a stage's every rank hashes the same)."""
    import hashlib
    import json

    hashes = {}
    for i in engine.layers:  # (gathered whole on a stage of several GPUs: every rank of it at once)
        digest = hashlib.sha256()
        for key, value in sorted(engine.layer_state(i).items()):
            digest.update(key.encode())
            digest.update(value.detach().cpu().contiguous().numpy().tobytes())
        hashes[engine.specs[i].name] = digest.hexdigest()
    path = Path(directory) / "replicas"
    path.mkdir(parents=True, exist_ok=True)
    (path / f"rank{engine.rank}.json").write_text(json.dumps(hashes, indent=1, sort_keys=True))


# --------------------------------------------------------------------------- local launch (tests, benchmarks)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True, slots=True)
class Phase:
    """A later plan in a local run: the workers re-form without restarting (a simulated reconfiguration)."""

    plan: ExecutionPlan
    steps: int
    survivors: Mapping[int, int]
    """Previous phase's rank -> this phase's rank; a rank left out leaves the job (its node is lost)."""
    rank_nodes: Sequence[str] = ()
    """Node of each rank of ``plan`` (the same-node preference of the state copy); empty: one node per rank."""
    prepared: bool = False
    """Its groups are formed in the background while the previous phase trains (``runtime.group.
    PreparedGroup``), as a worker does for a join or a leave on notice."""

    @property
    def previous_ranks(self) -> list[int]:
        """Per rank of ``plan``: its rank in the previous phase, -1 for a new worker."""
        out = [-1] * self.plan.world_size
        for old, new in self.survivors.items():
            out[new] = old
        return out


def _local_entry(
    job,
    plan: ExecutionPlan,
    rank: int,
    port: int,
    steps: int,
    out_dir: str,
    threads: int,
    phases: Sequence[Phase] = (),
    save_final: str | None = None,
    timeout_s: float = 120.0,
    resume: str | None = None,
) -> None:
    torch.set_num_threads(threads)
    # No master watches a local run: its waits are bounded by the run's own timeout instead.
    bound = timedelta(seconds=timeout_s)

    def join(generation: int, rank: int, world_size: int, prepared: PreparedGroup | None = None) -> None:
        join_generation(
            store,
            generation,
            rank,
            world_size,
            job.cluster.resolved_backend,
            collective_timeout=bound,
            arrival_timeout=bound,
            prepared=prepared,
        )
        backends.append(dist.get_backend())

    def previous_plan(generation: int) -> ExecutionPlan:
        return phases[generation - 2].plan if generation > 1 else first_plan

    first_plan = plan

    def prepare(generation: int) -> PreparedGroup | None:
        """The groups of phase ``generation``, formed now if it says so, while this generation trains."""
        if (
            generation > len(phases)
            or not phases[generation - 1].prepared
            or rank not in phases[generation - 1].survivors
        ):
            return None
        phase, specs = phases[generation - 1], model_layer_specs(job)
        return PreparedGroup(
            lambda: dist.TCPStore("127.0.0.1", port, is_master=False, timeout=bound),
            generation,
            phase.survivors[rank],
            phase.plan.world_size,
            collective_timeout=bound,
            arrival_timeout=bound,
            subgroups=engine_subgroups(job, phase.plan, specs, previous_plan(generation), phase.previous_ranks),
        )

    backends: list[str] = []

    try:
        device = device_for(job, rank)  # before the group: NCCL binds to the current CUDA device
        # A private store on loopback for this test/benchmark harness (no master, no network).
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=bound)
        join(0, rank, plan.world_size)
        results: list[StepResult] = []
        prepared = prepare(1)
        start, held = 0, None
        if resume is not None:  # as a worker resumes (agent_worker): its stage's layers from the checkpoint
            specs = model_layer_specs(job)
            start = int(read_meta(resume)["step"])
            held = {i: load_layer(resume, job, i, specs, device) for i in plan.stage(rank).layers}
        engine = train(job, plan, rank, start, steps, device, results.append, held)
        step, transfers = start + steps, []
        for generation, phase in enumerate(phases, start=1):
            if rank not in phase.survivors:
                dist.destroy_process_group()
                return  # this worker's node is gone
            old_plan, rank = plan, phase.survivors[rank]
            plan = phase.plan
            join(generation, rank, plan.world_size, prepared)
            prepared = prepare(generation + 1)
            engine, moves, _, _ = adopt_plan(
                job, engine, old_plan, plan, phase.previous_ranks, rank, phase.rank_nodes, device
            )
            transfers.append(moves)
            for s in range(step, step + phase.steps):
                results.append(engine.train_step(s))
            step += phase.steps
        if save_final is not None:
            if not (saved := save_checkpoint(save_final, engine, step)).complete:
                raise OSError(saved.error or f"another rank could not write its share of {save_final}")
        states = {engine.specs[i].name: engine.layer_state(i) for i in engine.layers}
        # A stage of several GPUs holds shards: gathered whole (engine.held), every rank of it at once.
        optim = {
            engine.specs[i].name: optimizer_state(h.optimizer)
            for i, h in sorted(engine.held().items())
            if h.optimizer is not None
        }
        torch.save(
            {
                "losses": [r.loss for r in results],
                "states": states,
                "optimizer_states": optim,
                "optimizer_state_sizes": {
                    k: len(opt.state) for k, opt in ((engine.specs[i].name, o) for i, o in engine.optimizers.items())
                },
                "results": results,
                "transfers": transfers,
                "loss_scaler": engine.scaler_state(),
                "backends": backends,
                "balancer": (
                    None
                    if engine.balancer is None
                    else {
                        "coefficients": engine.balancer.coefficients.to_dict(),
                        "metrics": engine.balancer.last_metrics,
                    }
                ),
            },
            Path(out_dir) / f"rank{rank}.pt",
        )
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        (Path(out_dir) / f"rank{rank}.err").write_text(traceback.format_exc())
        raise


def run_local(
    job,
    plan: ExecutionPlan,
    steps: int,
    out_dir: str | os.PathLike,
    threads: int = 1,
    timeout_s: float = 120.0,
    phases: Sequence[Phase] = (),
    save_final: str | None = None,
    resume: str | None = None,
) -> list[dict]:
    """Train ``plan`` for ``steps`` with one OS process per rank, then each of ``phases``; ``resume``: from
    that checkpoint (its step, its layers and optimizer states), as workers resume.

    Returns the saved outputs of every rank of the last plan, in rank order.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    # Forks of a template that imported torch and the engine once: ~2 s less per rank than a spawn.
    procs = [
        warm_process(
            _local_entry, job, plan, r, port, steps, str(out_dir), threads, tuple(phases), save_final, timeout_s, resume
        )
        for r in range(plan.world_size)
    ]
    final = phases[-1].plan if phases else plan
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout_s)
        errors = [f.read_text() for f in sorted(out_dir.glob("rank*.err"))]
        if errors:
            raise RuntimeError("worker failed:\n" + errors[0])
        bad = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode != 0]
        if bad:
            raise RuntimeError(f"workers exited abnormally (rank, exit code): {bad}")
        return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(final.world_size)]
    finally:
        for p in procs:
            if p.pid is not None:
                if p.is_alive():
                    p.kill()
                p.join(5)
        del store
