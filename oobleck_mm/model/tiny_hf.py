"""Small random HuggingFace models saved with ``save_pretrained``: the examples' and the tests' models.

Nothing is downloaded: each model is made from a ``transformers`` config with
random weights and written as config.json + safetensors, exactly the directory
layout a user's pretrained model has. ``examples/make_tiny_llava.py`` is the
command-line front end.
"""

from __future__ import annotations

import functools

import os

import torch

TEXT_KINDS = ("llama", "mistral", "qwen2")
VISION_KINDS = ("clip", "siglip")


def tiny_text_config(kind: str, tie: bool = False, vocab_size: int = 320, **sizes):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    common = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab_size,
        tie_word_embeddings=tie,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    common.update(sizes)
    if kind == "llama":
        return LlamaConfig(**common)
    if kind == "mistral":
        return MistralConfig(**common, sliding_window=None)
    if kind == "qwen2":
        return Qwen2Config(**common, use_sliding_window=False)
    raise ValueError(f"text model {kind!r}: choose one of {', '.join(TEXT_KINDS)}")


def tiny_vision_config(kind: str, image_size: int = 32, patch_size: int = 8, **sizes):
    from transformers import CLIPVisionConfig, SiglipVisionConfig

    common = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=2,
        image_size=image_size,
        patch_size=patch_size,
    )
    common.update(sizes)
    if kind == "clip":
        return CLIPVisionConfig(**common)
    if kind == "siglip":
        return SiglipVisionConfig(**common)
    raise ValueError(f"vision tower {kind!r}: choose one of {', '.join(VISION_KINDS)}")


CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %}ASSISTANT: "
    "{{ m['content'] }}{{ eos_token }}{% else %}USER: {{ m['content'] }} {% endif %}{% endfor %}"
)
"""Vicuna's (LLaVA-1.5's) turn format."""


@functools.lru_cache(maxsize=None)
def _trained_bpe(vocab_size: int) -> str:
    """``tiny_tokenizer``'s BPE model, trained on its corpus, as ``tokenizers`` JSON."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [
        "What is in the picture? A red square, a blue circle and a green triangle. Name both shapes. "
        "What is 2 + 2? 4. The quick brown fox jumps over the lazy dog. USER: ASSISTANT:"
    ] * 20
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - 1,
        special_tokens=["<pad>", "<s>", "</s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    return tok.to_str()


def tiny_tokenizer(vocab_size: int = 320, image_token: bool = True):
    """A byte-level BPE tokenizer trained here (no download) on English-ish text, ``<image>`` as an added
    token (``image_token``; a text-only LM's has none), ids 0-2 ``<pad>``, ``<s>``, ``</s>`` as the tiny
    configs say, Vicuna's chat template. Trained once per process and size: the trainer breaks ties between
    equally frequent pairs in no fixed order, and a LLaVA's parts must tokenize as the LLaVA does."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer.from_str(_trained_bpe(vocab_size))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        chat_template=CHAT_TEMPLATE,
    )
    if image_token:
        fast.add_special_tokens({"additional_special_tokens": ["<image>"]})
    return fast


def tiny_image_processor(kind: str, side: int):
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
    from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

    if kind == "clip":
        return CLIPImageProcessorPil(size={"shortest_edge": side}, crop_size={"height": side, "width": side})
    return SiglipImageProcessorPil(size={"height": side, "width": side})


def make_tiny_model(
    out: str | os.PathLike,
    text: str = "llama",
    vision: str | None = "clip",
    tie: bool = False,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    max_shard_size: str | None = None,
    text_sizes: dict | None = None,
    vision_sizes: dict | None = None,
) -> str:
    """Writes a random LLaVA (``vision`` set) or text-only causal LM to ``out``; returns ``out``.

    ``text_sizes`` / ``vision_sizes`` override the tiny defaults (``hidden_size``, ``num_hidden_layers``,
    ``image_size`` ...): the benchmarks make larger ones."""
    from transformers import LlavaConfig, LlavaForConditionalGeneration, LlamaForCausalLM, MistralForCausalLM
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(seed)
    text_cfg = tiny_text_config(text, tie, **(text_sizes or {}))
    tokenizer = tiny_tokenizer(min(text_cfg.vocab_size, 320))
    if vision is None:
        cls = {"llama": LlamaForCausalLM, "mistral": MistralForCausalLM, "qwen2": Qwen2ForCausalLM}[text]
        model = cls(text_cfg)
    else:
        vision_cfg = tiny_vision_config(vision, **(vision_sizes or {}))
        cfg = LlavaConfig(
            vision_config=vision_cfg,
            text_config=text_cfg,
            image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
            tie_word_embeddings=tie,
            vision_feature_select_strategy="default" if vision == "clip" else "full",
        )
        model = LlavaForConditionalGeneration(cfg)
        tiny_image_processor(vision, vision_cfg.image_size).save_pretrained(os.fspath(out))
    model = model.to(dtype)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(os.fspath(out), **kwargs)
    tokenizer.save_pretrained(os.fspath(out))
    return os.fspath(out)


