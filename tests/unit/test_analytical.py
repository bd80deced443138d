"""Analytical cost model: FLOP accounting, the backward split, memory terms, frozen effects."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from oobleck_mm.config import load_config
from oobleck_mm.config.shape import LayerSpec, layer_specs, matmul_param_count, param_count
from oobleck_mm.planning.costs import ClusterSpec, LayerPrefix, effective_layers, stage_cost
from oobleck_mm.config.devices import DEVICES, DeviceSpec, get_device
from oobleck_mm.profiling.analytical import analytical_profile, peak_flops, profile_from_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def job(name: str):
    return load_config(os.path.join(ROOT, "configs", f"{name}.yaml"))


def by_name(profile):
    return {layer.name: layer for layer in profile.layers}


# A device so fast at memory that every layer is compute-bound: times are FLOPs / rate.
COMPUTE_BOUND = DeviceSpec(name="ideal", peak_flops=1e12, memory_bytes=2**40, memory_bandwidth=1e30, efficiency=1.0)


def block(**overrides) -> LayerSpec:
    base = dict(
        name="llm.block0",
        modality="text",
        kind="block",
        hidden=64,
        in_features=64,
        ffn_hidden=256,
        num_heads=4,
        tokens_per_sample=100,
        attention_len=100,
    )
    return LayerSpec(**{**base, **overrides})


def seconds_of(spec: LayerSpec, microbatch_size: int = 1):
    layer = analytical_profile([spec], COMPUTE_BOUND, microbatch_size, "m").layers[0]
    return layer.forward_s, layer.backward_weight_s, layer.backward_input_s


def test_device_catalogue_uses_dense_peaks():
    assert DEVICES["a40"].peak_flops == pytest.approx(149.7e12)  # dense bf16/fp16; TF32 (the paper's) is 74.8
    assert DEVICES["a100-40gb"].peak_flops == DEVICES["a100-80gb"].peak_flops == pytest.approx(312e12)
    assert DEVICES["h100"].peak_flops == pytest.approx(989e12)
    assert DEVICES["h100"].memory_bytes == 80 * 2**30 and DEVICES["a100-40gb"].memory_bytes == 40 * 2**30
    assert DEVICES["cpu"].bytes_per_param == 4 and DEVICES["cpu"].optimizer_bytes_per_param == 8
    assert DEVICES["h100"].bytes_per_param == 2 and DEVICES["h100"].optimizer_bytes_per_param == 12
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        get_device("tpu")


def test_forward_flops_are_matmuls_plus_attention():
    spec = block(attention_len=0)
    forward, _, _ = seconds_of(spec)
    assert forward == pytest.approx(2 * matmul_param_count(spec) * 100 / 1e12)
    with_attention, _, _ = seconds_of(block())
    assert with_attention - forward == pytest.approx(4 * 100 * 100 * 64 / 1e12)


def test_causal_attention_counts_half_the_quadratic_work():
    plain = seconds_of(block())[0] - seconds_of(block(attention_len=0))[0]
    causal = seconds_of(block(causal=True))[0] - seconds_of(block(attention_len=0, causal=True))[0]
    assert causal == pytest.approx(plain / 2)


def test_backward_splits_into_weight_and_input_grads_summing_to_twice_forward():
    forward, b_weight, b_input = seconds_of(block())
    assert b_weight + b_input == pytest.approx(2 * forward)
    # The attention core has no weights: all of its backward is input-gradient work.
    no_attention = seconds_of(block(attention_len=0))
    assert b_weight == pytest.approx(no_attention[1])
    assert b_input - b_weight == pytest.approx(2 * (forward - no_attention[0]))


@settings(max_examples=40, deadline=None)
@given(
    heads=st.sampled_from([1, 2, 4, 8]),
    kv_div=st.sampled_from([1, 2]),
    head_dim=st.integers(1, 16),
    ffn=st.integers(1, 512),
    tokens=st.floats(1, 5000),
    span=st.floats(0, 5000),
    causal=st.booleans(),
    gated=st.booleans(),
)
def test_backward_is_twice_forward_for_any_block_shape(heads, kv_div, head_dim, ffn, tokens, span, causal, gated):
    spec = block(
        hidden=heads * head_dim,
        in_features=heads * head_dim,
        num_heads=heads,
        num_kv_heads=max(1, heads // kv_div),
        ffn_hidden=ffn,
        tokens_per_sample=tokens,
        attention_len=span,
        causal=causal,
        gated_ffn=gated,
    )
    forward, b_weight, b_input = seconds_of(spec)
    assert b_weight + b_input == pytest.approx(2 * forward)
    assert b_weight <= b_input and b_weight == pytest.approx(2 * matmul_param_count(spec) * tokens / 1e12)


def test_compute_bound_times_scale_with_microbatch():
    one = seconds_of(block(), microbatch_size=1)
    four = seconds_of(block(), microbatch_size=4)
    for a, b in zip(one, four):
        assert b == pytest.approx(4 * a)


def test_bandwidth_bound_layers_cost_bytes_over_bandwidth():
    j = job("tiny_mm")
    specs = layer_specs(j.model, j.data)
    embed = by_name(analytical_profile(specs, "cpu", 2, "tiny"))["llm.embed"]
    # 16 text tokens + one mean image of 3 x 3 patches (sides of 16..32 px in 8-px patches)
    tokens = 2 * (16 + 9)
    # A lookup: no FLOPs, reads the gathered rows and writes them (fp32 on the cpu).
    assert embed.forward_s == pytest.approx(tokens * 2 * 64 * 4 / DEVICES["cpu"].memory_bandwidth)
    assert embed.forward_s > 0


def test_gpt3_block_matches_korthikanti_activation_memory():
    j = job("gpt3_2.7b")
    specs = layer_specs(j.model, j.data)
    layer = by_name(analytical_profile(specs, "a40", 2, "gpt"))["llm.block0"]
    s, b, h, a = 2048, 2, 2560, 32
    # 34sbh + 5as^2b bytes in half precision per transformer layer (Korthikanti et al. 2022, eq. 2).
    assert layer.activation_bytes == pytest.approx(34 * s * b * h + 5 * a * s * s * b, rel=1e-9)
    assert layer.output_bytes == s * b * h * 2
    # Flash attention stores no scores, only fp32 softmax statistics per head and token.
    flash = by_name(analytical_profile(specs, "a40", 2, "gpt", flash_attention=True))["llm.block0"]
    assert flash.activation_bytes == pytest.approx(34 * s * b * h + 4 * a * s * b, rel=1e-9)
    # Eager attention also streams the a*s*s score matrix through its memory-bound kernels:
    # 16 element passes forward, 32 backward (input-gradient work), at 2 bytes, added to the time.
    scores = a * s * s * b * 2
    bandwidth = DEVICES["a40"].memory_bandwidth
    assert layer.forward_s - flash.forward_s == pytest.approx(16 * scores / bandwidth, rel=1e-9)
    assert layer.backward_input_s - flash.backward_input_s == pytest.approx(32 * scores / bandwidth, rel=1e-9)
    assert layer.backward_weight_s == flash.backward_weight_s


def test_profile_from_config_applies_checkpointing_and_attention_choices():
    j = job("gpt3_2.7b")  # activation checkpointing on, eager attention
    specs = layer_specs(j.model, j.data)
    profile = profile_from_config(j)
    assert profile.recompute == "always"
    from_config = by_name(profile)["llm.block0"]
    direct = by_name(analytical_profile(specs, "a40", 2, "gpt"))["llm.block0"]
    assert from_config.kept_bytes == direct.kept_bytes == 2 * 2048 * 2560 * 2
    assert from_config.activation_bytes == direct.activation_bytes > 10 * from_config.kept_bytes
    for setting, policy in (("auto", "auto"), (False, "never")):
        j.training.activation_checkpointing = setting
        assert profile_from_config(j).recompute == policy
    j.training.activation_checkpointing = False
    j.training.flash_attention = True
    flash = by_name(profile_from_config(j))["llm.block0"]
    assert flash.activation_bytes == pytest.approx(34 * 2048 * 2 * 2560 + 4 * 32 * 2048 * 2, rel=1e-9)


def test_state_bytes_follow_parameter_counts_and_dtype():
    j = job("gpt3_2.7b")  # float16: 2-byte weights, fp32 grads (the masters'), fp32 master + moments
    specs = {s.name: s for s in layer_specs(j.model, j.data)}
    for layer in profile_from_config(j).layers:
        params = param_count(specs[layer.name])
        assert (layer.param_bytes, layer.grad_bytes, layer.optimizer_bytes) == (2 * params, 4 * params, 12 * params)
    tiny = job("tiny_mm")  # float32 on the cpu: 4 + 4 + 8
    head = by_name(profile_from_config(tiny))["llm.head"]
    assert (head.param_bytes, head.optimizer_bytes) == (4 * (64 * 256 + 64), 8 * (64 * 256 + 64))
    assert DEVICES["h100"].with_dtype("float32").bytes_per_param == 4
    exact = DEVICES["cpu"].with_dtype("float32", "float64")  # the exact-test mode: 4 + 8 + (8 + 16)
    assert (exact.bytes_per_param, exact.grad_bytes, exact.optimizer_bytes_per_param) == (4, 8, 24)
    with pytest.raises(ValueError, match="dtype"):
        DEVICES["h100"].with_dtype("int8")


def test_each_compute_dtype_is_priced_at_its_own_rate():
    """torch multiplies float32 without TF32 by default: an A100 gives 19.5 TFLOP/s, 156 with
    ``training.tf32``, 312 in bf16."""
    rates = {
        "a100-80gb": (312e12, 156e12, 19.5e12, 19.5e12),
        "h100": (989e12, 494.7e12, 67e12, 67e12),
        "a40": (149.7e12, 74.8e12, 37.4e12, 0.585e12),
    }
    for name, (half, tf32, fp32, fp64) in rates.items():
        device = DEVICES[name]
        assert (
            device.with_dtype("bfloat16").peak_flops == device.with_dtype("float16").peak_flops == pytest.approx(half)
        )
        assert device.with_dtype("float32", tf32=True).peak_flops == pytest.approx(tf32)
        assert device.with_dtype("float32").peak_flops == pytest.approx(fp32)
        assert device.with_dtype("float64").peak_flops == pytest.approx(fp64)
        assert device.with_dtype("float32", "float64").peak_flops == pytest.approx(fp32), "the compute dtype's rate"
    assert DEVICES["cpu"].with_dtype("float64").peak_flops == DEVICES["cpu"].peak_flops
    with pytest.raises(ValueError, match="float32_flops must be > 0 or None, got 0"):
        DeviceSpec(name="x", peak_flops=1.0, memory_bytes=1, memory_bandwidth=1.0, float32_flops=0)


def test_the_planner_and_mfu_see_the_jobs_compute_rate():
    half = job("mllm_10b")  # bfloat16 on H100s
    full = replace(half, training=replace(half.training, dtype="float32"))
    tf32 = replace(half, training=replace(half.training, dtype="float32", tf32=True))
    assert (peak_flops(half), peak_flops(tf32), peak_flops(full)) == pytest.approx((989e12, 494.7e12, 67e12))
    fwd = lambda j: sum(layer.forward_s for layer in profile_from_config(j).layers)  # noqa: E731
    assert fwd(full) > 4 * fwd(tf32) > 4 * fwd(half), "compute-bound layers slow down with the rate"
    paper = job("paper/gpt2")  # float32 with TF32 on A40s, as the dissertation ran it (§2.7.1)
    assert paper.training.tf32 and peak_flops(paper) == pytest.approx(74.8e12)


def test_tf32_is_a_float32_switch_and_sets_torchs_float32_precision():
    from oobleck_mm.config import ConfigError
    from oobleck_mm.runtime.worker import set_float32_precision

    with pytest.raises(
        ConfigError, match="training.tf32: true applies to training.dtype float32.*got dtype 'bfloat16'"
    ):
        replace(job("mllm_10b").training, tf32=True)
    before = torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.fp32_precision
    try:
        tf32 = job("paper/gpt2")
        set_float32_precision(tf32)  # what a worker does after torch.cuda.set_device (flags only: no GPU needed)
        assert torch.backends.cuda.matmul.fp32_precision == torch.backends.cudnn.fp32_precision == "tf32"
        set_float32_precision(replace(tf32, training=replace(tf32.training, tf32=False)))
        assert torch.backends.cuda.matmul.fp32_precision == torch.backends.cudnn.fp32_precision == "ieee"
    finally:
        torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.fp32_precision = before


def test_profile_from_config_uses_the_job_shape():
    j = job("mllm_10b")
    profile = profile_from_config(j)
    assert profile.model_name == "MLLM-10B" and profile.device == "h100" and profile.microbatch_size == 1
    assert profile.source == "analytical"
    assert [l.name for l in profile.layers] == [s.name for s in layer_specs(j.model, j.data)]
    assert all(l.trainable for l in profile.layers)


def test_later_encoder_branch_carries_the_earlier_branch_tokens():
    j = job("tiny_mm_audio")
    layers = by_name(profile_from_config(j))
    vision_out = layers["vision.projector"].output_bytes
    alone = 2 * 8 * 32 * 4  # microbatch 2 x 8 audio tokens x hidden 32 x fp32
    assert layers["audio.block0"].output_bytes == alone + vision_out
    # The LLM sequence already contains them: no double counting after the merge.
    # 16 text + 9 image (mean 3 x 3 patches) + 8 audio tokens per sample.
    assert layers["llm.block0"].output_bytes == 2 * (16 + 9 + 8) * 64 * 4


def test_activation_checkpointing_trades_memory_for_one_recomputed_forward():
    j = job("gpt3_2.7b")
    specs = layer_specs(j.model, j.data)
    profile = analytical_profile(specs, "a40", 2, "gpt")
    index = [layer.name for layer in profile.layers].index("llm.block3")
    prefix = LayerPrefix(effective_layers(profile))
    cluster = ClusterSpec(gpus_per_node=1, device_memory_bytes=80 * 2**30)
    plain = stage_cost(prefix, cluster, index, index + 1, 1)
    ckpt = stage_cost(prefix, cluster, index, index + 1, 1, recompute=True)
    assert ckpt.activation_bytes == 2 * 2048 * 2560 * 2  # only the block's input
    assert ckpt.activation_bytes < plain.activation_bytes / 10
    assert ckpt.backward_s == pytest.approx(plain.backward_s + plain.forward_s)
    assert ckpt.forward_s == plain.forward_s and ckpt.resident_bytes == plain.resident_bytes


# --------------------------------------------------------------------------- frozen effects


def test_cornstarch_frozen_encoders_and_llm_pay_only_what_they_must():
    j = job("cornstarch_mllm_sss")
    profile = profile_from_config(j)
    layers = by_name(profile)
    trainable = {l.name for l in profile.layers if l.trainable}
    assert trainable == {"vision.projector0", "vision.projector1", "audio.projector0", "audio.projector1"}
    effective = dict(zip(layers, effective_layers(profile)))
    # Frozen encoders before any trainable layer run no backward and keep no activations.
    for name in ("vision.embed", "vision.block5", "audio.block3"):
        assert effective[name].backward_s == 0 and effective[name].activation_bytes == 0
        assert effective[name].resident_bytes == layers[name].param_bytes
    # The first projector layer has nothing trainable before it: weight grads only.
    assert effective["vision.projector0"].backward_s == pytest.approx(layers["vision.projector0"].backward_weight_s)
    assert effective["vision.projector1"].backward_s == pytest.approx(layers["vision.projector1"].backward_s)
    # The frozen LLM must pass gradients back to the projectors: input grads only.
    block = layers["llm.block7"]
    assert effective["llm.block7"].backward_s == pytest.approx(block.backward_input_s)
    assert 0 < block.backward_input_s < block.backward_s
    assert effective["llm.block7"].grad_bytes == 0


def test_freezing_reduces_total_backward_and_state():
    j = job("cornstarch_mllm_sss")
    frozen = profile_from_config(j)
    all_trainable = replace(frozen, layers=tuple(replace(l, trainable=True) for l in frozen.layers))
    eff_frozen, eff_all = effective_layers(frozen), effective_layers(all_trainable)
    assert sum(e.backward_s for e in eff_frozen) < 0.6 * sum(e.backward_s for e in eff_all)
    assert sum(e.resident_bytes for e in eff_frozen) < 0.2 * sum(e.resident_bytes for e in eff_all)
    # Forward work does not depend on what is trained.
    assert [e.forward_s for e in eff_frozen] == [e.forward_s for e in eff_all]


def test_frozen_layer_names_in_config_are_exact():
    j = job("gpt3_2.7b")
    j.model.frozen = ("llm.block1",)
    frozen = {l.name for l in profile_from_config(j).layers if not l.trainable}
    assert frozen == {"llm.block1"}  # llm.block10..19 stay trainable


def test_compute_efficiency_scales_the_compute_bound_time_only():
    j = job("gpt3_2.7b")
    j.training.flash_attention = True  # no memory-bound score kernels: blocks are compute-bound on an A40
    base = by_name(profile_from_config(j))["llm.block0"]
    j.cluster.compute_efficiency = DEVICES["a40"].efficiency / 2
    slow = by_name(profile_from_config(j))["llm.block0"]
    assert slow.forward_s == pytest.approx(2 * base.forward_s) and slow.backward_s == pytest.approx(2 * base.backward_s)
    assert slow.state_bytes == base.state_bytes
