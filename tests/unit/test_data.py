"""Datasets: metadata equals the loaded sample, text follows the media, skew, limits, LLaVA reader."""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import statistics

import pytest
import torch
import yaml
from PIL import Image

from oobleck_mm.config import config_from_dict
from oobleck_mm.data.dataset import Dataset, ModelInputs
from oobleck_mm.data.loader import build_dataset
from oobleck_mm.data.llava import LlavaJsonDataset
from oobleck_mm.data.sample import AUDIO, BOS, EOS, IMAGE, NUM_SPECIAL_TOKENS, PAD
from oobleck_mm.data.synthetic import COLOURS, NOTES, SyntheticDataset
from oobleck_mm.data.tokenizer import decode, encode, num_tokens

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIXTURE = os.path.join(ROOT, "tests", "fixtures", "llava")


def job_dict(config: str = "tiny_mm", **data) -> dict:
    with open(os.path.join(ROOT, "configs", f"{config}.yaml"), encoding="utf-8") as fh:
        raw = yaml.safe_load(fh)
    raw["data"].update(data)
    return raw


def dataset(config: str = "tiny_mm", **data) -> Dataset:
    return build_dataset(config_from_dict(job_dict(config, **data)))


def check_sample_matches_meta(ds, index: int) -> None:
    inputs: ModelInputs = ds.inputs
    meta, sample = ds.meta(index), ds[index]
    assert sample.meta == meta and meta.index == index
    tokens = sample.tokens
    assert tokens.dtype == torch.int64 and tokens.shape == (meta.text_tokens,)
    assert tokens[0] == BOS and tokens[-1] == EOS and not (tokens == PAD).any()
    assert int((tokens == IMAGE).sum()) == meta.num_images and int((tokens == AUDIO).sum()) == meta.num_audio
    assert int(tokens.max()) < inputs.vocab_size and meta.loss_tokens >= (1 if ds.data.loss_on == "all" else 0)
    assert [tuple(im.shape) for im in sample.images] == [(inputs.in_channels, h, w) for h, w in meta.image_sizes]
    assert all(h % inputs.patch_size == 0 and w % inputs.patch_size == 0 for h, w in meta.image_sizes)
    assert all(im.dtype == torch.float32 and 0 <= im.min() and im.max() <= 1 for im in sample.images)
    assert [tuple(a.shape) for a in sample.audio] == [(f, inputs.mel_bins) for f in meta.audio_frames]
    assert all(f % inputs.frames_unit == 0 and f > 0 for f in meta.audio_frames)
    assert inputs.llm_tokens(meta) <= ds.data.max_seq_len


@pytest.mark.parametrize("config", ["tiny_mm", "tiny_mm_audio"])
def test_metadata_equals_the_loaded_sample(config):
    ds = dataset(config)
    assert isinstance(ds, Dataset) and len(ds) == 4096
    for index in range(0, 4096, 13):
        check_sample_matches_meta(ds, index)


def test_samples_depend_only_on_seed_and_index():
    a, b = dataset(), dataset()
    order = [5, 900, 3, 5, 4095]
    for i, j in zip(order, reversed(order)):  # different call orders, separate objects
        a.meta(i)
        b[j]
    for i in order:
        x, y = a[i], b[i]
        assert x.meta == y.meta and torch.equal(x.tokens, y.tokens)
        assert all(torch.equal(p, q) for p, q in zip(x.images, y.images))
    other = dataset(seed=1)
    assert [other.meta(i) for i in range(20)] != [a.meta(i) for i in range(20)]


def segments(tokens: torch.Tensor) -> list[tuple[int, str]]:
    """(placeholder, the text after it up to the next placeholder or EOS)."""
    out, text = [], []
    for t in tokens.tolist()[1:]:
        if t in (IMAGE, AUDIO, EOS):
            if out:
                out[-1] = (out[-1][0], decode(text))
            text = []
            out.append((t, ""))
        else:
            text.append(t)
    return out[:-1]  # drop EOS


