"""Measured per-layer profiler: runs each layer of a model on a real device and times it.

Owns ``profile_layers``, which turns a chain of torch modules into a
``ModelProfile`` (``source="measured"``) the planner consumes, and its on-disk
cache. The analytical model in ``oobleck_mm.profiling.analytical`` produces the
same ``ModelProfile`` without running anything.

What is measured per layer (one microbatch, the caller's ``example_input``):

* forward seconds, with autograd recording as in training;
* the backward split of Cornstarch eq. 3.1: ``B_d`` = ``torch.autograd.grad``
  of the output w.r.t. the layer's float inputs only, ``B_w`` = w.r.t. its
  parameters only, and the full backward w.r.t. both. The two partial
  backwards each redo the work both paths share (the autograd traversal, the
  backward of norms and activations), so ``B_w + B_d`` exceeds the full
  backward. We keep the measured split *ratio* and scale both so that
  ``B_w + B_d`` equals the measured full backward: a trainable layer whose
  input gradient is needed then costs exactly what it was measured to cost;
* bytes: parameters, gradients and Adam state of the trainable parameters,
  the activations saved for backward (``saved_tensors_hooks``), the output.

Parameter gradients are timed for every floating-point parameter, whatever its
``requires_grad`` (it is switched on for the measurement and restored), so a
profile stays valid when ``with_frozen`` later changes which layers train;
frozen status only decides ``trainable`` and the gradient/optimizer bytes.

The torch thread count is left as the caller set it. Modules are moved to
``device`` in place; the caller chooses train/eval mode (dropout).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from oobleck_mm.planning.costs import MODALITIES, LayerCost, ModelProfile

logger = logging.getLogger(__name__)

STATISTICS = ("median", "trimmed_mean")
"""Robust statistics ``profile_layers`` can summarize the timed runs with."""

_CACHE_FORMAT = 2
"""Bumped whenever the cached fields or their meaning change, so old files miss."""

_TRIM_FRACTION = 0.2
"""``trimmed_mean`` drops this fraction of the runs at each end (at least one each when >= 3 runs)."""

_ADAM_MOMENTS = 2
_FP32_BYTES = 4


@dataclass(frozen=True, slots=True)
class LayerMeasurement:
    """What one layer costs, before frozen status is applied (that happens in ``profile_layers``)."""

    forward_s: float
    backward_weight_s: float
    """B_w, scaled so that ``backward_weight_s + backward_input_s == backward_full_s``."""
    backward_input_s: float
    """B_d, scaled the same way; 0 when the layer has no float input."""
    backward_full_s: float
    """Measured backward w.r.t. float inputs and parameters together."""
    param_bytes: int
    grad_bytes: int
    """Bytes of the parameters with ``requires_grad``: their gradients when the layer trains."""
    optimizer_bytes: int
    """Adam state of those parameters when the layer trains (see ``_optimizer_bytes``)."""
    activation_bytes: int
    output_bytes: int
    input_bytes: int = 0
    """Bytes of the layer's inputs: what it keeps for backward when it recomputes its forward there."""