def tiny_whisper_config(**sizes):
    """A tiny Whisper: clips of 2 x 8 = 16 mel frames of 8 bins (0.16 s at 100 frames a second)."""
    from transformers import WhisperConfig

    common = dict(
        d_model=32,
        encoder_layers=2,
        encoder_attention_heads=2,
        encoder_ffn_dim=64,
        decoder_layers=1,
        decoder_attention_heads=2,
        decoder_ffn_dim=64,
        num_mel_bins=8,
        max_source_positions=8,
        max_target_positions=16,
        vocab_size=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=1,
        begin_suppress_tokens=None,
        suppress_tokens=None,
    )
    common.update(sizes)
    return WhisperConfig(**common)


def make_tiny_parts(
    out: str | os.PathLike,
    text: str = "llama",
    vision: str = "clip",
    tie: bool = False,
    seed: int = 0,
    audio: bool = False,
) -> tuple[str, dict[str, str]]:
    """A random tiny LLaVA at ``out/llava`` and the same model as separately saved parts, as a user's
    pretrained parts are: ``out/vision`` (a ``CLIPVisionModel``/``SiglipVisionModel``), ``out/llm`` (a causal
    LM with the tokenizer) and ``out/projector`` (the projector directory of a composition). Returns the
    LLaVA directory and ``{vision, llm, projector}``: a composition of the parts is the LLaVA (the vision part
    has its image processor, the LM's tokenizer no ``<image>``, as a text-only LM's). ``audio``: also
    ``out/audio``, a random tiny ``WhisperForConditionalGeneration`` (``tiny_whisper_config``), and its
    projector in ``out/projector`` (``{vision, audio, llm, projector}``; the LLaVA has no audio)."""
    import json

    from safetensors.torch import save_file
    from transformers import (
        AutoModelForCausalLM,
        CLIPVisionModel,
        LlavaForConditionalGeneration,
        SiglipVisionModel,
    )

    from oobleck_mm.config.huggingface import PROJECTOR_TYPE

    root = os.fspath(out)
    llava_dir = make_tiny_model(os.path.join(root, "llava"), text, vision, tie=tie, seed=seed)
    llava = LlavaForConditionalGeneration.from_pretrained(llava_dir)
    parts = {p: os.path.join(root, p) for p in ("vision", "llm", "projector")}
    tower_cls = CLIPVisionModel if vision == "clip" else SiglipVisionModel
    tower = tower_cls(llava.config.vision_config)
    tower.load_state_dict(llava.model.vision_tower.state_dict())
    tower.save_pretrained(parts["vision"])
    # A tower's checkpoint comes with its image processor (openai/clip-vit-*, google/siglip-*), as the LLaVA's.
    tiny_image_processor(vision, llava.config.vision_config.image_size).save_pretrained(parts["vision"])
    lm = AutoModelForCausalLM.from_config(llava.config.text_config)
    lm.model.load_state_dict(llava.model.language_model.state_dict())
    lm.lm_head.load_state_dict(llava.lm_head.state_dict())
    lm.save_pretrained(parts["llm"])
    # A causal LM pretrained on text: its tokenizer has no ``<image>`` (the LLaVA's added it).
    tiny_tokenizer(min(llava.config.text_config.vocab_size, 320), image_token=False).save_pretrained(parts["llm"])
    projector = llava.model.multi_modal_projector
    os.makedirs(parts["projector"], exist_ok=True)
    weights = {f"vision.{k}": v.contiguous() for k, v in projector.state_dict().items()}
    if audio:
        from transformers import WhisperForConditionalGeneration

        whisper_cfg = tiny_whisper_config()
        parts["audio"] = os.path.join(root, "audio")
        WhisperForConditionalGeneration(whisper_cfg).save_pretrained(parts["audio"])
        hidden = llava.config.text_config.hidden_size
        linear_1, linear_2 = torch.nn.Linear(whisper_cfg.d_model, hidden), torch.nn.Linear(hidden, hidden)
        for name, linear in (("linear_1", linear_1), ("linear_2", linear_2)):
            weights.update({f"audio.{name}.{k}": v.detach().contiguous() for k, v in linear.state_dict().items()})
    save_file(weights, os.path.join(parts["projector"], "model.safetensors"), metadata={"format": "pt"})
    config = {
        "model_type": PROJECTOR_TYPE,
        "architectures": ["LlavaMultiModalProjector"],
        "projector_hidden_act": llava.config.projector_hidden_act,
        "multimodal_projector_bias": llava.config.multimodal_projector_bias,
        "vision_hidden_size": llava.config.vision_config.hidden_size,
        "text_hidden_size": llava.config.text_config.hidden_size,
    }
    if audio:
        config["audio_hidden_size"] = tiny_whisper_config().d_model
    with open(os.path.join(parts["projector"], "config.json"), "w", encoding="utf-8") as fh:
        json.dump(config, fh, indent=2)
    return llava_dir, parts
