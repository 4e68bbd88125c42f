"""Gradient offload: a backward stage's summed device gradients -> a host buffer.

Gradients are summed in a flat device buffer over all micro-batches of a backward stage,
in the main gradients' dtype (grad_buffers.py). `offload` then copies them on the D2H
stream into a pooled host buffer and returns a `GradientsReady` whose `wait()` is all the
CPU optimizer task needs to call before reading `host`.

Host dtype: the main gradients' (megatron.config.run.host_gradient_dtype, Megatron-LM's
rule: fp32 for a bf16 run unless --grad-reduce-in-bf16), the dtype they were summed in, so
the copy moves them as they are. An offload into a wider host dtype than the gradients'
(a caller's choice; the runtime never makes it) converts on the D2H stream, a chunk at a
time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron.config.run import host_gradient_dtype
from megatron.offload.device import DeviceLayer, Event
from megatron.offload.host_memory import HostBufferPool
from megatron.schedules.instructions import BackwardStage
from megatron.schedules.memory_model import UPCAST_CHUNK


@dataclass
class GradientsReady:
    """Host gradients of one stage and the event of their D2H copy."""

    key: BackwardStage
    host: torch.Tensor
    event: Event
    _pool: HostBufferPool

    _device: DeviceLayer | None = None

    def wait(self) -> None:
        """Block until `host` holds the stage's gradients: what the optimizer's task calls
        before it reads them (the sanitizer is told of that read here)."""
        self.event.wait()
        if self._device is not None:
            self._device.checks.host_read(self.host, what=f"the optimizer reads stage {self.key}'s "
                                                    "gradients")

    def query(self) -> bool:
        return self.event.query()

    def release(self) -> None:
        """Give the host buffer back to the pool (after the optimizer has used it). The
        pool hands it out again: the copy into it must be done, as this thread knows by
        its own wait (the sanitizer checks a free against that, not against what other
        threads waited for)."""
        self.event.wait()
        if self._device is not None:
            self._device.checks.host_free(self.host, what=f"stage {self.key}'s host gradients go "
                                                   "back to the pool")
        self._pool.release(self.host)


_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def default_grad_host_dtype(training_dtype: torch.dtype) -> torch.dtype:
    """The main gradients' dtype for `training_dtype` without Megatron-LM's flags (the rule
    is megatron.config.run.host_gradient_dtype's)."""
    name = {dtype: n for n, dtype in _DTYPES.items()}[training_dtype]
    return _DTYPES[host_gradient_dtype(name)]


class GradientOffloader:
    """Copies flat device gradients to host buffers on the D2H stream.

    `host_dtype=None` picks `default_grad_host_dtype(training_dtype)`. An upcast
    (16-bit gradients, fp32 host buffers) runs on the D2H stream too, `upcast_chunk`
    elements at a time through one device scratch of that size: each chunk is converted,
    then copied, and the stream's order frees the scratch for the next chunk, so the device
    holds a chunk, not a whole stage, and the compute stream never waits for it.
    """

    def __init__(
        self,
        device: DeviceLayer,
        pool: HostBufferPool,
        host_dtype: torch.dtype | None = None,
        training_dtype: torch.dtype = torch.bfloat16,
        upcast_chunk: int = UPCAST_CHUNK,
    ) -> None:
        if host_dtype is None:
            host_dtype = default_grad_host_dtype(training_dtype)
        if host_dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"host_dtype={host_dtype}: expected float32, float16 or bfloat16")
        self.device = device
        self.pool = pool
        self.host_dtype = host_dtype
        if upcast_chunk < 1:
            raise ValueError(f"upcast_chunk={upcast_chunk}: expected >= 1")
        self.upcast_chunk = upcast_chunk
        self._upcast: torch.Tensor | None = None  # device scratch, used on the D2H stream only

    @property
    def scratch_nbytes(self) -> int:
        """Device memory of the upcast scratch (0 when gradients go to the host as they are)."""
        return 0 if self._upcast is None else self._upcast.nbytes

    def _scratch(self) -> torch.Tensor:
        """The upcast scratch: one chunk, allocated once (never regrown, so no queued
        conversion can outlive the memory it writes)."""
        if self._upcast is None:
            self._upcast = self.device.empty(self.upcast_chunk, self.host_dtype,
                                             name="gradient upcast scratch")
        return self._upcast

    def offload(self, key: BackwardStage, grads: torch.Tensor) -> GradientsReady:
        """Queue the D2H copy of a stage's accumulated flat gradients (after compute)."""
        if grads.dim() != 1:
            raise ValueError(
                f"stage {key}: expected flat gradients, got shape {tuple(grads.shape)}"
            )
        computed = self.device.compute_stream.record_event()
        host = self.pool.acquire(grads.numel(), self.host_dtype)
        stream = self.device.d2h_stream
        stream.wait_event(computed)
        if grads.dtype == self.host_dtype:
            event = self.device.copy_async(host, grads, stream)
            return GradientsReady(key, host, event, self.pool, self.device)
        scratch = self._scratch()
        for lo in range(0, grads.numel(), self.upcast_chunk):
            hi = min(lo + self.upcast_chunk, grads.numel())
            part = scratch[:hi - lo]
            # the conversion: a kernel on the D2H stream, after the previous chunk's copy
            stream.submit(lambda part=part, lo=lo, hi=hi: part.copy_(grads[lo:hi]),
                          reads=(grads,), writes=(part,), what="gradient upcast")
            event = self.device.copy_async(host[lo:hi], part, stream)
        return GradientsReady(key, host, event, self.pool, self.device)
