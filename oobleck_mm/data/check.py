"""Every sample checked once before the first step, and the bad ones left out when the user says so.

The master runs ``check_samples`` before any worker starts (``verify`` does too,
so its reference run leaves out the same samples). Building the dataset reads
every record and every image's header; with ``data.check_images: decode`` (the
default) every image is then decoded once as well, so a truncated or corrupt
file is found here and not by a worker mid-run. Without ``data.skip_bad_samples``
the whole pass runs all the same, and every bad sample (the first ``REPORTED``
named, the rest counted) is one ``UserError`` that suggests ``--skip-bad-samples``
(exit 2): a user fixes them all at once instead of one per launch.
With it, bad samples are logged and their positions in the JSON file become
``data.excluded_samples``, which the job's config carries to every worker: all
ranks, and any later resume, leave out exactly the same samples. The global
batch keeps its size: the sampler draws from the samples that remain.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from oobleck_mm.data.dataset import BadSample
from oobleck_mm.data.build import build_dataset
from oobleck_mm.errors import UserError

PROGRESS_EVERY_S = 5.0
"""A progress line at most this often while images are decoded."""
SHOWN = 5
"""Bad samples left out that are named one by one before the rest are counted."""
REPORTED = 20
"""Bad samples a refusal names one by one (without ``data.skip_bad_samples``) before it counts the rest."""


def check_samples(job, progress: Callable[[str], None] = print) -> list[BadSample]:
    """Checks every sample of ``job.data``; returns the bad ones left out (sets ``data.excluded_samples``).

    Raises ``UserError`` naming every bad sample (up to ``REPORTED``) unless ``data.skip_bad_samples``,
    and when too few samples remain for one global batch.
    """
    start = time.perf_counter()
    if job.data.kind == "synthetic":  # generated samples: nothing to read
        build_dataset(job)
        return []
    # One pass that collects every bad sample, whether or not they are then left out.
    collecting = (
        job
        if job.data.skip_bad_samples
        else dataclasses.replace(job, data=dataclasses.replace(job.data, skip_bad_samples=True))
    )
    dataset = build_dataset(collecting)
    bad = list(dataset.skipped)  # records and headers: already left out of ``dataset``
    decoded_bad = _decode_every_image(dataset, progress) if job.data.check_images == "decode" else []
    bad += decoded_bad
    if bad and not job.data.skip_bad_samples:
        skip = "data.skip_bad_samples: true (or --skip-bad-samples) leaves {} out, on every rank and every resume"
        if len(bad) == 1:  # one line, as the console prints an error
            raise UserError(f"{bad[0].reason} (sample #{bad[0].position}); {skip.format('it')}")
        named = "\n".join(f"  #{b.position}: {b.reason}" for b in bad[:REPORTED])
        more = f"\n  ... and {len(bad) - REPORTED} more" if len(bad) > REPORTED else ""
        raise UserError(
            f"{job.data.path}: {len(bad)} bad samples, each of which would stop the job on any "
            f"replica:\n{named}{more}\n{skip.format('them')}"
        )
    if bad:
        job.data.excluded_samples = tuple(sorted(set(job.data.excluded_samples) | {b.position for b in bad}))
        for b in bad[:SHOWN]:
            progress(f"data: left out sample #{b.position}: {b.reason}")
        if len(bad) > SHOWN:
            progress(f"data: ... and {len(bad) - SHOWN} more")
    kept = len(dataset) - len(decoded_bad)
    if kept < job.training.global_batch:
        raise UserError(
            f"{job.data.path}: {kept} good samples left, fewer than training.global_batch ({job.training.global_batch})"
        )
    left_out = (
        f", {len(job.data.excluded_samples)} left out (data.excluded_samples)" if job.data.excluded_samples else ""
    )
    progress(f"data: {kept} samples of {job.data.path} checked in {time.perf_counter() - start:.1f} s{left_out}")
    measure_shape(job, dataset, {b.position for b in decoded_bad}, progress)
    return bad


def ensure_shape(job, progress: Callable[[str], None] = print) -> None:
    """``measure_shape`` for a command that plans without the master's check (``plan``, ``simulate``,
    ``verify`` of a run without recorded means): one pass over the records, no image decoded."""
    from oobleck_mm.config.validation import shape_measured

    if not shape_measured(job.data):
        measure_shape(job, build_dataset(job), progress=progress)


def measure_shape(job, dataset, left_out: set[int] = frozenset(), progress: Callable[[str], None] = print) -> None:
    """The planning shape a ``llava_json`` job did not give, measured over its samples (those not in
    ``left_out``, positions in the file): ``data.mean_text_tokens`` (text tokens of the LLM sequence, without
    the media placeholders, as ``config.shape.sequence_tokens`` counts them) and ``data.mean_images_per_sample``.
    A value the user set is kept (a user may plan for data to come). The job is validated again with them:
    the rules that need the means (``data.max_seq_len`` against the mean sequence, an idle vision tower)."""
    from oobleck_mm.config.validation import shape_measured, validate

    d = job.data
    if shape_measured(d):
        return
    text = images = frames = count = 0
    for i in range(len(dataset)):
        meta = dataset.meta(i)
        if meta.index in left_out:
            continue
        count += 1
        images += meta.num_images
        frames += sum(meta.audio_frames)
        text += meta.text_tokens - meta.num_images - meta.num_audio
    measured = []
    if d.mean_text_tokens is None:
        d.mean_text_tokens = max(1.0, round(text / count, 3))
        measured.append(f"data.mean_text_tokens {d.mean_text_tokens:g}")
    if d.mean_images_per_sample is None:
        d.mean_images_per_sample = round(images / count, 4)
        measured.append(f"data.mean_images_per_sample {d.mean_images_per_sample:g}")
    if d.mean_audio_seconds is None:
        d.mean_audio_seconds = round(frames / d.audio_frames_per_second / count, 4)
        measured.append(f"data.mean_audio_seconds {d.mean_audio_seconds:g}")
    progress(f"data: measured over {count} samples for the planner: {', '.join(measured)}")
    validate(job)


def _decode_every_image(dataset, progress: Callable[[str], None]) -> list[BadSample]:
    bad: list[BadSample] = []
    total = len(dataset)
    started = last = time.perf_counter()
    for index in range(total):
        try:
            dataset.decode_images(index)
        except UserError as error:
            bad.append(BadSample(dataset.meta(index).index, str(error)))
        now = time.perf_counter()
        if now - last >= PROGRESS_EVERY_S:
            rate = (index + 1) / (now - started)
            progress(
                f"data: decoded the images of {index + 1}/{total} samples ({rate:.0f}/s, "
                f"{(total - index - 1) / rate:.0f} s left)"
            )
            last = now
    return bad
