"""Layers stay in the autograd graph whatever a microbatch's samples (stages of several GPUs need it).

A stage of several GPUs runs FSDP2 (docs/runtime.md), which issues its parameter
all-gathers and gradient reduce-scatters from autograd hooks, while the stage's
ranks run different samples of a microbatch. A layer that skips its work for a
rank's samples (an encoder block over a microbatch without images) would leave
that rank out of the layer's backward collectives while its peers run them, and
the ranks' collectives would no longer pair up (found: a 2-GPU first stage hung
in a reduce-scatter). Such a layer adds 0 made of its parameters to its empty
output instead; a token embedding adds an empty encoder output's sum (0). No value
changes; the skipped layer's gradients are zeros, as ``fill_missing_grads`` makes
them anyway.
"""

from __future__ import annotations

import torch
from torch import nn


def zero_of(module: nn.Module) -> torch.Tensor | int:
    """0, as a function of every parameter of ``module`` (0 itself for a module without parameters)."""
    sums = [p.sum() for p in module.parameters()]
    return torch.stack(sums).sum() * 0 if sums else 0
