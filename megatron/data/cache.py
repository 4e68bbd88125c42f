"""The cache directory for data derived once and shared by runs (dataset indices, the demo
corpus), and the file lock that lets concurrent processes build a cache entry only once."""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator

from megatron.config.errors import ConfigError


def default_cache_dir() -> str:
    """$MEGATRON_SYSX_CACHE, else ~/.cache/megatron-sysx."""
    return os.environ.get("MEGATRON_SYSX_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "megatron-sysx"
    )


@contextlib.contextmanager
def file_lock(path: str) -> Iterator[None]:
    """An exclusive advisory lock (fcntl.flock) on `path`, released on exit or process death.
    A cache this user cannot write (a read-only $MEGATRON_SYSX_CACHE or HOME) is bad input:
    one line naming the directory and how to choose another."""
    directory = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(directory, exist_ok=True)
        handle = open(path, "a+")  # noqa: SIM115 - closed below
    except OSError as exc:
        raise ConfigError("--data-cache-dir", directory,
                          f"expected a cache directory this user can write ({exc.strerror}); "
                          "give another with --data-cache-dir or $MEGATRON_SYSX_CACHE"
                          ) from None
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
