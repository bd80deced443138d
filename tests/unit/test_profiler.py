"""Tests of the measured per-layer profiler on tiny real torch modules (CPU, a few seconds)."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from torch import nn

from oobleck_mm.planning.costs import effective_layers, needs_input_grad
from oobleck_mm.profiling import profiler
from oobleck_mm.profiling.profiler import measure_layer, profile_layers

VOCAB, D_MODEL, BATCH, SEQ = 64, 32, 2, 16
FAST = {"warmup": 1, "repeats": 3}


def _encoder_layer(d_model: int = D_MODEL) -> nn.Module:
    return nn.TransformerEncoderLayer(d_model, nhead=4, dim_feedforward=2 * d_model, dropout=0.0, batch_first=True)


def _tiny_llm() -> list[tuple[str, str, nn.Module]]:
    torch.manual_seed(0)
    return [
        ("llm.embed", "text", nn.Embedding(VOCAB, D_MODEL)),
        ("llm.block0", "text", _encoder_layer()),
        ("llm.norm", "text", nn.LayerNorm(D_MODEL, elementwise_affine=False)),
        ("llm.head", "text", nn.Linear(D_MODEL, VOCAB)),
    ]


def _tokens(seq: int = SEQ) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, seq), generator=torch.Generator().manual_seed(1))


def _profile(layers, example=None, **kwargs):
    options = {"microbatch_size": BATCH, "model_name": "tiny", **FAST, **kwargs}
    return profile_layers(layers, _tokens() if example is None else example, **options)


def _count_forwards(layers) -> list[int]:
    """Counts calls of every layer's forward: the cache tests' witness that nothing ran."""
    calls = [0]

    def hook(module, args):
        calls[0] += 1

    for _, _, module in layers:
        module.register_forward_pre_hook(hook)
    return calls


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Intra-op threads on a small machine shared with other jobs stall on each other; one thread
    keeps these tests fast and the timing comparison about FLOPs. (The profiler itself never
    changes the thread count: that is the caller's choice.)"""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


@pytest.fixture(scope="module")
def tiny_profile(one_thread):
    return _profile(_tiny_llm())


def test_costs_positive_where_expected(tiny_profile):
    by_name = {layer.name: layer for layer in tiny_profile.layers}
    assert tiny_profile.source == "measured" and tiny_profile.microbatch_size == BATCH
    assert [layer.name for layer in tiny_profile.layers] == ["llm.embed", "llm.block0", "llm.norm", "llm.head"]
    for layer in tiny_profile.layers:
        assert layer.forward_s > 0 and layer.output_bytes > 0
    # Token embedding: integer input, so no input gradient, but its table has a weight gradient.
    assert by_name["llm.embed"].backward_input_s == 0
    assert by_name["llm.embed"].backward_weight_s > 0
    # Parameterless norm: only an input gradient, and nothing to train.
    assert by_name["llm.norm"].backward_weight_s == 0 and by_name["llm.norm"].backward_input_s > 0
    assert not by_name["llm.norm"].trainable and by_name["llm.norm"].param_bytes == 0
    for name in ("llm.block0", "llm.head"):
        assert by_name[name].backward_weight_s > 0 and by_name[name].backward_input_s > 0
        assert by_name[name].activation_bytes > 0


def test_bytes_are_exact(tiny_profile):
    layers = _tiny_llm()
    for (name, _, module), cost in zip(layers, tiny_profile.layers):
        numel = sum(p.numel() for p in module.parameters())
        assert cost.param_bytes == 4 * numel, name
        assert cost.grad_bytes == (4 * numel if cost.trainable else 0), name
        assert cost.optimizer_bytes == (2 * 4 * numel if cost.trainable else 0), name  # two fp32 Adam moments
    head_output = BATCH * SEQ * VOCAB * 4
    assert tiny_profile.layers[-1].output_bytes == head_output


