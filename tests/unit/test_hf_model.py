"""HuggingFace models split into the engine's layers equal the unsplit transformers model.

Real ``transformers`` models with random weights, written with ``save_pretrained``
into a temporary directory and read back by the engine from their safetensors
files. The unsplit model runs each sample of a packed microbatch alone (its own
forward, no padding); the engine runs the packed microbatch through its layer
list. Float64, same SDPA kernels: logits, loss and every gradient agree.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from oobleck_mm.config import ConfigError, config_from_dict  # noqa: E402
from oobleck_mm.data.loader import TrainingData  # noqa: E402
from oobleck_mm.data.sample import IMAGE  # noqa: E402
from oobleck_mm.errors import UserError  # noqa: E402
from oobleck_mm.model.hf_weights import hf_name  # noqa: E402
from oobleck_mm.model.layers import build_layer, model_layer_specs  # noqa: E402
from oobleck_mm.model.tiny_hf import make_tiny_model  # noqa: E402

CASES = [
    ("llama", "clip", False),
    ("qwen2", "siglip", False),
    ("mistral", "clip", False),
    ("llama", None, False),
    ("qwen2", None, False),
    ("mistral", None, False),
    ("qwen2", None, True),
    ("llama", "siglip", True),
]


@pytest.fixture(autouse=True)
def one_thread():
    """transformers' RMSNorm rounds activations to float32 even in a float64 model, which turns a 1e-16
    difference into 1e-8; with several threads MKL may split a sum differently from call to call (it
    picks the thread count by the machine's load), so the comparisons run on one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def hf_job(directory, **training):
    with open(os.path.join(directory, "config.json")) as fh:
        multimodal = "vision_config" in json.load(fh)
    data = {"mean_text_tokens": 16, "max_seq_len": 96, "num_samples": 64}
    if multimodal:
        data.update(mean_images_per_sample=1, max_images_per_sample=2, image_size=32)
    training = {"global_batch": 4, "microbatch_size": 4, "dtype": "float64", **training}
    return config_from_dict({"model": {"huggingface": str(directory)}, "data": data, "training": training})


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {
        case: make_tiny_model(root / "-".join(map(str, case)), text=case[0], vision=case[1], tie=case[2])
        for case in CASES
    }


def unsplit(directory):
    model = (
        transformers.AutoModelForImageTextToText
        if "vision" in open(f"{directory}/config.json").read()
        else transformers.AutoModelForCausalLM
    )
    return model.from_pretrained(directory, dtype=torch.float64, attn_implementation="sdpa").eval()


def sample_inputs(sample, image_token_id, tokens_per_image):
    ids = []
    for t in sample.tokens.tolist():
        ids += [image_token_id] * tokens_per_image if t == IMAGE else [t]
    pixels = torch.stack(list(sample.images)).double() if len(sample.images) else None
    return torch.tensor([ids]), pixels


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1] or 'text'}{'-tied' if c[2] else ''}")
def test_split_model_equals_unsplit_transformers_model(models, case):
    directory = models[case]
    job = hf_job(directory)
    specs = model_layer_specs(job)
    layers = [build_layer(job, i, specs) for i in range(len(specs))]
    data = TrainingData(job)
    ids = data.global_batch(0)
    batch = data.microbatch(ids)
    tokens = int((batch.labels != -100).sum())
    acts = ()
    for layer in layers:
        acts = layer(acts, batch)
    loss = F.cross_entropy(acts[0], batch.labels, ignore_index=-100, reduction="sum") / tokens
    loss.backward()

    hf = unsplit(directory)
    image_token = getattr(hf.config, "image_token_id", None)
    per_image = (32 // 8) ** 2
    hf_loss = 0.0
    for seg, (start, end) in enumerate(batch.spans()):
        input_ids, pixels = sample_inputs(data.dataset[ids[seg]], image_token, per_image)
        kwargs = {"pixel_values": pixels} if pixels is not None else {}
        logits = hf(input_ids=input_ids, **kwargs).logits[0]
        assert (logits - acts[0][start:end]).abs().max().item() <= 1e-10, f"sample {seg}: logits differ"
        seg_loss = F.cross_entropy(logits, batch.labels[start:end], ignore_index=-100, reduction="sum") / tokens
        seg_loss.backward()
        hf_loss += seg_loss.item()
    assert abs(loss.item() - hf_loss) <= 1e-10

    hf_params = dict(hf.named_parameters())
    mine: dict[str, torch.Tensor] = {}  # a tied embedding's gradient is its two uses' sum
    for layer in layers:
        for name, param in layer.named_parameters():
            key = hf_name(hf_params, *layer.hf_names()[name])
            mine[key] = mine[key] + param.grad if key in mine else param.grad
    for key, grad in mine.items():
        assert hf_params[key].grad is not None, key
        assert (grad - hf_params[key].grad).abs().max().item() <= 1e-10, f"{key}: gradients differ"
    # Every parameter the unsplit model trains is one of the engine's (CLIP's unused last block and
    # post-layernorm get no gradient there and are not layers of the engine).
    trained = {n for n, p in hf_params.items() if p.grad is not None and p.grad.abs().sum() > 0}
    assert trained <= set(mine), trained - set(mine)
    if case[2]:
        specs_by_name = {s.name: i for i, s in enumerate(specs)}
        embed, head = layers[specs_by_name["llm.embed"]], layers[specs_by_name["llm.head"]]
        assert torch.equal(embed.tied_weight, head.tied_weight)  # the copy starts as the embedding


def test_every_rank_builds_the_same_random_init_without_weight_files(tmp_path):
    directory = make_tiny_model(tmp_path / "m", "llama", "clip")
    for f in os.listdir(directory):
        if f.endswith(".safetensors"):
            os.remove(os.path.join(directory, f))
    job = hf_job(directory)
    specs = model_layer_specs(job)
    a = [build_layer(job, i, specs).state_dict() for i in range(len(specs))]
    b = [build_layer(job, i, specs).state_dict() for i in range(len(specs))]
    assert all(torch.equal(x[k], y[k]) for x, y in zip(a, b) for k in x)
    # transformers' own init: normal(0, initializer_range) weights, not torch's default uniform
    block = a[[s.name for s in specs].index("llm.block0")]
    assert abs(block["layer.mlp.up_proj.weight"].std().item() - 0.02) < 0.005


def test_weights_come_from_the_safetensors_files(models):
    from safetensors.torch import load_file

    directory = models[("llama", "clip", False)]
    job = hf_job(directory)
    specs = model_layer_specs(job)
    files = load_file(os.path.join(directory, "model.safetensors"))
    for i, spec in enumerate(specs):
        layer = build_layer(job, i, specs)
        for name, (component, inside) in layer.hf_names().items():
            key = hf_name(files, component, inside)
            assert torch.equal(layer.state_dict()[name], files[key].double()), key


def test_sharded_checkpoint_reads_each_tensor_from_its_shard(tmp_path, models):
    sharded = make_tiny_model(tmp_path / "sharded", "llama", "clip", max_shard_size="100KB")
    assert os.path.exists(os.path.join(sharded, "model.safetensors.index.json"))
    job, ref = hf_job(sharded), hf_job(models[("llama", "clip", False)])
    specs = model_layer_specs(job)
    for i in range(len(specs)):
        mine, theirs = build_layer(job, i, specs).state_dict(), build_layer(ref, i, specs).state_dict()
        assert all(torch.equal(mine[k], theirs[k]) for k in mine)


# --------------------------------------------------------------------------- bad input


def test_unsupported_architecture_names_it_and_the_supported_list(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(ConfigError, match=r"GPT2LMHeadModel.*LlavaForConditionalGeneration.*Qwen2ForCausalLM"):
        config_from_dict({"model": {"huggingface": str(tmp_path)}})


def test_huggingface_and_builtin_sections_are_exclusive(models):
    with pytest.raises(ConfigError, match=r"model\.llm: cannot be set together with model\.huggingface"):
        config_from_dict(
            {
                "model": {
                    "huggingface": models[("llama", None, False)],
                    "llm": {"num_layers": 1, "hidden": 8, "num_heads": 1, "vocab_size": 16},
                }
            }
        )


def test_image_size_is_the_towers_read_from_its_config_and_another_is_refused(models):
    """Issue 30 item 4: a user never types what the engine reads (the tower's side, in its config.json)."""
    job = config_from_dict({"model": {"huggingface": models[("llama", "clip", False)]}, "data": {"max_seq_len": 96}})
    assert (job.data.image_size, job.data.min_image_size, job.data.mean_images_per_sample) == (32, 32, 1.0)
    with pytest.raises(ConfigError, match=r"data\.image_size \(224\).*must both be 32"):
        config_from_dict(
            {"model": {"huggingface": models[("llama", "clip", False)]}, "data": {"image_size": 224, "max_seq_len": 96}}
        )


def test_job_round_trips_through_to_dict(models):
    job = hf_job(models[("qwen2", "siglip", False)])
    assert config_from_dict(job.to_dict()).model == job.model
    assert job.model.llm.num_layers == 4 and job.model.vision.num_layers == 2  # feature layer -2 of 3


def test_truncated_shard_is_a_user_error_naming_the_file(tmp_path):
    directory = make_tiny_model(tmp_path / "m", "llama", None)
    path = os.path.join(directory, "model.safetensors")
    os.truncate(path, os.path.getsize(path) // 2)
    job = hf_job(directory)
    with pytest.raises(UserError, match=r"model\.safetensors: unreadable safetensors file"):
        build_layer(job, 1)


def test_missing_shard_is_a_user_error_naming_it(tmp_path):
    directory = make_tiny_model(tmp_path / "m", "llama", None, max_shard_size="100KB")
    shard = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))[-1]
    os.remove(os.path.join(directory, shard))
    job = hf_job(directory)
    with pytest.raises(UserError, match=shard):
        build_layer(job, 0)


def test_tensor_of_the_wrong_shape_is_a_user_error_naming_it(tmp_path):
    from safetensors.torch import load_file, save_file

    directory = make_tiny_model(tmp_path / "m", "llama", None)
    path = os.path.join(directory, "model.safetensors")
    tensors = load_file(path)
    tensors["model.layers.0.mlp.up_proj.weight"] = torch.zeros(3, 3)
    save_file(tensors, path, metadata={"format": "pt"})
    job = hf_job(directory)
    with pytest.raises(UserError, match=r"model\.layers\.0\.mlp\.up_proj\.weight' has shape \[3, 3\].*\[128, 64\]"):
        build_layer(job, 1)


# --------------------------------------------------------------------------- a real-size config


def test_a_config_only_llava_7b_plans_with_the_real_models_sizes():
    """configs/llava_1.5_7b.yaml: config.json only (no weights); the planner's parameter count is the
    transformers model's (built on the meta device: no memory) less the tower's unused last block."""
    from oobleck_mm.config import load_config
    from oobleck_mm.config.shape import model_param_count
    from oobleck_mm.planning.planner import plan_job
    from oobleck_mm.profiling.load import load_profile

    job = load_config("configs/llava_1.5_7b.yaml")
    specs = model_layer_specs(job)
    config = transformers.AutoConfig.from_pretrained("configs/hf/llava-1.5-7b")
    with torch.device("meta"):
        model = transformers.LlavaForConditionalGeneration(config)
    unused = sum(p.numel() for n, p in model.named_parameters() if ".encoder.layers.23." in n or "post_layernorm" in n)
    real = sum(p.numel() for p in model.parameters()) - unused
    assert 7.0e9 < real < 7.1e9
    assert abs(model_param_count(specs) - real) / real < 0.001  # biases of CLIP: the planner omits them
    result = plan_job(job, load_profile(job), [f"node{i}" for i in range(8)])
    assert len(result.plan.pipelines) >= 2


def test_freezing_one_half_of_a_tied_embedding_is_refused(models):
    with pytest.raises(ConfigError, match=r"model\.frozen: freezes llm\.head but not its tied partner"):
        config_from_dict(
            {
                "model": {"huggingface": models[("qwen2", None, True)], "frozen": ["llm.head"]},
                "data": {"mean_text_tokens": 16, "max_seq_len": 96},
            }
        )


def test_frozen_modules_of_an_hf_model(models):
    job = config_from_dict(
        {
            "model": {"huggingface": models[("llama", "clip", False)], "frozen": ["vision"]},
            "data": {"mean_text_tokens": 16, "max_seq_len": 96, "mean_images_per_sample": 1, "image_size": 32},
        }
    )
    specs = model_layer_specs(job)
    trainable = {
        s.name: any(p.requires_grad for p in build_layer(job, i, specs).parameters()) for i, s in enumerate(specs)
    }
    assert trainable == {
        "vision.embed": False,
        "vision.block0": False,
        "vision.block1": False,
        "vision.projector0": True,
        "vision.projector1": True,
        "llm.embed": True,
        "llm.block0": True,
        "llm.block1": True,
        "llm.block2": True,
        "llm.block3": True,
        "llm.head": True,
    }


# --------------------------------------------------------------------------- llava_json with the model's tokenizer

FIXTURE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "llava", "llava.json")


