"""Cost model of the balancer: NNLS, robust fitting, profile-derived shape, and sample features."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from oobleck_mm.balance.cost_model import TERMS, CostCoefficients, CostModel, StageTiming
from oobleck_mm.balance.nnls import nnls, robust_nnls
from oobleck_mm.balance.work import F, NUM_FEATURES, microbatch_features, sample_features
from oobleck_mm.config import load_config
from oobleck_mm.data.dataset import ModelInputs
from oobleck_mm.data.sample import SampleMeta
from oobleck_mm.config.shape import layer_specs
from oobleck_mm.planning.costs import effective_layers
from oobleck_mm.profiling.analytical import profile_from_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.fixture(scope="module")
def job():
    return load_config(CONFIGS / "tiny_mm_audio.yaml")


@pytest.fixture(scope="module")
def model(job):
    return CostModel.from_profile(profile_from_config(job), layer_specs(job.model, job.data))


@pytest.fixture(scope="module")
def dims(job):
    return ModelInputs.from_model(job.model)


@pytest.fixture(scope="module")
def big():
    """MLLM-10B: images of up to 4096 patches and long texts, where attention is a real share of the time."""
    job = load_config(CONFIGS / "mllm_10b.yaml")
    return CostModel.from_profile(profile_from_config(job), layer_specs(job.model, job.data)), ModelInputs.from_model(
        job.model
    )


def random_metas(rng, num, dims, max_side=32, max_text=120, max_clip_units=20):
    unit = dims.patch_size
    metas = []
    for i in range(num):
        images = int(rng.integers(0, 4))
        sides = rng.integers(2, max_side // unit + 1, size=(images, 2)) * unit
        step = dims.audio_downsample * dims.audio_merge
        clips = (int(rng.integers(1, max_clip_units)) * step,) if rng.random() < 0.6 else ()
        text = int(rng.integers(4, max_text))
        metas.append(SampleMeta(i, text + images + len(clips), tuple(map(tuple, sides.tolist())), clips))
    return metas


# ---------------------------------------------------------------------- NNLS


def test_nnls_satisfies_the_kkt_conditions():
    """Optimality without a reference solver: x >= 0, gradient <= 0 where x = 0 and = 0 where x > 0."""
    rng = np.random.default_rng(0)
    for _ in range(200):
        m, n = int(rng.integers(2, 30)), int(rng.integers(1, 9))
        a, b = rng.normal(size=(m, n)), rng.normal(size=m)
        x = nnls(a, b)
        grad = a.T @ (b - a @ x)
        tol = 1e-9 * (1 + np.abs(a).sum() * np.abs(b).sum())
        assert (x >= 0).all()
        assert (grad[x == 0] <= tol).all()
        assert np.abs(grad[x > 0]).max(initial=0) <= tol


def test_nnls_matches_scipy_where_available():
    optimize = pytest.importorskip("scipy.optimize")
    rng = np.random.default_rng(1)
    for _ in range(50):
        a, b = rng.normal(size=(20, 6)), rng.normal(size=20)
        assert np.linalg.norm(a @ nnls(a, b) - b) == pytest.approx(np.linalg.norm(a @ optimize.nnls(a, b)[0] - b))


def test_robust_nnls_ignores_gross_outliers_that_pull_plain_nnls_off():
    rng = np.random.default_rng(2)
    truth = np.array([2.0, 0.5, 0.0, 3.0])
    a = rng.uniform(0, 1, size=(200, 4))
    b = a @ truth * rng.lognormal(0, 0.01, 200)
    bad = rng.choice(200, 20, replace=False)
    b[bad] *= rng.uniform(3, 6, 20)
    plain = nnls(a, b)
    robust, weights = robust_nnls(a, b)
    assert np.abs(robust - truth).max() < 0.05
    assert np.abs(plain - truth).max() > 0.2
    assert (weights[bad] == 0).mean() > 0.9  # the outliers are rejected, not just down-weighted


# ---------------------------------------------------------------------- the model


def test_full_model_prediction_reproduces_the_profile_for_the_profiled_sample(job, model):
    """The per-token split of each layer's profiled time must add back up to that time."""
    profile = profile_from_config(job)
    specs = layer_specs(job.model, job.data)
    b = profile.microbatch_size
    x = np.zeros(NUM_FEATURES)
    by_name = {s.name: s for s in specs}
    x[F["vision_patches"]] = b * by_name["vision.block0"].tokens_per_sample
    x[F["vision_patches_sq"]] = b * by_name["vision.block0"].tokens_per_sample * by_name["vision.block0"].attention_len
    x[F["vision_tokens"]] = b * by_name["vision.projector"].tokens_per_sample
    x[F["audio_tokens_enc"]] = b * by_name["audio.block0"].tokens_per_sample
    x[F["audio_tokens_enc_sq"]] = b * by_name["audio.block0"].tokens_per_sample * by_name["audio.block0"].attention_len
    x[F["audio_tokens"]] = b * by_name["audio.projector"].tokens_per_sample
    x[F["llm_tokens"]] = b * by_name["llm.block0"].tokens_per_sample
    x[F["llm_tokens_sq"]] = b * by_name["llm.block0"].tokens_per_sample ** 2
    x[F["microbatch"]] = 1
    total = sum(layer.forward_s + layer.backward_s for layer in effective_layers(profile))
    predicted = model.predict(CostCoefficients.initial(), 0, model.num_layers, x)
    assert predicted == pytest.approx(total, rel=1e-9)


