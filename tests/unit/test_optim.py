"""Optimizer runtime: lr schedules equal DeepSpeed's real classes, clipping equals torch, state moves exactly."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from deepspeed.runtime import lr_schedules  # a dependency: without it this module must fail, not skip
from hypothesis import given, settings
from hypothesis import strategies as st

from oobleck_mm.config import OptimizerConfig, OptimizerParams, SchedulerConfig, TrainingConfig
from oobleck_mm.runtime.update import grad_sq
from oobleck_mm.runtime.optim import (
    betas_at,
    build_layer_optimizer,
    clip_coefficient,
    load_optimizer_state,
    lr_at,
    optimizer_state,
    set_lr,
)


def training(lr: float = 1e-3, scheduler: SchedulerConfig | None = None, steps: int = 10, **opt) -> TrainingConfig:
    optimizer = OptimizerConfig(type=opt.pop("type", "AdamW"), params=OptimizerParams(lr=lr, **opt))
    return TrainingConfig(steps=steps, optimizer=optimizer, scheduler=scheduler)


def deepspeed_lrs(t: TrainingConfig, num_steps: int) -> list[float]:
    """The lr each optimizer.step() sees when DeepSpeed's engine drives the real scheduler class:
    built from the config (last_batch_iteration=-1), stepped after every optimizer step."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=t.optimizer.params.lr)
    sched = getattr(lr_schedules, t.scheduler.type)(opt, **t.scheduler.deepspeed_params(t.steps))
    lrs = []
    for _ in range(num_steps):
        lrs.append(opt.param_groups[0]["lr"])  # what optimizer.step() would use now
        sched.step()
    return lrs


SCHEDULER_PARAMS = {
    "WarmupLR": ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type"),
    "WarmupDecayLR": ("total_num_steps", "warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type"),
    "WarmupCosineLR": ("total_num_steps", "warmup_min_ratio", "warmup_num_steps", "cos_min_ratio", "warmup_type"),
}
PARAM_VALUES = {
    "warmup_min_lr": st.floats(0.0, 1e-3),
    "warmup_max_lr": st.floats(1e-5, 1e-1),
    "warmup_num_steps": st.integers(1, 40),
    "warmup_type": st.sampled_from(["log", "linear"]),
    "total_num_steps": st.integers(1, 80),
    "warmup_min_ratio": st.floats(0.0, 1.0),
    "cos_min_ratio": st.floats(0.0, 1.0),
}


@st.composite
def schedulers(draw) -> SchedulerConfig:
    kind = draw(st.sampled_from(sorted(SCHEDULER_PARAMS)))
    names = draw(st.lists(st.sampled_from(SCHEDULER_PARAMS[kind]), unique=True))
    return SchedulerConfig(type=kind, params={n: draw(PARAM_VALUES[n]) for n in names})


@settings(max_examples=150, deadline=None)
@given(scheduler=schedulers(), lr=st.floats(1e-5, 1.0), steps=st.integers(1, 80))
def test_lr_equals_deepspeed_scheduler_driven_like_the_engine(scheduler, lr, steps):
    t = training(lr=lr, scheduler=scheduler, steps=steps)
    num_steps = max(steps, t.scheduler.params.get("warmup_num_steps", 0)) + 15  # well past the schedule's end
    expected = deepspeed_lrs(t, num_steps)
    got = [lr_at(t, s) for s in range(num_steps)]
    assert all(math.isclose(g, e, rel_tol=1e-13, abs_tol=1e-16) for g, e in zip(got, expected)), (got, expected)


@pytest.mark.parametrize("kind", sorted(SCHEDULER_PARAMS))
def test_deepspeed_defaults_when_params_are_absent(kind):
    # Default warm-up is 1000 log steps; total_num_steps defaults to training.steps.
    t = training(lr=0.01, scheduler=SchedulerConfig(type=kind), steps=1200)
    expected = deepspeed_lrs(t, 1210)
    assert [lr_at(t, s) for s in range(1210)] == pytest.approx(expected, rel=1e-13, abs=1e-16)


