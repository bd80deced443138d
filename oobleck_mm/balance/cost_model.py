"""Predicted time of a pipeline stage for one microbatch, from its samples' token counts.

Model. A microbatch with feature vector ``x`` (``work.FEATURES``: the sum of
its samples' rows, 1 in the ``microbatch`` column) costs stage ``[u, v)``::

    seconds = sum_{layers l in [u, v)} sum_terms scale[term] * base[l, term, feature] * x[feature]

Each layer has three terms of its modality (vision, audio or text):

* ``<m>.fixed``: ``base = 1`` on the ``microbatch`` feature, so its scale is
  seconds per layer per microbatch (launches, norms, small ops);
* ``<m>.linear``: the profile's forward + backward seconds per token of the
  layer (projectors count merged tokens, the LLM counts its whole sequence);
* ``<m>.quadratic``: the profile's attention seconds per token^2 unit
  (``sum patches^2`` over images, ``sum tokens^2`` over clips, the sample's
  LLM length squared).

The profile gives one time per layer; it is split into its linear and
attention parts in proportion to their FLOPs (``2*P*s`` against
``4*s*L*h``, halved when causal, as ``profiling.analytical`` counts them),
and frozen layers use ``planning.costs.effective_layers``' backward.

Only the ``len(TERMS)`` scales are fitted (``CostCoefficients``): the per-layer
shape comes from the profile. So a fit made on one set of stages predicts any
other cut of the layers: after a reconfiguration the balancer keeps its
coefficients, with no new warm-up. The fit is robust non-negative least
squares on relative errors (``nnls.robust_nnls``), with a weak pull toward the
previous coefficients so terms the measurements cannot separate (say, the
fixed costs of two modalities always sharing a stage) keep their old values.

Determinism: every rank must derive bit-identical stage vectors from the
shipped coefficients, so everything here is elementwise IEEE arithmetic and
sequential prefix sums, never BLAS (whose kernels, and so roundings, differ
between CPUs).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from oobleck_mm.balance.nnls import robust_nnls
from oobleck_mm.balance.work import F, LINEAR_FEATURE, NUM_FEATURES, QUADRATIC_FEATURE
from oobleck_mm.config.shape import LayerSpec, matmul_param_count
from oobleck_mm.planning.costs import MODALITIES, ModelProfile, effective_layers

TERM_KINDS = ("fixed", "linear", "quadratic")
TERMS = tuple(f"{m}.{k}" for m in MODALITIES for k in TERM_KINDS)
NUM_TERMS = len(TERMS)


@dataclass(frozen=True, slots=True)
class CostCoefficients:
    """The fitted scales: what the master ships to every rank with a step's plan."""

    scales: tuple[float, ...]
    """One per ``TERMS`` entry: ``<m>.fixed`` in seconds per layer per microbatch; ``<m>.linear`` and
    ``<m>.quadratic`` multiply the profile's per-token costs (1.0: the profile as is)."""
    num_observations: int = 0
    """Stage timings the last fit used (0: straight from the profile)."""

    def __post_init__(self) -> None:
        if len(self.scales) != NUM_TERMS:
            raise ValueError(f"scales must have {NUM_TERMS} entries ({', '.join(TERMS)}), got {len(self.scales)}")
        for name, value in zip(TERMS, self.scales):
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"scales[{name}] must be a finite number >= 0, got {value}")

    @classmethod
    def initial(cls, fixed_s_per_layer: float = 0.0) -> CostCoefficients:
        """The profile's costs, with a guessed fixed cost per layer per microbatch."""
        return cls(tuple(fixed_s_per_layer if t.endswith(".fixed") else 1.0 for t in TERMS))

    def scale(self, term: str) -> float:
        return self.scales[TERMS.index(term)]

    def to_dict(self) -> dict[str, Any]:
        return {"scales": dict(zip(TERMS, self.scales)), "num_observations": self.num_observations}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> CostCoefficients:
        scales = d["scales"]
        unknown = sorted(set(scales) - set(TERMS))
        if unknown:
            raise ValueError(f"coefficients: unknown terms {unknown}; valid: {', '.join(TERMS)}")
        return cls(tuple(float(scales[t]) for t in TERMS), int(d.get("num_observations", 0)))


