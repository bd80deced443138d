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
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import zipfile
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import torch

from oobleck_mm.errors import UserError
from oobleck_mm.runtime.engine import HeldLayer, fresh_layer
from oobleck_mm.runtime.optim import load_optimizer_state, optimizer_state

FORMAT = 1


def _layer_file(directory: Path, name: str) -> Path:
    return directory / "layers" / f"{name}.pt"


def periodic_checkpoint_dir(root: str | os.PathLike, step: int) -> str:
    """Where the periodic checkpoint of ``step`` goes under ``root``: one directory per step."""
    return os.path.join(os.fspath(root), f"step{step:08d}")


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
    path = _layer_file(directory, name)
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


def save_meta(directory: str | os.PathLike, job, step: int, specs, sampler=None) -> None:
    """Written last (by one rank, after every layer file): its presence marks a complete checkpoint, so a
    layer file that is not there (removed under it, never written) raises ``FileNotFoundError`` naming it
    instead of marking a checkpoint complete that no resume can read."""
    directory = Path(directory)
    missing = [s.name for s in specs if not _layer_file(directory, s.name).exists()]
    if missing:
        raise FileNotFoundError(
            f"{directory}: not complete, no file of layer(s) {', '.join(missing[:5])}"
            f"{' ...' if len(missing) > 5 else ''}: meta.json not written"
        )
    meta = {
        "format": FORMAT,
        "step": step,
        "num_layers": len(specs),
        "layer_names": [s.name for s in specs],
        "layer_bytes": {s.name: _size(_layer_file(directory, s.name)) for s in specs},
        "layer_sha256": {s.name: digest for s in specs if (digest := _recorded_digest(directory, s.name))},
        "config": job.to_dict(),  # config_from_dict reads it back (export does)
        "sampler": (
            {"epoch": sampler.epoch_of(step), "steps_per_epoch": sampler.steps_per_epoch}
            if sampler is not None
            else None
        ),
    }
    tmp = directory / "meta.json.tmp"
    tmp.write_text(json.dumps(meta, indent=1))
    os.replace(tmp, directory / "meta.json")


META_KEYS = ("format", "step", "num_layers", "layer_names")
"""What ``meta.json`` must hold for a resume or ``verify``."""


def read_meta(directory: str | os.PathLike) -> dict:
    path = Path(directory) / "meta.json"
    if not path.exists():
        raise UserError(f"{directory}: not a complete checkpoint (no meta.json)")
    try:
        meta = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"{path}: unreadable checkpoint metadata ({exc})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise UserError(f"{path}: checkpoint format {found!r}, this version reads {FORMAT}")
    missing = [key for key in META_KEYS if key not in meta]
    if missing:
        raise UserError(f"{path}: checkpoint metadata lacks {', '.join(missing)} (needs {', '.join(META_KEYS)})")
    return meta


def newest_checkpoint(roots: Iterable[str | os.PathLike]) -> tuple[str, int] | None:
    """(directory, step) of the complete checkpoint (a readable ``meta.json``) with the highest step under
    ``roots`` (each a checkpoint, or a folder holding some up to two levels down: a run dir's
    ``checkpoints/stepN``, a round's ``checkpoint-g*-step*``); the newest ``meta.json`` on a tie. A folder
    of ``.tmp`` files without ``meta.json`` (a write cut short) is never one."""
    best: tuple[int, float, str] | None = None
    for root in roots:
        root = Path(root)
        for meta_path in [root / "meta.json", *root.glob("*/meta.json"), *root.glob("*/*/meta.json")]:
            try:
                step = int(read_meta(meta_path.parent)["step"])
                key = (step, meta_path.stat().st_mtime, str(meta_path.parent))
            except (UserError, OSError, ValueError, TypeError):
                continue
            if best is None or key > best:
                best = key
    return None if best is None else (best[2], best[0])


PROGRESS_EVERY_S = 5.0
"""``check_layer_files`` says how far it got at most this often (reading a large checkpoint takes a while)."""


def check_layer_files(
    directory: str | os.PathLike, meta: Mapping, progress: Callable[[str], None] | None = None
) -> None:
    """Raises ``UserError`` naming the first layer file that is missing, not the recorded size, no zip
    archive, or not the recorded sha256.

    The master runs it before any worker starts loading: a stat, a zip directory read and one
    sequential read per layer (for the digest), no tensor loaded. ``layer_bytes`` and
    ``layer_sha256`` are absent from checkpoints of older versions: then less is checked.
    """
    recorded = meta.get("layer_bytes") or {}
    digests = meta.get("layer_sha256") or {}
    names = list(meta["layer_names"])
    total = sum(recorded.get(n, 0) for n in names)
    started = last = time.monotonic()
    done = 0
    for k, name in enumerate(names, start=1):
        path = _layer_file(Path(directory), name)
        size = _size(path)
        if size < 0:
            raise UserError(f"{directory}: checkpoint has no layer file layers/{path.name}")
        if name in recorded and recorded[name] != size:
            raise UserError(f"{path}: {size} bytes, the checkpoint recorded {recorded[name]} (truncated or replaced)")
        if not zipfile.is_zipfile(path):
            raise UserError(f"{path}: not a readable layer shard (torch.save's zip archive is damaged)")
        if name in digests and _file_digest(path) != digests[name]:
            raise UserError(f"{path}: its sha256 is not the one the checkpoint recorded (corrupted or replaced)")
        done += size
        if progress is not None and time.monotonic() - last >= PROGRESS_EVERY_S:
            last = time.monotonic()
            of = f" of {total / 2**30:.2f}" if total else ""
            progress(
                f"checkpoint {directory}: checked {k}/{len(names)} shards ({done / 2**30:.2f}{of} GiB, "
                f"{done / 2**20 / max(last - started, 1e-9):.0f} MiB/s)"
            )


def _recorded_digest(directory: Path, name: str) -> str:
    """The sha256 the layer's writer recorded next to it ("" when absent: an older checkpoint)."""
    try:
        return _layer_file(directory, name).with_suffix(".sha256").read_text().strip()
    except FileNotFoundError:
        return ""


def _file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def _size(path: Path) -> int:
    """Bytes of ``path``, -1 if it does not exist."""
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return -1


def load_layer(directory: str | os.PathLike, job, index: int, specs, device="cpu") -> HeldLayer:
    """Layer ``index`` with its parameters and optimizer state from the checkpoint."""
    path = _layer_file(Path(directory), specs[index].name)
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
    payload = _load_shard(_layer_file(Path(directory), name), "cpu")
    return {key: payload.get(key) for key in SHARED_KEYS}


def load_params(directory: str | os.PathLike, name: str) -> dict[str, torch.Tensor]:
    return _load_shard(_layer_file(Path(directory), name), "cpu")["params"]


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