@pytest.mark.parametrize(
    "params",
    [
        {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-2, "cycle_first_step_size": 5},
        {
            "cycle_min_lr": 0.0,
            "cycle_max_lr": 3e-3,
            "cycle_first_step_size": 6,
            "cycle_second_step_size": 3,
            "cycle_first_stair_count": 2,
            "decay_step_size": 2,
            "decay_lr_rate": 0.1,
            "cycle_min_mom": 0.85,
            "cycle_max_mom": 0.95,
            "decay_mom_rate": 0.05,
        },
        {"cycle_min_lr": 1e-3, "cycle_max_lr": 2e-3, "cycle_first_step_size": 4, "cycle_momentum": False},
    ],
)
def test_one_cycle_lr_and_momentum_are_deepspeeds(params):
    """OneCycle driven like DeepSpeed's engine (stepped after each optimizer step) on AdamW."""
    t = training(lr=1e-3, scheduler=SchedulerConfig(type="OneCycle", params=params), betas=(0.9, 0.999))
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-3, betas=(0.9, 0.999))
    sched = lr_schedules.OneCycle(opt, **params)
    for step in range(30):
        group = opt.param_groups[0]
        assert lr_at(t, step) == pytest.approx(group["lr"], rel=1e-13, abs=1e-16), step
        betas = betas_at(t, step)
        if params.get("cycle_momentum", True):
            assert betas == pytest.approx(tuple(group["betas"]), rel=1e-13), step
        else:
            assert betas is None and tuple(group["betas"]) == (0.9, 0.999)
        sched.step()


def test_first_steps_follow_deepspeed_step_order():
    # The scheduler steps after the optimizer, so step 0 runs with the lr of iteration -1.
    warm = training(lr=0.1, scheduler=SchedulerConfig(type="WarmupLR", params={"warmup_min_lr": 0.01}))
    assert lr_at(warm, 0) == lr_at(warm, 1) == 0.01 < lr_at(warm, 2)
    assert lr_at(warm, 1001) == 0.1
    cosine = training(lr=0.1, scheduler=SchedulerConfig(type="WarmupCosineLR", params={"warmup_min_ratio": 0.5}))
    assert lr_at(cosine, 0) == 0.0 and lr_at(cosine, 1) == pytest.approx(0.05)
    decay = training(lr=0.1, steps=50, scheduler=SchedulerConfig(type="WarmupDecayLR", params={"warmup_num_steps": 10}))
    assert lr_at(decay, 11) == pytest.approx(0.001) and lr_at(decay, 51) == 0.0  # peaks at 0.001, not the lr
    assert [lr_at(training(lr=0.3), s) for s in (0, 7, 10_000)] == [0.3, 0.3, 0.3]
    with pytest.raises(ValueError, match="step"):
        lr_at(warm, -1)


def test_optimizer_starts_at_step_zero_lr_and_set_lr_sets_every_group():
    t = training(lr=0.1, scheduler=SchedulerConfig(type="WarmupLR", params={"warmup_min_lr": 0.02}))
    opt = build_layer_optimizer([torch.nn.Parameter(torch.ones(3))], t)
    assert opt.param_groups[0]["lr"] == 0.02
    opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(2))]})
    set_lr(opt, 0.5)
    assert [g["lr"] for g in opt.param_groups] == [0.5, 0.5]
    with pytest.raises(ValueError, match="lr"):
        set_lr(opt, float("nan"))
    with pytest.raises(ValueError, match="frozen"):
        build_layer_optimizer([], t)


