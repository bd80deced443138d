"""Live mode's periodic checkpoints: the snapshot is what training had at the boundary, the write
happens in the background, and every layer has exactly one writer, the replicas taking turns."""

from __future__ import annotations

import threading

import torch

from oobleck_mm.planning.layout import ExecutionPlan
from oobleck_mm.runtime.async_checkpoint import AsyncCheckpointer
from oobleck_mm.runtime.checkpoint import load_params
from oobleck_mm.runtime.engine import HeldLayer


class _Spec:
    def __init__(self, name: str) -> None:
        self.name = name


def _held(value: float) -> HeldLayer:
    module = torch.nn.Linear(4, 4)
    torch.nn.init.constant_(module.weight, value)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
    module(torch.ones(1, 4)).sum().backward()
    optimizer.step()  # moments exist
    return HeldLayer(module, optimizer)


def test_the_snapshot_is_the_boundarys_state_while_training_overwrites_it(tmp_path, monkeypatch):
    import oobleck_mm.runtime.async_checkpoint as ac

    release = threading.Event()
    real_write = ac.write_layer_file

    def slow_write(directory, name, payload):  # the disk is slow: training goes on meanwhile
        release.wait(10)
        real_write(directory, name, payload)

    monkeypatch.setattr(ac, "write_layer_file", slow_write)
    written = []
    saver = AsyncCheckpointer(lambda *args: written.append(args))
    held = {0: _held(1.0), 1: _held(2.0)}
    specs = [_Spec("a"), _Spec("b")]
    before = held[0].module.weight.detach().clone()
    assert saver.save(str(tmp_path), held, [0, 1], specs, step=5, generation=3)
    with torch.no_grad():
        held[0].module.weight.add_(100.0)  # the next steps update the live tensors
    assert saver.busy and not saver.save(str(tmp_path), held, [0], specs, step=6, generation=3)  # skipped
    release.set()
    assert saver.wait(10)
    assert torch.equal(load_params(tmp_path, "a")["weight"], before)  # not the +100 of later steps
    [(directory, step, layers, generation, seconds)] = written
    assert (directory, step, layers, generation) == (str(tmp_path), 5, 2, 3) and seconds >= 0
    assert not list(tmp_path.glob("layers/*.tmp"))  # renamed into place


def test_every_layer_has_one_checkpoint_owner_and_replicas_share_the_work():
    plan = ExecutionPlan.even(10, [1, 1, 2], [2, 2, 2], 2)  # two 1-stage pipelines and a 2-stage one
    owners = [plan.checkpoint_owner(i) for i in range(10)]
    assert all(owner in plan.holders(i) for i, owner in enumerate(owners))
    counts = {r: owners.count(r) for r in range(plan.world_size)}
    assert all(counts[r] > 0 for r in range(plan.world_size)), counts  # nobody idles, nobody writes it all
    assert max(counts.values()) <= 4


def test_a_write_that_fails_is_reported_with_the_reason_and_the_path(tmp_path):
    """A full disk: the layer's temporary file is /dev/full, which answers every write with ENOSPC.
    The checkpoint is lost and said to be, with the reason and the path; nothing else happens."""
    from oobleck_mm.runtime.checkpoint_meta import layer_file

    directory = tmp_path / "step00000004"
    tmp = layer_file(directory, "a").with_suffix(".tmp")
    tmp.parent.mkdir(parents=True)
    tmp.symlink_to("/dev/full")
    failed, written = [], []
    saver = AsyncCheckpointer(lambda *args: written.append(args), lambda *args: failed.append(args))
    assert saver.save(str(directory), {0: _held(1.0)}, [0], [_Spec("a")], step=4, generation=2)
    assert saver.wait(10)
    [(where, step, generation, error)] = failed
    assert (where, step, generation) == (str(directory), 4, 2) and not written
    assert error.startswith("No space left on device: ") and str(directory) in error, error
