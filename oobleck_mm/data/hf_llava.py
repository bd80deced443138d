"""LLaVA-style JSON samples for a ``model.huggingface`` model: its own tokenizer, chat template and image processor.

Same records as ``oobleck_mm.data.llava`` (``id``, ``image``, ``conversations``
of ``{"from", "value"}`` turns). What differs is that the model's directory
decides the text and the pixels:

- the conversation is rendered with the tokenizer's chat template (``human`` /
  ``user`` -> ``user``, ``gpt`` / ``assistant`` -> ``assistant``, ``system``
  kept); a tokenizer without one renders ``"<from>: <value>\\n"`` per turn after
  its BOS, as the byte-level reader does;
- the text is tokenized by the model's own fast tokenizer (``tokenizers``); every
  ``<image>`` must become the model's ``image_token_id``, and packing expands it
  into the tower's image tokens (``Sample.media`` marks them, since real token
  ids may equal the engine's own placeholder ids);
- ``data.loss_on: assistant`` trains on the tokens of the assistant's answers
  (found through the tokenizer's character offsets) and the end-of-turn token
  right after each; ``all`` on every token but the first;
- images go through the model's image processor (resize, crop, normalise) to
  the tower's square size.

Metadata needs the token count of every sample, so the records are rendered
and tokenized once, at construction: ~420 us a record on one core of the 2-core
development machine with the tests' tiny tokenizer (20,000 records of 15-150
words), so about 4.6 minutes for LLaVA's 665k records, of which the tokenizer's
own ``encode`` is a third and the chat template's rendering a quarter. With
``data.cache_dir`` (the default) the first process of a node does it and the
node's other ranks and its joiners map what it wrote (``record_cache.py``).
Pixels are decoded only when a sample is loaded.
Bad input is a ``UserError`` naming the file, the sample and what to change.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

import numpy as np
import torch
from PIL import UnidentifiedImageError

from oobleck_mm.config import DataConfig
from oobleck_mm.data import audio, record_cache
from oobleck_mm.data.dataset import BadSample, ModelInputs, check_index
from oobleck_mm.data.llava import ASSISTANT_ROLES, AUDIO_MARKER, MARKER, JsonRecords, image_folder
from oobleck_mm.data.sample import AUDIO, IMAGE, Sample, SampleMeta
from oobleck_mm.errors import UserError

ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
_MARKERS = re.compile(f"({re.escape(MARKER)}|{re.escape(AUDIO_MARKER)})")
"""The media markers of a record's text; split keeps them (at odd positions)."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


@dataclass(frozen=True, slots=True)
class _Record:
    sample_id: str
    tokens: np.ndarray
    media: np.ndarray
    targets: np.ndarray | None
    image_paths: tuple[str, ...]
    meta: SampleMeta
    audio_paths: tuple[str, ...] = ()


