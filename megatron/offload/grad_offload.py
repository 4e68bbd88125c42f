"""Gradient offload: accumulated device gradients of a backward stage -> a host buffer.

Gradients accumulate in a flat device buffer over all micro-batches of a backward stage
(see layout.bind_gradients). `offload` then copies them on the D2H stream into a pooled
host buffer and returns a `GradientsReady` whose `wait()` is all the CPU optimizer task
needs to call before reading `host`.

Host dtype: fp32 upcasts on the device first and moves 4 bytes per value; the training
dtype moves 2 bytes and leaves the upcast to the CPU. The default is picked by
measurement (`default_grad_host_dtype`): on CUDA fp32, as Deep Optimizer States
(section 4.1) measured over PCIe; on the CPU device layer the training dtype, which
bench/offload.py measured faster there (the "device" upcast is CPU work as well, so
moving fewer bytes wins). See BENCHMARKS.md "Host memory tier".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron.offload.device import DeviceLayer, Event
from megatron.offload.host_memory import HostBufferPool
from megatron.schedules.instructions import BackwardStage


@dataclass
class GradientsReady:
    """Host gradients of one stage and the event of their D2H copy."""

    key: BackwardStage
    host: torch.Tensor
    event: Event
    _pool: HostBufferPool

    def wait(self) -> None:
        """Block until `host` holds the stage's gradients."""
        self.event.wait()

    def query(self) -> bool:
        return self.event.query()

    def release(self) -> None:
        """Give the host buffer back to the pool (after the optimizer has used it)."""
        self.event.wait()
        self._pool.release(self.host)


def default_grad_host_dtype(device: DeviceLayer, training_dtype: torch.dtype) -> torch.dtype:
    """The measured-faster host gradient dtype for this device (see the module docstring)."""
    return torch.float32 if device.kind == "cuda" else training_dtype


class GradientOffloader:
    """Copies flat device gradients to host buffers on the D2H stream.

    `host_dtype=None` picks `default_grad_host_dtype(device, training_dtype)`.
    """

    def __init__(
        self,
        device: DeviceLayer,
        pool: HostBufferPool,
        host_dtype: torch.dtype | None = None,
        training_dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        if host_dtype is None:
            host_dtype = default_grad_host_dtype(device, training_dtype)
        if host_dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"host_dtype={host_dtype}: expected float32, float16 or bfloat16")
        self.device = device
        self.pool = pool
        self.host_dtype = host_dtype
        self._upcast: torch.Tensor | None = None  # device scratch for the fp32 upcast
        self._upcast_free: Event | None = None  # the last D2H copy out of the scratch is done

    @property
    def scratch_nbytes(self) -> int:
        """Device memory of the upcast scratch (0 when gradients go to the host as they are)."""
        return 0 if self._upcast is None else self._upcast.nbytes

    def _device_source(self, grads: torch.Tensor) -> torch.Tensor:
        """The device tensor to copy: `grads`, or its upcast in a reused scratch buffer."""
        if grads.dtype == self.host_dtype:
            return grads
        if self._upcast is None or self._upcast.numel() < grads.numel():
            self._upcast = self.device.empty(grads.numel(), self.host_dtype)
            self._upcast_free = None
        if self._upcast_free is not None:
            self.device.compute_stream.wait_event(self._upcast_free)
        scratch = self._upcast[: grads.numel()]
        with self.device.on(self.device.compute_stream):
            scratch.copy_(grads)
        return scratch

    def offload(self, key: BackwardStage, grads: torch.Tensor) -> GradientsReady:
        """Queue the D2H copy of a stage's accumulated flat gradients (after compute)."""
        if grads.dim() != 1:
            raise ValueError(
                f"stage {key}: expected flat gradients, got shape {tuple(grads.shape)}"
            )
        source = self._device_source(grads)
        computed = self.device.compute_stream.record_event()
        host = self.pool.acquire(grads.numel(), self.host_dtype)
        stream = self.device.d2h_stream
        stream.wait_event(computed)
        event = self.device.copy_async(host, source, stream)
        if source is not grads:
            self._upcast_free = event
        return GradientsReady(key, host, event, self.pool)