@dataclass(frozen=True, slots=True)
class StageTiming:
    """One measurement: a stage's forward + backward seconds for one microbatch."""

    layer_start: int
    layer_end: int
    """Exclusive."""
    features: tuple[float, ...]
    """The microbatch's feature vector (``work.microbatch_features``)."""
    seconds: float


@dataclass(frozen=True, slots=True, eq=False)
class CostModel:
    """Per-layer cost shape from a profile; combine with ``CostCoefficients`` to predict."""

    layer_names: tuple[str, ...]
    prefix: np.ndarray
    """``(L + 1, NUM_TERMS, NUM_FEATURES)``: cumulative per-layer base weights (sequential cumsum)."""
    forward_prefix: np.ndarray
    """``(L + 1,)`` cumulative profile forward seconds, and ``total_prefix`` forward + backward."""
    total_prefix: np.ndarray

    @property
    def num_layers(self) -> int:
        return len(self.layer_names)

    @classmethod
    def from_profile(cls, profile: ModelProfile, specs: Sequence[LayerSpec]) -> CostModel:
        """``specs``: the model's layers in the profile's order (``config.shape.layer_specs``)."""
        names = tuple(layer.name for layer in profile.layers)
        if names != tuple(s.name for s in specs):
            raise ValueError(
                f"profile layers {names[:3]}... do not match the layer specs {[s.name for s in specs][:3]}..."
            )
        effective = effective_layers(profile)
        weights = np.zeros((len(specs), NUM_TERMS, NUM_FEATURES))
        for i, (spec, eff) in enumerate(zip(specs, effective)):
            weights[i] = _layer_weights(spec, eff.forward_s + eff.backward_s, profile.microbatch_size)
        forward = np.array([e.forward_s for e in effective])
        total = np.array([e.forward_s + e.backward_s for e in effective])
        return cls(names, _cumsum0(weights), _cumsum0(forward), _cumsum0(total))

    # ------------------------------------------------------------------ predictions
    def design(self, start: int, end: int) -> np.ndarray:
        """``(NUM_TERMS, NUM_FEATURES)`` base weights summed over layers ``[start, end)``."""
        self._check_range(start, end)
        return self.prefix[end] - self.prefix[start]

    def stage_vector(self, coefficients: CostCoefficients, start: int, end: int) -> np.ndarray:
        """``(NUM_FEATURES,)`` seconds per unit of each feature on stage ``[start, end)``."""
        w = self.design(start, end)
        out = np.zeros(NUM_FEATURES)
        for t, scale in enumerate(coefficients.scales):  # elementwise, in a fixed order: reproducible
            out = out + scale * w[t]
        return out

    def forward_share(self, start: int, end: int) -> float:
        """Forward's share of the stage's forward + backward time (from the profile)."""
        self._check_range(start, end)
        total = self.total_prefix[end] - self.total_prefix[start]
        return float((self.forward_prefix[end] - self.forward_prefix[start]) / total) if total > 0 else 1 / 3

    def predict(self, coefficients: CostCoefficients, start: int, end: int, features: np.ndarray) -> np.ndarray:
        """Seconds of stage ``[start, end)`` for microbatch feature vectors ``(..., NUM_FEATURES)``."""
        v = self.stage_vector(coefficients, start, end)
        features = np.asarray(features, dtype=float)
        out = np.zeros(features.shape[:-1])
        for f in range(NUM_FEATURES):
            out = out + features[..., f] * v[f]
        return out

    # ------------------------------------------------------------------ fitting
    def fit(self, prior: CostCoefficients, timings: Sequence[StageTiming], ridge: float = 1e-4) -> CostCoefficients:
        """Coefficients that best explain ``timings`` (relative error, outliers rejected).

        ``prior`` is pulled toward with weight ``ridge`` (relative to one unit-norm column),
        and terms no timing exercises keep their prior value.
        """
        if not timings:
            return prior
        rows, seconds = self._design_rows(timings)
        # Relative errors: a 10 ms microbatch and a 1 s one count alike.
        rows = rows / seconds[:, None]
        target = np.ones(len(seconds))
        norms = np.sqrt((rows**2).sum(axis=0))
        active = norms > 1e-12 * norms.max(initial=0.0)
        if not active.any():
            return prior
        theta0 = np.asarray(prior.scales)
        a = rows[:, active] / norms[active]
        n_active = int(active.sum())
        # Prior rows: sqrt(ridge) * (phi - phi0), phi = theta * norm (unit-norm columns).
        a = np.vstack([a, math.sqrt(ridge) * np.eye(n_active)])
        b = np.concatenate([target, math.sqrt(ridge) * theta0[active] * norms[active]])
        phi, _ = robust_nnls(a, b, prior_rows=n_active)
        theta = theta0.copy()
        theta[active] = phi / norms[active]
        return CostCoefficients(tuple(float(x) for x in theta), num_observations=len(timings))

    def _design_rows(self, timings: Sequence[StageTiming]) -> tuple[np.ndarray, np.ndarray]:
        rows = np.zeros((len(timings), NUM_TERMS))
        seconds = np.zeros(len(timings))
        for i, t in enumerate(timings):
            if len(t.features) != NUM_FEATURES:
                raise ValueError(f"timing {i}: features must have {NUM_FEATURES} entries, got {len(t.features)}")
            if not (math.isfinite(t.seconds) and t.seconds > 0):
                raise ValueError(f"timing {i}: seconds must be a finite number > 0, got {t.seconds}")
            rows[i] = self.design(t.layer_start, t.layer_end) @ np.asarray(t.features, dtype=float)
            seconds[i] = t.seconds
        return rows, seconds

    def _check_range(self, start: int, end: int) -> None:
        if not 0 <= start < end <= self.num_layers:
            raise ValueError(f"stage layers [{start}, {end}) must satisfy 0 <= start < end <= {self.num_layers}")