def llava_json_job(directory, path=FIXTURE, **data):
    """A worker's job: the data's planning shape measured, as the master does before it ships the job.
    ``directory``: an HF model directory, or a composition's parts."""
    from oobleck_mm.data.check import ensure_shape

    job = config_from_dict(
        {
            "model": {"huggingface": directory if isinstance(directory, dict) else str(directory)},
            "data": {"kind": "llava_json", "path": str(path), "max_seq_len": 128, **data},
            "training": {"global_batch": 3, "microbatch_size": 3, "dtype": "float64"},
        }
    )
    ensure_shape(job, progress=lambda line: None)
    return job


def test_llava_json_uses_the_models_tokenizer_template_and_image_processor(models):
    from PIL import Image

    directory = models[("llama", "clip", False)]
    data = TrainingData(llava_json_job(directory))
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    sample = data.dataset[0]
    messages = [
        {"role": "user", "content": "<image>\nWhat is in the picture?"},
        {"role": "assistant", "content": "A red square."},
    ]
    assert sample.tokens.tolist() == tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
    assert tokenizer.decode(sample.tokens[sample.targets]) == " A red square.</s>"  # the answer and its end
    assert data.dataset.meta(0).loss_tokens == int(sample.targets.sum())
    processor = transformers.AutoImageProcessor.from_pretrained(directory, backend="pil")
    image = Image.open(os.path.join(os.path.dirname(FIXTURE), "images", "red_square.png")).convert("RGB")
    assert torch.equal(sample.images[0], processor(image, return_tensors="pt")["pixel_values"][0])
    batch = data.microbatch([0, 1, 2])
    assert batch.num_loss_tokens == sum(data.dataset.meta(i).loss_tokens for i in range(3))
    assert batch.vision.features.shape[0] == 3 * 16  # three images of 4x4 patches, expanded in the sequence


