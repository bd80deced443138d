"""Building a layer whose values are about to be overwritten, without paying for its random init.

A layer read from a checkpoint, received from a peer in a state copy, or loaded
from a HuggingFace directory gets every parameter and persistent buffer written
by the load. Its random initialisation is pure cost: most of the time to build
a layer whose weights are read (docs/benchmarks.md, HuggingFace loading), and
on a recovery's critical path for a survivor that receives layers.

Two switches, each skipping only fills whose values the load replaces:

- ``skipping_random_init()`` makes ``torch.nn.init``'s leaf random fills
  (``uniform_``, ``normal_``, ``kaiming_uniform_``: what ``nn.Linear``,
  ``nn.Conv2d`` and ``nn.Embedding`` constructors call) return their tensor
  untouched while a layer is built. Only functions that dispatch as themselves
  through ``__torch_function__`` are skipped, never ``Tensor.normal_`` and
  friends: ``trunc_normal_`` resamples in a loop until its values fall inside
  its bounds, and a skipped ``Tensor.normal_`` would leave it looping forever on
  whatever ``torch.empty`` gave. A function that does not dispatch runs in full.
- ``marked_as_loaded(module)`` sets transformers' own ``_is_hf_initialized``
  flag on the parameters and persistent buffers while ``_init_weights`` runs,
  which transformers' ``initialization`` functions honour (``from_pretrained``
  uses it to skip what it loaded), ``trunc_normal_`` and ``xavier_uniform_``
  included. Non-persistent buffers (position ids, rotary frequencies) are not
  flagged: no load writes them, so they are computed as always.

Every caller loads with a check that each value was written
(``load_state_dict``'s strict keys, ``HFLayer.hf_names`` covering the whole
state dict with ``hf_weights``' "no tensor" error, the state copy's packed
targets).

Why not transformers' ``no_init_weights``: it replaces ``torch.nn.init``'s
functions for the whole process while active; a ``TorchFunctionMode`` applies
to the thread that entered it only (a joiner prepares its layers in the
background while its main thread may build others). Why not the meta device
and ``to_empty``: the buffers computed in constructors would be left
uninitialised.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch.nn.init as init
from torch import nn
from torch.overrides import TorchFunctionMode

SKIPPED_FILLS = frozenset(
    {
        init.uniform_,
        init.normal_,
        init.trunc_normal_,
        init.kaiming_uniform_,
        init.kaiming_normal_,
        init.xavier_uniform_,
        init.xavier_normal_,
        init.orthogonal_,
        init.sparse_,
    }
)
"""``torch.nn.init``'s random fills. Those that dispatch through ``__torch_function__`` (in
torch 2.13: ``uniform_``, ``normal_``, ``kaiming_uniform_``) are skipped whole; the others never
reach the mode as themselves and run in full (see the module's docstring)."""

HF_FLAG = "_is_hf_initialized"
"""transformers' mark for a tensor that ``from_pretrained`` loaded: its ``initialization``
functions leave such a tensor as it is."""


class _SkipRandomFills(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in SKIPPED_FILLS:
            return args[0] if args else kwargs["tensor"]
        return func(*args, **(kwargs or {}))


def skipping_random_init() -> TorchFunctionMode:
    """Context manager: this thread's ``torch.nn.init`` random fills do nothing while it is active."""
    return _SkipRandomFills()


@contextmanager
def marked_as_loaded(module: nn.Module) -> Iterator[None]:
    """transformers' ``initialization`` functions skip the module's parameters and persistent
    buffers (what a load writes) while active; the marks are removed after."""
    tensors = list(module.parameters()) + [
        b
        for sub in module.modules()
        for name, b in sub.named_buffers(recurse=False)
        if b is not None and name not in sub._non_persistent_buffers_set
    ]
    for t in tensors:
        setattr(t, HF_FLAG, True)
    try:
        yield
    finally:
        for t in tensors:
            if HF_FLAG in t.__dict__:
                delattr(t, HF_FLAG)