def colours_in(image: torch.Tensor) -> set[str]:
    return {
        name for name, rgb in COLOURS.items() if ((image - torch.tensor(rgb)[:, None, None]).abs().amax(0) < 1e-6).any()
    }


def test_captions_name_the_colours_drawn_and_the_tone_played():
    ds = dataset("tiny_mm_audio", mean_text_tokens=64)  # long enough for whole captions
    complete = 0
    bands: dict[str, set[int]] = {}
    for index in range(300):
        sample = ds[index]
        images, clips = iter(sample.images), iter(sample.audio)
        for placeholder, text in segments(sample.tokens):
            if placeholder == AUDIO:
                note = re.match(r"tone (\w)\.", text)
                if note:
                    bands.setdefault(note.group(1), set()).add(int(next(clips).mean(0).argmax()))
                continue
            image = next(images)
            caption = text.split(".")[0]
            named = set(re.findall(r"\b(" + "|".join(COLOURS) + r") ", caption + " "))
            assert named <= colours_in(image), (index, text)
            if "." in text:  # whole caption: it names every colour in the picture
                assert named == colours_in(image), (index, text)
                complete += 1
    assert complete >= 100
    assert set(bands) == set(NOTES) and all(len(b) == 1 for b in bands.values())
    assert len({b for bs in bands.values() for b in bs}) == len(NOTES)  # each note its own pitch


def test_samples_are_skewed_like_real_data():
    ds = dataset()
    metas = [ds.meta(i) for i in range(2000)]
    counts = [m.num_images for m in metas]
    assert 0.2 < counts.count(0) / len(counts) < 0.4  # binomial(3, 1/3): 30% without images
    assert max(counts) == 3 and abs(statistics.mean(counts) - 1.0) < 0.1
    sizes = [s for m in metas for s in m.image_sizes]
    assert {h for h, _ in sizes} == {w for _, w in sizes} == {16, 24, 32}
    assert sum(h != w for h, w in sizes) > len(sizes) / 2
    text = [m.text_tokens - m.num_images for m in metas]
    assert max(text) / statistics.median(text) >= 3
    assert abs(statistics.mean(text) - 16) < 2  # the planner's mean_text_tokens holds


@pytest.mark.parametrize("config,max_seq_len", [("tiny_mm", 36), ("tiny_mm", 128), ("tiny_mm_audio", 48)])
def test_no_sample_exceeds_max_seq_len(config, max_seq_len):
    ds = dataset(config, max_seq_len=max_seq_len, mean_text_tokens=12)
    lengths = [ds.inputs.llm_tokens(ds.meta(i)) for i in range(1500)]
    assert max(lengths) <= max_seq_len
    assert max(lengths) == max_seq_len  # the long tail reaches the limit and is cut there
    for i in range(0, 1500, 50):
        check_sample_matches_meta(ds, i)


def test_a_limit_no_image_fits_is_refused():
    with pytest.raises(ValueError, match=r"data.max_seq_len \(10\).*32x32 \(16 tokens\).*at least 18"):
        dataset(max_seq_len=10, mean_text_tokens=4, mean_images_per_sample=0.1, min_image_size=32)


def test_text_only_model_gets_text_only_samples():
    raw = job_dict(mean_images_per_sample=0)
    del raw["model"]["vision"]
    ds = build_dataset(config_from_dict(raw))
    metas = [ds.meta(i) for i in range(200)]
    assert all(m.num_images == 0 and m.num_audio == 0 for m in metas)
    long = [decode(ds[m.index].tokens) for m in metas if m.text_tokens > 24]
    assert len(long) > 20
    for text in long:  # counting from a random start: learnable once the start is seen
        start, *numbers = re.match(r"<bos>count (\d+):((?: \d+)*)", text).group(1, 2)
        numbers = numbers[0].split()[:-1]  # the last may be cut short
        assert numbers == [str(int(start) + k) for k in range(len(numbers))], text


