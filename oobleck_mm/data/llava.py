"""Reader of a LLaVA-style JSON file of samples whose images are local files.

The file is a list of records::

    {"id": "0001", "image": "imgs/cat.png" (or a list of paths, or absent),
     "audio": "clips/meow.wav" (or a list of .wav / .npy paths, or absent),
     "conversations": [{"from": "human", "value": "<image>\\n<audio>\\nWhat is this?"},
                       {"from": "gpt", "value": "A cat, meowing."}]}

The text is every turn as ``"<from>: <value>\\n"``, concatenated; each ``<image>``
marker becomes an ``IMAGE`` placeholder and each ``<audio>`` marker an ``AUDIO``
one, and the markers must match the images and the clips in number (each kind
in its own order). Clips (``oobleck_mm.data.audio``: 16 kHz WAV or log-mel
``.npy``) need a model with an audio encoder; their frames come from the file
header, cut to ``data.max_audio_seconds``. With ``data.loss_on: assistant`` (the default) the loss covers the
assistant's turns only (``from`` is ``gpt`` or ``assistant``: their value and
newline, and the final EOS after an assistant turn); ``all`` trains on every
text token. A model from ``model.huggingface`` reads the same files with its
own tokenizer and image processor (``oobleck_mm.data.hf_llava``). Image paths are relative to ``data.image_dir`` (itself relative to
the JSON's folder; default: that folder).

All metadata is computed at construction from the JSON and the image *headers*
(no pixel is decoded): an image is scaled so its longer side is at most
``data.image_size``, then each side is rounded down to whole patches (at least
one). Text that would take the sample past ``data.max_seq_len`` is cut at the
end (placeholders are kept); a sample whose images alone do not fit is an
error naming it. Every bad record raises ``UserError`` naming the sample id; with
``data.skip_bad_samples`` it is left out instead (``skipped``), and positions in
``data.excluded_samples`` are left out unread (``oobleck_mm.data.check``).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from oobleck_mm.errors import UserError
from oobleck_mm.config import DataConfig
from oobleck_mm.data import audio
from oobleck_mm.data.dataset import BadSample, ModelInputs, check_index
from oobleck_mm.data.sample import AUDIO, BOS, EOS, IMAGE, Sample, SampleMeta
from oobleck_mm.data.tokenizer import encode, num_tokens

MARKER = "<image>"
AUDIO_MARKER = "<audio>"
_MARKERS = re.compile(rb"<image>|<audio>")
_PIL_MODES = {1: "L", 3: "RGB"}


ASSISTANT_ROLES = ("gpt", "assistant")
"""``from`` values of the turns ``data.loss_on: assistant`` trains on."""


@dataclass(frozen=True, slots=True)
class _Record:
    sample_id: str
    texts: tuple[str, ...]
    """Text around the media markers: one more than there are images and clips."""
    image_paths: tuple[str, ...]
    meta: SampleMeta
    targets: tuple[np.ndarray, ...] | None = None
    """Per text piece, per byte (= token): is it a loss target; None: all are."""
    eos_target: bool = True
    audio_paths: tuple[str, ...] = ()
    placeholders: tuple[int, ...] = ()
    """``IMAGE`` or ``AUDIO`` for each marker, in text order (empty: every marker is an image's)."""


class JsonRecords:
    """The records of a LLaVA-style JSON file: what both readers (byte-level, a model's own tokenizer)
    share. A subclass sets up what ``_record(position, entry)`` needs, then calls ``__init__``. Where the
    records and their images come from is ``_entries`` and ``open_image`` (``data.hf_datasets`` reads
    them from a ``datasets`` folder instead)."""

    def __init__(self, data: DataConfig, inputs: ModelInputs) -> None:
        if data.path is None:
            raise UserError(f"data.path: required when data.kind is {data.kind!r}")
        self.data, self.inputs = data, inputs
        self.image_dir = image_folder(data)
        entries = self._entries(data)
        excluded = set(data.excluded_samples)
        if excluded and max(excluded) >= len(entries):
            raise UserError(
                f"data.excluded_samples: position {max(excluded)} is past the end of {data.path} "
                f"({len(entries)} samples, positions 0..{len(entries) - 1})"
            )
        self.skipped: list = []
        """Bad records left out under ``data.skip_bad_samples`` (``check.BadSample``)."""
        records = []
        for position, entry in enumerate(entries):
            if position in excluded:
                continue
            try:
                records.append(self._record(position, entry))
            except UserError as error:
                if not data.skip_bad_samples:
                    raise UserError(f"{error} (data.skip_bad_samples: true leaves such samples out)") from None
                self.skipped.append(BadSample(position, str(error)))
        if not records:
            raise UserError(
                f"data.path: no sample of {data.path} is usable ({len(excluded)} excluded, {len(self.skipped)} bad)"
            )
        self._records = tuple(records)

    def _entries(self, data: DataConfig):
        """The records as JSON entries, in file order (a sequence)."""
        return _load_json(data.path)

    def open_image(self, path: str):
        """The image a record names, opened (PIL, lazily: the header is read, the pixels when loaded)."""
        return Image.open(path)

    def image_exists(self, path: str) -> bool:
        return os.path.isfile(path)

    def open_audio(self, path: str):
        """The clip a record names, as a binary file (``oobleck_mm.data.audio`` reads its header or its body)."""
        return open(path, "rb")

    def _clip_frames(self, path: str, where: str) -> int:
        """Frames of the clip the model sees (``audio.usable_frames``), from its header only."""
        d = self.data
        try:
            audio.suffix(path)
            with self.open_audio(path) as f:
                frames = audio.header_frames(path, f, d.audio_frames_per_second, self.inputs.mel_bins)
        except (OSError, audio.BadClip) as exc:
            raise UserError(f"{where}: cannot read audio clip {path!r}: {exc}") from None
        usable = audio.usable_frames(frames, self.inputs.frames_unit, d.max_audio_seconds, d.audio_frames_per_second)
        if usable == 0:
            raise UserError(
                f"{where}: audio clip {path!r} has {frames} frames, fewer than one LLM token's "
                f"{self.inputs.frames_unit} (model.audio.downsample x token_merge)"
            )
        return usable

    def _clip_features(self, record: _Record, path: str, frames: int) -> torch.Tensor:
        try:
            with self.open_audio(path) as f:
                features = audio.load_features(path, f, frames, self.data.audio_frames_per_second, self.inputs.mel_bins)
        except (OSError, audio.BadClip, ValueError) as exc:
            raise UserError(
                f"{self.data.path}: sample {record.sample_id!r}: cannot decode audio {path!r}: {exc}"
            ) from None
        return torch.from_numpy(features)

    def _image_path(self, name: str) -> str:
        """Where a record's image is: relative to ``data.image_dir``."""
        return os.path.join(self.image_dir, name)

    def __len__(self) -> int:
        return len(self._records)

    def meta(self, index: int) -> SampleMeta:
        return self._records[check_index(index, len(self))].meta

    def sample_id(self, index: int) -> str:
        return self._records[check_index(index, len(self))].sample_id

    def decode_images(self, index: int) -> None:
        """Decodes every image and clip of sample ``index`` once (pixels and samples, not just the header);
        ``UserError`` naming the sample and the file when one does not decode."""
        record = self._records[check_index(index, len(self))]
        for path, frames in zip(record.audio_paths, record.meta.audio_frames):
            self._clip_features(record, path, frames)
        for path in record.image_paths:
            try:
                with self.open_image(path) as im:
                    im.load()
            except (OSError, UnidentifiedImageError, SyntaxError, ValueError) as exc:  # PIL's decoders raise these
                raise UserError(
                    f"{self.data.path}: sample {record.sample_id!r}: cannot decode image {path!r}: {exc}"
                ) from None

    def _entry(self, position: int, entry) -> tuple[str, str, list[tuple[str, str]], tuple[str, ...], tuple[str, ...]]:
        """(sample id, where, turns, image paths, clip paths) of a record (paths under ``image_dir``), its
        common parts checked."""
        if not isinstance(entry, dict):
            raise UserError(f"{self.data.path}: entry {position} must be an object, got {type(entry).__name__}")
        sample_id = str(entry.get("id", f"#{position}"))
        where = f"{self.data.path}: sample {sample_id!r}"
        if entry.get("error"):  # a reader of another format found the record unusable (``webdataset``)
            raise UserError(f"{where} {entry['error']}")
        turns = conversation_turns(entry.get("conversations"), where)
        paths = _image_paths(entry.get("image"), where)
        markers = sum(value.count(MARKER) for _, value in turns)
        if markers != len(paths):
            raise UserError(f"{where} has {markers} '{MARKER}' markers but {len(paths)} images")
        if paths and not self.inputs.has_vision:
            raise UserError(f"{where} has {len(paths)} images but the model has no vision encoder")
        clips = _image_paths(entry.get("audio"), where, "audio")
        heard = sum(value.count(AUDIO_MARKER) for _, value in turns)
        if heard != len(clips):
            raise UserError(f"{where} has {heard} '{AUDIO_MARKER}' markers but {len(clips)} audio clips")
        if clips and not self.inputs.has_audio:
            raise UserError(f"{where} has {len(clips)} audio clips but the model has no audio encoder")
        return sample_id, where, turns, tuple(self._image_path(p) for p in paths), tuple(map(self._image_path, clips))


class LlavaJsonDataset(JsonRecords):
    """The samples of ``data.path``, shaped for the model in ``inputs`` (byte-level text)."""

    def __init__(self, data: DataConfig, inputs: ModelInputs) -> None:
        self._header_sizes: dict[str, tuple[int, int]] = {}
        """(width, height) of each image file read so far. Reading headers is half of what building
        the records costs (36 s a rank at 665k records, ``docs/benchmarks.md``), and LLaVA's mixes
        hold several conversations per image (its COCO images: about three each). Dropped once the
        records are built: at 665k records it would hold hundreds of thousands of paths per rank."""
        super().__init__(data, inputs)
        self._header_sizes = {}

    def __getitem__(self, index: int) -> Sample:
        sample = self.layout(index)
        record = self._records[index]
        for path, size in zip(record.image_paths, record.meta.image_sizes):
            try:
                with self.open_image(path) as im:
                    sample.images.append(_pixels(im, size, self.inputs.in_channels))
            except (OSError, UnidentifiedImageError) as exc:  # a header that read fine, a body that does not
                raise UserError(
                    f"{self.data.path}: sample {record.sample_id!r}: cannot decode image {path!r}: {exc}"
                ) from None
        sample.audio = [self._clip_features(record, p, f) for p, f in zip(record.audio_paths, record.meta.audio_frames)]
        return sample

    def layout(self, index: int) -> Sample:
        """Sample ``index`` without its images' pixels or its clips' frames (``data.dataset.Dataset``): no file
        is opened."""
        record = self._records[check_index(index, len(self))]
        tokens = self._tokens(record)
        targets = None
        if record.targets is not None:
            parts = [np.zeros(1, dtype=bool)]  # BOS
            for i, mask in enumerate(record.targets):
                if i:
                    parts.append(np.zeros(1, dtype=bool))  # the medium's placeholder
                parts.append(mask)
            parts.append(np.array([record.eos_target]))
            targets = torch.from_numpy(np.concatenate(parts))
        return Sample(meta=record.meta, tokens=tokens, targets=targets)

    # ------------------------------------------------------------------ construction

    def _record(self, position: int, entry) -> _Record:
        sample_id, where, turns, paths, clips = self._entry(position, entry)
        text, mask = _conversation_bytes(turns)
        pieces = _MARKERS.split(text)
        found = _MARKERS.findall(text)
        placeholders = tuple(AUDIO if m == AUDIO_MARKER.encode() else IMAGE for m in found) if clips else ()
        texts = tuple(p.decode("utf-8") for p in pieces)
        sizes = tuple(self._image_size(p, where) for p in paths)
        frames = tuple(self._clip_frames(p, where) for p in clips)
        media = sum(self.inputs.image_llm_tokens(h, w) for h, w in sizes)
        media += sum(self.inputs.clip_llm_tokens(f) for f in frames)
        budget = self.data.max_seq_len - 2 - media  # BOS and EOS
        if budget < 0:
            raise UserError(
                f"{where}: its {len(paths)} images and {len(clips)} clips take {media} LLM tokens, which with "
                f"BOS/EOS exceed data.max_seq_len ({self.data.max_seq_len}); raise it to at least {media + 2} or "
                f"lower data.image_size ({self.data.image_size}) or data.max_audio_seconds "
                f"({self.data.max_audio_seconds:g})"
            )
        text = min(budget, sum(num_tokens(t) for t in texts))
        placed = 2 + len(paths) + len(clips) + text
        media_fields = dict(image_paths=paths, audio_paths=clips, placeholders=placeholders)
        if self.data.loss_on == "all":
            meta = SampleMeta(index=position, text_tokens=placed, image_sizes=sizes, audio_frames=frames)
            return _Record(sample_id=sample_id, texts=texts, meta=meta, **media_fields)
        targets, start, left = [], 0, text
        for k, piece in enumerate(pieces):  # the byte mask cut like the text: each piece, then what fits of it
            targets.append(mask[start : start + len(piece)][: max(0, left)])
            left -= len(targets[-1])
            start += len(piece) + (len(found[k]) if k < len(found) else 0)
        # The EOS ends the answer only when nothing was cut off before it.
        eos = turns[-1][0] in ASSISTANT_ROLES and text == sum(len(p) for p in pieces)
        # A sample whose answer is cut off entirely trains on nothing (as LLaVA's own training masks it).
        count = int(sum(t.sum() for t in targets)) + int(eos)
        meta = SampleMeta(
            index=position, text_tokens=placed, image_sizes=sizes, audio_frames=frames, target_tokens=count
        )
        return _Record(
            sample_id=sample_id, texts=texts, meta=meta, targets=tuple(targets), eos_target=eos, **media_fields
        )

    def _image_size(self, path: str, where: str) -> tuple[int, int]:
        """(height, width) after preprocessing, from the file header only."""
        if self.inputs.in_channels not in _PIL_MODES:
            raise UserError(f"{where}: images need model.vision.in_channels 1 or 3, got {self.inputs.in_channels}")
        size = self._header_sizes.get(path)
        if size is None:
            try:
                with self.open_image(path) as im:
                    size = self._header_sizes[path] = im.size
            except (OSError, UnidentifiedImageError) as exc:
                raise UserError(f"{where}: cannot read image {path!r}: {exc}") from None
        width, height = size
        return fit_size(height, width, self.data.image_size, self.inputs.patch_size)

    # ------------------------------------------------------------------ loading

    def _tokens(self, record: _Record) -> torch.Tensor:
        budget = record.meta.text_tokens - 2 - record.meta.num_images - record.meta.num_audio
        ids = [BOS]
        for i, text in enumerate(record.texts):
            if i:
                ids.append(record.placeholders[i - 1] if record.placeholders else IMAGE)
            part = encode(text, self.inputs.vocab_size)[: max(0, budget)]
            budget -= len(part)
            ids += part
        ids.append(EOS)
        return torch.tensor(ids, dtype=torch.int64)


def fit_size(height: int, width: int, image_size: int, patch_size: int) -> tuple[int, int]:
    """Size an image is resized to: longer side <= image_size, both sides whole patches (>= 1)."""
    scale = min(1.0, image_size / max(height, width))
    return tuple(max(patch_size, int(side * scale) // patch_size * patch_size) for side in (height, width))


def image_folder(data: DataConfig) -> str:
    """The folder a record's image paths are relative to: ``data.image_dir`` under the JSON file's folder."""
    json_dir = os.path.dirname(os.path.abspath(data.path))
    return os.path.join(json_dir, data.image_dir) if data.image_dir else json_dir


def _load_json(path: str) -> list:
    try:
        with open(path, encoding="utf-8") as fh:
            entries = json.load(fh)
    except OSError as exc:
        raise UserError(f"data.path: cannot read {path!r}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise UserError(f"data.path: {path} is not valid JSON: {exc}") from None
    if not isinstance(entries, list):
        raise UserError(f"data.path: {path} must hold a JSON list of samples, got {type(entries).__name__}")
    if not entries:
        raise UserError(f"data.path: {path} holds no samples")
    return entries


def conversation_turns(conversations, where: str) -> list[tuple[str, str]]:
    """``(from, value)`` of each turn, checked."""
    if not isinstance(conversations, list) or not conversations:
        raise UserError(f"{where}: 'conversations' must be a non-empty list of turns")
    turns = []
    for i, turn in enumerate(conversations):
        if not (isinstance(turn, dict) and isinstance(turn.get("from"), str) and isinstance(turn.get("value"), str)):
            raise UserError(f"{where}: conversations[{i}] must be an object with string 'from' and 'value'")
        turns.append((turn["from"], turn["value"]))
    return turns


def _conversation_bytes(turns: list[tuple[str, str]]) -> tuple[bytes, np.ndarray]:
    """The byte-level text (``"<from>: <value>\\n"`` per turn) and, per byte, whether it is an
    assistant's value or closing newline."""
    text, mask = [], []
    for role, value in turns:
        head, body = f"{role}: ".encode(), f"{value}\n".encode()
        text += [head, body]
        mask += [np.zeros(len(head), dtype=bool), np.full(len(body), role in ASSISTANT_ROLES)]
    return b"".join(text), np.concatenate(mask)


def _image_paths(image, where: str, field: str = "image") -> tuple[str, ...]:
    if image is None:
        return ()
    paths = [image] if isinstance(image, str) else image
    if not isinstance(paths, list) or not all(isinstance(p, str) and p for p in paths):
        raise UserError(f"{where}: {field!r} must be a path or a list of paths, got {image!r}")
    return tuple(paths)


def _pixels(im: Image.Image, size: tuple[int, int], channels: int) -> torch.Tensor:
    height, width = size
    pixels = im.convert(_PIL_MODES[channels]).resize((width, height), Image.Resampling.BICUBIC)
    array = np.asarray(pixels, dtype=np.float32).reshape(height, width, channels) / 255.0
    return torch.from_numpy(np.ascontiguousarray(array.transpose(2, 0, 1)))