def test_adam_type_is_decoupled_weight_decay_like_deepspeed():
    from deepspeed.runtime.config import ADAM_W_MODE_DEFAULT

    assert ADAM_W_MODE_DEFAULT is True  # DeepSpeed's "Adam" means AdamW unless adam_w_mode: false
    start = torch.linspace(-1, 1, 5, dtype=torch.float64)
    grad = torch.linspace(0.3, -0.2, 5, dtype=torch.float64)

    def one_step(make):
        p = torch.nn.Parameter(start.clone())
        opt = make([p])
        p.grad = grad.clone()
        opt.step()
        return p.detach()

    ours = {
        k: one_step(lambda ps, k=k: build_layer_optimizer(ps, training(lr=0.1, type=k, weight_decay=0.5)))
        for k in ("Adam", "AdamW")
    }
    coupled = one_step(lambda ps: torch.optim.Adam(ps, lr=0.1, weight_decay=0.5))
    decoupled = one_step(lambda ps: torch.optim.AdamW(ps, lr=0.1, weight_decay=0.5))
    assert torch.equal(ours["Adam"], decoupled) and torch.equal(ours["AdamW"], decoupled)
    assert not torch.allclose(ours["Adam"], coupled)


@settings(max_examples=60, deadline=None)
@given(
    scales=st.lists(st.floats(1e-4, 1e3), min_size=1, max_size=4),
    max_norm=st.floats(1e-3, 1e2),
    seed=st.integers(0, 2**16),
)
def test_clip_coefficient_equals_torch_clip_grad_norm(scales, max_norm, seed):
    gen = torch.Generator().manual_seed(seed)
    grads = [torch.randn(3, 2, generator=gen, dtype=torch.float64) * s for s in scales]
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    total = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
    coef = clip_coefficient(total, max_norm)
    assert 0 < coef <= 1.0
    for p, g in zip(params, grads):
        assert torch.equal(p.grad, g * coef)


def test_clip_coefficient_edges():
    assert clip_coefficient(1e9, 0.0) == 1.0  # gradient_clipping: 0 turns clipping off
    assert clip_coefficient(0.0, 1.0) == 1.0
    assert math.isnan(clip_coefficient(float("nan"), 1.0))
    with pytest.raises(ValueError, match="max_norm"):
        clip_coefficient(1.0, -1.0)


def layer_params(seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.nn.Parameter(torch.randn(*shape, generator=gen, dtype=torch.float64))
        for shape in ((4, 3), (3,), (2, 2, 2))
    ]


def train_steps(params, opt, t, steps: range, skip_grad: int | None = None) -> None:
    """Deterministic grads per (step, param); param ``skip_grad`` gets none (no state from that step)."""
    for step in steps:
        set_lr(opt, lr_at(t, step))
        for i, p in enumerate(params):
            gen = torch.Generator().manual_seed(1000 * step + i)
            p.grad = None if i == skip_grad else torch.randn(p.shape, generator=gen, dtype=p.dtype)
        opt.step()


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("steps_before", [0, 1, 3])
def test_loaded_state_continues_bit_identically(weight_decay, steps_before):
    t = training(
        lr=0.05,
        weight_decay=weight_decay,
        type="Adam",
        scheduler=SchedulerConfig(type="WarmupLR", params={"warmup_num_steps": 4, "warmup_type": "linear"}),
    )
    params = layer_params()
    opt = build_layer_optimizer(params, t)
    # Parameter 2 never had a gradient: it has no state while the others do.
    train_steps(params, opt, t, range(steps_before), skip_grad=2)

    moved = [torch.nn.Parameter(p.detach().clone()) for p in params]
    fresh = build_layer_optimizer(moved, t)
    sent = {k: v.clone() for k, v in optimizer_state(opt).items()}  # as received over torch.distributed
    load_optimizer_state(fresh, sent)
    for key in sent:
        sent[key].add_(7.0)  # the optimizer must hold copies, not the buffers it was given

    after = range(steps_before, steps_before + 3)
    train_steps(params, opt, t, after)
    train_steps(moved, fresh, t, after)
    for a, b in zip(params, moved):
        assert torch.equal(a, b)
    original, loaded = optimizer_state(opt), optimizer_state(fresh)
    assert list(original) == list(loaded)
    assert all(torch.equal(original[k], loaded[k]) and original[k].dtype == loaded[k].dtype for k in original)


