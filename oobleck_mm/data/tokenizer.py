"""Byte-level tokenizer: text <-> token ids, one id per UTF-8 byte above the special ids.

Id ``NUM_SPECIAL_TOKENS + b`` is byte ``b``. A vocabulary must hold at least the
128 ASCII bytes; bytes that do not fit a smaller vocabulary (non-ASCII UTF-8
bytes) become ``'?'``, so every string encodes to exactly one id per UTF-8 byte
(datasets rely on that to count tokens without tokenizing).
"""

from __future__ import annotations

from oobleck_mm.errors import UserError
from oobleck_mm.data.sample import AUDIO, BOS, EOS, IMAGE, NUM_SPECIAL_TOKENS, PAD

MIN_VOCAB_SIZE = NUM_SPECIAL_TOKENS + 128
"""Smallest vocabulary that holds every ASCII byte."""

SPECIAL_NAMES = {PAD: "<pad>", BOS: "<bos>", EOS: "<eos>", IMAGE: "<image>", AUDIO: "<audio>"}

_QUESTION = NUM_SPECIAL_TOKENS + ord("?")


def check_vocab_size(vocab_size: int) -> None:
    if vocab_size < MIN_VOCAB_SIZE:
        raise UserError(
            f"vocab_size ({vocab_size}) is too small for byte-level text: it must be >= {MIN_VOCAB_SIZE} "
            f"({NUM_SPECIAL_TOKENS} special ids + 128 ASCII bytes)"
        )


def num_tokens(text: str) -> int:
    """Ids ``encode(text, ...)`` returns, whatever the vocabulary."""
    return len(text.encode("utf-8"))


def encode(text: str, vocab_size: int) -> list[int]:
    """Token ids of ``text`` (no BOS/EOS); bytes beyond the vocabulary become '?'."""
    check_vocab_size(vocab_size)
    ids = [NUM_SPECIAL_TOKENS + b for b in text.encode("utf-8")]
    if vocab_size < NUM_SPECIAL_TOKENS + 256:
        ids = [i if i < vocab_size else _QUESTION for i in ids]
    return ids


def decode(ids) -> str:
    """Readable text of ``ids`` (a list or 1-d tensor); special ids render as ``<image>`` etc."""
    out: list[str] = []
    pending = bytearray()
    for raw in ids:
        i = int(raw)
        if NUM_SPECIAL_TOKENS <= i < NUM_SPECIAL_TOKENS + 256:
            pending.append(i - NUM_SPECIAL_TOKENS)
            continue
        if pending:
            out.append(pending.decode("utf-8", errors="replace"))
            pending.clear()
        out.append(SPECIAL_NAMES.get(i, f"<unk:{i}>"))
    if pending:
        out.append(pending.decode("utf-8", errors="replace"))
    return "".join(out)