def test_llava_json_batch_through_the_split_model_equals_transformers(models):
    directory = models[("llama", "clip", False)]
    job = llava_json_job(directory)
    specs = model_layer_specs(job)
    layers = [build_layer(job, i, specs) for i in range(len(specs))]
    data = TrainingData(job)
    batch = data.microbatch([0, 1, 2])
    acts = ()
    for layer in layers:
        acts = layer(acts, batch)
    hf = unsplit(directory)
    for seg, (start, end) in enumerate(batch.spans()):
        sample = data.dataset[seg]
        ids = []
        for t, is_image in zip(sample.tokens.tolist(), sample.media.tolist()):
            ids += [t] * 16 if is_image else [t]
        kwargs = {"pixel_values": torch.stack(sample.images).double()} if sample.images else {}
        logits = hf(input_ids=torch.tensor([ids]), **kwargs).logits[0]
        assert (logits - acts[0][start:end]).abs().max().item() <= 1e-10


def test_llava_json_bad_input_names_the_file_or_sample(tmp_path, models):
    import shutil

    directory = tmp_path / "no_tokenizer"
    shutil.copytree(models[("llama", "clip", False)], directory)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        os.remove(directory / f)
    with pytest.raises(UserError, match=r"no_tokenizer has no tokenizer files .*model's own tokenizer"):
        TrainingData(llava_json_job(directory))
    with pytest.raises(UserError, match=r"sample 'shape-pair': its 2 images take 32 LLM tokens.*max_seq_len \(30\)"):
        TrainingData(llava_json_job(models[("llama", "clip", False)], max_seq_len=30, mean_text_tokens=8))