def profile_layers(
    layers: Sequence[tuple[str, str, torch.nn.Module]],
    example_input: torch.Tensor | tuple,
    *,
    microbatch_size: int,
    model_name: str,
    device: str = "cpu",
    warmup: int = 2,
    repeats: int = 5,
    statistic: str = "median",
    frozen: Sequence[str] = (),
    cache_dir: str | os.PathLike | None = None,
    config_key: Mapping | None = None,
    progress: Callable[[str], None] | None = None,
) -> ModelProfile:
    """Measures every layer of a chain and returns their costs as a ``ModelProfile``.

    ``layers`` is ``(name, modality, module)`` in execution order: layer i+1 is
    called with layer i's output (a tensor, or a tuple of tensors passed as
    ``*args``); the first layer gets ``example_input``, which must be one
    microbatch of ``microbatch_size`` samples. Layers whose name starts with
    one of ``frozen`` get ``trainable=False``. With ``cache_dir`` the profile
    is stored as JSON keyed by everything that changes the measurement
    (``config_key`` carries what the module shapes cannot show, e.g. sequence
    length or attention kernel); a later call with the same key loads it and
    runs nothing.
    """
    _validate(layers, microbatch_size, warmup, repeats, statistic, frozen)
    torch_device = _parse_device(device)
    inputs = _as_tensor_tuple(example_input, "example_input")
    names = [name for name, _, _ in layers]

    cache_path = None
    if cache_dir is not None:
        key = _cache_key(
            model_name, torch_device, microbatch_size, layers, inputs, config_key, warmup, repeats, statistic
        )
        cache_path = Path(cache_dir) / f"{_safe_file_part(model_name)}-{key}.json"
        measurements = _load_cache(cache_path, key, layers)
        if measurements is not None:
            _report(progress, f"loaded profile of {model_name} ({len(names)} layers) from {cache_path}")
            return _build_profile(model_name, torch_device, microbatch_size, layers, measurements, frozen)

    measurements = []
    current = tuple(t.to(torch_device) for t in inputs)
    for index, (name, _modality, module) in enumerate(layers):
        module.to(torch_device)
        try:
            measurement, current = measure_layer(
                module, current, device=str(torch_device), warmup=warmup, repeats=repeats, statistic=statistic
            )
        except ValueError as error:
            raise ValueError(f"layer {name!r}: {error}") from error
        measurements.append(measurement)
        _report(
            progress,
            f"profiled {index + 1}/{len(layers)} {name}: fwd {_ms(measurement.forward_s)}, "
            f"bwd_w {_ms(measurement.backward_weight_s)}, bwd_d {_ms(measurement.backward_input_s)}",
        )

    if cache_path is not None:
        _write_cache(cache_path, key, layers, measurements)
    return _build_profile(model_name, torch_device, microbatch_size, layers, measurements, frozen)


def measure_layer(
    module: torch.nn.Module,
    inputs: tuple[torch.Tensor, ...],
    *,
    device: str = "cpu",
    warmup: int = 2,
    repeats: int = 5,
    statistic: str = "median",
) -> tuple[LayerMeasurement, tuple[torch.Tensor, ...]]:
    """Measures one layer on ``inputs`` (already on ``device``).

    Returns the measurement and the layer's output, detached, as a tuple of
    tensors ready to feed the next layer.
    """
    leaves = tuple(_as_leaf(t) for t in inputs)
    float_inputs = [t for t in leaves if t.requires_grad]
    params = [p for p in module.parameters() if p.is_floating_point()]
    with _requiring_grad(params):
        outputs, activation_bytes = _forward_saving(module, leaves, _resident_storages(module))
        differentiable = [i for i, o in enumerate(outputs) if o.requires_grad]
        grad_outputs = _fixed_grad_outputs([outputs[i] for i in differentiable])
        outputs = tuple(o.detach() for o in outputs)  # frees this forward's graph before the timed runs
        targets = _backward_targets(float_inputs, params) if differentiable else {}

        def run_forward() -> tuple[torch.Tensor, ...]:
            return _as_tensor_tuple(module(*leaves), "layer output")

        samples: dict[str, list[float]] = {"forward": [], **{kind: [] for kind in targets}}
        # Targets are interleaved within each run so that machine noise hits all of them alike.
        for run in range(warmup + repeats):
            for kind, wrt in (targets or {"forward": []}).items():
                out, forward_s = _timed(run_forward, device)
                if wrt:
                    diff_out = [out[i] for i in differentiable]
                    _, backward_s = _timed(
                        lambda: torch.autograd.grad(diff_out, wrt, grad_outputs, allow_unused=True), device
                    )
                del out
                if run >= warmup:
                    samples["forward"].append(forward_s)
                    if wrt:
                        samples[kind].append(backward_s)

    summary = {kind: _summarize(values, statistic) for kind, values in samples.items() if values}
    weight_s, input_s, full_s = _reconcile(summary)
    trainable_params = [p for p in module.parameters() if p.requires_grad]
    measurement = LayerMeasurement(
        forward_s=summary["forward"],
        backward_weight_s=weight_s,
        backward_input_s=input_s,
        backward_full_s=full_s,
        param_bytes=_tensor_bytes(module.parameters()),
        grad_bytes=_tensor_bytes(trainable_params),
        optimizer_bytes=_optimizer_bytes(trainable_params),
        activation_bytes=activation_bytes,
        output_bytes=_tensor_bytes(outputs),
        input_bytes=_tensor_bytes(inputs),
    )
    return measurement, outputs