def test_stage_vectors_add_up_over_any_cut(model):
    c = CostCoefficients.initial(1e-5)
    whole = model.stage_vector(c, 0, model.num_layers)
    cut = model.num_layers // 3
    parts = model.stage_vector(c, 0, cut) + model.stage_vector(c, cut, model.num_layers)
    assert np.allclose(whole, parts, rtol=1e-12)
    assert whole[F["microbatch"]] == pytest.approx(model.num_layers * 1e-5)


# Every term is a visible share of some stage times (a fixed cost of ~1 ms a layer, attention
# up to half of a long sample's time): what a term never contributes cannot be measured.
TRUE_SCALES = {
    "vision.fixed": 1e-3,
    "vision.linear": 1.6,
    "vision.quadratic": 2.0,
    "audio.fixed": 5e-4,
    "audio.linear": 0.8,
    "audio.quadratic": 2.5,
    "text.fixed": 2e-3,
    "text.linear": 1.3,
    "text.quadratic": 3.0,
}


def synthetic_timings(model, dims, rng, num, truth, noise=0.03, outliers=0.1):
    metas = random_metas(rng, 400, dims, max_side=896, max_text=4096, max_clip_units=1500)
    features = sample_features(metas, dims)
    timings = []
    for _ in range(num):
        rows = rng.choice(len(metas), int(rng.integers(1, 5)), replace=False)
        x = microbatch_features(features[rows])
        start = int(rng.integers(0, model.num_layers - 1))
        end = int(rng.integers(start + 1, model.num_layers + 1))
        seconds = float(model.predict(truth, start, end, x)) * rng.lognormal(0, noise)
        stalled, slowdown = rng.random() < outliers, rng.uniform(2, 5)  # drawn always: same data either way
        if stalled:
            seconds *= slowdown  # a stall: GC pause, a straggling peer, page faults
        timings.append(StageTiming(start, end, tuple(x), seconds))
    return timings


