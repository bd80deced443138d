"""The stage mapping's tables: every stage's cost over a layer range in O(1) (``_CostTables``), and the
costs of a chain of stages that a boundary move changes (``_SuffixChain``). Parts of
``oobleck_mm.planning.stage_mapping``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from oobleck_mm.planning.costs import ClusterSpec, LayerPrefix, ModelProfile, StageCost, effective_layers, stage_cost

_INTRA, _CROSS, _LAST = 0, 1, 2
"""A stage's outgoing transfer: to a stage on the same node, on another node, or none (the last stage)."""


class _CostTables:
    """Stage costs of every layer range ``[w, w')`` on ``d`` GPUs, as ``(L+1) x (L+1)`` matrices.

    ``stage_cost`` is additive over layers (compute, collectives and bytes are
    per-layer sums; only ``output_bytes`` is the last layer's), so one call per
    (layer, d) plus prefix sums reproduce it for every range in O(L^2) numpy
    work instead of O(L^3) Python calls. The brute-force test holds the DP to
    ``stage_cost`` itself, so a non-additive change there would be caught.
    """

    def __init__(self, profile: ModelProfile, cluster: ClusterSpec):
        self.prefix = LayerPrefix(effective_layers(profile))
        self.cluster = cluster
        self.num_layers = L = profile.num_layers
        self.options = cluster.stage_gpu_options
        self.usable = cluster.usable_memory_bytes
        # The stage variants the planner may pick from, cheapest first: keep the activations (no
        # recomputation) wherever they fit, recompute where only that fits (profile.recompute).
        self.modes: tuple[bool, ...] = {"auto": (False, True), "always": (True,), "never": (False,)}[profile.recompute]
        upper = np.triu(np.ones((L + 1, L + 1), dtype=bool), k=1)  # w < w': a stage has >= 1 layer
        out_bytes = [self.prefix.layers[max(v - 1, 0)].output_bytes for v in range(L + 1)]
        comm = {
            _INTRA: np.array([2 * cluster.transfer_s(b, cross_node=False) for b in out_bytes]),
            _CROSS: np.array([2 * cluster.transfer_s(b, cross_node=True) for b in out_bytes]),
            _LAST: np.zeros(L + 1),
        }
        # A stage starting at layer w receives layer w-1's output (nothing when w == 0).
        self.incoming = {kind: np.concatenate(([0.0], vec[1:])) for kind, vec in comm.items() if kind != _LAST}
        self.time: dict[tuple[int, int, bool], np.ndarray] = {}
        self._resident: dict[int, np.ndarray] = {}
        self._activation: dict[tuple[int, bool], np.ndarray] = {}
        for d in self.options:
            for recompute in self.modes:
                per_layer = [stage_cost(self.prefix, cluster, k, k + 1, d, recompute) for k in range(L)]
                compute = _range_sums([c.forward_s + c.backward_s for c in per_layer], upper)
                for kind, vec in comm.items():
                    self.time[(d, kind, recompute)] = compute + vec[None, :]
                if d not in self._resident:  # the same whichever the variant
                    self._resident[d] = _range_sums([c.resident_bytes for c in per_layer], upper)
                self._activation[(d, recompute)] = _range_sums([c.activation_bytes for c in per_layer], upper)
        self._choice: dict[tuple[int, int], np.ndarray] = {}
        self._masked: dict[tuple[int, int, int], np.ndarray] = {}

    def stages_after(self, gpus_after: int) -> int:
        """The most stages ``gpus_after`` GPUs can be: each has at least the narrowest option's GPUs (all of a
        context-parallel pipeline's stages are as wide as its lanes)."""
        return gpus_after // min(self.options)

    def in_flight(self, gpus_after: int) -> np.ndarray:
        """Per end layer w': microbatches the stage may hold (see module docstring), never an underestimate."""
        ends = np.arange(self.num_layers + 1)
        return np.minimum(1 + self.stages_after(gpus_after), 1 + self.num_layers - ends)

    def memory(self, d: int, gpus_after: int, recompute: bool | None = None) -> np.ndarray:
        """Peak bytes per GPU of every stage ``[w, w')`` on ``d`` GPUs (inf where w >= w'): with or without
        recomputation, or (None) the least of the variants the profile allows."""
        modes = self.modes if recompute is None else (recompute,)
        flight = self.in_flight(gpus_after)[None, :]
        return np.minimum.reduce([self._resident[d] + self._activation[(d, r)] * flight for r in modes])

    def choice(self, d: int, gpus_after: int) -> np.ndarray:
        """Per stage ``[w, w')``: the index into ``modes`` of its cheapest variant that fits memory, or
        ``len(modes)`` where none does."""
        # Beyond L - 1 stages after, in_flight no longer depends on gpus_after.
        key = (d, min(self.stages_after(gpus_after), self.num_layers - 1))
        choice = self._choice.get(key)
        if choice is None:
            choice = np.full((self.num_layers + 1, self.num_layers + 1), len(self.modes), dtype=np.int8)
            for index in reversed(range(len(self.modes))):
                fits = self.memory(d, gpus_after, self.modes[index]) <= self.usable
                choice[fits] = index
            # Neighbouring counts usually give the same choices: share the object so that
            # masked_time can cache by it.
            previous = self._choice.get((d, key[1] - 1))
            if previous is not None and np.array_equal(previous, choice):
                choice = previous
            self._choice[key] = choice
        return choice

    def feasible(self, d: int, gpus_after: int) -> np.ndarray:
        return self.choice(d, gpus_after) < len(self.modes)

    def masked_time(self, d: int, kind: int, gpus_after: int) -> np.ndarray:
        """Stage seconds of every ``[w, w')`` on ``d`` GPUs, of its cheapest variant that fits memory (inf
        where none fits): a per-stage choice that is exact for the DP, because a stage's variant changes
        nothing outside the stage.

        Every template's chains ask for the same matrices again; computed once per
        distinct choice matrix.
        """
        choice = self.choice(d, gpus_after)
        key = (d, kind, id(choice))
        masked = self._masked.get(key)
        if masked is None:
            masked = np.full(choice.shape, np.inf)
            for index, recompute in enumerate(self.modes):
                masked = np.where(choice == index, self.time[(d, kind, recompute)], masked)
            self._masked[key] = masked
        return masked

    def stage(self, start: int, end: int, d: int, in_flight: int) -> tuple[StageCost, bool]:
        """The cost of stage ``[start, end)`` on ``d`` GPUs holding ``in_flight`` microbatches, in its cheapest
        variant that fits memory (the last variant when none does), and whether it recomputes."""
        for recompute in self.modes:
            cost = stage_cost(self.prefix, self.cluster, start, end, d, recompute)
            if cost.memory_bytes(in_flight) <= self.usable:
                break
        return cost, recompute


