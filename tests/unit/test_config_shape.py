"""Models as layer lists: order, token counts from the workload, frozen names, parameter counts."""

from __future__ import annotations

import os

import pytest

from oobleck_mm.config import DataConfig, LLMConfig, ModelConfig, ProjectorConfig, VisionConfig, load_config
from oobleck_mm.config.shape import layer_specs, model_param_count, param_count, resolve_frozen, sequence_tokens

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def job(name: str):
    return load_config(os.path.join(ROOT, "configs", f"{name}.yaml"))


def specs_of(name: str):
    j = job(name)
    return layer_specs(j.model, j.data)


def test_layer_order_vision_audio_then_llm():
    names = [s.name for s in specs_of("tiny_mm_audio")]
    assert names == [
        "vision.embed",
        "vision.block0",
        "vision.block1",
        "vision.projector",
        "audio.embed",
        "audio.block0",
        "audio.block1",
        "audio.projector",
        "llm.embed",
        "llm.block0",
        "llm.block1",
        "llm.block2",
        "llm.block3",
        "llm.head",
    ]
    kinds = [s.kind for s in specs_of("tiny_mm_audio")]
    assert kinds[0] == "patch_embed" and kinds[4] == "frame_embed" and kinds[8] == "token_embed"
    assert kinds[-1] == "lm_head" and kinds[3] == kinds[7] == "projector"


def test_modalities_projectors_belong_to_their_encoder():
    by_name = {s.name: s.modality for s in specs_of("tiny_mm_audio")}
    assert by_name["vision.projector"] == "vision" and by_name["audio.projector"] == "audio"
    assert {by_name[n] for n in by_name if n.startswith("llm.")} == {"text"}


def test_text_only_model_is_embed_blocks_head():
    names = [s.name for s in specs_of("gpt3_2.7b")]
    assert names[0] == "llm.embed" and names[-1] == "llm.head" and len(names) == 34


def test_two_layer_projector_is_two_cuttable_layers():
    j = job("tiny_mm")
    model = ModelConfig(name="m", llm=j.model.llm, vision=j.model.vision, projector=ProjectorConfig(num_layers=2))
    specs = {s.name: s for s in layer_specs(model, j.data)}
    first, second = specs["vision.projector0"], specs["vision.projector1"]
    assert "vision.projector" not in specs
    assert (first.in_features, first.hidden) == (32, 64)  # encoder width -> LLM width
    assert (second.in_features, second.hidden) == (64, 64)


def test_token_counts_follow_the_workload_shape():
    j = job("tiny_mm_audio")
    specs = {s.name: s for s in layer_specs(j.model, j.data)}
    # sides of 16..32 px in whole 8-px patches (2, 3 or 4 patches), drawn independently: mean 3 x 3
    patches = 3.0**2
    assert specs["vision.block0"].tokens_per_sample == 1 * patches
    assert specs["vision.block0"].attention_len == patches and not specs["vision.block0"].causal
    frames = 0.32 * 100 / 4
    assert specs["audio.block0"].tokens_per_sample == pytest.approx(frames)
    assert specs["audio.embed"].in_features == 16 * 4  # mel bins x frames folded per token
    llm_tokens = 16 + patches + frames
    for name in ("llm.embed", "llm.block2", "llm.head"):
        assert specs[name].tokens_per_sample == pytest.approx(llm_tokens)
    assert specs["llm.block0"].attention_len == pytest.approx(llm_tokens) and specs["llm.block0"].causal
    assert specs["vision.embed"].in_features == 3 * 8 * 8


def test_token_merge_shrinks_what_the_llm_sees_but_not_the_encoder():
    j = job("cornstarch_mllm_sss")
    tokens = sequence_tokens(j.model, j.data)
    assert tokens.vision_encoder == 69 * 69 and tokens.vision_llm == pytest.approx(69 * 69 / 4)
    assert tokens.audio_encoder == pytest.approx(120 * 100 / 8)
    assert tokens.llm == pytest.approx(1000 + 69 * 69 / 4 + 1500)
    specs = {s.name: s for s in layer_specs(j.model, j.data)}
    assert specs["vision.projector0"].in_features == 1280 * 4
    assert specs["vision.projector0"].tokens_per_sample == pytest.approx(tokens.vision_llm)


def test_more_images_mean_proportionally_more_vision_work():
    j = job("tiny_mm")
    double = DataConfig(
        mean_text_tokens=16,
        mean_images_per_sample=2,
        image_size=32,
        min_image_size=16,
        max_images_per_sample=3,
        max_seq_len=128,
    )
    one = {s.name: s for s in layer_specs(j.model, j.data)}
    two = {s.name: s for s in layer_specs(j.model, double)}
    assert two["vision.block0"].tokens_per_sample == 2 * one["vision.block0"].tokens_per_sample
    # Attention stays within an image: its span does not grow with the image count.
    assert two["vision.block0"].attention_len == one["vision.block0"].attention_len
    assert two["llm.block0"].tokens_per_sample == one["llm.block0"].tokens_per_sample + 9  # one more mean image


# --------------------------------------------------------------------------- frozen names


def _many_block_model():
    llm = LLMConfig(num_layers=12, hidden=16, num_heads=2, vocab_size=32)
    vision = VisionConfig(num_layers=2, hidden=16, num_heads=2, patch_size=8)
    model = ModelConfig(name="m", llm=llm, vision=vision, projector=ProjectorConfig(num_layers=2))
    data = DataConfig(mean_images_per_sample=1, image_size=16, mean_text_tokens=4)
    return layer_specs(model, data)