# --- measuring -------------------------------------------------------------------------------


def _as_leaf(tensor: torch.Tensor) -> torch.Tensor:
    """A fresh graph leaf; float tensors require grad so B_d can be measured."""
    leaf = tensor.detach()
    return leaf.requires_grad_(True) if leaf.is_floating_point() else leaf


@contextlib.contextmanager
def _requiring_grad(params: list[torch.nn.Parameter]) -> Iterator[None]:
    """Switches ``requires_grad`` on for B_w timing and restores the caller's flags afterwards."""
    saved = [p.requires_grad for p in params]
    try:
        for p in params:
            p.requires_grad_(True)
        yield
    finally:
        for p, flag in zip(params, saved):
            p.requires_grad_(flag)


def _backward_targets(
    float_inputs: list[torch.Tensor], params: list[torch.nn.Parameter]
) -> dict[str, list[torch.Tensor]]:
    """What each timed backward differentiates w.r.t.; with only one side, that one *is* the full backward."""
    if float_inputs and params:
        return {"weight": params, "input": float_inputs, "full": float_inputs + params}
    if params:
        return {"weight": params}
    if float_inputs:
        return {"input": float_inputs}
    return {}


def _reconcile(summary: Mapping[str, float]) -> tuple[float, float, float]:
    """(B_w, B_d, full): scales the partial backwards so they add up to the full one (module docstring)."""
    raw_weight = summary.get("weight", 0.0)
    raw_input = summary.get("input", 0.0)
    full = summary.get("full", raw_weight + raw_input)
    if raw_weight + raw_input <= 0:
        return 0.0, 0.0, full
    scale = full / (raw_weight + raw_input)
    return raw_weight * scale, raw_input * scale, full


