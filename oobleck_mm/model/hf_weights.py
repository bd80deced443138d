"""Reading a layer's tensors from an HF directory's safetensors files, and where each tensor lives there.

A worker builds only its own stage's layers, so it reads only their tensors:
``safe_open`` maps the file and ``get_tensor`` copies just the bytes of that
tensor (the index of a sharded checkpoint says which file holds which name).

Checkpoints name the same tensor differently across transformers versions
(``language_model.model.layers.0...`` in LLaVA checkpoints on the Hub,
``model.language_model.layers.0...`` in transformers 5's in-memory names), so
each component (text body, LM head, vision tower, projector) is located once by
probing for one tensor it must have, and a layer's names are that prefix plus
the names inside the component (``HFLayer.hf_names``).
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Mapping

import torch

from oobleck_mm.errors import UserError

INDEX_FILE = "model.safetensors.index.json"

# component -> (tensor every checkpoint of it has, candidate prefixes in the order tried)
_PROBES = {
    "text": ("embed_tokens.weight", ("model.language_model.", "language_model.model.", "model.", "language_model.")),
    "head": ("weight", ("lm_head.", "language_model.lm_head.")),
    "vision": (
        "embeddings.patch_embedding.weight",
        (
            "model.vision_tower.vision_model.",
            "model.vision_tower.",
            "vision_tower.vision_model.",
            "vision_tower.",
            "vision_model.",  # a CLIPVisionModel / SiglipVisionModel saved by transformers 4, or a CLIPModel
            "",  # a CLIPVisionModel / SiglipVisionModel saved by transformers 5 (its tower's own names)
        ),
    ),
    # "vision." / "audio.": a composition's projector directory holds each encoder's projector under its name
    "projector": ("linear_1.weight", ("model.multi_modal_projector.", "multi_modal_projector.", "vision.")),
    "audio_projector": ("linear_1.weight", ("audio.",)),
    "audio": ("conv1.weight", ("model.encoder.", "encoder.")),  # a Whisper checkpoint's encoder
}


class HFWeights:
    """The safetensors files of one HF model directory: which file holds which tensor."""

    def __init__(self, directory: str):
        self.directory = directory
        self.file_of = _tensor_files(directory)
        self._prefixes: dict[str, str] = {}

    def __bool__(self) -> bool:
        return bool(self.file_of)

    def prefix(self, component: str) -> str:
        if component not in self._prefixes:
            self._prefixes[component] = component_prefix(component, self.file_of, self.directory)
        return self._prefixes[component]

    def name(self, component: str, inside: str) -> str:
        return self.prefix(component) + inside

    def read(
        self, names: Mapping[str, tuple[str, str]], expected: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """``{local name: tensor}`` for ``names`` (local -> (component, inside)), checked against ``expected``'s shapes."""
        keys = {}
        for local, (component, inside) in names.items():
            key = self.name(component, inside)
            if key not in self.file_of:
                raise UserError(f"{self.directory}: no tensor {key!r} in the safetensors files (needed for {local!r})")
            keys[key] = local
        tensors = self.tensors(keys)
        out = {}
        for key, local in keys.items():
            want = tuple(expected[local].shape)
            if tuple(tensors[key].shape) != want:
                path = os.path.join(self.directory, self.file_of[key])
                raise UserError(
                    f"{path}: tensor {key!r} has shape {list(tensors[key].shape)}, the model's "
                    f"config.json makes it {list(want)}"
                )
            out[local] = tensors[key]
        return out

    def tensors(self, keys) -> dict[str, torch.Tensor]:
        """``{name: tensor}`` of the files' tensors ``keys``, each file opened once, only those bytes read."""
        from safetensors import SafetensorError, safe_open

        by_file: dict[str, list[str]] = {}
        for key in keys:
            by_file.setdefault(self.file_of[key], []).append(key)
        out: dict[str, torch.Tensor] = {}
        for file, names in by_file.items():
            path = os.path.join(self.directory, file)
            try:
                with safe_open(path, framework="pt") as fh:
                    out.update({key: fh.get_tensor(key) for key in names})
            except FileNotFoundError:
                raise UserError(f"{path}: safetensors shard missing (listed in {INDEX_FILE})") from None
            except (SafetensorError, OSError, RuntimeError) as exc:
                raise UserError(f"{path}: unreadable safetensors file, truncated or damaged ({exc})") from None
        return out


def component_prefix(component: str, names, where: str) -> str:
    """Where ``component`` sits among the tensor ``names`` (a checkpoint's, or a model's state dict)."""
    probe, candidates = _PROBES[component]
    for prefix in candidates:
        if prefix + probe in names:
            return prefix
    wanted = " or ".join(p + probe for p in candidates)
    raise UserError(f"{where}: no tensor {wanted}; is this the model config.json describes?")


def hf_name(names, component: str, inside: str, where: str = "the model") -> str:
    """The full name of a component's tensor among ``names``."""
    return component_prefix(component, names, where) + inside


@functools.lru_cache(maxsize=8)
def hf_weights(directory: str) -> HFWeights:
    return HFWeights(directory)


def layer_has_weights(layer_components, shape) -> bool:
    """Whether every component a layer is made of has a directory with weights (``shape``: the model's
    ``HFModelShape``): a composition's projector may have none, and any part may be config-only."""
    return all((d := shape.source(c)) is not None and bool(hf_weights(d)) for c in layer_components)


def load_hf_weights(layer, shape) -> bool:
    """Copies the layer's tensors from the weights of its components' directories (``shape.source``: one
    directory, or a composition's parts); False when they have none (random init stays).

    Copied, not assigned (``load_state_dict(assign=True)``): ``get_tensor`` returns a view of the
    file's private mapping, so an assigned parameter would keep the user's file mapped for the whole
    run (each page read at its first use, a replaced or truncated file a SIGBUS mid-training). The
    mapping's pages are freed with the view once the copy is done."""
    names = layer.hf_names()
    if not layer_has_weights({c for c, _ in names.values()}, shape):
        return False
    state = layer.state_dict()
    by_directory: dict[str, dict[str, tuple[str, str]]] = {}
    for local, (component, inside) in names.items():
        by_directory.setdefault(shape.source(component), {})[local] = (component, inside)
    with torch.no_grad():
        for directory, part in by_directory.items():
            for name, value in hf_weights(directory).read(part, state).items():
                state[name].copy_(value)
    return True


def _tensor_files(directory: str) -> dict[str, str]:
    """tensor name -> file (relative to ``directory``); empty when the directory has no weights."""
    index = os.path.join(directory, INDEX_FILE)
    if os.path.exists(index):
        try:
            with open(index, encoding="utf-8") as fh:
                weight_map = json.load(fh)["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise UserError(f"{index}: not a readable safetensors index ({exc!r})") from None
        missing = sorted({f for f in weight_map.values() if not os.path.exists(os.path.join(directory, f))})
        if missing:
            raise UserError(f"{directory}: safetensors shard {missing[0]} is missing (listed in {INDEX_FILE})")
        return dict(weight_map)
    files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
    out: dict[str, str] = {}
    for file in files:
        out.update({key: file for key in _header_keys(os.path.join(directory, file))})
    return out


def _header_keys(path: str) -> list[str]:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, framework="pt") as fh:
            return list(fh.keys())
    except (SafetensorError, OSError, RuntimeError) as exc:
        raise UserError(f"{path}: unreadable safetensors file, truncated or damaged ({exc})") from None
