"""The data-parallel balancer inside the engine: one assignment per step, the same on every rank.

Each step every rank builds the same ``BalanceProblem`` from the sampler's
global batch, the samples' metadata (nothing is loaded) and the current plan's
pipelines, and runs the same deterministic algorithm, so all ranks agree on
which pipeline and microbatch runs each sample without exchanging data.

The cost model starts from the analytical profile of the config (identical on
every rank) and is refitted every ``balance.fit_every`` steps from measured
per-stage, per-microbatch times: rank 0 gathers every rank's recent timings,
fits, and broadcasts the coefficients, so ranks never diverge even on
heterogeneous hardware. The refit runs at the start of a step, before any
gradient exists, so a peer failing during it only aborts that step.

A ``StepBalancer`` is handed from engine to engine across reconfigurations:
the coefficients and the timing window survive (timings are per layer range,
valid for any plan), so nothing warms up again.

Nothing is pickled between processes: timings travel as float64 tensors (one
row per timing: layer range, seconds, features) and coefficients as one float64
vector, so a peer (or anyone who reaches the store) can send data, never code.
"""

from __future__ import annotations

from collections import deque

import numpy as np
import torch
import torch.distributed as dist

from oobleck_mm.balance.balancer import balance, step_metrics
from oobleck_mm.balance.cost_model import CostCoefficients, CostModel, StageTiming
from oobleck_mm.balance.problem import BalanceProblem, pipeline_shapes, recompute_factor
from oobleck_mm.balance.cost_model import NUM_TERMS
from oobleck_mm.balance.work import LLM_FEATURES, NUM_FEATURES, microbatch_features, sample_features
from oobleck_mm.data.dataset import ModelInputs


_LLM_COLUMNS = np.array(sorted(LLM_FEATURES))
"""The feature columns of a slot that are its LLM samples' (``StageWork.slot_features``)."""

TIMING_COLUMNS = 3 + NUM_FEATURES
"""A timing as a tensor row: layer_start, layer_end, seconds, then the microbatch's features."""


def warm_balancer(job) -> None:
    """Loads the balancer's numba kernels (``balance.search.warm_up``: numba's import and its disk cache)
    for a job that balances with them. A worker does it before it says it is ready (and a local run's
    template before it forks), not in a joiner's preparation, where an HF LLaVA joiner spent 1.2-1.7 s on it
    beside its peers' training. Cheap once done in this process."""
    if job.balance.enabled and job.balance.algorithm.startswith("ours"):
        from oobleck_mm.balance.search import warm_up

        warm_up()


def step_balancer(job, data, specs, device: torch.device | str = "cpu", emulation=None) -> StepBalancer:
    """The balancer of a stage's engine. On an emulated device (``runtime.emulated.Emulation``) ``job``, ``data``
    and ``specs`` are the compute copy's; the balancer works on the real job's instead (its cost model, its
    samples' real tokens), as it would on the real cluster: the assignment is the same on every rank either
    way, and every rank packs the compute copy's samples of the ids it assigns."""
    if emulation is not None:
        return StepBalancer(emulation.job, emulation.data, emulation.truth.specs, device)
    return StepBalancer(job, data, specs, device)


class StageWork:
    """The cost model's view of what a stage runs: each sample's features (from its metadata: nothing is
    loaded; cached) and a microbatch slot's, for the balancer's timings and the straggler detector's
    expectation alike."""

    def __init__(self, job, data, specs):
        from oobleck_mm.profiling.analytical import profile_from_config

        self.data = data
        self.dims = ModelInputs.from_model(job.model)
        self.model = CostModel.from_profile(profile_from_config(job), specs)
        self._features: dict[int, np.ndarray] = {}

    def features(self, ids) -> np.ndarray:
        missing = [i for i in ids if i not in self._features]
        if missing:
            rows = sample_features(self.data.metas(missing), self.dims)
            self._features.update(zip(missing, rows))
        return np.stack([self._features[i] for i in ids])

    def slot_features(self, stage, ids, llm_ids=None) -> np.ndarray:
        """What ``stage`` computed for one microbatch slot of ``ids``. ``llm_ids``: with Entrain's deferral, the
        samples the slot ran through the LLM's layers (and through the encoders' backward): encoder columns
        weighted by the stage's forward share between ``ids`` (forward) and ``llm_ids`` (backward), LLM
        columns of ``llm_ids``. The cost model is linear, so this is exact for it."""
        feats = microbatch_features(self.features(list(ids)))
        if llm_ids is not None and tuple(llm_ids) != tuple(ids):
            share = self.model.forward_share(stage.layer_start, stage.layer_end)
            after = microbatch_features(self.features(list(llm_ids)))
            feats = share * feats + (1 - share) * after
            feats[_LLM_COLUMNS] = after[_LLM_COLUMNS]
            feats[0] = 1.0
        return feats


