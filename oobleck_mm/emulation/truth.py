"""What the emulated accelerator really does: the true seconds of every stage's work and transfer.

An emulated run (``cluster.emulate``) must test the planner and the balancer
against a world they do not already know (``docs/emulation.md``, "Circularity"),
so the truth is the analytical roofline of the *real* model (``profiling.
analytical.pass_seconds``, every microbatch priced by its own samples' tokens
and attention spans) perturbed in two stated ways the planner never sees:

- a factor per layer kind or modality (``TruthProfile.factors``: the most
  specific key of ``modality.kind``, ``kind``, ``modality`` applies);
- per-sample noise: sample ``i`` runs ``exp(sigma * z_i - sigma^2 / 2)`` times
  its roofline time (mean 1), ``z_i`` a standard normal drawn from
  (``seed``, ``i``), the same in every process and every run.

A microbatch's layer time is the roofline of its summed tokens, weighted by its
samples' noise in proportion to each sample's share of that layer's tokens.

Transfers are priced from the real model's bytes at the job's bandwidths
(``planning.costs.ClusterSpec``): activations and their gradients between
stages, the layer-wise gradient all-reduce, a recovery's layer-state copies.

Pure: numpy, no torch (the simulator may use it).
"""

from __future__ import annotations

import json
import math
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np

from oobleck_mm.balance.work import LINEAR_FEATURE, QUADRATIC_FEATURE, F, sample_features
from oobleck_mm.config.shape import LayerSpec, layer_specs, param_count, resolve_frozen
from oobleck_mm.errors import UserError
from oobleck_mm.planning.costs import ClusterSpec, LayerCost, needs_input_grad
from oobleck_mm.profiling.analytical import compute_device, output_width, pass_seconds

if TYPE_CHECKING:
    from oobleck_mm.config import JobConfig
    from oobleck_mm.data.sample import SampleMeta


class TruthProfileError(UserError):
    """``cluster.emulate_profile`` cannot be read: the message names the file and the key."""


@dataclass(frozen=True, slots=True)
class TruthProfile:
    """How the emulated accelerator's true times differ from the analytical model the planner uses."""

    factors: Mapping[str, float] = field(default_factory=dict)
    """Multipliers of a layer's time by ``modality.kind``, ``kind`` or ``modality`` (most specific wins)."""
    noise: float = 0.0
    """Sigma of every sample's log-normal time factor (mean 1)."""
    seed: int = 0
    efficiency: float | None = None
    """The fraction of peak FLOP/s the true kernels reach; None: the job's (``cluster.compute_efficiency`` or
    the catalogue's), the planner's own."""
    scale: float = 1.0
    """Every duration (compute, transfers, all-reduces, copies) times this: the known delay the emulation's
    calibration adds (+10% must cost 10% of the throughput, ``scripts/bench_emulated.py calibrate``)."""
    odd_steps_scale: float = 1.0
    """Every duration of the odd steps times this too: the known delay interleaved with undelayed steps of the
    same run, so that whatever load the host carries falls on both alike (two runs side by side measured a
    +10% delay as +11.6% on a host 79% busy during the second)."""
    source: str = "built-in"

    def step_scale(self, step: int) -> float:
        """What every duration of global step ``step`` is multiplied by."""
        return self.scale * (self.odd_steps_scale if step % 2 else 1.0)

    def factor(self, spec: LayerSpec) -> float:
        for key in (f"{spec.modality}.{spec.kind}", spec.kind, spec.modality):
            if key in self.factors:
                return self.factors[key]
        return 1.0

    def describe(self) -> str:
        factors = ", ".join(f"{k} x{v:g}" for k, v in sorted(self.factors.items())) or "none"
        efficiency = "the planner's" if self.efficiency is None else f"{self.efficiency:g}"
        scale = f", every duration x{self.scale:g}" if self.scale != 1 else ""
        if self.odd_steps_scale != 1:
            scale += f", odd steps' x{self.odd_steps_scale:g}"
        return (
            f"truth {self.source}: analytical roofline at efficiency {efficiency}, factors {factors}, "
            f"per-sample noise sigma {self.noise:g} (seed {self.seed}){scale}"
        )

    def to_dict(self) -> dict:
        return {
            "factors": dict(self.factors),
            "noise": self.noise,
            "seed": self.seed,
            "efficiency": self.efficiency,
            "scale": self.scale,
            "odd_steps_scale": self.odd_steps_scale,
            "source": self.source,
        }