# --------------------------------------------------------------------------- tokenizer


def test_tokenizer_round_trips_and_guards_the_vocabulary():
    text = "human: <what> is 2+2?\n"
    ids = encode(text, 256)
    assert len(ids) == num_tokens(text) and min(ids) >= NUM_SPECIAL_TOKENS
    assert decode([BOS, IMAGE, *ids, AUDIO, EOS]) == f"<bos><image>{text}<audio><eos>"
    assert encode("é!", 133) == encode("??!", 133) and len(encode("é!", 261)) == num_tokens("é!") == 3
    assert decode(encode("é", 261)) == "é"
    with pytest.raises(ValueError, match=r"vocab_size \(132\).*>= 133"):
        encode("a", 132)


# --------------------------------------------------------------------------- LLaVA


def llava(path: str = os.path.join(FIXTURE, "llava.json"), **data) -> LlavaJsonDataset:
    return dataset(kind="llava_json", path=path, **data)


def test_llava_fixture_reads_sizes_text_and_pixels():
    ds = llava()
    assert len(ds) == 3 and [ds.sample_id(i) for i in range(3)] == ["shape-1", "text-only", "shape-pair"]
    # 30x20 and 20x30 px files: whole 8 px patches, longer side <= 32.
    assert [ds.meta(i).image_sizes for i in range(3)] == [((16, 24),), (), ((24, 16), (16, 24))]
    for i in range(3):
        check_sample_matches_meta(ds, i)
    assert decode(ds[0].tokens) == "<bos>human: <image>\nWhat is in the picture?\ngpt: A red square.\n<eos>"
    assert decode(ds[2].tokens).startswith("<bos>human: <image>\n<image>\nName both shapes.")
    red = ds[0].images[0][:, 8, 12]  # the middle of the red square
    assert red[0] > 0.8 and red[1] < 0.2 and red[2] < 0.2


def test_llava_downscales_and_truncates_text_to_the_limits():
    ds = llava(image_size=16, max_seq_len=32, mean_text_tokens=8)
    assert ds.meta(0).image_sizes == ((8, 16),)  # 20x30 scaled by 16/30, whole patches
    for i in range(3):
        check_sample_matches_meta(ds, i)
        assert ds.inputs.llm_tokens(ds.meta(i)) <= 32
    assert ds.meta(1).text_tokens == 32  # the long conversation is cut to fit, placeholders kept
    assert int((ds[2].tokens == IMAGE).sum()) == 2


def test_llava_images_resolve_against_image_dir(tmp_path):
    shutil.copy(os.path.join(FIXTURE, "llava.json"), tmp_path / "llava.json")
    (tmp_path / "elsewhere").mkdir()
    ds = llava(str(tmp_path / "llava.json"), image_dir=FIXTURE)
    assert ds.meta(2).image_sizes == ((24, 16), (16, 24))
    shutil.copytree(os.path.join(FIXTURE, "images"), tmp_path / "elsewhere" / "images")
    relative = llava(str(tmp_path / "llava.json"), image_dir="elsewhere")
    assert torch.equal(relative[0].images[0], ds[0].images[0])


def test_an_image_shared_by_several_samples_has_its_header_read_once(tmp_path, monkeypatch):
    """Reading headers is half of building the byte-level records (36 s a rank at 665k); LLaVA's mixes hold
    several conversations per image. The sizes stay each sample's own (another file, another size)."""
    from oobleck_mm.data import llava as llava_module

    samples = [
        {
            "id": f"s{i}",
            "image": "images/red_square.png" if i % 3 else "images/blue_circle.png",
            "conversations": GOOD_TURNS,
        }
        for i in range(9)
    ]
    path = tmp_path / "shared.json"
    path.write_text(json.dumps(samples))
    opened = []
    real_open = llava_module.Image.open
    monkeypatch.setattr(llava_module.Image, "open", lambda p, *a, **k: opened.append(p) or real_open(p, *a, **k))
    ds = llava(str(path), image_dir=FIXTURE)
    assert sorted(opened) == sorted({os.path.join(FIXTURE, "images", n) for n in ("red_square.png", "blue_circle.png")})
    uncached = llava()  # the fixture's own samples, for the files' sizes
    red, blue = uncached.meta(0).image_sizes[0], uncached.meta(2).image_sizes[0]  # (16, 24), (24, 16)
    assert [ds.meta(i).image_sizes for i in range(9)] == [((blue if i % 3 == 0 else red),) for i in range(9)]
    assert ds._header_sizes == {}  # not kept past the build


