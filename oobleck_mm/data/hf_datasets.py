"""``data.kind: hf_datasets``: samples from a HuggingFace ``datasets`` folder or Parquet files.

``data.path`` is a folder written by ``Dataset.save_to_disk`` (a ``DatasetDict``'s: ``data.split`` picks
one), a Parquet file, or a folder of Parquet files. ``datasets`` memory-maps its Arrow files: nothing is
read into RAM whole (Parquet is converted to Arrow once, in ``datasets``' own cache). Each row becomes the
record a LLaVA JSON entry would be, so both readers (byte-level text, or an HF model's own tokenizer, chat
template and image processor), the node's record cache, ``data.skip_bad_samples`` and the master's check
of every image work as for ``llava_json``. ``data.columns`` says which column holds what:

- ``id``: the sample's name in messages (default column ``id``; without one, its row ``#N``);
- ``conversations``: LLaVA turns (``{"from", "value"}``, ``<image>`` markers in the text) or chat
  messages (``{"role", "content"}``, content a string or HF's parts: ``{"type": "text", "text"}`` and
  ``{"type": "image"}``, each image part a marker); or instead
- ``text``: a caption: a user turn holding one marker per image, then the caption as the answer;
- ``image``: a ``datasets`` ``Image`` (its bytes or its path), a list of them, a path or a list of paths
  (relative to ``data.image_dir``, itself relative to the dataset folder; default the folder);
- ``audio``: a ``datasets`` ``Audio`` (its bytes or its path: 16 kHz WAV) or a path to a .wav or .npy clip,
  or a list of them (``<audio>`` markers in the text; ``oobleck_mm.data.audio``).

Images stored in the dataset are read from its Arrow file only when a sample needs them (their header at
construction, their pixels when loaded); a record names such an image ``row:<row>/<k>``. The balancer
splits each batch before loading, so every rank must be able to read every row: a folder on each node's
disk or on a shared file system. Clips stored in the dataset are read like its images (``arow:<row>/<k>``).
"""

from __future__ import annotations

import glob
import io
import os
from collections.abc import Iterator

from PIL import Image

from oobleck_mm.config import DataConfig
from oobleck_mm.config.data import COLUMN_ROLES
from oobleck_mm.data import record_cache
from oobleck_mm.data.dataset import ModelInputs
from oobleck_mm.data.hf_llava import HFLlavaJsonDataset
from oobleck_mm.data.llava import AUDIO_MARKER, MARKER, LlavaJsonDataset
from oobleck_mm.errors import UserError

ROW_REF = "row:"
"""How a record names an image stored in the dataset: ``row:<row>/<k>``, the k-th image of that row."""
AUDIO_ROW_REF = "arow:"
"""How a record names a clip stored in the dataset: ``arow:<row>/<k>.<ext>`` (the extension says how it is read)."""
ROWS_PER_READ = 1024
"""Rows read from Arrow at once while the records are built."""


def open_rows(data: DataConfig):
    """The ``datasets.Dataset`` ``data.path`` names (``data.split`` of a ``DatasetDict``)."""
    import datasets

    path = data.path
    try:
        if os.path.isdir(path) and not glob.glob(os.path.join(path, "*.parquet")):
            loaded = datasets.load_from_disk(path)
            if isinstance(loaded, datasets.DatasetDict):
                if data.split not in loaded:
                    raise UserError(f"data.split: {path} has splits {sorted(loaded)}, not {data.split!r}")
                loaded = loaded[data.split]
            return loaded
        files = sorted(glob.glob(os.path.join(path, "*.parquet"))) if os.path.isdir(path) else [path]
        if not all(f.endswith(".parquet") for f in files):
            raise UserError(
                f"data.path: {path} is neither a datasets folder (save_to_disk) nor Parquet (*.parquet) files"
            )
        return datasets.Dataset.from_parquet(files)
    except UserError:
        raise
    except (FileNotFoundError, ValueError, OSError) as exc:  # datasets' and pyarrow's refusals of a folder or file
        raise UserError(f"data.path: cannot read {path} as a datasets folder or Parquet: {exc}") from None