def _fixed_grad_outputs(outputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Random (not all-ones, which some kernels special-case) but identical on every run and every call."""
    generator = torch.Generator(device="cpu").manual_seed(0)
    return [
        torch.randn(o.shape, generator=generator, dtype=torch.float32).to(device=o.device, dtype=o.dtype)
        for o in outputs
    ]


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], object], device: str) -> tuple[object, float]:
    """Runs ``fn`` once; on CUDA the device is drained before and after so the time covers its kernels."""
    _sync(device)
    start = time.perf_counter()
    result = fn()
    _sync(device)
    return result, time.perf_counter() - start


def _summarize(values: list[float], statistic: str) -> float:
    if statistic == "median":
        return statistics.median(values)
    ordered = sorted(values)
    trim = max(1, int(len(ordered) * _TRIM_FRACTION)) if len(ordered) >= 3 else 0
    return statistics.fmean(ordered[trim : len(ordered) - trim])


def _storage_key(tensor: torch.Tensor) -> tuple[int, int]:
    """(identity, bytes) of the memory behind ``tensor``, so views of one buffer count once."""
    try:
        storage = tensor.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError):  # tensors without a plain storage (e.g. sparse)
        return id(tensor), tensor.numel() * tensor.element_size()


def _resident_storages(module: torch.nn.Module) -> set[int]:
    """Parameters and buffers are resident anyway: saving them for backward costs no activation memory."""
    return {_storage_key(t)[0] for t in (*module.parameters(), *module.buffers())}


def _forward_saving(
    module: torch.nn.Module, inputs: tuple[torch.Tensor, ...], resident: set[int]
) -> tuple[tuple[torch.Tensor, ...], int]:
    """One forward that records the unique storages autograd saves for backward; returns (outputs, their bytes)."""
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        key, num_bytes = _storage_key(tensor)
        if key not in resident:
            saved[key] = num_bytes
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        outputs = _as_tensor_tuple(module(*inputs), "layer output")
    return outputs, sum(saved.values())


def _tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _optimizer_bytes(trainable_params: list[torch.nn.Parameter]) -> int:
    """Adam: two fp32 moments per parameter, plus an fp32 master copy when the parameter is not fp32.

    Mixed-precision trainers (DeepSpeed, apex O2) keep fp32 master weights for
    bf16/fp16 parameters; fp64 parameters are counted the same way, as no
    trainer here keeps them in fp64 (a small overestimate for that rare case).
    """
    total = 0
    for p in trainable_params:
        copies = _ADAM_MOMENTS + (0 if p.dtype == torch.float32 else 1)
        total += copies * _FP32_BYTES * p.numel()
    return total


# --- profile assembly ------------------------------------------------------------------------


def _build_profile(
    model_name: str,
    device: torch.device,
    microbatch_size: int,
    layers: Sequence[tuple[str, str, torch.nn.Module]],
    measurements: Sequence[LayerMeasurement],
    frozen: Sequence[str],
) -> ModelProfile:
    costs = tuple(
        _layer_cost(name, modality, m, is_frozen=any(name.startswith(prefix) for prefix in frozen))
        for (name, modality, _), m in zip(layers, measurements)
    )
    return ModelProfile(
        model_name=model_name, device=str(device), microbatch_size=microbatch_size, layers=costs, source="measured"
    )


def _layer_cost(name: str, modality: str, m: LayerMeasurement, *, is_frozen: bool) -> LayerCost:
    # A layer with nothing to train (no parameters, or all with requires_grad=False) is not
    # trainable: it must not make later layers back-propagate input gradients (eq. 3.3).
    trainable = not is_frozen and m.grad_bytes > 0
    return LayerCost(
        name=name,
        modality=modality,
        forward_s=m.forward_s,
        backward_weight_s=m.backward_weight_s,
        backward_input_s=m.backward_input_s,
        param_bytes=m.param_bytes,
        grad_bytes=m.grad_bytes if trainable else 0,
        optimizer_bytes=m.optimizer_bytes if trainable else 0,
        activation_bytes=m.activation_bytes,
        output_bytes=m.output_bytes,
        trainable=trainable,
        kept_bytes=m.input_bytes,
    )


# --- cache -----------------------------------------------------------------------------------


def _cache_key(
    model_name: str,
    device: torch.device,
    microbatch_size: int,
    layers: Sequence[tuple[str, str, torch.nn.Module]],
    inputs: tuple[torch.Tensor, ...],
    config_key: Mapping | None,
    warmup: int,
    repeats: int,
    statistic: str,
) -> str:
    """sha256 of everything that changes a measurement. ``frozen`` is not in it: it is applied after loading."""
    description = {
        "format": _CACHE_FORMAT,
        "model_name": model_name,
        "device": str(device),
        "microbatch_size": microbatch_size,
        "torch": torch.__version__,
        "layers": [_module_signature(name, modality, module) for name, modality, module in layers],
        "inputs": [[list(t.shape), str(t.dtype)] for t in inputs],
        "config_key": None if config_key is None else dict(config_key),
        "warmup": warmup,
        "repeats": repeats,
        "statistic": statistic,
    }
    try:
        text = json.dumps(description, sort_keys=True)
    except TypeError as error:
        raise ValueError(
            f"config_key must hold only JSON values (str, numbers, lists, dicts), got {config_key!r}"
        ) from error
    return hashlib.sha256(text.encode()).hexdigest()


def _module_signature(name: str, modality: str, module: torch.nn.Module) -> list:
    tensors = [
        [kind, tensor_name, list(t.shape), str(t.dtype), t.requires_grad]
        for kind, named in (("param", module.named_parameters()), ("buffer", module.named_buffers()))
        for tensor_name, t in named
    ]
    return [name, modality, type(module).__qualname__, tensors]


def _safe_file_part(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", text)[:64] or "model"


def _load_cache(
    path: Path, key: str, layers: Sequence[tuple[str, str, torch.nn.Module]]
) -> list[LayerMeasurement] | None:
    """The cached measurements, or None when absent; a damaged file warns and counts as absent."""
    if not path.exists():
        return None
    try:
        payload = json.loads(path.read_text())
        if payload["format"] != _CACHE_FORMAT or payload["key"] != key:
            raise ValueError("format or key does not match its file name")
        entries = payload["layers"]
        expected = [[name, modality] for name, modality, _ in layers]
        if [[e["name"], e["modality"]] for e in entries] != expected:
            raise ValueError("layer names or modalities differ")
        measurements = [LayerMeasurement(**e["measurement"]) for e in entries]
        for (name, modality, _), m in zip(layers, measurements):
            _layer_cost(name, modality, m, is_frozen=False)  # validates values and types
        return measurements
    except (OSError, ValueError, KeyError, TypeError) as error:
        logger.warning("profile cache %s is unreadable (%s); profiling again", path, error)
        return None


def _write_cache(
    path: Path, key: str, layers: Sequence[tuple[str, str, torch.nn.Module]], measurements: Sequence[LayerMeasurement]
) -> None:
    """Atomic (temporary file + ``os.replace``) so a crash or a concurrent reader never sees half a file."""
    payload = {
        "format": _CACHE_FORMAT,
        "key": key,
        "layers": [
            {"name": name, "modality": modality, "measurement": asdict(m)}
            for (name, modality, _), m in zip(layers, measurements)
        ],
    }
    tmp_name = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".tmp")
        with os.fdopen(fd, "w") as file:
            json.dump(payload, file, indent=1)
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp_name, path)
    except OSError as error:
        # The profile itself is fine; losing the cache only costs a re-run next time.
        logger.warning("could not write profile cache %s: %s", path, error)
        if tmp_name is not None and os.path.exists(tmp_name):
            os.unlink(tmp_name)


# --- argument checks and small helpers -------------------------------------------------------


def _validate(
    layers: Sequence[tuple[str, str, torch.nn.Module]],
    microbatch_size: int,
    warmup: int,
    repeats: int,
    statistic: str,
    frozen: Sequence[str],
) -> None:
    if not layers:
        raise ValueError("layers must hold at least one (name, modality, module), got none")
    names = [name for name, _, _ in layers]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"layer names must be unique, got duplicates {duplicates}")
    for name, modality, module in layers:
        if modality not in MODALITIES:
            raise ValueError(f"layer {name!r}: modality {modality!r} is not one of {MODALITIES}")
        if not isinstance(module, torch.nn.Module):
            raise ValueError(f"layer {name!r}: module must be a torch.nn.Module, got {type(module).__name__}")
    if microbatch_size < 1:
        raise ValueError(f"microbatch_size must be >= 1, got {microbatch_size}")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if statistic not in STATISTICS:
        raise ValueError(f"statistic must be one of {STATISTICS}, got {statistic!r}")
    if isinstance(frozen, str):
        raise ValueError(f"frozen must be a sequence of name prefixes, got the string {frozen!r}")


def _parse_device(device: str) -> torch.device:
    try:
        return torch.device(device)
    except RuntimeError as error:
        raise ValueError(f"device must be a torch device string such as 'cpu' or 'cuda:0', got {device!r}") from error


def _as_tensor_tuple(value: object, what: str) -> tuple[torch.Tensor, ...]:
    values = tuple(value) if isinstance(value, (tuple, list)) else (value,)
    if not values or not all(isinstance(v, torch.Tensor) for v in values):
        raise ValueError(f"{what} must be a tensor or a non-empty tuple of tensors, got {_describe(value)}")
    return values


def _describe(value: object) -> str:
    if isinstance(value, (tuple, list)):
        return f"{type(value).__name__} of ({', '.join(type(v).__name__ for v in value)})"
    return type(value).__name__


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms"


def _report(progress: Callable[[str], None] | None, line: str) -> None:
    logger.info(line)
    if progress is not None:
        progress(line)
