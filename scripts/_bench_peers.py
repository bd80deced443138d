"""Worker side of ``bench_runtime.py``: the engine and its two peers, one process per rank.

Three trainers, all built from ``build_layer`` (identical initial weights) and
fed by ``TrainingData`` (identical global batches, the same loss normalisation
by the global number of loss tokens, the same clipping and AdamW settings):

- ``engine``: ``StageEngine`` of ``oobleck_mm.runtime`` as it is (DeepSpeed's
  1F1B instruction stream, layer-wise all-reduce, per-layer AdamW);
- ``ddp``: the whole model under torch ``DistributedDataParallel`` (gloo); rank
  p runs the microbatches the engine's pipeline p runs, ``no_sync`` for all but
  the last, then global-norm clipping and one AdamW over the whole model;
- ``hf_ddp``: a ``model.huggingface`` job's model as plain ``transformers`` runs it
  (``from_pretrained``, SDPA attention) under ``DistributedDataParallel``: each
  microbatch's samples right-padded into one batch with an attention mask, image
  placeholders expanded to the tower's image tokens, the same loss normalisation;
- ``deepspeed``: DeepSpeed's own ``PipelineEngine`` over a ``PipelineModule`` of
  the same layers, for fixed-shape data only (it caches activation shapes after
  the first microbatch). Stages exchange ``(tokens, *hidden states)`` tuples;
  masks and positions come from one template microbatch, since every
  microbatch has the same shapes (checked on every microbatch loaded).

``launch`` runs several systems side by side, each in its own spawned
processes (one torch thread each) and process group, taking turns step by step,
and returns what each rank wrote: per-step losses and times, a time breakdown
and the peak RSS (``ru_maxrss``). Any failure kills every process it started.
Given ``hosts``, rank r of every system runs in host r's network namespace
(``tests/network.py``: a veth link each, on one bridge), so its traffic crosses
a real link that ``tc`` can slow.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import json
import multiprocessing as mp
import os
import resource
import sys
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import wait
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from oobleck_mm.balance.assignment import contiguous_assignment
from oobleck_mm.data.loader import TrainingData
from oobleck_mm.data.packing import PackedBatch
from oobleck_mm.model.layers import build_layer, microbatch_loss, model_layer_specs
from oobleck_mm.planning.layout import ExecutionPlan
from oobleck_mm.runtime.optim import lr_at, set_lr
from oobleck_mm.runtime.group import join_generation
from oobleck_mm.runtime.worker import free_port

SYSTEMS = ("engine", "ddp", "deepspeed", "hf_ddp")
TURN_TIMEOUT_S = 600.0
"""Longest wait for the other systems' step (a step takes seconds; a dead worker is caught by the parent)."""


@dataclasses.dataclass(frozen=True, slots=True)
class RunSpec:
    """One system training ``plan``'s global batches: ``warmup`` untimed steps, then ``timed`` steps."""

    system: str
    job: object
    """The JobConfig (pickled to each worker)."""
    plan: ExecutionPlan
    """For ``ddp`` the engine's plan it mirrors (pipeline p -> rank p); for ``deepspeed`` its stage cuts."""
    warmup: int
    timed: int

    def __post_init__(self) -> None:
        if self.system not in SYSTEMS:
            raise ValueError(f"system: {self.system!r} is not one of {SYSTEMS}")


# --------------------------------------------------------------------------- launching


@dataclasses.dataclass(frozen=True, slots=True)
class Host:
    """A simulated host of a bench network: rank r of every system runs in hosts[r]."""

    namespace: str
    """The path of its network namespace (``/run/netns/NAME``)."""
    address: str
    interface: str
    """The interface gloo binds in it (``GLOO_SOCKET_IFNAME``)."""


CLONE_NEWNET = 0x40000000