def write_samples(tmp_path, samples) -> str:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(samples))
    return str(path)


GOOD_TURNS = [{"from": "human", "value": "<image>\nWhat?"}, {"from": "gpt", "value": "A shape."}]


@pytest.mark.parametrize(
    "sample,message",
    [
        ({"id": "s7", "image": "missing.png", "conversations": GOOD_TURNS}, "sample 's7': cannot read image"),
        ({"id": "s8", "conversations": GOOD_TURNS}, "sample 's8' has 1 '<image>' markers but 0 images"),
        ({"id": "s9", "image": ["images/red_square.png"] * 2, "conversations": GOOD_TURNS}, "sample 's9' has 1"),
        ({"id": "s10", "conversations": [{"from": "human"}]}, "sample 's10': conversations\\[0\\] must be"),
        ({"id": "s11", "image": 3, "conversations": GOOD_TURNS}, "sample 's11': 'image' must be a path"),
        ({"id": "big", "image": "big.png", "conversations": GOOD_TURNS}, r"sample 'big'.*64 LLM tokens.*\(32\)"),
    ],
)
def test_bad_llava_records_name_the_sample(tmp_path, sample, message):
    shutil.copytree(os.path.join(FIXTURE, "images"), tmp_path / "images")
    Image.new("RGB", (64, 64)).save(tmp_path / "big.png")
    good = {"id": "ok", "image": "images/red_square.png", "conversations": copy.deepcopy(GOOD_TURNS)}
    path = write_samples(tmp_path, [good, sample])
    with pytest.raises(ValueError, match=message):
        llava(path, image_size=64, max_seq_len=32, mean_images_per_sample=0.1)


