"""Packing without padding: targets, media positions, attention masks; and the pipeline dispatch table."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
from deepspeed.runtime.pipe import schedule as ds

from oobleck_mm.config import load_config
from oobleck_mm.data.loader import TrainingData
from oobleck_mm.data.packing import IGNORE, fold_frames, patchify
from oobleck_mm.data.sample import IMAGE
from oobleck_mm.model.layers import build_layer, model_layer_specs
from oobleck_mm.runtime.engine import execute


WAIT = timedelta(seconds=60)


@pytest.fixture(scope="module")
def job():
    return load_config("configs/tiny_mm.yaml")


@pytest.fixture(scope="module")
def data(job):
    return TrainingData(job)


def test_targets_match_metadata_and_skip_media(data):
    ids = data.global_batch(0)
    batch = data.microbatch(ids)
    assert batch.num_loss_tokens == sum(m.loss_tokens for m in data.metas(ids))
    # no media slot is ever a target; the token after an image is (predicted from the last slot)
    targets = batch.labels[batch.labels != IGNORE]
    assert not (targets == IMAGE).any()
    slots = batch.vision.llm_positions
    assert (batch.tokens[slots] == IMAGE).all()
    after = slots + 1
    after = after[(after < len(batch.tokens)) & ~torch.isin(after, slots)]
    assert (batch.labels[after - 1] == batch.tokens[after]).all()


def test_masks_stay_inside_sample_and_image(data):
    ids = data.global_batch(1)[:4]
    batch = data.microbatch(ids)
    mask = batch.attention_mask()
    seg = batch.segments
    i, j = torch.nonzero(mask, as_tuple=True)
    assert (seg[i] == seg[j]).all() and (j <= i).all()  # causal, within a sample
    assert mask.diagonal().all()
    vm = batch.vision.attention_mask()
    vs = batch.vision.segments
    assert torch.equal(vm, vs[:, None] == vs[None, :])  # bidirectional within each image


@pytest.mark.parametrize("flash", [True, False])
def test_block_attention_equals_attention_under_the_packed_mask(data, flash):
    """Attention per span (what the model runs: the cost is the sum of the spans' squares) computes
    exactly what attention over the whole packed sequence under ``attention_mask`` would."""
    import math

    from oobleck_mm.model.layers import Attention

    torch.manual_seed(0)
    batch = data.microbatch(data.global_batch(3)[:5])
    for tokens, spans, mask, causal in (
        (batch.tokens, batch.spans(), batch.attention_mask(), True),
        (batch.vision.segments, batch.vision.spans(), batch.vision.attention_mask(), False),
    ):
        assert len(spans) > 1 and spans[0][0] == 0 and spans[-1][1] == len(tokens)
        attn = Attention(32, 4, 4, flash).double()
        x = torch.randn(len(tokens), 32, dtype=torch.float64)
        got = attn(x, spans, causal, None)
        t, h, d = len(tokens), 4, 8
        q, k, v = (proj(x).view(t, h, d).transpose(0, 1) for proj in (attn.q, attn.k, attn.v))
        scores = (q @ k.transpose(-1, -2) / math.sqrt(d)).masked_fill(~mask, float("-inf"))
        dense = attn.o((scores.softmax(-1) @ v).transpose(0, 1).reshape(t, -1))
        torch.testing.assert_close(got, dense, rtol=1e-12, atol=1e-12)


def test_media_slots_equal_projected_tokens(job, data):
    ids = data.global_batch(2)
    batch = data.microbatch(ids)
    metas = data.metas(ids)
    patches = sum(sum(m.image_patches(job.model.vision.patch_size)) for m in metas)
    assert batch.vision.features.shape[0] == patches == len(batch.vision.llm_positions)
    assert len(batch.tokens) == sum(m.llm_tokens(job.model.vision.patch_size) for m in metas)


def assert_layout_is_the_packed_batch_without_media(data, ids) -> None:
    """``microbatch(ids, media=False)`` (what a stage without an encoder input layer packs, without pixels or
    frames) is ``microbatch(ids)`` field for field, each medium's ``features`` ``[tokens, 0]``."""
    whole, layout = data.microbatch(ids), data.microbatch(ids, media=False)
    for name in ("tokens", "labels", "positions", "segments"):
        assert torch.equal(getattr(layout, name), getattr(whole, name)), name
    assert layout.spans() == whole.spans() and layout.sample_ids == whole.sample_ids
    for modality in ("vision", "audio"):
        got, want = layout.encoder(modality), whole.encoder(modality)
        assert (got is None) == (want is None), modality
        if want is None:
            continue
        for name in ("grid", "segments", "llm_positions"):
            assert torch.equal(getattr(got, name), getattr(want, name)), (modality, name)
        assert got.features.shape == (want.features.shape[0], 0), modality
        assert got.spans() == want.spans()


@pytest.mark.parametrize("config", ["configs/tiny_mm.yaml", "configs/tiny_mm_audio.yaml"])
def test_a_stage_without_encoder_inputs_packs_the_layout_alone(config):
    """Stages after the encoders' input layers pack the layout from the samples' metadata: nothing renders
    the synthetic images or clips (``SyntheticDataset.layout``), and the rest is the whole batch."""
    data = TrainingData(load_config(config))
    batches = [data.global_batch(step)[:4] for step in range(3)]
    metas = [m for ids in batches for m in data.metas(ids)]
    assert any(m.num_images for m in metas) and any(not m.num_images for m in metas)
    assert any(m.num_audio for m in metas) == data.spec.has_audio
    for ids in batches:
        assert_layout_is_the_packed_batch_without_media(data, ids)
    rendered = []
    data.dataset._render_image = rendered.append
    for ids in batches:
        data.microbatch(ids, media=False)
    assert not rendered


def test_patchify_and_fold_invert():
    img = torch.rand(3, 16, 24)
    patches, grid = patchify(img, 8)
    assert patches.shape == (6, 3 * 64) and grid.tolist()[:4] == [[0, 0], [0, 1], [0, 2], [1, 0]]
    assert torch.equal(patches[4].view(3, 8, 8), img[:, 8:16, 8:16])
    with pytest.raises(ValueError, match="patch size 5"):
        patchify(img, 5)
    clip = torch.rand(10, 4)
    folded, _ = fold_frames(clip, 2)
    assert torch.equal(folded[1], clip[2:4].reshape(-1))


def test_training_batches_are_skewed(job, data):
    """The equivalence tests' batches have text-only samples and several resolutions in one microbatch."""
    metas = [m for s in range(5) for m in data.metas(data.global_batch(s))]
    assert any(m.num_images == 0 for m in metas)
    assert len({size for m in metas for size in m.image_sizes}) >= 3
    assert len({m.llm_tokens(job.model.vision.patch_size) for m in metas}) >= 10


def test_microbatch_without_images_runs_the_encoder(job, data):
    specs = model_layer_specs(job)
    text_only = [m.index for m in (data.dataset.meta(i) for i in range(200)) if m.num_images == 0][:2]
    batch = data.microbatch(text_only)
    assert batch.vision.features.shape[0] == 0
    acts = ()
    for i in range(len(specs)):
        acts = build_layer(job, i, specs)(acts, batch)
    assert acts[0].shape == (len(batch.tokens), job.model.llm.vocab_size)


def test_dispatch_table_raises_on_unknown_instruction():
    seen = []
    table = {ds.ForwardPass: seen.append, ds.BackwardPass: seen.append}
    assert execute([[ds.ForwardPass(0)], [ds.BackwardPass(0)]], table) == 2
    with pytest.raises(RuntimeError, match="no handler for pipeline instruction.*SendGrad"):
        execute([[ds.ForwardPass(0), ds.SendGrad(1)]], table)
