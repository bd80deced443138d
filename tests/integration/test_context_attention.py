"""All-gather context-parallel attention on real gloo processes equals one process's dense attention (float64).

Three ranks split a packed multimodal sequence (two samples: causal text with an image span and an audio
span, Cornstarch Figure 3.5c) by LPT over its blocks' work; each holds its own tokens' queries, keys and
values, all-gathers the keys and values, and computes its rows. Its outputs, and the gradients of a loss of
every rank's outputs with respect to its own q, k and v, must equal those rows of the whole sequence's
dense masked attention on one process: the gradient of the keys and values summed over every rank's rows.
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import traceback
from datetime import timedelta

import pytest

pytestmark = pytest.mark.integration

RANKS = 3
TOKENS, BLOCK, HEADS, DIM = 200, 16, 2, 8
TIMEOUT = timedelta(seconds=60)


def _sequence():
    import torch

    from oobleck_mm.model.attention_masks import token_bits

    segments = torch.cat([torch.zeros(120, dtype=torch.long), torch.ones(TOKENS - 120, dtype=torch.long)])
    bits = token_bits(segments, [(10, 50), (70, 90), (125, 160)])
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(HEADS, TOKENS, DIM, generator=g, dtype=torch.float64) for _ in range(3))
    weights = torch.randn(HEADS, TOKENS, DIM, generator=g, dtype=torch.float64)  # the loss: <weights, out>
    return bits, segments, q, k, v, weights


def _assignment(bits, segments):
    from oobleck_mm.balance.context_blocks import lpt
    from oobleck_mm.model.attention_masks import block_workload

    return lpt(block_workload(bits, segments, BLOCK), RANKS)


def _rank(rank: int, port: int, results) -> None:
    try:
        import torch.distributed as dist

        from oobleck_mm.runtime.context_parallel import block_tokens, context_attention

        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=RANKS, timeout=TIMEOUT
        )
        bits, segments, q, k, v, weights = _sequence()
        assignment = _assignment(bits, segments)
        mine = block_tokens(assignment[rank], BLOCK, TOKENS)
        local = [t[:, mine].clone().requires_grad_(True) for t in (q, k, v)]
        out = context_attention(*local, assignment, rank, bits, segments, BLOCK)
        (out * weights[:, mine]).sum().backward()
        results.put((rank, out.detach(), *(t.grad for t in local)))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - the parent reports it
        results.put((rank, traceback.format_exc()))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_each_rank_computes_its_rows_of_the_whole_sequence_and_their_gradients(monkeypatch):
    import torch

    from oobleck_mm.model.attention_masks import dense_attention, dense_mask
    from oobleck_mm.runtime.context_parallel import block_tokens

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    bits, segments, q, k, v, weights = _sequence()
    assignment = _assignment(bits, segments)
    assert sorted(len(a) for a in assignment) == [4, 4, 5] and assignment != [
        [0, 1, 2, 3],
        [4, 5, 6, 7],
        [8, 9, 10, 11, 12],
    ]
    whole = [t.clone().requires_grad_(True) for t in (q, k, v)]
    reference = dense_attention(*whole, dense_mask(bits, segments))
    (reference * weights).sum().backward()

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(rank, port, results), daemon=True) for rank in range(RANKS)]
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
    covered = torch.zeros(TOKENS, dtype=torch.bool)
    for rank, out, dq, dk, dv in outcomes:
        mine = block_tokens(assignment[rank], BLOCK, TOKENS)
        covered[mine] = True
        torch.testing.assert_close(out, reference.detach()[:, mine], rtol=0, atol=1e-12)
        for got, ref in ((dq, whole[0].grad), (dk, whole[1].grad), (dv, whole[2].grad)):
            torch.testing.assert_close(got, ref[:, mine], rtol=0, atol=1e-12)
    assert covered.all()  # every token on exactly one rank (block_tokens of a partition)
