"""Rank 0 of a run holds the lock of its --save directory (megatron/common/save_lock.py)
from before anything is allocated to the end; every rank stops together when it cannot.

Before each save the lock is checked again: a --save directory removed during the run
(by hand, by a cleanup script) would be recreated by the save, without its lock, and a
second job could take it. So the save re-takes the lock of the recreated directory and
says so, or, when another job holds it by then, every rank stops with one line (a fault
mid-run, exit status 1)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from megatron.common.save_lock import LockError, SaveLock, describe
from megatron.config.errors import ConfigError
from megatron.pipeline.host_group import host_group
from megatron.training.checkpointing import CheckpointWriteError

Log = Callable[[str], object]


class SaveDirectoryLost(CheckpointWriteError):
    """The --save directory was removed during the run and cannot be locked again (another
    job holds it now): the run stops before its next save, exit status 1."""


def hold_save_directory(directory: str | None, rank: int, world_size: int,
                        log: Log = print) -> SaveLock | None:
    """Rank 0 takes the lock of --save `directory`; every rank raises the same ConfigError
    when it cannot (one all-reduce on the host group), before anything is allocated."""
    if not directory:
        return None
    lock, error = None, None
    if rank == 0:
        lock = SaveLock(directory)
        try:
            previous = lock.acquire()
        except LockError as exc:
            error = ConfigError("--save", directory, exc.reason)
        else:
            if previous:
                log(f"--save {directory}: taking over the lock of a job that is gone "
                    f"({describe(previous)})")
    _raise_together(error, world_size,
                    ConfigError("--save", directory, "rank 0 cannot lock it (it says why)"))
    return lock


def keep_save_directory(lock: SaveLock | None, directory: str, rank: int, world_size: int,
                        warn: Log) -> None:
    """Before a save (collective): rank 0 checks that it still holds the directory's lock
    and re-takes it when the directory or its lock file went away, warning once; every
    rank raises SaveDirectoryLost when another job holds it now."""
    error = None
    if rank == 0 and lock is not None and not lock.held():
        try:
            lock.retake()
        except LockError as exc:
            error = SaveDirectoryLost(
                f"--save {directory}: the directory was removed during the run and cannot "
                f"be locked again: {exc.reason}; stopping without saving (the checkpoints "
                "saved before went with the directory)")
        else:
            warn(f"--save {directory}: the directory (or its lock) was removed during the "
                 "run; recreated it and took its lock again (the checkpoints saved before "
                 "went with it)")
    _raise_together(error, world_size, SaveDirectoryLost(
        f"--save {directory}: rank 0 cannot lock it again (it says why); stopping"))


def _raise_together(error: Exception | None, world_size: int, elsewhere: Exception) -> None:
    """Raise `error` on the rank that has one and `elsewhere` on the others (one all-reduce
    on the host group), so that every rank stops together."""
    if world_size > 1:
        flag = torch.tensor([1.0 if error else 0.0])
        dist.all_reduce(flag, group=host_group())
        if flag.item() and error is None:
            error = elsewhere
    if error is not None:
        raise error
