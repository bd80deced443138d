"""Mixed precision: compute-dtype copies of the master layers, gradients accumulated into the masters.

The layers a worker holds (``StageEngine.layers``, what the optimizer updates,
what state transfer, checkpoints, ``verify`` and export read) are the masters,
in ``training.master_dtype``. Under mixed precision each gets a copy whose
parameters are cast to ``training.dtype``; forward and backward run on the
copies, and a post-accumulate-grad hook on every trainable copy parameter adds
its gradient, cast to the master dtype, into the master's ``.grad`` and frees
it. So gradients accumulate across microbatches in the master dtype (a bf16
accumulation would round every microbatch's contribution), the all-reduce,
clipping and the AdamW step run on the masters as in full precision, and
``sync`` casts the updated masters back into the copies.

Buffers are not cast: rotary frequencies and position tables keep the precision
the model built them in, as transformers keeps them.
"""

from __future__ import annotations

import copy
import math
import os
from collections.abc import Mapping

import torch
from torch import nn


class ComputeCopies:
    """``compute[i]``: layer ``i`` in the compute dtype, its gradients flowing into ``masters[i]``."""

    def __init__(self, masters: Mapping[int, nn.Module], dtype: torch.dtype):
        self.masters = masters
        self.dtype = dtype
        self.compute: dict[int, nn.Module] = {}
        self._pairs: list[tuple[nn.Parameter, nn.Parameter]] = []
        for index, master in masters.items():
            self.compute[index] = self._copy(master)

    def _copy(self, master: nn.Module) -> nn.Module:
        mine = copy.deepcopy(master)
        # remove_duplicate=False: a parameter shared inside a layer is paired once per use.
        pairs = zip(
            mine.named_parameters(remove_duplicate=False), master.named_parameters(remove_duplicate=False), strict=True
        )
        for (_, p), (_, q) in pairs:
            p.data = q.detach().to(self.dtype)
            self._pairs.append((p, q))
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(_into(q))
        return mine

    @torch.no_grad()
    def sync(self) -> None:
        """Cast every master parameter into its copy (after an optimizer step or a state load)."""
        for p, q in self._pairs:
            p.copy_(q)


def _into(master: nn.Parameter):
    def hook(p: torch.Tensor) -> None:
        if master.grad is None:
            master.grad = p.grad.to(master.dtype)
        else:  # (the usual case: ``GradientSync.attach`` gave it a view of its chunk's buffer)
            master.grad.add_(p.grad)  # cast as it is read: the same sum, no master-dtype temporary
        p.grad = None

    return hook


# --------------------------------------------------------------------------- float16 overflow injection

OVERFLOW_ENV = "OOBLECK_INJECT_OVERFLOW"
"""Fault injection for float16 runs: ``"STEP[@RANK],..."`` puts an inf into a gradient of that rank
(every rank without ``@RANK``; the reference trainer ignores the rank) before the all-reduce of that
step, as a real overflow would. Every rank must then skip that step."""


def overflow_injected(step: int, rank: int | None = None) -> bool:
    for item in filter(None, (x.strip() for x in os.environ.get(OVERFLOW_ENV, "").split(","))):
        at, _, who = item.partition("@")
        if int(at) == step and (not who or rank is None or int(who) == rank):
            return True
    return False


@torch.no_grad()
def poison_gradients(layers: Mapping[int, nn.Module]) -> None:
    """An inf in the first trainable gradient this rank holds."""
    for index in sorted(layers):
        for p in layers[index].parameters():
            if p.requires_grad:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad  # a shard on a wide stage
                grad.view(-1)[0] = math.inf
                return
