"""The tests' reference cache (``harness.reference_state``): a reference trained on from another test's
cached state equals one trained from step 0, bit for bit, and a job that differs is never continued."""

from __future__ import annotations

import os

import torch

import harness
from harness import REFERENCE_CACHE_ENV, _trained_states, write_config
from oobleck_mm.runtime.reference import ReferenceTrainer


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n][k], b[n][k]) for n in a for k in a[n])


def test_a_reference_continued_from_a_cached_state_equals_one_from_step_0(tmp_path, monkeypatch):
    monkeypatch.setenv(REFERENCE_CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(harness, "_REFERENCES", {})
    starts = []
    train = ReferenceTrainer.train
    monkeypatch.setattr(
        ReferenceTrainer, "train", lambda self, n, start_step=0: starts.append(start_step) or train(self, n, start_step)
    )

    short = write_config(tmp_path, nodes=2, steps=2)
    long = write_config(tmp_path, nodes=3, steps=4)  # another cluster and run length: the same trajectory
    harness.reference_state(short, 2)
    continued = harness.reference_state(long, 4)
    assert starts == [0, 2], "the second trained on from the first's state"
    assert sorted(p.name for p in (tmp_path / "cache").rglob("*.pt")) == ["2.pt", "4.pt"]
    assert _equal(continued, _trained_states(long, 4)[0])  # Adam moments, steps and all
    assert not _equal(continued, _trained_states(long, 3)[0])  # (a step off is caught)

    # Another learning rate: a trajectory of its own, never continued from the first's.
    (tmp_path / "other").mkdir()
    other = write_config(tmp_path / "other", nodes=3, steps=4)
    text = open(other).read()
    assert "lr: 0.001" in text
    open(other, "w").write(text.replace("lr: 0.001", "lr: 0.002"))
    starts.clear()
    assert _equal(harness.reference_state(other, 4), _trained_states(other, 4)[0])
    assert starts[0] == 0 and len(os.listdir(tmp_path / "cache")) == 2