class HFLlavaJsonDataset(JsonRecords):
    """The samples of ``data.path`` tokenized and processed as the HF model in ``inputs.huggingface`` expects."""

    def __init__(self, data: DataConfig, inputs: ModelInputs) -> None:
        self.tokenizer = load_tokenizer(inputs.huggingface)
        self.image_processor = (
            load_image_processor(inputs.image_processor_dir or inputs.huggingface) if inputs.has_vision else None
        )
        self.image_tokens = (inputs.image_side // inputs.patch_size) ** 2 // inputs.image_merge
        self.special_ids = frozenset(self.tokenizer.all_special_ids)
        self.cache_folder: str | None = None
        """The record cache folder this dataset was read from or written to (None: no cache)."""
        self.built = True
        """Whether this process tokenized the records (False: it mapped another process's)."""
        if data.cache_dir is None:
            super().__init__(data, inputs)
            return
        self.cache_folder, self.built = record_cache.built_once(
            data.cache_dir, self._cache_key(data, inputs), lambda folder: self._build_into(folder, data, inputs)
        )
        if not self.built:
            self._read(self.cache_folder, data, inputs)

    def __getitem__(self, index: int) -> Sample:
        sample = self.layout(index)
        record = self._records[index]
        sample.images = [self._pixels(path, record.sample_id) for path in record.image_paths]
        sample.audio = [
            self._clip_features(record, path, frames)
            for path, frames in zip(record.audio_paths, record.meta.audio_frames)
        ]
        return sample

    def layout(self, index: int) -> Sample:
        """Sample ``index`` without its images' pixels or its clips' frames (``data.dataset.Dataset``): no file
        is opened."""
        record = self._records[check_index(index, len(self))]
        # Copies: a cached record's arrays are read-only views of a file every rank of the node maps.
        return Sample(
            meta=record.meta,
            tokens=torch.from_numpy(np.array(record.tokens, dtype=np.int64)),
            media=torch.from_numpy(np.array(record.media, dtype=bool)),
            targets=torch.from_numpy(np.array(record.targets, dtype=bool)) if record.targets is not None else None,
        )

    # ------------------------------------------------------------------ the node's record cache

    def _data_fingerprint(self, data: DataConfig):
        """What the records are read from, for the cache key (a reader of other files says which)."""
        return record_cache.fingerprint(data.path)

    def _cache_key(self, data: DataConfig, inputs: ModelInputs) -> str:
        import tokenizers
        import transformers

        return record_cache.cache_key(
            {
                "reader": type(self).__name__,
                "data": self._data_fingerprint(data),
                "columns": sorted(data.columns.items()),
                "split": data.split,
                "image_dir": image_folder(data),
                "model": record_cache.directory_fingerprint(inputs.huggingface),
                "image_processor": record_cache.directory_fingerprint(inputs.image_processor_dir)
                if inputs.image_processor_dir not in (None, inputs.huggingface)
                else None,
                "settings": [data.max_seq_len, data.loss_on, data.skip_bad_samples, list(data.excluded_samples)],
                "inputs": [
                    inputs.has_vision,
                    inputs.image_side,
                    inputs.patch_size,
                    inputs.image_merge,
                    inputs.image_token_id,
                    inputs.in_channels,
                ],
                "versions": [transformers.__version__, tokenizers.__version__],
            }
        )

    def _build_into(self, folder: str, data: DataConfig, inputs: ModelInputs) -> None:
        """Tokenize every record (``JsonRecords``), then write them as flat arrays into ``folder``."""
        super().__init__(data, inputs)
        records = self._records
        lengths = np.fromiter((len(r.tokens) for r in records), dtype=np.int64, count=len(records))
        offsets = np.zeros(len(records) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        empty = np.zeros(0, dtype=bool)
        arrays = {
            "offsets": offsets,
            "ids": np.concatenate([r.tokens for r in records]).astype(np.int32),  # vocabularies < 2**31
            "media": np.concatenate([r.media for r in records]),
            "targets": np.concatenate([r.targets if r.targets is not None else empty for r in records]),
            "position": np.array([r.meta.index for r in records], dtype=np.int64),
            "target_tokens": np.array(
                [-1 if r.meta.target_tokens is None else r.meta.target_tokens for r in records], dtype=np.int64
            ),
        }
        for name, array in arrays.items():
            np.save(os.path.join(folder, f"{name}.npy"), array)
        with open(os.path.join(folder, "strings.json"), "w", encoding="utf-8") as fh:
            json.dump(
                {
                    "sample_id": [r.sample_id for r in records],
                    "image_paths": [r.image_paths for r in records],
                    "audio_paths": [r.audio_paths for r in records],
                    "has_targets": records[0].targets is not None,
                    "skipped": [[b.position, b.reason] for b in self.skipped],
                },
                fh,
            )

    def _read(self, folder: str, data: DataConfig, inputs: ModelInputs) -> None:
        """The records another process wrote into ``folder``, their token arrays mapped, not read."""
        self.data, self.inputs = data, inputs
        self.image_dir = image_folder(data)
        a = {
            name: np.load(os.path.join(folder, f"{name}.npy"), mmap_mode="r")
            for name in ("offsets", "ids", "media", "targets")
        }
        position = np.load(os.path.join(folder, "position.npy")).tolist()
        target_tokens = np.load(os.path.join(folder, "target_tokens.npy")).tolist()
        offsets = a["offsets"].tolist()
        with open(os.path.join(folder, "strings.json"), encoding="utf-8") as fh:
            strings = json.load(fh)
        side = (inputs.image_side,) * 2
        ids, media, targets = a["ids"], a["media"], a["targets"] if strings["has_targets"] else None
        records = []
        clips = strings.get("audio_paths") or [()] * len(strings["sample_id"])  # (a cache written before clips)
        for i, (sample_id, paths) in enumerate(zip(strings["sample_id"], strings["image_paths"])):
            start, end = offsets[i], offsets[i + 1]
            meta = SampleMeta(
                index=position[i],
                text_tokens=end - start,
                image_sizes=(side,) * len(paths),
                audio_frames=(inputs.audio_clip_frames,) * len(clips[i]),
                target_tokens=None if target_tokens[i] < 0 else target_tokens[i],
            )
            records.append(
                _Record(
                    sample_id,
                    ids[start:end],
                    media[start:end],
                    targets[start:end] if targets is not None else None,
                    tuple(paths),
                    meta,
                    tuple(clips[i]),
                )
            )
        self._records = tuple(records)
        self.skipped = [BadSample(position, reason) for position, reason in strings["skipped"]]

    # ------------------------------------------------------------------ construction

    def _record(self, position: int, entry) -> _Record:
        sample_id, where, turns, paths, clips = self._entry(position, entry)  # (clips: a composition's Whisper's)
        for path in paths:
            if not self.image_exists(path):
                raise UserError(f"{where}: cannot read image {path!r}: no such file")
        text, answers = self._render(turns, where)
        if self.inputs.image_token_id is None:  # a composition's LLM: its tokenizer has no image token
            ids, offsets, media = self._encode_around_markers(text)
        else:
            # The tokenizers backend itself, as the transformers call ends in it (the same ids and
            # offsets): its per-call wrapping was a quarter of the time every rank spends here.
            encoded = self.tokenizer.backend_tokenizer.encode(text, add_special_tokens=False)
            ids, offsets = np.asarray(encoded.ids, dtype=np.int64), encoded.offsets
            media = ids == self.inputs.image_token_id if paths else np.zeros(len(ids), dtype=bool)
        if int(media.sum()) != len(paths) + len(clips):
            raise UserError(
                f"{where}: the tokenizer of {self.inputs.huggingface} turned {len(paths)} '{MARKER}' markers into "
                f"{int(media.sum())} image tokens (id {self.inputs.image_token_id}, the model's image_token_id); "
                "its tokenizer must hold '<image>' as one added token"
            )
        targets = self._targets(offsets, ids, answers) if self.data.loss_on == "assistant" else None
        ids, media, targets = self._fit(ids, media, targets, where, len(clips))
        if targets is None:
            targets_count = None
        else:
            targets[0] = False
            targets_count = int(targets.sum())
        meta = SampleMeta(
            index=position,
            text_tokens=len(ids),
            image_sizes=((self.inputs.image_side,) * 2,) * len(paths),
            audio_frames=(self.inputs.audio_clip_frames,) * len(clips),
            target_tokens=targets_count,
        )
        for path in clips:
            if not self.image_exists(path):
                raise UserError(f"{where}: cannot read audio clip {path!r}: no such file")
        return _Record(sample_id, ids, media, targets, paths, meta, clips)

    def _encode_around_markers(self, text: str) -> tuple[np.ndarray, list[tuple[int, int]], np.ndarray]:
        """(ids, character offsets, media mask) of ``text`` for a tokenizer without an image token (a composed
        model's LLM, pretrained on text alone): the text between ``<image>`` (and ``<audio>``) markers is
        encoded piece by piece, each marker becomes one placeholder (``IMAGE``, ``AUDIO``; ``Sample.media``
        marks it, and the LLM's first layer puts the medium's tokens there whatever its id). That is how a tokenizer with ``<image>`` as an
        added token encodes it (it splits the text at its added tokens): the same ids elsewhere, the
        vocabulary and embedding left as pretrained."""
        ids: list[int] = []
        offsets: list[tuple[int, int]] = []
        media: list[bool] = []
        cursor = 0
        for k, piece in enumerate(_MARKERS.split(text)):
            if k % 2:  # a marker: its medium's placeholder (``IMAGE``, ``AUDIO``: packing tells them apart)
                ids.append(IMAGE if piece == MARKER else AUDIO)
                offsets.append((cursor, cursor + len(piece)))
                media.append(True)
            else:
                encoded = self.tokenizer.backend_tokenizer.encode(piece, add_special_tokens=False)
                ids += encoded.ids
                offsets += [(cursor + a, cursor + b) for a, b in encoded.offsets]
                media += [False] * len(encoded.ids)
            cursor += len(piece)
        return np.asarray(ids, dtype=np.int64), offsets, np.asarray(media, dtype=bool)

    def _render(self, turns: list[tuple[str, str]], where: str) -> tuple[str, list[tuple[int, int]]]:
        """The conversation's text and the character span of each assistant answer in it."""
        if self.tokenizer.chat_template:
            messages = []
            for role, value in turns:
                if role not in ROLES:
                    raise UserError(f"{where}: turn from {role!r}; the chat template takes {', '.join(ROLES)}")
                messages.append({"role": ROLES[role], "content": value})
            text = self.tokenizer.apply_chat_template(messages, tokenize=False)
        else:
            messages = [{"role": ROLES.get(r, r), "content": v} for r, v in turns]
            text = (self.tokenizer.bos_token or "") + "".join(f"{r}: {v}\n" for r, v in turns)
        spans, cursor = [], 0
        for message in messages:
            start = text.find(message["content"], cursor)
            if start < 0:
                raise UserError(
                    f"{where}: the chat template's text does not contain a turn's text as written; "
                    "use data.loss_on: all with this template"
                )
            cursor = start + len(message["content"])
            if message["role"] == "assistant" or message["role"] in ASSISTANT_ROLES:
                spans.append((start, cursor))
        return text, spans

    def _targets(self, offsets, ids: np.ndarray, answers: list[tuple[int, int]]) -> np.ndarray:
        """Tokens inside an answer, and the (special) end-of-turn token right after it."""
        targets = np.zeros(len(ids), dtype=bool)
        if not answers or not len(ids):
            return targets
        spans = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
        first, after = spans[:, 0], spans[:, 1]
        for start, end in answers:
            inside = np.flatnonzero((first < end) & (after > start) & (after > first))
            if not inside.size:
                continue
            targets[inside] = True
            last = int(inside[-1])
            if last + 1 < len(ids) and int(ids[last + 1]) in self.special_ids:
                targets[last + 1] = True
        return targets

    def _fit(self, ids, media, targets, where: str, clips: int = 0):
        """Cut text at the end so the LLM sequence fits ``data.max_seq_len``; images and clips are never cut."""
        clip_tokens = self.inputs.clip_llm_tokens(self.inputs.audio_clip_frames) if clips else 0
        length = len(ids) + (self.image_tokens - 1) * (int(media.sum()) - clips) + (clip_tokens - 1) * clips
        limit = self.data.max_seq_len
        if length <= limit:
            return ids, media, targets
        images = int(media.sum()) - clips
        keep = len(ids) - (length - limit)
        if keep < 2 or int(media[:keep].sum()) != images + clips:
            clipped = f" and {clips} audio clips" if clips else ""
            raise UserError(
                f"{where}: its {images} images{clipped} take {images * self.image_tokens + clips * clip_tokens} LLM "
                f"tokens, which with its text before them exceed data.max_seq_len ({limit}); raise data.max_seq_len"
            )
        return ids[:keep], media[:keep], (targets[:keep] if targets is not None else None)

    # ------------------------------------------------------------------ loading

    def _clip_features(self, record: _Record, path: str, frames: int) -> torch.Tensor:
        """float32 ``[frames, mel bins]``: a clip as a composition's Whisper encoder takes it (``frames``: its
        fixed length), padded with silence (or cut) to that length before the log-mel features, as
        ``WhisperFeatureExtractor`` pads it; a ``.npy`` clip holds those features already, exactly that long.
        (What ``decode_images``, the master's check of every record, decodes too.)"""
        bins, sample_id = self.inputs.mel_bins, record.sample_id
        try:
            with self.open_audio(path) as f:
                if audio.suffix(path) == ".npy":
                    features = np.load(f, allow_pickle=False)
                    if features.shape != (frames, bins):
                        raise audio.BadClip(
                            f"log-mel features must be [{frames}, {bins}] (the Whisper encoder's clip), got "
                            f"{list(features.shape)}"
                        )
                else:
                    hop = audio.hop_length(self.data.audio_frames_per_second)
                    features = audio.log_mel(_whisper_clip(audio.read_wav(path, f), frames, hop), bins, hop)
        except (OSError, audio.BadClip, ValueError) as exc:
            raise UserError(f"{self.data.path}: sample {sample_id!r}: cannot decode audio {path!r}: {exc}") from None
        return torch.from_numpy(np.ascontiguousarray(features, dtype=np.float32))

    def _pixels(self, path: str, sample_id: str) -> torch.Tensor:
        try:
            with self.open_image(path) as im:
                image = im.convert("RGB")
        except (OSError, UnidentifiedImageError) as exc:
            raise UserError(f"{self.data.path}: sample {sample_id!r}: cannot decode image {path!r}: {exc}") from None
        pixels = self.image_processor(image, return_tensors="pt")["pixel_values"][0]
        side = self.inputs.image_side
        if tuple(pixels.shape) != (self.inputs.in_channels, side, side):
            raise UserError(
                f"{self.inputs.huggingface}: its image processor makes {list(pixels.shape)} images, the "
                f"vision tower takes [{self.inputs.in_channels}, {side}, {side}]"
            )
        return pixels.float()


def _whisper_clip(waveform: np.ndarray, frames: int, hop: int) -> np.ndarray:
    """The waveform as Whisper's feature extractor takes it: zeros after it, or cut, to ``frames`` frames."""
    samples = frames * hop
    return np.pad(waveform[:samples], (0, max(0, samples - len(waveform))))


def load_tokenizer(directory: str):
    from transformers import AutoTokenizer

    if not any(os.path.exists(os.path.join(directory, f)) for f in TOKENIZER_FILES):
        raise UserError(
            f"model.huggingface: {directory} has no tokenizer files ({', '.join(TOKENIZER_FILES)}); "
            "data.kind llava_json tokenizes with the model's own tokenizer"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise UserError(f"model.huggingface: cannot load the tokenizer of {directory}: {exc}") from None
    if not tokenizer.is_fast:
        raise UserError(
            f"model.huggingface: the tokenizer of {directory} is not a fast (tokenizers) tokenizer; "
            "loss masks need its character offsets (save it with a tokenizer.json)"
        )
    return tokenizer


def load_image_processor(directory: str):
    from transformers import AutoImageProcessor

    if not os.path.exists(os.path.join(directory, "preprocessor_config.json")):
        raise UserError(
            f"model.huggingface: {directory} has no preprocessor_config.json; data.kind llava_json "
            "prepares images with the model's own image processor"
        )
    # PIL: what transformers itself prefers for CLIP/SigLIP (same outputs as the slow processors), no torchvision.
    return AutoImageProcessor.from_pretrained(directory, local_files_only=True, backend="pil")
