"""A multimodal model composed from separately pretrained HuggingFace parts (issue 49 item 1):
``model.huggingface: {vision: DIR, llm: DIR, projector: DIR}``.

Real ``transformers`` models with random weights: a tiny LLaVA written with ``save_pretrained``, and the
same weights saved as the parts a user has (a ``CLIPVisionModel``/``SiglipVisionModel``, a causal LM, a
projector directory: ``tiny_hf.make_tiny_parts``). The composition of the parts is that LLaVA, so its
layers must compute exactly what the LLaVA directory's layers compute (float64, bit for bit: the same
tensors through the same modules), and the LLaVA's are held equal to transformers' unsplit model by
tests/unit/test_hf_model.py; here the composed model is also checked against the unsplit LLaVA directly.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from oobleck_mm.config import ConfigError, config_from_dict  # noqa: E402
from oobleck_mm.data.loader import TrainingData  # noqa: E402
from oobleck_mm.data.sample import IMAGE  # noqa: E402
from oobleck_mm.export import export_checkpoint  # noqa: E402
from oobleck_mm.model.layers import build_layer, model_layer_specs  # noqa: E402
from oobleck_mm.model.tiny_hf import make_tiny_parts  # noqa: E402
from oobleck_mm.runtime.checkpoint import write_layer_file  # noqa: E402
from oobleck_mm.runtime.checkpoint_meta import save_meta  # noqa: E402

from test_hf_export import checkpoint_without_training, tensors  # noqa: E402


@pytest.fixture(autouse=True)
def one_thread():
    """As tests/unit/test_hf_model.py: transformers' RMSNorm rounds to float32, so sums must not change order."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=[("llama", "clip"), ("qwen2", "siglip")], ids=["clip-llama", "siglip-qwen2"])
def made(request, tmp_path_factory):
    text, vision = request.param
    return make_tiny_parts(tmp_path_factory.mktemp(f"{text}-{vision}"), text, vision)


def job(huggingface, dtype="float64", **data):
    data = {"mean_text_tokens": 16, "max_seq_len": 96, "num_samples": 64, "mean_images_per_sample": 1,
            "max_images_per_sample": 2, "image_size": 32, **data}  # fmt: skip
    training = {"global_batch": 4, "microbatch_size": 4, "dtype": dtype}
    return config_from_dict({"model": {"huggingface": huggingface}, "data": data, "training": training})


def run(job_, ids=None):
    """Every layer of ``job_`` built, one microbatch forward and backward: (logits, loss, {layer: grads})."""
    specs = model_layer_specs(job_)
    layers = [build_layer(job_, i, specs) for i in range(len(specs))]
    data = TrainingData(job_)
    ids = ids if ids is not None else data.global_batch(0)
    batch = data.microbatch(ids)
    acts = ()
    for layer in layers:
        acts = layer(acts, batch)
    tokens = int((batch.labels != -100).sum())
    loss = F.cross_entropy(acts[0], batch.labels, ignore_index=-100, reduction="sum") / tokens
    loss.backward()
    grads = {s.name: {n: p.grad for n, p in layer.named_parameters()} for s, layer in zip(specs, layers)}
    return acts[0].detach(), loss.item(), grads, (data, ids, batch)


def test_the_composition_of_the_parts_computes_exactly_what_the_llava_computes(made):
    llava_dir, parts = made
    composed, whole = job(parts), job(llava_dir)
    assert [s.name for s in model_layer_specs(composed)] == [s.name for s in model_layer_specs(whole)]
    mine, theirs = run(composed), run(whole)
    assert torch.equal(mine[0], theirs[0]) and mine[1] == theirs[1]
    for layer, grads in theirs[2].items():
        for name, grad in grads.items():
            assert torch.equal(mine[2][layer][name], grad), f"{layer}.{name}"
    assert composed.model.name == "llm+vision" and composed.model.hf.composed


