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

from oobleck_mm.data.loader import TrainingData
from oobleck_mm.model.layers import build_layer, microbatch_loss, model_layer_specs, tied_pair
from oobleck_mm.runtime.optim import build_layer_optimizer
from oobleck_mm.runtime.update import apply_update, grad_sq, trainable_params


class ReferenceTrainer:
    def __init__(self, job, data: TrainingData | None = None):
        self.job = job
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

    def train_step(self, step: int) -> float:
        """One iteration at 0-based global step ``step``; returns the global batch's mean token loss."""
        ids = self.data.global_batch(step)
        loss_tokens = self.data.loss_tokens(ids)
        total = 0.0
        mbs = self.job.training.microbatch_size
        for start in range(0, len(ids), mbs):
            batch = self.data.microbatch(ids[start : start + mbs])
            acts: tuple[torch.Tensor, ...] = ()
            for layer in self.layers:
                acts = layer(acts, batch)
            loss = microbatch_loss(acts[0], batch, loss_tokens)
            loss.backward()
            total += loss.item()
        norm_sq = float(sum(grad_sq(layer) for layer in self.layers))
        apply_update(dict(enumerate(self.layers)), self.optimizers, norm_sq, step, self.job.training)
        return total

    def train(self, steps: int, start_step: int = 0) -> Iterator[tuple[int, float]]:
        for step in range(start_step, start_step + steps):
            yield step, self.train_step(step)

    def layer_state(self, index: int) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.layers[index].state_dict().items()}
