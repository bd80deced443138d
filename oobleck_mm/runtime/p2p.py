"""Point-to-point transfer of a tuple of tensors between pipeline stages, with their shapes every time.

Multimodal microbatches change shape from one microbatch to the next (image
count, resolutions, text lengths), so nothing is cached: each transfer sends a
fixed-size int64 header (count, then dtype code, ndim and shape per tensor)
and then the tensors. Empty tensors (a microbatch without images) travel in the
header only. Works on any torch.distributed backend with send/recv (gloo, NCCL).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

HEADER_LEN = 32
_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.bool)
_CODE = {d: i for i, d in enumerate(_DTYPES)}


def encode_header(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    fields = [len(tensors)]
    for t in tensors:
        if t.dtype not in _CODE:
            raise ValueError(f"cannot send a tensor of dtype {t.dtype}; supported: {_DTYPES}")
        fields += [_CODE[t.dtype], t.dim(), *t.shape]
    if len(fields) > HEADER_LEN:
        raise ValueError(f"{len(tensors)} tensors of shapes {[tuple(t.shape) for t in tensors]} exceed the header")
    return torch.tensor(fields + [0] * (HEADER_LEN - len(fields)), dtype=torch.int64)


def decode_header(header: torch.Tensor) -> list[tuple[torch.dtype, tuple[int, ...]]]:
    h = header.tolist()
    out, pos = [], 1
    for _ in range(h[0]):
        dtype, ndim = _DTYPES[h[pos]], h[pos + 1]
        out.append((dtype, tuple(h[pos + 2 : pos + 2 + ndim])))
        pos += 2 + ndim
    return out


def send_tensors(tensors: Sequence[torch.Tensor], dst: int, device: torch.device | str = "cpu", group=None) -> int:
    """Send ``tensors`` to global rank ``dst``; returns the payload bytes."""
    dist.send(encode_header(tensors).to(device), dst, group=group)
    sent = 0
    for t in tensors:
        if t.numel():
            t = t.detach().contiguous()
            dist.send(t, dst, group=group)
            sent += t.numel() * t.element_size()
    return sent


def recv_tensors(src: int, device: torch.device | str = "cpu", group=None) -> tuple[torch.Tensor, ...]:
    header = torch.empty(HEADER_LEN, dtype=torch.int64, device=device)
    dist.recv(header, src, group=group)
    out = []
    for dtype, shape in decode_header(header.cpu()):
        t = torch.empty(shape, dtype=dtype, device=device)
        if t.numel():
            dist.recv(t, src, group=group)
        out.append(t)
    return tuple(out)
