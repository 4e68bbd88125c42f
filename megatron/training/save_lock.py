"""Rank 0 of a run holds the lock of its --save directory (megatron/common/save_lock.py)
from before anything is allocated to the end; every rank stops together when it cannot."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from megatron.common.save_lock import LockError, SaveLock, describe
from megatron.config.errors import ConfigError
from megatron.pipeline.host_group import host_group


def hold_save_directory(directory: str | None, rank: int, world_size: int,
                        log: Callable[[str], object] = print) -> SaveLock | None:
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
    if world_size > 1:
        flag = torch.tensor([1.0 if error else 0.0])
        dist.all_reduce(flag, group=host_group())
        if flag.item() and error is None:
            error = ConfigError("--save", directory, "rank 0 cannot lock it (it says why)")
    if error is not None:
        raise error
    return lock
