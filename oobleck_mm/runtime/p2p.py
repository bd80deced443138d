"""Point-to-point transfer of a tuple of tensors between pipeline stages, with their shapes every time.

Multimodal microbatches change shape from one microbatch to the next (image
count, resolutions, text lengths), so nothing is cached: each transfer sends a
fixed-size int64 header (count, then dtype code, ndim and shape per tensor)
and then the tensors. Empty tensors (a microbatch without images) travel in the
header only. Works on any torch.distributed backend with send/recv (gloo, NCCL).

The header's last field carries, for an emulated run (``cluster.emulate``), when the
bytes would arrive on the emulated network (``time.monotonic()`` microseconds, one
clock for every process of the machine; 0 otherwise): the receiver waits until then
(``runtime/emulated.py``), since the real transfer of a shrunk model costs nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from oobleck_mm.runtime.waiting import PeerFailure, Waiter

_BLOCKING = Waiter()

HEADER_LEN = 32
_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.bool)
_CODE = {d: i for i, d in enumerate(_DTYPES)}


_ARRIVAL = HEADER_LEN - 1
"""The header field of the emulated arrival time (see the module's docstring)."""


def encode_header(tensors: Sequence[torch.Tensor], arrival_s: float = 0.0) -> torch.Tensor:
    fields = [len(tensors)]
    for t in tensors:
        if t.dtype not in _CODE:
            raise ValueError(f"cannot send a tensor of dtype {t.dtype}; supported: {_DTYPES}")
        fields += [_CODE[t.dtype], t.dim(), *t.shape]
    if len(fields) > _ARRIVAL:
        raise ValueError(f"{len(tensors)} tensors of shapes {[tuple(t.shape) for t in tensors]} exceed the header")
    fields += [0] * (_ARRIVAL - len(fields)) + [round(arrival_s * 1e6)]
    return torch.tensor(fields, dtype=torch.int64)


ABANDONED = -1
"""A header's tensor count that says the sender abandoned the step (``send_abandoned``)."""


class AbandonedByPeer(PeerFailure):
    """The rank this one was receiving from abandoned the step (``send_abandoned``)."""


def send_abandoned(dst: int, device: torch.device | str = "cpu"):
    """Tell rank ``dst`` that this rank abandoned the step: a header whose count is ``ABANDONED``, not waited
    on. A neighbour blocked receiving from this rank (which is alive, so its sockets stay open) would otherwise
    wait out the group's whole timeout, since gloo's point-to-point waits cannot be interrupted
    (``runtime.waiting``); the notice ends its wait at once. Sent only when the generation is over (the
    group is retired after), so one nobody reads is harmless. Returns the request (keep it, and the tensor,
    alive until the group goes)."""
    fields = [ABANDONED] + [0] * (HEADER_LEN - 1)
    header = torch.tensor(fields, dtype=torch.int64).to(device)
    return header, dist.isend(header, dst)


def decode_header(header: torch.Tensor) -> list[tuple[torch.dtype, tuple[int, ...]]]:
    h = header.tolist()
    out, pos = [], 1
    for _ in range(h[0]):
        dtype, ndim = _DTYPES[h[pos]], h[pos + 1]
        out.append((dtype, tuple(h[pos + 2 : pos + 2 + ndim])))
        pos += 2 + ndim
    return out


def send_tensors(
    tensors: Sequence[torch.Tensor],
    dst: int,
    device: torch.device | str = "cpu",
    waiter: Waiter = _BLOCKING,
    arrival_s: float = 0.0,
) -> int:
    """Send ``tensors`` to global rank ``dst``; returns the payload bytes. ``arrival_s``: the emulated arrival
    time the receiver waits for (0: none)."""
    # The tensors stay referenced here until every request completes.
    payload = [encode_header(tensors, arrival_s).to(device)] + [t.detach().contiguous() for t in tensors if t.numel()]
    works = [dist.isend(t, dst) for t in payload]
    sent = sum(t.numel() * t.element_size() for t in payload[1:])
    for work in works:
        waiter.wait(work, f"send to rank {dst}", pollable=False)
    return sent


def recv_tensors(src: int, device: torch.device | str = "cpu", waiter: Waiter = _BLOCKING) -> tuple[torch.Tensor, ...]:
    return recv_tensors_timed(src, device, waiter)[0]


def recv_tensors_timed(
    src: int, device: torch.device | str = "cpu", waiter: Waiter = _BLOCKING
) -> tuple[tuple[torch.Tensor, ...], float]:
    """``recv_tensors``, and the emulated arrival time the sender wrote (0.0: none)."""
    header = torch.empty(HEADER_LEN, dtype=torch.int64, device=device)
    waiter.wait(dist.irecv(header, src), f"receive from rank {src}", pollable=False)
    header = header.cpu()
    if int(header[0]) == ABANDONED:
        raise AbandonedByPeer(f"receive from rank {src}: it abandoned the step")
    out = []
    for dtype, shape in decode_header(header):
        t = torch.empty(shape, dtype=dtype, device=device)
        if t.numel():
            waiter.wait(dist.irecv(t, src), f"receive from rank {src}", pollable=False)
        out.append(t)
    return tuple(out), int(header[_ARRIVAL]) / 1e6
