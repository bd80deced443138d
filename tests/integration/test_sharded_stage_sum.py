"""A layer held by a 2-GPU FSDP2 stage in one pipeline and a 1-GPU stage in another sums exactly (issue 28).

Three real gloo processes. Pipeline A's stage is ranks 0 and 1: the layer (a
``transformers`` Llama MLP after its RMSNorm, parameters of 1, 6 and 11 rows, so
the chunks are uneven) is sharded with FSDP2's ``fully_shard`` over a mesh of
the two, each rank runs half of A's samples, and FSDP2's reduce-scatter (divide
factor 1: a sum) leaves each with its rows' gradient over A's samples.
Pipeline B's stage is rank 2 alone with the whole layer and its own samples.
Then the cross-pipeline sum runs over the common refinement of the two cuts
(``planning.shards.reduction_pieces``): each piece's rows all-reduced among the
rank of each pipeline holding them, in a group per rank set
(``reduction_groups``). Every rank's rows must equal the gradient of the whole
batch on one process (float64, 1e-12), and before the cross-pipeline sum they
must not (the sum is what makes them equal: the test can fail).
"""

from __future__ import annotations

from oobleck_mm.runtime.template import warm_context, warm_process
import socket
import traceback
from datetime import timedelta

import pytest

pytestmark = pytest.mark.integration

HOLDERS = [(0, 1), (2,)]
"""Pipeline A's stage: ranks 0 and 1 (shard order); pipeline B's: rank 2."""
SAMPLES = {0: slice(0, 2), 1: slice(2, 4), 2: slice(4, 7)}
"""Which of the batch's 7 samples each rank runs (A: 4 split over its two ranks; B: 3)."""
TIMEOUT = timedelta(seconds=60)


def _layer():
    import torch
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

    config = LlamaConfig(
        hidden_size=6, intermediate_size=11, hidden_act="silu", num_attention_heads=2, num_key_value_heads=2
    )
    torch.manual_seed(0)
    layer = torch.nn.Sequential(LlamaRMSNorm(6), LlamaMLP(config)).double()
    with torch.no_grad():
        layer[0].weight.uniform_(0.5, 1.5)  # not all ones: its gradient is then not symmetric by chance
    return layer


def _batch():
    import torch

    torch.manual_seed(1)
    return torch.randn(7, 3, 6, dtype=torch.float64)


def _loss(layer, x):
    return layer(x).pow(2).sum() / 7  # normalised by the global batch, wherever a sample runs


def _rank(rank: int, port: int, results) -> None:
    try:
        import torch.distributed as dist
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import DTensor

        from oobleck_mm.planning.shards import chunk_rows, reduction_groups, reduction_pieces

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=3, timeout=TIMEOUT)
        layer = _layer()
        reference = _layer()
        _loss(reference, _batch()).backward()
        names = [n for n, _ in layer.named_parameters()]
        rows = [p.shape[0] for _, p in layer.named_parameters()]
        mesh = DeviceMesh("cpu", list(HOLDERS[0]))  # every rank takes part in making it (new_group)
        groups = {ranks: dist.new_group(list(ranks)) for ranks in reduction_groups(rows, HOLDERS)}
        if rank in HOLDERS[0]:
            for module in (layer[0], layer[1].gate_proj, layer[1].up_proj, layer[1].down_proj, layer):
                fully_shard(module, mesh=mesh)
                module.set_reduce_scatter_divide_factor(1.0)  # a sum, as the engine's losses are pre-scaled
        _loss(layer, _batch()[SAMPLES[rank]]).backward()

        holder = next(h for h in HOLDERS if rank in h)
        local = {}
        for name, p in layer.named_parameters():
            g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            local[name] = g
        start_of = {name: chunk_rows(r, len(holder))[holder.index(rank)][0] for name, r in zip(names, rows)}

        def off_by() -> float:
            worst = 0.0
            for name, p in reference.named_parameters():
                start = start_of[name]
                ref_rows = p.grad[start : start + local[name].shape[0]]
                worst = max(worst, float((local[name] - ref_rows).abs().max()) if ref_rows.numel() else 0.0)
            return worst

        before = off_by()
        for name, r in zip(names, rows):  # every rank in the same order: parameters, then pieces by row
            for piece in reduction_pieces(r, HOLDERS):
                if rank in piece.ranks and len(piece.ranks) > 1:
                    start = start_of[name]
                    view = local[name][piece.start - start : piece.end - start]
                    dist.all_reduce(view, group=groups[piece.ranks])  # in place: rows of the gradient
        results.put((rank, before, off_by(), {n: tuple(g.shape) for n, g in local.items()}))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - the parent reports it
        results.put((rank, traceback.format_exc()))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_layer_sharded_two_ways_by_one_pipeline_and_whole_in_another_sums_to_the_reference(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # three ranks on two cores
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    ctx = warm_context()  # forks of the suite's template: torch is imported once, not per rank
    results = ctx.Queue()
    port = _free_port()
    procs = [warm_process(_rank, rank, port, results) for rank in range(3)]
    try:
        for p in procs:
            p.start()
        outcomes = sorted((results.get(timeout=180) for _ in procs), key=lambda o: o[0])
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    failed = [o for o in outcomes if len(o) == 2]
    assert not failed, f"rank {failed[0][0]} failed:\n{failed[0][1]}"
    shapes = {rank: s for rank, _, _, s in outcomes}
    # the layout is what the test means: rank 0 holds 6 of the 11 gate rows, rank 1 the other 5, rank 2 all
    assert shapes[0]["1.gate_proj.weight"] == (6, 6) and shapes[1]["1.gate_proj.weight"] == (5, 6)
    assert shapes[2]["1.gate_proj.weight"] == (11, 6) and shapes[1]["0.weight"] == (3,)
    for rank, before, after, _ in outcomes:
        assert before > 1e-3, f"rank {rank}: already the whole batch's gradient before the cross-pipeline sum"
        assert after <= 1e-12, f"rank {rank}: {after:.3g} off the reference after the sum over the refinement"
