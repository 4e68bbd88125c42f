"""The cache directory for data derived once and shared by runs (dataset indices, the demo
corpus), and the file lock that lets concurrent processes build a cache entry only once."""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator


def default_cache_dir() -> str:
    """$MEGATRON_SYSX_CACHE, else ~/.cache/megatron-sysx."""
    return os.environ.get("MEGATRON_SYSX_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "megatron-sysx"
    )


@contextlib.contextmanager
def file_lock(path: str) -> Iterator[None]:
    """An exclusive advisory lock (fcntl.flock) on `path`, released on exit or process death."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