def test_the_composition_equals_the_unsplit_transformers_model_of_its_parts(made):
    """Each sample's logits against ``LlavaForConditionalGeneration`` holding the parts' weights."""
    llava_dir, parts = made
    logits, _, _, (data, ids, batch) = run(job(parts))
    hf = transformers.LlavaForConditionalGeneration.from_pretrained(
        llava_dir, dtype=torch.float64, attn_implementation="sdpa"
    ).eval()
    per_image = (32 // 8) ** 2
    for seg, (start, end) in enumerate(batch.spans()):
        sample = data.dataset[ids[seg]]
        tokens = []
        for t in sample.tokens.tolist():
            tokens += [hf.config.image_token_id] * per_image if t == IMAGE else [t]
        kwargs = {"pixel_values": torch.stack(list(sample.images)).double()} if len(sample.images) else {}
        with torch.no_grad():
            theirs = hf(input_ids=torch.tensor([tokens]), **kwargs).logits[0]
        assert (theirs - logits[start:end]).abs().max().item() <= 1e-10, f"sample {seg}"


def test_without_a_projector_directory_the_projector_starts_afresh_the_same_on_every_build(made):
    llava_dir, parts = made
    fresh = {k: v for k, v in parts.items() if k != "projector"}
    specs = model_layer_specs(job(fresh))
    index = {s.name: i for i, s in enumerate(specs)}
    a = build_layer(job(fresh), index["vision.projector0"], specs)
    b = build_layer(job(fresh), index["vision.projector0"], specs)
    loaded = build_layer(job(parts), index["vision.projector0"], specs)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))  # any rank builds it alike
    assert not torch.equal(a.linear_1.weight, loaded.linear_1.weight)
    # the tower and the LLM still come from their directories
    tower = index["vision.block0"]
    assert all(
        torch.equal(p, q)
        for p, q in zip(
            build_layer(job(fresh), tower, specs).parameters(), build_layer(job(parts), tower, specs).parameters()
        )
    )


def test_export_writes_each_part_back_for_from_pretrained_and_as_a_composition(made, tmp_path):
    llava_dir, parts = made
    composed = job(parts)
    ckpt = checkpoint_without_training(composed, tmp_path / "ckpt")
    for f in sorted((ckpt / "layers").glob("*.pt")):  # change every value, as training would
        payload = torch.load(f, weights_only=True)
        payload["params"] = {k: v + 0.25 for k, v in payload["params"].items()}
        write_layer_file(ckpt, f.stem, payload)
    save_meta(ckpt, composed, 0, model_layer_specs(composed))
    out = tmp_path / "out"
    export_checkpoint(ckpt, out, dtype="float64")  # (the source's dtype by default: float32 here)
    assert sorted(os.listdir(out)) == ["llm", "projector", "vision"]
    # each part loads with transformers as the kind of model it came as, moved by the change
    vision_cls = transformers.AutoConfig.from_pretrained(parts["vision"]).architectures[0]
    tower = getattr(transformers, vision_cls).from_pretrained(out / "vision")
    before = getattr(transformers, vision_cls).from_pretrained(parts["vision"])
    moved = {
        n for n, p in tower.named_parameters() if torch.equal(p, dict(before.named_parameters())[n].double() + 0.25)
    }
    assert any(".layers.0." in n for n in moved) and not any(".layers.2." in n for n in moved)  # unused last block
    lm = transformers.AutoModelForCausalLM.from_pretrained(out / "llm")
    original = transformers.AutoModelForCausalLM.from_pretrained(parts["llm"])
    old = dict(original.named_parameters())
    assert lm.dtype == torch.float64 and all(torch.equal(p, old[n].double() + 0.25) for n, p in lm.named_parameters())
    assert os.path.exists(out / "llm" / "tokenizer.json")
    # the exported parts compose again into the checkpoint's model
    again = job({k: str(out / k) for k in ("vision", "llm", "projector")})
    specs = model_layer_specs(again)
    for i, spec in enumerate(specs):
        params = torch.load(ckpt / "layers" / f"{spec.name}.pt", weights_only=True)["params"]
        layer = build_layer(again, i, specs)
        for name, value in layer.state_dict().items():
            assert torch.equal(value, params[name]), f"{spec.name}.{name}"
    assert tensors(out / "projector").keys() == {f"vision.linear_{i}.{p}" for i in (1, 2) for p in ("weight", "bias")}


