"""Room in the shared-memory file system: segment sizes and a clear error when it is full.

Checked before anything is created, so a too-small /dev/shm (Docker's 64 MiB default)
fails with the fix in the message instead of half-way through creating a store.
"""

from __future__ import annotations

import os

import torch

from megatron.offload.shm_header import HEADER_BYTES

DEFAULT_SHM_DIR = "/dev/shm"


class ShmSpaceError(MemoryError):
    """Not enough free space in the shared-memory file system."""


def free_bytes(shm_dir: str = DEFAULT_SHM_DIR) -> int:
    """Bytes an unprivileged process can still allocate in `shm_dir`."""
    st = os.statvfs(shm_dir)
    return st.f_bavail * st.f_frsize


def check_space(required_bytes: int, shm_dir: str = DEFAULT_SHM_DIR, what: str = "") -> None:
    """Fail before creating anything when `shm_dir` cannot hold `required_bytes`."""
    available = free_bytes(shm_dir)
    if required_bytes > available:
        raise ShmSpaceError(
            f"{shm_dir} has {available} bytes free but {what or 'the parameter store'} needs "
            f"{required_bytes} bytes; enlarge it (Docker: --shm-size, e.g. --shm-size="
            f"{-(-required_bytes // 2**30) + 1}g; a host: mount -o remount,size=... {shm_dir})"
        )


def segment_bytes(numel: int, dtype: torch.dtype) -> int:
    """File size of a segment holding `numel` elements of `dtype`, header included."""
    return HEADER_BYTES + numel * torch.empty((), dtype=dtype).element_size()
