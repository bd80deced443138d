"""The single-process reference trainer: the correctness oracle of every distributed run.

Same layers (same deterministic init), same global batches (same sampler),
same loss normalisation (the global number of loss tokens), same clipping,
learning rate and per-layer AdamW as the engine. It runs the whole global batch
on one process as gradient accumulation over fixed-size microbatches, which is
what any split across pipelines must reproduce.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from oobleck_mm.config.emulation import compute_job
from oobleck_mm.data.loader import TrainingData
from oobleck_mm.errors import UserError
from oobleck_mm.model.layers import build_layer, microbatch_loss, model_layer_specs, tied_pair
from oobleck_mm.precision import LossScaler, compute_dtype, is_mixed
from oobleck_mm.runtime.mixed import ComputeCopies, overflow_injected, poison_gradients
from oobleck_mm.runtime.optim import build_layer_optimizer
from oobleck_mm.runtime.update import apply_update, grad_sq, trainable_params


WORKER_THREADS = 1
"""Torch threads per worker process (the launcher's OMP_NUM_THREADS default)."""


class ReferenceTrainer:
    def __init__(self, job, data: TrainingData | None = None, reverse_microbatches: bool = False):
        job = compute_job(job)  # an emulated job's workers compute its shrunk copy (config.emulation)
        self.job = job
        self.reverse_microbatches = reverse_microbatches
        """Accumulate each step's microbatches last to first: the same sum in another rounding
        (``verify`` measures a float32 run's reordering drift with it)."""
        self.start_step = 0
        """The first step to train: 0, or a loaded checkpoint's step."""
        self.specs = model_layer_specs(job)
        self.data = data if data is not None else TrainingData(job)
        self.layers = nn.ModuleList(build_layer(job, i, self.specs) for i in range(len(self.specs)))
        pair = tied_pair(self.specs)
        if pair is not None:  # one parameter, as in the unsplit model: autograd sums both uses
            self.layers[pair[1]].tie_to(self.layers[pair[0]].tied_weight)
        seen: set[int] = set()
        self.optimizers = {}
        for i, layer in enumerate(self.layers):
            params = [p for p in trainable_params(layer) if id(p) not in seen]
            seen.update(id(p) for p in params)
            if params:
                self.optimizers[i] = build_layer_optimizer(params, job.training)
        # The layers above are the masters; mixed precision computes on copies (as the engine does).
        self.mixed = (
            ComputeCopies(dict(enumerate(self.layers)), compute_dtype(job.training)) if is_mixed(job.training) else None
        )
        self.compute = self.mixed.compute if self.mixed is not None else dict(enumerate(self.layers))
        self.scaler = LossScaler.for_training(job.training)

    def train_step(self, step: int, microbatches=None) -> float:
        """One iteration at 0-based global step ``step``; returns the global batch's mean token loss.

        ``microbatches``: the sample ids of each microbatch, when replaying an engine step whose
        balancer composed them (default: the global batch in ``microbatch_size`` chunks)."""
        threads = torch.get_num_threads()
        # The workers' thread count (OMP_NUM_THREADS=1 by default): a CPU kernel's float32 sums depend
        # on how it splits work over threads, and float32 compute must round as the workers' does.
        torch.set_num_threads(WORKER_THREADS)
        try:
            return self._train_step(step, microbatches)
        finally:
            torch.set_num_threads(threads)

    def _train_step(self, step: int, microbatches=None) -> float:
        ids = self.data.global_batch(step)
        loss_tokens = self.data.loss_tokens(ids)
        total = 0.0
        mbs = self.job.training.microbatch_size
        if microbatches is None:
            microbatches = [ids[start : start + mbs] for start in range(0, len(ids), mbs)]
            if self.reverse_microbatches:
                microbatches.reverse()
        elif sorted(i for mb in microbatches for i in mb) != sorted(ids):
            raise ValueError(f"step {step}: the microbatches do not hold the global batch's samples")
        for chunk in microbatches:
            batch = self.data.microbatch(chunk)
            acts: tuple[torch.Tensor, ...] = ()
            for i in range(len(self.layers)):
                acts = self.compute[i](acts, batch)
            loss = microbatch_loss(acts[0], batch, loss_tokens)
            (loss * self.scaler.scale if self.scaler is not None else loss).backward()
            total += loss.item()
        if overflow_injected(step):
            poison_gradients(dict(enumerate(self.layers)))
        norm_sq = float(sum(grad_sq(layer) for layer in self.layers))
        scale = self.scaler.scale if self.scaler is not None else 1.0
        if self.scaler is not None:
            overflow = LossScaler.overflowed(norm_sq)
            self.scaler.update(overflow)
            if overflow:  # skipped, as the engine skips it on every rank
                for optimizer in self.optimizers.values():
                    optimizer.zero_grad(set_to_none=True)
                return total
        apply_update(dict(enumerate(self.layers)), self.optimizers, norm_sq, step, self.job.training, grad_scale=scale)
        if self.mixed is not None:
            self.mixed.sync()
        return total

    def train(self, steps: int, start_step: int = 0) -> Iterator[tuple[int, float]]:
        for step in range(start_step, start_step + steps):
            yield step, self.train_step(step)

    def load_checkpoint(self, directory: str) -> int:
        """Continue from an engine checkpoint: parameters, Adam moments, loss scale; returns its step.

        Optimizer state is matched parameter by parameter (``trainable_params`` order), so a tied LM
        head, whose weight the reference holds once (in the embedding's optimizer), takes the rest
        of its state from its shard.
        """
        from oobleck_mm.runtime.checkpoint import load_layer, read_loss_scaler
        from oobleck_mm.runtime.checkpoint_meta import read_meta

        meta = read_meta(directory)
        names = [s.name for s in self.specs]
        if meta["layer_names"] != names:
            raise UserError(f"{directory}: layers {meta['layer_names']} are not this model's {names}")
        with torch.no_grad():
            for i, layer in enumerate(self.layers):
                held = load_layer(directory, self.job, i, self.specs)
                for mine, saved in zip(layer.state_dict().values(), held.module.state_dict().values()):
                    mine.copy_(saved)
                if i not in self.optimizers or held.optimizer is None:
                    continue
                owned = {id(p) for group in self.optimizers[i].param_groups for p in group["params"]}
                for mine, saved in zip(trainable_params(layer), trainable_params(held.module)):
                    if id(mine) in owned and saved in held.optimizer.state:
                        self.optimizers[i].state[mine] = {k: v.clone() for k, v in held.optimizer.state[saved].items()}
        if self.scaler is not None:
            state = read_loss_scaler(directory, names[0])
            if state is not None:
                self.scaler.load_state_dict(state)
        if self.mixed is not None:
            self.mixed.sync()
        self.start_step = int(meta["step"])
        return self.start_step

    def layer_state(self, index: int) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.layers[index].state_dict().items()}
