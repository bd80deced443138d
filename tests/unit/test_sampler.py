"""Global-batch sampler: epochs are permutations, any step can be resumed, every process agrees."""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oobleck_mm.data.sampler import GlobalBatchSampler

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@settings(max_examples=60, deadline=None)
@given(num_samples=st.integers(1, 300), batch=st.integers(1, 40), seed=st.integers(0, 2**32), epoch=st.integers(0, 5))
def test_an_epoch_is_disjoint_batches_of_distinct_ids(num_samples, batch, seed, epoch):
    if batch > num_samples:
        with pytest.raises(ValueError, match=rf"global_batch \({batch}\).*num_samples \({num_samples}\)"):
            GlobalBatchSampler(num_samples, batch, seed)
        return
    sampler = GlobalBatchSampler(num_samples, batch, seed)
    steps = sampler.steps_per_epoch
    assert steps == num_samples // batch
    first = epoch * steps
    batches = [sampler.batch(s) for s in range(first, first + steps)]
    ids = [i for b in batches for i in b]
    assert all(len(b) == batch for b in batches)
    assert len(set(ids)) == len(ids) == steps * batch
    assert all(0 <= i < num_samples for i in ids)
    assert {sampler.epoch_of(s) for s in range(first, first + steps)} == {epoch}
    assert sampler.position(first + steps - 1) == (epoch, steps - 1)


def test_resuming_at_any_step_gives_the_uninterrupted_batches():
    run = GlobalBatchSampler(1000, 48, seed=3)
    uninterrupted = [run.batch(s) for s in range(100)]  # crosses four epoch boundaries
    for k in (0, 1, 20, 21, 55, 99):
        resumed = GlobalBatchSampler(1000, 48, seed=3)
        assert [resumed.batch(s) for s in range(k, 100)] == uninterrupted[k:]
    # Asking out of order (a rank that joins late, a lookup of an old step) changes nothing.
    shuffled = GlobalBatchSampler(1000, 48, seed=3)
    assert [shuffled.batch(s) for s in (77, 3, 41, 3)] == [uninterrupted[s] for s in (77, 3, 41, 3)]


def test_epochs_are_different_permutations_and_no_sample_is_left_out_for_long():
    sampler = GlobalBatchSampler(10, 4, seed=0)  # 2 ids skipped per epoch
    perms = [tuple(sampler.permutation(e)) for e in range(6)]
    assert len(set(perms)) == 6
    assert all(sorted(p) == list(range(10)) for p in perms)
    seen = {i for s in range(6 * sampler.steps_per_epoch) for i in sampler.batch(s)}
    assert seen == set(range(10))
    assert GlobalBatchSampler(10, 4, seed=1).permutation(0).tolist() != list(perms[0])


def test_bad_arguments_name_the_value():
    with pytest.raises(ValueError, match="global_batch must be an integer >= 1, got 0"):
        GlobalBatchSampler(10, 0, 0)
    with pytest.raises(ValueError, match="seed must be an integer >= 0, got -1"):
        GlobalBatchSampler(10, 2, -1)
    with pytest.raises(ValueError, match="step must be an integer >= 0, got -3"):
        GlobalBatchSampler(10, 2, 0).batch(-3)
