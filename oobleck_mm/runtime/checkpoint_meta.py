"""A checkpoint's metadata and its files' integrity: what the master, the launcher and ``verify`` read
and write without torch (importing torch costs a process ~2.5 CPU-s on a 2-core machine; the master
and the launcher never touch a tensor). The layer shards themselves are ``runtime.checkpoint``'s; the
layout of a checkpoint directory is in its docstring."""

from __future__ import annotations

import hashlib
import json
import os
import time
import zipfile
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from oobleck_mm.errors import UserError

FORMAT = 1


def layer_file(directory: Path, name: str) -> Path:
    """Where layer ``name``'s shard is in a checkpoint ``directory``."""
    return directory / "layers" / f"{name}.pt"


def periodic_checkpoint_dir(root: str | os.PathLike, step: int) -> str:
    """Where the periodic checkpoint of ``step`` goes under ``root``: one directory per step."""
    return os.path.join(os.fspath(root), f"step{step:08d}")


def save_meta(directory: str | os.PathLike, job, step: int, specs, sampler=None) -> None:
    """Written last (by one rank, after every layer file): its presence marks a complete checkpoint, so a
    layer file that is not there (removed under it, never written) raises ``FileNotFoundError`` naming it
    instead of marking a checkpoint complete that no resume can read."""
    directory = Path(directory)
    missing = [s.name for s in specs if not layer_file(directory, s.name).exists()]
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
        "layer_bytes": {s.name: _size(layer_file(directory, s.name)) for s in specs},
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
        path = layer_file(Path(directory), name)
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
        return layer_file(directory, name).with_suffix(".sha256").read_text().strip()
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