def test_state_layout_depends_only_on_params():
    # A receiver allocates its buffers from its own fresh optimizer: same keys, order, shapes, dtypes.
    t = training(weight_decay=0.01)
    fresh = build_layer_optimizer(layer_params(), t)
    template = optimizer_state(fresh)
    assert len(fresh.state) == 0  # asking for the layout must not create state
    assert list(template) == [f"{i}.{k}" for i in range(3) for k in ("exp_avg", "exp_avg_sq", "step")]
    assert all(float(v.abs().sum()) == 0 for v in template.values())

    params = layer_params()
    stepped = build_layer_optimizer(params, t)
    train_steps(params, stepped, t, range(2))
    state = optimizer_state(stepped)
    assert list(state) == list(template)
    assert all(state[k].shape == template[k].shape and state[k].dtype == template[k].dtype for k in state)
    assert float(state["1.step"]) == 2.0 and float(state["0.exp_avg_sq"].abs().sum()) > 0


def test_load_rejects_state_of_another_layer():
    t = training()
    opt = build_layer_optimizer(layer_params(), t)
    state = optimizer_state(opt)
    with pytest.raises(ValueError, match="missing keys"):
        load_optimizer_state(opt, {k: v for k, v in state.items() if k != "1.step"})
    with pytest.raises(ValueError, match="unexpected keys"):
        load_optimizer_state(opt, {**state, "3.exp_avg": torch.zeros(1)})
    wrong = copy.copy(state)
    wrong["0.exp_avg"] = torch.zeros(3, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"'0.exp_avg': shape \(3, 4\)"):
        load_optimizer_state(opt, wrong)


def test_layer_optimizer_is_torchs_fused_adamw_with_the_loops_math():
    # The fused kernel (one per layer, not ~10 ops per tensor) updates as the per-tensor loop does.
    t = training(lr=0.05, weight_decay=0.1)
    fused_params, loop_params = layer_params(), layer_params()
    fused = build_layer_optimizer(fused_params, t)
    assert all(group["fused"] for group in fused.param_groups)
    hp = t.optimizer.params
    loop = torch.optim.AdamW(
        loop_params, lr=lr_at(t, 0), betas=tuple(hp.betas), eps=hp.eps, weight_decay=hp.weight_decay, foreach=False
    )
    train_steps(fused_params, fused, t, range(3))
    train_steps(loop_params, loop, t, range(3))
    for a, b in zip(fused_params, loop_params):
        torch.testing.assert_close(a, b, rtol=1e-14, atol=1e-15)


def test_grad_sq_sums_each_tensors_norm_in_float64():
    layer = torch.nn.Linear(300, 200)
    gen = torch.Generator().manual_seed(3)
    grads = [torch.randn(p.shape, generator=gen, dtype=torch.float64) * 10 for p in layer.parameters()]
    exact = sum(float(g.pow(2).sum()) for g in grads)
    for p, g in zip(layer.parameters(), grads):
        p.grad = g.float()
    got = grad_sq(layer)
    assert got.dtype == torch.float64
    assert abs(float(got) - exact) <= 1e-6 * exact  # float32 gradients: each tensor's norm in float32
    layer.double()
    for p, g in zip(layer.parameters(), grads):
        p.grad = g.clone()
    assert abs(float(grad_sq(layer)) - exact) <= 1e-14 * exact  # float64 gradients: float64 throughout
    layer.weight.grad = None  # a parameter without a gradient adds nothing
    assert abs(float(grad_sq(layer)) - float(grads[1].pow(2).sum())) <= 1e-14 * exact
