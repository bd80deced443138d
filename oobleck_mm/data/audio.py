"""Audio clips of a record: their length from the file header, their log-mel features when loaded.

A clip is a WAV file (16-bit or 32-bit PCM; several channels are averaged) at
``SAMPLE_RATE``, or a NumPy ``.npy`` array of precomputed log-mel features ``[frames, mel_bins]``
(what a pipeline that resampled or augmented its audio writes). The features are Whisper's: a 400-sample
Hann window, a hop of ``SAMPLE_RATE / data.audio_frames_per_second`` samples (160: 100 frames a second),
``model.audio.mel_bins`` Slaney mel filters up to 8 kHz, log10, clamped to 8 below the clip's maximum and
scaled ``(x + 4) / 4`` -- computed with ``transformers.audio_utils`` (the functions Whisper's own feature
extractor calls), so a clip here gives the features ``WhisperFeatureExtractor`` gives it
(``tests/unit/test_audio_records.py``).

The frame count comes from the header alone (a WAV's sample count, an array's shape), so a record's
``SampleMeta.audio_frames`` is known without decoding: a clip of ``n`` samples has ``n // hop`` frames,
cut to ``data.max_audio_seconds`` (Whisper's 30 s window by default) and rounded down to whole LLM tokens
(``downsample * token_merge`` frames); a clip shorter than one token is a bad sample, named.

Not resampled: a WAV at another rate is a bad sample naming the rate (resample it, or store ``.npy``
features); no maintained resampler is installed here (torchaudio, scipy), and a hand-written one would be
a second, untested definition of the model's input.
"""

from __future__ import annotations

import io
import wave
from typing import IO

import numpy as np

SAMPLE_RATE = 16_000
"""Samples per second the features are computed at (Whisper's)."""
N_FFT = 400
"""Window of each frame: 25 ms at 16 kHz (Whisper's)."""
MAX_FREQUENCY = 8_000.0
AUDIO_SUFFIXES = (".wav", ".npy")


class BadClip(ValueError):
    """A clip that cannot be read or used; the message says why (the caller names the sample)."""


def hop_length(frames_per_second: float) -> int:
    hop = SAMPLE_RATE / frames_per_second
    if hop != int(hop) or hop < 1:
        raise BadClip(
            f"data.audio_frames_per_second ({frames_per_second:g}) must divide {SAMPLE_RATE} (the audio's sample "
            f"rate) into whole samples per frame; 100 gives Whisper's 160"
        )
    return int(hop)


def suffix(name: str) -> str:
    """``.wav`` or ``.npy``: how the clip is read (``BadClip`` for any other name)."""
    lower = name.lower()
    for suffix in AUDIO_SUFFIXES:
        if lower.endswith(suffix):
            return suffix
    raise BadClip(f"{name!r} is not a .wav or .npy clip")


def header_frames(name: str, source: IO[bytes], frames_per_second: float, mel_bins: int) -> int:
    """Feature frames of the clip in ``source`` (a binary file) from its header, before any cut."""
    if suffix(name) == ".npy":
        shape = _npy_shape(source)
        if len(shape) != 2 or shape[1] != mel_bins:
            raise BadClip(
                f"{name!r}: log-mel features must be [frames, {mel_bins}] (model.audio.mel_bins), got {shape}"
            )
        return int(shape[0])
    with _open_wav(name, source) as w:
        return w.getnframes() // hop_length(frames_per_second)


def usable_frames(frames: int, unit: int, max_seconds: float, frames_per_second: float) -> int:
    """The frames of a clip the model sees: cut to ``max_seconds``, rounded down to whole tokens (``unit``)."""
    frames = min(frames, int(max_seconds * frames_per_second))
    return frames - frames % unit


def load_features(name: str, source: IO[bytes], frames: int, frames_per_second: float, mel_bins: int) -> np.ndarray:
    """float32 ``[frames, mel_bins]``: the clip's log-mel features, its first ``frames`` frames."""
    if suffix(name) == ".npy":
        features = np.load(source, allow_pickle=False)
    else:
        features = log_mel(read_wav(name, source), mel_bins, hop_length(frames_per_second))
    if features.shape[0] < frames:  # the header promised more than the body holds
        raise BadClip(f"{name!r}: {features.shape[0]} frames of features, its header said at least {frames}")
    return np.ascontiguousarray(features[:frames], dtype=np.float32)


def log_mel(waveform: np.ndarray, mel_bins: int, hop: int = 160) -> np.ndarray:
    """Whisper's log-mel features of a mono 16 kHz waveform: ``[len(waveform) // hop, mel_bins]``."""
    from transformers.audio_utils import mel_filter_bank, spectrogram, window_function

    filters = mel_filter_bank(
        num_frequency_bins=1 + N_FFT // 2,
        num_mel_filters=mel_bins,
        min_frequency=0.0,
        max_frequency=MAX_FREQUENCY,
        sampling_rate=SAMPLE_RATE,
        norm="slaney",
        mel_scale="slaney",
    )
    spec = spectrogram(
        waveform.astype(np.float32),
        window_function(N_FFT, "hann"),
        frame_length=N_FFT,
        hop_length=hop,
        power=2.0,
        mel_filters=filters,
        log_mel="log10",
    )[:, :-1]  # Whisper drops the last frame: len // hop frames
    spec = np.maximum(spec, spec.max() - 8.0)
    return ((spec + 4.0) / 4.0).T


def read_wav(name: str, source: IO[bytes]) -> np.ndarray:
    """A WAV file's samples as mono float32 in [-1, 1]."""
    with _open_wav(name, source) as w:
        width, channels = w.getsampwidth(), w.getnchannels()
        raw = w.readframes(w.getnframes())
    if width == 2:
        samples = np.frombuffer(raw, dtype="<i2").astype(np.float32) / 32768.0
    elif width == 4:
        samples = np.frombuffer(raw, dtype="<i4").astype(np.float32) / 2147483648.0
    else:
        raise BadClip(f"{name!r}: {8 * width}-bit samples; 16- or 32-bit PCM WAV is read")
    return samples.reshape(-1, channels).mean(axis=1) if channels > 1 else samples


def _open_wav(name: str, source: IO[bytes]) -> wave.Wave_read:
    try:
        w = wave.open(source, "rb")
    except (wave.Error, EOFError) as exc:
        raise BadClip(f"{name!r} is not a PCM WAV file ({exc})") from None
    if w.getframerate() != SAMPLE_RATE:
        rate = w.getframerate()
        w.close()
        raise BadClip(
            f"{name!r} is sampled at {rate} Hz; the features are computed at {SAMPLE_RATE} Hz (resample it, or "
            "store its log-mel features as .npy)"
        )
    return w


def _npy_shape(source: IO[bytes]) -> tuple[int, ...]:
    try:
        version = np.lib.format.read_magic(source)
        read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, _, _ = read(source)  # the header only: no data read
    except ValueError as exc:
        raise BadClip(f"not a .npy array ({exc})") from None
    return tuple(shape)


def as_file(data: bytes) -> IO[bytes]:
    return io.BytesIO(data)
