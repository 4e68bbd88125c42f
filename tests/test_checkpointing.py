"""Checkpoints in one process: the layout, the tracker, and saves that fail half-way."""

import os

import pytest
import torch

from megatron.training.checkpointing import (
    TRACKER,
    CheckpointError,
    latest_iteration,
    load_checkpoint,
    save_checkpoint,
)


def test_save_then_load_the_latest_in_megatrons_layout(tmp_path):
    assert load_checkpoint(str(tmp_path)) is None
    save_checkpoint(str(tmp_path), 3, {"w": torch.ones(2)})
    path = save_checkpoint(str(tmp_path), 6, {"w": torch.full((2,), 6.0)})
    assert path == str(tmp_path / "iter_0000006")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000003", "iter_0000006", TRACKER]
    assert (tmp_path / TRACKER).read_text() == "6"
    iteration, state = load_checkpoint(str(tmp_path))
    assert iteration == 6 and torch.equal(state["w"], torch.full((2,), 6.0))


def test_a_save_that_fails_before_the_commit_keeps_the_previous_checkpoint(tmp_path):
    save_checkpoint(str(tmp_path), 3, {"w": torch.ones(2)})

    calls = []

    def fail_at_the_second_barrier():
        calls.append(1)
        if len(calls) == 2:  # every rank has written its file into iter_N.tmp
            raise RuntimeError("killed")

    with pytest.raises(RuntimeError, match="killed"):
        save_checkpoint(str(tmp_path), 6, {"w": torch.zeros(2)},
                        barrier=fail_at_the_second_barrier)
    assert latest_iteration(str(tmp_path)) == 3
    assert load_checkpoint(str(tmp_path))[0] == 3
    # The next save of that iteration starts from a clean .tmp directory.
    save_checkpoint(str(tmp_path), 6, {"w": torch.zeros(2)})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000003", "iter_0000006", TRACKER]


def test_a_tracker_temporary_left_by_a_kill_is_removed_by_the_next_save(tmp_path):
    (tmp_path / f".tmp-x1y2z3{TRACKER}").write_text("")
    save_checkpoint(str(tmp_path), 1, {})
    assert sorted(os.listdir(tmp_path)) == ["iter_0000001", TRACKER]


def test_bad_tracker_and_missing_rank_file_are_reported(tmp_path):
    save_checkpoint(str(tmp_path), 2, {})
    with pytest.raises(CheckpointError, match="another world size"):
        load_checkpoint(str(tmp_path), rank=1)
    (tmp_path / TRACKER).write_text("two")
    with pytest.raises(CheckpointError, match="expected an iteration number"):
        latest_iteration(str(tmp_path))
