"""Analytical layer costs: a roofline estimate of each layer from its shape, no hardware needed.

Turns ``LayerSpec``s into the
``ModelProfile`` the planner consumes, the same currency the measured profiler
produces. Per layer and microbatch of ``b`` samples (``s`` = b * tokens per sample,
``L`` = attention span, ``h`` hidden, ``P`` matmul weights):

* FLOPs. Forward: ``2*P*s`` for the matmuls plus ``4*s*L*h`` for attention
  (QK^T and AV), halved when causal. Backward splits (Cornstarch eq. 3.1) into
  the weight gradients ``B_w = 2*P*s`` and the input gradients
  ``B_d = 2*P*s + 2 * attention``: the attention core has no weights, and its
  backward (dQ, dK, dV, dP) is twice its forward. So ``B_w + B_d = 2 F``, and a
  frozen layer that only passes gradients through pays ``B_d`` alone.
* Time of each pass: ``max(FLOPs / (peak * efficiency), bytes moved / memory
  bandwidth)``; bytes moved = weights read once + the layer's input and output
  activations. Embedding lookups and small layers are bandwidth-bound this way.
* Eager attention (no ``flash_attention``) also runs memory-bound kernels over the
  ``a*s*L`` score matrix one after the other, added to the pass's time. Forward,
  about 16 element passes, counted kernel by kernel in transformers' eager attention
  (what Oobleck ran, §2.6): QK^T writes the scores (1); the scaling (2), the causal
  ``where`` (2) and the padding-mask add (2) each read and write them; softmax reads
  twice and writes (3); dropout writes its mask, reads both and writes (4); AV reads
  them (1); plus the masks' own reads. Backward twice that: every one of those ops
  reads the incoming gradient and a saved tensor and writes one. All of it is
  input-gradient work. At 2,048 tokens and d_model 1,024 this traffic costs more than
  the block's matmuls: with it, the catalogue's efficiency reproduces the
  dissertation's Table 2.2 for models from 340M to 6.7B parameters within 7%, where
  matmuls alone overestimate GPT-3 Medium 2.7x (docs/simulator.md).
* Memory: params at ``bytes_per_param`` (the compute dtype), grads at the master
  dtype's width, optimizer state at ``optimizer_bytes_per_param`` (mixed precision:
  the master copy and two moments). Activations kept for backward per microbatch
  follow Korthikanti et al. 2022 ("Reducing activation recomputation"): a
  transformer block keeps ``s*(9h + 2*ffn)`` elements (``3*ffn`` for a gated FFN;
  both give the paper's ``34*s*h`` bytes at 2 bytes and ffn = 4h) plus
  ``5*a*s*L`` bytes of attention scores and masks at half precision (scaled with the
  activation width). With ``flash_attention`` the scores are never stored: only the
  fp32 softmax statistics, ``4*a*s`` bytes (its backward recomputes the scores; that
  extra half of the attention forward is not counted). Linear layers keep their
  input (+ output for the projector's activation); the LM head keeps its input, its
  norm's input and fp32 logits; the token embedding keeps only the int64 ids.
* Activation checkpointing: the profile holds the costs of keeping the activations, and each
  layer's ``kept_bytes``, its input (the ids for the token embedding), which is all a layer
  keeps when it recomputes. The planner decides per stage whether to recompute
  (``planning.costs.stage_cost``: one more forward in the backward of every layer that runs
  one, frozen layers passing gradients through included).
* Output: ``s*h`` activations (logits for the head) plus, for an encoder branch
  that follows another one, the already projected tokens of the earlier branch,
  which must travel with it to the LLM.

Pure: no torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from oobleck_mm.config.devices import DeviceSpec, get_device
from oobleck_mm.config.shape import LayerSpec, layer_specs, matmul_param_count, param_count, resolve_frozen
from oobleck_mm.planning.costs import LayerCost, ModelProfile, recompute_policy

if TYPE_CHECKING:
    from oobleck_mm.config import JobConfig

# --------------------------------------------------------------------------- per-layer model


# Element passes over the eager attention score matrix (see the module docstring).
EAGER_SCORE_PASSES_FORWARD = 16
EAGER_SCORE_PASSES_BACKWARD = 32


@dataclass(frozen=True, slots=True)
class _Work:
    """FLOPs and bytes moved of one pass over one microbatch."""

    flops: float
    bytes_moved: float
    elementwise_bytes: float = 0.0
    """Bytes of memory-bound kernels that run after the matmuls, not overlapped with them."""

    def seconds(self, dev: DeviceSpec) -> float:
        matmuls = max(self.flops / (dev.peak_flops * dev.efficiency), self.bytes_moved / dev.memory_bandwidth)
        return matmuls + self.elementwise_bytes / dev.memory_bandwidth


def _in_width(spec: LayerSpec) -> int:
    # The token embedding reads ids and table rows: count the rows it gathers.
    return spec.hidden if spec.kind == "token_embed" else spec.in_features


def _out_width(spec: LayerSpec) -> int:
    return spec.vocab_size if spec.kind == "lm_head" else spec.hidden


def _passes(spec: LayerSpec, tokens: float, dev: DeviceSpec, flash: bool = False) -> tuple[_Work, _Work, _Work]:
    """(forward, backward weight-grad, backward input-grad) work of one microbatch."""
    matmul = 2.0 * matmul_param_count(spec) * tokens
    attention = 4.0 * tokens * spec.attention_len * spec.hidden * (0.5 if spec.causal else 1.0)
    # A lookup reads the rows it gathers, not the whole table.
    weights = 0.0 if spec.kind == "token_embed" else param_count(spec) * dev.bytes_per_param
    io = tokens * (_in_width(spec) + _out_width(spec)) * dev.bytes_per_param
    # Eager attention materialises the full score matrix, masked or not.
    scores = 0.0 if flash else spec.num_heads * tokens * spec.attention_len * dev.bytes_per_param
    forward = _Work(matmul + attention, weights + io, EAGER_SCORE_PASSES_FORWARD * scores)
    backward_weight = _Work(matmul, weights + io)
    # The embedding's input is integer ids: no input gradient beyond passing the merged
    # encoder tokens' gradients through, a copy.
    backward_input = (
        _Work(0.0, io)
        if spec.kind == "token_embed"
        else _Work(matmul + 2 * attention, weights + io, EAGER_SCORE_PASSES_BACKWARD * scores)
    )
    return forward, backward_weight, backward_input


def _activation_bytes(spec: LayerSpec, tokens: float, bpa: int, checkpointing: bool, flash: bool) -> float:
    if checkpointing:
        return tokens * _in_width(spec) * bpa if spec.kind != "token_embed" else tokens * 8
    if spec.kind == "block":
        ffn_tensors = 3 if spec.gated_ffn else 2
        linear = tokens * (9 * spec.hidden + ffn_tensors * spec.ffn_hidden) * bpa
        if spec.attention_len == 0:
            return linear
        if flash:
            return linear + 4 * spec.num_heads * tokens
        return linear + 5 * spec.num_heads * tokens * spec.attention_len * bpa / 2
    if spec.kind == "token_embed":
        return tokens * 8  # int64 ids
    if spec.kind == "lm_head":
        return tokens * (2 * spec.hidden * bpa + 4 * spec.vocab_size)
    if spec.kind == "projector":
        return tokens * (spec.in_features + spec.hidden) * bpa
    return tokens * spec.in_features * bpa  # patch/frame embedding: its input


def pass_seconds(
    spec: LayerSpec,
    tokens: float,
    dev: DeviceSpec,
    flash: bool,
    attention_len: float | None = None,
) -> tuple[float, float, float]:
    """(forward, backward weight-grad, backward input-grad) seconds of ``spec`` over ``tokens`` tokens on
    ``dev``. ``attention_len``: the mean span its attention covers per token (default the spec's mean);
    a microbatch of spans L_i has ``tokens = sum(L_i)`` and ``attention_len = sum(L_i^2) / sum(L_i)``.
    The emulated accelerator's truth (``oobleck_mm.emulation.truth``) prices each microbatch with it."""
    if attention_len is not None and spec.attention_len:
        spec = replace(spec, attention_len=attention_len)
    forward, b_weight, b_input = (w.seconds(dev) for w in _passes(spec, tokens, dev, flash))
    return forward, b_weight, b_input


def output_width(spec: LayerSpec) -> int:
    """Elements per token of the layer's output (the logits' vocabulary for the head)."""
    return _out_width(spec)


def _layer_cost(spec: LayerSpec, dev: DeviceSpec, microbatch_size: int, flash: bool) -> LayerCost:
    tokens = spec.tokens_per_sample * microbatch_size
    forward, b_weight, b_input = pass_seconds(spec, tokens, dev, flash)
    params = param_count(spec)
    return LayerCost(
        name=spec.name,
        modality=spec.modality,
        forward_s=forward,
        backward_weight_s=b_weight,
        backward_input_s=b_input,
        param_bytes=params * dev.bytes_per_param,
        grad_bytes=params * dev.grad_bytes,
        optimizer_bytes=params * dev.optimizer_bytes_per_param,
        activation_bytes=math.ceil(_activation_bytes(spec, tokens, dev.bytes_per_param, False, flash)),
        kept_bytes=math.ceil(_activation_bytes(spec, tokens, dev.bytes_per_param, True, flash)),
        # Keys and values after grouped-query projection, what context parallelism gathers.
        kv_bytes=math.ceil(2 * tokens * spec.kv_hidden * dev.bytes_per_param) if spec.attention_len else 0,
        output_bytes=math.ceil(tokens * _out_width(spec) * dev.bytes_per_param),
    )


def analytical_profile(
    specs: Sequence[LayerSpec],
    device: DeviceSpec | str,
    microbatch_size: int,
    model_name: str,
    recompute: str = "auto",
    flash_attention: bool = False,
) -> ModelProfile:
    """Costs of every layer for one microbatch of ``microbatch_size`` samples on ``device``.

    ``flash_attention=False`` (the default) keeps Korthikanti's materialised attention scores.
    ``recompute``: which stages may recompute activations (``ModelProfile.recompute``).
    """
    if microbatch_size < 1:
        raise ValueError(f"microbatch_size must be >= 1, got {microbatch_size}")
    dev = get_device(device)
    own = [_layer_cost(spec, dev, microbatch_size, flash_attention) for spec in specs]
    layers: list[LayerCost] = []
    carried = 0  # bytes of finished encoder branches' projected tokens, en route to the LLM
    for i, (spec, cost) in enumerate(zip(specs, own)):
        if i and specs[i - 1].modality not in (spec.modality, "text"):
            carried += own[i - 1].output_bytes  # the previous branch just ended
        if spec.modality != "text":
            cost = replace(cost, output_bytes=cost.output_bytes + carried)
        layers.append(cost)
    return ModelProfile(
        model_name=model_name,
        device=dev.name,
        microbatch_size=microbatch_size,
        layers=tuple(layers),
        source="analytical",
        recompute=recompute,
    )


def profile_from_config(job: JobConfig) -> ModelProfile:
    """The analytical profile of a job: model and workload shape, dtype, device, attention and
    checkpointing choices, frozen modules."""
    specs = layer_specs(job.model, job.data)
    device = compute_device(job)
    if job.cluster.compute_efficiency is not None:
        device = replace(device, efficiency=job.cluster.compute_efficiency)
    t = job.training
    profile = analytical_profile(
        specs,
        device,
        t.microbatch_size,
        job.model.name,
        recompute=recompute_policy(t.activation_checkpointing),
        flash_attention=t.flash_attention,
    )
    # Exact names, not costs.with_frozen's prefixes: "llm.block1" must not freeze "llm.block10".
    frozen = resolve_frozen(job.model.frozen, specs)
    layers = tuple(replace(layer, trainable=layer.name not in frozen) for layer in profile.layers)
    return replace(profile, layers=layers)


def model_flops_per_sample(job: JobConfig) -> float:
    """Model FLOPs of one sample's forward and backward at the config's sample shape: the numerator
    of MFU (PaLM's convention: activation recomputation is not counted, a frozen layer pays its
    input gradients only; the first layer's input gradients are counted, a rounding error)."""
    specs = layer_specs(job.model, job.data)
    frozen = resolve_frozen(job.model.frozen, specs)
    dev = get_device(job.cluster.accelerator)  # FLOPs do not depend on it; _passes wants one
    total = 0.0
    for spec in specs:
        forward, weight, inputs = _passes(spec, spec.tokens_per_sample, dev, job.training.flash_attention)
        total += forward.flops + inputs.flops + (0.0 if spec.name in frozen else weight.flops)
    return total


def compute_device(job: JobConfig) -> DeviceSpec:
    """The job's accelerator as its training computes: byte widths of its dtypes, FLOP/s of its
    compute dtype (TF32 for float32 with ``training.tf32``)."""
    t = job.training
    return get_device(job.cluster.accelerator).with_dtype(t.dtype, t.master_dtype, tf32=t.tf32)


def peak_flops(job: JobConfig) -> float:
    """Peak FLOP/s of one of the job's accelerators at the job's compute dtype: MFU's denominator."""
    return compute_device(job).peak_flops
