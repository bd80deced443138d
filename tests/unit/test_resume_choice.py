"""Who is at fault when a generation's checkpoint cannot be read (issue 56 item 2): the user, for their own
``--resume`` (exit 2, naming what is wrong), the run, for a checkpoint the master chose (restart mode)."""

from __future__ import annotations

import pytest

from oobleck_mm.errors import UserError
from oobleck_mm.protocol import oobleck_pb2 as pb
from oobleck_mm.runtime.generation_setup import UnreadableCheckpoint, _read_resume
from oobleck_mm.runtime.checkpoint_meta import read_meta
from oobleck_mm.runtime.waiting import PeerFailure


def test_a_chosen_checkpoint_that_cannot_be_read_abandons_the_iteration_naming_it(tmp_path):
    gone = str(tmp_path / "checkpoints" / "step00000065")  # pruned: the folder is not there
    a = pb.Assignment(generation=3, resume_dir=gone, resume_chosen=True)
    with pytest.raises(UnreadableCheckpoint) as caught:
        _read_resume(a, lambda: read_meta(gone))
    assert isinstance(caught.value, PeerFailure) and caught.value.directory == gone
    assert "generation 3" in str(caught.value) and "no meta.json" in str(caught.value)


def test_the_users_own_resume_stays_a_user_error(tmp_path):
    mine = str(tmp_path / "not-a-checkpoint")
    with pytest.raises(UserError, match="no meta.json"):
        _read_resume(pb.Assignment(generation=1, resume_dir=mine), lambda: read_meta(mine))
