"""The cache directory for data derived once and shared by runs (dataset indices, the demo
corpus), and the file lock that lets concurrent processes build a cache entry only once."""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator

from megatron.config.errors import ConfigError

# Megatron-LM's name of the flag (--data-cache-dir is this project's older spelling of it)
CACHE_FLAG = "--data-cache-path"


def default_cache_dir() -> str:
    """$MEGATRON_SYSX_CACHE, else ~/.cache/megatron-sysx."""
    return os.environ.get("MEGATRON_SYSX_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "megatron-sysx"
    )


@contextlib.contextmanager
def file_lock(path: str, cache_dir: str) -> Iterator[None]:
    """An exclusive advisory lock (fcntl.flock) on `path` under `cache_dir`, released on exit
    or process death. A cache this user cannot write (a read-only $MEGATRON_SYSX_CACHE or
    HOME, a file in the path) is bad input: one line naming the cache directory as given
    (not the entry under it) and how to choose another."""
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        handle = open(path, "a+")  # noqa: SIM115 - closed below
    except OSError as exc:
        raise ConfigError(CACHE_FLAG, cache_dir,
                          f"expected a cache directory this user can write ({exc.strerror}); "
                          f"give another with {CACHE_FLAG} or $MEGATRON_SYSX_CACHE"
                          ) from None
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
