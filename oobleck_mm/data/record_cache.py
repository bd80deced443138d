"""A JSON dataset's records built once per node, then memory-mapped by every other rank and by joiners.

Why: ``HFLlavaJsonDataset`` renders and tokenizes every conversation when it is
built (~420 us a record on this machine's cores: ~4.6 minutes for LLaVA's 665k
records), and every rank builds it: 8 times at once on an 8-GPU node, and again
for every joiner and every restart. Here the first process of a node to need the
records builds them and writes them as flat ``.npy`` arrays; every other process
(the node's other ranks wait on a file lock meanwhile, a joiner comes later)
maps them with ``np.load(mmap_mode="r")``, so the tokens are shared pages of the
page cache, not a copy per rank.

Written by hand: HF ``datasets`` caches a ``map`` as memory-mapped Arrow keyed on
a fingerprint, but it would bring pyarrow and pandas (not dependencies here) for
a handful of flat arrays, and its fingerprint hashes the mapping function's
closure where the key here names exactly what the records depend on.

The key (``cache_key``) is a hash of everything a record depends on: the JSON
file (path, size, modification time), the image folder, the model directory's
small files (tokenizer, chat template, configs; not its weights), the data
settings that shape a record, the model facts the reader uses, and the
versions of ``transformers`` and ``tokenizers``. A change to any of them is
another folder; nothing is ever invalidated in place. A folder is complete
once its ``complete`` marker exists (written last, then renamed into place),
so a process killed while building leaves only a ``.tmp`` folder, removed by
the next build.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
from collections.abc import Callable, Mapping
from typing import Any

CACHE_FORMAT = 1
"""Bumped whenever what a cache folder holds changes: older folders are then simply not found."""
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack", ".gguf")
"""Files of a model directory that no record depends on (and that are too large to hash cheaply)."""


def fingerprint(path: str) -> dict:
    """A file's identity for a cache key: where it is, its size and its modification time."""
    st = os.stat(path)
    return {"path": os.path.abspath(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def directory_fingerprint(directory: str) -> list[dict]:
    """Every small file of a model directory (tokenizer, templates, configs), weights left out."""
    out = []
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if os.path.isfile(path) and not name.endswith(WEIGHT_SUFFIXES):
            out.append(fingerprint(path))
    return out


def cache_key(parts: Mapping[str, Any]) -> str:
    """The hash naming a cache folder: ``parts`` must hold everything the records depend on."""
    text = json.dumps({"format": CACHE_FORMAT, **parts}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def built_once(root: str, key: str, build: Callable[[str], None]) -> tuple[str, bool]:
    """(The complete folder ``root/key``, whether this process built it). ``build(folder)`` writes the
    records into an empty folder; it runs in whichever process takes the folder's lock first, while the
    others wait for it, and never again once the folder is complete. An exception in ``build`` (a bad
    record) leaves nothing behind and reaches the caller; a waiting process then builds, and meets it too."""
    os.makedirs(root, exist_ok=True)
    folder = os.path.join(root, key)
    if os.path.exists(os.path.join(folder, "complete")):
        return folder, False
    with open(folder + ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file is closed, even by a killed process
        try:
            if os.path.exists(os.path.join(folder, "complete")):
                return folder, False
            tmp = f"{folder}.tmp{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
            try:
                build(tmp)
                with open(os.path.join(tmp, "complete"), "w") as fh:
                    fh.write("1\n")
                shutil.rmtree(folder, ignore_errors=True)  # an incomplete one a killed build left
                os.rename(tmp, folder)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            for stale in os.listdir(root):  # builds of this key killed before they renamed
                if stale.startswith(f"{key}.tmp"):
                    with contextlib.suppress(OSError):
                        shutil.rmtree(os.path.join(root, stale))
            return folder, True
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
