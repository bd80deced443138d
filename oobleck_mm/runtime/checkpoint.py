"""Layer-sharded checkpoints: each layer written once, with its optimizer state, plus the job's position.

Layout of a checkpoint directory::

    meta.json            {"format", "step", "num_layers", "layer_names", "layer_bytes", "layer_sha256",
                          "config", "sampler": {...}}
    layers/<name>.pt     {"params": state_dict, "optimizer": flat optimizer state or None}
    layers/<name>.sha256 the shard's sha256, computed by its writer as it wrote it (no second read)

``layer_bytes`` (each layer file's size, read when meta.json is written last)
and ``layer_sha256`` (the writers' digests, gathered then) let
``check_layer_files`` find a missing, truncated or corrupted shard before any
worker loads one.

``step`` is the next global step to run; the sampler is stateless in the step,
so it is the whole data position. Every rank writes the layers it owns (the
first holder of each layer), so a checkpoint costs one copy of the model
whatever the number of replicas, and it loads onto any plan: each worker reads
just the layers of its stage. The same files are what ``--save-final`` writes
and what ``python -m oobleck_mm.verify`` compares against.

``meta.json`` and the files' checks (``save_meta``, ``read_meta``, ``check_layer_files``,
``newest_checkpoint``) live in ``runtime.checkpoint_meta``: no torch, for the master and the launcher.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch

from oobleck_mm.errors import UserError
from oobleck_mm.runtime.checkpoint_meta import layer_file
from oobleck_mm.runtime.engine import HeldLayer, fresh_layer
from oobleck_mm.runtime.optim import load_optimizer_state, optimizer_state

SHARED_KEYS = ("loss_scaler", "balancer")
"""State the same on every rank that every shard carries (``StageEngine.shared_state``): float16's
loss scaler and the balancer's fitted cost model, so a resume goes on with both from whichever
shard a worker loads (``read_shared_state``) instead of starting them cold."""


def save_layers(
    directory: str | os.PathLike,
    held: Mapping[int, HeldLayer],
    layers: Iterable[int],
    specs,
    shared: Mapping | None = None,
) -> None:
    """Write ``layers`` (indices into ``held``) atomically, one file each, each with ``shared``."""
    for i in layers:
        write_layer_file(Path(directory), specs[i].name, layer_payload(held[i], shared))


def layer_payload(h: HeldLayer, shared: Mapping | None = None, copy: bool = False) -> dict:
    """One layer file's contents on the host. ``copy``: a snapshot that training may overwrite
    while it is written (an asynchronous checkpoint), not views of the live tensors."""
    take = (lambda v: v.detach().to("cpu", copy=True)) if copy else (lambda v: v.detach().cpu())
    return {
        "params": {k: take(v) for k, v in h.module.state_dict().items()},
        "optimizer": (
            {k: v.detach().cpu().clone() for k, v in optimizer_state(h.optimizer).items()}
            if h.optimizer is not None
            else None
        ),
        **{key: (shared or {}).get(key) for key in SHARED_KEYS},
    }


def write_error(exc: BaseException, directory: str) -> str:
    """A failed checkpoint write in words: the reason and the path ("No space left on device: PATH")."""
    if isinstance(exc, OSError):
        return f"{exc.strerror or exc}: {exc.filename or directory}"
    return f"{str(exc).splitlines()[0]}: {directory}"  # torch's writer wrapping the disk's error


def write_layer_file(directory: Path, name: str, payload: dict) -> str:
    """Atomically: a temporary file, flushed to disk, then renamed over the layer's file; then its
    sha256 (hashed from the bytes as they were written) next to it. Returns the digest."""
    path = layer_file(directory, name)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as fh:
        hashing = _HashingWriter(fh)
        torch.save(payload, hashing)
        fh.flush()
        os.fsync(fh.fileno())  # a crash after the rename must not leave a file of zeros behind the name
    os.replace(tmp, path)
    digest = hashing.sha256.hexdigest()
    sidecar = path.with_suffix(".sha256")
    sidecar.with_suffix(".sha256.tmp").write_text(digest + "\n")
    os.replace(sidecar.with_suffix(".sha256.tmp"), sidecar)
    return digest


class _HashingWriter:
    """A file that hashes what goes through it (torch.save writes its zip archive sequentially)."""

    def __init__(self, fh) -> None:
        self.fh, self.sha256 = fh, hashlib.sha256()

    def write(self, data) -> int:
        self.sha256.update(data)
        return self.fh.write(data)

    def flush(self) -> None:
        self.fh.flush()


def load_layer(directory: str | os.PathLike, job, index: int, specs, device="cpu") -> HeldLayer:
    """Layer ``index`` with its parameters and optimizer state from the checkpoint."""
    path = layer_file(Path(directory), specs[index].name)
    if not path.exists():
        raise UserError(f"{directory}: checkpoint has no layer {specs[index].name!r} ({path} missing)")
    payload = _load_shard(path, device)
    held = fresh_layer(job, index, specs, device, initialize=False)  # load_state_dict (strict) writes every value
    try:
        held.module.load_state_dict(payload["params"])
    except RuntimeError as exc:  # shapes or names differ: a checkpoint of another model, not a peer failure
        raise UserError(
            f"{path}: does not fit layer {specs[index].name!r} of this model: {str(exc).splitlines()[-1].strip()}"
        ) from None
    if held.optimizer is not None:
        if payload["optimizer"] is None:
            raise UserError(f"{path}: layer {specs[index].name!r} is trainable but was saved without optimizer state")
        load_optimizer_state(held.optimizer, payload["optimizer"])
    return held


def read_loss_scaler(directory: str | os.PathLike, name: str) -> dict | None:
    """The loss-scaler state layer ``name``'s shard carries (None: not a float16 run)."""
    return read_shared_state(directory, name)["loss_scaler"]


def read_shared_state(directory: str | os.PathLike, name: str) -> dict:
    """``SHARED_KEYS`` -> the state layer ``name``'s shard carries (None: absent, or an older checkpoint)."""
    payload = _load_shard(layer_file(Path(directory), name), "cpu")
    return {key: payload.get(key) for key in SHARED_KEYS}


def load_params(directory: str | os.PathLike, name: str) -> dict[str, torch.Tensor]:
    return _load_shard(layer_file(Path(directory), name), "cpu")["params"]


def _load_shard(path: Path, device) -> dict:
    """One layer file; a missing, truncated or foreign file is the user's checkpoint problem, named."""
    if not path.exists():
        raise UserError(f"{path.parent.parent}: checkpoint has no layer file {path.name}")
    try:
        payload = torch.load(path, map_location=device, weights_only=True)
    except (RuntimeError, OSError, EOFError, ValueError) as exc:  # torch's zip reader raises RuntimeError
        raise UserError(f"{path}: unreadable checkpoint shard ({str(exc).splitlines()[0]})") from None
    if not isinstance(payload, dict) or "params" not in payload:
        raise UserError(f"{path}: not a layer shard of this project (no 'params')")
    return payload
