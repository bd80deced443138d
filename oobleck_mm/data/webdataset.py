"""``data.kind: webdataset``: samples from WebDataset tar shards, with random access through a shard index.

``data.path`` names the shards: a brace pattern (``/data/pairs-{000000..000099}.tar``, expanded as
``webdataset`` does, with ``braceexpand``), a glob (``/data/*.tar``), one tar, or a folder of them. A
sample is the run of consecutive members sharing a key (the member's path up to the first ``.`` of its
file name), as WebDataset writes them; ``data.columns`` names the extension that holds each role:

- ``image`` (default: the first of ``jpg``, ``jpeg``, ``png``, ``webp`` a sample has): one image;
- ``audio`` (default: the first of ``wav``, ``npy`` a sample has): one clip (``oobleck_mm.data.audio``);
- ``text`` (default ``txt``): a caption, trained on as the answer to a turn holding the image; or
- ``conversations`` (default ``json`` when the sample has one): a JSON of LLaVA turns, chat messages, or an
  object holding them under ``conversations`` or ``messages``;
- ``id`` (default: the key).

Why an index and not WebDataset's stream: the balancer splits each global batch from the samples'
metadata before anything is loaded, and the sampler's exact, resumable global order (the same samples
after any failure as without it) needs sample ``i`` by position. So each shard is read once, in order,
with the standard ``tarfile`` (the ``webdataset`` library only streams), and its index lists every
sample's members as (offset, size) in the tar, with the small text members' contents; a sample's image is
then read with one seek. The index is kept under ``data.cache_dir`` (keyed by the shard's path, size and
mtime: a rewritten shard is indexed again) for the node's other ranks and its joiners. Positions run over
the shards in the pattern's order, then each shard's samples in order.

A shard that is not a tar or ends inside a member (truncated) stops the job at the master's check, exit 2
naming the shard and the member: nothing trains on a half-read shard. A pattern that matches no file is
exit 2 naming it. Each sample then goes through the LLaVA readers (``JsonRecords``): both readers, the
check of every image, ``data.skip_bad_samples`` for a bad sample.
"""

from __future__ import annotations

import glob
import hashlib
import io
import json
import os
import tarfile
from collections.abc import Iterator

from PIL import Image

from oobleck_mm.config import DataConfig
from oobleck_mm.data import record_cache
from oobleck_mm.data.dataset import ModelInputs
from oobleck_mm.data.hf_llava import HFLlavaJsonDataset
from oobleck_mm.data.llava import AUDIO_MARKER, MARKER, LlavaJsonDataset
from oobleck_mm.errors import UserError

TAR_REF = "tar:"
"""How a record names an image inside a shard: ``tar:<shard>:<offset>:<size>``."""
IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp")
AUDIO_EXTENSIONS = ("wav", "npy")
TEXT_LIMIT = 1 << 20
"""Largest text member (caption, JSON) read into the index; a larger one is a bad sample."""
INDEX_FORMAT = 1


def shard_paths(pattern: str) -> list[str]:
    """The shards ``data.path`` names, in order (UserError when it names none, or a file is missing)."""
    from braceexpand import braceexpand

    if os.path.isdir(pattern):
        paths = sorted(glob.glob(os.path.join(pattern, "*.tar")))
    else:
        paths = []
        for item in braceexpand(os.path.expanduser(pattern)):
            paths += sorted(glob.glob(item)) if glob.has_magic(item) else [item]
    if not paths:
        raise UserError(
            f"data.path: {pattern!r} matches no shard (a brace pattern, a glob, a .tar or a folder of them)"
        )
    missing = [p for p in paths if not os.path.isfile(p)]
    if missing:
        raise UserError(f"data.path: shard {missing[0]!r} of {pattern!r} does not exist ({len(missing)} missing)")
    return paths


def _key(name: str) -> tuple[str, str]:
    """(key, extension) of a member, as WebDataset splits it: at the first dot of the file name."""
    folder, base = os.path.split(name)
    stem, dot, ext = base.partition(".")
    return os.path.join(folder, stem) if folder else stem, ext.lower() if dot else ""


def index_shard(path: str) -> list[dict]:
    """Every sample of one shard: ``{"key", "members": {ext: [offset, size]}, "texts": {ext: str}}``."""
    samples: list[dict] = []
    member = None
    try:
        with tarfile.open(path, "r:") as tar:
            for member in tar:
                if not member.isfile():
                    continue
                key, ext = _key(member.name)
                if not samples or samples[-1]["key"] != key:
                    samples.append({"key": key, "members": {}, "texts": {}})
                samples[-1]["members"][ext] = [member.offset_data, member.size]
                if ext not in IMAGE_EXTENSIONS + AUDIO_EXTENSIONS and member.size <= TEXT_LIMIT:
                    data = tar.extractfile(member).read()
                    if len(data) != member.size:
                        raise tarfile.ReadError("unexpected end of data")
                    samples[-1]["texts"][ext] = data.decode("utf-8", errors="replace")
            end = os.path.getsize(path)
            if member is not None and member.offset_data + member.size > end:
                raise tarfile.ReadError("unexpected end of data")
    except (tarfile.TarError, EOFError, OSError) as exc:
        at = f" in member {member.name!r}" if member is not None else ""
        raise UserError(
            f"data.path: shard {path} cannot be read{at}: {exc} (truncated, or not a tar); nothing is trained "
            "on a half-read shard: rewrite or remove it"
        ) from None
    return samples