def test_composition_mistakes_name_the_part_and_what_is_valid(made, tmp_path):
    llava_dir, parts = made
    with pytest.raises(
        ConfigError,
        match=r"model.huggingface: unknown part\(s\) \['speech'\]; a composition has vision, audio, llm, projector",
    ):
        job({**parts, "speech": parts["llm"]})
    with pytest.raises(ConfigError, match="a composition needs llm and an encoder"):
        job({"vision": parts["vision"]})
    with pytest.raises(
        ConfigError,
        match=r"model.huggingface.vision: .* is a '(Llama|Qwen2)ForCausalLM'; a vision tower: CLIPVisionModel, SiglipVisionModel, CLIPModel, SiglipModel",
    ):
        job({"vision": parts["llm"], "llm": parts["llm"]})
    with pytest.raises(ConfigError, match=r"model.huggingface.llm: .* is a '(CLIP|Siglip)VisionModel'; a causal LM"):
        job({"vision": parts["vision"], "llm": parts["vision"]})
    with pytest.raises(ConfigError, match="model.huggingface.projector: .* has model_type"):
        job({**parts, "projector": parts["llm"]})
    bad = tmp_path / "projector"
    bad.mkdir()
    config = json.loads(open(os.path.join(parts["projector"], "config.json")).read())
    (bad / "config.json").write_text(json.dumps({**config, "text_hidden_size": 7}))
    with pytest.raises(
        ConfigError, match="model.huggingface.projector: its text_hidden_size is 7, the parts make it 64"
    ):
        job({**parts, "projector": str(bad)})


def test_a_whole_clip_model_serves_as_the_tower_and_exports_back_whole(made, tmp_path):
    """LLaVA-1.5's tower is a whole ``CLIPModel`` checkpoint (openai/clip-vit-large-patch14-336): its
    ``vision_config`` and ``vision_model.*`` tensors are the tower; the text half comes back untouched."""
    llava_dir, parts = made
    tower_cfg = transformers.AutoConfig.from_pretrained(parts["vision"])
    if tower_cfg.model_type != "clip_vision_model":
        pytest.skip("the CLIP case covers it")
    text = transformers.CLIPTextConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    whole = transformers.CLIPModel(
        transformers.CLIPConfig(text_config=text.to_dict(), vision_config=tower_cfg.to_dict())
    )
    tower = transformers.CLIPVisionModel.from_pretrained(parts["vision"])
    whole.vision_model.load_state_dict(
        tower.vision_model.state_dict() if hasattr(tower, "vision_model") else tower.state_dict()
    )
    whole.save_pretrained(tmp_path / "clip")
    composed = job({**parts, "vision": str(tmp_path / "clip")})
    mine, theirs = run(composed), run(job(parts))
    assert torch.equal(mine[0], theirs[0])
    ckpt = checkpoint_without_training(composed, tmp_path / "ckpt")
    export_checkpoint(ckpt, tmp_path / "out")
    assert tensors(tmp_path / "out" / "vision").keys() == tensors(tmp_path / "clip").keys()
    assert all(torch.equal(v, tensors(tmp_path / "clip")[k]) for k, v in tensors(tmp_path / "out" / "vision").items())


def test_vision_audio_and_llm_parts_equal_their_unsplit_transformers_modules(tmp_path_factory):
    """``{vision, audio, llm, projector}``: a CLIP tower, a Whisper encoder and a Llama, against the same
    transformers models run whole per sample (``assert_equals_the_parts_run_whole``), in float64."""
    _, parts = make_tiny_parts(tmp_path_factory.mktemp("audio"), "llama", "clip", audio=True)
    composed = job(parts, max_seq_len=128)
    assert [s.name for s in model_layer_specs(composed)][5:10] == [
        "audio.embed", "audio.block0", "audio.block1", "audio.projector0", "audio.projector1",
    ]  # fmt: skip
    logits, _, grads, (data, ids, batch) = run(composed)
    assert batch.audio is not None and batch.audio.features.shape[0] > 0  # clips in this microbatch
    assert all(g is not None for g in grads["audio.block0"].values())  # the audio tower trains
    assert_equals_the_parts_run_whole(parts, logits, data, ids, batch)