def enter_namespace(path: str) -> None:
    """Move this process into the network namespace at ``path`` (``setns(2)``; Python 3.11's ``os`` has no
    ``setns``). Called first thing in a worker, before it has a thread or a socket: threads it starts later
    and every socket they open are in the namespace."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({path}): {os.strerror(err)}")
    finally:
        os.close(fd)


def launch(
    specs: Sequence[RunSpec], out_dir: Path, timeout_s: float = 900.0, hosts: Sequence[Host] | None = None
) -> list[list[dict]]:
    """Run ``specs`` side by side, each in its own processes and process group, taking turns step by step.

    Step s of specs[0] runs, then step s of specs[1], ... (the others' processes sleep on a
    barrier meanwhile), so load from elsewhere on the machine hits every system alike while
    each keeps its own peak RSS. Returns, per spec, each rank's report. Kills every worker
    it started, whatever happens. ``hosts``: rank r of every system runs in ``hosts[r]``'s network
    namespace, its group's store on ``hosts[0]``'s address (else every rank on this host's loopback).
    """
    if hosts is not None and len(hosts) < max(s.plan.world_size for s in specs):
        raise ValueError(f"{len(hosts)} hosts for {max(s.plan.world_size for s in specs)} ranks")
    if len({s.warmup + s.timed for s in specs}) != 1:
        raise ValueError("specs taking turns must run the same number of steps")
    out_dir.mkdir(parents=True, exist_ok=True)
    ctx = mp.get_context("spawn")
    turns = ctx.Barrier(sum(s.plan.world_size for s in specs))
    procs: list[tuple[str, mp.Process]] = []
    for index, spec in enumerate(specs):
        port = free_port()
        for rank in range(spec.plan.world_size):
            tag = f"{index}-{spec.system}-rank{rank}"
            args = (spec, index, len(specs), rank, port, turns, str(out_dir / tag), hosts)
            procs.append((tag, ctx.Process(target=_entry, args=args, daemon=True)))
    try:
        for _, p in procs:
            p.start()
        _wait_all(procs, out_dir, timeout_s)
        return [
            [json.loads((out_dir / f"{i}-{s.system}-rank{r}.json").read_text()) for r in range(s.plan.world_size)]
            for i, s in enumerate(specs)
        ]
    finally:
        turns.abort()  # wakes any worker still waiting for its turn
        for _, p in procs:
            if p.pid is not None and p.is_alive():
                p.kill()
        for _, p in procs:
            if p.pid is not None:
                p.join(10)


def _wait_all(procs: list[tuple[str, mp.Process]], out_dir: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    alive = [p for _, p in procs]
    while alive:
        left = deadline - time.monotonic()
        if left <= 0:
            raise RuntimeError(f"benchmark workers still running after {timeout_s:.0f} s")
        wait([p.sentinel for p in alive], timeout=left)
        alive = [p for p in alive if p.exitcode is None]
        failed = [tag for tag, p in procs if p.exitcode not in (None, 0)]
        if failed:  # the others would wait for their turn, or in a collective, until a timeout
            raise RuntimeError(f"worker {failed[0]} failed:\n{_worker_error(out_dir / failed[0])}")


def _worker_error(prefix: Path) -> str:
    err, log = prefix.with_suffix(".err"), prefix.with_suffix(".log")
    if err.exists():
        return err.read_text()
    return log.read_text()[-4000:] if log.exists() else "(no output)"


def _entry(
    spec: RunSpec, index: int, num_turns: int, rank: int, port: int, turns, prefix: str, hosts: Sequence[Host] | None
) -> None:
    global STORE_HOST
    if hosts is not None:
        enter_namespace(hosts[rank].namespace)
        os.environ["GLOO_SOCKET_IFNAME"] = hosts[rank].interface
        STORE_HOST = hosts[0].address
    out = Path(prefix)
    # DeepSpeed prints its whole config at start-up: keep each worker's chatter in its own file.
    log = open(out.with_suffix(".log"), "w")  # noqa: SIM115 (lives as long as the process)
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    torch.set_num_threads(1)  # 4 processes per system on 2 cores: every system gets the same oversubscription
    try:
        trainer = TRAINERS[spec.system](spec, rank, port)
        report = _measure(trainer, spec, index, num_turns, turns)
        report["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
        out.with_suffix(".json").write_text(json.dumps(report))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        out.with_suffix(".err").write_text(traceback.format_exc())
        sys.stderr.flush()
        raise


def _measure(trainer, spec: RunSpec, index: int, num_turns: int, turns) -> dict:
    """Every step: wait for this system's turn, run the step, time it on this rank.

    All ranks of the system leave the turn barrier together and every system's step
    ends in a collective over all its ranks (the loss all-reduce or broadcast), so a
    rank's step time is the group's, up to the wake-up skew.
    """
    losses, step_s = [], []
    for step in range(spec.warmup + spec.timed):
        if step == spec.warmup:
            trainer.breakdown.clear()
        for turn in range(num_turns):
            turns.wait(TURN_TIMEOUT_S)
            if turn != index:
                continue
            t0, cpu0 = time.perf_counter(), time.process_time()
            faults0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            losses.append(trainer.step(step))
            if step >= spec.warmup:
                step_s.append(time.perf_counter() - t0)
                # CPU seconds of every thread of the process: a rank that waits without spinning uses none.
                _add(trainer.breakdown, "cpu_s", time.process_time() - cpu0)
                # Pages first touched (a fresh allocation's): each costs the kernel a zeroed page, on this CPU.
                _add(trainer.breakdown, "page_faults", resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0)
    turns.wait(TURN_TIMEOUT_S)  # nobody tears down (reports, group shutdown) while another system still steps
    breakdown = {k: v / spec.timed for k, v in trainer.breakdown.items()}
    return {"losses": losses, "step_s": step_s, "breakdown": breakdown}


DDP_OPTIONS = {"find_unused_parameters": True, "gradient_as_bucket_view": True}
"""The DDP peers' options. Unused parameters are real here: a microbatch without images leaves the vision
encoder idle. Gradients as views of DDP's buckets (saving its copy back after each bucket's all-reduce), as the
engine's are of its chunks' (``GradientSync.attach``): DDP as a user tuning for speed runs it."""


def peer_adamw(params, hp) -> torch.optim.AdamW:
    """A peer's AdamW with the job's hyperparameters and the engine's fused kernel
    (``runtime.optim.build_layer_optimizer``): the same update cost on both sides of a comparison."""
    return torch.optim.AdamW(
        params, lr=hp.lr, betas=tuple(hp.betas), eps=hp.eps, weight_decay=hp.weight_decay, fused=True
    )


def _add(breakdown: dict[str, float], key: str, seconds: float) -> None:
    breakdown[key] = breakdown.get(key, 0.0) + seconds


STORE_HOST = "127.0.0.1"
"""Where rank 0's store listens: its host's address on a bench network (``launch``'s ``hosts``)."""


def _join(job, rank: int, port: int, world_size: int) -> None:
    """Join this system's group on a store its rank 0 hosts."""
    store = dist.TCPStore(STORE_HOST, port, world_size, is_master=rank == 0, timeout=timedelta(seconds=120))
    join_generation(
        store,
        0,
        rank,
        world_size,
        job.cluster.resolved_backend,
        collective_timeout=timedelta(seconds=300),
        arrival_timeout=timedelta(seconds=300),
    )


# --------------------------------------------------------------------------- engine


class EngineTrainer:
    """``StageEngine`` as is; packing, gradient sync and the update are timed by wrapping them (no library change)."""

    def __init__(self, spec: RunSpec, rank: int, port: int):
        import oobleck_mm.runtime.engine as engine_module

        _join(spec.job, rank, port, spec.plan.world_size)
        self.engine = engine_module.StageEngine(spec.job, spec.plan, rank)
        self.breakdown: dict[str, float] = {}
        self.engine.data.microbatch = self._timed("pack_s", self.engine.data.microbatch)
        # Parts of the engine's comm_s: the layer-wise all-reduce and the global-norm all-reduce.
        self.engine.sync.all_reduce = self._timed("grad_allreduce_s", self.engine.sync.all_reduce)
        self.engine.sync.global_grad_sq = self._timed("grad_norm_s", self.engine.sync.global_grad_sq)
        engine_module.apply_update = self._timed("update_s", engine_module.apply_update)

    def _timed(self, key: str, fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                _add(self.breakdown, key, time.perf_counter() - t0)

        return wrapper

    def step(self, step: int) -> float:
        r = self.engine.train_step(step)
        for key in ("step_time_s", "forward_s", "backward_s", "comm_s"):
            _add(self.breakdown, key, getattr(r, key))
        return r.loss


# --------------------------------------------------------------------------- DDP peer


class WholeModel(nn.Module):
    """Every layer of the model in order: ``PackedBatch -> logits``."""

    def __init__(self, job):
        super().__init__()
        specs = model_layer_specs(job)
        self.layers = nn.ModuleList(build_layer(job, i, specs) for i in range(len(specs)))

    def forward(self, batch: PackedBatch) -> torch.Tensor:
        acts: tuple[torch.Tensor, ...] = ()
        for layer in self.layers:
            acts = layer(acts, batch)
        return acts[0]


class DDPTrainer:
    def __init__(self, spec: RunSpec, rank: int, port: int):
        from torch.nn.parallel import DistributedDataParallel

        if any(p.ranks != (i,) for i, p in enumerate(spec.plan.pipelines)):
            raise ValueError("ddp mirrors a plan of single-stage pipelines, pipeline i on rank i")
        _join(spec.job, rank, port, spec.plan.world_size)
        self.job, self.plan, self.rank = spec.job, spec.plan, rank
        self.data = TrainingData(spec.job)
        self.model = DistributedDataParallel(WholeModel(spec.job), **DDP_OPTIONS)
        hp = spec.job.training.optimizer.params
        self.optimizer = peer_adamw(self.model.parameters(), hp)
        self.breakdown: dict[str, float] = {}

    def step(self, step: int) -> float:
        t_step = time.perf_counter()
        ids = self.data.global_batch(step)
        loss_tokens = self.data.loss_tokens(ids)
        counts = [p.num_microbatches for p in self.plan.pipelines]
        mine = contiguous_assignment(ids, counts, self.plan.microbatch_size).pipelines[self.rank]
        total = torch.zeros((), dtype=torch.float64)
        world = dist.get_world_size()
        for k, ids_mb in enumerate(mine):
            t0 = time.perf_counter()
            batch = self.data.microbatch(ids_mb)
            t1 = time.perf_counter()
            sync = k == len(mine) - 1
            with contextlib.nullcontext() if sync else self.model.no_sync():
                loss = microbatch_loss(self.model(batch), batch, loss_tokens)
                t2 = time.perf_counter()
                # DDP averages over ranks; the update is the sum of the loss-token-normalised losses.
                (loss * world).backward()
            total += loss.detach().double()
            t3 = time.perf_counter()
            _add(self.breakdown, "pack_s", t1 - t0)
            _add(self.breakdown, "forward_s", t2 - t1)
            # The last microbatch's backward includes DDP's bucketed all-reduce (overlapped, then awaited).
            _add(self.breakdown, "backward_s", t3 - t2)
        t0 = time.perf_counter()
        clip = self.job.training.gradient_clipping
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
        set_lr(self.optimizer, lr_at(self.job.training, step))  # DeepSpeed's schedule, as the engine's
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        _add(self.breakdown, "update_s", time.perf_counter() - t0)
        dist.all_reduce(total)
        _add(self.breakdown, "step_time_s", time.perf_counter() - t_step)
        return float(total)


# --------------------------------------------------------------------------- DeepSpeed peer


class StaticBatch:
    """The shape-only parts of a fixed-shape microbatch (attention spans, positions, placements), built once."""

    def __init__(self, template: PackedBatch):
        if template.vision is None or template.audio is not None:
            raise ValueError("the DeepSpeed peer runs vision-language models (model.vision set, no model.audio)")
        template.spans()  # cached in the template, shared by every microbatch built from it
        template.vision.spans()
        self.template = template

    def batch(self, tokens: torch.Tensor, features: torch.Tensor | None = None) -> PackedBatch:
        vision = self.template.vision
        if features is not None:
            vision = dataclasses.replace(vision, features=features)
        return dataclasses.replace(self.template, tokens=tokens, vision=vision)

    def check(self, batch: PackedBatch) -> None:
        t, v = self.template, batch.vision
        same = (
            torch.equal(t.positions, batch.positions)
            and torch.equal(t.segments, batch.segments)
            and torch.equal(t.vision.grid, v.grid)
            and torch.equal(t.vision.segments, v.segments)
            and torch.equal(t.vision.llm_positions, v.llm_positions)
        )
        if not same:
            raise ValueError(
                f"microbatch {batch.sample_ids} does not have the template's shapes; "
                "the DeepSpeed peer needs fixed-shape data"
            )


class PipeLayer(nn.Module):
    """One of our layers as DeepSpeed calls it: ``(tokens, *acts) -> (tokens, *acts)``.

    Layer 0 (the patch embedding) receives ``(tokens, pixels)`` from the data
    iterator; tokens ride along so ``llm.embed`` can read them on any stage.
    """

    def __init__(self, job, index: int, statics: StaticBatch):
        super().__init__()
        self.index, self.statics = index, statics
        self.layer = build_layer(job, index)
        # DeepSpeed's fp32 clipping (runtime/utils.clip_grad_norm_) counts a parameter's gradient in the
        # global norm only on pipeline stage 0 unless it is marked model-parallel: mark every parameter
        # so each stage counts its own and the norm covers the whole model, as the engine's does.
        for p in self.layer.parameters():
            p.model_parallel = True

    def forward(self, x: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        tokens, *acts = x
        if self.index == 0:
            batch, acts = self.statics.batch(tokens, features=acts[0]), ()
        else:
            batch = self.statics.batch(tokens)
        return (tokens, *self.layer(tuple(acts), batch))


class DeepSpeedTrainer:
    def __init__(self, spec: RunSpec, rank: int, port: int):
        import deepspeed
        from deepspeed.pipe import LayerSpec, PipelineModule

        if len(spec.plan.pipelines) != 1:
            raise ValueError("the DeepSpeed peer runs one pipeline (no data parallelism)")
        os.environ.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(spec.plan.world_size),
        )
        deepspeed.init_distributed(dist_backend="gloo", timeout=timedelta(seconds=300))
        self.job, self.plan = spec.job, spec.plan
        self.data = TrainingData(spec.job)
        self.mbs = self.plan.microbatch_size
        self.gas = self.plan.pipelines[0].num_microbatches
        self.statics = StaticBatch(self.data.microbatch(self.data.global_batch(0)[: self.mbs]))
        self.loss_tokens = self.data.loss_tokens(self.data.global_batch(0))
        stages = self.plan.pipelines[0].stages
        cuts = [s.layer_start for s in stages] + [stages[-1].layer_end]
        module = PipelineModule(
            layers=[LayerSpec(PipeLayer, spec.job, i, self.statics) for i in range(self.plan.num_layers)],
            num_stages=len(stages),
            loss_fn=self._loss,
            partition_method="uniform",
        )
        if list(module.parts) != cuts:
            raise ValueError(f"DeepSpeed cut the layers at {list(module.parts)}, the engine's plan at {cuts}")
        training = spec.job.training
        hp = training.optimizer.params
        optimizer = peer_adamw(module.parameters(), hp)
        config = {
            "train_micro_batch_size_per_gpu": self.mbs,
            "gradient_accumulation_steps": self.gas,
            "gradient_clipping": training.gradient_clipping,
            "steps_per_print": 10**9,
            "wall_clock_breakdown": False,
        }
        if training.scheduler is not None:  # our scheduler section is DeepSpeed's, keys and meaning
            config["scheduler"] = {
                "type": training.scheduler.type,
                "params": training.scheduler.deepspeed_params(training.steps),
            }
        self.engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, config=config)
        self.breakdown: dict[str, float] = {}
        self._iter = self._microbatches()
        self._next_step = 0

    def _loss(self, outputs: tuple[torch.Tensor, ...], labels: torch.Tensor) -> torch.Tensor:
        # DeepSpeed divides the loss by the accumulation steps before backward and when averaging;
        # undo it so the gradient is the engine's (sum over the global batch / global loss tokens).
        batch = dataclasses.replace(self.statics.template, labels=labels)
        return microbatch_loss(outputs[-1], batch, self.loss_tokens) * self.gas

    def _microbatches(self):
        """((tokens, pixels), labels) per microbatch, step after step (read by the first and last stage)."""
        step = 0
        while True:
            ids = self.data.global_batch(step)
            if self.data.loss_tokens(ids) != self.loss_tokens:
                raise ValueError(f"step {step}: loss tokens differ from step 0's; data is not fixed-shape")
            for mb in contiguous_assignment(ids, [self.gas], self.mbs).pipelines[0]:
                t0 = time.perf_counter()
                batch = self.data.microbatch(mb)
                self.statics.check(batch)
                _add(self.breakdown, "pack_s", time.perf_counter() - t0)
                yield (batch.tokens, batch.vision.features), batch.labels
            step += 1

    def step(self, step: int) -> float:
        if step != self._next_step:  # the data iterator walks the steps in order
            raise ValueError(f"step {step}: the DeepSpeed peer runs steps in order, expected {self._next_step}")
        self._next_step += 1
        t0 = time.perf_counter()
        loss = float(self.engine.train_batch(self._iter))
        _add(self.breakdown, "step_time_s", time.perf_counter() - t0)
        return loss


# --------------------------------------------------------------------------- plain transformers under DDP


class HFModel(nn.Module):
    """The unsplit transformers model on a right-padded microbatch: ``PackedBatch -> packed logits``.

    The logits of each sample's real positions are concatenated in the packed order, so the
    engine's ``microbatch_loss`` (and its labels) apply unchanged."""

    def __init__(self, job):
        super().__init__()
        import transformers

        from oobleck_mm.data.sample import IMAGE

        hf = job.model.hf
        auto = transformers.AutoModelForImageTextToText if hf.is_multimodal else transformers.AutoModelForCausalLM
        self.model = auto.from_pretrained(job.model.huggingface, attn_implementation="sdpa", dtype=torch.float32)
        self.image_token, self.image = hf.image_token_id, IMAGE
        if hf.is_multimodal:
            self.side, self.patch, self.channels = (
                hf.vision["image_size"],
                hf.vision["patch_size"],
                hf.vision["num_channels"],
            )

    def forward(self, batch: PackedBatch) -> torch.Tensor:
        # The packed microbatch already holds each sample's sequence with its image slots expanded.
        rows = [batch.tokens[s:e] for s, e in batch.spans()]
        width = max(len(r) for r in rows)
        input_ids = torch.zeros(len(rows), width, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for k, r in enumerate(rows):
            input_ids[k, : len(r)] = torch.where(r == self.image, self.image_token, r)
            mask[k, : len(r)] = 1
        kwargs = {}
        if batch.vision is not None and batch.vision.features.shape[0]:
            n, p, c = self.side // self.patch, self.patch, self.channels
            feats = batch.vision.features
            kwargs["pixel_values"] = (
                feats.reshape(-1, n, n, c, p, p).permute(0, 3, 1, 4, 2, 5).reshape(-1, c, self.side, self.side)
            )
        logits = self.model(input_ids=input_ids, attention_mask=mask, **kwargs).logits
        return torch.cat([logits[k, : len(r)] for k, r in enumerate(rows)])


class HFDDPTrainer(DDPTrainer):
    def __init__(self, spec: RunSpec, rank: int, port: int):
        from torch.nn.parallel import DistributedDataParallel

        if spec.job.model.huggingface is None:
            raise ValueError("hf_ddp runs model.huggingface jobs")
        _join(spec.job, rank, port, spec.plan.world_size)
        self.job, self.plan, self.rank = spec.job, spec.plan, rank
        self.data = TrainingData(spec.job)
        model = HFModel(spec.job)
        self.model = DistributedDataParallel(model, **DDP_OPTIONS)
        hp = spec.job.training.optimizer.params
        # The parameters the engine trains (CLIP's unused tail gets no gradient and AdamW skips it).
        self.optimizer = peer_adamw(self.model.parameters(), hp)
        self.breakdown: dict[str, float] = {}


TRAINERS = {"engine": EngineTrainer, "ddp": DDPTrainer, "deepspeed": DeepSpeedTrainer, "hf_ddp": HFDDPTrainer}