def test_bad_llava_samples_are_left_out_with_skip_bad_samples_and_the_batches_never_draw_them(tmp_path):
    from oobleck_mm.data.check import check_samples
    from oobleck_mm.data.loader import TrainingData

    shutil.copytree(os.path.join(FIXTURE, "images"), tmp_path / "images")
    data = (tmp_path / "images" / "red_square.png").read_bytes()
    (tmp_path / "images" / "cut.png").write_bytes(data[: len(data) // 2])  # its header reads, its pixels do not
    good = [{"id": f"ok{k}", "image": "images/red_square.png", "conversations": GOOD_TURNS} for k in range(10)]
    samples = (
        good[:2]
        + [{"id": "gone", "image": "missing.png", "conversations": GOOD_TURNS}]
        + good[2:5]
        + [{"id": "cut", "image": "images/cut.png", "conversations": GOOD_TURNS}]
        + good[5:]
    )
    path = write_samples(tmp_path, samples)
    raw = job_dict(kind="llava_json", path=path, image_size=64, max_seq_len=64, mean_images_per_sample=1)
    raw["training"].update(global_batch=4, microbatch_size=2)
    # Without skip_bad_samples: both in one refusal (issue 30: one per launch before), the flag suggested.
    with pytest.raises(
        ValueError,
        match=r"(?s)2 bad samples.*#2: .*sample 'gone': cannot read image.*#6: .*sample "
        r"'cut': cannot decode image .*cut.png.*--skip-bad-samples",
    ):
        check_samples(config_from_dict(raw), progress=lambda line: None)
    raw["data"]["excluded_samples"] = [2]
    with pytest.raises(
        ValueError,
        match=r"sample 'cut': cannot decode image .*cut.png.* \(sample #6\); "
        r"data.skip_bad_samples: true \(or --skip-bad-samples\) leaves it out",
    ):
        check_samples(config_from_dict(raw), progress=lambda line: None)
    raw["data"].update(excluded_samples=[], skip_bad_samples=True)
    job, lines = config_from_dict(raw), []
    bad = check_samples(job, progress=lines.append)
    assert [b.position for b in bad] == [2, 6] and job.data.excluded_samples == (2, 6)
    assert any("left out sample #6" in line and "cut.png" in line for line in lines), lines
    # What the workers build from the master's config: the same 10 good samples, every batch full.
    training = TrainingData(config_from_dict(job.to_dict()))
    assert len(training.dataset) == 10
    for step in range(training.sampler.steps_per_epoch * 3):
        ids = training.global_batch(step)
        assert len(ids) == 4 and {training.dataset.meta(i).index for i in ids}.isdisjoint({2, 6})
    raw["data"]["excluded_samples"] = [12]
    with pytest.raises(ValueError, match=r"data.excluded_samples: position 12 is past the end .*0..11"):
        build_dataset(config_from_dict(raw))


def test_too_few_good_samples_for_a_global_batch_are_refused(tmp_path):
    from oobleck_mm.data.check import check_samples

    shutil.copytree(os.path.join(FIXTURE, "images"), tmp_path / "images")
    samples = [
        {"id": f"s{k}", "image": "images/red_square.png" if k < 3 else "missing.png", "conversations": GOOD_TURNS}
        for k in range(6)
    ]
    raw = job_dict(
        kind="llava_json",
        path=write_samples(tmp_path, samples),
        image_size=64,
        max_seq_len=64,
        mean_images_per_sample=1,
        skip_bad_samples=True,
    )
    raw["training"].update(global_batch=4, microbatch_size=2)
    with pytest.raises(ValueError, match=r"3 good samples left, fewer than training.global_batch \(4\)"):
        check_samples(config_from_dict(raw), progress=lambda line: None)


def test_llava_images_need_a_vision_model(tmp_path):
    raw = job_dict(kind="llava_json", path=os.path.join(FIXTURE, "llava.json"), mean_images_per_sample=0)
    del raw["model"]["vision"]
    with pytest.raises(ValueError, match="sample 'shape-1' has 1 images but the model has no vision encoder"):
        build_dataset(config_from_dict(raw))


def test_synthetic_dataset_is_what_build_dataset_gives():
    assert isinstance(dataset(), SyntheticDataset) and isinstance(llava(), LlavaJsonDataset)


# --------------------------------------------------------------------------- config fields of the data


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("num_samples", 0, "data.num_samples: must be >= 1, got 0"),
        ("text_length_sigma", -0.5, "data.text_length_sigma: must be >= 0.0, got -0.5"),
        ("max_images_per_sample", 0, r"data.max_images_per_sample \(0\) must be >= 1 and >= .*\(1.0\)"),
        ("min_image_size", 40, r"data.min_image_size \(40\) must be <= data.image_size \(32\)"),
        ("image_dir", "no/such/folder", "data.image_dir: folder .*no/such/folder' does not exist"),
    ],
)
def test_data_config_errors_name_the_field(field, value, message):
    raw = job_dict(**{field: value})
    if field == "image_dir":
        raw["data"].update(kind="llava_json", path=os.path.join(FIXTURE, "llava.json"))
    with pytest.raises(ValueError, match=message):
        config_from_dict(raw)