def assert_equals_the_parts_run_whole(parts, logits, data, ids, batch) -> None:
    """``logits`` (the composed layers' on ``batch``, samples ``ids`` of ``data``) equal the parts' own
    transformers models run whole per sample: CLIPVisionModel's second-to-last hidden state without CLS,
    WhisperEncoder on the clip as its feature extractor pads it, each through its projector, put at the
    sample's media positions of the LLM's input embeddings (float64, 1e-10)."""
    from safetensors.torch import load_file

    from oobleck_mm.data.sample import AUDIO

    kw = {"dtype": torch.float64, "attn_implementation": "sdpa"}
    tower = transformers.CLIPVisionModel.from_pretrained(parts["vision"], **kw).eval()
    whisper = transformers.WhisperForConditionalGeneration.from_pretrained(parts["audio"], **kw).model.encoder.eval()
    lm = transformers.AutoModelForCausalLM.from_pretrained(parts["llm"], **kw).eval()
    weights = load_file(os.path.join(parts["projector"], "model.safetensors"))

    def project(x, who):
        x = F.linear(x, weights[f"{who}.linear_1.weight"].double(), weights[f"{who}.linear_1.bias"].double())
        return F.linear(F.gelu(x), weights[f"{who}.linear_2.weight"].double(), weights[f"{who}.linear_2.bias"].double())

    for seg, (start, end) in enumerate(batch.spans()):
        sample = data.dataset[ids[seg]]
        images, clips = iter(sample.images), iter(sample.audio)
        # Media slots: a record's mask (its ids are the LM tokenizer's), else the placeholder ids.
        tokens = sample.tokens.tolist()
        media = sample.media.tolist() if sample.media is not None else [t in (IMAGE, AUDIO) for t in tokens]
        pieces = []
        with torch.no_grad():
            for t, is_media in zip(tokens, media):
                if is_media and t == AUDIO:
                    pieces.append(project(whisper(next(clips).T[None].double()).last_hidden_state[0], "audio"))
                elif is_media:
                    hidden = tower(next(images)[None].double(), output_hidden_states=True).hidden_states[-2]
                    pieces.append(project(hidden[0, 1:], "vision"))
                else:
                    pieces.append(lm.get_input_embeddings()(torch.tensor([t])))
            theirs = lm(inputs_embeds=torch.cat(pieces)[None]).logits[0]
        assert theirs.shape == logits[start:end].shape
        assert (theirs - logits[start:end]).abs().max().item() <= 1e-10, f"sample {seg}"


def test_an_audio_composition_exports_a_whisper_whose_decoder_came_along_untouched(tmp_path):
    _, parts = make_tiny_parts(tmp_path / "parts", "qwen2", "siglip", audio=True)
    composed = job(parts, max_seq_len=128)
    ckpt = checkpoint_without_training(composed, tmp_path / "ckpt")
    for f in sorted((ckpt / "layers").glob("*.pt")):
        payload = torch.load(f, weights_only=True)
        payload["params"] = {k: v + 0.25 for k, v in payload["params"].items()}
        write_layer_file(ckpt, f.stem, payload)
    save_meta(ckpt, composed, 0, model_layer_specs(composed))
    export_checkpoint(ckpt, tmp_path / "out", dtype="float64")
    assert sorted(os.listdir(tmp_path / "out")) == ["audio", "llm", "projector", "vision"]
    new = transformers.WhisperForConditionalGeneration.from_pretrained(tmp_path / "out" / "audio")
    old = dict(transformers.WhisperForConditionalGeneration.from_pretrained(parts["audio"]).named_parameters())
    moved = {n for n, p in new.named_parameters() if torch.equal(p, old[n].double() + 0.25)}
    kept = {n for n, p in new.named_parameters() if torch.equal(p, old[n].double())}
    assert "model.encoder.conv1.weight" in moved and "model.encoder.layer_norm.weight" in moved
    assert all(n.startswith("model.encoder.") for n in moved) and any(n.startswith("model.decoder.") for n in kept)
    projector = tensors(tmp_path / "out" / "projector")
    assert {k.split(".")[0] for k in projector} == {"vision", "audio"}
    config = json.loads((tmp_path / "out" / "projector" / "config.json").read_text())
    assert config["audio_hidden_size"] == 32 and config["vision_hidden_size"] == 32
    again = job({k: str(tmp_path / "out" / k) for k in ("vision", "audio", "llm", "projector")}, max_seq_len=128)
    specs = model_layer_specs(again)
    for i, spec in enumerate(specs):
        params = torch.load(ckpt / "layers" / f"{spec.name}.pt", weights_only=True)["params"]
        for name, value in build_layer(again, i, specs).state_dict().items():
            assert torch.equal(value, params[name]), f"{spec.name}.{name}"


