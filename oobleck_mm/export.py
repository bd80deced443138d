"""``oobleck-launch export``: an engine checkpoint as a HuggingFace model directory.

    oobleck-launch export --checkpoint DIR --to OUT [--dtype bfloat16|float16|float32|float64]

Any checkpoint the engine writes (``--save-final``, a periodic or a restart
checkpoint) of a ``model.huggingface`` job becomes a directory that
``from_pretrained(OUT)`` loads: the source directory's config.json (and
generation config, tokenizer and processor files) copied, and the weights as
safetensors, sharded with an index above ``--max-shard-size``.

A composed model (``model.huggingface: {vision, llm, projector}``) comes back as one directory per
part, ``OUT/vision``, ``OUT/llm`` and ``OUT/projector``, each from its own source directory.

Tensor names follow the source directory's files (so a model from the Hub comes
back with the names it came with); tensors the engine never runs (a CLIP tower's
layers after ``vision_feature_layer``, its post-layernorm) are copied from
there unchanged (a source without weights has none to copy: ``from_pretrained`` initialises
those unused tensors itself and says so). Values are bit-equal to the checkpoint, cast to the dtype of the
source's weights (the checkpoint's own dtype when the source has none) unless
``--dtype`` names another.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from oobleck_mm.config import config_from_dict
from oobleck_mm.config.huggingface import PROJECTOR_TYPE
from oobleck_mm.errors import UserError
from oobleck_mm.model.hf_weights import INDEX_FILE, hf_weights
from oobleck_mm.model.huggingface import build_hf_layer
from oobleck_mm.model.layers import model_layer_specs
from oobleck_mm.precision import torch_dtype
from oobleck_mm.runtime.checkpoint import load_params
from oobleck_mm.runtime.checkpoint_meta import check_layer_files, read_meta

DTYPES = ("float32", "float64", "bfloat16", "float16")
COPIED_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.json",
    "chat_template.jinja",
    "preprocessor_config.json",
    "processor_config.json",
)


def export_checkpoint(
    checkpoint: str | os.PathLike,
    out: str | os.PathLike,
    dtype: str | None = None,
    max_shard_size: str = "5GB",
    progress: Callable[[str], None] | None = None,
) -> dict:
    """Writes the HF directory; returns ``{"tensors", "bytes", "files"}``."""
    say = progress or (lambda line: None)
    checkpoint, out = Path(checkpoint), Path(out)
    meta = read_meta(checkpoint)
    check_layer_files(checkpoint, meta)
    if dtype is not None and dtype not in DTYPES:
        raise UserError(f"--dtype: {dtype!r} is not one of {', '.join(DTYPES)}")
    model = (meta.get("config") or {}).get("model") or {}
    source = model.get("huggingface")
    if not source:
        raise UserError(
            f"{checkpoint}: a checkpoint of a built-in model (model.name {model.get('name')!r}); "
            "export writes HuggingFace directories of model.huggingface jobs"
        )
    for part, directory in source.items() if isinstance(source, dict) else [("", source)]:
        if not os.path.isdir(directory):
            key = f"model.huggingface.{part}" if part else "model.huggingface"
            raise UserError(
                f"{checkpoint}: its {key} directory {directory!r} is gone; export copies its "
                f"config.json and tokenizer files (restore it, or edit meta.json's config.{key})"
            )
    job = config_from_dict(meta["config"], source=str(checkpoint / "meta.json"))
    if out.exists() and not out.is_dir():  # iterdir() on a file was an internal error (exit 1)
        raise UserError(f"--to: {out} exists and is a file; choose a new directory")
    if out.exists() and any(out.iterdir()):
        raise UserError(f"--to: {out} exists and is not empty; choose a new directory")
    specs = model_layer_specs(job)
    if [s.name for s in specs] != meta["layer_names"]:
        raise UserError(f"{checkpoint}: its layers differ from the model in {source} (config.json changed?)")

    shape = job.model.hf
    # Where each component goes: the one directory, or a composition's part directories.
    target_of = (
        {
            "vision": out / "vision",
            "audio": out / "audio",
            "projector": out / "projector",
            "audio_projector": out / "projector",
            "text": out / "llm",
            "head": out / "llm",
        }
        if shape.composed
        else {c: out for c in ("vision", "projector", "text", "head")}
    )
    parts: dict[Path, dict[str, torch.Tensor]] = {}
    sources: dict[Path, str | None] = {}
    for index, spec in enumerate(specs):
        with torch.device("meta"):  # only the names: no memory, no init work
            skeleton = build_hf_layer(shape, specs, index, torch.float32)
        params = load_params(checkpoint, spec.name)
        for local, (component, inside) in skeleton.hf_names().items():
            directory = shape.source(component)
            weights = hf_weights(directory) if directory is not None else None
            name = weights.name(component, inside) if weights else _default_name(shape, component, inside)
            parts.setdefault(target_of[component], {})[name] = params[local]
            sources[target_of[component]] = directory
        say(f"  {spec.name}: {len(params)} tensors")
    target = torch_dtype(dtype) if dtype else None
    totals = {"tensors": 0, "bytes": 0, "files": []}
    for where, tensors in parts.items():
        directory = sources[where]
        weights = hf_weights(directory) if directory is not None else None
        if weights:  # what the engine does not run stays as it came (see the module docstring)
            untouched = sorted(set(weights.file_of) - set(tensors))
            tensors.update(weights.tensors(untouched))
        source_dtypes = _source_dtypes(weights) if weights else {}
        for name, value in tensors.items():
            cast = target or source_dtypes.get(name) or value.dtype
            tensors[name] = value.to(cast).contiguous()
        where.mkdir(parents=True, exist_ok=True)
        files = _write_safetensors(tensors, where, max_shard_size)
        if directory is not None:
            for name in COPIED_FILES:
                if os.path.exists(os.path.join(directory, name)):
                    shutil.copy2(os.path.join(directory, name), where / name)
        if shape.composed and where == target_of["projector"]:
            (where / "config.json").write_text(json.dumps(_projector_config(shape), indent=2, sort_keys=True))
        if target is not None:
            _set_config_dtype(where / "config.json", dtype)
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        say(f"wrote {len(tensors)} tensors ({total / 2**20:.1f} MiB) in {len(files)} file(s) to {where}")
        totals["tensors"] += len(tensors)
        totals["bytes"] += total
        totals["files"] += [str((where / f).relative_to(out)) for f in files]
    return totals


def _projector_config(shape) -> dict:
    """A composition's projector directory's config.json (``config.huggingface.composed_model_shape`` reads it)."""
    out = {
        "model_type": PROJECTOR_TYPE,
        "architectures": ["LlavaMultiModalProjector"],
        "projector_hidden_act": shape.projector_act,
        "multimodal_projector_bias": shape.projector_bias,
        "text_hidden_size": shape.text["hidden_size"],
    }
    if shape.vision is not None:
        out["vision_hidden_size"] = shape.vision["hidden_size"]
    if shape.audio is not None:
        out["audio_hidden_size"] = shape.audio["d_model"]
    return out


# In-memory names of transformers 5 (what from_pretrained loads directly) for a source without weights.
_DEFAULT_PREFIXES = {
    "llava": {
        "text": "model.language_model.",
        "head": "lm_head.",
        "vision": "model.vision_tower.",
        "projector": "model.multi_modal_projector.",
    },
    "text": {"text": "model.", "head": "lm_head."},
    # a composition's parts: a CausalLM's, a vision tower's (CLIPVisionModel, as transformers 5 saves it)
    # and the projector's own names
    "composition": {
        "text": "model.",
        "head": "lm_head.",
        "vision": "",
        "audio": "model.encoder.",
        "projector": "vision.",
        "audio_projector": "audio.",
    },
}


def _default_name(shape, component: str, inside: str) -> str:
    kind = "composition" if shape.composed else "llava" if shape.is_multimodal else "text"
    return _DEFAULT_PREFIXES[kind][component] + inside


def _source_dtypes(weights) -> dict[str, torch.dtype]:
    from safetensors import safe_open

    out: dict[str, torch.dtype] = {}
    for file in sorted(set(weights.file_of.values())):
        with safe_open(os.path.join(weights.directory, file), framework="pt") as fh:
            for key in fh.keys():
                out[key] = _SAFETENSORS_DTYPES[fh.get_slice(key).get_dtype()]
    return out


_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def _write_safetensors(tensors: dict[str, torch.Tensor], out: Path, max_shard_size: str) -> list[str]:
    """The shards and index transformers writes (``split_torch_state_dict_into_shards`` decides the split)."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    split = split_torch_state_dict_into_shards(tensors, max_shard_size=max_shard_size)
    for file, names in split.filename_to_tensors.items():
        tmp = out / f"{file}.tmp"
        save_file({n: tensors[n] for n in names}, tmp, metadata={"format": "pt"})
        os.replace(tmp, out / file)
    if split.is_sharded:
        index = {
            "metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
            "weight_map": split.tensor_to_filename,
        }
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True))
    return sorted(split.filename_to_tensors)


def _set_config_dtype(path: Path, dtype: str) -> None:
    config = json.loads(path.read_text())
    config["dtype"] = dtype
    for sub in ("text_config", "vision_config"):
        if isinstance(config.get(sub), dict):
            config[sub]["dtype"] = dtype
    path.write_text(json.dumps(config, indent=2, sort_keys=True))