class DatasetRows:
    """The rows of a ``datasets.Dataset`` as LLaVA JSON entries, and the images they hold."""

    def __init__(self, data: DataConfig) -> None:
        self.path = data.path
        self.dataset = open_rows(data)
        names = set(self.dataset.column_names)
        self.columns = {role: data.columns.get(role, role) for role in COLUMN_ROLES}
        for role in ("id", "image", "audio"):
            if self.columns[role] not in names:
                if role in data.columns:
                    raise UserError(self._missing(role, names))
                self.columns[role] = None  # optional: rows without ids, samples without images
        talk, caption = self.columns["conversations"], self.columns["text"]
        if "conversations" in data.columns and talk not in names:
            raise UserError(self._missing("conversations", names))
        if "text" in data.columns and caption not in names:
            raise UserError(self._missing("text", names))
        if talk in names and ("text" not in data.columns or "conversations" in data.columns):
            self.columns["text"] = None
        elif caption in names:
            self.columns["conversations"] = None
        else:
            raise UserError(
                f"data.columns: {self.path} has no column 'conversations' or 'text' (its columns: "
                f"{', '.join(sorted(names))}); name the one holding the text, e.g. data.columns: "
                "{conversations: messages} or {text: caption}"
            )
        arrow = self.dataset.with_format("arrow")  # rows as Arrow tables: images stay bytes, nothing decoded
        self._records = arrow.select_columns([c for c in self.columns.values() if c is not None])
        self._images = arrow.select_columns([self.columns["image"]]) if self.columns["image"] else None
        self._clips = arrow.select_columns([self.columns["audio"]]) if self.columns["audio"] else None

    def _missing(self, role: str, names: set) -> str:
        return (
            f"data.columns.{role}: {self.path} has no column {self.columns[role]!r}; its columns: "
            f"{', '.join(sorted(names))}"
        )

    def __len__(self) -> int:
        return self.dataset.num_rows

    def __iter__(self) -> Iterator[dict]:
        """Every row as a LLaVA entry (``id``, ``conversations``, ``image`` names), in order."""
        position = 0
        for start in range(0, len(self), ROWS_PER_READ):
            table = self._records[start : start + ROWS_PER_READ]
            for row in table.to_pylist():
                yield self.entry(position, row)
                position += 1

    def entry(self, position: int, row: dict) -> dict:
        images = self._image_names(position, row.get(self.columns["image"]) if self.columns["image"] else None)
        clips = self._clip_names(position, row.get(self.columns["audio"]) if self.columns["audio"] else None)
        entry: dict = {"image": images}
        if clips:
            entry["audio"] = clips
        if self.columns["id"] is not None and row.get(self.columns["id"]) is not None:
            entry["id"] = str(row[self.columns["id"]])
        if self.columns["conversations"] is not None:
            entry["conversations"] = _turns(row[self.columns["conversations"]])
        else:
            caption = row[self.columns["text"]]
            markers = "\n".join([MARKER] * len(images) + [AUDIO_MARKER] * len(clips))
            entry["conversations"] = [{"from": "human", "value": markers}, {"from": "gpt", "value": caption}]
        return entry

    def _image_names(self, position: int, value) -> list:
        return _media_names(value, lambda k, item: f"{ROW_REF}{position}/{k}")

    def _clip_names(self, position: int, value) -> list:
        def ref(k: int, item: dict) -> str:  # an Audio's bytes are read as its file's kind
            ext = ".npy" if str(item.get("path") or "").lower().endswith(".npy") else ".wav"
            return f"{AUDIO_ROW_REF}{position}/{k}{ext}"

        return _media_names(value, ref)

    def clip_bytes(self, ref: str) -> bytes:
        return _stored_bytes(self._clips, self.columns["audio"], ref[len(AUDIO_ROW_REF) :].split(".")[0])

    def image_bytes(self, ref: str) -> bytes:
        return _stored_bytes(self._images, self.columns["image"], ref[len(ROW_REF) :])