class ComputeExpectation:
    """A rank's forward and backward seconds over the samples its stage ran, by the planner's own analytical
    cost model (never refitted: a refit learns a slow node's layers as the model's error): what the master's
    straggler detector divides the rank's measured compute by (``StepMetrics.expected_compute_s``).

    Per sample, not the plan's mean microbatch: on emulated MLLM-10B (two pipelines given different samples
    each step) the mean read a node slowed exactly 2x at 1.2-2.8x step by step, and it was flagged at 1.6x."""

    def __init__(self, work: StageWork, fixed_s_per_layer: float = 0.0) -> None:
        self.work = work
        self.coefficients = CostCoefficients.initial(fixed_s_per_layer)

    @classmethod
    def for_job(cls, job, data, specs, emulation=None) -> ComputeExpectation:
        """On an emulated device, the real job's model and samples (as ``step_balancer``)."""
        if emulation is not None:
            job, data, specs = emulation.job, emulation.data, emulation.truth.specs
        return cls(StageWork(job, data, specs), job.balance.fixed_s_per_layer)

    def seconds(self, stage, microbatches, llm_microbatches=None) -> float:
        """One rank's share of ``stage``'s seconds over ``microbatches`` (a stage of d GPUs: 1/d each)."""
        if not microbatches:
            return 0.0
        rows = np.stack(
            [
                self.work.slot_features(stage, ids, llm_microbatches[k] if llm_microbatches else None)
                for k, ids in enumerate(microbatches)
            ]
        )
        total = self.work.model.predict(self.coefficients, stage.layer_start, stage.layer_end, rows).sum()
        if stage.recompute:  # its forward runs again in the backward: not a straggler for that
            total *= recompute_factor(self.work.model.forward_share(stage.layer_start, stage.layer_end))
        return float(total) / max(1, stage.width)


