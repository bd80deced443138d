"""What multimodal data skew costs a plan, and what the balancer buys back (issue 32 item 4).

The planner prices a pipeline as if every sample cost the profile's mean sample. Real batches mix
text-only samples with image-heavy ones, so microbatches differ and 1F1B waits for the worst stage of each
slot. ``SkewPricer`` samples global batches from the job's data (its synthetic generator: the same
metadata the engine's sampler draws) and prices them with the balancer's own cost model and exact 1F1B
recurrence (``balance.problem``), in one of three modes:

* ``off``: the contiguous split (``balance.enabled: false``);
* ``dp``: the balancer's placement (which pipeline and microbatch runs each sample);
* ``dp+deferral``: the same, then Entrain's stratified split and deferral inside each pipeline
  (``balance.deferral``).

The batches come from outside (``oobleck_mm.data.skew_samples``, called by the CLI): the data pipeline
imports torch, and the simulator stays pure (the import-linter contract); only their metadata is read.

A plan's skew factor is the mean, over the sampled batches, of the slowest pipeline's predicted seconds
divided by the same plan's with every sample replaced by the batch's mean sample. The simulator multiplies
the plan's 1F1B part by it (the gradient all-reduce does not depend on the samples). Pure: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

MODES = ("off", "dp", "dp+deferral")


def mode_of(balance) -> str:
    """The job's ``balance`` section as a pricing mode."""
    if not balance.enabled:
        return "off"
    return "dp+deferral" if balance.deferral else "dp"


@dataclass(slots=True)
class SkewPricer:
    job: object
    profile: object
    samples: tuple
    """``(batches of SampleMeta, the model's dims)``, as ``data.skew_samples.sampled_batches`` returns them."""
    features: list = field(default_factory=list)
    _model: object = None
    _cache: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        from oobleck_mm.balance.cost_model import CostModel
        from oobleck_mm.balance.work import sample_features
        from oobleck_mm.config.shape import layer_specs

        batches, dims = self.samples
        if not batches:
            raise ValueError("SkewPricer needs at least one sampled batch")
        self.features = [sample_features(metas, dims) for metas in batches]
        self._model = CostModel.from_profile(self.profile, layer_specs(self.job.model, self.job.data))

    def factor(self, plan, mode: str) -> float:
        """``plan``'s (a planning ``Plan``) 1F1B time under skewed batches over its time with mean samples."""
        from oobleck_mm.balance.problem import PipelineShape

        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        shapes = tuple(
            PipelineShape(p.num_microbatches, tuple((s.layer_start, s.layer_end) for s in p.template.stages))
            for p in plan.pipelines
        )
        key = (shapes, plan.microbatch_size, mode)
        if key not in self._cache:
            self._cache[key] = float(np.mean([self._one(f, shapes, plan.microbatch_size, mode) for f in self.features]))
        return self._cache[key]

    def _one(self, features: np.ndarray, shapes, microbatch_size: int, mode: str) -> float:
        from oobleck_mm.balance.balancer import balance
        from oobleck_mm.balance.cost_model import CostCoefficients
        from oobleck_mm.balance.problem import BalanceProblem

        coefficients = CostCoefficients.initial(self.job.balance.fixed_s_per_layer)
        ids = np.arange(len(features))
        fill = sum(s.num_microbatches for s in shapes) * microbatch_size == len(features)
        size = microbatch_size if fill else None
        mean = np.repeat(features.mean(axis=0, keepdims=True), len(features), axis=0)
        uniform = balance(
            BalanceProblem.build(ids, mean, shapes, self._model, coefficients, size), "ours", threshold=1e9
        )
        problem = BalanceProblem.build(ids, features, shapes, self._model, coefficients, size)
        if mode == "off" and fill:
            skewed = balance(problem, "ours", threshold=1e9)  # always kept contiguous
        else:
            skewed = balance(problem, "ours", self.job.balance.threshold, deferral=mode == "dp+deferral")
        return max(skewed.predicted_s) / max(uniform.predicted_s)