def test_fit_recovers_known_coefficients_from_noisy_timings_with_outliers(big):
    model, dims = big
    truth = CostCoefficients(tuple(TRUE_SCALES[t] for t in TERMS))
    dirty = synthetic_timings(model, dims, np.random.default_rng(4), 1000, truth, noise=0.02, outliers=0.1)
    clean = synthetic_timings(model, dims, np.random.default_rng(4), 1000, truth, noise=0.02, outliers=0.0)
    fitted = model.fit(CostCoefficients.initial(), dirty)
    assert fitted.num_observations == 1000
    for term in TERMS:
        # 15 %: vision's quadratic and linear terms are partly collinear in any batch (each
        # image adds both), so even outlier-free data pins it no better than that.
        assert fitted.scale(term) == pytest.approx(truth.scale(term), rel=0.15), term
    # The outliers (10 % of rows, 2-5x slow) change nothing: same fit as without them.
    without = model.fit(CostCoefficients.initial(), clean)
    assert np.allclose(fitted.scales, without.scales, rtol=0.03)
    # What matters to the balancer: predictions on stages and microbatches never measured.
    fresh = synthetic_timings(model, dims, np.random.default_rng(5), 200, truth, noise=0.0, outliers=0.0)
    errors = [
        abs(model.predict(fitted, t.layer_start, t.layer_end, np.array(t.features)) / t.seconds - 1) for t in fresh
    ]
    assert np.median(errors) < 0.01 and max(errors) < 0.05


def test_fit_keeps_terms_the_timings_do_not_exercise(big):
    model, dims = big
    """A batch without audio cannot say anything about audio: those scales keep the prior."""
    rng = np.random.default_rng(6)
    truth = CostCoefficients(tuple(TRUE_SCALES[t] for t in TERMS))
    timings = [t for t in synthetic_timings(model, dims, rng, 300, truth, outliers=0.0)]
    no_audio = [
        replace(
            t,
            features=tuple(
                0.0 if i in (F["audio_tokens_enc"], F["audio_tokens_enc_sq"], F["audio_tokens"]) else v
                for i, v in enumerate(t.features)
            ),
        )
        for t in timings
    ]
    prior = CostCoefficients.initial()
    fitted = model.fit(prior, no_audio)
    assert fitted.scale("audio.linear") == prior.scale("audio.linear")
    assert fitted.scale("audio.quadratic") == prior.scale("audio.quadratic")


def test_coefficients_validate_and_round_trip():
    c = CostCoefficients(tuple(TRUE_SCALES[t] for t in TERMS), num_observations=7)
    assert CostCoefficients.from_dict(c.to_dict()) == c
    with pytest.raises(ValueError, match="scales must have 9 entries"):
        CostCoefficients((1.0,))
    with pytest.raises(ValueError, match=r"scales\[text.linear\]"):
        CostCoefficients(tuple(-1.0 if t == "text.linear" else 1.0 for t in TERMS))
    with pytest.raises(ValueError, match="unknown terms"):
        CostCoefficients.from_dict({"scales": {"video.linear": 1.0}})


def test_model_rejects_a_profile_of_another_model(job, model):
    profile = profile_from_config(job)
    with pytest.raises(ValueError, match="do not match"):
        CostModel.from_profile(profile, layer_specs(job.model, job.data)[1:])
    with pytest.raises(ValueError, match="stage layers"):
        model.design(3, 3)


# ---------------------------------------------------------------------- features


def test_features_follow_sample_metadata(dims):
    meta = SampleMeta(0, text_tokens=20, image_sizes=((16, 24), (32, 32)), audio_frames=(dims.audio_downsample * 8,))
    row = sample_features([meta], dims)[0]
    p = dims.patch_size
    patches = [(16 // p) * (24 // p), (32 // p) ** 2]
    assert row[F["vision_patches"]] == sum(patches)
    assert row[F["vision_patches_sq"]] == sum(x * x for x in patches)
    assert row[F["audio_tokens_enc"]] == 8
    assert row[F["llm_tokens"]] == meta.llm_tokens(p, dims.image_merge, dims.audio_downsample, dims.audio_merge)
    assert row[F["llm_tokens_sq"]] == row[F["llm_tokens"]] ** 2
    assert row[F["microbatch"]] == 0 and microbatch_features(np.stack([row, row]))[F["microbatch"]] == 1
