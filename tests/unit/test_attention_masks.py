"""Attention masks as data (``oobleck_mm.model.attention_masks``, issue 50 item 1): the words mean the mask
they stand for, and blocked attention over them equals dense masked attention in float64 whatever the
samples, spans and block size (hypothesis), while skipping the blocks that cannot attend."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from oobleck_mm.model.attention_masks import (
    CAUSAL,
    SPAN_BITS,
    batch_bits,
    block_matrix,
    block_workload,
    blocked_attention,
    dense_attention,
    dense_mask,
    token_bits,
)

EXAMPLES = int(os.environ.get("OOBLECK_MASK_EXAMPLES", "60"))


@st.composite
def packed(draw):
    """Samples of random lengths packed in order, each with random media spans; some tokens maybe padding."""
    lengths = draw(st.lists(st.integers(1, 24), min_size=1, max_size=4))
    segments = torch.cat([torch.full((n,), i, dtype=torch.int64) for i, n in enumerate(lengths)])
    spans, start = [], 0
    for n in lengths:
        cursor = start
        while cursor < start + n and draw(st.booleans()):
            a = draw(st.integers(cursor, start + n - 1))
            b = draw(st.integers(a + 1, start + n))
            spans.append((a, b))
            cursor = b
        start += n
    causal = draw(st.booleans())
    return segments, spans, causal


def brute(segments, spans, causal) -> torch.Tensor:
    """The mask by its definition, token pair by token pair."""
    t = segments.numel()
    span_of = {}
    for k, (a, b) in enumerate(spans):
        for i in range(a, b):
            span_of[i] = k
    mask = torch.zeros(t, t, dtype=torch.bool)
    for q in range(t):
        for k in range(t):
            if segments[q] != segments[k]:
                continue
            mask[q, k] = (causal and k <= q) or (q in span_of and span_of.get(k) == span_of[q])
    return mask


@settings(max_examples=EXAMPLES, deadline=None)
@given(case=packed(), block=st.integers(1, 20), heads=st.integers(1, 2), seed=st.integers(0, 2**16))
def test_blocked_attention_over_the_words_equals_dense_masked_attention_in_float64(case, block, heads, seed):
    segments, spans, causal = case
    bits = token_bits(segments, spans, causal=causal)
    mask = dense_mask(bits, segments)
    assert torch.equal(mask, brute(segments, spans, causal))
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(heads, segments.numel(), 8, generator=g, dtype=torch.float64) for _ in range(3))
    torch.testing.assert_close(
        blocked_attention(q, k, v, bits, segments, block), dense_attention(q, k, v, mask), rtol=0, atol=1e-12
    )
    blocks = -(-segments.numel() // block)
    work = block_workload(bits, segments, block)
    assert len(work) == blocks and all(0 <= w <= blocks for w in work)
    # Every block pair with an allowed query-key pair is computed (and counted in the workload).
    padded = torch.nn.functional.pad(mask, (0, blocks * block - mask.shape[1], 0, blocks * block - mask.shape[0]))
    needed = padded.reshape(blocks, block, blocks, block).any(dim=3).any(dim=1).numpy()
    computed = block_matrix(bits, segments, block)
    assert not (needed & ~computed).any() and list(computed.sum(axis=1)) == work
    # A context-parallel rank's rows: its query blocks only, every key visible, equal to those rows of the whole.
    rows = sorted(set(range(0, blocks, 2)))
    part = blocked_attention(q, k, v, bits, segments, block, rows=rows)
    mine = torch.zeros(segments.numel(), dtype=torch.bool)
    for r in rows:
        mine[r * block : (r + 1) * block] = True
    torch.testing.assert_close(part[:, mine], dense_attention(q, k, v, mask)[:, mine], rtol=0, atol=1e-12)
    assert not part[:, ~mine].any()


def test_packed_samples_and_causal_text_skip_blocks():
    """Four 32-token samples of causal text in 16-token blocks: each query block computes only its own
    sample's blocks at or before it (1 or 2 of 8), not 8."""
    segments = torch.arange(4).repeat_interleave(32)
    bits = token_bits(segments, [])
    assert block_workload(bits, segments, 16) == [1, 2] * 4
    image = token_bits(segments, [(40, 60)])  # an image in sample 1 spanning its two blocks
    assert block_workload(image, segments, 16) == [1, 2, 2, 2, 1, 2, 1, 2]


def test_a_packed_batch_gives_each_image_and_clip_a_span_and_its_text_the_causal_bit():
    from oobleck_mm.config import load_config
    from oobleck_mm.data.build import build_dataset
    from oobleck_mm.data.packing import PackingSpec, pack

    job = load_config(os.path.join(os.path.dirname(__file__), "..", "..", "configs", "tiny_mm_audio.yaml"))
    ds = build_dataset(job)
    samples = [ds[i] for i in range(6)]
    batch = pack(samples, PackingSpec.from_model(job.model), torch.float64, vision_in=192, audio_in=64)
    bits = batch_bits(batch)
    assert bool(((bits & CAUSAL) != 0).all()), "every token of the LLM's sequence is causal"
    media = (bits & ((1 << SPAN_BITS) - 1)) != 0
    placeholder_ids = {3, 4}  # IMAGE, AUDIO: media slots hold their placeholder id
    assert torch.equal(media, torch.tensor([int(t) in placeholder_ids for t in batch.tokens]))
    mask = dense_mask(bits, batch.segments)
    assert torch.equal(mask & ~media[:, None], batch.attention_mask() & ~media[:, None]), "text rows stay causal"
    first = last = int(torch.nonzero(media)[0])
    while last + 1 < bits.numel() and bits[last + 1] == bits[first]:
        last += 1  # the medium's tokens are contiguous
    assert last > first and mask[first, last], "a medium's first token sees its last"
    assert not mask[first, last + 1 :].any(), "nor anything after it (text is causal, samples apart)"


def test_too_many_spans_in_one_sample_is_named():
    segments = torch.zeros(200, dtype=torch.int64)
    with pytest.raises(ValueError, match="more than 62 media spans"):
        token_bits(segments, [(2 * i, 2 * i + 1) for i in range(63)])
