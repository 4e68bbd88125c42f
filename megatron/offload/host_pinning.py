"""Page-locking the shared-memory segments on CUDA, so that prefetch copies out of them
run on the copy engine while compute proceeds.

A pageable source turns a "non-blocking" H2D copy into a staged, host-blocking one. Each
segment's mapping is registered with `cudaHostRegister` when it is created or attached and
unregistered before it is unmapped. Registration can fail (the locked-memory limit:
`ulimit -l`, a container's memlock); the copy then stays pageable and one warning names the
limit. Without CUDA nothing is registered.
"""

from __future__ import annotations

import resource
import warnings

import torch

_warned = False


def _cudart():
    return torch.cuda.cudart()


def register(address: int, nbytes: int) -> bool:
    """Page-lock [address, address + nbytes) for the GPU; False when not possible."""
    global _warned
    if not torch.cuda.is_available() or nbytes <= 0:
        return False
    error = _cudart().cudaHostRegister(address, nbytes, 0)
    if int(error) == 0:
        return True
    if not _warned:
        _warned = True
        soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        limit = "unlimited" if soft == resource.RLIM_INFINITY else f"{soft} bytes"
        warnings.warn(
            f"cudaHostRegister of a {nbytes}-byte shared-memory segment failed (error "
            f"{int(error)}); locked-memory limit (ulimit -l, container memlock): {limit}. "
            "Prefetches from shared memory stay pageable and block the host.",
            stacklevel=2)
    return False


def unregister(address: int) -> None:
    if torch.cuda.is_available():
        _cudart().cudaHostUnregister(address)
