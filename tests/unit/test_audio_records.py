"""Audio clips in records (``oobleck_mm.data.audio``, ``llava_json``'s ``<audio>`` markers): Whisper's features,
the frame count from the header alone equal to what loading gives, placeholders in text order, and clear errors."""

from __future__ import annotations

import io
import json
import wave

import numpy as np
import pytest
import torch

from oobleck_mm.config import DataConfig
from oobleck_mm.data import audio
from oobleck_mm.data.dataset import ModelInputs
from oobleck_mm.data.llava import LlavaJsonDataset
from oobleck_mm.data.packing import PackingSpec, pack
from oobleck_mm.data.sample import AUDIO, BOS, EOS, IMAGE
from oobleck_mm.errors import UserError

MEL = 80
INPUTS = ModelInputs(
    vocab_size=300, has_vision=True, patch_size=4, has_audio=True, mel_bins=MEL, audio_downsample=2, audio_merge=2
)


def write_wav(path, seconds: float, rate: int = audio.SAMPLE_RATE, channels: int = 1, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    n = int(seconds * rate)
    t = np.arange(n) / rate
    mono = 0.3 * np.sin(2 * np.pi * 440.0 * t) + 0.05 * rng.standard_normal(n)
    pcm = np.clip(np.repeat(mono[:, None], channels, axis=1) * 32767, -32768, 32767).astype("<i2")
    with wave.open(str(path), "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.tobytes())
    return pcm[:, 0].astype(np.float32) / 32768.0


def test_the_features_are_whispers_own_feature_extractors():
    from transformers import WhisperFeatureExtractor

    rng = np.random.default_rng(1)
    waveform = (0.2 * rng.standard_normal(int(1.37 * audio.SAMPLE_RATE))).astype(np.float32)
    ours = audio.log_mel(waveform, MEL)
    fe = WhisperFeatureExtractor(feature_size=MEL, sampling_rate=audio.SAMPLE_RATE)
    theirs = fe._np_extract_fbank_features(waveform[None], "cpu")[0].T  # the numpy path: the same functions
    assert ours.shape == (len(waveform) // 160, MEL) == theirs.shape
    np.testing.assert_array_equal(ours, theirs)
    public = fe(waveform, sampling_rate=audio.SAMPLE_RATE, padding="longest", return_tensors="np")["input_features"]
    np.testing.assert_allclose(ours, public[0].T[: len(ours)], atol=1e-4)  # (torch's STFT when torch is there)


def test_a_records_clip_frames_come_from_the_header_and_equal_what_loading_gives(tmp_path):
    write_wav(tmp_path / "a.wav", 1.234)
    write_wav(tmp_path / "b.wav", 0.5, channels=2, seed=2)
    np.save(tmp_path / "c.npy", np.random.default_rng(3).standard_normal((57, MEL)).astype(np.float32))
    records = [
        {
            "id": "s0",
            "audio": ["a.wav", "b.wav"],
            "conversations": [
                {"from": "human", "value": "<audio> then <audio>: which is louder?"},
                {"from": "gpt", "value": "The first."},
            ],
        },
        {
            "id": "s1",
            "audio": "c.npy",
            "conversations": [{"from": "human", "value": "hi <audio>"}, {"from": "gpt", "value": "ok"}],
        },
    ]
    (tmp_path / "d.json").write_text(json.dumps(records))
    ds = LlavaJsonDataset(DataConfig(kind="llava_json", path=str(tmp_path / "d.json"), max_seq_len=512), INPUTS)
    # 1.234 s: 123 frames, rounded down to whole LLM tokens (4 frames each); 0.5 s: 50 -> 48; 57 -> 56
    assert ds.meta(0).audio_frames == (120, 48) and ds.meta(1).audio_frames == (56,)
    sample = ds[0]
    assert [tuple(c.shape) for c in sample.audio] == [(120, MEL), (48, MEL)]
    ids = sample.tokens.tolist()
    assert ids[0] == BOS and ids[-1] == EOS and ids.count(AUDIO) == 2 and IMAGE not in ids
    assert len(ids) == sample.meta.text_tokens and int(sample.targets.sum()) == sample.meta.loss_tokens
    assert not sample.targets[sample.tokens == AUDIO].any(), "a placeholder is never a target"
    np.testing.assert_array_equal(ds[1].audio[0].numpy(), np.load(tmp_path / "c.npy")[:56])
    spec = PackingSpec(patch_size=4, audio_downsample=2, audio_merge=2, has_vision=True, has_audio=True)
    batch = pack([sample, ds[1]], spec, torch.float32, vision_in=48, audio_in=MEL)
    assert batch.audio is not None and batch.audio.features.shape == ((120 + 48 + 56) // 2, 2 * MEL)


def test_images_and_clips_keep_their_text_order(tmp_path):
    from PIL import Image

    Image.new("RGB", (8, 8), "red").save(tmp_path / "i.png")
    write_wav(tmp_path / "a.wav", 0.2)
    records = [
        {
            "id": "mix",
            "image": "i.png",
            "audio": "a.wav",
            "conversations": [{"from": "human", "value": "<audio> <image>"}, {"from": "gpt", "value": "x"}],
        }
    ]
    (tmp_path / "d.json").write_text(json.dumps(records))
    ds = LlavaJsonDataset(DataConfig(kind="llava_json", path=str(tmp_path / "d.json"), image_size=8), INPUTS)
    media = [t for t in ds[0].tokens.tolist() if t in (IMAGE, AUDIO)]
    assert media == [AUDIO, IMAGE]
    # Without pixels or frames (a stage with no encoder input layer): the same text, no file opened.
    layout = ds.layout(0)
    assert torch.equal(layout.tokens, ds[0].tokens) and layout.images == [] and layout.audio == []
    (tmp_path / "i.png").unlink()
    (tmp_path / "a.wav").unlink()
    assert torch.equal(ds.layout(0).tokens, layout.tokens)


@pytest.mark.parametrize(
    "record, files, message",
    [
        (
            {"audio": "a.wav", "conversations": [{"from": "human", "value": "no marker"}]},
            {"a.wav": 0.3},
            "0 '<audio>' markers but 1 audio clips",
        ),
        (
            {"audio": "slow.wav", "conversations": [{"from": "human", "value": "<audio>"}]},
            {"slow.wav": (0.3, 8000)},
            "sampled at 8000 Hz",
        ),
        (
            {"audio": "tiny.wav", "conversations": [{"from": "human", "value": "<audio>"}]},
            {"tiny.wav": 0.02},
            "fewer than one LLM token's 4",
        ),
        ({"audio": "gone.wav", "conversations": [{"from": "human", "value": "<audio>"}]}, {}, "cannot read audio clip"),
        (
            {"audio": "a.mp3", "conversations": [{"from": "human", "value": "<audio>"}]},
            {},
            "is not a .wav or .npy clip",
        ),
    ],
)
def test_a_bad_clip_is_named_with_its_sample(tmp_path, record, files, message):
    for name, spec in files.items():
        seconds, rate = spec if isinstance(spec, tuple) else (spec, audio.SAMPLE_RATE)
        write_wav(tmp_path / name, seconds, rate)
    (tmp_path / "d.json").write_text(json.dumps([{"id": "bad", **record}]))
    with pytest.raises(UserError, match="sample 'bad'") as raised:
        LlavaJsonDataset(DataConfig(kind="llava_json", path=str(tmp_path / "d.json")), INPUTS)
    assert message in str(raised.value)


def test_a_model_without_an_audio_encoder_refuses_clips(tmp_path):
    write_wav(tmp_path / "a.wav", 0.3)
    (tmp_path / "d.json").write_text(
        json.dumps([{"id": "x", "audio": "a.wav", "conversations": [{"from": "human", "value": "<audio>"}]}])
    )
    with pytest.raises(UserError, match="has 1 audio clips but the model has no audio encoder"):
        LlavaJsonDataset(DataConfig(kind="llava_json", path=str(tmp_path / "d.json")), ModelInputs(vocab_size=300))


def test_a_long_clip_is_cut_to_max_audio_seconds(tmp_path):
    write_wav(tmp_path / "a.wav", 2.0)
    (tmp_path / "d.json").write_text(
        json.dumps([{"id": "x", "audio": "a.wav", "conversations": [{"from": "human", "value": "<audio>"}]}])
    )
    data = DataConfig(kind="llava_json", path=str(tmp_path / "d.json"), max_audio_seconds=0.5)
    ds = LlavaJsonDataset(data, INPUTS)
    assert ds.meta(0).audio_frames == (48,) and ds[0].audio[0].shape == (48, MEL)  # 50 frames -> whole tokens


# ---------------------------------------------------------------------- the other readers
def wav_bytes(seconds: float, seed: int = 0) -> bytes:
    buffer = io.BytesIO()
    rng = np.random.default_rng(seed)
    pcm = (0.2 * rng.standard_normal(int(seconds * audio.SAMPLE_RATE)) * 32767).astype("<i2")
    with wave.open(buffer, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(audio.SAMPLE_RATE)
        w.writeframes(pcm.tobytes())
    return buffer.getvalue()


def test_an_hf_datasets_audio_column_reads_its_clips_bytes_like_a_json_records_files(tmp_path):
    datasets = pytest.importorskip("datasets")
    from oobleck_mm.data.hf_datasets import DatasetsLlavaDataset

    clips = [wav_bytes(0.3 + 0.1 * i, seed=i) for i in range(3)]
    turns = [[{"from": "human", "value": "<audio>"}, {"from": "gpt", "value": f"clip {i}"}] for i in range(3)]
    datasets.Dataset.from_dict(
        {"conversations": turns, "sound": [{"bytes": c, "path": f"c{i}.wav"} for i, c in enumerate(clips)]}
    ).save_to_disk(tmp_path / "ds")
    hf = DatasetsLlavaDataset(
        DataConfig(kind="hf_datasets", path=str(tmp_path / "ds"), columns={"audio": "sound"}), INPUTS
    )
    for i, c in enumerate(clips):
        (tmp_path / f"c{i}.wav").write_bytes(c)
    (tmp_path / "d.json").write_text(
        json.dumps([{"id": f"#{i}", "audio": f"c{i}.wav", "conversations": t} for i, t in enumerate(turns)])
    )
    plain = LlavaJsonDataset(DataConfig(kind="llava_json", path=str(tmp_path / "d.json")), INPUTS)
    for i in range(3):
        assert hf.meta(i) == plain.meta(i) and hf.meta(i).audio_frames == ((30 + 10 * i) // 4 * 4,)
        assert torch.equal(hf[i].audio[0], plain[i].audio[0]) and torch.equal(hf[i].tokens, plain[i].tokens)


def test_webdataset_wav_members_with_captions_are_clips(tmp_path):
    pytest.importorskip("braceexpand")
    import tarfile

    from oobleck_mm.data.webdataset import ShardsLlavaDataset

    with tarfile.open(tmp_path / "part-000.tar", "w") as tar:
        for i in range(3):
            for name, data in ((f"k{i}.wav", wav_bytes(0.25, seed=i)), (f"k{i}.txt", f"tone {i}".encode())):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    data = DataConfig(kind="webdataset", path=str(tmp_path / "part-000.tar"), cache_dir=str(tmp_path / "cache"))
    ds = ShardsLlavaDataset(data, INPUTS)
    assert [ds.meta(i).audio_frames for i in range(3)] == [(24,)] * 3
    sample = ds[1]
    assert sample.tokens.tolist().count(AUDIO) == 1 and sample.audio[0].shape == (24, MEL)
    expected = audio.log_mel(audio.read_wav("k1.wav", io.BytesIO(wav_bytes(0.25, seed=1))), MEL)[:24]
    np.testing.assert_array_equal(sample.audio[0].numpy(), expected)
