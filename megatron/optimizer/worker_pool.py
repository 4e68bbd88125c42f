"""The process's kernel threads: one persistent pool per (threads, cores) configuration.

Every CPUAdamW group and every gradient check of the process shares it, so a step never
starts a thread and concurrent group tasks never run more kernel threads than the pool
holds (the trainer sizes it to the cores left to each process, so it does not oversubscribe
the compute and copy threads). A forked child gets fresh pools: the parent's threads do not
exist there.
"""

from __future__ import annotations

import atexit
import os
import threading
from collections.abc import Sequence

from megatron.optimizer import _cpu_adam as _kernel  # built by `make setup`

WorkerPool = _kernel.WorkerPool

_lock = threading.Lock()
_pools: dict[tuple[int, tuple[int, ...]], WorkerPool] = {}
# Pools inherited through fork: their threads are gone, so they are never closed (closing
# would join threads that do not exist); kept referenced so no destructor runs either.
_orphans: list[WorkerPool] = []


def shared_pool(threads: int, cores: Sequence[int] = ()) -> WorkerPool:
    """The pool of `threads` kernel threads pinned to `cores` (none: unpinned), created on
    first use and shared afterwards. One thread without pinning runs in the caller."""
    if threads < 1:
        raise ValueError(f"threads={threads} must be >= 1")
    key = (int(threads), tuple(int(c) for c in cores))
    with _lock:
        pool = _pools.get(key)
        if pool is None:
            pool = _pools[key] = WorkerPool(threads=key[0], cores=list(key[1]))
        return pool


def close_pools() -> None:
    """Join every pool's threads (at exit; tests use it to check nothing is left)."""
    with _lock:
        pools = list(_pools.values())
        _pools.clear()
    for pool in pools:
        pool.close()


def _forget_after_fork() -> None:
    global _lock
    _lock = threading.Lock()
    _orphans.extend(_pools.values())
    _pools.clear()


atexit.register(close_pools)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)
