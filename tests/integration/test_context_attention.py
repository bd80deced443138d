"""All-gather context-parallel attention on real gloo processes equals one process's attention (float64).

Three ranks split a packed multimodal sequence (two samples: causal text with an image span and an audio
span, Cornstarch Figure 3.5c) by LPT over its blocks' work; each holds its own tokens' queries, keys and
values, all-gathers the keys and values, and computes its rows. Its outputs, and the gradients of a loss of
every rank's outputs with respect to its own q, k and v, must equal those rows of the whole sequence's
dense masked attention on one process: the gradient of the keys and values summed over every rank's rows.
Then a whole transformer block of the built-in LLM on two ranks, each holding half the blocks of a packed
microbatch (``shard_batch``): its outputs, its input gradients and its parameters' gradients summed over the
ranks equal the block on the whole microbatch.
"""

from __future__ import annotations

from oobleck_mm.runtime.template import warm_context, warm_process
import traceback
from datetime import timedelta

import pytest

from oobleck_mm.runtime.worker import free_port

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
        # numpy arrays travel by value: a torch tensor travels as a shared-memory handle, which the parent
        # could not open once this process had exited (a race seen on a loaded machine)
        results.put((rank, out.detach().numpy(), *(t.grad.numpy() for t in local)))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - the parent reports it
        results.put((rank, traceback.format_exc()))


def _run_ranks(target, ranks: int, *extra) -> list[tuple]:
    """``target(rank, port, results, *extra)`` on ``ranks`` forks of the warm template; their results by rank; all joined
    or killed."""
    ctx = warm_context()  # forks of the suite's template: torch is imported once, not per rank
    results = ctx.Queue()
    port = free_port()
    procs = [warm_process(target, rank, port, results, *extra) for rank in range(ranks)]
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
    assert not failed, "\n".join(f"rank {f[0]} failed:\n{f[1]}" for f in failed)
    return outcomes


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

    outcomes = _run_ranks(_rank, RANKS)
    covered = torch.zeros(TOKENS, dtype=torch.bool)
    for rank, out, dq, dk, dv in outcomes:
        out, dq, dk, dv = (torch.from_numpy(a) for a in (out, dq, dk, dv))
        mine = block_tokens(assignment[rank], BLOCK, TOKENS)
        covered[mine] = True
        torch.testing.assert_close(out, reference.detach()[:, mine], rtol=0, atol=1e-12)
        for got, ref in ((dq, whole[0].grad), (dk, whole[1].grad), (dv, whole[2].grad)):
            torch.testing.assert_close(got, ref[:, mine], rtol=0, atol=1e-12)
    assert covered.all()  # every token on exactly one rank (block_tokens of a partition)


# --------------------------------------------------------------------------- a whole block of the built-in LLM

BLOCK_RANKS, TEXT_BLOCK = 2, 8


def _block_case(kind: str = "built-in"):
    import dataclasses
    import types

    import torch

    from oobleck_mm.config import load_config
    from oobleck_mm.data.loader import TrainingData
    from oobleck_mm.model.layers import build_layer, model_layer_specs

    job = load_config("configs/tiny_mm.yaml")
    job = dataclasses.replace(job, training=dataclasses.replace(job.training, dtype="float64"))
    specs = model_layer_specs(job)
    index = next(i for i, s in enumerate(specs) if s.name == "llm.block0")
    torch.manual_seed(1)
    if kind == "huggingface":  # transformers' LlamaDecoderLayer, 4 query heads sharing 2 key-value heads
        from oobleck_mm.model import huggingface as hf
        from oobleck_mm.model.tiny_hf import tiny_text_config

        hf._register_packed_attention()
        cfg = hf.hf_config("llama", tiny_text_config("llama").to_dict(), torch.float64, hf.PACKED_ATTENTION)
        layer = hf.DecoderBlock(types.SimpleNamespace(text_type="llama"), cfg, 0).double()
        hidden = cfg.hidden_size
    else:
        layer, hidden = build_layer(job, index, specs), specs[index].hidden
    data = TrainingData(job)
    batch = data.microbatch(data.global_batch(0)[:3])  # three packed samples
    g = torch.Generator().manual_seed(2)
    x = torch.randn(batch.tokens.numel(), hidden, generator=g, dtype=torch.float64)
    weights = torch.randn(x.shape, generator=g, dtype=torch.float64)
    return layer, batch, x, weights