def _media_names(value, stored_ref) -> list:
    """A row's images or clips as record names: ``stored_ref(k, item)`` for one stored as bytes, its path
    for one stored as a path, else the value itself (what the record's check refuses by name)."""
    values = [] if value is None else value if isinstance(value, list) else [value]
    names = []
    for k, item in enumerate(values):
        if isinstance(item, dict) and item.get("bytes") is not None:
            names.append(stored_ref(k, item))
        elif isinstance(item, dict) and isinstance(item.get("path"), str):
            names.append(item["path"])
        else:
            names.append(item)
    return names


def _stored_bytes(table, column: str, where: str) -> bytes:
    """The bytes of the k-th image or clip of a row, ``where`` being ``<row>/<k>``."""
    position, k = (int(x) for x in where.split("/"))
    value = table[position].to_pylist()[0][column]
    return (value if isinstance(value, list) else [value])[k]["bytes"]


def _turns(value) -> list:
    """LLaVA turns from LLaVA turns or chat messages (what the readers' check refuses passes through)."""
    if not isinstance(value, list):
        return value
    turns = []
    for turn in value:
        if isinstance(turn, dict) and "role" in turn and "from" not in turn:
            content = turn.get("content")
            if isinstance(content, list):  # HF's multimodal parts
                content = "".join(_part(p) for p in content)
            turn = {"from": turn["role"], "value": content}
        turns.append(turn)
    return turns


def _part(part) -> str:
    """One part of an HF chat message's content as text: a marker for an image or an audio part."""
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in ("image", "audio"):
        return MARKER if kind == "image" else AUDIO_MARKER
    return str((part or {}).get("text") or "")


class _FromDatasetRows:
    """What a JSON reader does differently over a ``datasets`` folder: its entries, and its images' bytes."""

    rows: DatasetRows

    def _entries(self, data: DataConfig):
        return self.rows

    def _image_path(self, name: str) -> str:
        if name.startswith((ROW_REF, AUDIO_ROW_REF)):
            return name
        return os.path.join(dataset_image_folder(self.data), name)

    def open_audio(self, path: str):
        if path.startswith(AUDIO_ROW_REF):
            return io.BytesIO(self.rows.clip_bytes(path))
        return open(path, "rb")

    def open_image(self, path: str):
        if path.startswith(ROW_REF):
            return Image.open(io.BytesIO(self.rows.image_bytes(path)))
        return Image.open(path)

    def image_exists(self, path: str) -> bool:
        return path.startswith(ROW_REF) or os.path.isfile(path)


def dataset_image_folder(data: DataConfig) -> str:
    """``data.image_dir`` under the dataset folder (a Parquet file's folder), or that folder."""
    base = data.path if os.path.isdir(data.path) else os.path.dirname(os.path.abspath(data.path))
    return os.path.join(base, data.image_dir) if data.image_dir else base


class DatasetsLlavaDataset(_FromDatasetRows, LlavaJsonDataset):
    """``hf_datasets`` read as ``llava_json`` is, byte-level text (the built-in model)."""

    def __init__(self, data: DataConfig, inputs: ModelInputs) -> None:
        self.rows = DatasetRows(data)
        super().__init__(data, inputs)


class DatasetsHFLlavaDataset(_FromDatasetRows, HFLlavaJsonDataset):
    """``hf_datasets`` for a ``model.huggingface`` model: its tokenizer, chat template and image processor."""

    def __init__(self, data: DataConfig, inputs: ModelInputs) -> None:
        self.rows = DatasetRows(data)
        super().__init__(data, inputs)

    def _data_fingerprint(self, data: DataConfig):
        if os.path.isdir(data.path):
            return record_cache.directory_fingerprint(data.path)
        return record_cache.fingerprint(data.path)
