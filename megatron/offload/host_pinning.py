"""Page-locking host memory on CUDA, so that copies to and from it run on the copy engine
while compute proceeds: the shared-memory segments (prefetch sources) and the device
layer's pinned buffers (the host gradients).

A pageable source turns a "non-blocking" H2D copy into a staged, host-blocking one. Each
segment's mapping is registered with `cudaHostRegister` when it is created or attached and
unregistered before it is unmapped. Registration can fail (the locked-memory limit:
`ulimit -l`, a container's memlock); the copy then stays pageable and one warning names the
limit. Without CUDA nothing is registered.

Pinned buffers (`pinned_empty`) are anonymous mappings of exactly their size, registered
the same way: torch's pinned allocator (`pin_memory=True`) rounds every request up to the
next power of two, up to twice the host memory a stage's gradients need.
"""

from __future__ import annotations

import ctypes
import mmap
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


class _PinnedMapping(mmap.mmap):
    """An anonymous mapping registered with CUDA; unregistered when the last tensor on it
    is gone (a tensor's storage holds its buffer), before it is unmapped."""

    address = 0

    def __del__(self) -> None:
        if self.address:
            unregister(self.address)


def pinned_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Page-locked host memory of exactly `numel` elements (rounded to whole pages);
    RuntimeError when CUDA refuses to lock it (the caller falls back to pageable memory)."""
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    mapping = _PinnedMapping(-1, max(nbytes, 1))
    address = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
    error = int(_cudart().cudaHostRegister(address, len(mapping), 0))
    if error != 0:
        raise RuntimeError(f"cudaHostRegister of {len(mapping)} bytes failed (error {error})")
    mapping.address = address
    return torch.frombuffer(mapping, dtype=dtype, count=numel)