class StepBalancer:
    def __init__(self, job, data, specs, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        """Where exchanged tensors live: the process group's device (NCCL needs CUDA tensors)."""
        self.config = job.balance
        self.data = data
        self.work = StageWork(job, data, specs)
        self.dims = self.work.dims
        self.model = self.work.model
        self.coefficients = CostCoefficients.initial(self.config.fixed_s_per_layer)
        self.window: deque[StageTiming] = deque(maxlen=self.config.fit_window)
        self.fresh: list[StageTiming] = []
        """This rank's timings since the last fit."""
        self.last_metrics: dict[str, float] = {}
        warm_balancer(job)  # the compiled kernels now, not inside the first step (done already in a worker)

    def state_dict(self) -> dict:
        """The fitted cost model and the timings it was fitted to (plain numbers: checkpoints load
        them with ``weights_only``)."""
        coefficients = self.coefficients.to_dict()
        coefficients = {
            "scales": {k: float(v) for k, v in coefficients["scales"].items()},
            "num_observations": int(coefficients["num_observations"]),
        }
        return {
            "coefficients": coefficients,
            "window": [
                [t.layer_start, t.layer_end, [float(x) for x in t.features], float(t.seconds)] for t in self.window
            ],
        }

    def load_state_dict(self, state: dict) -> None:
        self.coefficients = CostCoefficients.from_dict(state["coefficients"])
        self.window.clear()
        self.window.extend(StageTiming(int(a), int(b), tuple(f), float(s)) for a, b, f, s in state["window"])

    def features(self, ids) -> np.ndarray:
        return self.work.features(ids)

    def assign(self, step: int, ids, plan):
        """The step's assignment (and predicted metrics); identical on every rank."""
        problem = BalanceProblem.build(
            ids, self.features(ids), pipeline_shapes(plan), self.model, self.coefficients, plan.microbatch_size, step
        )
        # Entrain's deferral regroups whole microbatches at the LLM's first layer (a branched pipeline's merge
        # stage); on a pipeline whose stages split microbatches over several GPUs it does not run yet.
        deferral = self.config.deferral and not plan.sharded
        result = balance(problem, self.config.algorithm, self.config.threshold, deferral)
        self.last_metrics = step_metrics(problem, result)
        if result.unbalanced_s is not None:
            self.last_metrics["predicted_contiguous_max_s"] = max(result.unbalanced_s)
        return result.assignment

    def observe(self, stage, microbatches, times, llm_microbatches=None) -> None:
        """Record this stage's (forward + backward) seconds of each microbatch of the step.

        ``llm_microbatches``: with Entrain's deferral, the samples each slot ran through the LLM's layers
        (``StageWork.slot_features``)."""
        # A recomputing stage's seconds include a second forward the cost model's layers do not: fitted as
        # the stage would take without it, so that one fit serves every stage (problem.recompute_factor).
        again = recompute_factor(self.model.forward_share(stage.layer_start, stage.layer_end)) if stage.recompute else 1
        for k, (ids, (fwd, bwd)) in enumerate(zip(microbatches, times)):
            feats = self.work.slot_features(stage, ids, llm_microbatches[k] if llm_microbatches is not None else None)
            self.fresh.append(
                StageTiming(stage.layer_start, stage.layer_end, tuple(float(x) for x in feats), (fwd + bwd) / again)
            )

    def maybe_fit(self, step: int) -> bool:
        """Collective every ``fit_every`` steps (every rank of the group calls it at the same step)."""
        every = self.config.fit_every
        if not every or step == 0 or step % every:
            return False
        gathered = self._all_gather_timings(self.fresh)
        self.fresh = []
        for timings in gathered:  # rank order: the same window on every rank
            self.window.extend(timings)
        fitted = self.coefficients
        if dist.get_rank() == 0:
            fitted = self.model.fit(self.coefficients, list(self.window), self.config.ridge)
        self.coefficients = self._broadcast_coefficients(fitted, src=0)
        return True

    def share_from(self, src: int) -> None:
        """Collective: every rank takes ``src``'s coefficients and timing window (a joiner has none)."""
        self.coefficients = self._broadcast_coefficients(self.coefficients, src)
        rows = torch.tensor(
            _timing_rows(self.window) if dist.get_rank() == src else np.zeros((0, TIMING_COLUMNS)),
            dtype=torch.float64,
            device=self.device,
        )
        count = torch.tensor([rows.shape[0]], dtype=torch.int64, device=self.device)
        dist.broadcast(count, src=src)
        if dist.get_rank() != src:
            rows = torch.empty((int(count.item()), TIMING_COLUMNS), dtype=torch.float64, device=self.device)
        if rows.numel():
            dist.broadcast(rows, src=src)
        self.window = deque(_timings(rows.cpu().numpy()), maxlen=self.config.fit_window)

    # ------------------------------------------------------------------ tensor exchange
    def _all_gather_timings(self, timings) -> list[list[StageTiming]]:
        """Every rank's ``timings``, in rank order (counts first: all_gather needs equal shapes)."""
        mine = torch.tensor(_timing_rows(timings), dtype=torch.float64, device=self.device)
        counts = [torch.zeros(1, dtype=torch.int64, device=self.device) for _ in range(dist.get_world_size())]
        dist.all_gather(counts, torch.tensor([mine.shape[0]], dtype=torch.int64, device=self.device))
        longest = max(int(c.item()) for c in counts)
        padded = torch.zeros((longest, TIMING_COLUMNS), dtype=torch.float64, device=self.device)
        padded[: mine.shape[0]] = mine
        rows = [torch.empty_like(padded) for _ in counts]
        dist.all_gather(rows, padded)
        return [_timings(r[: int(c.item())].cpu().numpy()) for r, c in zip(rows, counts)]

    def _broadcast_coefficients(self, coefficients: CostCoefficients, src: int) -> CostCoefficients:
        vector = torch.tensor(
            [coefficients.num_observations, *coefficients.scales], dtype=torch.float64, device=self.device
        )
        dist.broadcast(vector, src=src)
        values = vector.cpu().tolist()
        return CostCoefficients(tuple(values[1 : 1 + NUM_TERMS]), int(values[0]))


def _timing_rows(timings) -> np.ndarray:
    rows = [(t.layer_start, t.layer_end, t.seconds, *t.features) for t in timings]
    return np.array(rows, dtype=np.float64).reshape(len(rows), TIMING_COLUMNS)


def _timings(rows: np.ndarray) -> list[StageTiming]:
    return [StageTiming(int(r[0]), int(r[1]), tuple(float(x) for x in r[3:]), float(r[2])) for r in rows]