def test_an_audio_tower_takes_clips_of_its_length_and_other_audio_means_are_refused(tmp_path):
    _, parts = make_tiny_parts(tmp_path / "parts", "llama", "clip", audio=True)
    # 16 frames of 100 a second in 80% of samples: 0.128 s a sample, derived when left out
    assert job(parts, max_seq_len=128).data.mean_audio_seconds == pytest.approx(0.128)
    with pytest.raises(ConfigError, match=r"data.mean_audio_seconds \(2.0\): the Whisper tower .* 16 mel frames"):
        job(parts, max_seq_len=128, mean_audio_seconds=2.0)
    with pytest.raises(ConfigError, match=r"model.huggingface.audio: .* is a 'LlamaForCausalLM'; an audio tower"):
        job({**parts, "audio": parts["llm"]}, max_seq_len=128)
    data = TrainingData(job(parts, max_seq_len=128))
    frames = {tuple(c.shape) for i in range(32) for c in data.dataset[i].audio}
    assert frames == {(16, 8)}  # every clip is the tower's 16 frames of 8 mel bins


def test_llava_json_records_for_a_composition_through_the_lms_own_tokenizer_equal_transformers(made):
    """Real records for a composed model: its LM's tokenizer (a text-only LM's, without ``<image>``; for a Qwen2
    LM transformers' ``Qwen2Tokenizer``) encodes the text between the markers, each marker one image's
    placeholder, and the vision part's own image processor prepares the pixels. The text decodes back to the
    chat template's rendering, the loss mask to the answers, the images are the LLaVA's, and the composed
    model's logits on the records equal transformers' LLaVA (of the same weights) run on the same ids."""
    from test_hf_model import FIXTURE, llava_json_job, unsplit

    llava_dir, parts = made
    lm = transformers.AutoTokenizer.from_pretrained(parts["llm"])
    assert "<image>" not in lm.get_vocab()

    composed = llava_json_job(parts)
    data, theirs = TrainingData(composed), TrainingData(llava_json_job(llava_dir)).dataset
    records = json.load(open(FIXTURE))
    assert len(data.dataset) == len(theirs) == len(records) >= 3
    for i, record in enumerate(records):
        sample = data.dataset[i]
        messages = [
            {"role": "user" if t["from"] == "human" else "assistant", "content": t["value"]}
            for t in record["conversations"]
        ]
        pieces, run_ids = [], []
        for t, is_media in zip(sample.tokens.tolist(), sample.media.tolist()):
            if is_media:
                pieces += [lm.decode(run_ids), "<image>"]
                run_ids = []
            else:
                run_ids.append(t)
        assert "".join([*pieces, lm.decode(run_ids)]) == lm.apply_chat_template(messages, tokenize=False), i
        answers = "".join(m["content"] for m in messages if m["role"] == "assistant")
        assert lm.decode(sample.tokens[sample.targets]).replace("</s>", "").replace(" ", "") == answers.replace(
            " ", ""
        ), i
        assert int(sample.media.sum()) == len(sample.images) == len(theirs[i].images), i
        assert all(torch.equal(x, y) for x, y in zip(sample.images, theirs[i].images)), i
    logits = run(composed, [0, 1, 2])[0]
    batch = data.microbatch([0, 1, 2])
    hf = unsplit(llava_dir)
    per_image = batch.vision.features.shape[0] // sum(len(data.dataset[i].images) for i in range(3))
    for seg, (start, end) in enumerate(batch.spans()):
        sample = data.dataset[seg]
        ids = []
        for t, is_image in zip(sample.tokens.tolist(), sample.media.tolist()):
            ids += [hf.config.image_token_id] * per_image if is_image else [t]
        kwargs = {"pixel_values": torch.stack(sample.images).double()} if sample.images else {}
        theirs_logits = hf(input_ids=torch.tensor([ids]), **kwargs).logits[0]
        assert (theirs_logits - logits[start:end]).abs().max().item() <= 1e-10, seg