def test_llava_loss_covers_the_assistants_answers_by_default():
    from oobleck_mm.data.packing import PackingSpec, pack

    ds, everything = llava(), llava(loss_on="all")
    spec = PackingSpec(patch_size=8, has_vision=True)
    # "gpt: A red square.\n<eos>": the answer, its newline and the EOS after it
    assert ds.meta(0).loss_tokens == len("A red square.\n") + 1
    assert everything.meta(0).loss_tokens == everything.meta(0).text_tokens - 1 - 1
    for d in (ds, everything):
        for i in range(len(d)):
            batch = pack([d[i]], spec, vision_in=3 * 8 * 8)
            assert batch.num_loss_tokens == d.meta(i).loss_tokens  # the normaliser counts what is trained
    batch = pack([ds[0]], spec, vision_in=3 * 8 * 8)
    targets = batch.labels[batch.labels != -100].tolist()
    assert decode(targets) == "A red square.\n<eos>"


def test_llava_answer_cut_off_by_max_seq_len_trains_on_nothing(tmp_path):
    turns = [{"from": "human", "value": "x" * 40}, {"from": "gpt", "value": "late"}]
    ok = [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]
    path = write_samples(tmp_path, [{"id": "long", "conversations": turns}, {"id": "ok", "conversations": ok}])
    ds = llava(path, max_seq_len=32, mean_images_per_sample=0.1)
    assert ds.meta(0).loss_tokens == 0 and ds.meta(1).loss_tokens == 3  # "a\n" and the EOS


def _measured_job(path: str, **data):
    raw = job_dict(kind="llava_json", path=path, **data)
    for key in ("mean_text_tokens", "mean_images_per_sample", "max_images_per_sample"):
        if key not in data:
            raw["data"].pop(key, None)
    raw["training"].update(global_batch=2, microbatch_size=1)
    return config_from_dict(raw)


def test_a_llava_json_jobs_planning_shape_is_measured_over_its_samples_by_the_masters_check():
    """Issue 30 item 4: a user never types what the engine can read. A llava_json job that does not give
    its means has them measured by the check the master runs before it plans (every rank then gets the
    job with them); a mean the user gave is kept."""
    from oobleck_mm.config.shape import layer_specs, sequence_tokens
    from oobleck_mm.data.check import check_samples

    path = os.path.join(FIXTURE, "llava.json")
    job = _measured_job(path)
    assert job.data.mean_text_tokens is None and job.data.mean_images_per_sample is None
    with pytest.raises(ValueError, match=r"data\.mean_text_tokens: not known yet: the master measures it"):
        sequence_tokens(job.model, job.data)
    lines = []
    check_samples(job, progress=lines.append)
    metas = [llava(path).meta(i) for i in range(3)]  # images 1, 0 and 2
    assert job.data.mean_images_per_sample == pytest.approx(1.0)
    text = [m.text_tokens - m.num_images for m in metas]
    assert job.data.mean_text_tokens == pytest.approx(sum(text) / 3, abs=1e-3)
    assert any("measured over 3 samples" in line and "data.mean_text_tokens" in line for line in lines), lines
    assert sequence_tokens(job.model, job.data).text == job.data.mean_text_tokens and layer_specs(job.model, job.data)
    # The job as shipped to the workers (and read back by a resume) carries the numbers.
    again = config_from_dict(job.to_dict())
    assert (again.data.mean_text_tokens, again.data.mean_images_per_sample) == (job.data.mean_text_tokens, 1.0)
    given = _measured_job(path, mean_text_tokens=50)
    check_samples(given, progress=lambda line: None)
    assert given.data.mean_text_tokens == 50 and given.data.mean_images_per_sample == pytest.approx(1.0)


def test_a_vision_model_over_data_without_images_is_refused_once_measured(tmp_path):
    from oobleck_mm.data.check import check_samples

    samples = [
        {"id": f"t{k}", "conversations": [{"from": "human", "value": "Hi?"}, {"from": "gpt", "value": "Hello."}]}
        for k in range(3)
    ]
    job = _measured_job(write_samples(tmp_path, samples))
    with pytest.raises(
        ValueError,
        match=r"data\.mean_images_per_sample \(0\.0, as measured over .*bad\.json\) must "
        r"be > 0 exactly when model\.vision is set",
    ):
        check_samples(job, progress=lambda line: None)