def _layer_weights(spec: LayerSpec, seconds: float, microbatch_size: int) -> np.ndarray:
    """One layer's ``(NUM_TERMS, NUM_FEATURES)`` base weights from its profiled seconds."""
    modality = spec.modality
    w = np.zeros((NUM_TERMS, NUM_FEATURES))
    w[TERMS.index(f"{modality}.fixed"), F["microbatch"]] = 1.0
    tokens = microbatch_size * spec.tokens_per_sample
    if tokens <= 0 or seconds <= 0:
        return w
    matmul = 2.0 * matmul_param_count(spec) * tokens
    attention = 4.0 * tokens * spec.attention_len * spec.hidden * (0.5 if spec.causal else 1.0)
    quad_share = attention / (matmul + attention) if matmul + attention > 0 else 0.0
    linear_feature = LINEAR_FEATURE.get((modality, spec.kind))
    if linear_feature is None:
        raise ValueError(f"layer {spec.name!r}: no work feature for a {spec.kind!r} layer of modality {modality!r}")
    w[TERMS.index(f"{modality}.linear"), F[linear_feature]] = seconds * (1 - quad_share) / tokens
    if quad_share > 0:
        # The profile's attention work is tokens * span summed over the microbatch: the
        # sum of span^2 over the attention spans (images, clips, samples) it holds.
        units = tokens * spec.attention_len
        w[TERMS.index(f"{modality}.quadratic"), F[QUADRATIC_FEATURE[modality]]] = seconds * quad_share / units
    return w


def _cumsum0(values: np.ndarray) -> np.ndarray:
    """Prefix sums with a leading zero row; ``np.cumsum`` adds sequentially, the same on every CPU."""
    out = np.zeros((len(values) + 1, *values.shape[1:]))
    np.cumsum(values, axis=0, out=out[1:])
    return out
