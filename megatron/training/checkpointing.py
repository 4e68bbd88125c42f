"""Checkpoints in Megatron's layout: `DIR/iter_NNNNNNN/rank_RRR.pt` plus
`DIR/latest_checkpointed_iteration.txt`.

Every rank writes its own file into `iter_NNNNNNN.tmp`; after a barrier rank 0 renames the
directory and then replaces the tracker atomically, so a crash mid-save never leaves a
checkpoint that `--load` would pick up half-written.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable

import torch

from megatron.common.files import atomic_write, leftover_temporaries

TRACKER = "latest_checkpointed_iteration.txt"


class CheckpointError(ValueError):
    """A checkpoint or its tracker is missing, unreadable or does not fit this run."""


def _iter_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def _rank_file(directory: str, rank: int) -> str:
    return os.path.join(directory, f"rank_{rank:03d}.pt")


def save_checkpoint(
    root: str,
    iteration: int,
    state: dict,
    rank: int = 0,
    barrier: Callable[[], None] = lambda: None,
) -> str:
    """Save this rank's `state` as iteration `iteration` under `root`; a collective call:
    every rank calls it with the same `barrier`. Returns the checkpoint directory."""
    final = _iter_dir(root, iteration)
    tmp = final + ".tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    barrier()
    # Straight into the .tmp directory: it only becomes iter_N once every rank's file is
    # complete (the barrier below), so a rank file of its own needs no write-then-rename.
    torch.save(state, _rank_file(tmp, rank))
    barrier()
    if rank == 0:
        # A multi-rank commit (one name agreed on by all ranks, a barrier before the rename),
        # so not megatron.common.files.staged_paths, which is for a single writer.
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        tracker = os.path.join(root, TRACKER)
        for stale in leftover_temporaries(tracker):  # of a save killed mid-write
            os.unlink(stale)
        payload = str(iteration).encode()
        atomic_write(tracker, lambda stream: stream.write(payload))
    barrier()
    return final


def latest_iteration(root: str) -> int | None:
    """The iteration the tracker under `root` names, or None when there is no tracker."""
    tracker = os.path.join(root, TRACKER)
    if not os.path.exists(tracker):
        return None
    text = open(tracker).read().strip()
    if not text.isdigit():
        raise CheckpointError(f"{tracker}: expected an iteration number, found {text!r}")
    return int(text)


def load_checkpoint(root: str, rank: int = 0) -> tuple[int, dict] | None:
    """The latest checkpoint's state for `rank`, or None when `root` holds none."""
    iteration = latest_iteration(root)
    if iteration is None:
        return None
    path = _rank_file(_iter_dir(root, iteration), rank)
    if not os.path.exists(path):
        raise CheckpointError(f"{path}: missing (was the checkpoint saved with another world size?)")
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:  # a truncated or foreign file
        raise CheckpointError(f"{path}: unreadable checkpoint ({exc})") from None
    return iteration, state