def test_half_precision_params_pay_for_an_fp32_master_copy():
    head = nn.Linear(D_MODEL, 8).to(torch.bfloat16)
    profile = _profile([("llm.head", "text", head)], example=torch.randn(BATCH, D_MODEL, dtype=torch.bfloat16))
    numel = D_MODEL * 8 + 8
    cost = profile.layers[0]
    assert cost.param_bytes == 2 * numel and cost.grad_bytes == 2 * numel
    assert cost.optimizer_bytes == 3 * 4 * numel


def test_wider_block_takes_longer_within_one_run():
    torch.manual_seed(0)
    light, heavy = D_MODEL, 4 * D_MODEL

    def mlp(width: int) -> nn.Module:
        return nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    layers = [
        ("vision.light", "vision", mlp(light)),
        ("vision.up", "vision", nn.Linear(light, heavy)),
        ("vision.heavy", "vision", mlp(heavy)),
    ]
    profile = _profile(layers, example=torch.randn(4, 64, light), warmup=1, repeats=5)
    light_cost, _, heavy_cost = profile.layers
    # 16x the FLOPs; a 2x margin survives a busy machine.
    assert heavy_cost.forward_s > 2 * light_cost.forward_s
    assert heavy_cost.backward_s > 2 * light_cost.backward_s
    assert heavy_cost.activation_bytes > light_cost.activation_bytes


def test_activation_bytes_grow_with_sequence_length():
    def block_activation(seq: int) -> int:
        torch.manual_seed(0)
        example = torch.randn(BATCH, seq, D_MODEL)
        return _profile([("llm.block0", "text", _encoder_layer())], example=example).layers[0].activation_bytes

    short, long = block_activation(8), block_activation(32)
    assert 0 < short < long
    # Everything saved grows at least linearly with tokens, attention scores quadratically.
    assert long >= 3 * short


def test_a_recomputing_layer_keeps_only_its_inputs():
    # What torch.utils.checkpoint keeps of a block is its input: far less than the block saves without it.
    x = torch.randn(BATCH, SEQ, D_MODEL)
    profile = _profile([("llm.block0", "text", _encoder_layer())], example=x)
    (layer,) = profile.layers
    assert layer.kept_bytes == layer.recompute_bytes == x.numel() * 4
    assert layer.activation_bytes > 3 * layer.kept_bytes


def test_activation_bytes_count_saved_tensors_not_parameters():
    # y = x @ W^T saves x for the weight gradient and W (a parameter, not counted) for the input gradient.
    linear = nn.Linear(D_MODEL, D_MODEL, bias=False)
    x = torch.randn(BATCH, D_MODEL)
    measurement, output = measure_layer(linear, (x,), **FAST)
    assert measurement.activation_bytes == x.numel() * 4
    assert output[0].shape == (BATCH, D_MODEL) and not output[0].requires_grad


def test_partial_backwards_add_up_to_the_full_backward():
    x = torch.randn(BATCH, SEQ, D_MODEL)
    measurement, _ = measure_layer(_encoder_layer(), (x,), statistic="trimmed_mean", **FAST)
    assert measurement.backward_weight_s > 0 and measurement.backward_input_s > 0
    assert measurement.backward_weight_s + measurement.backward_input_s == pytest.approx(measurement.backward_full_s)