def test_records_with_clips_for_a_vision_audio_and_llm_composition_equal_the_parts_run_whole(tmp_path):
    """Records with ``<audio>`` markers and WAV clips for a composition with a Whisper part: each clip padded
    with silence (or cut) to the encoder's length before its log-mel features, as transformers'
    ``WhisperFeatureExtractor`` makes them; the logits on the records equal the parts run whole
    (``assert_equals_the_parts_run_whole``)."""
    import shutil
    import wave

    import numpy as np

    from oobleck_mm.data.sample import AUDIO
    from test_hf_model import FIXTURE, llava_json_job

    _, parts = make_tiny_parts(tmp_path / "parts", "llama", "clip", audio=True)
    shutil.copytree(os.path.dirname(FIXTURE), tmp_path / "data")
    (tmp_path / "data" / "clips").mkdir()
    rng = np.random.default_rng(0)
    waves = {"short.wav": 0.1, "long.wav": 0.3}  # the tiny Whisper's clip is 16 frames, 0.16 s
    for name, seconds in waves.items():
        samples = (rng.uniform(-0.5, 0.5, int(16000 * seconds)) * 32767).astype(np.int16)
        with wave.open(str(tmp_path / "data" / "clips" / name), "wb") as w:
            w.setnchannels(1), w.setsampwidth(2), w.setframerate(16000), w.writeframes(samples.tobytes())
        waves[name] = samples.astype(np.float32) / 32768.0
    records = json.loads((tmp_path / "data" / "llava.json").read_text())
    records[0]["audio"] = "clips/short.wav"
    records[0]["conversations"][0]["value"] = "<audio>\n" + records[0]["conversations"][0]["value"]
    records[1]["audio"] = ["clips/long.wav", "clips/short.wav"]
    records[1]["conversations"][0]["value"] += " <audio> or <audio>?"
    (tmp_path / "data" / "llava.json").write_text(json.dumps(records))
    composed = llava_json_job(parts, path=tmp_path / "data" / "llava.json", max_seq_len=160)
    assert composed.data.mean_audio_seconds > 0
    data = TrainingData(composed)
    first, second = data.dataset[0], data.dataset[1]
    assert [t for t, m in zip(first.tokens.tolist(), first.media.tolist()) if m] == [AUDIO, IMAGE]
    assert [t for t, m in zip(second.tokens.tolist(), second.media.tolist()) if m] == [AUDIO, AUDIO]
    assert data.dataset.meta(1).audio_frames == (16, 16)
    for i in range(len(data.dataset)):  # the master's check of every record decodes the clips the same way
        data.dataset.decode_images(i)
    extractor = transformers.WhisperFeatureExtractor(feature_size=8, sampling_rate=16000, hop_length=160, n_fft=400)
    extractor.n_samples, extractor.nb_max_frames = 16 * 160, 16  # the tiny Whisper's clip, as its 30 s
    for got, name in ((first.audio[0], "short.wav"), *zip(second.audio, ("long.wav", "short.wav"))):
        want = extractor(waves[name], sampling_rate=16000, return_tensors="np").input_features[0].T
        assert got.shape == (16, 8) and np.allclose(got.numpy(), want, atol=1e-5), name
    logits, _, _, (_, ids, batch) = run(composed, [0, 1, 2])
    assert batch.audio.features.shape[0] > 0
    assert_equals_the_parts_run_whole(parts, logits, data, ids, batch)
    from test_packing import assert_layout_is_the_packed_batch_without_media

    assert_layout_is_the_packed_batch_without_media(data, [0, 1, 2])  # its chat template's media mask too