def shard_index(path: str, cache_dir: str | None) -> list[dict]:
    """``index_shard``, kept under ``cache_dir`` for the next reader of the same shard."""
    if cache_dir is None:
        return index_shard(path)
    key = hashlib.sha256(json.dumps([INDEX_FORMAT, record_cache.fingerprint(path)]).encode()).hexdigest()[:32]
    file = os.path.join(cache_dir, "webdataset-index", f"{key}.json")
    try:
        with open(file, encoding="utf-8") as fh:
            return json.load(fh)
    except (OSError, ValueError):
        pass
    samples = index_shard(path)
    os.makedirs(os.path.dirname(file), exist_ok=True)
    temporary = f"{file}.{os.getpid()}.tmp"
    with open(temporary, "w", encoding="utf-8") as fh:
        json.dump(samples, fh)
    os.replace(temporary, file)  # whole or absent: a reader never sees half an index
    return samples


class ShardSamples:
    """The samples of ``data.path``'s shards as LLaVA JSON entries, and the images they hold."""

    def __init__(self, data: DataConfig) -> None:
        self.pattern = data.path
        self.shards = shard_paths(data.path)
        self.columns = dict(data.columns)
        self._index = [shard_index(p, data.cache_dir) for p in self.shards]
        # Conversations or captions, for the whole dataset: JSON members if any sample has one (unless named).
        self.talk = self.columns.get("conversations")
        if self.talk is None and "text" not in self.columns:
            self.talk = "json" if any("json" in s["texts"] for samples in self._index for s in samples) else None

    def __len__(self) -> int:
        return sum(len(s) for s in self._index)

    def __iter__(self) -> Iterator[dict]:
        position = 0
        for shard, samples in enumerate(self._index):
            for sample in samples:
                yield self.entry(position, shard, sample)
                position += 1

    def entry(self, position: int, shard: int, sample: dict) -> dict:
        members, texts = sample["members"], sample["texts"]
        image_ext = self.columns.get("image") or next((e for e in IMAGE_EXTENSIONS if e in members), None)
        images = []
        if image_ext is not None and image_ext in members:
            offset, size = members[image_ext]
            images.append(f"{TAR_REF}{shard}:{offset}:{size}")
        audio_ext = self.columns.get("audio") or next((e for e in AUDIO_EXTENSIONS if e in members), None)
        clips = []
        if audio_ext is not None and audio_ext in members:
            offset, size = members[audio_ext]
            clips.append(f"{TAR_REF}{shard}:{offset}:{size}.{audio_ext}")  # the extension says how it is read
        name = f"{os.path.basename(self.shards[shard])}:{sample['key']}"  # the shard and the key: where it is
        entry: dict = {"id": texts.get(self.columns["id"], "").strip() or name if "id" in self.columns else name}
        if self.talk is not None:
            turns = _conversation(texts.get(self.talk), self.talk)
            if isinstance(turns, str):
                return {"id": entry["id"], "error": turns}
            entry["conversations"] = turns
        else:
            caption_ext = self.columns.get("text", "txt")
            caption = texts.get(caption_ext)
            markers = "\n".join([MARKER] * len(images) + [AUDIO_MARKER] * len(clips))
            if caption is None:
                return {"id": entry["id"], "error": f"has no '.{caption_ext}' member (data.columns.text)"}
            entry["conversations"] = [{"from": "human", "value": markers}, {"from": "gpt", "value": caption.strip()}]
        entry["image"] = images
        if clips:
            entry["audio"] = clips
        return entry

    def image_bytes(self, ref: str) -> bytes:
        """The bytes of the member ``ref`` names (an image, or a clip: ``...:<size>.<ext>``)."""
        shard, offset, size = (int(x) for x in ref[len(TAR_REF) :].split(".")[0].split(":"))
        with open(self.shards[shard], "rb") as fh:
            fh.seek(offset)
            data = fh.read(size)
        if len(data) != size:
            raise OSError(f"{self.shards[shard]} ends inside the image at offset {offset}")
        return data


def _conversation(text, ext: str):
    """LLaVA turns from a sample's JSON member (what the readers' check refuses passes through), or why not."""
    from oobleck_mm.data.hf_datasets import _turns

    if text is None:
        return f"has no '.{ext}' member (data.columns.conversations)"
    try:
        value = json.loads(text)
    except ValueError as exc:
        return f"has a '.{ext}' member that is not JSON ({exc})"
    if isinstance(value, dict):
        value = value.get("conversations", value.get("messages"))
    return _turns(value)


class _FromShards:
    """What a JSON reader does differently over tar shards: its entries, and its images' bytes."""

    shards: ShardSamples

    def _entries(self, data: DataConfig):
        return self.shards

    def _image_path(self, name: str) -> str:
        return name

    def open_image(self, path: str):
        return Image.open(io.BytesIO(self.shards.image_bytes(path)))

    def image_exists(self, path: str) -> bool:
        return path.startswith(TAR_REF)

    def open_audio(self, path: str):
        return io.BytesIO(self.shards.image_bytes(path))


class ShardsLlavaDataset(_FromShards, LlavaJsonDataset):
    """``webdataset`` shards read as ``llava_json`` is, byte-level text (the built-in model)."""

    def __init__(self, data: DataConfig, inputs: ModelInputs) -> None:
        self.shards = ShardSamples(data)
        super().__init__(data, inputs)


class ShardsHFLlavaDataset(_FromShards, HFLlavaJsonDataset):
    """``webdataset`` shards for a ``model.huggingface`` model: its tokenizer, chat template and processor."""

    def __init__(self, data: DataConfig, inputs: ModelInputs) -> None:
        self.shards = ShardSamples(data)
        super().__init__(data, inputs)

    def _data_fingerprint(self, data: DataConfig):
        return [record_cache.fingerprint(p) for p in self.shards.shards]