DEFAULT_TRUTH = TruthProfile(
    # Kinds a roofline gets wrong in known directions: attention-heavy encoder blocks run below the matmul
    # rate, small-hidden audio blocks and the vocabulary-wide head are launch- and memory-bound.
    factors={"vision.block": 1.12, "audio.block": 0.92, "lm_head": 1.25, "projector": 1.3, "token_embed": 1.5},
    noise=0.08,
    seed=0,
)
"""The truth of an emulated run without ``cluster.emulate_profile``; the run prints it."""

_PROFILE_KEYS = ("factors", "noise", "seed", "efficiency", "scale", "odd_steps_scale")


def load_truth(path: str | None) -> TruthProfile:
    """``cluster.emulate_profile``'s file, or ``DEFAULT_TRUTH``. A file that does not parse or holds a bad
    value raises ``TruthProfileError`` naming the file, the key and what is valid."""
    if path is None:
        return DEFAULT_TRUTH
    where = f"cluster.emulate_profile ({path})"
    try:
        with open(path) as fh:
            raw = json.load(fh)
    except OSError as exc:
        raise TruthProfileError(f"{where}: cannot be read: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise TruthProfileError(f"{where}: not JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise TruthProfileError(f"{where}: must be a JSON object with keys {', '.join(_PROFILE_KEYS)}")
    unknown = sorted(set(raw) - set(_PROFILE_KEYS))
    if unknown:
        raise TruthProfileError(f"{where}: unknown key {unknown[0]!r}; valid: {', '.join(_PROFILE_KEYS)}")
    factors = raw.get("factors", {})
    if not isinstance(factors, dict) or not all(_positive(v) for v in factors.values()):
        raise TruthProfileError(f"{where}: factors must map a layer kind or modality to a number > 0, got {factors!r}")
    noise, seed, efficiency = raw.get("noise", 0.0), raw.get("seed", 0), raw.get("efficiency")
    if not (_number(noise) and 0 <= noise < 1):
        raise TruthProfileError(f"{where}: noise must be a number in [0, 1), got {noise!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise TruthProfileError(f"{where}: seed must be an integer >= 0, got {seed!r}")
    if efficiency is not None and not (_number(efficiency) and 0 < efficiency <= 1):
        raise TruthProfileError(f"{where}: efficiency must be in (0, 1], got {efficiency!r}")
    scale, odd = raw.get("scale", 1.0), raw.get("odd_steps_scale", 1.0)
    for key, value in (("scale", scale), ("odd_steps_scale", odd)):
        if not _positive(value):
            raise TruthProfileError(f"{where}: {key} must be a number > 0, got {value!r}")
    return TruthProfile(
        factors={str(k): float(v) for k, v in factors.items()},
        noise=float(noise),
        seed=seed,
        efficiency=efficiency,
        scale=float(scale),
        odd_steps_scale=float(odd),
        source=path,
    )


def _number(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def _positive(value) -> bool:
    return _number(value) and value > 0


def sample_noise(seed: int, index: int, sigma: float) -> float:
    """Sample ``index``'s time factor: log-normal with mean 1, the same in every process (a hash, not a stream)."""
    if sigma == 0:
        return 1.0
    rng = np.random.default_rng(zlib.crc32(f"{seed}:{index}".encode()))
    return float(math.exp(sigma * rng.standard_normal() - sigma * sigma / 2))


@dataclass(frozen=True, slots=True)
class _Dims:
    """``balance.work.ModelDims`` of the real model (how a sample's metadata becomes its tokens)."""

    patch_size: int = 1
    image_merge: int = 1
    audio_downsample: int = 1
    audio_merge: int = 1

    @classmethod
    def of(cls, model) -> _Dims:
        kwargs = {}
        if model.vision is not None:
            kwargs.update(patch_size=model.vision.patch_size, image_merge=model.vision.token_merge)
        if model.audio is not None:
            kwargs.update(audio_downsample=model.audio.downsample, audio_merge=model.audio.token_merge)
        return cls(**kwargs)


@dataclass(frozen=True, slots=True)
class _Group:
    """Identical layers of one stage (an encoder's blocks): priced once per microbatch."""

    spec: LayerSpec
    count: int
    trainable: bool
    input_grad: bool
    linear: int
    """Column of ``balance.work.FEATURES`` that counts its tokens."""
    quadratic: int | None


class Truth:
    """The true seconds of a job's stages on its emulated accelerator (``cluster.emulate``)."""

    def __init__(self, job: JobConfig, profile: TruthProfile | None = None) -> None:
        if job.cluster.emulate is None:
            raise ValueError("Truth needs a job with cluster.emulate set")
        self.job = job
        self.profile = profile if profile is not None else load_truth(job.cluster.emulate_profile)
        device = compute_device(job)
        efficiency = self.profile.efficiency or job.cluster.compute_efficiency
        self.device = replace(device, efficiency=efficiency) if efficiency is not None else device
        self.cluster = ClusterSpec.from_config(job.cluster)
        self.specs = layer_specs(job.model, job.data)
        self.dims = _Dims.of(job.model)
        frozen = resolve_frozen(job.model.frozen, self.specs)
        self.trainable = tuple(param_count(s) > 0 and s.name not in frozen for s in self.specs)
        stub = tuple(
            LayerCost(
                name=s.name,
                modality=s.modality,
                forward_s=0.0,
                backward_weight_s=0.0,
                backward_input_s=0.0,
                param_bytes=0,
                grad_bytes=0,
                optimizer_bytes=0,
                activation_bytes=0,
                output_bytes=0,
                trainable=t,
            )
            for s, t in zip(self.specs, self.trainable)
        )
        self.input_grad = needs_input_grad(stub)
        self._features: dict[int, np.ndarray] = {}
        self._noise: dict[int, float] = {}
        self.scale = self.profile.step_scale(0)
        """Every duration's multiplier at the step ``at_step`` last named (``TruthProfile.step_scale``)."""

    def at_step(self, step: int) -> Truth:
        """The durations of global step ``step`` from now on (a profile's ``odd_steps_scale``)."""
        self.scale = self.profile.step_scale(step)
        return self

    # ------------------------------------------------------------------ samples
    def features(self, metas: Sequence[SampleMeta]) -> np.ndarray:
        """Rows of ``balance.work.FEATURES`` for ``metas`` at the real model's dims (cached by sample)."""
        missing = [m for m in metas if m.index not in self._features]
        if missing:
            for meta, row in zip(missing, sample_features(missing, self.dims)):
                self._features[meta.index] = row
                self._noise[meta.index] = sample_noise(self.profile.seed, meta.index, self.profile.noise)
        return np.stack([self._features[m.index] for m in metas]) if metas else np.zeros((0, len(F)))

    def _noise_of(self, metas: Sequence[SampleMeta]) -> np.ndarray:
        return np.array([self._noise[m.index] for m in metas])

    # ------------------------------------------------------------------ stages
    def groups(self, layers: Sequence[int]) -> list[_Group]:
        """``layers`` as runs of identical specs (the name aside)."""
        groups: list[_Group] = []
        for i in layers:
            spec = self.specs[i]
            key = replace(spec, name="")
            if (
                groups
                and replace(groups[-1].spec, name="") == key
                and groups[-1].trainable == self.trainable[i]
                and groups[-1].input_grad == self.input_grad[i]
            ):
                groups[-1] = replace(groups[-1], count=groups[-1].count + 1)
                continue
            quadratic = QUADRATIC_FEATURE[spec.modality] if spec.kind == "block" and spec.attention_len else None
            groups.append(
                _Group(
                    spec,
                    1,
                    self.trainable[i],
                    self.input_grad[i],
                    F[LINEAR_FEATURE[(spec.modality, spec.kind)]],
                    F[quadratic] if quadratic is not None else None,
                )
            )
        return groups

    def stage_seconds(
        self, groups: Sequence[_Group], metas: Sequence[SampleMeta], recompute: bool = False
    ) -> tuple[float, float]:
        """(forward, backward) true seconds of a stage's ``groups`` over one microbatch of ``metas``. The
        backward is Cornstarch's eq. 3.2: weight gradients of trainable layers, input gradients where a
        trainable layer precedes; a stage that ``recompute``s (the plan's ``StageSpec.recompute``) runs
        every such layer's forward again first."""
        rows = self.features(metas)
        noise = self._noise_of(metas)
        flash = self.job.training.flash_attention
        forward = backward = 0.0
        for g in groups:
            per_sample = rows[:, g.linear]
            tokens = float(per_sample.sum())
            if tokens <= 0:
                continue
            span = float(rows[:, g.quadratic].sum()) / tokens if g.quadratic is not None else None
            f, bw, bd = pass_seconds(g.spec, tokens, self.device, flash, attention_len=span)
            scale = g.count * self.profile.factor(g.spec) * self.scale * float(per_sample @ noise) / tokens
            forward += f * scale
            again = f if recompute and (g.trainable or g.input_grad) else 0.0
            backward += ((bw if g.trainable else 0.0) + (bd if g.input_grad else 0.0) + again) * scale
        return forward, backward

    def output_bytes(self, last: int, metas: Sequence[SampleMeta]) -> float:
        """Bytes a stage ending at layer ``last`` sends downstream for one microbatch (its output at the compute
        dtype, plus an earlier encoder branch's projected tokens riding along to the LLM); the same comes back
        as the gradient."""
        rows = self.features(metas)
        spec = self.specs[last]
        width = self.device.bytes_per_param
        total = float(rows[:, F[LINEAR_FEATURE[(spec.modality, spec.kind)]]].sum()) * output_width(spec) * width
        if spec.modality == "audio" and any(s.modality == "vision" for s in self.specs):
            total += float(rows[:, F["vision_tokens"]].sum()) * self.job.model.llm.hidden * width
        return total

    def transfer_s(self, num_bytes: float) -> float:
        """One stage-to-stage message between nodes (one GPU per stage: always across GPUs)."""
        return self.scale * self.cluster.transfer_s(num_bytes, cross_node=self.job.cluster.gpus_per_node == 1)

    def grad_bytes(self, layers: Sequence[int]) -> float:
        """Bytes of ``layers``' gradients the layer-wise all-reduce sums (trainable layers only)."""
        width = 2 if self.job.training.grad_reduce_dtype == "bfloat16" else self.device.grad_bytes
        return float(sum(param_count(self.specs[i]) * width for i in layers if self.trainable[i]))

    def allreduce_s(self, layers: Sequence[int], pipelines: int) -> float:
        """The gradient all-reduce of a stage's ``layers`` across ``pipelines`` replicas (ring, between nodes)."""
        return self.scale * self.cluster.allreduce_s(self.grad_bytes(layers), pipelines, cross_node=True)

    def state_bytes(self, index: int) -> float:
        """Bytes of layer ``index``'s state a recovery copies: its master parameters, and their two Adam moments
        when trainable, all in the master dtype (the compute copy of mixed precision is derived, not moved)."""
        master = self.device.grad_bytes  # the master dtype's width (``DeviceSpec.with_dtype``)
        return float(param_count(self.specs[index]) * master * (3 if self.trainable[index] else 1))

    def copy_s(self, layers: Sequence[int]) -> float:
        """A receiver's copy of ``layers``' states over its one inter-node link."""
        return self.scale * self.cluster.transfer_s(sum(self.state_bytes(i) for i in layers), cross_node=True)


def describe_emulation(job: JobConfig) -> str:
    """What an emulated run is, in one paragraph: the accelerator, the truth, the compute copy (printed at its
    start, kept in ``emulation.json``)."""
    from oobleck_mm.config.emulation import auto_coarsen, auto_shrink

    c = job.cluster
    shrink = c.emulate_shrink or auto_shrink(job.model)
    coarsen = c.emulate_coarsen or auto_coarsen(job.model, job.data)
    return (
        f"emulating {c.emulate} ({job.cluster.nodes} nodes x {c.gpus_per_node} GPUs; stages and transfers "
        f"end when the real model's would; control plane in real time). "
        f"{load_truth(c.emulate_profile).describe()}. Compute copy: widths / {shrink}, encoder tokens {coarsen}x "
        f"coarser, text {coarsen}x shorter, float32 (config.emulation)."
    )