def test_module_names_cover_their_layers_and_nothing_else():
    specs = _many_block_model()
    assert resolve_frozen(["vision"], specs) == {"vision.embed", "vision.block0", "vision.block1"}
    assert resolve_frozen(["projector"], specs) == {"vision.projector0", "vision.projector1"}
    llm = resolve_frozen(["llm"], specs)
    assert llm == {s.name for s in specs if s.modality == "text"} and len(llm) == 14
    assert resolve_frozen([], specs) == frozenset()


def test_layer_names_are_exact_not_prefixes():
    specs = _many_block_model()
    assert resolve_frozen(["llm.block1"], specs) == {"llm.block1"}  # not llm.block10 / llm.block11
    assert resolve_frozen(["vision.projector"], specs) == {"vision.projector0", "vision.projector1"}
    assert len(resolve_frozen(["llm.block"], specs)) == 12
    assert resolve_frozen(["llm.head", "vision"], specs) == {
        "llm.head",
        "vision.embed",
        "vision.block0",
        "vision.block1",
    }


@pytest.mark.parametrize("entry", ["audio", "llm.block12", "vision.blk", "llm.", "everything"])
def test_frozen_names_that_cover_nothing_are_rejected(entry):
    with pytest.raises(ValueError, match=repr(entry)):
        resolve_frozen([entry], _many_block_model())


# --------------------------------------------------------------------------- parameter counts


def test_block_parameter_formula_on_a_hand_counted_block():
    specs = {s.name: s for s in specs_of("tiny_mm")}
    # h=64, ffn=256: q,k,v,o 4*64*64 + ffn 2*64*256 + two norms 2*64
    assert param_count(specs["llm.block0"]) == 4 * 64 * 64 + 2 * 64 * 256 + 2 * 64
    assert param_count(specs["llm.embed"]) == 256 * 64
    assert param_count(specs["llm.head"]) == 64 * 256 + 64
    assert param_count(specs["vision.embed"]) == 3 * 8 * 8 * 32 + 32
    assert param_count(specs["vision.projector"]) == 32 * 64 + 64


def test_grouped_query_attention_and_gated_ffn_counts():
    llm = LLMConfig(num_layers=1, hidden=64, num_heads=8, num_kv_heads=2, ffn_hidden=100, vocab_size=10, gated_ffn=True)
    spec = layer_specs(ModelConfig(name="m", llm=llm), DataConfig(mean_text_tokens=4))[1]
    # q,o: 2*64*64; k,v: 2*64*16 (2 of 8 heads); gated FFN: 3*64*100; norms 2*64
    assert param_count(spec) == 2 * 64 * 64 + 2 * 64 * 16 + 3 * 64 * 100 + 2 * 64


def test_tied_embeddings_are_counted_once():
    j = job("cornstarch_mllm_sss")
    specs = layer_specs(j.model, j.data)
    head = next(s for s in specs if s.kind == "lm_head")
    assert head.tied_embedding
    assert model_param_count(specs) == sum(param_count(s) for s in specs) - head.hidden * head.vocab_size


def _module_params(specs, prefix):
    return sum(param_count(s) for s in specs if s.name.startswith(prefix) and s.kind != "projector")


@pytest.mark.parametrize(("config", "total"), [("gpt3_2.7b", 2.7e9), ("gpt3_6.7b", 6.7e9)])
def test_gpt3_sizes_within_5_percent(config, total):
    assert model_param_count(specs_of(config)) == pytest.approx(total, rel=0.05)


@pytest.mark.parametrize(
    ("config", "total", "llm", "vision", "audio"),
    # OrchMLLM Table 1 (rounded there to 0.1-1B): LLM, vision, audio, and the total in the name.
    [("mllm_10b", 10e9, 7e9, 2e9, 0.6e9), ("mllm_18b", 18e9, 14e9, 3e9, 0.6e9), ("mllm_84b", 84e9, 72e9, 6e9, 6e9)],
)
def test_orchmllm_sizes_near_table_1(config, total, llm, vision, audio):
    specs = specs_of(config)
    assert model_param_count(specs) == pytest.approx(total, rel=0.05)
    # The table rounds to whole billions: Qwen2-7B is 7.6B, the 2B ViT 1.8B.
    assert _module_params(specs, "llm.") == pytest.approx(llm, rel=0.10)
    assert _module_params(specs, "vision.") == pytest.approx(vision, rel=0.10)
    assert _module_params(specs, "audio.") == pytest.approx(audio, rel=0.10)


@pytest.mark.parametrize(
    ("config", "llm", "vision", "audio"),
    # Cornstarch Table 3.1. Its "1b" Llama-3 small is Llama-3.2-1B, 1.24B with tied embeddings.
    [
        ("cornstarch_mllm_sss", 1.24e9, 0.6e9, 0.5e9),
        ("cornstarch_mllm_mmm", 8e9, 3.9e9, 3.4e9),
        ("cornstarch_mllm_lll", 32e9, 11.6e9, 12.4e9),
    ],
)
def test_cornstarch_sizes_near_table_3_1(config, llm, vision, audio):
    specs = specs_of(config)
    llm_unique = model_param_count([s for s in specs if s.name.startswith("llm.")])
    assert llm_unique == pytest.approx(llm, rel=0.05)
    assert _module_params(specs, "vision.") == pytest.approx(vision, rel=0.06)
    assert _module_params(specs, "audio.") == pytest.approx(audio, rel=0.06)