def test_tuple_outputs_feed_the_next_layer_as_arguments():
    class Split(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(D_MODEL, D_MODEL)

        def forward(self, x):
            return self.proj(x), x.sum(-1)

    class Merge(nn.Module):
        def forward(self, hidden, summary):
            return hidden + summary.unsqueeze(-1)

    profile = _profile(
        [("audio.split", "audio", Split()), ("audio.merge", "audio", Merge())], example=torch.randn(BATCH, D_MODEL)
    )
    split, merge = profile.layers
    assert split.output_bytes == BATCH * D_MODEL * 4 + BATCH * 4
    assert merge.backward_weight_s == 0 and merge.forward_s > 0


def test_frozen_layers_have_no_grad_or_optimizer_bytes():
    torch.manual_seed(0)
    layers = [
        ("vision.block0", "vision", _encoder_layer()),
        ("vision.projector", "vision", nn.Linear(D_MODEL, D_MODEL)),
        ("llm.block0", "text", _encoder_layer()),
    ]
    profile = _profile(layers, example=torch.randn(BATCH, SEQ, D_MODEL), frozen=("vision.block",))
    block, projector, llm = profile.layers
    assert not block.trainable and block.grad_bytes == 0 and block.optimizer_bytes == 0
    assert block.param_bytes == 4 * sum(p.numel() for p in layers[0][2].parameters())
    # The split is still measured, so the profile stays valid if the layer is unfrozen later.
    assert block.backward_weight_s > 0
    assert projector.trainable and projector.grad_bytes > 0 and llm.trainable
    effective = effective_layers(profile)
    assert needs_input_grad(profile.layers) == (False, False, True)
    assert effective[0].backward_s == 0 and effective[0].activation_bytes == 0
    assert effective[0].resident_bytes == block.param_bytes
    assert effective[1].backward_s == pytest.approx(projector.backward_weight_s)
    assert effective[2].backward_s == pytest.approx(llm.backward_s)


def test_requires_grad_flags_are_restored():
    torch.manual_seed(0)
    head = nn.Linear(D_MODEL, VOCAB)
    head.bias.requires_grad_(False)
    profile = _profile([("llm.head", "text", head)], example=torch.randn(BATCH, D_MODEL))
    assert head.weight.requires_grad and not head.bias.requires_grad
    assert profile.layers[0].grad_bytes == 4 * head.weight.numel()
    assert head.weight.grad is None  # timing uses autograd.grad, never .backward()


def test_effective_layers_accepts_a_measured_profile(tiny_profile):
    effective = effective_layers(tiny_profile)
    assert len(effective) == tiny_profile.num_layers
    # Only the embedding precedes every trainable layer: it needs no input gradient.
    assert effective[0].backward_s == pytest.approx(tiny_profile.layers[0].backward_weight_s)
    assert all(layer.backward_s > 0 for layer in effective)


def test_progress_reports_one_line_per_layer():
    lines: list[str] = []
    _profile(_tiny_llm(), progress=lines.append)
    assert len(lines) == 4
    assert lines[1].startswith("profiled 2/4 llm.block0: fwd ")
    assert "bwd_w" in lines[1] and "bwd_d" in lines[1] and lines[1].endswith(" ms")


def test_cache_hit_runs_nothing_and_returns_the_same_profile(tmp_path):
    first = _profile(_tiny_llm(), cache_dir=tmp_path, config_key={"seq": SEQ})
    layers = _tiny_llm()
    calls = _count_forwards(layers)
    lines: list[str] = []
    second = _profile(layers, cache_dir=tmp_path, config_key={"seq": SEQ}, progress=lines.append)
    assert calls[0] == 0
    assert second == first
    assert len(lines) == 1 and "from" in lines[0]
    # Frozen status is applied after loading, so it is not part of the key.
    frozen = _profile(layers, cache_dir=tmp_path, config_key={"seq": SEQ}, frozen=("llm.block",))
    assert calls[0] == 0 and not frozen.layers[1].trainable and frozen.layers[1].grad_bytes == 0
    assert len(list(tmp_path.glob("*.json"))) == 1
    assert not list(tmp_path.glob("*.tmp"))


@pytest.mark.parametrize(
    "change",
    [
        {"microbatch_size": BATCH + 1},
        {"config_key": {"seq": 2 * SEQ}},
        {"repeats": 4},
        {"statistic": "trimmed_mean"},
        {"model_name": "other"},
    ],
)
def test_changed_key_profiles_again(tmp_path, change):
    _profile(_tiny_llm()[:1], cache_dir=tmp_path, config_key={"seq": SEQ})
    layers = _tiny_llm()[:1]
    calls = _count_forwards(layers)
    _profile(layers, cache_dir=tmp_path, **{"config_key": {"seq": SEQ}, **change})
    assert calls[0] > 0
    assert len(list(tmp_path.glob("*.json"))) == 2


def test_changed_layer_shape_profiles_again(tmp_path):
    _profile([("llm.head", "text", nn.Linear(D_MODEL, 8))], example=torch.randn(BATCH, D_MODEL), cache_dir=tmp_path)
    wider = [("llm.head", "text", nn.Linear(D_MODEL, 16))]
    calls = _count_forwards(wider)
    profile = _profile(wider, example=torch.randn(BATCH, D_MODEL), cache_dir=tmp_path)
    assert calls[0] > 0 and profile.layers[0].param_bytes == 4 * (D_MODEL * 16 + 16)


@pytest.mark.parametrize("damage", ["{not json", '{"format": 1}', "[]"])
def test_corrupt_cache_warns_and_profiles_again(tmp_path, caplog, damage):
    first = _profile(_tiny_llm()[:1], cache_dir=tmp_path)
    (path,) = tmp_path.glob("*.json")
    path.write_text(damage)
    layers = _tiny_llm()[:1]
    calls = _count_forwards(layers)
    with caplog.at_level(logging.WARNING, logger="oobleck_mm.profiling.profiler"):
        again = _profile(layers, cache_dir=tmp_path)
    assert calls[0] > 0
    assert any("unreadable" in record.getMessage() for record in caplog.records)
    assert [layer.param_bytes for layer in again.layers] == [layer.param_bytes for layer in first.layers]
    assert json.loads(path.read_text())["format"] == profiler._CACHE_FORMAT  # rewritten whole


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"statistic": "mean"}, "statistic"),
        ({"repeats": 0}, "repeats"),
        ({"warmup": -1}, "warmup"),
        ({"microbatch_size": 0}, "microbatch_size"),
        ({"device": "gpu"}, "device"),
        ({"config_key": {"fn": print}}, "config_key"),
        ({"frozen": "vision"}, "frozen"),
    ],
)
def test_bad_arguments_name_the_field(tmp_path, kwargs, field):
    with pytest.raises(ValueError, match=field):
        _profile(_tiny_llm()[:1], cache_dir=tmp_path, **kwargs)


