"""The compute copy of an emulated job: the same layer list and token counts, widths divided.

With ``cluster.emulate: ACCELERATOR`` the master plans the job's real model on
that accelerator, and every worker computes a *shrunk* copy of it on the CPU
(``docs/emulation.md``): the same layers in the same order (so stage cuts and
layer indices mean the same thing), the same data (so every sample's image
patches, audio frames and text tokens are the real ones, and the emulated
durations follow them), but every width divided by ``cluster.emulate_shrink``:
hidden sizes, FFN widths, attention heads, the vocabulary. The math stays real:
``verify`` judges an emulated run against the reference trainer on the same
shrunk model.

The emulated durations never come from the compute copy: they follow each
sample's metadata read from the *real* job's data (``emulation.truth``). So the
compute copy may also be coarser in tokens, and must be: eager attention's
quadratic terms do not shrink with the width, and a 1,024-patch image through a
36-block encoder cost 0.97 CPU-s per sample at real token counts, against a
budget of ~43 ms per sample for 16 emulated A100s on 2 cores (docs/emulation.md).
``cluster.emulate_coarsen`` multiplies the encoders' patch size and audio
downsampling in the compute copy (the synthetic data then draws its images in
those coarser patches), and synthetic text is as many times shorter. Input
channels, mel bins and token merges stay as they are.

Pure: dataclasses only, no other project module (config is a leaf).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from oobleck_mm.config.values import ConfigError

AUTO_TARGET_HIDDEN = 32
"""The LLM width an automatic shrink aims at: wide enough for attention heads to be real, narrow
enough that a worker's CPU math stays a small fraction of the emulated GPU time (``docs/emulation.md``)."""

AUTO_MAX_SPAN = 128
"""The longest encoder attention span (patches of one image, tokens of one clip) an automatic coarsening
leaves in the compute copy."""

MIN_VOCAB = 133
"""The smallest vocabulary a shrunk LLM keeps: byte-level text needs 5 special ids and 128 ASCII bytes
(``data.tokenizer.MIN_VOCAB_SIZE``; config, a leaf, cannot import it)."""


