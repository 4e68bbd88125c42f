"""Bounded, reused pools of (pinned) host buffers.

Pinning is slow and page-locked memory is a scarce, process-wide resource (the memlock
limit, container limits): pinned-memory failures and host OOM are among the most
reported problems of DeepSpeed's offload. So buffers are pinned once, kept in a pool of
bounded size and reused; when pinning fails the pool falls back to pageable memory and
says so once.
"""

from __future__ import annotations

import resource
import threading
import warnings
from collections.abc import Callable

import torch

from megatron.offload.device import DeviceLayer

PinFn = Callable[[int, torch.dtype], torch.Tensor]

_warned_pin_failure = False
_warn_lock = threading.Lock()


def _memlock_limit_text() -> str:
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return "unlimited" if soft == resource.RLIM_INFINITY else f"{soft} bytes"


def _warn_pin_failure_once(nbytes: int, error: BaseException) -> None:
    global _warned_pin_failure
    with _warn_lock:
        if _warned_pin_failure:
            return
        _warned_pin_failure = True
    warnings.warn(
        f"pinning {nbytes} bytes of host memory failed ({error}); memlock limit is "
        f"{_memlock_limit_text()}. Falling back to pageable host memory: copies will be "
        "slower. Raise the limit (ulimit -l unlimited, Docker --ulimit memlock=-1) to pin.",
        RuntimeWarning,
        stacklevel=3,
    )


class HostBufferPool:
    """Flat host buffers keyed by (numel, dtype), pinned where the device pins.

    `capacity_bytes` bounds everything the pool allocates; `acquire` reuses a released
    buffer of the same shape before allocating, and fails clearly past the bound.
    """

    def __init__(
        self, device: DeviceLayer, capacity_bytes: int, pin_fn: PinFn | None = None
    ) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes={capacity_bytes}: expected a positive size")
        self.capacity_bytes = capacity_bytes
        self._pin = pin_fn if pin_fn is not None else device.pin_host
        self._device = device
        self._try_pin = device.pins_memory or pin_fn is not None
        self._free: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
        self._allocated_bytes = 0
        self._in_use: dict[int, torch.Tensor] = {}
        self._lock = threading.Lock()
        self.pinned = self._try_pin

    @property
    def allocated_bytes(self) -> int:
        """Bytes of the buffers the pool holds now (in use or free for reuse)."""
        return self._allocated_bytes

    def buffers(self) -> list[torch.Tensor]:
        """Every buffer the pool holds now, in use or free (for measurements)."""
        with self._lock:
            return [*self._in_use.values(), *(b for bufs in self._free.values() for b in bufs)]

    @property
    def in_use(self) -> int:
        return len(self._in_use)

    def acquire(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        key = (numel, dtype)
        with self._lock:
            free = self._free.get(key)
            if free:
                buf = free.pop()
                self._in_use[buf.data_ptr()] = buf
                return buf
            nbytes = numel * torch.empty((), dtype=dtype).element_size()
            if self._allocated_bytes + nbytes > self.capacity_bytes:
                raise MemoryError(
                    f"host buffer pool exhausted: capacity_bytes={self.capacity_bytes}, "
                    f"{self._allocated_bytes} allocated ({len(self._in_use)} buffers in use), "
                    f"{nbytes} more requested; release buffers or raise the capacity"
                )
            buf = self._allocate(numel, dtype, nbytes)
            self._allocated_bytes += nbytes
            self._in_use[buf.data_ptr()] = buf
            return buf

    def _allocate(self, numel: int, dtype: torch.dtype, nbytes: int) -> torch.Tensor:
        if self._try_pin:
            try:
                return self._pin(numel, dtype)
            except (RuntimeError, MemoryError, OSError) as exc:
                self._try_pin = False
                self.pinned = False
                _warn_pin_failure_once(nbytes, exc)
        if not self._device.pins_memory:  # the CPU layer's host memory: its sanitizer tracks it
            return self._device.pin_host(numel, dtype, name="pooled host buffer")
        return torch.empty(numel, dtype=dtype)

    def release(self, buf: torch.Tensor) -> None:
        with self._lock:
            if self._in_use.pop(buf.data_ptr(), None) is None:
                raise ValueError("release of a buffer that this pool did not hand out")
            self._free.setdefault((buf.numel(), buf.dtype), []).append(buf)

    def clear(self) -> None:
        """Drop the free buffers (buffers still in use stay counted)."""
        with self._lock:
            for (numel, dtype), bufs in self._free.items():
                self._allocated_bytes -= (
                    len(bufs) * numel * torch.empty((), dtype=dtype).element_size()
                )
            self._free.clear()