def test_bad_layers_are_rejected():
    linear = nn.Linear(D_MODEL, D_MODEL)
    with pytest.raises(ValueError, match="at least one"):
        _profile([])
    with pytest.raises(ValueError, match="unique"):
        _profile([("a", "text", linear), ("a", "text", linear)])
    with pytest.raises(ValueError, match="modality"):
        _profile([("a", "video", linear)])
    with pytest.raises(ValueError, match="example_input"):
        _profile([("a", "text", linear)], example=[torch.zeros(1), 3])


def test_measured_profile_of_the_runtime_model(tmp_path):
    """planning.profile: measured times the job's own layers (exact frozen names, cached on disk)."""
    import dataclasses

    from oobleck_mm.config import load_config
    from oobleck_mm.model.layers import model_layer_specs
    from oobleck_mm.profiling.load import load_profile

    job = load_config("configs/tiny_mm.yaml")
    model = dataclasses.replace(job.model, frozen=("vision",))
    planning = dataclasses.replace(job.planning, profile="measured", profile_cache_dir=str(tmp_path))
    job = dataclasses.replace(job, model=model, planning=planning)
    lines = []
    profile = load_profile(job, lines.append)
    specs = model_layer_specs(job)
    assert [c.name for c in profile.layers] == [s.name for s in specs]
    assert profile.source == "measured"
    assert all(c.forward_s > 0 for c in profile.layers)
    trainable = {c.name: c.trainable for c in profile.layers}
    assert not trainable["vision.embed"] and not trainable["vision.block1"]
    assert trainable["vision.projector"] and trainable["llm.block0"]
    # what a context-parallel stage would gather: keys and values of the microbatch's sequence, float32
    by_name = {c.name: c for c in profile.layers}
    block = next(s for s in specs if s.name == "llm.block0")
    assert by_name["llm.block0"].kv_bytes > 0 and by_name["llm.block0"].kv_bytes % (2 * block.kv_hidden * 4) == 0
    assert by_name["llm.head"].kv_bytes == 0 and by_name["vision.block1"].kv_bytes == 0
    again = load_profile(job, lines.append)
    assert again == profile and any("loaded profile" in line for line in lines)