def auto_shrink(model: Any) -> int:
    """The width divisor ``cluster.emulate_shrink`` defaults to: the LLM's hidden size down to about
    ``AUTO_TARGET_HIDDEN`` (1 for a model already that narrow)."""
    return max(1, model.llm.hidden // AUTO_TARGET_HIDDEN)


def encoder_spans(model: Any, data: Any) -> dict[str, float]:
    """The longest attention span of each encoder, in its tokens: an image's patches at ``data.image_size``,
    a clip's frames after downsampling at the mean clip length."""
    spans = {}
    if model.vision is not None:
        side = data.image_size or 224
        spans["vision"] = float((side // model.vision.patch_size) ** 2)
    if model.audio is not None:
        spans["audio"] = (data.mean_audio_seconds or 0.0) * data.audio_frames_per_second / model.audio.downsample
    return spans


def coarsened_spans(model: Any, data: Any, factor: int) -> dict[str, float]:
    """The attention spans of the compute copy coarsened by ``factor``: the encoders' and synthetic text's."""
    spans = encoder_spans(coarsened_model(model, factor), data)
    if data.kind == "synthetic" and data.mean_text_tokens is not None:
        spans["text"] = data.mean_text_tokens / factor
    return spans


def valid_coarsenings(model: Any, data: Any) -> list[int]:
    """The factors a compute copy may coarsen by: a coarser patch must still tile ``data.image_size`` (and
    ``data.min_image_size``) exactly, as the data's own check asks of every patch."""
    if model.vision is None:
        return list(range(1, 65))
    sides = [s // model.vision.patch_size for s in (data.image_size or 224, data.min_image_size) if s]
    return [f for f in range(1, 65) if all(side % f == 0 for side in sides)]


def auto_coarsen(model: Any, data: Any) -> int:
    """The ``cluster.emulate_coarsen`` default: the smallest valid factor that leaves every attention span of the
    compute copy at most ``AUTO_MAX_SPAN`` tokens (a patch side grows by the factor, an audio token folds as
    many more frames, synthetic text is as many times shorter), else the largest valid one."""
    factors = valid_coarsenings(model, data)
    for factor in factors:
        if all(span <= AUTO_MAX_SPAN for span in coarsened_spans(model, data, factor).values()):
            return factor
    return factors[-1]


def coarsened_model(model: Any, factor: int) -> Any:
    """``model`` whose encoders read ``factor`` times coarser tokens: patch sides and audio downsampling
    times ``factor``."""
    if factor == 1:
        return model
    vision = model.vision
    if vision is not None:
        vision = dataclasses.replace(vision, patch_size=vision.patch_size * factor)
    audio = (
        dataclasses.replace(model.audio, downsample=model.audio.downsample * factor)
        if model.audio is not None
        else None
    )
    return dataclasses.replace(model, vision=vision, audio=audio)


def _divide(path: str, value: int, divisor: int) -> int:
    shrunk = value // divisor
    if shrunk < 1:
        raise ConfigError(
            f"cluster.emulate_shrink ({divisor}) leaves {path} ({value}) with no width; "
            f"valid: 1 to {value}, or leave it unset for the automatic choice"
        )
    return shrunk


def _heads(hidden: int, heads: int, divisor: int) -> int:
    """Heads after the shrink: heads / divisor (at least 1), lowered until they divide the width."""
    shrunk = max(1, heads // divisor)
    while hidden % shrunk:
        shrunk -= 1
    return shrunk


def _kv_heads(heads: int, kv_heads: int, divisor: int) -> int:
    shrunk = max(1, min(heads, kv_heads // divisor))
    while heads % shrunk:
        shrunk -= 1
    return shrunk


def _tower(section: Any, prefix: str, divisor: int) -> Any:
    """An encoder's or the LLM's section with its widths divided."""
    hidden = _divide(f"{prefix}.hidden", section.hidden, divisor)
    changes: dict[str, Any] = {
        "hidden": hidden,
        "num_heads": _heads(hidden, section.num_heads, divisor),
        "ffn_hidden": _divide(f"{prefix}.ffn_hidden", section.ffn_hidden, divisor),
    }
    if hasattr(section, "num_kv_heads"):
        changes["num_kv_heads"] = _kv_heads(changes["num_heads"], section.num_kv_heads, divisor)
    if hasattr(section, "vocab_size"):
        changes["vocab_size"] = max(min(MIN_VOCAB, section.vocab_size), section.vocab_size // divisor)
    return dataclasses.replace(section, **changes)


def shrunk_model(model: Any, divisor: int) -> Any:
    """``model`` (a ``ModelConfig``) with every width divided by ``divisor``; ConfigError naming the
    field a divisor would leave with no width."""
    if divisor == 1:
        return model
    return dataclasses.replace(
        model,
        llm=_tower(model.llm, "model.llm", divisor),
        vision=_tower(model.vision, "model.vision", divisor) if model.vision is not None else None,
        audio=_tower(model.audio, "model.audio", divisor) if model.audio is not None else None,
    )


def compute_model(job: Any) -> Any:
    """The model section of ``job``'s compute copy (``job.model`` when not emulated)."""
    c = job.cluster
    if c.emulate is None:
        return job.model
    coarsen = c.emulate_coarsen or auto_coarsen(job.model, job.data)
    model = coarsened_model(job.model, coarsen)
    return shrunk_model(model, c.emulate_shrink or auto_shrink(job.model))


HALF_TYPES = ("bfloat16", "float16")


def compute_training(training: Any) -> Any:
    """The compute copy's training section: a half compute dtype becomes float32 (a CPU has no fast half
    matmuls: bfloat16 cost the shrunk MLLM-10B 1.8x the CPU time of float32), and activation checkpointing
    is off (the shrunk copy has memory to spare, and recomputing every forward cost a third more CPU). The
    math of an update does not depend on either; the emulated time does charge the real job's choices (the
    plan's per-stage recomputation, ``StageSpec.recompute``)."""
    dtype = "float32" if training.dtype in HALF_TYPES else training.dtype
    master = training.master_dtype if training.master_dtype not in (None, dtype) or dtype == "float32" else None
    return dataclasses.replace(training, dtype=dtype, master_dtype=master, activation_checkpointing=False)


def compute_job(job: Any) -> Any:
    """The job a worker computes: ``job`` itself, or under ``cluster.emulate`` its compute copy (the model's
    widths divided, encoder tokens coarsened, CPU-friendly numerics: ``compute_training``). Every process that
    builds layers or packs samples of an emulated job (workers, the reference trainer, ``verify``, a resume)
    goes through here; what is *timed* stays the real job's (``emulation.truth``)."""
    if job.cluster.emulate is None:
        return job
    # Its own shrink and coarsening are 1: a compute copy is its own compute copy (callers need not know
    # which of the two they hold).
    cluster = dataclasses.replace(job.cluster, emulate_shrink=1, emulate_coarsen=1)
    return dataclasses.replace(
        job, model=compute_model(job), data=compute_data(job), training=compute_training(job.training), cluster=cluster
    )


def compute_data(job: Any) -> Any:
    """The compute copy's data section: synthetic text as many times shorter as the encoders' tokens are
    coarser (the LLM's packed attention over a microbatch is quadratic in its length on the CPU too). The
    sampler's global batches do not depend on it; the emulated time reads the real data's lengths."""
    data = job.data
    factor = job.cluster.emulate_coarsen or auto_coarsen(job.model, job.data)
    if factor == 1 or data.kind != "synthetic" or data.mean_text_tokens is None:
        return data
    # The longest sample shrinks with the mean: the lognormal tail cut at max_seq_len is where the CPU's
    # quadratic attention costs most (a 2,048-token sample overran its emulated forward 3x).
    return dataclasses.replace(
        data,
        mean_text_tokens=max(2.0, data.mean_text_tokens / factor),
        max_seq_len=max(1, -(-data.max_seq_len // factor)),
    )