def _block_assignment(batch, block=TEXT_BLOCK):
    from oobleck_mm.balance.context_blocks import lpt
    from oobleck_mm.model.attention_masks import block_workload, token_bits

    bits = token_bits(batch.segments, [])
    return lpt(block_workload(bits, batch.segments, block), BLOCK_RANKS)


def _block_rank(rank: int, port: int, results, block: int = TEXT_BLOCK, kind: str = "built-in") -> None:
    try:
        import torch
        import torch.distributed as dist

        from oobleck_mm.runtime.context_parallel import shard_batch

        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=BLOCK_RANKS, timeout=TIMEOUT
        )
        layer, batch, x, weights = _block_case(kind)
        local = shard_batch(batch, _block_assignment(batch, block), rank, block)
        mine = local.context.positions
        x_local = x[mine].clone().requires_grad_(True)
        (out,) = layer((x_local,), local)
        (out * weights[mine]).sum().backward()
        # (a lane without tokens may get no gradient at all for some parameter: zeros, as the engine fills them)
        grads = {n: p.grad.clone() if p.grad is not None else torch.zeros_like(p) for n, p in layer.named_parameters()}
        for g in grads.values():  # the parameters are replicated over the group: their gradients sum
            dist.all_reduce(g)
        results.put((rank, out.detach().numpy(), x_local.grad.numpy(), {n: g.numpy() for n, g in grads.items()}))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - the parent reports it
        results.put((rank, traceback.format_exc()))


@pytest.mark.parametrize(
    ("block", "kind"),
    [(TEXT_BLOCK, "built-in"), (4096, "built-in"), (4096, "huggingface")],
    ids=["both lanes hold tokens", "one lane holds none", "one lane holds none, transformers' LlamaDecoderLayer"],
)
def test_a_transformer_block_split_over_two_ranks_equals_the_block_on_the_whole_microbatch(monkeypatch, block, kind):
    """With one block for the whole microbatch, lane 1 holds no token and must still take part in every gather
    (it hung a run once: its block skipped attention on an empty input; transformers' attention cannot reshape
    0 tokens, which stopped a HuggingFace run). A transformers block whose lanes both hold tokens runs in
    test_context_parallel_training.py's LLaVA."""
    import torch

    from oobleck_mm.runtime.context_parallel import block_tokens

    if kind == "huggingface":
        pytest.importorskip("transformers")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    layer, batch, x, weights = _block_case(kind)
    assignment = _block_assignment(batch, block)
    assert len(batch.spans()) == 3
    assert all(len(a) > 1 for a in assignment) if block == TEXT_BLOCK else assignment == [[0], []]
    whole_x = x.clone().requires_grad_(True)
    (reference,) = layer((whole_x,), batch)
    (reference * weights).sum().backward()
    outcomes = _run_ranks(_block_rank, BLOCK_RANKS, block, kind)
    tokens = batch.tokens.numel()
    for rank, out, dx, grads in outcomes:
        out, dx, grads = torch.from_numpy(out), torch.from_numpy(dx), {n: torch.from_numpy(g) for n, g in grads.items()}
        mine = block_tokens(assignment[rank], block, tokens)
        torch.testing.assert_close(out, reference.detach()[mine], rtol=0, atol=1e-12)
        torch.testing.assert_close(dx, whole_x.grad[mine], rtol=0, atol=1e-12)
        for name, p in layer.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, rtol=0, atol=1e-12)
