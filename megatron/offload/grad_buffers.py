"""Device gradient buffers lent to backward stages only while their backward runs.

A backward stage accumulates its parameter gradients over all micro-batches in one flat
device buffer; after its last micro-batch the buffer is offloaded to host memory and goes
back to the pool. The pool holds as many buffers as the schedule has backward stages in
flight at once on this rank (the validator counts them), plus one so that the next stage
can start while the previous one's D2H copy is still running: device memory for gradients
does not grow with the number of backward stages a rank owns.
"""

from __future__ import annotations

from collections import deque

import torch

from megatron.offload.device import DeviceLayer, Event


class GradientBuffers:
    def __init__(self, device: DeviceLayer, numel: int, dtype: torch.dtype, count: int) -> None:
        if count < 1 or numel < 1:
            raise ValueError(f"{count} gradient buffers of {numel} elements: expected >= 1 each")
        self.device = device
        self.numel = numel
        # (buffer, event after which it may be overwritten): the oldest release first.
        self._free: deque[tuple[torch.Tensor, Event | None]] = deque(
            (device.empty(numel, dtype, name=f"gradient buffer {i}"), None) for i in range(count))
        self.nbytes = sum(buffer.nbytes for buffer, _ in self._free)

    def acquire(self, numel: int) -> torch.Tensor:
        """A zeroed flat buffer of `numel` elements on the device."""
        if numel > self.numel:
            raise ValueError(f"a gradient buffer of {numel} elements; the pool's hold {self.numel}")
        if not self._free:
            raise RuntimeError("every gradient buffer is in use: more backward stages in flight "
                               "than the schedule's validator counted")
        buffer, freed = self._free.popleft()
        if freed is not None:  # stream-ordered reuse after the D2H copy out of it
            self.device.compute_stream.wait_event(freed)
        view = buffer[:numel]
        compute = self.device.compute_stream
        self.device.checks.kernel(compute, writes=(view,), what="zeroing a gradient buffer")
        with self.device.on(compute):
            view.zero_()
        return view

    def release(self, view: torch.Tensor, after: Event) -> None:
        """`view` may be reused once `after` (its offload copy) has completed."""
        base = view._base if view._base is not None else view
        self._free.append((base, after))
