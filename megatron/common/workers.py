"""Pure-Python work spread over forked processes that never outlive their parent.

The planner builds and simulates schedules, seconds of CPU each for the largest models;
a node has dozens of cores. Workers are forked (the parent's modules are already
imported), each asks the kernel to kill it when its parent dies (a killed planner leaves
no orphans), and the pool is shut down on success and on error alike.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager

_PR_SET_PDEATHSIG = 1


def cores_per_rank() -> int:
    """Cores this process may run on, shared by the node's local ranks (LOCAL_WORLD_SIZE)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    return max(1, (cores or 1) // local)


def _die_with_parent() -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the pool's own shutdown still applies
        pass


@contextmanager
def worker_pool(workers: int) -> Iterator[Callable[[Callable, Iterable], list]]:
    """A `map(function, items) -> list` over `workers` forked processes (in this process
    when `workers` is 1 or fork is unavailable); `function` must be a module-level one."""
    if workers <= 1 or "fork" not in multiprocessing.get_all_start_methods():
        yield lambda function, items: [function(item) for item in items]
        return
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"),
                               initializer=_die_with_parent)
    try:
        yield lambda function, items: list(pool.map(function, items))
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