def _same_samples(a, b) -> None:
    assert len(a) == len(b) and a.skipped == b.skipped
    for i in range(len(a)):
        x, y = a[i], b[i]
        assert a.meta(i) == b.meta(i) and a.sample_id(i) == b.sample_id(i)
        assert x.tokens.dtype == y.tokens.dtype == torch.int64 and torch.equal(x.tokens, y.tokens)
        assert torch.equal(x.media, y.media) and torch.equal(x.targets, y.targets)
        assert all(torch.equal(p, q) for p, q in zip(x.images, y.images)) and len(x.images) == len(y.images)


def test_the_tokenized_records_are_built_once_and_mapped_after_and_a_change_is_another_cache(models, tmp_path):
    """Issue 30 item 4: the node's first rank tokenizes, the others and joiners map its arrays. Whatever the
    records depend on is in the key: another max_seq_len, a touched JSON file are built afresh."""
    import shutil

    from oobleck_mm.data.loader import build_dataset

    path = tmp_path / "data.json"
    shutil.copy(FIXTURE, path)
    shutil.copytree(os.path.join(os.path.dirname(FIXTURE), "images"), tmp_path / "images")
    directory = models[("llama", "clip", False)]
    cache = str(tmp_path / "cache")
    shape = {"mean_text_tokens": 20, "mean_images_per_sample": 1}  # given: no measuring pass of its own

    def job(**data):
        return llava_json_job(directory, path=path, **shape, **data)

    first = build_dataset(job(cache_dir=cache))
    second = build_dataset(job(cache_dir=cache))
    uncached = build_dataset(job(cache_dir=None))
    assert first.built and not second.built and first.cache_folder == second.cache_folder
    assert uncached.cache_folder is None
    _same_samples(first, uncached)
    _same_samples(second, uncached)
    assert isinstance(second._records[0].tokens, np.memmap), "mapped, not read into each rank's memory"
    shorter = build_dataset(job(cache_dir=cache, max_seq_len=40))
    assert shorter.built and shorter.cache_folder != first.cache_folder
    os.utime(path, ns=(1, 1))  # the file changed (its modification time is in the key)
    touched = build_dataset(job(cache_dir=cache))
    assert touched.built and touched.cache_folder not in (first.cache_folder, shorter.cache_folder)
    assert sorted(os.listdir(cache)) == sorted(
        os.path.basename(f) + suffix
        for f in (first.cache_folder, shorter.cache_folder, touched.cache_folder)
        for suffix in ("", ".lock")
    ), "no .tmp folder left"
