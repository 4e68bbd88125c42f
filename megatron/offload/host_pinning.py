"""Page-locking host memory on CUDA, so that copies to and from it run on the copy engine
while compute proceeds: the shared-memory segments (prefetch sources) and the device
layer's pinned buffers (the host gradients); and what a run's page-locked memory needs of
the locked-memory limit.

A pageable source turns a "non-blocking" H2D copy into a staged, host-blocking one. Each
segment's mapping is registered with `cudaHostRegister` when it is created or attached and
unregistered before it is unmapped. Registration can fail (the locked-memory limit:
`ulimit -l`, a container's memlock); the copy then stays pageable and one warning names the
limit. Without CUDA nothing is registered.

Pinned buffers (`pinned_empty`) are anonymous mappings of exactly their size, registered
the same way: torch's pinned allocator (`pin_memory=True`) rounds every request up to the
next power of two, up to twice the host memory a stage's gradients need.

A process page-locks the segments it maps and its pooled gradient buffers
(host_memory.py). When that is more than its limit, what does not fit stays pageable for
the whole run: `memlock_shortfall` says so at start-up and in the run summary, with the
fix. The CPU device layer pins nothing, so no limit applies to it; a test stands one in
with MEGATRON_CPU_DEVICE_MEMLOCK (bytes), and the run goes down the same path as on CUDA.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import resource
import warnings
from dataclasses import dataclass

import torch

from megatron.common.units import BYTES_EXPECTED, format_bytes, parse_bytes
from megatron.config.errors import ConfigError

CPU_DEVICE_MEMLOCK_ENV = "MEGATRON_CPU_DEVICE_MEMLOCK"  # the CPU layer's stand-in for ulimit -l
FIX = "`ulimit -l unlimited` before the launch, or `docker run --ulimit memlock=-1`"

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


@dataclass(frozen=True)
class MemlockLimit:
    """How much a process may page-lock (None: unlimited) and what says so."""

    nbytes: int | None
    source: str


def memlock_limit(device_kind: str) -> MemlockLimit:
    """This process's locked-memory limit: on CUDA its soft `ulimit -l`; on the CPU device
    layer, which pins nothing, MEGATRON_CPU_DEVICE_MEMLOCK where a test stands one in
    (else unlimited)."""
    if device_kind != "cuda":
        text = os.environ.get(CPU_DEVICE_MEMLOCK_ENV, "").strip()
        if not text:
            return MemlockLimit(None, "the CPU device layer pins nothing")
        try:
            return MemlockLimit(parse_bytes(text), CPU_DEVICE_MEMLOCK_ENV)
        except ValueError:
            raise ConfigError(CPU_DEVICE_MEMLOCK_ENV, repr(text),
                              f"expected {BYTES_EXPECTED}: the CPU device layer's stand-in "
                              "for ulimit -l") from None
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return MemlockLimit(None if soft == resource.RLIM_INFINITY else soft, "ulimit -l")


@dataclass(frozen=True)
class PinningShortfall:
    """A process page-locks `pinned` bytes (the largest of the run's), `limit` allows less."""

    pinned: int
    limit: MemlockLimit

    @property
    def pageable(self) -> int:
        """What stays pageable at least: the part beyond the limit."""
        return self.pinned - (self.limit.nbytes or 0)

    def startup_line(self) -> str:
        return (f"pinned memory: a process of this run page-locks {format_bytes(self.pinned)} "
                f"(the shared-memory segments it maps and its gradient buffers), "
                f"{self.limit.source} allows {format_bytes(self.limit.nbytes or 0)}: at least "
                f"{format_bytes(self.pageable)} stays pageable for the whole run, and copies "
                "between it and the GPU are staged by the driver and block the host instead "
                f"of overlapping compute; raise the limit: {FIX}")

    def summary_line(self) -> str:
        return (f"  {'pinned:':<13}at least {format_bytes(self.pageable)} of "
                f"{format_bytes(self.pinned)} per process stayed pageable "
                f"({self.limit.source} {format_bytes(self.limit.nbytes or 0)}): slower "
                f"host-device copies; next time {FIX}")


def memlock_shortfall(pinned: int, limit: MemlockLimit) -> PinningShortfall | None:
    """What a process would page-lock beyond its limit, None when it fits."""
    if limit.nbytes is None or pinned <= limit.nbytes:
        return None
    return PinningShortfall(pinned, limit)