def _shift_boundary(cuts: list, k: int, shift: int) -> list | None:
    """Moves the boundary between stages k and k+1 by ``shift`` layers (None if a stage would empty)."""
    start, end, node, gpu, d = cuts[k]
    nstart, nend, nnode, ngpu, nd = cuts[k + 1]
    boundary = end + shift
    if not start < boundary < nend:
        return None
    moved = list(cuts)
    moved[k] = (start, boundary, node, gpu, d)
    moved[k + 1] = (boundary, nend, nnode, ngpu, nd)
    return moved


def _range_sums(values: list[float], valid: np.ndarray) -> np.ndarray:
    """S[w, w'] = sum(values[w:w']) where w < w', inf elsewhere."""
    cum = np.concatenate(([0.0], np.cumsum(values)))
    sums = cum[None, :] - cum[:, None]
    return np.where(valid, sums, np.inf)


# cost_fn(d, outgoing boundary kind, gpus after the stage) -> (L+1) x (L+1) stage values
# (inf = forbidden), without the incoming transfer, which _SuffixChain adds by row.
_CostFn = Callable[[int, int, int], np.ndarray]


class _SuffixChain:
    """V_g[w]: best value for layers [w, L) on the last g GPUs of a pipeline (module docstring)."""

    def __init__(
        self,
        tables: _CostTables,
        cost_fn: _CostFn,
        combine: Callable,
        keep_argmin: bool,
        add_incoming: bool = True,
        cap: float = math.inf,
    ):
        self.tables = tables
        self.add_incoming = add_incoming
        self.cap = cap
        self.gpus_per_node = tables.cluster.gpus_per_node
        self.cost_fn = cost_fn
        self.combine = combine
        self.keep_argmin = keep_argmin
        L = tables.num_layers
        start = np.full(L + 1, np.inf)
        start[L] = 0.0  # no GPUs left: only the empty layer suffix is done
        self.values: list[np.ndarray] = [start]
        self.choice: list[tuple[np.ndarray, np.ndarray] | None] = [None]
        self._rows = np.arange(L + 1)
        self.incoming = np.zeros(L + 1)

    def extend_to(self, num_gpus: int) -> None:
        while len(self.values) <= num_gpus:
            self._step(len(self.values))

    def best(self, num_nodes: int) -> float:
        g = num_nodes * self.gpus_per_node
        self.extend_to(g)
        return float(self.values[g][0])

    def _step(self, g: int) -> None:
        M = self.gpus_per_node
        offset = (-g) % M  # node-local GPU index where this suffix starts
        self.incoming = self.tables.incoming[_CROSS if offset == 0 else _INTRA]
        best_vals, best_ends, gpu_counts = [], [], []
        for d in self.tables.options:
            if offset + d > M or d > g:
                continue  # a stage never spans nodes
            after = g - d
            kind = _LAST if after == 0 else (_CROSS if after % M == 0 else _INTRA)
            cost = self.cost_fn(d, kind, after)
            if self.add_incoming:
                cost = cost + self.incoming[:, None]
            if self.cap < math.inf:
                cost = np.where(cost <= self.cap, cost, np.inf)
            candidates = self.combine(cost, self.values[after][None, :])
            ends = np.argmin(candidates, axis=1)
            best_vals.append(candidates[self._rows, ends])
            best_ends.append(ends)
            gpu_counts.append(d)
        if not best_vals:  # no stage width fits here (context parallelism: only d-GPU stages)
            L = self.tables.num_layers
            self.values.append(np.full(L + 1, np.inf))
            if self.keep_argmin:
                self.choice.append((np.zeros(L + 1, dtype=np.int64), np.zeros(L + 1, dtype=np.int64)))
            return
        stacked = np.stack(best_vals)
        pick = np.argmin(stacked, axis=0)
        self.values.append(stacked[pick, self._rows])
        if self.keep_argmin:
            self.choice.append((np.asarray(gpu_counts)[pick], np.stack(best_ends)[pick, self._rows]))

    def stages(self, num_nodes: int) -> list[tuple[int, int, int, int, int]]:
        """(layer start, layer end, node, first local gpu, d) of the optimum on ``num_nodes`` nodes."""
        M = self.gpus_per_node
        total = g = num_nodes * M
        w, out = 0, []
        while g > 0:
            gpu_counts, ends = self.choice[g]
            d, end = int(gpu_counts[w]), int(ends[w])
            position = total - g
            out.append((w, end, position // M, position % M, d))
            g, w = g - d, end
        assert w == self.tables.num_layers, (w, out)
        return out
